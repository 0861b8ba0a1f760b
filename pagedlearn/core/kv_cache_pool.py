"""The pool a KV-cache manager allocates from: the blocks, and what goes with them.

``KVCacheManager(num_blocks=8, ...)`` builds a pool of 8 GPU blocks for itself. The pool holds

- the GPU :class:`BlockAllocator` (block_allocator.py: the free queue, refcounts, lazy LRU),
- the :class:`PrefixCache` (prefix_cache.py) when prefix caching is on, else None,
- the :class:`SwapSpace` (swap.py): a CPU pool of ``num_cpu_blocks`` blocks (0: no swapping),
- the list of pending copy-on-write copies ``(src, dst)`` the engine applies before a kernel runs,
- the :class:`Trace` every block event goes to (trace/events.py).

Why an object of its own: a model that mixes sliding-window and full-attention layers keeps one
manager per KV-cache group, and all of them must draw on the same blocks, find the same cached
prefixes and copy in one order. Its coordinator (hybrid/kv_cache_coordinator.py) builds one pool
and hands it to every group's manager, as vLLM's coordinator hands its ``BlockPool`` to each
``SingleTypeKVCacheManager``.

>>> pool = KVCachePool(num_blocks=4, num_cpu_blocks=2, enable_prefix_caching=True)
>>> pool.allocator.num_free_blocks, pool.swap.cpu_allocator.num_blocks, pool.copies
(4, 2, [])
"""

from __future__ import annotations

from pagedlearn.core.block_allocator import BlockAllocator
from pagedlearn.core.prefix_cache import PrefixCache
from pagedlearn.core.swap import SwapSpace
from pagedlearn.errors import PagedLearnError
from pagedlearn.trace.events import Trace


class KVCachePool:
    """``num_blocks`` GPU and ``num_cpu_blocks`` CPU blocks, with what goes with them;
    ``allocator_class`` and ``prefix_cache_class`` build the parts (a lab plugs a student's in)."""

    def __init__(
        self,
        num_blocks: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False,
        allocator_class: type = BlockAllocator,
        prefix_cache_class: type = PrefixCache,
    ) -> None:
        n_cpu = num_cpu_blocks
        if not isinstance(n_cpu, int) or isinstance(n_cpu, bool) or n_cpu < 0:
            raise PagedLearnError(f"num_cpu_blocks must be an int >= 0, got {n_cpu!r}")
        self.trace = Trace()
        self.allocator = allocator_class(num_blocks)
        self.prefix_cache = prefix_cache_class() if enable_prefix_caching else None
        self.copies: list[tuple[int, int]] = []  # pending copy-on-write (src, dst)
        # The swap pool holds KV only while its sequence is swapped out: no caching, no eviction.
        cpu = allocator_class(n_cpu) if n_cpu else None
        self.swap = SwapSpace(self.allocator, cpu, self.copies)

    def uncache_free_blocks(self) -> list[tuple[int, bytes]]:
        """Make every free cached block an empty one and forget its hash; returns ``(block,
        hash)`` for each (blocks in use keep theirs). An allocator forgets that a block is cached
        only when it hands it out, so every free block is handed out and taken back, in the same
        order (each cached one counts as an eviction). Emits nothing: the caller says why (a
        reset, or engine/recovery.py dropping blocks whose K/V may never have been written)."""
        allocator = self.allocator
        if self.prefix_cache is None or not allocator.num_cached_free_blocks:
            return []
        blocks = allocator.allocate(allocator.num_free_blocks)  # the empty ones first
        dropped = [(b, h) for b in blocks if (h := self.prefix_cache.evict(b)) is not None]
        allocator.free(blocks)  # back in the same order, all of them empty now
        return dropped

    def drop_free_cached_blocks(self) -> list[int]:
        """:meth:`uncache_free_blocks` for a reset (not counted as evictions); emits a
        ``cache_reset`` event naming the dropped blocks, and returns them."""
        dropped = [b for b, _ in self.uncache_free_blocks()]
        self.allocator.num_evictions -= len(dropped)
        self.trace.emit("cache_reset", tuple(dropped), ())
        return dropped
