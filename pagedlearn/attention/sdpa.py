"""Paged attention for the engine's ``"torch"`` backend: plan once per step, then SDPA per layer.

The references in :mod:`pagedlearn.attention` are written to be read; they run some twenty small
tensor operations per layer (index math, a gather, masks, two einsums, a softmax). On a small
model most of a forward pass is that per-operation overhead, and most of it is the same in every
layer: which rows of q belong to which sequence, which cache slots hold its keys, which key each
query may see. Only the cache tensors change from layer to layer. So, as in vLLM v1 (its GPU
model runner calls each attention backend's ``AttentionMetadataBuilder.build`` once per step and
KV-cache group; the layers only read the result), the work is split in two:

1. :func:`plan_attention`, once per step and KV-cache group: an :class:`AttentionPlan` that pads
   the sequences into a few batches, with the cache slot of every key and an additive mask.
2. :func:`attend`, once per layer: per batch, gather q's rows and K/V at the planned slots, call
   ``torch.nn.functional.scaled_dot_product_attention`` (SDPA) with the mask, and put each real
   query's output back in its packed row::

       packed q (T, H, D) ──q_rows──> (n, m, H, D) ───────────┐
       cache (slots, H_kv, D) ──key_slots──> K, V (n, L, H_kv, D) ──┴─ SDPA(mask) ─> out[out_rows]

Which sequences share a batch: those whose query counts round up to the same power of two. All
decodes (one query each) make one batch; a prompt of 10 tokens is not padded to the 2048 x 2048
square of a prompt chunk next to it, and never more than half a batch's query rows are padding.
(A pure decode step is the common case: one batch, q and out used as they are.)

What keeps the padding exact (``tests/test_attention_sdpa.py`` holds every case against the
references):

- Padding never reads a slot that no sequence uses: it may hold anything, NaN included, and
  ``0 * NaN`` is NaN even behind a mask. A padding key position reads its row's first visible
  key instead, a real key, and the mask gives it weight 0 (a sequence with no keys at all reads
  slot 0 and is zeroed, below). A padding query row repeats the
  sequence's last query (so no row is fully masked) and is dropped on the way back.
- A sequence with no keys at all (``context_len == 0``, which the decode references accept)
  gets zeros, set explicitly.
- Everything is computed in float32 and returned in q's dtype, as the references do.

:func:`write_kv_flat` is :func:`~pagedlearn.attention.write_kv_ref` as one ``index_copy_`` per
tensor, on the cache seen as ``(num_blocks * block_size, num_kv_heads, head_dim)``: one row per
slot. :func:`write_kv_planned` writes at slots planned once per step. The engine calls
:func:`plan_attention` through ``PagedAttentionMetadata.plan`` (models/paged_attention.py);
:func:`paged_attention_decode_sdpa` and :func:`paged_attention_prefill_sdpa` are plan + attend
behind the references' signatures, checks included.

Two decoding sequences, blocks of 4: A holds 6 tokens in blocks 7 and 2, B 3 tokens in block 5.
Each row reads 2 blocks; B's second is padding (-1), and its padding keys re-read its slot 20:

>>> tables, lens = torch.tensor([[7, 2], [5, -1]]), torch.tensor([6, 3])
>>> (batch,) = plan_attention(tables, lens, torch.tensor([0, 1, 2]), block_size=4).batches
>>> batch.key_slots.view(2, 8)
tensor([[28, 29, 30, 31,  8,  9, 28, 28],
        [20, 21, 22, 20, 20, 20, 20, 20]])
>>> batch.mask[:, 0, 0]  # (n, 1, m, L): 0 where the query sees the key
tensor([[0., 0., 0., 0., 0., 0., -inf, -inf],
        [0., 0., 0., -inf, -inf, -inf, -inf, -inf]])
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedlearn.attention.inputs import (
    check_decode,
    check_prefill,
    check_sliding_window,
    check_write_kv,
    first_visible_key,
)
from pagedlearn.errors import AttentionInputError


@dataclass
class PaddedBatch:
    """``n`` sequences padded to ``m`` queries and ``L`` keys each: one SDPA call."""

    q_rows: torch.Tensor | None  # (n * m,) int64: each query's packed row; None: rows 0..n-1
    key_slots: torch.Tensor  # (n * L,) int64: the cache slot of each key; padding reads a real one
    mask: torch.Tensor  # (n, 1, m, L) float32: 0 where query i of sequence s sees key l, else -inf
    real: torch.Tensor | None  # (R,) int64: which of the n * m rows are real; None: all of them
    out_rows: torch.Tensor | None  # (R,) int64: the packed rows they fill; None: rows 0..T-1
    empty: torch.Tensor | None  # (n, 1, 1, 1) bool: sequences without keys; None: there are none


@dataclass
class AttentionPlan:
    """Everything index-like about one step for one KV-cache group; see the module docstring."""

    num_tokens: int  # T, the packed query rows
    batches: list[PaddedBatch]  # one per bucket of query counts: decodes (m = 1), prefills
    write_slots: torch.Tensor | None = None  # (T',) int64: where the new K/V go (no -1)
    write_rows: torch.Tensor | None = None  # (T',) int64: which tokens have one; None: all


def plan_attention(
    block_tables, context_lens, cu_seqlens_q, block_size, sliding_window=None, slot_mapping=None
) -> AttentionPlan:
    """Plan one step: which batches to pad the sequences into, and every index they need.

    block_tables: int ``(S, max_blocks)``; context_lens: int ``(S,)``, the new tokens included;
    cu_seqlens_q: int ``(S + 1,)``, sequence ``i`` owns packed rows ``cu[i]:cu[i+1]``, its last
    ``cu[i+1] - cu[i]`` positions; slot_mapping (optional): int ``(T,)``, for
    :func:`write_kv_planned`. Trusts its inputs: the callers check them (once per step).
    """
    window = check_sliding_window(sliding_window)
    lens, cu = context_lens.tolist(), cu_seqlens_q.tolist()  # the step's host copies
    q_lens = [b - a for a, b in itertools.pairwise(cu)]
    tables = block_tables.long()
    if tables.shape[1] == 0:  # no sequence has a block: give the gathers one to point at
        tables = tables.new_zeros(tables.shape[0], 1)
    buckets: dict[int, list[int]] = {}  # ceil(log2(query count)) -> the sequences padded together
    for i, n in enumerate(q_lens):
        if n > 0:  # (a sequence without queries takes no part)
            buckets.setdefault((n - 1).bit_length(), []).append(i)
    batches = [
        _pad(tables, seqs, lens, q_lens, cu, block_size, window) for seqs in buckets.values()
    ]
    if q_lens and all(n == 1 for n in q_lens):  # pure decode: row i of q is sequence i's query
        batches[0].q_rows = batches[0].real = batches[0].out_rows = None
    plan = AttentionPlan(cu[-1] if cu else 0, batches)
    if slot_mapping is not None:
        plan.write_slots = slot_mapping.long()
        if slot_mapping.numel() and int(slot_mapping.min()) < 0:  # -1: padding, not written
            plan.write_rows = (slot_mapping >= 0).nonzero().flatten()
            plan.write_slots = plan.write_slots[plan.write_rows]
    return plan


def _pad(tables, seqs, lens, q_lens, q_starts, block_size, window) -> PaddedBatch:
    """Sequences ``seqs`` (indices into the per-sequence lists and ``tables``'s rows) padded to
    one batch of ``m`` query rows and ``L`` keys each."""
    dev, bs = tables.device, block_size
    if len(seqs) < tables.shape[0]:
        tables = tables[torch.tensor(seqs, device=dev)]
    lens, q_lens, q_starts = ([xs[i] for i in seqs] for xs in (lens, q_lens, q_starts))
    m = max(q_lens)
    # Per sequence, in Python: its earliest query's first visible key (0 without a window); its
    # row reads the blocks from the one holding that key to the one holding its last key.
    first_key = [first_visible_key(n - q, window) for n, q in zip(lens, q_lens, strict=True)]
    width = max(max(-(-n // bs) - f // bs for n, f in zip(lens, first_key, strict=True)), 1)
    per_seq = torch.tensor(lens + q_lens + q_starts + first_key, device=dev).view(4, -1, 1)
    lens_, q_lens_, q_starts_, first_key_ = per_seq  # each (n, 1)
    # Queries: sequence s's are packed rows q_starts[s] + j, at positions lens[s] - q_lens[s] + j;
    # padding rows (j >= q_lens[s]) repeat the last one.
    if m == 1:  # decodes: one query each, at the last position
        q_rows, q_pos = q_starts_, lens_ - 1
    else:
        j = torch.arange(m, device=dev).minimum(q_lens_ - 1)  # (n, m)
        q_rows, q_pos = q_starts_ + j, lens_ - q_lens_ + j
    # Keys: L = width * block_size positions per row.
    if window is None:  # every row from block 0: the tables' first columns
        logical = torch.arange(width, device=dev)[None]  # (1, width) logical blocks
        ids = tables[:, :width]  # (n, width) physical ids (or padding)
    else:  # every row from the block of its first visible key
        logical = first_key_ // bs + torch.arange(width, device=dev)  # (n, width)
        ids = tables.gather(1, logical.clamp(max=tables.shape[1] - 1))
    offsets = torch.arange(bs, device=dev)
    key_pos = (logical[:, :, None] * bs + offsets).flatten(1)  # (1 or n, L)
    slots = (ids[:, :, None] * bs + offsets).flatten(1)  # (n, L)
    # A key outside [first_key, len) reads the row's first visible key -- a real one, never
    # garbage -- and the mask hides it. A row without keys reads slot 0; attend zeroes it.
    first_slot = slots[:, :1] if window is None else slots.gather(1, first_key_ % bs)  # (n, 1)
    empty = 0 in lens
    if empty:
        first_slot = first_slot.masked_fill(lens_ == 0, 0)
    in_use = key_pos < lens_
    if window is not None:
        in_use &= key_pos >= first_key_
    slots = torch.where(in_use, slots, first_slot)
    # The query at position p sees the keys p - W < key_pos <= p (no lower bound without W).
    visible = key_pos[:, None, :] <= q_pos[:, :, None]  # (n, m, L)
    if window is not None:
        visible &= key_pos[:, None, :] > q_pos[:, :, None] - window
    real = None if m == 1 else torch.arange(m, device=dev) < q_lens_  # (n, m)
    return PaddedBatch(
        q_rows=q_rows.flatten(),
        key_slots=slots.flatten(),
        mask=torch.where(visible, 0.0, float("-inf"))[:, None],  # the same for every head
        real=None if real is None else real.flatten().nonzero().flatten(),
        out_rows=q_rows.flatten() if real is None else q_rows[real],
        empty=(lens_ == 0)[:, :, None, None] if empty else None,
    )


def attend(q, key_cache, value_cache, plan: AttentionPlan, scale: float | None = None):
    """One layer's attention over the paged cache, following ``plan``; no checks.

    q: ``(T, num_heads, head_dim)`` packed queries; caches ``(num_blocks, block_size,
    num_kv_heads, head_dim)``. Returns ``(T, num_heads, head_dim)`` in q's dtype.
    """
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = key_cache.shape[2]
    flat_k = key_cache.flatten(0, 1)  # (num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = value_cache.flatten(0, 1)
    out = None
    for b in plan.batches:
        n, _, m, width = b.mask.shape
        qb = q if b.q_rows is None else q.index_select(0, b.q_rows)  # (n * m, H, D)
        k = flat_k.index_select(0, b.key_slots).view(n, width, num_kv_heads, head_dim)
        v = flat_v.index_select(0, b.key_slots).view(n, width, num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(  # (n, num_heads, m, head_dim), in float32
            qb.float().reshape(n, m, num_heads, head_dim).transpose(1, 2),
            k.float().transpose(1, 2),
            v.float().transpose(1, 2),
            attn_mask=b.mask,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,  # query head h reads KV head h // group
        )
        if b.empty is not None:
            o = o.masked_fill(b.empty, 0.0)
        o = o.transpose(1, 2).reshape(n * m, num_heads, head_dim).to(q.dtype)
        if b.out_rows is None:  # a pure decode step: row s is sequence s's query
            return o
        if out is None:
            out = q.new_empty(plan.num_tokens, num_heads, head_dim)
        out.index_copy_(0, b.out_rows, o if b.real is None else o.index_select(0, b.real))
    return q.new_empty(0, num_heads, head_dim) if out is None else out


def write_kv_planned(key, value, key_cache, value_cache, plan: AttentionPlan) -> None:
    """:func:`write_kv_flat` at the plan's slots (planned with a ``slot_mapping``); no checks."""
    if plan.write_rows is not None:
        key, value = key.index_select(0, plan.write_rows), value.index_select(0, plan.write_rows)
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, plan.write_slots, key)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, plan.write_slots, value)


