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
# # 03 · Copy-on-write: parallel sampling and beam search
#
# One prompt, several continuations: parallel sampling (`n=3`) asks for three samples of the same
# prompt, and beam search keeps the `beam_width` best partial outputs at every step. Without
# paging, every sequence holds its own copy of the prompt's KV. With paging, the sequences of a
# request **share** physical blocks: a `fork` points a new block table at the parent's blocks and
# raises their **refcount**; a block is copied only when a sequence is about to write into a
# block somebody else still reads (**copy-on-write**, the paper's section 4.4, Figures 8 and 9).
#
# **What you will learn**
#
# 1. what `fork` does to block tables and refcounts, on a real model generating `n=3` samples;
# 2. the exact step where copy-on-write happens, which blocks it copies and why only `n - 1` of
#    the `n` sharers copy;
# 3. that the copy is real: the copied slots hold the same K/V in the KV tensors;
# 4. how much memory sharing saves, measured with the engine's counters, for parallel sampling
#    and for beam search -- and how that relates to the paper's Figure 15.
#
# **What you need** Nothing beyond the package: everything here runs on a CPU in a few seconds.
# Without network (or without GPT-2 in the local Hugging Face cache) the chapter runs the offline
# `tiny-gpt2` (random weights, so the text is gibberish, but every block, refcount and copy is
# the real thing). On a GPU, or with GPT-2 available, the same cells run GPT-2 and the text reads
# as English; the block pictures keep the same shape, because the prompts are cut to fixed
# lengths in tokens.

# %%
from pagedlearn.cli.notebook import setup

env = setup()

# %%
from collections import Counter
from dataclasses import replace

import torch
from IPython.display import display

from pagedlearn import LLM, SamplingParams
from pagedlearn.engine.sampling_params import BeamSearchParams
from pagedlearn.sim.sharing import PAPER_FIG15, savings
from pagedlearn.viz import draw_block_pool, draw_block_tables
from pagedlearn.viz.state import pool_state

# %% [markdown]
# ## A prompt that ends in the middle of a block
#
# Blocks of 4 tokens keep the pictures small. We cut the prompt to 10 tokens: two full blocks and
# a last block with 2 of its 4 slots filled. That half-empty last block is where the samples will
# write their first tokens -- and where copy-on-write must happen.

# %%
BLOCK_SIZE = 4
MAX_TOKENS = 8 if env.quick else 16
llm = LLM(env.gpt2, num_blocks=24, block_size=BLOCK_SIZE, verbose=False)
engine = llm.engine
tok = llm.tokenizer

text = "The paged KV cache keeps keys and values in small blocks of memory, shared where possible."
prompt = tok.encode(text)[: 2 * BLOCK_SIZE + 2]  # token ids: 2 full blocks + 2 tokens
print(f"prompt: {len(prompt)} tokens = {tok.decode(prompt)!r}")
full, rest = divmod(len(prompt), BLOCK_SIZE)
print(f"blocks: {full} full" + (f" + 1 holding {rest} of {BLOCK_SIZE} tokens" if rest else ""))

# %% [markdown]
# ## Watching the block events
#
# The KV-cache manager announces every block operation on its trace (`engine.kv.trace`, see
# `pagedlearn/trace/events.py`). We keep three kinds: `incref` (a fork: the child shares all the
# parent's blocks), `cow_copy` (a sequence copies a shared block before writing into it) and
# `free` (a sequence finished or fell out of the beam). `engine.num_steps` counts the steps that
# have *finished*, so an event raised inside a step belongs to step `num_steps + 1`.


# %%
def watch(engine, kinds=("incref", "cow_copy", "free")):
    """Collect (step, event) for the block events of ``kinds``; returns the list it fills."""
    seen = []
    engine.kv.trace.subscribe(lambda e: e.kind in kinds and seen.append((engine.num_steps + 1, e)))
    return seen


