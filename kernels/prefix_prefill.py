"""Prefill/extend attention over a paged cache in Triton ("prefix prefill", as vLLM calls it).

A prompt's new tokens attend to every earlier token, including a prefix that is already in the
cache. That prefix may come from a prefix-cache hit: its K/V were written by an earlier request
and are not recomputed. Only the new tokens are queries. Their K/V are written into the cache first
(:func:`kernels.write_kv`), so keys come from one place, the paged cache, whatever their origin.

The queries of several sequences are packed into one tensor, as in vLLM and FlashAttention's
varlen API: sequence ``i`` owns rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``. Its new tokens are the
last ``query_len`` of its ``context_len`` keys, so query ``j`` sees keys
``key_pos <= context_len - query_len + j``: every cached key, and the new ones up to itself.

One program handles one (sequence, query head, tile of BLOCK_M queries); the loop over keys is
the decode kernel's loop (``kernels/decode_attention.py``) with a causal mask added. Checked
against :func:`pagedlearn.attention.paged_attention_prefill_ref`.

Sliding windows (``sliding_window=W``): query ``j`` also needs ``key_pos > q_pos - W``. The key
loop starts at the first key that the tile's earliest query sees, ``max(0, q_pos_0 - W + 1)``, so
the blocks wholly before it are never loaded and their table entries (-1 once freed) never read.
The tile's later queries see later keys only, so a row can meet whole tiles it must ignore: its
running max is still -inf after them, and ``exp(-inf - (-inf))`` would be NaN. The loop guards
that case (it cannot happen without a window: key 0 is visible to every row).
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
from kernels.decode_attention import NO_WINDOW
from pagedlearn.attention import paged_attention_prefill_ref as reference
from pagedlearn.attention.inputs import CacheShape, check_prefill

BLOCK_M = 32  # query rows per program


@triton.jit
def _paged_prefill_kernel(
    out_ptr,  # (total_query_tokens, num_heads, head_dim)
    q_ptr,  # (total_query_tokens, num_heads, head_dim)
    k_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim), contiguous
    v_cache_ptr,  # same
    block_tables_ptr,  # (num_seqs, max_blocks_per_seq)
    cu_seqlens_q_ptr,  # (num_seqs + 1,)
    context_lens_ptr,  # (num_seqs,), new tokens included
    scale,
    sliding_window,  # keys a query sees (itself included); NO_WINDOW for full attention
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_seq,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    m_tile = tl.program_id(2)

    # 1. This sequence's queries, and where they sit among its keys.
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= q_len:  # the grid is sized for the longest sequence
        return
    context_len = tl.load(context_lens_ptr + seq)
    prefix_len = context_len - q_len  # keys before the first new token (cached or not)

    # 2. Load a tile of queries: (BLOCK_M, HEAD_DIM_PAD).
    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # index among this sequence's new tokens
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)  # int64 before any multiply
    q_offs = rows[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix_len + offs_m  # each query's position; it sees keys in (q_pos - W, q_pos]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    # 3. Stream the keys this tile can see: from its first query's first key in the window
    #    (0 without one) up to its last query's position (causal).
    kv_start = tl.maximum(prefix_len + m_tile * BLOCK_M - sliding_window + 1, 0)
    kv_end = tl.minimum(context_len, prefix_len + (m_tile + 1) * BLOCK_M)
    offs_t = tl.arange(0, TILE_N)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    head_off = (head // GROUP).to(tl.int64) * stride_cache_head  # the KV head this head reads
    for tile_start in range(kv_start, kv_end, TILE_N):
        # 3a. Physical slots of this tile's tokens, through the block table.
        pos = tile_start + offs_t
        t_mask = pos < kv_end
        block_ids = tl.load(table_row + pos // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        slot_offs = block_ids * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot
        kv_offs = slot_offs[:, None] + head_off + offs_d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]

        # 3b. Scores (BLOCK_M, TILE_N), with the causal rule key_pos <= q_pos and the window's
        #     key_pos > q_pos - W.
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        visible = t_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))

        # 3c. Online softmax, as in the decode kernel. A row that has seen no visible key yet
        #     (under a window: its keys start in a later tile) keeps m = -inf; subtracting 0
        #     instead of -inf gives it alpha = 0 and p = 0, not exp(-inf + inf) = NaN.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # 4. Divide once and store the real rows (every one saw a key: itself; rows past the last
    #    query may have l_i = 0 and are not stored, but never divide by 0).
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offs = rows[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :]
    tl.store(
        out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :]
    )


def launch_constants(shape: CacheShape, dtype, interpreted: bool) -> dict:
    """The kernel's ``tl.constexpr`` arguments (and ``num_warps``) for these sizes.

    ``kernels.gpu_compile`` compiles with the same values, so what CI checks is what runs.
    """
    upcast, precision = dot_settings(dtype, interpreted)
    head_dim_pad = next_power_of_2(shape.head_dim)
    return {
        "BLOCK_SIZE": shape.block_size,
        "HEAD_DIM": shape.head_dim,
        "HEAD_DIM_PAD": head_dim_pad,
        "GROUP": shape.group_size,
        "BLOCK_M": BLOCK_M,
        "TILE_N": tile_tokens(head_dim_pad, dtype),
        "UPCAST": upcast,
        "DOT_PRECISION": precision,
        "num_warps": num_warps(head_dim_pad, dtype),  # a launch option, not a constexpr
    }


def paged_attention_prefill(
    q,
    key_cache,
    value_cache,
    block_tables,
    cu_seqlens_q,
    context_lens,
    scale=None,
    max_query_len=None,
    *,
    check_values=True,
    sliding_window=None,
):
    """Prefill/extend attention for packed new tokens over a paged KV cache, in Triton.

    q: ``(total_query_tokens, num_heads, head_dim)``, the new tokens of all sequences packed;
    key_cache, value_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``, contiguous, with
    the new tokens' K/V already written; block_tables: int32 ``(num_seqs, max_blocks_per_seq)``;
    cu_seqlens_q: int32 ``(num_seqs + 1,)``, running sum of query lengths starting at 0;
    context_lens: int32 ``(num_seqs,)``, all keys of each sequence (cached prefix + new tokens);
    scale: defaults to ``1 / sqrt(head_dim)``; max_query_len: the longest query length, if the
    caller knows it (otherwise it is read from ``cu_seqlens_q``, one device-to-host copy).
    sliding_window: ``None`` (full attention) or ``W >= 1``: query ``j`` sees the keys in
    ``(q_pos - W, q_pos]``; blocks before the first query's window are never read (may be -1).
    On the CPU the tables' values are checked unless ``check_values=False``.
    Returns ``(total_query_tokens, num_heads, head_dim)``, same result as
    :func:`pagedlearn.attention.paged_attention_prefill_ref`.
    """
    on_cpu = q.device.type == "cpu" if isinstance(q, torch.Tensor) else True
    check, window = on_cpu and check_values, sliding_window
    shape = check_prefill(
        q, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens, scale, check, window
    )
    caches = [("key_cache", key_cache), ("value_cache", value_cache)]
    interpreted = check_launchable(
        _paged_prefill_kernel, "paged_attention_prefill", "paged_attention_prefill_ref", q, caches
    )
    longest = None  # read from the device only when needed: it costs a sync
    if max_query_len is None or on_cpu:
        longest = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if len(context_lens) else 0
    if max_query_len is None:
        max_query_len = longest
    elif not isinstance(max_query_len, int) or isinstance(max_query_len, bool) or max_query_len < 0:
        raise ValueError(f"max_query_len must be a non-negative int, got {max_query_len!r}")
    elif longest is not None and max_query_len < longest:
        raise ValueError(f"max_query_len is {max_query_len} but a sequence has {longest} queries")

    # The kernel walks head_dim with stride 1 and the index tensors densely; copy rare views.
    q = q.contiguous() if q.stride(-1) != 1 else q
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    cu_seqlens_q = cu_seqlens_q.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    num_seqs = len(context_lens)
    if num_seqs == 0 or max_query_len == 0:
        return out
    grid = (num_seqs, shape.num_heads, triton.cdiv(max_query_len, BLOCK_M))
    _paged_prefill_kernel[grid](
        out,
        q,
        key_cache,
        value_cache,
        block_tables,
        cu_seqlens_q,
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
        **launch_constants(shape, q.dtype, interpreted),
    )
    return out


__all__ = ["launch_constants", "paged_attention_prefill", "reference"]
