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
# # 10 · The operator's view: tenants, metrics and a load test
#
# **Why this chapter.** Chapters 01-09 looked at one engine from the inside: blocks, tables,
# hashes, kernels, the scheduler. The person who runs a server sees it from the outside. Many
# users share one pool of blocks and one prefix cache, so the first question is who may share
# what; the second is which numbers say that the server is healthy, and the third is how to
# convince yourself that it stays healthy when the load is real -- that no request is lost, no
# block leaks, no tenant reads another's cache, and what a too-small pool does to the latency
# users feel. This chapter answers the three with the engine's own features.
#
# **What you will learn**
#
# 1. **isolation keys**: a block's hash includes the model (and its version), the LoRA adapter
#    and a per-request `cache_salt`, so requests share cached KV only when all of them agree;
#    why a salt matters (a cache hit is faster, and time can be measured), what isolation costs
#    in memory, and how to drop the whole cache (`reset_prefix_cache`);
# 2. **the metrics an operator watches**: `engine.stats()` (the pool now), `engine.metrics`
#    (latency percentiles, opt-in cache residency) and the Prometheus page, with vLLM's names;
# 3. **the load test** (`pagedlearn.loadtest.in_process.run_loadtest`): a seeded mix of
#    requests that exposes what paging does, and the checks that say nothing went wrong;
# 4. **tails against the pool**: the same load test over several pool sizes, read as an
#    operator would -- the fewest free blocks, the preemptions, and the latency tails, per run
#    and per request (against the fewest free blocks each request lived through);
# 5. and at the end, questions to check yourself, answered by the runs above.
#
# **What you need.** A CPU; no network. Everything runs the offline `tiny-gpt2` (2 layers, random
# weights, a byte tokenizer: one token per character, a context of 512 tokens), in about half a
# minute on the CPU that stored these outputs. The *counts* in this chapter -- cached tokens,
# blocks, checks -- are the same on every machine, except where a cell says that arrivals follow the
# wall clock. The *times* are this machine's: a CPU, a tiny model, other programs running beside it.
# The cells that print times are marked `timing`; read them for what to look for, not for their
# values.

# %%
from pagedlearn.cli.notebook import setup

env = setup()

# %%
import random
from collections import Counter

import torch
from IPython.display import display
from matplotlib.figure import Figure

from pagedlearn import LLM, PagedLearnError, SamplingParams
from pagedlearn.core.prefix_cache import hash_blocks, make_extra_keys
from pagedlearn.engine import prometheus
from pagedlearn.loadtest.in_process import run_loadtest
from pagedlearn.loadtest.mix import DEFAULT_RATE, build_mix
from pagedlearn.sim.plots import OKABE_ITO
from pagedlearn.viz import draw_memory_timeline

MODEL, BLOCK_SIZE = "tiny-gpt2", 16
# On a CPU the tiny model's operations are too small to gain from several threads, and on a
# busy machine threads waiting for each other slow every step down; the load test runs torch on
# one thread for the same reason (pagedlearn/loadtest/in_process.py). So do all the cells here.
torch.set_num_threads(1)

# %% [markdown]
# ## 1. Who may share a cached block
#
# Chapter 04 built the prefix cache: every full block gets a hash, `H(parent hash, the block's
# tokens, extra keys)`, and a new prompt reuses a cached block when the hashes (and the stored
# tokens and keys) match. The **extra keys** (`make_extra_keys` in
# `pagedlearn/core/prefix_cache.py`) are what must agree besides the tokens:
#
# - the **model**: `engine.kv.model_id`, the model's name, or `(name, version)` once
#   `engine.model_version` is set -- new weights give other K/V for the same tokens;
# - the **adapter**: `lora_request=` (an id, or vLLM's `LoRARequest` shape; pagedlearn applies
#   no adapter, it only keeps each adapter's KV apart, as vLLM must);
# - the **cache salt**: `{"prompt": ..., "cache_salt": "..."}` (vLLM's prompt shape) or
#   `add_request(..., cache_salt=...)`; a str or an int (`pagedlearn/engine/admission.py`).
#
# A server with several tenants gives each its own salt. Here are the keys of a few requests, and
# the first block hash each one would get for the same tokens:

# %%
llm = LLM(MODEL, block_size=BLOCK_SIZE, num_blocks=128, verbose=False)
engine = llm.engine
SYSTEM = (
    "You are the support assistant of a bicycle shop. Answer briefly, politely and only "
    "about bicycles, parts and repairs; never give medical or legal advice. "
)
ids = llm.tokenizer.encode(SYSTEM)
print(f"the system prompt: {len(ids)} tokens = {len(ids) // BLOCK_SIZE} full blocks of "
      f"{BLOCK_SIZE} + {len(ids) % BLOCK_SIZE} tokens")  # fmt: skip
model = engine.kv.model_id
for who, keys in [
    ("alice", make_extra_keys(model, None, "alice")),
    ("bob", make_extra_keys(model, None, "bob")),
    ("no salt", make_extra_keys(model)),
    ("adapter-x", make_extra_keys(model, "adapter-x")),
    ("version v2", make_extra_keys((model, "v2"))),
]:
    first = hash_blocks(ids[:BLOCK_SIZE], BLOCK_SIZE, keys)[0]
    print(f"{who:<11} extra keys {keys!s:<72} first block {first.hex()[:12]}")

# %% [markdown]
# Same tokens, five different hashes: none of these requests can hit a block cached under another
# one's keys. Now the engine. Each call below serves one request alone (`llm.generate`), so it finds
# whatever the calls before it left in the cache; `num_cached_tokens` in its output says how many
# prompt tokens it did not compute. The prompts are the system prompt and a short question.