events = watch(engine)
params = SamplingParams(n=3, temperature=0.8, seed=0, max_tokens=MAX_TOKENS, ignore_eos=True)
engine.add_request("s", prompt, params)

# Run until the first copy-on-write, keeping the pool as it was just before that step. A copy
# need not come at all (exercise 1), so stop too when the request has finished.
before = pool_state(engine)
while engine.has_unfinished_requests() and not any(e.kind == "cow_copy" for _, e in events):
    before = pool_state(engine)
    engine.step()
after = pool_state(engine)
copied = any(e.kind == "cow_copy" for _, e in events)
cow_step = engine.num_steps if copied else None

for step, e in events:
    print(f"step {step}: {e.kind:8s} blocks {e.blocks}  seqs {e.seqs}")
if copied:
    print(f"\nfirst copy-on-write in step {cow_step}")
else:
    print(f"\nno copy-on-write in the {engine.num_steps} steps the request ran")

# %% [markdown]
# Read the events in order:
#
# - **step 1** is the prefill: the prompt gets its blocks, the model computes their K/V, and the
#   sampler draws the first token of each of the 3 samples. The engine then **forks** sequence
#   `s.0` twice (`incref`): `s.1` and `s.2` get block tables that point at the very same
#   physical blocks. No KV is copied; the refcount of each block goes to 3.
# - **step 2** feeds each sample's first token to the model, so each must write one K/V into the
#   last block -- which all three share. The first two writers **copy** it (`cow_copy (src,
#   dst)`) and write into their private copy; the third finds itself the only owner left
#   (refcount 1) and writes in place. `n` sharers, `n - 1` copies.
#
# Here is the pool just before step 2 and just after it. Shared blocks are hatched with their
# refcount (`x3`); colours are requests (all three samples belong to request `s`).

# %%
copies = [e for step, e in events if e.kind == "cow_copy" and step == cow_step]
assert copies, "no copy-on-write to show (exercise 1?): rerun from the top with a 10-token prompt"
print("refcounts before:", {b.block_id: b.refcount for b in before.blocks if b.refcount})
print("refcounts after: ", {b.block_id: b.refcount for b in after.blocks if b.refcount})
print(f"copies in step {cow_step}: {[e.blocks for e in copies]} (n - 1 = {params.n - 1})")
display(draw_block_pool(before, per_row=8, title=f"before step {cow_step}: one prompt, 3 tables"))
draw_block_pool(after, per_row=8, title=f"after step {cow_step}: the last block copied twice")

# %% [markdown]
# The block tables tell the same story from the sequences' side (the paper's Figure 8): the
# logical blocks 0 and 1 of every sample still map to the same physical blocks; logical block 2
# now maps to a different physical block per sample.

# %%
display(draw_block_tables(before, title=f"block tables before step {cow_step}"))
draw_block_tables(after, title=f"block tables after step {cow_step}")

# %% [markdown]
# ### The copy is real
#
# The manager only hands out `(src, dst)` pairs; the engine applies them to the KV tensors
# (`engine.kv_cache.copy_blocks`) *before* the forward pass writes the new tokens. So in every
# layer, the slots that held prompt tokens are identical in the source block and its copies,
# and the next slot holds each sample's own new token.

# %%
cache = engine.kv_cache
used = len(prompt) % BLOCK_SIZE  # prompt slots in the copied block
src = copies[0].blocks[0]
for layer in range(cache.spec.num_layers):
    k = cache.key_cache(layer)  # (num_blocks, block_size, num_kv_heads, head_dim)
    same = all(torch.equal(k[src, :used], k[e.blocks[1], :used]) for e in copies)
    print(f"layer {layer}: prompt slots of block {src} equal in its copies: {same}")
new_tokens = {s: after.tables[s][-1] for s in after.tables}
print("each sample's first token went to slot", used, "of block", new_tokens)

