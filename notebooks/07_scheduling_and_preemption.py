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
# **What you will learn**
#
# - what the scheduler does when the block pool runs out: it *preempts* the youngest running
#   request, either by **recompute** (free its blocks, prefill it again later) or by **swap**
#   (copy its blocks to a CPU pool and back);
# - what each costs: recompute pays in extra prefill tokens, swap in blocks copied, and both
#   in time, measured here step by step (`StepStats.step_time`, `forward_time`,
#   `bookkeeping_time`);
# - the numbers a vLLM operator watches -- KV usage %, the minimum of free blocks, preemptions,
#   time to first token (TTFT) and inter-token latency (ITL) -- and how they move with the pool
#   size;
# - that cancelling a request (`engine.abort_request`) returns its blocks at once.
#
# **What you need.** A CPU is enough: everything here runs the offline tiny models in a few
# seconds. The *counts* (preemptions, blocks swapped, tokens recomputed) do not depend on the
# machine. The *times* do: on a CPU with a 2-layer random model a step takes a millisecond or
# two, other programs on the machine add noise, and "swap" copies between two tensors
# in the same RAM. On a GPU with GPT-2 (`env.gpt2` is then the real model) the forward pass
# dominates and a swap crosses the PCIe bus, so rerun the chapter there before trusting any
# time ratio.

# %%
from pagedlearn.notebook import setup

env = setup()

# %% [markdown]
# ## A workload that does not fit
#
# We reuse the project's mixed batch (`pagedlearn.demo.requests()`, what `make demo` serves):
# two chats that share a system prompt, a short and a long prompt, `n=3` sampling and a beam
# search (we leave out its "cancel" request; cancelling comes at the end). Every request has
# `ignore_eos=True`, so its length -- and the memory pressure -- is the same on every run.
#
# How many blocks does each request need at most, alone? Its prompt plus `max_tokens`, rounded
# up to blocks, times its number of sequences (forked samples and beams share their prompt
# blocks, so this overestimates a little). The sum is what would let all of them run at once
# without ever preempting; the largest is the smallest pool that can serve them at all.

# %%
import statistics

from pagedlearn import LLM
from pagedlearn.demo import requests
from pagedlearn.models import load

BLOCK_SIZE = 8
REPEATS = 3 if env.quick else 5  # each time is the fastest of this many runs

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

# %%
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

# %%
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
# ## What an operator watches, as the pool grows
#
# A serving dashboard (vLLM's `/metrics`) shows, among others: **KV cache usage** (% of blocks
# in use), the **number of preemptions**, **time to first token** (TTFT: arrival until the first
# token; queueing included) and **inter-token latency** (ITL: the gap between two tokens of one
# request). Here is the same workload over a range of pool sizes, from the smallest that can
# serve the largest request alone to more than everything needs at once -- all computed now.

# %%
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

# %%
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
# requests run side by side (smaller batches). Latency follows: TTFT grows most, since late
# requests queue behind a full pool; ITL moves much less, since a running request gets one token
# per step whatever the pool (only the step's own duration changes). Preemptions stop well
# before the dotted line -- requests finish at different times, and forked samples share their
# prompt's blocks -- and past it more blocks buy nothing: the extra memory stays free. An
# operator sizes the pool (vLLM's `gpu_memory_utilization`) so that preemptions are rare at the
# expected load, and watches `min free` and the preemption counter to see when they stop being
# rare.
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