# %%
def ask(question, salt=None, lora=None):
    """Serve one prompt, SYSTEM + question, alone; returns its prompt tokens found cached."""
    prompt = {"prompt": SYSTEM + question}
    if salt is not None:
        prompt["cache_salt"] = salt  # vLLM's shape; add_request(cache_salt=...) works too
    (out,) = llm.generate(prompt, SamplingParams(max_tokens=8), use_tqdm=False, lora_request=lora)
    return out.num_cached_tokens


found = {}
found["alice, first"] = ask("Q1", salt="alice")
found["alice, again"] = ask("Q2", salt="alice")
found["bob, alice's prompt"] = ask("Q2", salt="bob")
found["no salt"] = ask("Q2")
found["no salt, again"] = ask("Q3")
found["alice, adapter-x"] = ask("Q2", salt="alice", lora="adapter-x")
engine.model_version = "v2"  # new weights, say: the model key changes
found["alice, model v2"] = ask("Q2", salt="alice")
engine.model_version = None  # back to the old weights: their blocks are still cached
found["alice, model back"] = ask("Q4", salt="alice")
for who, n in found.items():
    print(f"{who:<22} {n:>4} prompt tokens found in the cache")
print("engine.kv.model_id now:", engine.kv.model_id)

# %% [markdown]
# Alice's second prompt shares the system prompt with her first, and finds its 9 full blocks
# (144 tokens; her 12 tokens after them fill no block, and only full blocks are cached). Bob
# sends her very prompt and finds nothing: his salt is in every one of his hashes. The requests
# without a salt share among themselves -- a missing salt is one more tenant, shared by
# everyone who sends none. Another adapter and another model version find nothing
# either; setting the version back finds alice's old blocks again, since changing the version
# drops nothing: the old blocks leave when the pool needs their room (or at a reset, below).
#
# **Why a salt matters.** vLLM's design document on automatic prefix caching
# (`docs/design/prefix_caching.md`, "Cache Isolation for Security") gives the reason: with a
# shared cache, an adversary could infer what is cached -- what others sent -- by observing
# latency differences; with a `cache_salt`, only requests with the same salt reuse each other's
# blocks. (vLLM puts the salt into the first block's hash, and the chain carries it to every
# block after; pagedlearn puts the extra keys into every block's hash: the same effect.) Here is
# what pagedlearn itself shows. Alice sends a long secret prompt. Mallory guesses it -- once
# right, once wrong -- and measures the time to the first token (TTFT) of each guess, first on a
# server where nobody sends a salt, then with salts.

# %% tags=["timing"]
rng = random.Random(0)


def letters(n):
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))


def ttft(prompt, salt):
    """Serve ``prompt`` alone; returns its TTFT in ms and its prompt tokens found cached."""
    p = {"prompt": prompt} if salt is None else {"prompt": prompt, "cache_salt": salt}
    (out,) = llm.generate(p, SamplingParams(max_tokens=1), use_tqdm=False)
    return 1e3 * out.metrics.ttft, out.num_cached_tokens


def trial(alice_salt, mallory_salt):
    """Alice sends a new secret; Mallory guesses it, right, then wrong: (ms, cached) of each."""
    secret = letters(480)
    ttft(secret, alice_salt)
    return ttft(secret, mallory_salt), ttft(letters(480), mallory_salt)