# %% [markdown]
# ### Memory saved: one request with `n=3` vs three separate requests
#
# Let the request finish, and measure the **peak** number of blocks in use after a step (the
# engine publishes a `StepStats` after every step; `used_blocks` is what the scheduler has to
# find room for), and the mean over the steps. Then run the same work as three separate requests
# of `n=1`, first with prefix caching off (nothing shared: each sample holds its own copy of the
# prompt, as without block sharing), then on (pagedlearn's
# default: separate requests still share the prompt's *full* blocks through the hash, chapter
# 04, but each needs its own copy of the partly filled one). A longer prompt makes the
# difference visible.


# %%
def run(llm, requests):
    """Run ``requests`` [(id, prompt, params)] to the end; peak and mean blocks in use."""
    engine, used = llm.engine, []
    unsubscribe = engine.subscribe_stats(lambda s: used.append(s.used_blocks))
    for rid, p, sp in requests:
        engine.add_request(rid, p, sp)
    while engine.has_unfinished_requests():
        engine.step()
    unsubscribe()
    return max(used), sum(used) / len(used)


while engine.has_unfinished_requests():  # finish the n=3 request from above
    engine.step()

long_text = " ".join([text] * 4)
long_prompt = tok.encode(long_text)[: 10 * BLOCK_SIZE + 2]  # 10 full blocks + 2 tokens
one = [("n3", long_prompt, params)]
three = [(f"n1-{i}", long_prompt, replace(params, n=1, seed=i)) for i in range(3)]


def fresh_llm(**options):
    """A new engine with an empty pool of 64 blocks, so that runs do not disturb each other."""
    return LLM(env.gpt2, num_blocks=64, block_size=BLOCK_SIZE, verbose=False, **options)


rows = {
    "1 request, n=3 (fork)": run(fresh_llm(), one),
    "3 requests, caching off": run(fresh_llm(enable_prefix_caching=False), three),
    "3 requests, caching on": run(fresh_llm(), three),
}
base = rows["3 requests, caching off"][0]
print(f"prompt {len(long_prompt)} tokens, {MAX_TOKENS} new tokens per sample\n")
for name, (peak, mean) in rows.items():
    saved = 100 * (1 - peak / base)
    print(f"{name:24s} peak {peak:3d} blocks  mean {mean:5.1f}  peak saved {saved:4.1f}%")


# %% [markdown]
# The forked samples hold the prompt once; each sample owns only the blocks it wrote itself.
# The saving is largest when the prompt is long compared with the outputs -- try the exercises.
#
# Separate requests with prefix caching on reach the same peak here: they find the prompt's full
# blocks through their hashes, and the partly filled block ends up held once per sample either
# way. The difference is in *how*: `fork` shares every block at once, full or not, with no hash
# computed or looked up, and it works with caching off -- it is the mechanism that parallel
# sampling and beam search rely on, while the prefix cache (chapter 04) is a bet on future hits.
#
# ## Beam search: sharing that keeps changing
#
# Beam search forks too, but not only once: at every step the `beam_width` best continuations
# are chosen among all beams' candidates. A beam chosen twice is **forked** (the new beam shares
# all its blocks), a beam not chosen is **freed** (its private blocks go back to the pool; the
# blocks its siblings still share stay). So beams share a common past that grows and shrinks,
# the paper's Figure 9. We record every step and count the forks, copies and frees.

# %%
beam_llm = LLM(env.gpt2, num_blocks=32, block_size=BLOCK_SIZE, verbose=False)
beam_events = watch(beam_llm.engine)
beam_llm.engine.add_request(
    "beam", prompt, BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, ignore_eos=True)
)
frames = []  # the pool after every step in which beams were alive
while beam_llm.engine.has_unfinished_requests():
    beam_llm.engine.step()
    if (state := pool_state(beam_llm.engine)).tables:
        frames.append(state)


def physical(st):
    """Blocks in use: what the pool really holds."""
    return st.count("used") + st.count("shared")


def logical(st):
    """Entries of all block tables: what the sequences would hold without sharing."""
    return sum(len(t) for t in st.tables.values())


