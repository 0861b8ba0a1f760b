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
# # 02 · Block tables and the block allocator
#
# Chapter 01 showed what contiguous, max-length reservation wastes. PagedAttention's answer is the
# operating system's: cut the KV cache into fixed-size **blocks** (pages), give each sequence a
# **block table** (a page table) from its *logical* blocks to *physical* blocks anywhere in the
# pool, and hand blocks out only when tokens arrive. This chapter drives the memory manager that
# does it -- the very `KVCacheManager` the engine uses -- by hand, one operation at a time.
#
# **What you will learn**
#
# - logical blocks, physical blocks and **slots**: `slot = block_id * block_size + offset`, on a
#   12-token request whose block table is `[7, 2, 11]` (in the spirit of the paper's Figure 6);
# - the **free queue**: which block `allocate` hands out next, and why;
# - **allocation on demand** (a new block at each block boundary) and **freeing** (blocks go back
#   to the free queue);
# - `OutOfBlocksError` when the pool is full, and why a failed operation changes nothing;
# - the **block-size trade-off**: last-block waste vs block-table size, swept over block sizes
#   1 to 256 (the memory side of the paper's Figure 18b), and why vLLM picked 16.
#
# **What you need**: nothing but a CPU. No model runs in this chapter: token ids are made up,
# because the memory manager only counts them (the prefix cache, in chapter 04, is what reads
# them). On a GPU or with network, nothing changes here; only the sweep at the end uses more
# requests when `env.quick` is off.

# %%
from pagedlearn.cli.notebook import setup

env = setup()

# %% [markdown]
# ## A small pool
#
# The pool is `num_blocks` physical blocks of `block_size` token slots each. The manager hands out
# block *ids* only; the K/V tensors they index live in one slab per model
# (`pagedlearn/attention/kv_cache.py`, shape `(2, layers, num_blocks, block_size, kv_heads,
# head_dim)`), which the manager never touches. Here: 12 blocks of 4 slots, and six requests
# `A`..`F` whose prompts take 1 to 4 blocks each. A prompt of `n` tokens takes `ceil(n /
# block_size)` blocks, and only its last block can be partly empty.
#
# `kv.record()` starts recording every block event, so that we can replay this whole session at
# the end; `kv.mark_step(step=...)` after each operation marks a frame of that replay, numbered
# like an engine's steps: step 1 is the first operation (every picture and the replay name a
# frame by its step). `Palette.follow(kv)` watches those frames and gives each request a colour
# when it first appears, one that no request in the pool holds, so a request keeps its colour
# in every picture -- and the replay at the end, which runs the same rule over the same frames,
# agrees.

# %%
from pagedlearn import BlockAllocator, KVCacheManager, OutOfBlocksError, PagedLearnError
from pagedlearn.viz import Palette, draw_block_pool, draw_block_tables

kv = KVCacheManager(num_blocks=12, block_size=4)
log = kv.record()
palette = Palette.follow(kv)  # the colours of this session's frames, for every picture
step = 0


def mark():
    """End a step of the recorded session: a frame of the replay at the end."""
    global step
    step += 1
    kv.mark_step(step=step)


prompt_lens = {"A": 8, "B": 3, "C": 16, "D": 2, "E": 12, "F": 4}
for name, n in prompt_lens.items():
    kv.add_sequence(name, list(range(1, n + 1)))  # made-up token ids: only their count matters
    mark()
for name in kv.sequences():
    print(f"{name}: {kv.num_tokens(name):2d} tokens -> block table {kv.block_table(name)}")
print("free blocks:", kv.num_free_blocks, "of", kv.allocator.num_blocks)

# %%
draw_block_pool(kv, palette=palette, title="Six prompts fill the pool")

# %% [markdown]
# In the picture each cell is a physical block, coloured by the request that owns it; the fill
# level shows how many of its 4 slots hold KV (B's 3 tokens leave one slot of block 2 empty: that
# is paging's only waste, inside a sequence's *last* block).
#
# ## The free queue
#
# Requests finish in any order. Say D, then B, then F finish: `free_sequence` drops one reference
# from each of their blocks, and a block whose refcount reaches 0 joins the *back* of the free
# queue. `allocate` takes from the front, so the queue's order decides which physical blocks a
# new sequence gets.

# %%
for name in ("D", "B", "F"):
    kv.free_sequence(name)
    mark()
print("free queue (next allocation first):", kv.allocator.free_queue())