print("alice's secret: 480 tokens, a new one each trial; the fastest of 5 trials")
for alice_salt, mallory_salt in ((None, None), ("alice", "mallory")):
    trials = [trial(alice_salt, mallory_salt) for _ in range(5)]
    for i, guess in enumerate(("right", "wrong")):
        ms = min(t[i][0] for t in trials)
        (cached,) = {t[i][1] for t in trials}  # one count in all five trials
        print(f"salts {alice_salt!s:>5} / {mallory_salt!s:<7}  mallory's {guess} guess: "
              f"TTFT {ms:6.2f} ms, {cached} tokens found cached")  # fmt: skip
        hit = guess == "right" and alice_salt == mallory_salt
        assert cached == (BLOCK_SIZE * ((480 - 1) // BLOCK_SIZE) if hit else 0)

# %% [markdown]
# What to look for: without salts, the right guess hits 29 cached blocks (464 tokens; the last
# token is always computed, chapter 04) and computes 16 tokens instead of 480; the wrong guess
# computes all of them. Compare the two TTFTs: if the right guess answers clearly faster on this
# machine, the time alone tells Mallory that someone sent that prompt. With salts, both guesses
# compute every token, and their times should look alike. The token counts are the same on every
# machine; the gap in time depends on the prompt, the model and the hardware: a hit skips the
# prefill of every token it finds.
#
# **What isolation costs.** Salts keep tenants apart, and so they keep copies apart. The same 16
# requests -- the system prompt and a question each, at most 8 tokens out -- sent at once, first as
# one tenant, then as four (four salts), on a pool of 128 blocks and on one of 64:


# %%
def tenant_prompts(num_tenants, count=16):
    """``count`` prompts, SYSTEM and a question each, spread over ``num_tenants`` salts."""
    return [{"prompt": SYSTEM + f"Question {i}: my chain skips, why?",
             "cache_salt": f"tenant-{i % num_tenants}"} for i in range(count)]  # fmt: skip


cost = {}
print(f"{'pool':>4} {'tenants':>7} {'prompt tokens computed':>23} {'peak blocks used':>17} "
      f"{'steps':>6} {'evictions':>10}")  # fmt: skip
for num_blocks in (128, 64):
    for tenants in (1, 4):
        server = LLM(MODEL, block_size=BLOCK_SIZE, num_blocks=num_blocks, verbose=False)
        steps = []
        server.engine.subscribe_stats(steps.append)
        outs = server.generate(tenant_prompts(tenants), SamplingParams(max_tokens=8),
                               use_tqdm=False)  # fmt: skip
        s = server.engine.stats()
        cost[num_blocks, tenants] = (s.prefix_query_tokens - s.prefix_hit_tokens,
                                     max(x.used_blocks for x in steps), len(steps))  # fmt: skip
        print(f"{num_blocks:>4} {tenants:>7} {cost[num_blocks, tenants][0]:>23} "
              f"{cost[num_blocks, tenants][1]:>17} {len(steps):>6} {s.evictions:>10}")  # fmt: skip
shared = outs[-1].num_cached_tokens  # what a request finds of its tenant's system prompt
print(f"\neach request after its tenant's first finds {shared} tokens = "
      f"{shared // BLOCK_SIZE} blocks cached")  # fmt: skip
(one, one_peak, _), (four, four_peak, _) = cost[128, 1], cost[128, 4]
assert four - one == 3 * shared and four_peak - one_peak == 3 * shared // BLOCK_SIZE

# %% [markdown]
# A request finds 10 blocks of its tenant's earlier requests: all the tokens they have in common
# (the system prompt and the start of "Question"), in full blocks. Requests admitted in the same
# step share too: a prompt's full blocks enter the cache when they are allocated, before the prefill
# writes their K/V (`KVCacheManager.add_sequence`). One tenant computes those 10 blocks once; four
# tenants compute them four times -- 3 x 160 more prompt tokens -- and hold four copies, 3 x 10 more
# blocks at the peak (the assert checks both). On the pool of 64 blocks the four copies and the
# requests' own blocks do not all fit at once: requests wait for room, the same work takes more
# steps, and cached copies are evicted to make room. Salts are per trust boundary (a customer, an
# application), not per request: a salt per request would turn the prefix cache off.
#
# **Dropping the whole cache.** After new weights are loaded, or to clear tenants' data,
# `llm.reset_prefix_cache()` (vLLM's name) forgets every cached block at once. It is refused --
# with an error that names the requests, changing nothing -- while any request holds blocks
# (running or swapped out): their blocks are in use. Below, on a new engine recorded from its
# start (`engine.record()`; a recording knows only what happens after it starts): alice's
# prompt is served, carol's request runs, a reset is refused, carol finishes, the reset drops
# every cached block, and carol's next prompt finds nothing.

# %%
llm = LLM(MODEL, block_size=BLOCK_SIZE, num_blocks=32, verbose=False)  # ask() serves this one
engine = llm.engine
log = engine.record()
ask("Q1", salt="alice")
engine.add_request("carol-1", {"prompt": SYSTEM + "Q5", "cache_salt": "carol"},
                   SamplingParams(max_tokens=12, ignore_eos=True))  # fmt: skip
engine.step()
engine.step()
try:
    llm.reset_prefix_cache()
except PagedLearnError as e:
    print("refused:", e)
while engine.has_unfinished_requests():
    engine.step()
before = engine.stats().cached_blocks
dropped = llm.reset_prefix_cache()
after = engine.stats().cached_blocks
print(f"carol finished; cached blocks: {before} -> reset dropped {dropped} -> {after} left")
carol_again = ask("Q5", salt="carol")
print(f"carol's same prompt again: {carol_again} tokens found in the cache")
log.close()
assert dropped == before and after == 0 and carol_again == 0
draw_memory_timeline(log, title="alice, then carol; a reset refused, carol finishes, the reset")

# %% [markdown]
# The timeline replays the recording step by step (chapter 07 drew the same view). Used blocks
# are those of the request running; when it finishes, its full blocks stay cached -- free, but
# findable (the grey band) -- and the reset's marker is where that band falls to zero. Carol's
# second request then computes her prompt again, and caches it again.
#
# ## 2. What an operator watches
#
# The engine keeps its numbers in three layers, from "now" to "what a scrape exports":
#
# - `engine.stats()`: a `StepStats`, how things stand after the last step -- the queues, the
#   blocks (used, free, cached), and running totals (prefix-cache hits, preemptions, evictions,
#   swapped blocks), plus `min_free_blocks`, the fewest free blocks after any step so far.
#   `engine.subscribe_stats(fn)` gets one after every step (chapter 07 used it).
# - `engine.metrics`: an `EngineMetrics` (`pagedlearn/engine/metrics.py`), the distributions:
#   time to first token (TTFT), inter-token latency (ITL: each gap between two tokens of a
#   request), end-to-end latency (E2E), time in the queue, prompt and output lengths, sequences
#   per step. Each is a histogram with fixed buckets over the engine's life (vLLM's bounds, where
#   vLLM has the histogram)
#   plus the last 1,000 values (10,000 gaps for ITL), exact, for the p50 / p90 / p99 it prints:
#   memory that does not grow with the requests served. How long cached blocks live before they
#   are evicted is opt-in (`engine.metrics.track_cache_residency()`): it times every cached block
#   from the block trace, which costs an event per block operation. (vLLM's are opt-in too,
#   with `--kv-cache-metrics`, and by default sample 1% of blocks; pagedlearn times every one.)
# - the Prometheus page: `prometheus_text(engine)` (`pagedlearn/engine/prometheus.py`), what a
#   vLLM server answers on `GET /metrics`, with vLLM's names under the prefix `pagedlearn_`.
#
# A busier workload to read them on: the 16 prompts of four tenants again, now with long answers
# (48 to 80 tokens, some requests with `n=2` samples), all at once, on a pool of 48 blocks that
# preempts by swap (16 CPU blocks), with cache residency on:

# %%
served = []  # collected with the engine's observer, after every step
busy = LLM(MODEL, block_size=BLOCK_SIZE, num_blocks=48, preemption_mode="swap", swap_blocks=16,
           verbose=False)  # fmt: skip
busy.engine.metrics.track_cache_residency()
busy.engine.subscribe_stats(served.append)
params = [SamplingParams(max_tokens=48 + 16 * (i % 3), ignore_eos=True, seed=i, temperature=0.8,
                         n=2 if i % 5 == 0 else 1) for i in range(16)]  # fmt: skip
busy.generate(tenant_prompts(4), params, use_tqdm=False)
m = busy.engine.metrics
print(f"{len(served)} steps; {m.ttft.count} first tokens, by finish reason {m.finished_by_reason}; "
      f"{m.itl.count} inter-token gaps; {m.block_lifetime.count} cached blocks timed from their "
      "caching to their eviction")  # fmt: skip
print(f"fewest free blocks after a step: {busy.engine.stats().min_free_blocks} "
      f"(= min over the steps: {min(s.free_blocks for s in served)})")  # fmt: skip

# %% [markdown]
# The pool's summary and the latency percentiles (these hold times):

# %% tags=["timing"]
print(busy.engine.stats().summary())
print()
print(busy.engine.metrics.summary())

# %% [markdown]
# What to look for. The counts in the summary (blocks, hits, evictions, preemptions) are the same on
# every machine: the requests all arrived at once, so the schedule does not depend on time. In the
# percentiles, compare the queue time with the TTFT: the pool runs only a few of the 16 requests at
# a time (see "running seqs per step"), so expect most of a request's TTFT to be time spent waiting
# for room. The ITL percentiles are steps: a running request gets one token per step, so a gap is
# one step's duration, unless the request was preempted in between.
#
# **The Prometheus page.** A scrape reads `engine.stats()` and `engine.metrics` at that moment
# and writes them as metric families: gauges (the state now), counters (running totals, with
# `_total` appended, Prometheus' rule) and histograms (`_bucket`, `_sum`, `_count`). This chapter
# reads four of them, the block manager's: preemptions (by mode), prefix-cache hits, the fewest
# free blocks, and evictions. Their samples, and how many families the page holds in all:

# %%
page = prometheus.prometheus_text(busy)
lines = page.splitlines()
kinds = Counter(line.split()[3] for line in lines if line.startswith("# TYPE"))
print(f"{len(lines)} lines, {sum(kinds.values())} metric families: " +
      ", ".join(f"{n} {kind}s" for kind, n in kinds.items()))  # fmt: skip
watched = ("num_preemptions", "prefix_cache_hits", "kv_cache_min_free", "kv_cache_evictions")
for line in lines:
    if line.startswith(tuple("pagedlearn_" + name for name in watched)):
        print(line)

# %% [markdown]
# And a histogram: the TTFT's buckets are cumulative counts of requests whose TTFT was at most
# `le` seconds (vLLM's bounds), so the page carries the whole distribution and a dashboard
# computes any percentile from it (PromQL's `histogram_quantile`):

# %% tags=["timing"]
ttft_lines = [line for line in lines if line.startswith("pagedlearn_time_to_first_token")]
print("\n".join([*ttft_lines[:6], "...", *ttft_lines[-3:]]))

# %% [markdown]
# **Where to find the rest.** Every family, what it means, and its vLLM counterpart where vLLM
# has one (vLLM's names from `vllm/v1/metrics/loggers.py`), are in the module docstring of
# `pagedlearn/engine/prometheus.py`; `print(page)` shows the page itself. A name shared with vLLM
# is vLLM's with `pagedlearn_` for `vllm:` (the counter `pagedlearn_num_preemptions` is
# `vllm:num_preemptions`, with an extra `mode` label to sum away), so one dashboard reads
# both servers. The names vLLM does not have (`kv_cache_min_free_blocks`, `kv_cache_evictions`,
# `swapped_blocks`, `recomputed_tokens`, ...) are the ones this course cares about: what the
# block manager does.
#
# ## 3. The load test
#
# A unit test checks one rule with a few requests. A load test sends many requests of every
# kind, at once and over time, and checks what must hold whatever happened in between.
# `python -m pagedlearn loadtest` is one, and `run_loadtest` is the same thing from Python
# (`pagedlearn/loadtest/in_process.py`). One run sends a seeded mix (`loadtest/mix.py`) in five
# phases, each run until the engine is idle:
#
# - **mix**: a Poisson stream (`rate` requests per second) of short prompts and prompts near
#   the context limit; prompts that share a "system prompt" -- sent by several tenants (salts,
#   an adapter) -- or share nothing; `n > 1` samples; requests that stop early (stop tokens or
#   strings), run to `max_tokens`, or are cancelled after a few tokens; and one prompt longer
#   than the context, to be refused at the door;
# - **squeeze**: a burst of growing requests that want about twice the pool: preemptions, by
#   swap while the CPU swap pool has room, by recompute once it is full;
# - **cold**: after `reset_prefix_cache()`, one request for each of the first (system prompt,
#   tenant) pairs (as many as the run's share of requests for the pass: `split_counts`);
# - **warm**: the same prompts again -- their blocks are cached now;
# - **version**: the same prompts after `engine.model_version` changed.
#
# The pool is squeezed on purpose: by default it holds two full-context sequences (64 blocks of
# 16 for tiny-gpt2's 512 tokens), and the swap pool a quarter of that. A driver
# (`loadtest/driver.py`) adds each request at its arrival time on the wall clock, steps the
# engine, cancels requests mid-way, checks the pool's invariants after every step, and audits
# the block trace for cross-tenant hits. The returned `LoadTestReport` has the numbers by topic
# (`.counts`, `.pool`, `.prefix_cache`, `.latency`), the verdicts (`.checks`), a sample of the
# pool after every step (`.series`) and one record per request (`.requests`). Its `summary()` is
# what the command prints. One run, at the command's default rate of 40 requests per second:

# %% tags=["timing"]
SEED, NUM_REQUESTS, RATE = 0, 60, DEFAULT_RATE
report = run_loadtest(MODEL, num_requests=NUM_REQUESTS, rate=RATE, seed=SEED)
print(report.summary())

# %% [markdown]
# Arrivals follow the wall clock, so how many requests overlap in the mix depends on how fast
# this machine steps; the counts of that phase (steps, preemptions, hits) can differ a little
# from run to run. What may not differ is a correctness verdict. The checks are of two kinds:
# *correctness* (something went wrong: the command exits 1) and *coverage* (the run did not
# exercise something it meant to, e.g. a pool too big ever to preempt: printed `[--]`, and the
# exit code stays 0):

# %%
for check in report.checks:
    mark = "OK" if check.ok else "FAIL" if check.kind == "correctness" else "--"
    print(f"[{mark}] {check.kind:<11} {check.name}")
pc, rates = report.prefix_cache, report.prefix_cache["phase_hit_rate"]
print(f"\ncross-tenant hits: {pc['cross_tenant_hit_blocks']} blocks; cold and version passes: "
      f"{rates['cold']:.0%} and {rates['version']:.0%} hit")  # fmt: skip
assert report.ok and pc["cross_tenant_hit_blocks"] == 0

# %% [markdown]
# What each check guards against (`pagedlearn/loadtest/verdicts.py` computes them, the
# tenant audit is in `loadtest/checks.py`). Correctness:
#
# 1. **Every request finished or was cancelled.** Each request sent has a final output --
#    finished, cancelled on purpose after a few tokens, or refused at the door (the one prompt
#    longer than the context) -- and none failed. A request lost in a queue is a user waiting
#    forever.
# 2. **Every block came back.** After the run, no GPU block is held and the swap pool is empty,
#    and no sequence is left in the manager. A leak of one block per cancelled request is
#    invisible in a demo and fatal after a week: the pool shrinks until nothing fits.
# 3. **The invariants held after every step** (and after every cancellation):
#    `check_invariants()` (`pagedlearn/core/invariants.py`) -- refcounts equal the table entries
#    pointing at each block, a block is free exactly when nothing points at it, tables have the
#    right length, the swap pool obeys the same rules, every hash maps to a block holding exactly
#    those tokens under those keys. It catches a wrong step when it happens, not when a user
#    notices wrong text.
# 4. **No request hit another tenant's cache entry.** The audit (`TenantAudit`) reads the block
#    trace, not the engine's own counters: each `cache_store` makes the storing request's
#    tenant (salt, adapter, model version) the block's owner, until the block is evicted,
#    handed out for other data, or the cache is reset; a `cache_hit` by anyone else is a
#    violation.
# 5. **Nothing was hit after a reset or a new model version.** Each of the cold and version
#    passes sends each of its (system prompt, tenant) pairs once, so a new prompt there has
#    nothing of its own to hit: any hit is a block that `reset_prefix_cache()` should have
#    dropped, or one cached under the old weights.
#
# Coverage -- without these, the checks above would have proved less than they claim:
#
# 6. **Preemptions by swap and by recompute**: the squeeze exercised both ways of taking
#    blocks back.
# 7. **The warm pass hit the cache**: the cache works at all (else check 5 is empty).
# 8. **Cache hits within a tenant**, and some prompts sent by several tenants: check 4 had
#    something to tell apart.
# 9. **The whole mix happened**: every kind of request was sent (and, where the outputs can
#    show it -- `n > 1` samples, early stops, cancellations -- happened), several tenants, two
#    model versions.
#
# The report keeps the pool after every step. Drawn over the run's time, with the phases:

# %% tags=["timing"]
series, num_blocks = report.series, report.config["num_blocks"]
t = series["t"]
used = series["used_blocks"]
cached = series["cached_blocks"]
empty = [f - c for f, c in zip(series["free_blocks"], cached, strict=True)]  # free, not cached
fig = Figure(figsize=(11, 5.5), layout="constrained")
gpu, cpu = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
gpu.stackplot(t, used, cached, empty, step="post", colors=[OKABE_ITO[0], "#DDDDDD", "#FFFFFF"],
              labels=["used", "cached (free, holds a prefix)", "free"])  # fmt: skip
gpu.set_ylim(0, num_blocks)
gpu.set_ylabel(f"GPU blocks (of {num_blocks})", fontsize=11)
cpu.step(t, series["cpu_used_blocks"], where="post", color=OKABE_ITO[3],
         label="swap pool: blocks used")  # fmt: skip
cpu.step(t, series["num_waiting"], where="post", color=OKABE_ITO[1], label="requests waiting")
cpu.set_xlabel("seconds since the run started (one sample after each step)", fontsize=11)
starts = [i for i in range(len(t)) if i == 0 or series["phase"][i] != series["phase"][i - 1]]
for i in starts:
    for ax in (gpu, cpu):
        ax.axvline(t[i], color="#000000", linestyle=":", linewidth=1)
    gpu.text(t[i], num_blocks, f" {series['phase'][i]}", rotation=90, va="top", fontsize=10)
for ax in (gpu, cpu):
    ax.tick_params(labelsize=10)
    ax.legend(fontsize=10, loc="upper left", bbox_to_anchor=(1.01, 1))
gpu.set_title(f"The load test's pool after every step ({MODEL}, {NUM_REQUESTS} requests)",
              fontsize=12)  # fmt: skip
display(fig)

# %% [markdown]
# What to look for: in the squeeze the used blocks fill the pool and the swap pool takes the
# preempted requests' blocks (the lower panel); between phases the engine runs dry, and the
# cached blocks -- free, but findable -- stay until the reset before the cold pass drops them.
# The mix's shape depends on this machine's speed (arrivals follow the wall clock); the
# squeeze, a burst into an idle engine, takes the same steps on every machine, though not the
# same time.
#
# ## 4. Tails against the pool
#
# How big a pool does this load need? The operator's experiment: the same requests on pools of
# several sizes. The requests come from the seed, but `build_mix` also takes the pool sizes and
# sizes the squeeze to the swap pool; left at its default, the swap pool would be a quarter of
# each pool, and each pool would get other squeeze requests. So we keep the swap pool at 16
# blocks in every run, and the cell checks that every pool size then gets the very same
# requests:

# %%
POOLS = (36, 48, 64, 96, 128, 192)  # the load test takes no pool under 33 blocks
SWAP = 16
max_len = report.config["max_model_len"]
same = build_mix(NUM_REQUESTS, SEED, RATE, max_len, BLOCK_SIZE, POOLS[0], SWAP)
assert all(build_mix(NUM_REQUESTS, SEED, RATE, max_len, BLOCK_SIZE, n, SWAP) == same for n in POOLS)
print(f"{len(same)} requests, the same for every pool of {POOLS} blocks (swap pool: {SWAP})")

# %% [markdown]
# For each run, the numbers an operator's dashboard would show side by side: the fewest free
# blocks after any step (`pagedlearn_kv_cache_min_free_blocks`), the preemptions, and the
# latency tails of the report -- TTFT p50 and p99, ITL p99 -- plus the longest single gap between
# two tokens (ITL max, from `report.requests`) and the E2E p99. Every run must pass every
# correctness check (`report.ok`); a pool big enough never to preempt leaves "preemptions by
# swap and by recompute" `[--]` not exercised -- the load test saying that it could not
# exercise preemption there, not that something broke. Arrivals follow the wall clock here as
# in section 3, so this table's counts -- fewest free blocks, preemptions, preempted requests --
# may differ a little on another machine; the requests and the correctness verdicts may not.

# %% tags=["timing"]
runs, reports = {}, {}
for n in POOLS:
    r = reports[n] = run_loadtest(MODEL, num_requests=NUM_REQUESTS, rate=RATE, seed=SEED,
                                  num_blocks=n, swap_blocks=SWAP)  # fmt: skip
    assert r.ok, r.summary()  # every correctness check
    gaps = [g for q in r.requests for g in q["itl"]]
    batch = [b for b in r.series["num_running_seqs"] if b]  # the steps that ran anything
    runs[n] = {
        "min free": r.pool["min_free_blocks"],
        "swap": r.pool["preemptions_swap"],
        "recompute": r.pool["preemptions_recompute"],
        "preempted": sum(q["num_preemptions"] > 0 for q in r.requests),  # requests
        "batch": sum(b * b for b in batch) / sum(batch),  # the batch a token was made in, mean
        "TTFT p50": 1e3 * r.latency["ttft"]["p50"],
        "TTFT p99": 1e3 * r.latency["ttft"]["p99"],
        "ITL p99": 1e3 * r.latency["itl"]["p99"],
        "ITL max": 1e3 * max(gaps),
        "E2E p99": 1e3 * r.latency["e2e"]["p99"],
        "gaps": len(gaps),
    }
keys = list(runs[POOLS[0]])
print(f"{'blocks':>6}" + "".join(f"{k:>11}" for k in keys) + "   (latencies in ms)")
for n, row in runs.items():
    print(f"{n:>6}" + "".join(f"{v:>11.0f}" if isinstance(v, int) else f"{v:>11.1f}"
                              for v in row.values()))  # fmt: skip
print("\nthe preemptions of each preempted request ('swap' and 'recompute' count preemptions, "
      "'preempted' requests):")  # fmt: skip
for n, r in reports.items():
    counts = sorted(q["num_preemptions"] for q in r.requests if q["num_preemptions"])[::-1]
    print(f"{n:>6}: {counts}")

# %% [markdown]
# The same numbers, read as an operator would: the pool's headroom on top, the tails below,
# against the pool size. The shaded runs are those whose free blocks reached zero.

# %% tags=["timing"]
x = list(runs)
full = [n for n in x if runs[n]["min free"] == 0]
fig = Figure(figsize=(10, 8), layout="constrained")
free_ax, pre_ax, lat_ax = fig.subplots(3, 1, sharex=True, height_ratios=[1, 1, 2.5])
free_ax.plot(x, [runs[n]["min free"] for n in x], marker="o", color=OKABE_ITO[0])
free_ax.set_ylabel("fewest free\nblocks", fontsize=11)
pre_ax.bar(x, [runs[n]["swap"] for n in x], width=5, color=OKABE_ITO[1], label="swap")
pre_ax.bar(x, [runs[n]["recompute"] for n in x], width=5, color=OKABE_ITO[3],
           bottom=[runs[n]["swap"] for n in x], label="recompute")  # fmt: skip
pre_ax.set_ylabel("preemptions", fontsize=11)
pre_ax.set_ylim(0, 1 + max(runs[n]["swap"] + runs[n]["recompute"] for n in x))
for key, marker, color, style in (("TTFT p50", "o", OKABE_ITO[2], "-"),
                                  ("TTFT p99", "s", OKABE_ITO[3], "-"),
                                  ("ITL p99", "^", OKABE_ITO[4], "-"),
                                  ("ITL max", "v", OKABE_ITO[4], ":")):  # fmt: skip
    lat_ax.plot(x, [runs[n][key] for n in x], marker=marker, color=color, linestyle=style,
                label=key)  # fmt: skip
lat_ax.set_yscale("log")
lat_ax.set_ylabel(f"ms, log scale\n(CPU, {MODEL})", fontsize=11)
lat_ax.set_xlabel("num_blocks: the GPU pool, in blocks of 16 tokens", fontsize=11)
lat_ax.set_xticks(x)
for ax in (free_ax, pre_ax, lat_ax):
    for n in full:  # the runs whose free blocks reached 0
        ax.axvspan(n - 5, n + 5, color="#E5E5E5", linewidth=0, zorder=0)
    ax.tick_params(labelsize=10)
for ax in (pre_ax, lat_ax):
    ax.legend(fontsize=10, loc="upper left", bbox_to_anchor=(1.01, 1))
fig.suptitle(f"The same {NUM_REQUESTS} requests ({RATE:g}/s, seed {SEED}) on pools of "
             f"{x[0]}-{x[-1]} blocks; grey: the free blocks reached 0", fontsize=12)  # fmt: skip
display(fig)

# %% [markdown]
# How to read it. The latencies are times, so check each point against the table rather than
# trust a sentence; the reasons below say what to look for.
#
# - **Headroom first.** A pool whose fewest free blocks reached 0 was full after some step; when a
#   running request then needs a block, the scheduler takes the blocks of the most recently arrived
#   running request: a preemption. See whether the preempting runs are the grey ones. (It is not a
#   law: the free blocks are sampled after each step, and a preemption frees the victim's blocks
#   within the step, so a step can preempt and still end with a few blocks free.) On a live server,
#   `pagedlearn_kv_cache_min_free_blocks` says how close it has come to running out since it started
#   -- a running minimum, which never recovers -- so an alert watches `kv_cache_usage_perc` near 1
#   and the rate of `num_preemptions_total` (PromQL's `rate()`).
# - **TTFT p99** should grow as the pool shrinks: prompts that arrive together (the squeeze is
#   a burst) wait in the queue until there are blocks for them, and a small pool admits fewer at
#   a time. **TTFT p50** should move much less: most requests of the Poisson mix arrive to a
#   pool with room.
# - **ITL p99** may hardly move, and may even *fall* as the pool shrinks. A preempted request
#   waits, swapped out or re-queued, and that wait is one long gap between two of its tokens.
#   But a run has a handful of preemptions against well over a thousand gaps (the table's
#   `gaps` column); while the preemptions are fewer than 1% of the gaps, the p99 looks past
#   every one of them, and what it measures is an ordinary gap: one step's duration. A step
#   runs every running sequence, so its duration grows with the batch, and a smaller pool holds
#   a smaller batch (`batch`: the running sequences of the step a token was made in, averaged
#   over the tokens). Compare the `batch` and `ITL p99` columns. The stall shows in **ITL
#   max**, the single longest gap: look whether it jumps in the grey runs. A percentile
#   summarises the many; the preemption counter and the maximum catch the few.
# - **`preempted` counts requests; `swap` and `recompute` count preemptions.** A request can be
#   preempted more than once (swapped out, back in, and out again when the pool fills up
#   again), and each time is one preemption (`pagedlearn_num_preemptions`, as vLLM's
#   `vllm:num_preemptions`); the lines under the table give each preempted request's count.
#
# The paper's section 4.5 answers a full pool with preemption (all-or-nothing, the latest arrivals
# first): it keeps the server serving, and the table shows what it costs the requests it hits. An
# operator sizes the pool for the expected load (in vLLM, through `gpu_memory_utilization`, "the
# fraction of GPU memory to be used for the model executor" (`CacheConfig` in vLLM's
# `vllm/config/cache.py`): at startup vLLM loads the weights, profiles a forward pass, and makes KV
# blocks of what that fraction has left) and watches the headroom. Compare, too, the 64-block row
# with the report of section 3: the same requests on the same pool; what differs between the two is
# how this machine's timing moved the arrivals -- and its noise.
#
# ### Per request: the tails against the free blocks it lived through
#
# The runs above summarise a whole pool in one number. An operator's question is finer: *when*
# the pool ran short, who paid? `pagedlearn.loadtest.tails` places every request of the six
# runs by the **fewest free blocks it lived through** -- the minimum of the free blocks after
# every step from its arrival to its end -- and gives each range of that number its TTFT p50 /
# p99 and its ITL p99 and max:

# %% tags=["timing"]
from pagedlearn.loadtest.tails import tails_by_headroom

rows = tails_by_headroom(reports.values())
print(f"{'fewest free':>12}{'requests':>10}{'preempted':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
      f"{'ITL p99':>10}{'ITL max':>10}   (ms)")  # fmt: skip
for row in rows:
    ms = [1e3 * row[k] for k in ("ttft_p50", "ttft_p99", "itl_p99", "itl_max")]
    print(f"{row['label']:>12}{row['requests']:>10}{row['preempted']:>11}"
          + "".join(f"{v:>10.1f}" for v in ms))  # fmt: skip
used = [row for row in rows if row["requests"]]
fig = Figure(figsize=(9, 4.5), layout="constrained")
ax = fig.subplots()
xs = range(len(used))
for key, marker, color, style in (("ttft_p50", "o", OKABE_ITO[2], "-"),
                                  ("ttft_p99", "s", OKABE_ITO[3], "-"),
                                  ("itl_p99", "^", OKABE_ITO[4], "-"),
                                  ("itl_max", "v", OKABE_ITO[4], ":")):  # fmt: skip
    label = key.replace("_", " ").upper().replace(" P", " p").replace(" MAX", " max")
    ax.plot(xs, [1e3 * row[key] for row in used], marker=marker, color=color, linestyle=style,
            label=label)  # fmt: skip
ax.set_xticks(list(xs), [f"{row['label']}\n{row['requests']} requests\n{row['preempted']} "
                         "preempted" for row in used], fontsize=10)  # fmt: skip
ax.set_yscale("log")
ax.set_xlabel("fewest free blocks a request lived through", fontsize=11)
ax.set_ylabel(f"ms, log scale (CPU, {MODEL})", fontsize=11)
ax.tick_params(labelsize=10)
ax.legend(fontsize=10)
fig.suptitle(f"Every request of the {len(reports)} runs, by the headroom it saw", fontsize=12)
display(fig)

# %% [markdown]
# What to look for: the left of the figure is the requests that lived through a step that left
# the pool with no free block. Every preempted request should be in the leftmost ranges (the
# table's third column), since a preemption happens when a step finds the pool short -- though,
# as above, the victim's blocks come back within the same step, so a preempted request may have
# seen one or two free blocks rather than zero. Their TTFT p99 and ITL max should stand above
# those of the requests that always had room; compare the rows rather than trust this sentence,
# since these are timings. This is the reading an operator takes to a capacity decision: the
# requests that paid were those that lived through a step with no free block, which the pool's
# average use would not show and its fewest free blocks does.
#
# ## Check yourself
#
# Answer each question before you run the cell below: write your answers into `my_answers`
# (`None` skips one). The cell checks them against the runs above, and checks the rule behind
# each answer too.
#
# 1. In section 1, bob sends alice's prompt, token for token, with his own salt. How many of its
#    tokens does he find in the cache?
# 2. Alice's second prompt (the system prompt, 154 tokens, then "Q2") shares all but its last
#    token with her first ("Q1"). With blocks of 16 tokens, how many tokens does it find cached?
# 3. After `reset_prefix_cache()` dropped every cached block, how many tokens does carol's
#    prompt -- already served before the reset -- find?
# 4. In the load test, how many blocks did one tenant hit in another tenant's cache?

# %%
my_answers = [None, None, None, None]  # your answers to questions 1-4, then run the cell

common = 0  # alice's two prompts: the tokens they share from the start
first, second = llm.tokenizer.encode(SYSTEM + "Q1"), llm.tokenizer.encode(SYSTEM + "Q2")
while first[common] == second[common]:
    common += 1
rules = [  # what the rules predict
    0,  # another salt: every hash differs, from the first block on
    BLOCK_SIZE * min(common // BLOCK_SIZE, (len(second) - 1) // BLOCK_SIZE),  # full blocks only
    0,  # nothing is cached after a reset
    0,  # the audit: an owner per cached block, and no hit by another tenant
]
seen = [found["bob, alice's prompt"], found["alice, again"], carol_again,
        report.prefix_cache["cross_tenant_hit_blocks"]]  # fmt: skip
for q, (rule, got, mine) in enumerate(zip(rules, seen, my_answers, strict=True), start=1):
    assert got == rule, f"question {q}: the run gave {got}, the rule {rule}"
    verdict = "" if mine is None else ("  right" if mine == got else f"  (you said {mine})")
    print(f"question {q}: {got}{verdict}")

# %% [markdown]
# ## Exercises
#
# 1. **Two tenants without salts.** Serve the same system prompt for "dave" and "erin", neither
#    sending a salt, while recording (`engine.record()`), then run a `TenantAudit`
#    (`pagedlearn.loadtest.checks`) over the recorded events with a `tenant_of` that names each
#    request's tenant (send them with `engine.add_request("dave-1", ...)` and `"erin-1"`, so
#    that the ids name the tenant, and feed `log.events` to the audit one by one). What does
#    the audit report, and what would fix it?
# 2. **Recompute only.** Pass the load test an `LLM` you built yourself,
#    `LLM(MODEL, block_size=16, num_blocks=36, preemption_mode="recompute", swap_blocks=16,
#    verbose=False)`, which `run_loadtest(llm, NUM_REQUESTS, RATE, SEED)` drives as it is. The
#    swap pool is never used, but `build_mix` sizes the squeeze to it, so these are the sweep's
#    requests (without it the squeeze shrinks to one-block prompts and nothing is preempted).
#    Which check says `[--]`, why is that coverage and not correctness, and how do the tails and
#    `report.pool` change against the sweep's 36-block row?
# 3. **All at once.** Rerun the sweep with `rate=float("inf")` (every phase a burst; vLLM's
#    serving benchmark, `vllm bench serve` -- formerly `benchmarks/benchmark_serving.py` -- also
#    sends every request at time 0 unless given `--request-rate`). Now the arrivals do not follow
#    the wall clock: run it twice and check which columns of the table are the same both times.
#    Does the number of preemptions still fall, or stay level, as the pool grows? If not, find
#    the run that
#    breaks the pattern and read `pagedlearn/core/swap.py`'s docstring on blocks shared with another
#    request: what does a swap-out free when the victim's prefix is shared, and what does its
#    swap-in take?
# 4. **An alert.** From the sweep, pick the gauge and the threshold you would page someone on,
#    and the pool size you would deploy for this load. Argue from your table, and say what
#    would change if the arrival rate doubled.
