"""Which memory a kernel reads, counted in Triton's CPU interpreter: proof that blocks are skipped.

On a GPU a skipped block shows up as time saved; on a CPU there is no such clock to read, but the
interpreter runs every ``tl.load`` through one Python method, and the addresses it is given are
the ones a GPU would read. :func:`record_loads` wraps that method for the duration of a ``with``
block and keeps, for each tensor it is told about, the element indices that were loaded (masked
lanes excluded: a masked lane reads nothing). :func:`decode_loads` runs
:func:`kernels.paged_attention_decode` that way and turns the indices into what the sliding
window is about: the physical blocks of ``key_cache`` read, the tokens (slots) streamed, and the
block-table entries looked up. With a window ``W`` the decode kernel should read

    blocks  = (context_len - 1) // block_size - max(0, context_len - W) // block_size + 1
            <= ceil((W - 1) / block_size) + 1,     against ceil(context_len / block_size)
    tokens  = min(W, context_len)

per sequence and KV head (``benchmarks/bench_sliding_window.py`` prints them at 32k tokens).
Only the interpreter can be watched this way (``TRITON_INTERPRET=1`` before Triton is imported).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from kernels.backend import is_interpreted


@contextlib.contextmanager
def record_loads(**tensors: torch.Tensor):
    """``with record_loads(key_cache=kc, block_tables=bt) as seen: ...`` -- afterwards,
    ``seen[name]`` is the sorted array of distinct element indices (into ``t.flatten()``, for a
    contiguous ``t``) that the interpreted kernels loaded from that tensor."""
    from triton.runtime import interpreter

    spans = {
        name: (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), t.element_size())
        for name, t in tensors.items()
    }
    hits: dict[str, list[np.ndarray]] = {name: [] for name in tensors}
    builder = interpreter.InterpreterBuilder
    load = builder.create_masked_load

    def recording_load(self, ptrs, mask, other, *rest):
        addr = np.broadcast_to(ptrs.data, mask.data.shape)[mask.data].astype(np.uint64).ravel()
        for name, (lo, hi, size) in spans.items():
            inside = addr[(addr >= lo) & (addr < hi)]
            if inside.size:
                hits[name].append((inside - np.uint64(lo)) // np.uint64(size))
        return load(self, ptrs, mask, other, *rest)

    seen: dict[str, np.ndarray] = {}
    builder.create_masked_load = recording_load
    try:
        yield seen
    finally:
        builder.create_masked_load = load
        for name, parts in hits.items():
            seen[name] = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.uint64)


@dataclass(frozen=True)
class DecodeLoads:
    """What one decode call read: distinct physical blocks and slots of ``key_cache``, and the
    indices (into ``block_tables.flatten()``) of the table entries it looked up."""

    key_blocks: frozenset[int]
    value_blocks: frozenset[int]
    key_slots: int  # distinct (block, slot) rows of key_cache read, any head
    table_entries: frozenset[int]


def decode_loads(
    q, key_cache, value_cache, block_tables, context_lens, num_splits=1, *, sliding_window=None
) -> tuple[torch.Tensor, DecodeLoads]:
    """Run :func:`kernels.paged_attention_decode` in the interpreter, recording its loads;
    returns ``(output, DecodeLoads)``. The caches and tables must be contiguous."""
    from kernels import decode_attention

    if not is_interpreted(decode_attention._paged_decode_kernel):
        raise RuntimeError("decode_loads needs Triton's interpreter: set TRITON_INTERPRET=1 first")
    if not (key_cache.is_contiguous() and block_tables.is_contiguous()):
        raise ValueError("decode_loads needs contiguous caches and block tables")
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    tensors = {"k": key_cache, "v": value_cache, "table": block_tables}
    with record_loads(**tensors) as seen:
        out = decode_attention.paged_attention_decode(
            q, key_cache, value_cache, block_tables, context_lens, None, num_splits,
            sliding_window=sliding_window,
        )  # fmt: skip
    per_block, per_slot = block_size * num_kv_heads * head_dim, num_kv_heads * head_dim
    loads = DecodeLoads(
        key_blocks=frozenset((seen["k"] // per_block).tolist()),
        value_blocks=frozenset((seen["v"] // per_block).tolist()),
        key_slots=len(np.unique(seen["k"] // per_slot)),
        table_entries=frozenset(seen["table"].tolist()),
    )
    return out, loads


def expected_blocks(context_len: int, block_size: int, sliding_window: int | None) -> int:
    """The blocks one decode step must read: those holding the keys its query sees.

    >>> expected_blocks(32768, 16, None), expected_blocks(32768, 16, 4096)
    (2048, 256)
    >>> expected_blocks(200, 16, 40), expected_blocks(200, 16, 41)  # keys 160..199; 159..199
    (3, 4)
    """
    if context_len == 0:
        return 0
    start = 0 if sliding_window is None else max(0, context_len - sliding_window)
    return (context_len - 1) // block_size - start // block_size + 1


__all__ = ["DecodeLoads", "decode_loads", "expected_blocks", "record_loads"]
