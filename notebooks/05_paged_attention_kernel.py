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
# # 05 · The paged attention kernel
#
# At every decode step each sequence brings one new token, and that token's query attends to
# every key and value the sequence has cached. With PagedAttention those K/V are not in one
# contiguous run: they sit in fixed-size *blocks* scattered over one big slab, and a *block
# table* says where. This chapter walks from plain attention to the Triton kernel that reads
# through the block table, one step at a time, and checks every step against the one before.
#
# **What you will learn**
#
# - how a block table and a slot mapping place a sequence's K/V in the paged cache, and how
#   `gather_kv` reads them back in order;
# - that paged attention is ordinary attention over gathered K/V (`paged_attention_ref`);
# - the online softmax: a running max and a running sum that let a kernel stream K/V block by
#   block without ever holding a whole row of scores, and flash-decoding's splits;
# - how `kernels.paged_attention_decode` runs that loop in Triton (its tiles, padding and
#   masks), and why its wrapper checks the tensors before launching;
# - how the paper's own kernel (§5.1) and vLLM's first CUDA kernels differ from ours:
#   PagedAttention is reading K/V through a block table, not the online softmax;
# - the prefill/extend kernel over a prefix-cache hit, and the KV write (`write_kv`);
# - why decode is memory-bound (its arithmetic intensity, worked out), and, on a GPU, the
#   benchmark table: GB/s, and our kernel next to unpaged attention.
#
# **What you need**
#
# Only the project's environment. On a CPU the Triton kernels run in Triton's *interpreter*
# (`TRITON_INTERPRET=1`, which the first cell sets): the very same kernel code, executed one
# program at a time with NumPy. It is slow, so the shapes stay tiny, and its times say nothing
# about GPU speed. On a CUDA GPU the kernels are compiled, the check "at scale" uses a batch of
# long float16 contexts, and the last section prints the benchmark table.

# %%
from pagedlearn.cli.notebook import setup

env = setup()  # on a CPU: TRITON_INTERPRET=1, before anything imports Triton

# %%
import math
import time

import torch
import torch.nn.functional as F

from pagedlearn import KVCacheManager
from pagedlearn.attention import (
    contiguous_attention,
    gather_kv,
    paged_attention_batched,
    paged_attention_online_softmax_ref,
    paged_attention_prefill_ref,
    paged_attention_ref,
    write_kv_ref,
)

torch.manual_seed(0)
dev = env.device
H, KVH, D = 4, 2, 16  # query heads, KV heads, head_dim: tiny, so the interpreter is quick

# %% [markdown]
# ## 1. Attention on contiguous K/V: the ground truth
#
# Sequence A has 10 tokens in its cache. Its new token's query has 4 heads; the cache has 2 KV
# heads, so query heads 0-1 read KV head 0 and heads 2-3 read KV head 1 (grouped-query
# attention, GQA). `contiguous_attention` is softmax(q kᵀ / √d) v on K/V laid out in one run.
# We check it once against PyTorch's own `scaled_dot_product_attention`.

# %%
k_a = torch.randn(10, KVH, D, device=dev)  # (context_len, num_kv_heads, head_dim)
v_a = torch.randn(10, KVH, D, device=dev)
q_a = torch.randn(1, H, D, device=dev)  # (1 new token, num_heads, head_dim)
out_a = contiguous_attention(q_a, k_a, v_a)  # (1, num_heads, head_dim)

group = H // KVH  # query heads per KV head
sdpa = F.scaled_dot_product_attention(
    q_a.transpose(0, 1),  # (num_heads, 1, head_dim)
    k_a.repeat_interleave(group, dim=1).transpose(0, 1),  # (num_heads, 10, head_dim)
    v_a.repeat_interleave(group, dim=1).transpose(0, 1),
).transpose(0, 1)
torch.testing.assert_close(out_a, sdpa)
print("OK: contiguous_attention == torch's scaled_dot_product_attention", tuple(out_a.shape))

# %% [markdown]
# ## 2. The same K/V in blocks
#
# A server does not know how long a sequence will grow, so PagedAttention gives it blocks of
# `block_size` tokens one at a time, as it needs them. The KV-cache manager (`KVCacheManager`,
# the same one the engine uses) decides which physical block. Two sequences share a pool of 12
# blocks of 4 tokens: A arrives with a 6-token prompt, B with 9, then both decode 4 tokens,
# interleaved the way the engine steps them.

