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
# # Lab 5: The Triton decode kernel's inner loop
#
# **What you will build.** The arithmetic of `kernels/decode_attention.py`'s
# `_paged_decode_kernel`, the Triton kernel the engine calls for decode attention, in two
# exercises:
#
# 1. `tile`: `_attend_tile`, one iteration of the kernel's loop: load a tile of K/V through the
#    block table, score it, and fold it into the running max, sum and accumulator;
# 2. `finish`: `_split_result`, the end of the loop: divide once, and the log-sum-exp that
#    flash-decoding merges its splits by.
#
# It is lab 4's `paged_attention_online_softmax_ref` again, on a GPU's terms: a tile of
# `TILE_N` tokens instead of one block, the `GROUP` query heads that share a KV head as the
# rows of one matrix, loads guarded by masks instead of Python slicing.
#
# **The chapter it practises:** [05 · The paged attention kernel](
# ../05_paged_attention_kernel.ipynb), sections 4 and 5 ("The online softmax", "The Triton
# decode kernel", and its paragraph "Tiles, padding and masks"). Take lab 4 first.
#
# **How feedback works.** Each exercise cell defines your helper and ends with
# `check("<exercise>")`: the kernel is launched with **your** helper in place of the
# package's and compared with `paged_attention_ref` on small batches (shuffled blocks, NaN in
# every slot no token was written to, partly filled tiles, block sizes from 1 to 64, scores
# too large for a plain `exp`). It prints one line per check: `PASS`; `FAIL` with the launch,
# the first wrong sequence, the error, and the likely mistake; or `TODO` while the stub is
# still there. Without a CUDA GPU the kernel runs in Triton's *interpreter* on the CPU (the
# first cell turns it on): the same code, one program at a time, with NumPy -- slow, so the
# checks take a few seconds. With a GPU it is compiled and runs there.
#
# **Grade yourself** (the grader an instructor uses, with the points):
#
# ```
# python -m pagedlearn grade kernel 05_kernel.ipynb
# ```

# %%
from pagedlearn.cli.notebook import setup

env = setup()  # first: without a CUDA GPU it sets TRITON_INTERPRET=1 before Triton is imported

from pagedlearn.labs.feedback import start

check = start("kernel", globals())


# %% [markdown]
# ## Exercise `tile`: one tile of the online softmax
#
# One *program* of `_paged_decode_kernel` (read it in `kernels/decode_attention.py`) handles one
# (sequence, KV head, split). It loads `q`, the `GROUP` query heads that read this KV head, as
# a `(GROUP_PAD, HEAD_DIM_PAD)` matrix (padded with zero rows and columns up to the sizes
# `tl.dot` and `tl.arange` need), starts the running state -- `m_i = -inf`, `l_i = 0`,
# `acc = 0`, one row per query head -- and walks its tokens `start .. end - 1` a tile at a
# time:
#
# ```python
# for tile_start in range(start, end, TILE_N):
#     m_i, l_i, acc = _attend_tile(m_i, l_i, acc, q, tile_start, end, table_row, ...)
# ```
#
# **`_attend_tile`** is yours. Its docstring (kept in the cell) lists its arguments and the
# three steps; the Triton you need for them:
#
# - `tl.arange(0, TILE_N)` is the vector `0 .. TILE_N-1`; comparisons and arithmetic on vectors
#   work element by element, so the tile's positions and their mask are one line each;
# - a pointer plus a vector of offsets is a vector of pointers, and one `tl.load(ptrs,
#   mask=..., other=...)` reads them all; a masked-off lane reads nothing and yields `other`.
#   `table_row` is such a pointer (to block ids), and so are the caches (to K and V elements);
# - `x[:, None]` is a column and `y[None, :]` a row: `x[:, None] + y[None, :]` is a 2D grid, which
#   is how a tile's `(TILE_N, HEAD_DIM_PAD)` offsets and mask are built (with `d_mask` for the
#   padded columns);
# - `tl.dot(a, b, input_precision=DOT_PRECISION)` is a matrix product, `tl.trans` a transpose;
#   `tl.where(cond, x, y)` picks element by element. A masked load gives K = 0, hence a score
#   of 0, not `-inf`: masking the loads alone lets the missing tokens into the softmax;
# - per row: `tl.max(x, axis=1)`, `tl.sum(x, axis=1)`; element by element: `tl.maximum`,
#   `tl.exp`; `p @ v` is a `tl.dot` too, with `p` cast to V's dtype (`.to(v.dtype)`). Load K and V
#   in `q`'s dtype (`.to(q.dtype)`).
#
# Return `(m_new, l_i, acc)`. Triton inlines the call: a helper costs nothing on a GPU.
#
# The checks: one full tile; tiles cut short by the end; block sizes 1, 5 and 64 (a tile may
# span many blocks, or part of one); scores that grow from tile to tile; scores of +-150 (an
# `exp` that is not of a number `<= 0` overflows); and a handful of batches with splits and
# grouped-query heads.