# %% [markdown]
# ## Logical blocks, physical blocks and slots
#
# Now request R arrives with a 12-token prompt. With block size 4 it needs 3 blocks, and the free
# queue hands out **7, 2, 11**, in that order (the paper's Figure 6 draws the same kind of
# scattered table; `pagedlearn/core/block_table.py` uses this one as its example). R sees its cache
# as contiguous -- token `i` is in *logical* block `i // 4` at offset `i % 4` -- and its block
# table maps logical block `j` to a physical block anywhere in the pool.
#
# The **slot** of a token is its row in the slab flattened to `(num_blocks * block_size, ...)`:
# `slot = block_table[i // block_size] * block_size + i % block_size`. The list of slots of the
# tokens being processed, the **slot mapping**, is what tells the model where to write each new
# token's K and V (the engine hands it to the `write_kv` kernel).

# %%
kv.add_sequence("R", list(range(101, 113)))
mark()
r_step = step  # the step R arrived in: we come back to it in the replay
print(f"step {r_step}: R arrived")
table, bs = kv.block_table("R"), kv.block_size
print("R's block table:", table)
print("R's slot mapping:", kv.slot_mapping("R"))
print("\ntoken  logical block  offset  physical block  slot = block * 4 + offset")
for i, slot in enumerate(kv.slot_mapping("R")):
    j, offset = divmod(i, bs)
    print(f"{i:5d}  {j:13d}  {offset:6d}  {table[j]:14d}  {table[j]} * {bs} + {offset} = {slot}")

# %%
draw_block_tables(kv, ["R"], palette=palette, title="R: logical blocks -> physical blocks 7, 2, 11")

# %%
draw_block_pool(kv, palette=palette, title="R's blocks are scattered; R never needs them adjacent")

# %% [markdown]
# Three things to notice. R's blocks are not adjacent and need not be: no *external*
# fragmentation, since any free block serves any sequence. R holds exactly the blocks its 12
# tokens fill, nothing reserved for tokens it has not generated yet. And the free blocks D, B and
# F left behind were reused at once, without moving anyone else's KV.
#
# ## A full pool: `OutOfBlocksError`, and nothing changes
#
# Every block is now in use. R's next token is position 12, the first of a new logical block, so
# it needs a new physical block -- and there is none. The manager raises `OutOfBlocksError`
# (a `PagedLearnError`), which tells a scheduler how many blocks it needed, how many are free and
# how many there are, so that it can wait, preempt another request, or reject. Every operation
# checks before it changes anything, so the failed append leaves the tables, refcounts and free
# queue exactly as they were; `check_invariants()` re-checks every rule of the manager (refcounts
# equal the number of tables pointing at a block, the free queue holds exactly the free blocks,
# ...) and raises naming the first one broken.

# %%
before = {s: kv.block_table(s) for s in kv.sequences()}
try:
    kv.append_token("R", 113)
except OutOfBlocksError as e:
    print(f"{type(e).__name__}: {e}")
    print(f"  needed={e.needed} free={e.free} total={e.total}")
kv.check_invariants()
unchanged = before == {s: kv.block_table(s) for s in kv.sequences()}
print("tables unchanged:", unchanged, "| R still has", kv.num_tokens("R"), "tokens")
print("allocation failures counted:", kv.stats()["allocation_failures"])

# %% [markdown]
# ## Freeing, then allocation on demand
#
# E finishes. Its three blocks go back to the free queue -- tail first (`free_sequence` frees a
# table back to front: the tail of a sequence is the least likely to be shared, so with prefix
# caching it should be the first evicted; chapter 04). Now R can grow. Watch it append eight
# generated tokens one at a time: each `append_token` returns the slot for the new token's K/V,
# and a new physical block is taken only when the last one is full (positions 12 and 16).

# %%
kv.free_sequence("E")
mark()
print("free queue after E finished:", kv.allocator.free_queue())
print("\npos  slot  new block?  R's block table")
for pos in range(12, 20):
    blocks_before = len(kv.block_table("R"))
    slot = kv.append_token("R", 113 + pos)
    mark()
    grew = len(kv.block_table("R")) > blocks_before
    print(f"{pos:3d}  {slot:4d}  {'yes' if grew else '':10s}  {kv.block_table('R')}")
kv.check_invariants()

# %%
draw_block_tables(kv, palette=palette, title="Every sequence's block table after R grew")

# %% [markdown]
# At most one block per sequence is partly empty -- its last -- so paging wastes fewer than
# `block_size` slots per sequence, however long it runs. When R finishes, all its blocks return to
# the free queue and are ready for the next request.

# %%
kv.free_sequence("R")
mark()
print("free queue after R finished:", kv.allocator.free_queue())
stats = kv.stats()
print({k: stats[k] for k in ("num_seqs", "used_blocks", "free_blocks", "allocation_failures")})
kv.check_invariants()