print("events:", dict(Counter(e.kind for _, e in beam_events)))
print("step  beams  physical blocks  logical blocks (no sharing)")
for st in frames:
    print(f"{st.step:4d}  {len(st.tables):5d}  {physical(st):15d}  {logical(st):14d}")

# %% [markdown]
# *Logical* blocks are the entries of all block tables: what the beams would hold if each kept
# its own copy. *Physical* blocks are the blocks actually in use. Here is the step where the
# beams share the most: several beams' tables point at one common past.

# %%
best = max(frames, key=lambda st: logical(st) - physical(st))
display(draw_block_pool(best, per_row=8, title=f"beam search, step {best.step}"))
draw_block_tables(best, title=f"beam tables, step {best.step}")

# %% [markdown]
# ## Relating this to the paper's Figure 15
#
# Figure 15 reports the memory saved by sharing over a whole workload (OPT-13B on Alpaca):
# `saved = 1 - (blocks in use) / (blocks without sharing)`, summed over all steps. We compute
# the same measure for our one beam-search request, and put the paper's numbers next to
# `pagedlearn.sim.sharing`, which replays an Alpaca-like workload through the same
# `KVCacheManager` (the numbers the README reports).


# %%
def saved_pct(states):
    """The Figure 15 measure over recorded states: 1 - physical / logical blocks, in %."""
    return 100 * (1 - sum(map(physical, states)) / sum(map(logical, states)))


print(f"this beam search (width 3, one request): {saved_pct(frames):.1f}% saved")
num_requests = 30 if env.quick else 200
print(f"\nAlpaca-like workload, simulated ({num_requests} requests) vs the paper:")
print("mode      width  ours   paper")
for mode in ("parallel", "beam"):
    for width, paper in PAPER_FIG15[("alpaca", mode)].items():
        ours = savings("alpaca", mode, width, num_requests=num_requests)
        print(f"{mode:8s}  {width:5d}  {ours:4.1f}%  {paper:5.2f}%")

# %% [markdown]
# Two things to read from this.
#
# - **Beam search saves far more than parallel sampling.** Samples share only their prompt and
#   then diverge for good; beams keep re-forking from the best beams, so they share much of
#   their *generated* past too. That is the paper's observation (Figure 15: 6-10% for parallel
#   sampling, 38-55% for beam search on Alpaca), and the shape our simulation reproduces.
# - **One request is not a workload.** The saving of a single request depends on its prompt
#   length against its output length and on the block size: a long prompt and short outputs
#   save the most. The paper's figure averages over thousands of Alpaca requests, with outputs
#   of their own lengths; a 10-token prompt with a random-weight model's beams is a picture of
#   the mechanism, not a measurement of it.

# %% [markdown]
# ## Exercises
#
# 1. Cut the prompt to `2 * BLOCK_SIZE` tokens (it then ends exactly on a block boundary), and
#    run the event cell again watching allocations too:
#    `events = watch(engine, ("incref", "cow_copy", "free", "allocate"))`. (If no copy comes,
#    the cell stops when the request finishes.) Does a `cow_copy` happen at all? Into which
#    block does each sample's first new token go, and is that block shared? (The cells after the
#    event cell need a copy to show: rerun from the top with the 10-token prompt afterwards.)
# 2. Change `n=3` to `n=5`. How many copies happen in the copy-on-write step? Check your answer
#    against the rule "`n` sharers, `n - 1` copies".
# 3. In the memory comparison, make the prompt 4x longer and the outputs 4x shorter, then the
#    other way round. How does the saving of `n=3` change? Relate it to Figure 15's Alpaca vs
#    ShareGPT difference (`PAPER_FIG15`).
# 4. Run `savings("alpaca", "beam", 4, divergence=d)` for each `d` in `(0, 0.1, 0.4)`
#    (`divergence_sweep` in `pagedlearn.sim.sharing` does this). What does `divergence` model,
#    and why does beam search save more when beams re-fork often?
