"""Pure-PyTorch attention references, from plain attention to the loop a paged kernel runs.

Read them in order; each computes the same numbers as the one before, a step closer to a kernel:

1. :func:`contiguous_attention` -- softmax(q kᵀ · scale) v on contiguous K/V. Ground truth.
2. :func:`paged_attention_ref` -- decode over a *paged* cache: gather each sequence's K/V through
   its block table, then (1). This is what PagedAttention changes: K/V live in fixed-size blocks
   anywhere in one big slab, and a block table says where.
3. :func:`paged_attention_online_softmax_ref` -- the same result block by block, never holding a
   whole row of scores: a running max ``m_i``, a running sum ``l_i`` and an accumulator ``acc`` that
   is rescaled whenever the max grows. This is the loop of ``kernels.paged_attention_decode``;
   hold the two side by side. With ``num_splits > 1`` it is flash-decoding: independent partial
   results over slices of the context, merged by their log-sum-exp.
4. :func:`paged_attention_prefill_ref` -- prefill/extend: several new tokens per sequence whose
   first ``context_len - query_len`` keys are already cached (a prefix-cache hit), attending
   causally to the cached prefix and to each other.
5. :func:`paged_attention_batched` -- (2) for all sequences at once, as tensor operations: gather
   every padded block-table row, mask what lies past each length. No Python loop over sequences;
   the ``"reference"`` backend runs it for decode. The engine's default ``"torch"`` backend does
   the same with one SDPA call per layer, planned once per step (attention/sdpa.py, checked
   against these functions by tests/test_attention_sdpa.py).

Plus :func:`write_kv_ref`, the KV write ("reshape_and_cache"): token ``i``'s K/V go to slot
``slot_mapping[i]`` = ``block_id * block_size + offset``; a negative slot means "skip" (padding);
and :func:`decode_flops_and_bytes`, the arithmetic that says why decode is memory-bound.

Sliding windows: every attention function takes ``sliding_window=W`` (``None``: full attention;
``write_kv_ref`` and the FLOP count have no window to take). The query
at position ``p`` then sees only the keys at ``p - W < key_pos <= p``; the mask drops the keys
before the window, and the paged functions do not even read their blocks, starting at the block
that holds the first visible key (:func:`~pagedlearn.attention.inputs.first_visible_key`). That
is what frees memory: a key left behind by the window of a sequence's earliest query will never
be read again, so the KV-cache manager gives its block back to the pool (its table entry becomes
-1, which nothing here reads), and a decoding sequence holds at most ``ceil(W / block_size) + 1``
blocks however long it grows (a prefill step holds the blocks of every key its queries see).

Shapes use the cache layout of :mod:`pagedlearn.attention.inputs`:
``key_cache, value_cache: (num_blocks, block_size, num_kv_heads, head_dim)``. Everything is
computed in float32 and returned in the queries' dtype.
"""

import torch

from pagedlearn.attention.inputs import (
    check_decode,
    check_prefill,
    check_sliding_window,
    check_write_kv,
    first_visible_key,
)
from pagedlearn.errors import AttentionInputError


