"""Paged-attention decode in Triton: one new token per sequence attends to its paged K/V.

Read it beside :func:`pagedlearn.attention.paged_attention_online_softmax_ref`, the PyTorch loop it
runs, and check it against :func:`pagedlearn.attention.paged_attention_ref`, its reference (the
tests do). One program handles one (sequence, KV head, split):

1. find which tokens of the context this split covers: the last ``sliding_window`` of them
   under a window, all of them without one;
2. load the query heads that share this KV head (GQA: they are processed together, so each K/V
   tile is read from memory once for the whole group);
3. loop over the sequence's logical blocks a tile of tokens at a time (``backend.tile_tokens``):
   look up each token's physical block in the block table, load K, score, update the running
   max / sum / accumulator, load V, accumulate (one tile: :func:`_attend_tile`);
4. divide once at the end (one split), or write the partial result and its log-sum-exp for
   :func:`_merge_splits_kernel` to combine (flash-decoding, ``num_splits > 1``; both:
   :func:`_split_result`).

These two ``@triton.jit`` helpers are what the ``kernel`` lab has students write. Triton inlines
a call to a jit function, so they cost nothing on a GPU.

Sliding windows (``sliding_window=W``): the new token, at position ``context_len - 1``, sees the
keys at positions ``context_len - W .. context_len - 1``. Step 1 starts the first tile at
``max(0, context_len - W)`` instead of 0, so every tile lies inside the window: the blocks wholly
before it are never loaded, and their block-table entries (-1 once the KV-cache manager freed
them) are never read. Nothing else changes, ``_attend_tile`` included: it already takes any
``tile_start``. A decode step then reads at most ``ceil((W - 1) / block_size) + 1`` blocks per
sequence instead of ``ceil(context_len / block_size)``, so its time, bound by memory bandwidth,
stops growing with the context (``benchmarks/bench_sliding_window.py`` counts the blocks).
With ``num_splits > 1`` the splits share the window's tokens.
"""

import torch
import triton
import triton.language as tl

from kernels.backend import (
    check_launchable,
    dot_settings,
    next_power_of_2,
    num_warps,
    tile_tokens,
)
from pagedlearn.attention import paged_attention_ref as reference  # what the tests compare to
from pagedlearn.attention.inputs import CacheShape, check_decode

MAX_SPLITS = 64
NO_WINDOW = 2**31 - 1  # the kernels' sliding_window for full attention: longer than any context


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