# %%
BS = 4  # block_size: tokens per block
NUM_BLOCKS = 48 // BS  # a pool of 48 token slots
kv = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BS, enable_prefix_caching=True)
tokens = {"A": list(range(100, 110)), "B": list(range(200, 213))}  # every token id, in order
kv.add_sequence("A", tokens["A"][:6])  # the prompts
kv.add_sequence("B", tokens["B"][:9])
for _ in range(4):  # decode: one token per sequence per step; a new block on a block boundary
    for seq in ("A", "B"):
        kv.append_token(seq, tokens[seq][kv.num_tokens(seq)])
for seq in ("A", "B"):
    print(f"{seq}: {kv.num_tokens(seq)} tokens, block table {kv.block_table(seq)}")
    print(f"   slot mapping {kv.slot_mapping(seq)}")

# %% [markdown]
# A's last block is not next to its first two: it was taken when A's 9th token arrived, after
# B had already taken the blocks in between. A token's *slot* is
# `block_id * block_size + offset`: that is where its key and value live in the slab.
#
# The slab itself is two tensors (K and V) of shape `(num_blocks, block_size, num_kv_heads,
# head_dim)`. We fill it with NaN first: any step below that read a slot nobody wrote would
# turn its result into NaN, and its check would fail. Then `write_kv_ref` puts each token's K/V
# at its slot (vLLM calls this `reshape_and_cache`).

# %%
key_cache = torch.full((NUM_BLOCKS, BS, KVH, D), float("nan"), device=dev)
value_cache = torch.full_like(key_cache, float("nan"))  # (num_blocks, block_size, KVH, D)
k_seq = {"A": k_a, "B": torch.randn(13, KVH, D, device=dev)}  # each sequence's K, contiguous
v_seq = {"A": v_a, "B": torch.randn(13, KVH, D, device=dev)}
for seq in ("A", "B"):
    slots = torch.tensor(kv.slot_mapping(seq), device=dev)  # (context_len,)
    write_kv_ref(k_seq[seq], v_seq[seq], key_cache, value_cache, slots)

written = ~key_cache[:, :, 0, 0].isnan()  # (num_blocks, block_size): which slots hold a token
for b in range(NUM_BLOCKS):
    print(f"block {b:2}: " + "".join("#" if w else "." for w in written[b].tolist()))

# %% [markdown]
# Kernels and references see only tensors: the caches, a padded `block_tables` tensor and the
# `context_lens` (`pagedlearn/attention/inputs.py` lists what every attention function reads;
# none of it names a sequence, a request or the manager). Turning the manager's lists into those
# tensors is the engine's job; rows are padded with -1, which is never read because each
# sequence reads only the blocks its length needs.
#
# `gather_kv` walks one row of the table: logical token `t` is in logical block `t // 4`, which
# the table maps to a physical block, at offset `t % 4`. It must give back exactly A's
# contiguous K and V.


# %%
def as_tensors(kv, seqs):
    """The manager's block tables and lengths as the tensors a kernel takes."""
    tables = [kv.block_table(s) for s in seqs]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    context_lens = torch.tensor([kv.num_tokens(s) for s in seqs], dtype=torch.int32)
    return block_tables.to(dev), context_lens.to(dev)  # (num_seqs, max_blocks), (num_seqs,)


seqs = ["A", "B"]
block_tables, context_lens = as_tensors(kv, seqs)
print("block_tables =", block_tables.tolist(), " context_lens =", context_lens.tolist())

k_gathered, v_gathered = gather_kv(key_cache, value_cache, block_tables[0], 10)  # (10, KVH, D)
torch.testing.assert_close(k_gathered, k_a)
torch.testing.assert_close(v_gathered, v_a)
print("OK: gather_kv through A's block table gives back A's contiguous K and V")

# %% [markdown]
# ## 3. Paged attention = gather, then attend
#
# `paged_attention_ref` does decode for a batch: one query per sequence, gather through its
# block table, then `contiguous_attention`. Same numbers as step 1, for every sequence.
# `paged_attention_batched` is the same without a Python loop over sequences (one padded gather
# and a masked softmax). The engine's CPU backend does the same gather and hands it to PyTorch's
# `scaled_dot_product_attention` (`pagedlearn/attention/sdpa.py`), tested against this function.