def write_kv_flat(key, value, key_cache, value_cache, slot_mapping, *, check_values=True):
    """:func:`~pagedlearn.attention.write_kv_ref` as one ``index_copy_`` per tensor.

    Seen as ``(num_blocks * block_size, num_kv_heads, head_dim)``, the cache has one row per
    slot, so slot ``s`` is simply row ``s``. Negative slots are skipped; the cache must be
    contiguous (a copy would be written instead of the cache).
    """
    check_write_kv(key, value, key_cache, value_cache, slot_mapping, check_values)
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise AttentionInputError("write_kv_flat writes in place: the caches must be contiguous")
    keep = slot_mapping >= 0
    if not bool(keep.all()):  # padding tokens carry slot -1 and are not written
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    slots = slot_mapping.long()
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, key)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, value)


def paged_attention_decode_sdpa(
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
    """:func:`~pagedlearn.attention.paged_attention_batched`'s signature and result, via a plan."""
    window = check_sliding_window(sliding_window)
    shape = check_decode(
        q, key_cache, value_cache, block_tables, context_lens, scale, check_values, window
    )
    cu = torch.arange(q.shape[0] + 1, device=q.device)  # one query per sequence
    plan = plan_attention(block_tables, context_lens, cu, shape.block_size, window)
    return attend(q, key_cache, value_cache, plan, shape.scale)


def paged_attention_prefill_sdpa(
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
    """:func:`~pagedlearn.attention.paged_attention_prefill_ref`'s signature and result."""
    window = check_sliding_window(sliding_window)
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
    plan = plan_attention(block_tables, context_lens, cu_seqlens_q, shape.block_size, window)
    return attend(q, key_cache, value_cache, plan, shape.scale)