# %% [markdown]
# The manager is built on a block pool that knows only ids and refcounts: `BlockAllocator`'s rules
# (the very class the engine runs, and the one lab 1 asks you to write). You can use it
# alone: `allocate` is all-or-nothing, and freeing a block more times than it is referenced is an
# error, not a silent corruption.

# %%
pool = BlockAllocator(4)
ids = pool.allocate(3)
print("allocated", ids, "| free queue", pool.free_queue())
try:
    pool.allocate(2)
except OutOfBlocksError as e:
    print("allocate(2):", e, "| free queue still", pool.free_queue())
pool.free([ids[1]])
try:
    pool.free([ids[1]])
except PagedLearnError as e:
    print(f"second free of block {ids[1]}: {type(e).__name__}: {e}")

# %% [markdown]
# ## Replay the session
#
# Everything above was recorded as block events (`allocate`, `free`, ...) plus a `step` frame per
# operation. `ReplayView` rebuilds the pool from the events alone -- no manager -- and lets you
# scrub through the steps with the slider. `log.to_json()` is the same session as a file a lab
# can hand out.

# %%
from IPython.display import display

from pagedlearn.viz import ReplayView

print(f"{len(log)} events recorded, {sum(e.kind == 'step' for e in log.events)} frames")
replay = ReplayView(log)
display(replay)

# %% [markdown]
# The widget needs a live kernel. Its slider is named by step, like the frames we marked; beside
# the picture it lists the sequences in the pool with their colours. From code,
# `replay.show_step(s)` jumps to step `s` and `replay.state` is the pool there, rebuilt from
# events only: here the step where R arrived. The figure drawn from it has the replay's colours
# -- the same as the pictures above.

# %%
replay.show_step(r_step)
print(f"step {r_step}: R's replayed block table {replay.state.tables['R']}")
draw_block_pool(replay.state, title=f"Replayed from the event log: step {r_step}")

# %% [markdown]
# ## The block-size trade-off
#
# Which block size? Small blocks waste little: at most `block_size - 1` slots at the end of each
# sequence. But a sequence of `n` tokens needs `ceil(n / block_size)` block-table entries, each
# an indirection the attention kernel must follow, and what tiny blocks cost depends on how the
# kernel walks them. The paper's kernel (its §5.1) assigns a GPU warp to read each block, so a
# tiny block gives each warp little to read: §7.2 warns that with too small a block vLLM may not
# fully use the GPU's parallelism to read and process the KV cache. Our Triton kernel (chapter
# 05) does not go block by block: each step of its loop handles a tile of `TILE_N` tokens (64
# in fp16 for head_dim up to 128), whatever the block size, and looks up each token's block in
# the table. So tiny blocks cost it more distinct table entries to load and K/V rows spread over
# more places in the slab, not less work per step, nor a kernel launch per block. Large blocks
# are the reverse: short tables, but more slots wasted in last blocks, and less sharing (only
# *full* blocks can be shared by prefix caching).
#
# Let us measure both sides on the real manager. For ShareGPT-like and Alpaca-like requests (the
# paper's two workloads, lengths drawn to match its Figure 11 means; see
# `pagedlearn/sim/workloads.py`), admit every request at its final length (prompt + output) into a
# `KVCacheManager` with each block size, then read back the block tables: the entries per
# sequence, and the slots left empty in last blocks (internal fragmentation).

# %%
from pagedlearn.sim.workloads import paper_workload

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
n_requests = 300 if env.quick else 2000