# %%
q = torch.cat([q_a, torch.randn(1, H, D, device=dev)])  # (num_seqs, num_heads, head_dim)
ref = paged_attention_ref(q, key_cache, value_cache, block_tables, context_lens)
expected = torch.cat(
    [contiguous_attention(q[i : i + 1], k_seq[s], v_seq[s]) for i, s in enumerate(seqs)]
)
torch.testing.assert_close(ref, expected)
print("OK: paged_attention_ref == contiguous_attention per sequence", tuple(ref.shape))
batched = paged_attention_batched(q, key_cache, value_cache, block_tables, context_lens)
torch.testing.assert_close(batched, ref)
print("OK: paged_attention_batched == paged_attention_ref")

# %% [markdown]
# ## 4. The online softmax: one block at a time
#
# Gathering first needs room for the whole context. A kernel cannot afford that: it streams
# K/V through a small on-chip buffer, a tile at a time, and the softmax needs the largest score
# of the *whole* row (to subtract it before `exp`, so nothing overflows) and the sum of all the
# exponentials (to divide by). One way out is to keep just the row of scores (one number per
# token, far less than K and V) and pass over it again: vLLM's first kernel does that (section
# 5 compares). The other never holds the row at all, the *online softmax*, and it is the one
# our kernel runs. It keeps three running values per query head:
#
# - `m_i`, the largest score seen so far;
# - `l_i`, the sum of `exp(score - m_i)` so far;
# - `acc`, the sum of `exp(score - m_i) * v` so far.
#
# When a new block brings a larger score, `m_i` grows and everything summed under the old one
# is scaled by `alpha = exp(m_old - m_new)`. At the end, `acc / l_i` is the softmax-weighted sum
# of the values. By hand, with one head, six scores in three blocks of two, and one-number values:

# %%
scores = torch.tensor([1.0, 3.0, 2.0, 5.0, 0.0, 4.0])  # one query head against 6 keys
values = torch.tensor([10.0, 20.0, 30.0, 40.0, 50.0, 60.0])  # a 1-number "value" per key
m_i, l_i, acc = float("-inf"), 0.0, 0.0
for blk in range(3):
    s, v = scores[2 * blk : 2 * blk + 2], values[2 * blk : 2 * blk + 2]  # this block only
    m_new = max(m_i, s.max().item())
    alpha = math.exp(m_i - m_new)  # 0 on the first block (m_i = -inf)
    p = torch.exp(s - m_new)
    l_i, acc, m_i = l_i * alpha + p.sum().item(), acc * alpha + (p * v).sum().item(), m_new
    print(f"block {blk}: scores {s.tolist()} -> m_i={m_i:.0f} alpha={alpha:.4f} "
          f"l_i={l_i:.4f} acc={acc:.3f}")  # fmt: skip
whole_row = (torch.softmax(scores, dim=0) * values).sum().item()
print(f"acc / l_i = {acc / l_i:.4f}; softmax of the whole row, weighted sum = {whole_row:.4f}")
assert math.isclose(acc / l_i, whole_row, rel_tol=1e-6)
print("OK: the running max / sum gives the whole-row softmax")

# %% [markdown]
# `paged_attention_online_softmax_ref` runs exactly this loop over the paged cache, block by
# block through the block table, for every sequence and head. With `num_splits > 1` it is
# *flash-decoding*: the blocks of a context are cut into slices that run independently (on a
# GPU, in parallel, which helps a small batch with long contexts), each ending with its own
# `(m_i, l_i, acc)`, merged exactly at the end.

# %%
online = paged_attention_online_softmax_ref(q, key_cache, value_cache, block_tables, context_lens)
torch.testing.assert_close(online, ref)
print("OK: online softmax, block by block == paged_attention_ref")
split = paged_attention_online_softmax_ref(
    q, key_cache, value_cache, block_tables, context_lens, num_splits=2
)
torch.testing.assert_close(split, ref)
print("OK: two splits merged (flash-decoding) == paged_attention_ref")

# %% [markdown]
# ## 5. The Triton decode kernel
#
# `kernels.paged_attention_decode` takes the same arguments as `paged_attention_ref` and gives
# the same result. One *program* (a GPU thread block) handles one (sequence, KV head, split);
# it loads the query heads that share that KV head, then walks the context a tile of tokens at
# a time: for each token, look up its physical block in the block table, load K, score, update
# the running max / sum / accumulator, load V, accumulate. On this machine it runs in the
# interpreter (see the first cell's line).

# %%
import kernels  # after setup(): Triton must see TRITON_INTERPRET first
from kernels import paged_attention_decode

