"""The physical block pool: which blocks are free, and how many sequences use each one.

PagedAttention splits the KV cache into fixed-size *blocks* of ``block_size`` tokens, like pages of
virtual memory. A block is only an id here, ``0 .. num_blocks-1``; the tensors live elsewhere
(``kv_cache.py``). The allocator hands ids out and takes them back, and keeps a *reference count*
per block: how many block tables point at it. Sharing (parallel sampling, beam search, a cached
prefix) raises the count instead of copying memory; a block returns to the free queue only when its
count drops to 0.

A free block may still hold useful KV: a full block registered in the prefix cache. Such a block
stays findable until its slot is needed for new data (lazy eviction). So the free queue is two
ordered queues, and ``allocate`` takes

1. blocks that hold nothing, first (evicting nothing), then
2. cached blocks, least recently freed first (LRU eviction). The block's old KV is lost, so its
   hash must be forgotten: the KV-cache manager asks its prefix cache about each block it is
   handed, and an ``on_evict`` callback, if given, is called with each evicted id.

Every operation is O(1) per block: the queues are ``OrderedDict``s (a hash map threaded by a
doubly linked list), so popping the oldest block, appending a freed one, and pulling a cached block
back out of the middle of the queue on a prefix hit (``incref`` of a free block) cost the same with
1k or 100k blocks. (A ``deque.remove`` would scan the queue: O(n).)

Every method checks its whole input before changing anything, so an error leaves the pool as it was.

This is the version to read, and the one lab 1 asks you to write. The KV-cache manager runs on
its twin, :class:`~pagedlearn.core.block_pool.BlockPool` (block_pool.py): the same rules, errors and
order, with a faster common path; tests/test_fast_paths.py drives both with the same calls.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

from pagedlearn.errors import OutOfBlocksError, PagedLearnError


class BlockAllocator:
    """Hands out physical block ids and counts references to them.

    >>> pool = BlockAllocator(4)
    >>> pool.allocate(2)
    [0, 1]
    >>> pool.incref([1]); pool.refcount(1)     # a second sequence now shares block 1
    2
    >>> pool.free([0, 1]); pool.num_free_blocks  # block 1 is still used once
    3
    """

    def __init__(self, num_blocks: int, on_evict: Callable[[int], None] | None = None) -> None:
        if not _is_int(num_blocks) or num_blocks < 1:
            raise PagedLearnError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self._num_blocks = num_blocks
        self._refcounts = [0] * num_blocks
        # Free blocks, oldest first. Values are unused: the OrderedDict is an O(1) linked set.
        self._free_empty: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU order: evict from front
        self._cached: set[int] = set()  # blocks (used or free) whose KV the prefix cache indexes
        self.on_evict = on_evict
        self.num_evictions = 0
        self._num_shared = 0  # blocks with refcount > 1, kept up to date so stats() is O(1)

    # --- queries -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_empty) + len(self._free_cached)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable cached prefix."""
        return len(self._free_cached)

    @property
    def num_shared_blocks(self) -> int:
        """Blocks referenced by more than one block table (refcount > 1)."""
        return self._num_shared

    def refcount(self, block_id: int) -> int:
        self._check_ids([block_id])
        return self._refcounts[block_id]

    def is_cached(self, block_id: int) -> bool:
        self._check_ids([block_id])
        return block_id in self._cached

    def free_queue(self) -> list[int]:
        """Free block ids in the order ``allocate`` would hand them out (for pictures and tests)."""
        return [*self._free_empty, *self._free_cached]

    # --- operations ----------------------------------------------------------------------------
    def allocate(self, n: int = 1) -> list[int]:
        """Take ``n`` free blocks (refcount 0 -> 1), all or nothing.

        Raises :class:`OutOfBlocksError`, changing nothing, when fewer than ``n`` are free.
        """
        if not _is_int(n) or n < 0:
            raise PagedLearnError(f"allocate(n) needs an int n >= 0, got {n!r}")
        if n > self.num_free_blocks:
            raise OutOfBlocksError(n, self.num_free_blocks, self._num_blocks)
        ids = []
        for _ in range(n):
            if self._free_empty:
                block_id, _ = self._free_empty.popitem(last=False)
            else:  # only cached blocks left: reuse the least recently used one
                block_id, _ = self._free_cached.popitem(last=False)
                self._cached.discard(block_id)
                self.num_evictions += 1
                if self.on_evict is not None:
                    self.on_evict(block_id)
            self._refcounts[block_id] = 1
            ids.append(block_id)
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        """Add one reference per id (sharing). A free *cached* block is taken back out of the free
        queue (a prefix-cache hit); a free empty block cannot be shared -- allocate it instead."""
        ids = list(ids)
        self._check_ids(ids)
        for b in ids:
            if self._refcounts[b] == 0 and b not in self._cached:
                raise PagedLearnError(f"incref of block {b}: it is free and holds no cached KV")
        for b in ids:
            if self._refcounts[b] == 0:
                del self._free_cached[b]  # O(1): OrderedDict unlinks the node
            self._refcounts[b] += 1
            self._num_shared += self._refcounts[b] == 2

    def free(self, ids: Iterable[int]) -> None:
        """Drop one reference per id; a block whose count reaches 0 joins the free queue.

        Cached blocks join the back of the LRU queue (most recently used), so they are evicted
        last. Freeing a block more times than it is referenced raises, changing nothing.
        """
        ids = list(ids)
        self._check_ids(ids)
        for b, times in Counter(ids).items():
            if times > self._refcounts[b]:
                raise PagedLearnError(
                    f"double free: block {b} freed {times}x but has refcount {self._refcounts[b]}"
                )
        for b in ids:
            self._refcounts[b] -= 1
            self._num_shared -= self._refcounts[b] == 1
            if self._refcounts[b] == 0:
                queue = self._free_cached if b in self._cached else self._free_empty
                queue[b] = None

    def mark_cached(self, block_id: int) -> None:
        """Record that a used block now holds KV the prefix cache can find again."""
        self._check_ids([block_id])
        if self._refcounts[block_id] == 0:
            raise PagedLearnError(f"mark_cached of block {block_id}: it is free")
        self._cached.add(block_id)

    # --- helpers -------------------------------------------------------------------------------
    def _check_ids(self, ids: list[int]) -> None:
        for b in ids:
            if not _is_int(b) or not 0 <= b < self._num_blocks:
                raise PagedLearnError(
                    f"block id {b!r} is not a valid id: ids are ints 0..{self._num_blocks - 1}"
                )

    def __repr__(self) -> str:
        return (
            f"BlockAllocator(num_blocks={self._num_blocks}, free={self.num_free_blocks}, "
            f"cached_free={self.num_cached_free_blocks})"
        )


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # True is an int in Python; not here