def sweep(lengths):
    rows = []
    for bs in BLOCK_SIZES:
        kv_sweep = KVCacheManager(num_blocks=sum(lengths) // bs + len(lengths), block_size=bs)
        for i, n in enumerate(lengths):
            kv_sweep.add_sequence(i, [0] * n)
        entries = [len(kv_sweep.block_table(i)) for i in range(len(lengths))]
        slots = sum(entries) * bs  # slots held by the sequences
        rows.append(
            {
                "block_size": bs,
                "entries_per_seq": sum(entries) / len(lengths),
                "wasted_slots_per_seq": (slots - sum(lengths)) / len(lengths),
                "waste_pct": 100 * (slots - sum(lengths)) / slots,
            }
        )
    return rows


results = {}
for workload in ("sharegpt", "alpaca"):
    lengths = [r.final_len for r in paper_workload(workload, n_requests, seed=0)]
    results[workload] = sweep(lengths)
    print(
        f"{workload}-like: {len(lengths)} requests, mean length {sum(lengths) / len(lengths):.0f}"
    )
    print(" block  entries/seq  wasted slots/seq  waste % of held slots")
    for r in results[workload]:
        print(
            f"{r['block_size']:6d}  {r['entries_per_seq']:11.1f}  "
            f"{r['wasted_slots_per_seq']:16.1f}  {r['waste_pct']:20.1f}"
        )
at16 = {w: next(r for r in rows if r["block_size"] == 16) for w, rows in results.items()}
for w, r in at16.items():
    print(
        f"block 16, {w}-like: {r['entries_per_seq']:.1f} table entries per sequence "
        f"(1 per token: {results[w][0]['entries_per_seq']:.1f}), waste {r['waste_pct']:.1f}%"
    )

# %%
import matplotlib
from matplotlib.figure import Figure

OKABE_ITO = ["#0072B2", "#E69F00"]
with matplotlib.rc_context({"font.size": 11, "legend.fontsize": 10}):
    fig = Figure(figsize=(10, 4))
    waste_ax, table_ax = fig.subplots(1, 2)
    for color, (workload, rows) in zip(OKABE_ITO, results.items(), strict=True):
        sizes = [r["block_size"] for r in rows]
        kw = {"color": color, "marker": "o", "label": f"{workload}-like"}
        waste_ax.plot(sizes, [r["waste_pct"] for r in rows], **kw)
        table_ax.plot(sizes, [r["entries_per_seq"] for r in rows], **kw)
    waste_ax.set_ylabel("last-block waste, % of held slots")
    table_ax.set_ylabel("block-table entries per sequence")
    table_ax.set_yscale("log")
    for ax in (waste_ax, table_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(BLOCK_SIZES, [str(b) for b in BLOCK_SIZES])
        ax.set_xlabel("block size (tokens)")
        ax.axvline(16, color="grey", linestyle=":", label="vLLM default (16)")
        ax.legend()
    fig.suptitle("The block-size trade-off, measured on KVCacheManager")
    fig.tight_layout()
display(fig)

# %% [markdown]
# Waste grows with the block size and the table shrinks: one curve pays for the other. At 16
# (the last lines above) the tables are already about 16 times shorter than one entry per
# token, and the waste stays small for ShareGPT's long conversations; Alpaca's short requests
# feel large blocks much sooner, because a request shorter than a block wastes most of it.
#
# The same sweep *under load* is what the paper's Figure 18b is about: a saturated server whose
# running requests grow, finish and get preempted. `pagedlearn.sim.paper.figure18b` simulates it
# on the same manager and reports the average share of the pool lost to internal fragmentation,
# and how many requests fit in the batch (`mean_batch`; the simulator, like vLLM, runs at most
# 256 requests at once, so Alpaca's short requests hit that cap at the smallest block sizes).

# %%
from pagedlearn.sim import paper

n_sim = {"sharegpt": 300, "alpaca": 600} if env.quick else paper.NUM_REQUESTS
for workload in ("sharegpt", "alpaca"):
    print(f"\n{workload}-like, {n_sim[workload]} requests, OPT-13B's 12 GiB pool:")
    rows = paper.figure18b(workload, num_requests=n_sim[workload])
    print(
        paper.format_rows(
            [{k: r[k] for k in ("block_size", "internal", "mean_batch")} for r in rows]
        )
    )

# %% [markdown]
# What the paper found (§7.2, Figure 18b: vLLM's end-to-end latency on a GPU for each block
# size, ShareGPT and Alpaca traces at fixed request rates): with too small a block, vLLM may not
# fully use the GPU's parallelism when its kernel reads the KV cache; with too large a one,
# internal fragmentation grows and sharing becomes less likely. On ShareGPT sizes 16 to 128
# performed best; on Alpaca 16 and 32 did, and larger blocks degraded it badly because the
# sequences become shorter than a block. In practice, the authors write, "the block size 16 is
# large enough to efficiently utilize the GPU and small enough to avoid significant internal
# fragmentation in most workloads": vLLM's default is 16, and so is pagedlearn's
# (`LLM(..., block_size=16)`). Our memory side shows the same shape. The latency side needs a
# GPU: chapter 05 has our kernels and their benchmark.
#
# ## Exercises
#
# 1. Let the requests finish in a different order (say F, D, B instead of D, B, F). Predict R's
#    block table and slot mapping before you run the cells, then check.
# 2. Give R a 13-token prompt. How many blocks does it take, how many slots of its last block are
#    empty, and what is the last entry of its slot mapping? Does the pool still hold it?
# 3. In the sweep, suppose a block-table entry costs 4 bytes (an int32) and a wasted slot costs one
#    token of OPT-13B's KV (`paper.BYTES_PER_TOKEN`). Which block size minimises the total per
#    sequence for each workload? Why is the answer *not* what vLLM chose?
# 4. Call `kv.free_sequence("R")` a second time, and `BlockAllocator.incref` on a free block.
#    Read the errors, then run `kv.check_invariants()`: what did the failed calls change?