out = paged_attention_decode(q, key_cache, value_cache, block_tables, context_lens)
torch.testing.assert_close(out, ref)
print("OK: Triton paged_attention_decode == paged_attention_ref")
out2 = paged_attention_decode(q, key_cache, value_cache, block_tables, context_lens, num_splits=2)
torch.testing.assert_close(out2, ref)
print("OK: ... with num_splits=2 (flash-decoding, then a second kernel merges the splits)")
print(f"grid: {len(seqs)} sequences x {KVH} KV heads x num_splits programs")

# %% [markdown]
# **Tiles, padding and masks.** The loop is written in a few sizes fixed at launch
# (`tl.constexpr`; `launch_constants` in `kernels/decode_attention.py` picks them), and masks
# make them safe for any length. The next cell prints them for this section's tensors.
#
# - `TILE_N`, the tokens of K/V one loop iteration handles (`tile_tokens` in
#   `kernels/backend.py`): 64 for fp16/bf16 rows up to head_dim 128, halved for float32 or
#   head_dim 256. Our tensors are float32, so 32. The tile does not depend on the block size:
#   with `BS = 4` one tile spans 8 blocks, and every token looks up its own block in the table
#   (`pos // BLOCK_SIZE`). A's 10 tokens and B's 13 each fit in one tile.
# - `GROUP_PAD`. A program loads the `GROUP` query heads that share its KV head (here 4 / 2 = 2)
#   as the rows of one matrix, so that each K/V tile read from memory serves all of them in one
#   `tl.dot`. `tl.dot` wants at least 16 rows, so the 2 rows are padded to 16: 14 rows of zeros,
#   computed and never stored. `HEAD_DIM_PAD` does the same for the columns (`tl.arange` needs
#   a power of two: a head_dim of 80 would be read as 128); our 16 needs no padding.
# - The masks. `t_mask = pos < end` switches off the tile positions past the sequence's length
#   (or past this split's share of it): 22 of A's 32. For those, neither the block-table entry
#   nor K/V is loaded (a masked load reads nothing and returns `other`), and the score is set to
#   `-inf`, so `exp` gives it weight 0. `d_mask` switches off padded head_dim columns and
#   `g_mask` padded query-head rows, when q is loaded and the output stored.

# %%
from kernels.decode_attention import launch_constants
from pagedlearn.attention.inputs import check_decode