# %% tags=["exercise"]
# Exercise 'tile': One tile of the online softmax, in Triton
@triton.jit
def _attend_tile(
    m_i,  # (GROUP_PAD,) float32: the largest score so far, per query head
    l_i,  # (GROUP_PAD,) float32: the sum of exp(score - m_i) so far
    acc,  # (GROUP_PAD, HEAD_DIM_PAD) float32: the sum of exp(score - m_i) * v so far
    q,  # (GROUP_PAD, HEAD_DIM_PAD): the query heads that read this KV head; padding rows are 0
    tile_start,  # the first token (logical position) of this tile
    end,  # this split's tokens end here: positions >= end are masked off
    table_row,  # pointer to this sequence's block-table row (physical block ids)
    k_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache_ptr,  # same
    head_off,  # where this KV head starts in a slot: kv_head * stride_head
    offs_d,  # (HEAD_DIM_PAD,): 0, 1, 2, ...
    d_mask,  # (HEAD_DIM_PAD,): offs_d < HEAD_DIM
    scale,
    stride_block,  # elements between two physical blocks of a cache
    stride_slot,  # elements between two slots (tokens) of a block
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold the tile of ``TILE_N`` tokens ``tile_start, tile_start + 1, ...`` into the running
    state; returns the new ``(m_i, l_i, acc)``.

    a. Token ``t`` is in logical block ``t // BLOCK_SIZE``, at offset ``t % BLOCK_SIZE``; the
       block table maps the logical block to a physical one, and the token's K/V start at
       ``physical * stride_block + offset * stride_slot + head_off`` (then ``offs_d``).
       Tokens at or past ``end`` -- the empty slots of a last block, or the next split's
       tokens -- are masked: their loads are skipped and their scores are -inf (weight 0).
    b. Scores ``q kᵀ * scale``, ``(GROUP_PAD, TILE_N)`` (``tl.dot``, with ``DOT_PRECISION``;
       load K and V in ``q``'s dtype).
    c. The new max is the larger of the old max and the tile's; whatever was summed under the
       old max (``l_i`` and ``acc``) is multiplied by ``alpha = exp(m_old - m_new)``, then this
       tile's ``p = exp(score - m_new)`` is added in: to ``l_i`` its sum, to ``acc`` ``p @ v``.
       Every tile has at least one unmasked token, so ``m_new`` is finite.
    """
    # a. Where each token of the tile lives.
    pos = tile_start + tl.arange(0, TILE_N)  # (TILE_N,)
    t_mask = pos < end
    block_ids = tl.load(table_row + pos // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
    slot_offs = block_ids * stride_block + (pos % BLOCK_SIZE) * stride_slot
    kv_offs = slot_offs[:, None] + head_off + offs_d[None, :]  # (TILE_N, HEAD_DIM_PAD)
    kv_mask = t_mask[:, None] & d_mask[None, :]

    # b. Scores of this tile, (GROUP_PAD, TILE_N); masked tokens score -inf (weight 0). K and V
    #    are loaded in q's dtype: float32 when the interpreter upcasts bfloat16 (see UPCAST).
    k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    s = tl.where(t_mask[None, :], s, float("-inf"))

    # c. Raise the running max and rescale what was summed under the old one.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)  # 0 on the first tile, where m_i = -inf
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


check("tile")


# %% [markdown]
# ## Exercise `finish`: divide once, and the split's log-sum-exp
#
# After the loop, `_split_result(m_i, l_i, acc)` returns `(out, lse)`: `out = acc / l_i`, the
# softmax-weighted sum of the values (one division per row, after the last tile), and
# `lse = m_i + log(l_i)`, the log of the sum of `exp(score)` over this split's tokens. With one
# split the kernel stores `out`; with several (flash-decoding), each split stores `out` and
# `lse`, and `_merge_splits_kernel` weights split `s` by `exp(lse_s - max lse)`.
#
# A split with no tokens (more splits than tiles), or a sequence with no keys, ends with
# `l_i = 0` and `m_i = -inf`: its `out` must be zeros and its `lse` `-inf` (weight 0) --
# never `0 / 0 = NaN`, which would spread through the merge (`tl.where` can pick a safe divisor
# where there are no keys).


# %% tags=["exercise"]
# Exercise 'finish': Divide once, and the split's log-sum-exp
@triton.jit
def _split_result(m_i, l_i, acc):
    """The end of the loop: ``(out, lse)``, the softmax-weighted sum ``acc / l_i`` (divided
    once, here) and the log-sum-exp of the scores ``m_i + log(l_i)``, per query head.

    A split with no tokens (or a sequence with no keys) has ``l_i = 0`` and ``m_i = -inf``: its
    ``out`` is zeros, never 0 / 0, and its ``lse`` is -inf, so that the merge of the splits
    (:func:`_merge_splits_kernel`) gives it weight 0.
    """
    has_keys = l_i > 0  # never divide by zero, nor take log(0)
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    return out, lse


check("finish")

# %% [markdown]
# ## Your kernel, end to end
#
# Both helpers yours, on one batch with grouped-query heads, for several `num_splits`: the
# largest difference from `paged_attention_ref` should be around 1e-6 (float32; the sums run in
# another order). (Not graded: the grader skips this cell.)

# %% tags=["demo"]
from kernels.decode_attention import launch_decode
from pagedlearn.attention import paged_attention_ref
from pagedlearn.labs.attention_cases import make_case
from pagedlearn.labs.kernel import student_kernel
from pagedlearn.labs.submission import Submission

yours = student_kernel(Submission(globals(), "your notebook"), "tile", "finish")
case = make_case([3, 40, 100], block_size=16, heads=8, kv_heads=2, device=env.device)
want = paged_attention_ref(*case.args())
for num_splits in (1, 2, 4):
    got = launch_decode(yours, *case.args(), None, num_splits)
    print(f"num_splits={num_splits}: max |yours - paged_attention_ref| = "
          f"{(got - want).abs().max().item():.1e}")  # fmt: skip
