# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 07 · Scheduling and preemption
#
# **Why this chapter.** Paging lets a server admit requests as long as there are free blocks,
# without reserving room for outputs whose length nobody knows. The other side of that bet: the
# running requests keep growing, one token per step, and sooner or later the pool is full while
# they all still want more (the paper's section 4.5). Chapter 06 showed it happen. This chapter
# answers what the scheduler should do then -- whom to stop, what to do with their blocks, whom
# to let in next -- and what each answer costs, in the numbers an operator watches.
#
# **What you will learn**
#
# - what the scheduler does when the block pool runs out: it *preempts* the youngest running
#   request, either by **recompute** (free its blocks, prefill it again later) or by **swap**
#   (copy its blocks to a CPU pool and back);
# - what each costs: recompute pays in extra prefill tokens, swap in blocks copied, and both
#   in time, measured here step by step (`StepStats.step_time`, `forward_time`,
#   `bookkeeping_time`);
# - the paper's scheduling policy by name (section 4.5) -- first-come-first-served, all-or-nothing
#   eviction, gang scheduling of a request's samples, no admissions while a request is swapped
#   out -- each read back from a recording of a real run;
# - **chunked prefill**: a long prompt fed a chunk per step next to the running requests'
#   decodes, and what it does to their inter-token latency;
# - the numbers a vLLM operator watches -- KV usage %, the minimum of free blocks, preemptions,
#   time to first token (TTFT) and inter-token latency (ITL) -- and how they move with the pool
#   size;
# - that cancelling a request (`engine.abort_request`) returns its blocks at once;
# - and at the end, three questions to check yourself: predict, then let the run check you.
#
# **What you need.** A CPU is enough: everything here runs the offline tiny models in well
# under a minute. The *counts* (preemptions, blocks swapped, tokens recomputed) do not depend on the
# machine. The *times* do: on a CPU with a 2-layer random model a step takes a millisecond or
# two, other programs on the machine add noise, and "swap" copies between two tensors
# in the same RAM. On a GPU with GPT-2 (`env.gpt2` is then the real model) the forward pass
# dominates and a swap crosses the PCIe bus, so rerun the chapter there before trusting any
# time ratio.

# %%
from pagedlearn.cli.notebook import setup

env = setup()

# %% [markdown]
# ## A workload that does not fit
#
# We reuse the project's mixed batch (`pagedlearn.cli.demo.requests()`, what `make demo` serves):
# two chats that share a system prompt, a short and a long prompt, `n=3` sampling and a beam
# search (we leave out its "cancel" request; cancelling comes at the end). Every request has
# `ignore_eos=True`, so its length -- and the memory pressure -- is the same on every run.
#
# How many blocks does each request need at most, alone? Its prompt plus `max_tokens`, rounded
# up to blocks, times its number of sequences (forked samples and beams share their prompt
# blocks, so this overestimates a little). The sum is what would let all of them run at once
# without ever preempting; the largest is about the smallest pool that can serve them at all.

# %%
import statistics

from pagedlearn import LLM
from pagedlearn.cli import chapters
from pagedlearn.cli.demo import requests
from pagedlearn.models import load

BLOCK_SIZE = 8
REPEATS = 3 if env.quick else 5  # each time is the fastest of this many runs
if chapters.checking():  # CI checks that the timed sections run, not how fast: one run each
    REPEATS = 1

loaded = load(env.gpt2)  # loaded once, served by every LLM below
workload = [r for r in requests() if r[0] != "cancel"]
prompts = [prompt for _, prompt, _ in workload]
params = [p for _, _, p in workload]

