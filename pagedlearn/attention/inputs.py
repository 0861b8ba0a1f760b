"""What a paged-attention call accepts: argument checks shared by the references and the kernels.

Every attention function in pagedlearn reads the same three things:

- ``key_cache``, ``value_cache``: ``(num_blocks, block_size, num_kv_heads, head_dim)`` -- the
  physical KV slab in the "NHD" layout of FlashAttention, FlashInfer and vLLM's Triton kernels.
- ``block_tables``: int32 ``(num_seqs, max_blocks_per_seq)``; row ``i`` lists sequence ``i``'s
  physical block ids in logical order. Entries past a sequence's length are padding (any value).
- ``context_lens``: int32 ``(num_seqs,)``; how many tokens of K/V each sequence has in the cache.

Checking them in one place means the reference and the Triton kernel refuse exactly the same
inputs, with the same message, before anything is launched or written. Shapes, dtypes and devices
are always checked (that costs nothing). The *values* inside ``block_tables`` / ``context_lens`` /
``slot_mapping`` are checked when ``check_values`` is true: the references always do it, the
kernels do it for CPU tensors. On a GPU that would cost a device-to-host copy per call, so the
kernels skip it there; the engine builds these tensors from a ``KVCacheManager`` that has already
validated every id.

Sliding windows. Every call also takes ``sliding_window`` (vLLM's and transformers' name):
``None`` for full attention, or an int ``W >= 1``: the query at position ``p`` sees only the keys
at positions ``p - W < key_pos <= p``, itself and the ``W - 1`` keys before it (Mistral: every
layer; Gemma 3, gpt-oss: some layers). Queries only move forward, so a key before the window of
a sequence's earliest query in a call is never read again, by this call or any later one: the
KV-cache manager can hand a block of such keys back to the pool, and a decoding sequence then
holds at most ``ceil(W / block_size) + 1`` blocks however long it grows. The table entry of a
freed block
is stale (``-1`` in pagedlearn); the value checks accept any value there, and still refuse a bad
id in a block that some query of the call can see:

>>> first_visible_key(99, 40)  # the query at position 99 sees keys 60..99 with W = 40
60
>>> first_visible_key(99, None), first_visible_key(10, 40)  # no window; the window covers all
(0, 0)
"""

import math
import numbers
from dataclasses import dataclass

import torch

