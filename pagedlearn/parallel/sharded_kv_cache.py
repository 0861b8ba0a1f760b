"""The driver's handle on N workers' KV slabs: where the engine expects a ``KVCache``.

With tensor parallelism the KV cache is N slabs in N processes (worker.py), each::

    slab: (2, num_layers, num_blocks, block_size, num_kv_heads / N, head_dim)

-- every block id in every slab, a 1/N slice of every token's heads. The engine still copies
blocks (copy-on-write) and swaps them by block id; :class:`ShardedKVCache` sends each such
request to every worker, which moves its own heads of those blocks, and returns when all have.
The bytes add up: N slabs of ``block_bytes / N`` are one model's worth of blocks.
"""

from __future__ import annotations

import time

from pagedlearn.attention.kv_cache import KVCacheSpec
from pagedlearn.errors import PagedLearnError


class ShardedKVCache:
    """``spec`` is the whole model's (all KV heads); each worker holds ``worker_spec``'s share.
    Reads of the tensors go through ``LLM.collective_rpc`` (the slabs are in the workers)."""

    def __init__(self, executor, spec: KVCacheSpec, worker_spec: KVCacheSpec, num_blocks: int,
                 block_size: int, device, swap_blocks: int) -> None:  # fmt: skip
        self.executor, self.spec, self.worker_spec = executor, spec, worker_spec
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, device
        self.groups = spec.groups
        self.has_swap_pool = swap_blocks > 0
        # Seconds in block copies, per kind, as KVCache keeps them: here the round trip to
        # every worker (engine/stats.py reads them as the swap time).
        self.copy_seconds = {"swap_out": 0.0, "swap_in": 0.0}

    @property
    def num_workers(self) -> int:
        return self.executor.size

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def worker_nbytes(self) -> int:
        """One worker's slab: ``num_blocks x block_bytes / N``."""
        return self.num_blocks * self.worker_spec.block_bytes(self.block_size)

    @property
    def nbytes(self) -> int:
        """All workers' slabs together."""
        return self.worker_nbytes * self.num_workers

    def key_cache(self, layer: int):
        raise PagedLearnError(
            "with tensor_parallel_size > 1 the KV slabs live in the worker processes: read them "
            "with llm.collective_rpc(fn), which calls fn(worker) on each (worker.kv_cache)"
        )

    value_cache = key_cache

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write ``(src, dst)`` on every worker, each for its heads."""
        if pairs:
            self.executor.call("copy", list(pairs))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self._swap("swap_out", pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self._swap("swap_in", pairs)

    def _swap(self, kind: str, pairs) -> None:
        if not pairs:
            return
        if not self.has_swap_pool:
            raise PagedLearnError("the workers' KV caches have no CPU swap pool (swap_blocks=0)")
        t0 = time.perf_counter()
        self.executor.call(kind, list(pairs))
        self.copy_seconds[kind] += time.perf_counter() - t0