shape = check_decode(q, key_cache, value_cache, block_tables, context_lens, None, False)
consts = launch_constants(shape, q.dtype, interpreted=not env.gpu, num_splits=1)["decode"]
names = ("BLOCK_SIZE", "HEAD_DIM", "HEAD_DIM_PAD", "GROUP", "GROUP_PAD", "TILE_N")
print({name: consts[name] for name in names})
assert (consts["TILE_N"], consts["GROUP"], consts["GROUP_PAD"]) == (32, 2, 16)  # as said above
TILE_N = consts["TILE_N"]
for seq, n in zip(seqs, context_lens.tolist(), strict=True):
    tiles = -(-n // TILE_N)  # ceil
    print(f"{seq}: {n} tokens -> {tiles} tile(s) of {TILE_N} positions, "
          f"{tiles * TILE_N - n} masked; one tile spans {TILE_N // BS} blocks of {BS}")  # fmt: skip

# %% [markdown]
# Now hold the kernel's inner loop next to step 4: it is the same update, on tiles of tokens
# that may span several blocks, with masked loads so that nothing past a sequence's length is
# read. The loop calls `_attend_tile` once per tile (a `@triton.jit` helper, inlined by
# Triton; lab 5 has you write it). This is the loop, then the helper's body, as they are in the
# file:

# %%
import inspect

from kernels import decode_attention

kernel = inspect.getsource(decode_attention._paged_decode_kernel.fn)
tile = inspect.getsource(decode_attention._attend_tile.fn)
loop = kernel[kernel.index("    for tile_start") : kernel.index("    # 4.")]
print(loop.replace("        # fmt: off\n", "").replace("        # fmt: on\n", "").rstrip())
print()
print(tile[tile.index("    # a.") :].rstrip())

# %% [markdown]
# **This is not the paper's kernel.** PagedAttention is the *indexing*: K and V read through
# a block table. How a kernel then computes the softmax is a separate choice, and the paper's
# is not ours. The paper's §4.1 writes attention block by block (each block's scores,
# normalised by a sum over all blocks, then each block's values weighted by them) without
# prescribing how a kernel orders that work. Its §5.1 says how vLLM's kernel does it: the
# attention kernel of FasterTransformer, adapted to read the KV cache through the block table
# and attend on the fly (block read fused into attention), with a GPU warp assigned to read
# each block so that its memory accesses coalesce, and sequences of different lengths in one
# batch. Two more kernels go with it: a fused reshape-and-block-write (our `write_kv`) and a
# fused block copy that batches copy-on-write's copies of many blocks into one launch.
#
# The rest is in vLLM's code, not in the paper: the CUDA kernels `paged_attention_v1` and
# `paged_attention_v2` in `csrc/attention/attention_kernels.cu` (vLLM's documentation walks
# through them under "vLLM Paged Attention", and now says that page no longer describes the
# code vLLM uses today). Side by side with ours:
#
# - **One GPU thread block handles**: vLLM, one (query head, sequence); ours, one (sequence,
#   KV head, split) with all `GROUP` query heads of that KV head.
# - **The unit of the loop**: vLLM, a KV block: each warp takes one block per iteration, and
#   in it a *thread group* (32 / block_size threads, at least 1) scores one token. Ours, a tile
#   of `TILE_N` tokens, however many blocks it spans, with one table lookup per token.
# - **The softmax**: vLLM v1 first writes every score of the row to shared memory (float32),
#   then finds their max, takes the exps and their sum, and normalises; a second pass over the
#   blocks sums the values weighted by them. Not online: the whole row of scores must fit in
#   shared memory. Ours: one pass over K and V with section 4's online softmax.
# - **Long contexts**: vLLM v2 cuts a context into partitions of 512 tokens, one thread block
#   each, keeping each partition's max and exp-sum; a separate reduce kernel merges them,
#   rescaled to the largest max. Ours: `num_splits` (flash-decoding), merged by log-sum-exp in
#   `_merge_splits_kernel`. The same idea.
# - **Cache layout**: vLLM's CUDA kernels, K as `(num_blocks, num_kv_heads, head_dim / x,
#   block_size, x)`, x being the elements in 16 bytes (8 in fp16), and V as `(num_blocks,
#   num_kv_heads, head_dim, block_size)`, shaped for their thread groups' loads. Ours, both
#   `(num_blocks, block_size, num_kv_heads, head_dim)`.
#
# Our kernel belongs to a later family: FlashAttention-style tiles with an online softmax, and
# flash-decoding's splits. vLLM's own Triton attention
# (`vllm/attention/ops/triton_unified_attention.py`) is built that way too: tiles of
# `TILE_SIZE` tokens looked up through the block table, a running max and sum.

# %% [markdown]
# **The files.** Each kernel file in `kernels/` holds three things: the `@triton.jit` kernel;
# its Python wrapper, which checks every argument and launches the grid; and the name of the
# pure-PyTorch reference the tests compare it to (`reference`). `backend.py` decides where
# kernels run (a GPU, or the CPU interpreter) and the tile sizes.

# %%
import sys
from pathlib import Path

for name in ("paged_attention_decode", "paged_attention_prefill", "write_kv"):
    module = sys.modules[getattr(kernels, name).__module__]
    print(
        f"kernels.{name:24} {Path(module.__file__).name:22} checked against "
        f"pagedlearn.attention.{module.reference.__name__}"
    )

# %% [markdown]
# Why does the wrapper check so much? A kernel cannot raise: an index past the end of a tensor
# reads whatever memory is there, or crashes the process far from the mistake. So the wrapper
# refuses bad tensors before launch, with an error naming the argument. Here, 3 query heads
# cannot share 2 KV heads:

# %%
from pagedlearn.errors import AttentionInputError

try:
    paged_attention_decode(q[:, :3], key_cache, value_cache, block_tables, context_lens)
except AttentionInputError as e:
    print("AttentionInputError:", e)

# %% [markdown]
# **Timing, honestly.** In the interpreter each program runs in Python and NumPy, one after
# the other, so on a CPU expect the kernel to be *slower* than the PyTorch reference, usually
# by far. On a GPU it is compiled, and only there do its times say anything about speed. Below:
# wall-clock times of the tiny case on this machine, best of a few runs. They are noisy: on a
# busy machine even the best run can be many times slower than on an idle one.


# %% tags=["timing"]
def best_seconds(fn, repeat=3):
    """Best wall-clock time of ``fn()`` over a few runs, after one warm-up (compiles on a GPU)."""
    fn()
    times = []
    for _ in range(repeat):
        if env.gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if env.gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


args = (q, key_cache, value_cache, block_tables, context_lens)
t_ref = best_seconds(lambda: paged_attention_ref(*args), repeat=5)
t_kernel = best_seconds(lambda: paged_attention_decode(*args), repeat=5)
where = "compiled on the GPU" if env.gpu else "in the Triton interpreter"
print(f"paged_attention_ref: {t_ref * 1e3:.2f} ms   paged_attention_decode ({where}): "
      f"{t_kernel * 1e3:.2f} ms")  # fmt: skip

# %% [markdown]
# ## 6. Prefill over a prefix-cache hit, and the KV write
#
# A new request C starts with the same 8 tokens as A, then 3 of its own. The manager has
# prefix caching on, so C's first two blocks are A's full blocks, shared (refcount 2): their
# K/V are not recomputed. Only C's 3 new tokens are *queries*; they attend to the 8 cached keys
# and, causally, to each other. A fourth request D is a fresh 5-token prompt, packed into the
# same call: the queries of all sequences sit in one tensor, and `cu_seqlens_q` (the running
# sum of query lengths) says which rows belong to whom.

# %%
tokens["C"] = [*tokens["A"][:8], 300, 301, 302]
tokens["D"] = [400, 401, 402, 403, 404]
cached = {s: kv.add_sequence(s, tokens[s]) for s in ("C", "D")}  # prompt tokens found cached
for s in ("C", "D"):
    print(f"{s}: block table {kv.block_table(s)}, {cached[s]} prompt tokens from the cache")
print("A's block table:", kv.block_table("A"))

# %% [markdown]
# First the KV write. The new tokens' K/V go to their slots (the slot mapping's tail; the
# cached prefix is already there). The Triton `write_kv` does it into the real cache, the
# reference into a copy, and the two caches must be equal, NaN in the same unused slots.

# %%
from kernels import paged_attention_prefill, write_kv

new = {"C": 3, "D": 5}  # new tokens per sequence
k_new = {s: torch.randn(n, KVH, D, device=dev) for s, n in new.items()}  # (n, KVH, D)
v_new = {s: torch.randn(n, KVH, D, device=dev) for s, n in new.items()}
slots = torch.tensor([x for s in new for x in kv.slot_mapping(s)[-new[s] :]], device=dev)
k_packed, v_packed = torch.cat(list(k_new.values())), torch.cat(list(v_new.values()))

key_copy, value_copy = key_cache.clone(), value_cache.clone()
write_kv_ref(k_packed, v_packed, key_copy, value_copy, slots)
write_kv(k_packed, v_packed, key_cache, value_cache, slots)  # Triton, into the real cache
torch.testing.assert_close(key_cache, key_copy, equal_nan=True)
torch.testing.assert_close(value_cache, value_copy, equal_nan=True)
print("OK: Triton write_kv == write_kv_ref, slots", slots.tolist())

# %% [markdown]
# Then prefill attention: the Triton kernel, the reference, and plain causal attention over
# C's full contiguous K/V (A's first 8 tokens, then C's 3 new ones) must all agree.

# %%
pre_seqs = ["C", "D"]
pre_tables, pre_lens = as_tensors(kv, pre_seqs)
q_pre = torch.randn(sum(new.values()), H, D, device=dev)  # (total new tokens, num_heads, D)
cu_seqlens_q = torch.tensor([0, new["C"], new["C"] + new["D"]], dtype=torch.int32, device=dev)

pre_ref = paged_attention_prefill_ref(
    q_pre, key_cache, value_cache, pre_tables, cu_seqlens_q, pre_lens
)
k_c, v_c = torch.cat([k_a[:8], k_new["C"]]), torch.cat([v_a[:8], v_new["C"]])  # (11, KVH, D)
torch.testing.assert_close(pre_ref[:3], contiguous_attention(q_pre[:3], k_c, v_c, causal=True))
torch.testing.assert_close(pre_ref[3:], contiguous_attention(q_pre[3:], k_new["D"], v_new["D"]))
print("OK: paged_attention_prefill_ref == causal contiguous attention (C over A's cached prefix)")
pre_out = paged_attention_prefill(q_pre, key_cache, value_cache, pre_tables, cu_seqlens_q, pre_lens)
torch.testing.assert_close(pre_out, pre_ref)
print("OK: Triton paged_attention_prefill == paged_attention_prefill_ref", tuple(pre_out.shape))

# %% [markdown]
# ## 7. At scale
#
# A bigger batch, built the same way: the manager hands out blocks as every sequence grows one
# token per step, so each sequence's blocks are interleaved with everyone else's. On a CPU this
# stays small (the interpreter); on a GPU it is a batch of long float16 contexts with GPU-sized
# heads.

# %% tags=["timing"]
if env.quick:
    num_seqs, max_len, big = 6, 120, dict(block_size=16, heads=(8, 2, 32), dtype=torch.float32)
else:
    num_seqs, max_len, big = 64, 4096, dict(block_size=16, heads=(32, 8, 128), dtype=torch.float16)
lens = torch.randint(max_len // 4, max_len + 1, (num_seqs,)).tolist()
bs, (h, kvh, d) = big["block_size"], big["heads"]
pool = KVCacheManager(num_blocks=sum(-(-n // bs) for n in lens), block_size=bs)
for i in range(num_seqs):
    pool.add_sequence(i, [0])
for t in range(1, max(lens)):  # one decode step: every sequence still growing gets a token
    for i in range(num_seqs):
        if t < lens[i]:
            pool.append_token(i, 0)
big_tables, big_lens = as_tensors(pool, list(range(num_seqs)))
cache_shape = (pool.allocator.num_blocks, bs, kvh, d)  # (num_blocks, block_size, KVH, D)
big_k = torch.randn(cache_shape, dtype=big["dtype"], device=dev)
big_v = torch.randn(cache_shape, dtype=big["dtype"], device=dev)
big_q = torch.randn(num_seqs, h, d, dtype=big["dtype"], device=dev)
print(f"{num_seqs} sequences of {min(lens)}-{max(lens)} tokens, {h} heads / {kvh} KV heads, "
      f"head_dim {d}, {big['dtype']}")  # fmt: skip
print("sequence 0's first blocks:", pool.block_table(0)[:6])

big_args = (big_q, big_k, big_v, big_tables, big_lens)
big_ref = paged_attention_ref(*big_args)
tol = 1e-5 if big["dtype"] == torch.float32 else 1e-2  # fp16 rounds the output
torch.testing.assert_close(
    paged_attention_decode(*big_args).float(), big_ref.float(), atol=tol, rtol=tol
)
print("OK: paged_attention_decode == paged_attention_ref at this size")
t_ref = best_seconds(lambda: paged_attention_ref(*big_args), repeat=3 if env.quick else 10)
t_kernel = best_seconds(lambda: paged_attention_decode(*big_args), repeat=3 if env.quick else 10)
print(f"paged_attention_ref: {t_ref * 1e3:.1f} ms   paged_attention_decode ({where}): "
      f"{t_kernel * 1e3:.1f} ms")  # fmt: skip

# %% [markdown]
# ## 8. Why decode is memory-bound
#
# Count what one decode call computes against what it must read (`decode_flops_and_bytes` in
# `pagedlearn/attention/references.py`; the formula is in its docstring). For every cached token,
# each query head takes a dot product with the key and adds the weighted value: 4 · head_dim FLOPs.
# For every cached token and KV head, K and V must come from memory: 2 · head_dim · elem_size
# bytes. Their ratio, the *arithmetic intensity*, is therefore about
# 2 · (num_heads / num_kv_heads) / elem_size FLOPs per byte (a little less on short contexts,
# where reading q and writing the output count too), and a bigger batch does not raise it:
# every sequence reads its own K/V. That is 1 for fp16 with as many KV heads as query heads, 4
# for fp16 with 4 query heads per KV head (GQA).
#
# A GPU's arithmetic units stay busy only above its *ridge point*, peak FLOP/s divided by memory
# bandwidth. The cell below takes NVIDIA's spec-sheet numbers for the H100 and H200 as
# assumptions (nothing in it is measured) and prints the ridge points, the intensity of this
# chapter's shapes, and, for the 16-bit rows, how long an H200 at its spec would take to read
# the bytes and to do the FLOPs. Look at how far below the ridge point every row sits: decode's
# speed is the speed at which it reads K and V, which is why the benchmark reports GB/s. (It is
# also why the zero rows `GROUP_PAD` adds are cheap: arithmetic is what decode has to spare.)

# %%
from pagedlearn.attention import decode_flops_and_bytes

# Assumptions: NVIDIA's data sheets for the SXM boards. Dense BF16/FP16 tensor-core peak (the
# sheets print twice it, "with sparsity") and HBM bandwidth (HBM3 on H100, HBM3e on H200).
SPEC = {"H100 SXM": (989e12, 3.35e12), "H200 SXM": (989e12, 4.8e12)}  # (FLOP/s, bytes/s)
for gpu, (peak_flops, peak_bw) in SPEC.items():
    print(f"{gpu}: ridge point = {peak_flops / 1e12:.0f} TFLOP/s / {peak_bw / 1e12:.2f} TB/s "
          f"= {peak_flops / peak_bw:.0f} FLOP/byte")  # fmt: skip

elem, dtype_name = big["dtype"].itemsize, str(big["dtype"]).removeprefix("torch.")
section7 = (big_lens.tolist(), h, kvh, d, elem)
cases = {  # name: (context_lens, num_heads, num_kv_heads, head_dim, elem_size)
    f"section 7's batch, {h}/{kvh} heads, d={d}, {dtype_name}": section7,
    "8 x 4096 tokens, 12/12 heads, d=64, fp16": ([4096] * 8, 12, 12, 64, 2),
    "8 x 4096 tokens, 32/8 heads, d=128, fp16": ([4096] * 8, 32, 8, 128, 2),
}
peak_flops, peak_bw = SPEC["H200 SXM"]
print("\nFLOP/byte = 4*tokens*num_heads*head_dim / ((2*tokens*num_kv_heads + 2*num_seqs*num_heads)"
      " * head_dim * elem_size)")  # fmt: skip
for name, args in cases.items():
    flops, nbytes = decode_flops_and_bytes(*args)
    line = f"{name:46} {flops / 1e6:7.1f} MFLOP / {nbytes / 1e6:6.1f} MB = {flops / nbytes:4.2f}"
    if args[-1] == 2:  # the spec's peak is for 16-bit operands
        read_us, compute_us = nbytes / peak_bw * 1e6, flops / peak_flops * 1e6
        line += f" | H200: read {read_us:5.1f} us, compute {compute_us:.2f} us"
    print(line)

# %% [markdown]
# ## 9. The benchmark table (GPU)
#
# `benchmarks/bench_attention.py` times the kernel for a few batch sizes and context lengths
# and prints its bandwidth (bytes of K/V, q and output divided by time: the count above, its
# formula printed with the table) as a fraction of the GPU's measured copy bandwidth. It also
# prints our time divided by that of PyTorch's `scaled_dot_product_attention` on the same K/V
# laid out contiguously (`xSDPA`): what reading through the block table costs *our* kernel
# against *that* baseline, on *your* GPU. SDPA is another kernel (PyTorch picks FlashAttention
# or another backend), so the ratio mixes the cost of paging with the difference between two
# kernels.
#
# It is not the paper's comparison. The paper's §7.2 (Figure 18a) measures its PagedAttention
# kernel against FasterTransformer's attention kernel, which reads contiguous K/V and from
# which vLLM's was adapted: 20-26% higher attention-kernel latency, which it puts down to
# accessing the block table, extra branches and variable sequence lengths. It adds that the
# overhead touches only the attention operator, and that vLLM still outperforms
# FasterTransformer end to end. Compare our `xSDPA` with that for its direction and rough
# size, not as the same measurement.
#
# Here it runs with `--quick` (fewer rows) and `--no-flex` (no FlexAttention column: it compiles
# FlexAttention for every row, which takes longer than all the rest).

# %%
import subprocess

if env.gpu:
    bench = subprocess.run(
        [sys.executable, "../benchmarks/bench_attention.py", "--quick", "--no-flex"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(bench.stdout, bench.stderr[-2000:] if bench.returncode else "")
else:
    print(
        "The benchmark table needs a CUDA GPU (the interpreter's times say nothing about GPU "
        "speed). On a GPU machine, run this notebook again, or from the repository root: "
        "`make bench`, or `python benchmarks/bench_attention.py --quick`."
    )

# %% [markdown]
# ## Exercises
#
# 1. In section 2, change `BS` to 1 and then to 8, and run everything again. How do the block
#    tables and slot mappings change, and do all the checks still pass? Count the empty slots
#    (`.`) in the map of the pool: how much does each block size waste, and where?
# 2. In the worked example of section 4, put the largest score in the *first* block instead of
#    the second. Which `alpha` values change, and why does the result not?
# 3. Call `paged_attention_decode` with `num_splits` from 1 to 8 on the section 7 batch and
#    check each against `big_ref`. On a GPU, time them with `best_seconds`: when do splits
#    help? (Read `suggest_num_splits` in `kernels/decode_attention.py`.)
# 4. After section 6, use `write_kv` to write random K/V (shape `(1, KVH, D)`) into the last
#    slot of the pool, which no sequence owns, and rerun the checks of section 3. Why does
#    nothing change? Now write into one of A's slots (see its slot mapping): which checks fail?