def contiguous_attention(q, k, v, scale=None, causal=True, *, sliding_window=None):
    """Plain softmax attention, the ground truth every other function is checked against.

    q: ``(q_len, num_heads, head_dim)``; k, v: ``(kv_len, num_kv_heads, head_dim)``.
    Returns ``(q_len, num_heads, head_dim)`` in q's dtype.

    The ``q_len`` queries are the *last* ``q_len`` of the ``kv_len`` positions, so with
    ``causal=True`` query ``i`` sees keys ``j <= kv_len - q_len + i`` ("bottom-right" alignment;
    note that ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` aligns top-left,
    which is wrong as soon as a prefix is cached). Query heads ``h`` read KV head
    ``h // (num_heads // num_kv_heads)`` (grouped-query attention). No keys -> zeros.
    ``sliding_window=W`` also hides the keys ``j <= kv_len - q_len + i - W`` from query ``i``
    (it sees ``W`` keys at most, itself included); it needs ``causal=True``.

    >>> q = torch.zeros(1, 2, 4); k = torch.zeros(3, 1, 4); v = torch.arange(12.0).view(3, 1, 4)
    >>> contiguous_attention(q, k, v)[0, 0]  # equal scores: the mean of the three values
    tensor([4., 5., 6., 7.])
    >>> contiguous_attention(q, k, v, sliding_window=2)[0, 0]  # the last two values only
    tensor([6., 7., 8., 9.])
    """
    sliding_window = check_sliding_window(sliding_window)
    if sliding_window is not None and not causal:
        raise AttentionInputError("sliding_window needs causal=True: a window looks back only")
    q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads, _ = k.shape
    if scale is None:
        scale = head_dim**-0.5
    if kv_len == 0:
        return torch.zeros_like(q)
    group = num_heads // num_kv_heads
    qf = q.float().transpose(0, 1)  # (num_heads, q_len, head_dim)
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # (num_heads, kv_len, head_dim)
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = qf @ kf.transpose(1, 2) * scale  # (num_heads, q_len, kv_len)
    if causal:
        q_pos = torch.arange(q_len, device=q.device) + (kv_len - q_len)
        key_pos = torch.arange(kv_len, device=q.device)[None, :]
        visible = key_pos <= q_pos[:, None]  # (q_len, kv_len)
        if sliding_window is not None:
            visible &= key_pos > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf  # (num_heads, q_len, head_dim)
    return out.transpose(0, 1).to(q.dtype)