need = {}
for name, prompt, p in workload:
    n_prompt = len(loaded.tokenizer.encode(prompt))
    need[name] = p.n * -(-(n_prompt + p.max_tokens) // BLOCK_SIZE)
    print(f"{name:<7} prompt {n_prompt:>4} tokens, max_tokens {p.max_tokens:>3}, "
          f"sequences {p.n} -> at most {need[name]:>3} blocks of {BLOCK_SIZE}")  # fmt: skip
ALL_FIT, ONE_FITS = sum(need.values()), max(need.values())
print(f"\nall at once: {ALL_FIT} blocks; the largest alone: {ONE_FITS} blocks")

# %% [markdown]
# `serve` runs the workload once on a fresh engine and keeps the `StepStats` the engine
# publishes after every step (`engine.subscribe_stats`). `measure` turns one run into the
# operator's numbers. `LLM.generate` takes the mixed list of `SamplingParams` and
# `BeamSearchParams` and batches everything together -- continuous batching does the rest.


# %%
def serve(num_blocks, mode="recompute", swap_blocks=None, record=False):
    """One run of the workload: (per-step stats, outputs, event log or None)."""
    llm = LLM(loaded, block_size=BLOCK_SIZE, num_blocks=num_blocks, preemption_mode=mode,
              swap_blocks=swap_blocks, verbose=False)  # fmt: skip
    steps = []
    llm.engine.subscribe_stats(steps.append)
    log = llm.engine.record() if record else None
    outs = llm.generate(prompts, params, use_tqdm=False)
    return steps, outs, log


def measure(steps, outs):
    """The numbers one run gives: counts from the last step, times summed over steps (ms)."""
    last, ms = steps[-1], 1000.0
    # What a step spends outside the forward pass and the bookkeeping: the KV slab's block
    # copies (swap out, swap in, copy-on-write), done between scheduling and the forward.
    copies = sum(s.step_time - s.forward_time - s.bookkeeping_time for s in steps)
    return {
        "steps": last.step,
        "tokens computed": sum(s.num_batched_tokens for s in steps),
        "prefix hits": last.prefix_hit_tokens,  # prompt tokens found in the prefix cache
        "preemptions": last.preemptions_recompute + last.preemptions_swap,
        "blocks out": last.swap_out_blocks,
        "blocks in": last.swap_in_blocks,
        "peak usage %": max(s.usage for s in steps),
        "mean usage %": statistics.mean(s.usage for s in steps),
        "min free": min(s.free_blocks for s in steps),
        "step ms": ms * sum(s.step_time for s in steps),
        "forward ms": ms * sum(s.forward_time for s in steps),
        "bookkeeping ms": ms * sum(s.bookkeeping_time for s in steps),
        "block copies ms": ms * copies,
        "mean TTFT ms": ms * statistics.mean(o.metrics.ttft for o in outs),
        "mean ITL ms": ms * statistics.mean(o.metrics.mean_itl for o in outs),
    }


def best_run(num_blocks, mode="recompute"):
    """``measure`` of REPEATS runs, each number the smallest. The counts are the same in every
    run (greedy or seeded sampling); the times are not, and other programs only ever add time."""
    runs = [measure(*serve(num_blocks, mode)[:2]) for _ in range(REPEATS)]
    return {k: min(r[k] for r in runs) for k in runs[0]}


serve(ALL_FIT)  # a warm-up run: the first forward passes pay one-time costs
print("ready")

# %% [markdown]
# ## Recompute or swap?
#
# The same workload on a pool of a bit more than half of what it needs at once, first with
# `preemption_mode="recompute"`, then `"swap"` (with a CPU swap pool as big as the device pool,
# the default). When a running request needs a new block and none is free, the scheduler takes
# blocks from the **most recently arrived** running request (section 4.5 of the paper):
#
# - **recompute** frees that request's blocks and puts it back in the *waiting* queue with the
#   tokens it has generated; when it is readmitted, it prefills prompt + generated tokens again.
#   With prefix caching, its full blocks may still be in the cache then, and cost nothing;
# - **swap** copies its blocks to the CPU pool (`swap_out`) and puts it in the *swapped* queue;
#   swapped requests come back first, when blocks are free again (`swap_in`).

# %% tags=["timing"]
SMALL = max(ONE_FITS + 1, round(0.55 * ALL_FIT))
ample = best_run(ALL_FIT + BLOCK_SIZE)  # the reference: nothing is ever preempted
rows = {"ample pool": ample}
rows |= {mode: best_run(SMALL, mode) for mode in ("recompute", "swap")}

print(f"pool of {SMALL} blocks (the workload needs {ALL_FIT} at once); best of {REPEATS} "
      f"runs on {env.device}, model {loaded.name}\n")  # fmt: skip
print(f"{'':<18}" + "".join(f"{k:>12}" for k in rows))
for key in ample:
    print(f"{key:<18}" + "".join(f"{r[key]:>12.1f}" for r in rows.values()))

# %% [markdown]
# Read the table column by column. The counts are the same on every machine:
#
# - both modes preempt; the **recompute** run computes more tokens than the ample pool (its
#   preempted requests prefill again), the **swap** run computes exactly as many but moves
#   blocks out and back in;
# - the recompute run also has more `prefix hits`: a preempted request that comes back finds
#   some of its own full blocks still in the prefix cache (freed, but not yet evicted) and does
#   not compute them again;
# - the pool is full at times (`peak usage %`, `min free`) in both, and both need more steps
#   than the ample pool: fewer requests run side by side.
#
# The costs, in units that do not depend on the machine, and then in time:

# %% tags=["timing"]
from pagedlearn.models.runner import kv_cache_spec

bytes_per_block = BLOCK_SIZE * kv_cache_spec(loaded.model).bytes_per_token
extra = rows["recompute"]["tokens computed"] - ample["tokens computed"]
moved = rows["swap"]["blocks out"] + rows["swap"]["blocks in"]
reused = rows["recompute"]["prefix hits"] - ample["prefix hits"]
more = 100 * extra / ample["tokens computed"]
print(f"recompute: {extra:.0f} extra prefill tokens ({more:.0f}% more through the model), while "
      f"{reused:.0f} more prompt tokens than with the ample pool came from the prefix cache "
      "(mostly the preempted requests' own blocks)")  # fmt: skip
print(f"swap:      {moved:.0f} block copies x {bytes_per_block:,} B = "
      f"{moved * bytes_per_block / 2**10:,.0f} KiB copied to the swap pool and back")  # fmt: skip
for mode in ("recompute", "swap"):
    r = rows[mode]
    print(f"{mode:<9}  step time {r['step ms']:6.1f} ms = forward {r['forward ms']:6.1f} + "
          f"bookkeeping {r['bookkeeping ms']:5.1f} + block copies {r['block copies ms']:4.1f} "
          f"(ample pool: {ample['step ms']:.1f} ms)")  # fmt: skip

# %% [markdown]
# What do these times say? Without a GPU, honestly, not much about GPUs: they are **CPU,
# tiny-model numbers** (a step of a 2-layer random model takes a millisecond or two, and a swap is
# a copy inside the same RAM), and even the best of a few runs moves by tens of percent from
# one run to the next on a busy machine. What carries over is the *shape* of the cost:
#
# - recompute spends **forward time** (more tokens through the model) and nothing else;
# - swap spends **block-copy time** (on a GPU: bytes over the PCIe link), which grows with
#   the blocks moved, plus the block manager's bookkeeping for each block.
#
# The paper (section 7.3, Figure 19) measured both on OPT-13B: swapping is slow for small
# blocks (many small PCIe transfers), recomputation costs the same whatever the block size, and
# for the usual block sizes 16-64 the two are comparable. vLLM's current engine preempts by
# recomputation only, and pagedlearn's default is recompute too. Prefix caching makes
# recomputation cheaper still: the `prefix hits` above are tokens it did not compute again.

# %% [markdown]
# ## Who runs, who waits: the policy of section 4.5, by name
#
# The paper's section 4.5 sets four rules, and `pagedlearn/engine/scheduler.py` implements them
# (its docstring says where), as vLLM's V0 scheduler did:
#
# 1. **First-come, first-served (FCFS).** Requests are served in arrival order: the waiting
#    queue is admitted from its front, and when blocks run out, the *latest* arrival among the
#    running requests is preempted first. Every queue is kept in arrival order.
# 2. **All-or-nothing eviction.** Attention reads every block of a sequence at every step, so
#    evicting some of its blocks gains nothing: a preempted sequence gives up all its blocks
#    (freed, or swapped to the CPU pool), never part of them.
# 3. **Gang scheduling of a sequence group.** The sequences of one request -- the `n` samples
#    of parallel sampling, the beams of a beam search -- share blocks, so they form one
#    *sequence group*, scheduled as a unit: they run, are preempted and come back together.
# 4. **Preempted requests come back first.** The paper says it for swapping: once vLLM has
#    preempted sequences and evicted their blocks, it accepts no new requests until the
#    preempted ones are done. The scheduler (like vLLM V0's) admits nothing from the waiting
#    queue while any request is still swapped out, and swaps requests back in, in arrival order,
#    before anyone waiting is admitted. With recompute, a preempted request goes back into the
#    waiting queue at its arrival position, so FCFS alone brings it back first.
#
# We read all four off one run: the workload in the pool of `SMALL` blocks with swap, recorded.
# `queue_changes` (in `pagedlearn.engine.queue_changes`) turns the recording's step events back
# into the scheduler's decisions: for each step, who was admitted, swapped in, preempted or
# finished, and the queues after it. The steps where something moved:

# %%
from pagedlearn.engine.queue_changes import queue_changes
from pagedlearn.viz import replay_states

engine = LLM(loaded, block_size=BLOCK_SIZE, num_blocks=SMALL, preemption_mode="swap",
             verbose=False).engine  # fmt: skip
policy_log = engine.record()
for name, prompt, p in workload:  # all six arrive at once, in this order
    engine.add_request(name, prompt, p)
while engine.has_unfinished_requests():
    engine.step()

changes = queue_changes(policy_log)  # one per step
infos = [e.info for e in policy_log.events if e.kind == "step"]  # the engine's record per step
states = [state for _, state in replay_states(policy_log)]  # the pool after each step


def names(ids):
    return " ".join(ids) or "-"


print(f"{'step':>4}  {'what happened':<40}{'running':<34}{'swapped':<12}{'waiting':<8}free")
for c, info in zip(changes, infos, strict=True):
    moves = ("swap in", c.swapped_in), ("admit", c.admitted), ("preempt", c.preempted)
    what = [f"{verb} {names(ids)}" for verb, ids in (*moves, ("finish", c.finished)) if ids]
    if what:
        print(f"{c.step:>4}  {'; '.join(what):<40}{names(c.running):<34}{names(c.swapped):<12}"
              f"{names(c.waiting):<8}{info['stats']['free_blocks']:>4}")  # fmt: skip

print("\nthe block tables of n=3's three sequences, each time they move:")
step = 1  # a step's block events come before the step event that closes it
for e in policy_log.events:
    if e.kind == "step":
        step += 1
    elif e.kind in ("swap_out", "swap_in") and str(e.seqs[0]).startswith("n=3."):
        gpu, cpu = list(e.blocks), list(e.info["cpu_blocks"])
        move = f"GPU {gpu} -> CPU {cpu}" if e.kind == "swap_out" else f"CPU {cpu} -> GPU {gpu}"
        print(f"{step:>4}  {e.kind:<9}{e.seqs[0]}: {move}")

# The four rules, checked on this run.
arrival = [name for name, _, _ in workload]
assert list(dict.fromkeys(r for c in changes for r in c.admitted)) == arrival  # 1: FCFS
for i, c in enumerate(changes):
    for victim in c.preempted:  # 1: the latest arrival among the running goes first
        assert all(arrival.index(victim) > arrival.index(r) for r in c.running)
        group = next(r["seqs"] for r in infos[i - 1]["requests"] if r["id"] == victim)
        assert all(s not in states[i].tables and s in states[i].swapped for s in group)  # 2, 3
    assert not (c.admitted and c.swapped)  # 4: nobody admitted while a request is swapped out
print("\nchecked: FCFS admissions and preemptions, all-or-nothing, gang, swapped first")

# %% [markdown]
# What to look for (the steps are those of this run; another model gives other steps, the same
# rules):
#
# - **FCFS.** The first step admits requests in arrival order until the next one does not fit;
#   the rest wait, and no one is ever admitted ahead of an earlier arrival. Each preemption
#   takes the latest arrival among the requests still *running* -- not necessarily the latest
#   arrival overall, which may already be waiting or swapped out.
# - **All-or-nothing, gang.** `n=3`'s three sequences leave in the same step with all their
#   blocks, and come back together. The blocks they share are copied once: the three CPU
#   tables point at the same CPU blocks, and after the swap-in the three tables point at the
#   same new GPU blocks again -- whichever blocks were free then, not the old ones (paging: a
#   request's data can live in any block).
# - **Swapped first.** Look for steps where many blocks are free and still nobody moves: the
#   request at the front of the swapped queue needs more blocks than that to come back, the one
#   behind it waits its turn (FCFS), and nobody waiting is admitted while anyone is swapped out
#   -- even a request whose prompt would fit. When enough blocks come free, the swapped
#   requests come back and then the waiting ones are admitted, in one step, in arrival order.
#
# Strict FCFS has a price too: a request that fits may wait behind one that does not (the
# paper chose it for fairness and to prevent starvation).
#
# ## Chunked prefill: a long prompt beside the decodes
#
# A prompt is prefilled in one forward pass over all its tokens; a running request decodes one
# token per step. When a long prompt arrives, the step that prefills it is as long as that
# prefill, and every running request waits that long for its next token: a spike in its
# inter-token latency (ITL). **Chunked prefill** feeds the prompt a chunk per step instead, next
# to the decodes, under a per-step token budget (`max_num_batched_tokens`): decodes come first,
# one token per running sequence, and the prompt gets what the budget has left. It is not in
# the paper: it came later (Sarathi, Agrawal et al. 2023), vLLM adopted it, and vLLM's current
# engine chunks prefills by default -- as pagedlearn's scheduler does (`enable_chunked_prefill`,
# on by default; the default budget is large, 2048 tokens, so the prompts in this chapter never
# needed chunks).
#
# Below: `chat-1`, `chat-2` and `n=3` decode (5 sequences), and `long` arrives after step 2.
# Once with a budget of 64 tokens, once without chunking (the whole prompt in one step). Each
# step's time is the fastest of `REPEATS` runs.

# %% tags=["timing"]
from itertools import pairwise

BUDGET = 64  # max_num_batched_tokens of the chunked run
ARRIVES = 2  # `long` arrives after this step
DECODERS = ("chat-1", "chat-2", "n=3")
by_name = {name: (prompt, p) for name, prompt, p in workload}
n_long = len(loaded.tokenizer.encode(by_name["long"][0]))
decoding = sum(by_name[name][1].n for name in DECODERS)  # sequences: one token each per step


def long_beside_decodes(chunked, num_steps=10):
    """``long`` arriving while DECODERS decode. Returns, for the ``num_steps`` steps from its
    arrival on: their StepStats, ``long``'s tokens in the cache after each, and the longest gap
    between two tokens of a decoding request (seconds)."""
    budget = dict(max_num_batched_tokens=BUDGET, max_num_seqs=8) if chunked else {}
    engine = LLM(loaded, block_size=BLOCK_SIZE, num_blocks=ALL_FIT + BLOCK_SIZE,
                 enable_chunked_prefill=chunked, verbose=False, **budget).engine  # fmt: skip
    steps, in_cache, metrics = [], [], {}
    engine.subscribe_stats(steps.append)
    for name in DECODERS:
        engine.add_request(name, *by_name[name])
    while engine.num_steps < ARRIVES + num_steps:
        if engine.num_steps == ARRIVES:
            engine.add_request("long", *by_name["long"])
        metrics |= {out.request_id: out.metrics for out in engine.step()}
        in_cache.append(engine.kv.num_tokens("long.0") if "long.0" in engine.kv else 0)
    arrived = engine.requests["long"].metrics.arrival_time
    gaps = [b - a for n in DECODERS for a, b in pairwise(metrics[n].token_times) if b > arrived]
    return steps[ARRIVES:], in_cache[ARRIVES:], max(gaps)


def fastest(chunked):
    """One run's counts (every run has the same); each step's time and the longest gap, the
    smallest of REPEATS runs (other programs only ever add time)."""
    runs = [long_beside_decodes(chunked) for _ in range(REPEATS)]
    steps, in_cache, _ = runs[0]
    return {
        "steps": steps,
        "long K/V": in_cache,
        "step ms": [1000 * min(run[0][i].step_time for run in runs) for i in range(len(steps))],
        # the step that completes long's prompt also samples its first token
        "first token": next(s.step for s, n in zip(steps, in_cache, strict=True) if n >= n_long),
        "max ITL ms": 1000 * min(run[2] for run in runs),
    }


chunk, whole = fastest(True), fastest(False)
for run in (chunk, whole):  # decodes come first: every running sequence, every step
    assert all(s.num_decode_seqs >= decoding for s in run["steps"])
assert all(s.num_batched_tokens <= BUDGET for s in chunk["steps"])

print(f"long: {n_long} prompt tokens, arriving after step {ARRIVES}; {decoding} sequences "
      f"decoding ({', '.join(DECODERS)}); {loaded.name} on {env.device}\n")  # fmt: skip
print(f"{'':>4}  {f'chunked, max_num_batched_tokens={BUDGET}':^36}    "
      f"{'no chunking: the whole prompt in one step':^36}")  # fmt: skip
columns = f"{'tokens':>8}{'decodes':>9}{'long K/V':>10}{'step ms':>9}    "
print(f"{'step':>4}  {columns}{columns}")
for i, s in enumerate(chunk["steps"]):
    row = [f"{r['steps'][i].num_batched_tokens:>8}{r['steps'][i].num_decode_seqs:>9}"
           f"{r['long K/V'][i]:>10}{r['step ms'][i]:>9.2f}" for r in (chunk, whole)]  # fmt: skip
    print(f"{s.step:>4}  {'    '.join(row)}")
print(f"\nlong's prompt: {chunk['first token'] - ARRIVES} steps of at most {BUDGET - decoding} "
      f"tokens (first token at step {chunk['first token']}), or 1 step without chunking (first "
      f"token at step {whole['first token']})")  # fmt: skip
print(f"longest step once long arrived: {max(chunk['step ms']):.2f} ms chunked, "
      f"{max(whole['step ms']):.2f} ms without")  # fmt: skip
print(f"longest gap between two tokens of a decoding request (max ITL), fastest of {REPEATS}: "
      f"{chunk['max ITL ms']:.2f} ms chunked, {whole['max ITL ms']:.2f} ms without")  # fmt: skip

# %% [markdown]
# What to look for. The token columns are the same on every machine. With chunking, no step
# computes more than 64 tokens: each running sequence gets its token first, `long`'s prompt
# gets the other 59, and it goes in over several steps (`long K/V` grows by 59 a step). Without
# chunking, one step computes all its prompt tokens next to the 5 decodes. Chunking costs the
# long request a few steps of time to first token; the same tokens are computed, spread out.
#
# The times are this machine's. Compare the step that holds the whole prompt with the chunked
# steps, and the longest gap between two tokens of a decoding request: a step is as long as its
# forward pass, and the forward grows with the tokens in it once there are enough of them, so
# bounding the tokens per step bounds how long a running request can wait for its next token.
# On a GPU with a large model, a prefill of thousands of tokens takes many times a decode step,
# and chunking is what keeps a long prompt from freezing everyone's stream. On this CPU with a
# 2-layer random model the difference may be small and run-to-run noise large: look at the
# numbers, rerun the cell, and do not read more into them than they show. (vLLM's older
# scheduler without chunking went further: by its documentation, it ran prefills in steps of
# their own, without the decodes; pagedlearn packs them into one step either way.)

# %% [markdown]
# ## What an operator watches, as the pool grows
#
# A serving dashboard (vLLM's `/metrics`) shows, among others: **KV cache usage** (% of blocks
# in use), the **number of preemptions**, **time to first token** (TTFT: arrival until the first
# token; queueing included) and **inter-token latency** (ITL: the gap between two tokens of one
# request). Here is the same workload over a range of pool sizes, from the smallest that can
# serve the largest request alone to more than everything needs at once -- all computed now.

# %% tags=["timing"]
sizes = sorted(
    {round(ONE_FITS + 1 + i * (ALL_FIT + BLOCK_SIZE - ONE_FITS - 1) / 5) for i in range(6)}
)
sweep = {n: best_run(n) for n in sizes}
keys = ["steps", "preemptions", "peak usage %", "mean usage %", "min free", "mean TTFT ms",
        "mean ITL ms", "step ms"]  # fmt: skip
print(f"{'num_blocks':>10}" + "".join(f"{k:>14}" for k in keys))
for n, r in sweep.items():
    print(f"{n:>10}" + "".join(f"{r[k]:>14.1f}" for k in keys))
calm = min(n for n in sizes if all(sweep[m]["preemptions"] == 0 for m in sizes if m >= n))
print(f"\nno preemption from {calm} blocks on: {100 * calm / ALL_FIT:.0f}% of the {ALL_FIT} "
      "blocks the requests would need if they all ran at once to the end")  # fmt: skip

# %% [markdown]
# The same numbers as a figure (drawn here from the `sweep` dictionary just computed):

# %% tags=["timing"]
from IPython.display import display
from matplotlib.figure import Figure

OKABE_ITO = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7"]
fig = Figure(figsize=(11, 4), layout="constrained")
left, mid, right = fig.subplots(1, 3)
x = list(sweep)
for ax, series, ylabel in (
    (left, [("preemptions", "o"), ("min free", "s")], "count"),
    (mid, [("steps", "o"), ("peak usage %", "s")], "steps / %"),
    (right, [("mean TTFT ms", "o"), ("mean ITL ms", "s")], "ms (CPU, tiny model)"),
):
    for i, (key, marker) in enumerate(series):
        color = OKABE_ITO[i + 2 * (ax is right)]
        ax.plot(x, [sweep[n][key] for n in x], marker=marker, color=color, label=key)
    ax.axvline(ALL_FIT, color="#000000", linestyle=":", label="all fit at once")
    ax.set_xlabel("num_blocks (pool size)", fontsize=11)
    ax.set_ylabel(ylabel, fontsize=11)
    ax.tick_params(labelsize=10)
    ax.legend(fontsize=10)
fig.suptitle(f"One workload, pools of {x[0]}-{x[-1]} blocks of {BLOCK_SIZE} tokens "
             f"({loaded.name}, {env.device}, best of {REPEATS})", fontsize=12)  # fmt: skip
display(fig)

# %% [markdown]
# How to read it. A small pool runs hot: its peak usage is near 100% and its free-block
# minimum near 0, requests are preempted, and the whole workload takes more steps, because fewer
# requests run side by side (smaller batches). Latency follows; these are times, so look at the
# columns rather than trust a sentence. TTFT should grow the most in small pools, since late
# requests queue behind a full pool. ITL should move less, and not always up: a running request
# gets one token per step whatever the pool, so its ITL is the step's duration, and smaller
# batches make shorter steps; but a preempted request's time in the waiting or swapped queue
# falls between two of its tokens, which raises its own ITL. The mean over all requests shows
# both at once.
# Preemptions stop well before the dotted line -- requests finish at different times, and forked
# samples share their prompt's blocks -- and past it more blocks buy nothing: the extra memory
# stays free. An operator sizes the pool (vLLM's `gpu_memory_utilization`) so that preemptions
# are rare at the expected load, and watches `min free` and the preemption counter to see when
# they stop being rare.
#
# One run in detail: the smallest pool with swap, recorded (`engine.record()`) and drawn by
# `draw_memory_timeline`, which replays the log frame by frame.

# %%
from pagedlearn.viz import draw_memory_timeline

steps, outs, log = serve(sizes[0], "swap", record=True)
print(f"{len(log.events)} events, {steps[-1].preemptions_swap} swap preemptions, "
      f"{steps[-1].swap_out_blocks} blocks out / {steps[-1].swap_in_blocks} in")  # fmt: skip
draw_memory_timeline(log, title=f"swap, {sizes[0]} blocks: blocks and queues over steps")

# %% [markdown]
# Where the used blocks reach the top, a request moves from *running* to *swapped*; when enough
# blocks come free (a request finishes), it is swapped back in before anyone waiting is
# admitted -- swapped requests come first.
#
# ## Cancelling a request returns its blocks
#
# A user closes the tab; the server should not go on generating. `engine.abort_request(rid)`
# takes the request out of whichever queue holds it and frees its blocks at once (full blocks
# stay in the prefix cache as *free but cached* until the pool needs them). It returns the
# request's final output, with finish reason "abort", or `None` if it already finished.

# %%
from pagedlearn.viz import pool_state

llm = LLM(loaded, block_size=BLOCK_SIZE, num_blocks=SMALL, verbose=False)
engine = llm.engine
for name, prompt, p in workload:
    engine.add_request(name, prompt, p)
for _ in range(6):
    engine.step()

# The running request that holds the most blocks right now (read from the pool's state).
state = pool_state(llm)
running = [r for r in state.requests if r.status == "running"]
victim = max(running, key=lambda r: sum(len(state.blocks_of(s)) for s in r.seqs)).request_id
before = engine.stats()
held = sorted({b for s in engine.kv.sequences() if state.group_of(s) == victim
               for b in engine.kv.block_table(s)})  # fmt: skip
print(
    f"step {before.step}: free blocks {before.free_blocks}/{before.num_blocks} "
    f"(cached {before.cached_blocks}); {victim!r} holds {len(held)} blocks: {held}"
)
out = engine.abort_request(victim)
after = engine.stats()
print(
    f"aborted {victim!r} after {len(out.outputs[0].token_ids)} tokens, "
    f"finish reason {out.outputs[0].finish_reason!r}"
)
print(
    f"now:     free blocks {after.free_blocks}/{after.num_blocks} "
    f"(cached {after.cached_blocks}): +{after.free_blocks - before.free_blocks}"
)
print("aborting it again returns", engine.abort_request(victim))
while engine.has_unfinished_requests():
    engine.step()
end = engine.stats()
print(f"the other {end.num_finished - 1} requests finished; blocks in use: {end.used_blocks}")
engine.kv.check_invariants()

# %% [markdown]
# The freed blocks are free at once: the next step can give them to a waiting request.
#
# ## Check yourself
#
# Answer each question before you run the cell below: write your answers into `my_answers`
# (`None` skips one). The cell checks them against the runs above, and checks the rule behind
# each answer too.
#
# 1. In the policy run (swap, `SMALL` blocks), which request is preempted first, and how many
#    sequences leave the GPU with it? Use the arrival order and what you know about `n=3` and
#    `beam`; answer as `("name", count)`.
# 2. How many blocks does that first preemption copy to the CPU pool? (`BLOCK_SIZE` is 8, and
#    think about which blocks the sequences of one request share.)
# 3. In the chunked-prefill run, in how many steps does `long`'s prompt go in, with
#    `max_num_batched_tokens=64` and 5 sequences decoding?

# %%
my_answers = [None, None, None]  # your answers to questions 1-3, then run the cell

i = next(i for i, c in enumerate(changes) if c.preempted)  # the step of the first preemption
victim = changes[i].preempted[0]
group = next(r["seqs"] for r in infos[i - 1]["requests"] if r["id"] == victim)
copied = set()  # CPU blocks the victim's swap-outs filled in that step
step = 1
for e in policy_log.events:
    step += e.kind == "step"
    if step == changes[i].step and e.kind == "swap_out" and e.seqs[0] in group:
        copied |= set(e.info["cpu_blocks"])
prefill_steps = chunk["first token"] - ARRIVES  # the steps that took a chunk of `long`
rules = [  # what the rules predict, from the queues and tables before the step
    (max(changes[i - 1].running, key=arrival.index), len(group)),  # the latest arrival, all of it
    len({b for s in group for b in states[i - 1].tables[s]}),  # its distinct blocks, each once
    -(-n_long // (BUDGET - decoding)),  # the budget's rest after the decodes, every step
]
run = [(victim, len(group)), len(copied), prefill_steps]
for q, (rule, seen, mine) in enumerate(zip(rules, run, my_answers, strict=True), start=1):
    assert seen == rule, f"question {q}: the run gave {seen}, the rule {rule}"
    verdict = "" if mine is None else ("  right" if mine == seen else f"  (you said {mine})")
    print(f"question {q}: {seen}{verdict}")

# %% [markdown]
# ## Exercises
#
# 1. Give the swap run a CPU pool that is too small: `serve(SMALL, "swap", swap_blocks=4)`. The
#    scheduler falls back to recompute when the swap pool is full -- count both kinds of
#    preemption in the last `StepStats`.
# 2. Change `BLOCK_SIZE` to 4, then 32, and rerun the recompute-vs-swap table. How do the blocks
#    moved and the extra tokens change? Compare with the paper's Figure 19.
# 3. Turn prefix caching off (`enable_prefix_caching=False` in `serve`'s `LLM(...)`) and rerun
#    the sweep. At each pool size, compare `tokens computed` and `preemptions` with the run
#    above: where did the cache save recomputation? (Careful: without cache hits, requests are
#    admitted at other moments, so the preemptions change too.)
# 4. In the sweep, which metric would you put an alert on -- peak usage, min free blocks, or
#    preemptions -- and at what value? Argue from the numbers you got.