@triton.jit
def _paged_decode_kernel(
    out_ptr,  # (num_seqs, num_heads, head_dim), written when NUM_SPLITS == 1
    part_out_ptr,  # (num_seqs, num_heads, NUM_SPLITS, head_dim) float32: each split's acc / l
    part_lse_ptr,  # (num_seqs, num_heads, NUM_SPLITS) float32: each split's m + log(l)
    q_ptr,  # (num_seqs, num_heads, head_dim)
    k_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim), contiguous
    v_cache_ptr,  # same
    block_tables_ptr,  # (num_seqs, max_blocks_per_seq) int32/int64
    context_lens_ptr,  # (num_seqs,)
    scale,
    sliding_window,  # keys a query sees (itself included); NO_WINDOW for full attention
    stride_q_seq,
    stride_q_head,
    stride_o_seq,
    stride_o_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_seq,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two >= 16
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two >= 16 (tl.dot's minimum)
    TILE_N: tl.constexpr,  # tokens per loop iteration
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,  # bf16 in the interpreter: compute the dots in float32
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32, so a GPU does not round to TF32
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # 1. This split covers tokens [start, end) of the window, cut at whole tiles. The window is
    #    the last `sliding_window` tokens (all of them without one): whatever lies before it,
    #    its blocks and their table entries, is never touched.
    context_len = tl.load(context_lens_ptr + seq)
    window_start = tl.maximum(context_len - sliding_window, 0)
    per_split = tl.cdiv(tl.cdiv(context_len - window_start, NUM_SPLITS), TILE_N) * TILE_N
    start = window_start + split * per_split
    end = tl.minimum(start + per_split, context_len)  # start >= end: an empty split

    # 2. The GROUP query heads that read this KV head: (GROUP_PAD, HEAD_DIM_PAD), padding zeroed.
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    seq64 = seq.to(tl.int64)  # int64 before any multiply: offsets can pass 2**31
    q_offs = seq64 * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Online-softmax state, float32, one row per query head.
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max of the scores
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)  # running sum of exp(score - m_i)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)  # running sum of exp(...) * v

    # 3. Stream the split's tokens through the running state, a tile at a time.
    table_row = block_tables_ptr + seq64 * stride_table_seq
    head_off = kv_head.to(tl.int64) * stride_cache_head
    for tile_start in range(start, end, TILE_N):
        # fmt: off
        m_i, l_i, acc = _attend_tile(
            m_i, l_i, acc, q, tile_start, end, table_row, k_cache_ptr, v_cache_ptr, head_off,
            offs_d, d_mask, scale, stride_cache_block, stride_cache_slot,
            BLOCK_SIZE, TILE_N, DOT_PRECISION,
        )
        # fmt: on

    # 4. Divide once; one split writes its result, several write theirs and their log-sum-exp.
    out, lse = _split_result(m_i, l_i, acc)
    io_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        o_offs = seq64 * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        row = (seq64 * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split  # (GROUP_PAD,)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=io_mask)
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # (num_seqs, num_heads, head_dim)
    part_out_ptr,  # (num_seqs, num_heads, NUM_SPLITS, head_dim) float32
    part_lse_ptr,  # (num_seqs, num_heads, NUM_SPLITS) float32
    stride_o_seq,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Combine the splits of one (sequence, head): out = sum_s w_s * out_s / sum_s w_s, with
    w_s = l_s * exp(m_s - M) = exp(lse_s - M) and M the largest lse (for stability)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # no keys at all: weights all 0
    w = tl.exp(lse - lse_max)  # (SPLITS_PAD,); 0 for empty splits
    parts_offs = (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :]
    parts = tl.load(part_out_ptr + parts_offs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)
    o_offs = seq * stride_o_seq + head * stride_o_head + offs_d
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def suggest_num_splits(num_seqs, num_kv_heads, max_context_len, num_sms, min_tokens=256):
    """A ``num_splits`` that keeps a GPU busy: about two programs per streaming multiprocessor.

    Without splits the decode grid has ``num_seqs * num_kv_heads`` programs; a batch of 1 with 12
    KV heads would use 12 of a GPU's ~100 SMs, each streaming a whole context. Splitting the
    context gives each SM work, at the price of a small merge; a split shorter than
    ``min_tokens`` tokens is not worth it.
    """
    programs = max(num_seqs * num_kv_heads, 1)
    wanted = -(-2 * num_sms // programs)
    worth_it = max(max_context_len // min_tokens, 1)
    return max(1, min(wanted, worth_it, MAX_SPLITS))


def launch_constants(shape: CacheShape, dtype, interpreted: bool, num_splits: int) -> dict:
    """The ``tl.constexpr`` arguments (and ``num_warps``) of both kernels, for these sizes.

    ``kernels.gpu_compile`` compiles with the same values, so what CI checks is what runs.
    """
    upcast, precision = dot_settings(dtype, interpreted)
    head_dim_pad = next_power_of_2(shape.head_dim)
    decode = {
        "BLOCK_SIZE": shape.block_size,
        "HEAD_DIM": shape.head_dim,
        "HEAD_DIM_PAD": head_dim_pad,
        "GROUP": shape.group_size,
        "GROUP_PAD": next_power_of_2(shape.group_size),
        "TILE_N": tile_tokens(head_dim_pad, dtype),
        "NUM_SPLITS": num_splits,
        "UPCAST": upcast,
        "DOT_PRECISION": precision,
        "num_warps": num_warps(head_dim_pad, dtype),  # a launch option, not a constexpr
    }
    merge = {
        "HEAD_DIM": shape.head_dim,
        "HEAD_DIM_PAD": head_dim_pad,
        "NUM_SPLITS": num_splits,
        "SPLITS_PAD": triton.next_power_of_2(num_splits),
    }
    return {"decode": decode, "merge": merge}


def paged_attention_decode(
    q,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    scale=None,
    num_splits=1,
    *,
    sliding_window=None,
):
    """Decode attention over a paged KV cache, in Triton. Same signature and result as
    :func:`pagedlearn.attention.paged_attention_ref`.

    q: ``(num_seqs, num_heads, head_dim)``, one query token per sequence;
    key_cache, value_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``, contiguous;
    block_tables: int32 ``(num_seqs, max_blocks_per_seq)``; context_lens: int32 ``(num_seqs,)``;
    scale: defaults to ``1 / sqrt(head_dim)``; num_splits: 1 for one pass over each context, or
    more for flash-decoding (each sequence's context is cut into ``num_splits`` slices processed
    in parallel, then merged: worth it when ``num_seqs * num_kv_heads`` is too small to fill a GPU).
    Returns ``(num_seqs, num_heads, head_dim)`` in q's dtype; a sequence with no keys gets zeros.
    sliding_window: ``None`` (full attention) or ``W >= 1``: the new token sees its last ``W``
    keys, and the blocks before them are never read (their table entries may be -1).

    Any block size works; head_dim up to 256; float16, bfloat16 or float32. Bad input raises
    :class:`~pagedlearn.errors.AttentionInputError` (a ``ValueError``) before anything runs. The
    *values* of ``block_tables`` / ``context_lens`` are checked on the CPU only (see
    :mod:`pagedlearn.attention.inputs`).
    """
    args = (q, key_cache, value_cache, block_tables, context_lens, scale, num_splits)
    return launch_decode(_paged_decode_kernel, *args, sliding_window=sliding_window)


def launch_decode(
    kernel,
    q,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    scale=None,
    num_splits=1,
    *,
    sliding_window=None,
):
    """:func:`paged_attention_decode`, launching ``kernel``: ``_paged_decode_kernel`` or a
    kernel with its parameters (the kernel lab launches one whose loop is the student's)."""
    on_cpu = q.device.type == "cpu" if isinstance(q, torch.Tensor) else True
    window = sliding_window
    shape = check_decode(
        q, key_cache, value_cache, block_tables, context_lens, scale, on_cpu, window
    )
    if not isinstance(num_splits, int) or isinstance(num_splits, bool):
        raise ValueError(f"num_splits must be an int, got {num_splits!r}")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be between 1 and {MAX_SPLITS}, got {num_splits}")
    caches = [("key_cache", key_cache), ("value_cache", value_cache)]
    interpreted = check_launchable(
        kernel, "paged_attention_decode", "paged_attention_ref", q, caches
    )
    constants = launch_constants(shape, q.dtype, interpreted, num_splits)

    num_seqs, num_heads, head_dim = q.shape
    # The kernel walks head_dim with stride 1 and the index tensors densely; copy rare views.
    q = q.contiguous() if q.stride(-1) != 1 else q
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    if num_splits > 1:
        f32 = {"dtype": torch.float32, "device": q.device}
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, **f32)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, **f32)
    else:  # unused by the kernel; any tensor will do
        part_out = part_lse = out
    kernel[(num_seqs, shape.num_kv_heads, num_splits)](
        out,
        part_out,
        part_lse,
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        shape.scale,
        NO_WINDOW if window is None else min(int(window), NO_WINDOW),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        **constants["decode"],
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            out,
            part_out,
            part_lse,
            out.stride(0),
            out.stride(1),
            **constants["merge"],
        )
    return out


__all__ = ["launch_constants", "paged_attention_decode", "reference", "suggest_num_splits"]
