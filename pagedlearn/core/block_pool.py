"""The block pool the KV-cache manager runs on: :class:`BlockAllocator`'s rules, a faster path.

block_allocator.py is the version to read (and the one lab 1 asks you to write): every method
checks its whole input with small helpers, then changes the pool, one block at a time.
:class:`BlockPool` keeps every rule, every error message and the exact order in which blocks are
handed out -- a property-based test drives both with the same random calls and compares
everything they return and hold (tests/test_fast_paths.py) -- and changes only how the work is
spelled, because a serving engine calls these methods for every block of every request:

- The queue of *empty* free blocks is a ``deque``: an empty block only ever leaves from the front
  (``allocate``) and joins at the back (``free``); only *cached* blocks are pulled out of the
  middle (a prefix hit), so only they need the ``OrderedDict``; ``deque.popleft`` is cheaper
  than ``OrderedDict.popitem(last=False)``.
- The checks run inline, in the loop that reads the refcounts anyway, instead of in a helper
  called per id; a ``Counter`` (to catch a block freed twice in one call) is built only when an id
  repeats, which the manager never does.
- Anything unusual -- an eviction, a bad id, a double free -- takes the plain path, so the error
  is the one :class:`BlockAllocator` raises, word for word.

``python benchmarks/bench_block_manager.py`` measures both classes side by side (the columns
``pagedlearn`` and ``pagedlearn plain``), beside vLLM's ``BlockPool`` when vLLM is installed.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable

from pagedlearn.core.block_allocator import BlockAllocator
from pagedlearn.errors import OutOfBlocksError, PagedLearnError


class BlockPool(BlockAllocator):
    """:class:`BlockAllocator` with the same behaviour and a faster common path.

    >>> pool = BlockPool(4)
    >>> pool.allocate(2), pool.free_queue()
    ([0, 1], [2, 3])
    >>> pool.incref([1]); pool.free([0, 1]); pool.refcount(1), pool.free_queue()
    (1, [2, 3, 0])
    """

    def __init__(self, num_blocks: int, on_evict: Callable[[int], None] | None = None) -> None:
        super().__init__(num_blocks, on_evict)
        self._free_empty: deque[int] = deque(range(num_blocks))  # type: ignore[assignment]

    def refcount(self, block_id: int) -> int:
        if type(block_id) is int and 0 <= block_id < self._num_blocks:
            return self._refcounts[block_id]
        return super().refcount(block_id)  # raises, naming the bad id

    def mark_cached(self, block_id: int) -> None:
        if type(block_id) is int and 0 <= block_id < self._num_blocks and self._refcounts[block_id]:
            self._cached.add(block_id)
        else:
            super().mark_cached(block_id)  # raises, naming the bad or free block

    def allocate(self, n: int = 1) -> list[int]:
        """Take ``n`` free blocks (refcount 0 -> 1), all or nothing: see
        :meth:`BlockAllocator.allocate`."""
        empty = self._free_empty
        if type(n) is not int or not 0 <= n <= len(empty):  # a bad n, or it must evict
            return self._allocate_evicting(n)
        ids = [empty.popleft()] if n == 1 else [empty.popleft() for _ in range(n)]
        refs = self._refcounts
        for b in ids:
            refs[b] = 1
        return ids

    def _allocate_evicting(self, n: int) -> list[int]:
        """``allocate`` when the empty blocks do not suffice: cached ones are evicted, least
        recently freed first (or ``n`` is bad, or too big: the plain errors)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise PagedLearnError(f"allocate(n) needs an int n >= 0, got {n!r}")
        if n > self.num_free_blocks:
            raise OutOfBlocksError(n, self.num_free_blocks, self._num_blocks)
        n = int(n)  # an int subclass (an IntEnum, say) counts as its value
        if n <= len(self._free_empty):  # it did not need to evict after all
            return self.allocate(n)
        ids = list(self._free_empty)
        self._free_empty.clear()
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
        """One more reference per id; a free cached block leaves the free queue (a prefix hit).
        See :meth:`BlockAllocator.incref`."""
        ids = ids if type(ids) is list else list(ids)
        refs, num_blocks, cached = self._refcounts, self._num_blocks, self._cached
        for b in ids:  # check all first; anything wrong: the plain method raises the error
            if type(b) is not int or not 0 <= b < num_blocks or (refs[b] == 0 and b not in cached):
                return super().incref(ids)
        for b in ids:
            r = refs[b]
            if r == 0:
                del self._free_cached[b]
            elif r == 1:
                self._num_shared += 1
            refs[b] = r + 1

    def free(self, ids: Iterable[int]) -> None:
        """One reference less per id; at 0 a block joins the back of its free queue. See
        :meth:`BlockAllocator.free`."""
        ids = ids if type(ids) is list else list(ids)
        refs, num_blocks = self._refcounts, self._num_blocks
        for b in ids:  # check all first; anything wrong: the plain checks raise the error
            if type(b) is not int or not 0 <= b < num_blocks or refs[b] == 0:
                return self._free_checked(ids)
        if len(ids) > 1 and len(set(ids)) < len(ids):  # a block listed twice: count them
            return self._free_checked(ids)
        cached, empty, lru = self._cached, self._free_empty, self._free_cached
        for b in ids:
            r = refs[b] - 1
            refs[b] = r
            if r == 0:
                if b in cached:
                    lru[b] = None  # back of the LRU queue: evicted last
                else:
                    empty.append(b)
            elif r == 1:
                self._num_shared -= 1

    def _free_checked(self, ids: list[int]) -> None:
        """``free`` with the plain checks (bad ids, double frees: they raise, changing
        nothing), then the same changes one id at a time."""
        self._check_ids(ids)
        for b, times in Counter(ids).items():
            if times > self._refcounts[b]:
                raise PagedLearnError(
                    f"double free: block {b} freed {times}x but has refcount {self._refcounts[b]}"
                )
        for b in ids:  # the plain way, one id at a time (an id may repeat here)
            self._refcounts[b] -= 1
            self._num_shared -= self._refcounts[b] == 1
            if self._refcounts[b] == 0:
                if b in self._cached:
                    self._free_cached[b] = None
                else:
                    self._free_empty.append(b)

    def __repr__(self) -> str:
        return super().__repr__().replace("BlockAllocator", "BlockPool", 1)
