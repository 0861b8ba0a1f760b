"""The physical block pool: which blocks are free, and how many sequences use each one.

PagedAttention splits the KV cache into fixed-size *blocks* of ``block_size`` tokens, like pages of
virtual memory. A block is only an id here, ``0 .. num_blocks-1``; the tensors live elsewhere
(``attention/kv_cache.py``). The allocator hands ids out and takes them back, and keeps a
*reference count* per block: how many block tables point at it. Sharing (parallel sampling, beam
search, a cached prefix) raises the count instead of copying memory; a block returns to the free
queue only when its count drops to 0.

A free block may still hold useful KV: a full block registered in the prefix cache. Such a block
stays findable until its slot is needed for new data (lazy eviction). So the free queue is two
ordered queues, and ``allocate`` takes

1. blocks that hold nothing, first (evicting nothing), then
2. cached blocks, least recently freed first (LRU eviction). The block's old KV is lost, so its
   hash must be forgotten: the KV-cache manager asks its prefix cache about each block it is
   handed, and an ``on_evict`` callback, if given, is called with each evicted id.

Every operation is O(1) per block, with 1k or 100k blocks. An empty block only ever leaves from
the front (``allocate``) and joins at the back (``free``): a ``deque``. A cached block may also be
pulled out of the middle, on a prefix hit (``incref`` of a free block): an ``OrderedDict`` (a hash
map threaded by a doubly linked list) unlinks it in O(1), where ``deque.remove`` would scan.

Every method checks its whole input before changing anything, so an error leaves the pool as it
was. A serving engine calls these methods for every block of every request, so the checks are
cheap in the common case (a plain int id in range, each id listed once) and the slower, precise
ones run only when something is unusual: they name the problem.

This is the class the KV-cache manager runs on, and the one lab 1 asks you to write.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
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
    >>> pool.free_queue()                        # block 0 joined the back of the queue
    [2, 3, 0]
    """

    def __init__(self, num_blocks: int, on_evict: Callable[[int], None] | None = None) -> None:
        if not _is_int(num_blocks) or num_blocks < 1:
            raise PagedLearnError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self._num_blocks = num_blocks
        self._refcounts = [0] * num_blocks
        # Free blocks, oldest first: empty ones (leave from the front only), then cached ones.
        self._free_empty: deque[int] = deque(range(num_blocks))
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
        if type(block_id) is not int or not 0 <= block_id < self._num_blocks:
            self._check_ids([block_id])  # an int subclass in range passes; else it raises
        return self._refcounts[block_id]

    def is_cached(self, block_id: int) -> bool:
        if type(block_id) is not int or not 0 <= block_id < self._num_blocks:
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
        if (type(n) is not int and not _is_int(n)) or n < 0:  # plain ints: one test
            raise PagedLearnError(f"allocate(n) needs an int n >= 0, got {n!r}")
        empty = self._free_empty
        if n <= len(empty):  # the common case: empty blocks suffice, nothing is evicted
            ids = [empty.popleft()] if n == 1 else [empty.popleft() for _ in range(n)]
        elif n > self.num_free_blocks:
            raise OutOfBlocksError(n, self.num_free_blocks, self._num_blocks)
        else:  # every empty block, then cached ones, least recently used first: evicted
            ids = list(empty)
            empty.clear()
            while len(ids) < n:
                block_id, _ = self._free_cached.popitem(last=False)
                self._cached.discard(block_id)
                self.num_evictions += 1
                if self.on_evict is not None:
                    self.on_evict(block_id)
                ids.append(block_id)
        for b in ids:
            self._refcounts[b] = 1
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        """Add one reference per id (sharing). A free *cached* block is taken back out of the free
        queue (a prefix-cache hit); a free empty block cannot be shared -- allocate it instead."""
        ids = ids if type(ids) is list else list(ids)  # (a generator can be read only once)
        refs, cached, n = self._refcounts, self._cached, self._num_blocks
        for b in ids:  # check every id before changing anything (plain int ids: one test each)
            if type(b) is not int or not 0 <= b < n or (refs[b] == 0 and b not in cached):
                self._check_ids(ids)  # raises, naming the first bad id
                if refs[b] == 0 and b not in cached:
                    raise PagedLearnError(f"incref of block {b}: it is free and holds no cached KV")
        for b in ids:
            if refs[b] == 0:
                del self._free_cached[b]  # O(1): OrderedDict unlinks the node
            elif refs[b] == 1:
                self._num_shared += 1
            refs[b] += 1

    def free(self, ids: Iterable[int]) -> None:
        """Drop one reference per id; a block whose count reaches 0 joins the free queue.

        Cached blocks join the back of the LRU queue (most recently used), so they are evicted
        last. Freeing a block more times than it is referenced raises, changing nothing.
        """
        ids = ids if type(ids) is list else list(ids)  # (a generator can be read only once)
        refs, n = self._refcounts, self._num_blocks
        # Check everything before changing anything. A double free frees a block more times than
        # it is referenced: only a free block or an id listed twice can be one, and counting the
        # ids (a Counter) costs more than the rest of free, so they are counted only then.
        count = len(ids) > 1 and len(set(ids)) < len(ids)  # an id listed twice
        for b in ids:
            if type(b) is not int or not 0 <= b < n or refs[b] == 0:
                self._check_ids(ids)  # raises, naming the first bad id
                count = True
        if count:
            for b, times in Counter(ids).items():
                if times > refs[b]:
                    raise PagedLearnError(
                        f"double free: block {b} freed {times}x but has refcount {refs[b]}"
                    )
        cached, lru, empty = self._cached, self._free_cached, self._free_empty
        for b in ids:
            refs[b] -= 1
            if refs[b] == 0:
                if b in cached:
                    lru[b] = None  # the back of the LRU queue: evicted last
                else:
                    empty.append(b)
            elif refs[b] == 1:
                self._num_shared -= 1

    def mark_cached(self, block_id: int) -> None:
        """Record that a used block now holds KV the prefix cache can find again."""
        if type(block_id) is not int or not 0 <= block_id < self._num_blocks:
            self._check_ids([block_id])  # an int subclass in range passes; else it raises
        if self._refcounts[block_id] == 0:
            raise PagedLearnError(f"mark_cached of block {block_id}: it is free")
        self._cached.add(block_id)

    # --- helpers -------------------------------------------------------------------------------
    def _check_ids(self, ids: list[int]) -> None:
        """Raise, naming the first id that is not an int in ``0 .. num_blocks-1``."""
        n = self._num_blocks
        for b in ids:
            if (type(b) is not int and not _is_int(b)) or not 0 <= b < n:  # plain ints: one test
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