def gather_kv(key_cache, value_cache, block_table, context_len):
    """One sequence's K/V made contiguous: ``(context_len, num_kv_heads, head_dim)`` each.

    Logical token ``t`` lives in logical block ``t // block_size``, which the table maps to a
    physical block, at offset ``t % block_size`` inside it. (Under a sliding window the callers
    pass the row from the first block in the window on, ``block_table[first:]``, and the length
    from there: the blocks before it may be freed.)
    """
    block_size = key_cache.shape[1]
    num_blocks = -(-context_len // block_size)  # ceil: the last block may be partly filled
    ids = block_table[:num_blocks].long()  # (num_blocks,) physical ids, in logical order
    k = key_cache[ids].flatten(0, 1)[:context_len]  # (num_blocks * block_size, ...) -> trimmed
    v = value_cache[ids].flatten(0, 1)[:context_len]
    return k, v


def paged_attention_ref(
    q, key_cache, value_cache, block_tables, context_lens, scale=None, *, sliding_window=None
):
    """Decode attention over a paged KV cache: gather, then :func:`contiguous_attention`.

    q: ``(num_seqs, num_heads, head_dim)``, one new token per sequence;
    key_cache, value_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``;
    block_tables: int ``(num_seqs, max_blocks_per_seq)``; context_lens: int ``(num_seqs,)``.
    Returns ``(num_seqs, num_heads, head_dim)``. ``scale`` defaults to ``1 / sqrt(head_dim)``.
    ``sliding_window=W``: the new token (at position ``context_len - 1``) sees its last ``W``
    keys; the blocks before the one holding the first of them are not read (may be -1).
    Raises :class:`~pagedlearn.errors.AttentionInputError` (a ``ValueError``) on bad input.
    """
    window = check_sliding_window(sliding_window)  # an int >= 1, or None
    shape = check_decode(q, key_cache, value_cache, block_tables, context_lens, scale, True, window)
    bs = shape.block_size
    out = torch.empty_like(q)
    for i, n in enumerate(context_lens.tolist()):
        start = first_visible_key(n - 1, window)  # the window's first key; 0 without one
        first = start // bs  # its block: the blocks before it are not read (they may be freed)
        k, v = gather_kv(key_cache, value_cache, block_tables[i, first:], n - first * bs)
        k, v = k[start - first * bs :], v[start - first * bs :]  # the keys in the window
        out[i] = contiguous_attention(q[i : i + 1], k, v, shape.scale)[0]
    return out


def paged_attention_online_softmax_ref(
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
    """:func:`paged_attention_ref` computed the way the Triton kernel does, one block at a time.

    Per sequence and head it keeps, in float32: ``m_i`` the largest score seen so far, ``l_i`` the
    sum of ``exp(score - m_i)``, and ``acc`` the sum of ``exp(score - m_i) * v``. When a new block
    raises the max, ``l_i`` and ``acc`` are rescaled by ``exp(m_old - m_new)``; at the end
    ``acc / l_i`` is the softmax-weighted sum, divided once. A whole row of scores never exists,
    which is why a kernel can stream K/V of any length through a fixed amount of on-chip memory.

    ``num_splits > 1`` is flash-decoding: the blocks are cut into ``num_splits`` slices that run
    independently (on a GPU, in parallel: more work for short batches with long contexts). Each
    slice ends with its own ``(m_i, l_i, acc)``; they are merged exactly, weighting slice ``s`` by
    ``exp(m_s - max_s m_s)``. A slice with no blocks has ``l_i = 0`` and weight 0.

    ``sliding_window=W``: the loop starts at the block holding key ``context_len - W`` (the
    first the new token sees); the blocks before it are skipped, never loaded, and the slices
    divide only the window's blocks. In that first block, the keys before the window score -inf.
    """
    window = check_sliding_window(sliding_window)  # an int >= 1, or None
    shape = check_decode(q, key_cache, value_cache, block_tables, context_lens, scale, True, window)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    bs, group, dev = shape.block_size, shape.group_size, q.device
    out = torch.empty_like(q)
    for i, n in enumerate(context_lens.tolist()):
        qi = q[i].float()  # (num_heads, head_dim)
        num_blocks = -(-n // bs)
        start = first_visible_key(n - 1, window)  # the window's first key; 0 without one
        first = start // bs  # its block: the blocks before it are never visited (may be freed)
        per_split = -(-(num_blocks - first) // num_splits)  # per slice; trailing ones may be empty
        parts = []  # one (m_i, l_i, acc) per slice
        for split in range(num_splits):
            m_i = torch.full((shape.num_heads,), float("-inf"), device=dev)  # running max
            l_i = torch.zeros(shape.num_heads, device=dev)  # running sum of exp(score - m_i)
            acc = torch.zeros(shape.num_heads, shape.head_dim, device=dev)  # sum of exp(...) * v
            begin = first + split * per_split
            for j in range(begin, min(begin + per_split, num_blocks)):
                # 1. Look up where logical block j lives, and load it.
                block_id = int(block_tables[i, j])
                valid = min(bs, n - j * bs)  # tokens in this block; the last may be partial
                k = key_cache[block_id, :valid].float()  # (valid, num_kv_heads, head_dim)
                v = value_cache[block_id, :valid].float()
                k = k.repeat_interleave(group, dim=1)  # each KV head serves `group` query heads
                v = v.repeat_interleave(group, dim=1)  # (valid, num_heads, head_dim)
                # 2. Scores of this block only: (num_heads, valid). The window's first block may
                #    begin with keys before the window: they score -inf, so weigh 0.
                s = torch.einsum("hd,thd->ht", qi, k) * shape.scale
                s[:, : max(start - j * bs, 0)] = float("-inf")  # nothing, past the first block
                # 3. Raise the running max; rescale what was summed under the old max.
                m_new = torch.maximum(m_i, s.max(dim=1).values)
                alpha = torch.exp(m_i - m_new)  # exp(-inf) = 0 on the first block
                p = torch.exp(s - m_new[:, None])  # (num_heads, valid)
                l_i = l_i * alpha + p.sum(dim=1)
                acc = acc * alpha[:, None] + torch.einsum("ht,thd->hd", p, v)
                m_i = m_new
            parts.append((m_i, l_i, acc))
        # 4. Merge the slices (one slice: this is just acc / l_i). Empty slices have m_i = -inf.
        m_all = torch.stack([m for m, _, _ in parts])  # (num_splits, num_heads)
        m_max = m_all.max(dim=0).values
        m_max = torch.where(torch.isinf(m_max), torch.zeros_like(m_max), m_max)  # n == 0
        w = torch.exp(m_all - m_max)  # (num_splits, num_heads); 0 for empty slices
        l_total = sum(w[s] * parts[s][1] for s in range(num_splits))
        acc_total = sum(w[s][:, None] * parts[s][2] for s in range(num_splits))
        safe_l = torch.where(l_total > 0, l_total, torch.ones_like(l_total))
        out[i] = (acc_total / safe_l[:, None]).to(q.dtype)  # no keys at all -> zeros
    return out


def paged_attention_batched(
    q,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    scale=None,
    *,
    check_values=True,
    sliding_window=None,
):
    """:func:`paged_attention_ref` for all sequences at once: one gather, one masked softmax.

    Every row of ``block_tables`` is gathered in full, ``(num_seqs, max_blocks * block_size)``
    keys per head; positions at or past a sequence's ``context_len`` (padding, the unused end of
    its last block) are masked out of the softmax and zeroed in V, so whatever they hold --
    even NaN -- cannot leak in. Table entries past a sequence's blocks may be anything (-1
    included): they are replaced by block 0 and then masked. This trades memory (the padded
    gather) for a handful of large tensor operations instead of a Python loop per sequence.
    ``check_values=False`` skips the checks of the tables' *values*, for callers (the engine)
    that built them from a :class:`~pagedlearn.KVCacheManager`.

    ``sliding_window=W``: each row is gathered from the block holding its first visible key
    (``context_len - W``) on, ``(W + block_size - 2) // block_size + 1`` blocks (the most that
    ``W`` consecutive keys can touch), so neither the gather nor its memory grows with the
    context; entries before the window (-1 when freed) are never indexed, and the keys of the
    window's first block that lie before the window are masked like padding.
    """
    window = check_sliding_window(sliding_window)  # an int >= 1, or None
    shape = check_decode(
        q, key_cache, value_cache, block_tables, context_lens, scale, check_values, window
    )
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = shape.num_kv_heads
    bs, max_blocks = key_cache.shape[1], block_tables.shape[1]
    lens = context_lens.long()
    if window is None:  # every row from block 0, the whole table
        start, width = torch.zeros_like(lens), max_blocks
    else:  # every row from the block of its first visible key
        start, width = (lens - window).clamp(min=0), min(max_blocks, (window + bs - 2) // bs + 1)
    j = start[:, None] // bs + torch.arange(width, device=q.device)  # (S, width) logical blocks
    used = j < (lens[:, None] + bs - 1) // bs
    table = block_tables.long().gather(1, j.clamp(max=max_blocks - 1))  # (S, width)
    ids = torch.where(used, table, 0)  # padding reads block 0
    k = key_cache[ids].flatten(1, 2).float()  # (S, L, num_kv_heads, head_dim), L = width * bs
    v = value_cache[ids].flatten(1, 2).float()
    key_pos = (j[:, :, None] * bs + torch.arange(bs, device=q.device)).flatten(1)  # (S, L)
    valid = (key_pos >= start[:, None]) & (key_pos < lens[:, None])  # (S, L)
    v = v.masked_fill(~valid[:, :, None, None], 0.0)  # 0 * NaN would still be NaN
    qf = q.float().reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("skgd,slkd->skgl", qf, k) * shape.scale  # (S, kv_heads, group, L)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # no keys at all: zeros, not NaN
    out = torch.einsum("skgl,slkd->skgd", probs, v)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def paged_attention_prefill_ref(
    q,
    key_cache,
    value_cache,
    block_tables,
    cu_seqlens_q,
    context_lens,
    scale=None,
    *,
    check_values=True,
    sliding_window=None,
):
    """Prefill/extend over a paged cache, for the packed new tokens of several sequences.

    q: ``(total_query_tokens, num_heads, head_dim)``; sequence ``i``'s queries are rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``. Its ``context_lens[i]`` keys are already in the cache
    (the new tokens' K/V included, written by :func:`write_kv_ref` first). The first
    ``context_len - query_len`` of them are the cached prefix -- a prefix-cache hit that is not
    recomputed -- and query ``j`` sees keys ``key_pos <= context_len - query_len + j``.
    Returns ``(total_query_tokens, num_heads, head_dim)``. ``check_values=False``: as in
    :func:`paged_attention_batched`. ``sliding_window=W``: query ``j`` also needs
    ``key_pos > context_len - query_len + j - W``; the blocks before the one holding the first
    query's first visible key are not read (may be -1).
    """
    window = check_sliding_window(sliding_window)  # an int >= 1, or None
    shape = check_prefill(
        q,
        key_cache,
        value_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        scale,
        check_values,
        window,
    )
    bs = shape.block_size
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for i, n in enumerate(context_lens.tolist()):
        rows = slice(cu[i], cu[i + 1])
        first = first_visible_key(n - (cu[i + 1] - cu[i]), window) // bs  # 0 without a window
        k, v = gather_kv(key_cache, value_cache, block_tables[i, first:], n - first * bs)
        out[rows] = contiguous_attention(q[rows], k, v, shape.scale, sliding_window=window)
    return out


def write_kv_ref(key, value, key_cache, value_cache, slot_mapping, *, check_values=True):
    """Write each token's K/V into its slot of the paged cache (in place); skip negative slots.

    key, value: ``(num_tokens, num_kv_heads, head_dim)``; slot_mapping: int ``(num_tokens,)``.
    Slot ``s`` is row ``s % block_size`` of physical block ``s // block_size``.
    ``check_values=False`` skips checking the slots (in range, no two tokens in one slot).
    """
    shape = check_write_kv(key, value, key_cache, value_cache, slot_mapping, check_values)
    keep = slot_mapping >= 0  # padding tokens carry slot -1 and are not written
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // shape.block_size, slots % shape.block_size
    key_cache[blocks, offsets] = key[keep]
    value_cache[blocks, offsets] = value[keep]


def decode_flops_and_bytes(context_lens, num_heads, num_kv_heads, head_dim, elem_size):
    """``(flops, bytes)`` of one decode-attention call (one layer): why decode is memory-bound.

    FLOPs: for each of a sequence's ``n`` cached tokens, each query head takes a dot product
    with its key (``2 * head_dim``: a multiply and an add per element) and adds its value,
    weighted (``2 * head_dim`` more): ``4 * n * num_heads * head_dim``. The softmax's few
    operations per score are left out. Bytes: what must cross memory at least once, K and V of
    every cached token (``2 * n * num_kv_heads * head_dim`` values) plus q read and the output
    written (``2 * num_heads * head_dim``); block-table reads are not counted.
    ``benchmarks/bench_attention.py`` counts bytes the same way for its GB/s.

    Their ratio, the arithmetic intensity, tends to ``2 * (num_heads / num_kv_heads) / elem_size``
    FLOPs per byte on long contexts: a K/V value, once read, serves only the query heads of its
    group. A bigger batch does not raise it, since every sequence reads its own K/V (unlike the
    weights of the linear layers, which the whole batch shares).

    >>> flops, nbytes = decode_flops_and_bytes([4096], 12, 12, 64, elem_size=2)  # GPT-2-like, fp16
    >>> flops, nbytes, round(flops / nbytes, 2)
    (12582912, 12585984, 1.0)
    >>> flops, nbytes = decode_flops_and_bytes([4096] * 8, 32, 8, 128, elem_size=2)  # GQA, group 4
    >>> round(flops / nbytes, 2)
    4.0
    """
    tokens = sum(int(n) for n in context_lens)
    flops = 4 * tokens * num_heads * head_dim
    nbytes = (2 * tokens * num_kv_heads + 2 * len(context_lens) * num_heads) * head_dim * elem_size
    return flops, nbytes