from pagedlearn.errors import AttentionInputError

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class CacheShape:
    """The sizes every paged-attention call needs, read off the cache and the queries."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    num_heads: int
    scale: float

    @property
    def group_size(self) -> int:
        """Query heads per KV head: 1 for multi-head attention (GPT-2, OPT), more for GQA."""
        return self.num_heads // self.num_kv_heads


def _fail(message: str) -> None:
    raise AttentionInputError(message)


def _check_tensor(name, t, ndim, dtypes, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        _fail(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        _fail(f"{name} must be one of {names}, got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        _fail(f"{name} is on {t.device} but the queries are on {device}")


def check_cache(q, key_cache, value_cache, scale) -> CacheShape:
    """Check the queries ``(..., num_heads, head_dim)`` against the KV cache; return the sizes."""
    _check_tensor("q", q, 3, FLOAT_DTYPES)
    _check_tensor("key_cache", key_cache, 4, FLOAT_DTYPES, q.device)
    _check_tensor("value_cache", value_cache, 4, FLOAT_DTYPES, q.device)
    if value_cache.shape != key_cache.shape:
        _fail(
            f"value_cache has shape {tuple(value_cache.shape)} but key_cache has "
            f"{tuple(key_cache.shape)}; they must match"
        )
    if not (q.dtype == key_cache.dtype == value_cache.dtype):
        _fail(
            f"q, key_cache and value_cache must share one dtype, got {q.dtype}, "
            f"{key_cache.dtype} and {value_cache.dtype}"
        )
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = q.shape[-2]
    if min(num_blocks, block_size, num_kv_heads, head_dim) == 0:
        _fail(f"key_cache has an empty dimension: shape {tuple(key_cache.shape)}")
    if q.shape[-1] != head_dim:
        _fail(f"q has head_dim {q.shape[-1]} but the cache has head_dim {head_dim}")
    if num_heads == 0 or num_heads % num_kv_heads:
        _fail(
            f"q has {num_heads} heads, which is not a multiple of the cache's {num_kv_heads} "
            "KV heads (grouped-query attention needs num_heads = k * num_kv_heads)"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        _fail(f"scale must be a positive number or None, got {scale!r}")
    return CacheShape(num_blocks, block_size, num_kv_heads, head_dim, num_heads, float(scale))


def check_sliding_window(sliding_window) -> int | None:
    """``sliding_window`` as an int ``>= 1``, or ``None`` (full attention); anything else fails.

    ``True`` is refused although Python counts it as the int 1: it is a flag passed by mistake.
    """
    if sliding_window is None:
        return None
    if (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, numbers.Integral)
        or sliding_window < 1
    ):
        _fail(
            "sliding_window must be an int >= 1 (a query at position p sees the keys at "
            f"p - W < key_pos <= p) or None for full attention, got {sliding_window!r}"
        )
    return int(sliding_window)


def first_visible_key(first_query_pos: int, sliding_window: int | None) -> int:
    """The first key position that the query at ``first_query_pos`` sees: 0 without a window,
    else ``max(0, first_query_pos - W + 1)``. Pass a call's earliest query (decode: the last
    position, ``context_len - 1``; prefill: ``context_len - query_len``): every key before the
    result, and every block that ends before it, is read by no query of the call."""
    if sliding_window is None:
        return 0
    return max(0, first_query_pos - sliding_window + 1)


def check_block_tables(block_tables, context_lens, device, num_seqs: int) -> None:
    """Check the block tables' and lengths' shapes, dtypes and device (values: see below)."""
    _check_tensor("block_tables", block_tables, 2, INDEX_DTYPES, device)
    _check_tensor("context_lens", context_lens, 1, INDEX_DTYPES, device)
    if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
        _fail(
            f"block_tables has {block_tables.shape[0]} rows and context_lens "
            f"{context_lens.shape[0]} entries, but there are {num_seqs} sequences"
        )


def check_block_table_values(
    block_tables, context_lens, shape: CacheShape, sliding_window=None, query_lens=None
) -> None:
    """Every length fits its table row and every block a sequence reads exists in the cache.

    A sequence reads its blocks from the one holding its first visible key
    (:func:`first_visible_key` of its earliest query, at ``context_len - query_len``;
    ``query_lens`` defaults to 1 per sequence, decode) up to the one holding its last key.
    Entries before that (freed by a sliding window) and after it (padding) may hold anything.
    """
    capacity = block_tables.shape[1] * shape.block_size
    lens = context_lens.tolist()
    for i, n in enumerate(lens):
        if not 0 <= n <= capacity:
            _fail(
                f"context_lens[{i}] = {n}, but a sequence holds 0 to {capacity} tokens "
                f"({block_tables.shape[1]} blocks of {shape.block_size} per table row)"
            )
        q_len = 1 if query_lens is None else query_lens[i]
        first = first_visible_key(n - q_len, sliding_window) // shape.block_size
        end = -(-n // shape.block_size)
        used = block_tables[i, first:end].tolist()
        bad = [(j, b) for j, b in enumerate(used, first) if not 0 <= b < shape.num_blocks]
        if bad:
            j, b = bad[0]
            window = "" if sliding_window is None else f"; sliding_window={sliding_window}"
            _fail(
                f"block_tables[{i}] uses block {b}, outside the cache's {shape.num_blocks} "
                f"blocks (logical block {j}: the call reads logical blocks {first} to {end - 1}"
                f"{window})"
            )


def check_decode(
    q, key_cache, value_cache, block_tables, context_lens, scale, check_values, sliding_window=None
):
    """All checks for decode attention: one query token per sequence, ``q: (num_seqs, H, D)``."""
    shape = check_cache(q, key_cache, value_cache, scale)
    sliding_window = check_sliding_window(sliding_window)
    check_block_tables(block_tables, context_lens, q.device, q.shape[0])
    if check_values:
        check_block_table_values(block_tables, context_lens, shape, sliding_window)
    return shape


def check_prefill(
    q,
    key_cache,
    value_cache,
    block_tables,
    cu_seqlens_q,
    context_lens,
    scale,
    check_values,
    sliding_window=None,
):
    """All checks for prefill/extend: packed queries ``q: (total_query_tokens, H, D)``.

    ``cu_seqlens_q``: ``(num_seqs + 1,)``, sequence ``i``'s queries are rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of ``q``; they are the *last* tokens of its
    ``context_lens[i]`` keys, so each query length must be at most the context length.
    """
    shape = check_cache(q, key_cache, value_cache, scale)
    sliding_window = check_sliding_window(sliding_window)
    _check_tensor("cu_seqlens_q", cu_seqlens_q, 1, INDEX_DTYPES, q.device)
    if cu_seqlens_q.shape[0] < 1:
        _fail("cu_seqlens_q must have num_seqs + 1 entries, got none")
    num_seqs = cu_seqlens_q.shape[0] - 1
    check_block_tables(block_tables, context_lens, q.device, num_seqs)
    if check_values:
        cu = cu_seqlens_q.tolist()
        q_lens = [cu[i + 1] - cu[i] for i in range(num_seqs)]
        if cu[0] != 0 or cu[-1] != q.shape[0]:
            _fail(f"cu_seqlens_q must run from 0 to {q.shape[0]} (the rows of q), got {cu}")
        for i, n in enumerate(context_lens.tolist()):
            q_len = q_lens[i]
            if q_len < 0:
                _fail(f"cu_seqlens_q must not decrease, got {cu}")
            if q_len > n:
                _fail(
                    f"sequence {i} has {q_len} query tokens but context_lens[{i}] = {n}: the "
                    "context includes the new tokens, so it cannot be shorter than them"
                )
        check_block_table_values(block_tables, context_lens, shape, sliding_window, q_lens)
    return shape


def check_write_kv(key, value, key_cache, value_cache, slot_mapping, check_values) -> CacheShape:
    """All checks for the KV write: ``key, value: (num_tokens, num_kv_heads, head_dim)``."""
    shape = check_cache(key, key_cache, value_cache, None)
    _check_tensor("value", value, 3, FLOAT_DTYPES, key.device)
    if value.shape != key.shape or value.dtype != key.dtype:
        _fail(f"value {tuple(value.shape)} must have the shape and dtype of key {tuple(key.shape)}")
    if shape.num_heads != shape.num_kv_heads:
        _fail(f"key has {shape.num_heads} heads but the cache has {shape.num_kv_heads} KV heads")
    _check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES, key.device)
    if slot_mapping.shape[0] != key.shape[0]:
        _fail(f"slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens")
    if check_values:
        slots = slot_mapping[slot_mapping >= 0]
        num_slots = shape.num_blocks * shape.block_size
        if slots.numel() and int(slots.max()) >= num_slots:
            _fail(f"slot_mapping has slot {int(slots.max())}, past the cache's {num_slots} slots")
        if slots.unique().numel() != slots.numel():
            _fail("slot_mapping sends two tokens to the same slot (only -1, 'skip', may repeat)")
    return shape
