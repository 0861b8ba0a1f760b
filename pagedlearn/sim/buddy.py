"""A buddy allocator over token slots: the memory of the paper's contiguous-reservation baselines.

Before PagedAttention, a serving system (Orca, FasterTransformer) gave each request one *contiguous*
run of KV-cache token slots, reserved up front: 2048 slots (Orca "Max"), the prompt plus output
length rounded up to a power of two ("Pow2"), or the exact final length ("Oracle"). Figure 2 of
the paper measures how much of that memory holds real KV, and notes that "all three use a buddy
allocator". This module is that allocator, so that the waste is *measured* on a real free list.

How a buddy allocator works: the pool is a block of ``2**k`` slots. To serve a request it rounds the
size up to a power of two, takes the smallest free block at least that large, and splits it in
halves until a half has the right size; each split leaves the other half free. The two halves of
one split are *buddies*: a block of size ``s`` at offset ``o`` (``o`` a multiple of ``s``) has its
buddy at ``o XOR s``. When a block is freed and its buddy is free and whole, the two merge back into
their parent, and so on upward. Finding a buddy is one XOR, so every operation costs O(log n).

The price is fragmentation of both kinds:

- *internal*: a request for 1025 slots holds 2048; the rounding waste lives inside the allocation.
- *external*: free slots can be plentiful yet scattered. Free blocks merge only with their buddy,
  so two free neighbours that are not buddies (``[4, 8)`` and ``[8, 12)``, whose buddies are
  ``[0, 4)`` and ``[12, 16)``) never form an aligned block of 8, and ``allocate(8)`` fails while 8
  slots are free. ``allocate`` then returns ``None``: a scheduler waits, or preempts.

A pool that is not a power of two (the paper's 15.7K slots: 12 GB at 800 KB per token for OPT-13B)
is split by its binary decomposition into top-level *arenas*, largest first from offset 0:
15700 = 8192 + 4096 + 2048 + 1024 + 256 + 64 + 16 + 4, at offsets 0, 8192, 12288, 14336, ... Each
arena is a buddy system of its own, and blocks never merge across arenas (a merged block would not
be a power of two, or not aligned). The choice wastes nothing and keeps the XOR rule: every arena
starts at a multiple of its own size (all arenas before it are larger powers of two), so a block's
alignment to its size is the same measured from 0 or from its arena's start. The largest request
such a pool can ever serve is its largest arena, ``largest_arena`` (8192 for 15700 slots); asking
for more raises, because waiting would never help.
"""

from __future__ import annotations

from bisect import bisect_right

from pagedlearn.errors import PagedLearnError


class BuddyAllocator:
    """Contiguous runs of token slots, each a power of two, aligned to its size within its arena.

    >>> pool = BuddyAllocator(16)
    >>> pool.allocate(3), pool.allocated_size(0)      # 3 rounds up to 4 slots: 1 slot wasted inside
    (0, 4)
    >>> [pool.allocate(4) for _ in range(3)]
    [4, 8, 12]
    >>> pool.free(4); pool.free(8); pool.num_free_slots  # [4, 12) is free but is not a buddy pair
    8
    >>> pool.allocate(8) is None                         # external fragmentation
    True
    >>> pool.free(0); pool.allocate(8)                   # [0, 4) + [4, 8) merge into [0, 8)
    0
    """

    def __init__(self, num_slots: int) -> None:
        if not _is_int(num_slots) or num_slots < 1:
            raise PagedLearnError(f"num_slots must be a positive int, got {num_slots!r}")
        self._num_slots = num_slots
        # Arenas by binary decomposition, largest first: (start, size) with start % size == 0.
        self._arenas: list[tuple[int, int]] = []
        start = 0
        for k in reversed(range(num_slots.bit_length())):
            if num_slots >> k & 1:
                self._arenas.append((start, 1 << k))
                start += 1 << k
        self._arena_starts = [a for a, _ in self._arenas]  # sorted, for bisect
        # One free list per order k (blocks of 2**k slots): a set of offsets, so that "is my
        # buddy free?" is one lookup and taking a block out of the middle is O(1).
        self._free: list[set[int]] = [set() for _ in range(num_slots.bit_length())]
        for a, size in self._arenas:
            self._free[size.bit_length() - 1].add(a)
        self._allocated: dict[int, int] = {}  # start offset -> size (a power of two)
        self._num_free = num_slots  # kept up to date, so the counters are O(1)

    # --- queries -------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def num_free_slots(self) -> int:
        return self._num_free

    @property
    def num_allocated_slots(self) -> int:
        """Slots held by allocations, rounding waste included."""
        return self._num_slots - self._num_free

    @property
    def largest_free_run(self) -> int:
        """The largest size ``allocate`` could satisfy now: the largest free *block*, 0 if none.

        Neighbouring free blocks that are not buddies do not add up: a buddy allocator cannot hand
        out ``[4, 12)`` as one run, so this may be smaller than the longest stretch of free slots.
        """
        for k in reversed(range(len(self._free))):
            if self._free[k]:
                return 1 << k
        return 0

    @property
    def largest_arena(self) -> int:
        """The largest size any ``allocate`` can ever get: the first (largest) arena."""
        return self._arenas[0][1]

    def can_allocate(self, size: int) -> bool:
        """Whether ``allocate(size)`` would succeed now (raises on the inputs it raises on)."""
        return self._rounded(size) <= self.largest_free_run

    def allocated_size(self, offset: int) -> int:
        """The power-of-two size of the allocation that starts at ``offset``."""
        self._check_allocation_start(offset, "allocated_size")
        return self._allocated[offset]

    def free_runs(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every free block, sorted by offset (for pictures and tests)."""
        return sorted((o, 1 << k) for k, offsets in enumerate(self._free) for o in offsets)

    def allocations(self) -> dict[int, int]:
        """``offset -> size`` of every allocation, sorted by offset."""
        return dict(sorted(self._allocated.items()))

    # --- operations ----------------------------------------------------------------------------
    def allocate(self, size: int) -> int | None:
        """Reserve ``next_pow2(size)`` contiguous slots; return the start offset, or ``None``.

        ``None`` (no error) means no free block is large enough *now*: an expected outcome that a
        scheduler handles by waiting or preempting. Takes the smallest free block that fits, the
        lowest offset among equals (so runs are repeatable), and splits it down, keeping the
        lower half each time: the upper halves join the free lists as the buddies of what remains.
        """
        need = self._rounded(size).bit_length() - 1  # the order of the block we hand out
        k = next((k for k in range(need, len(self._free)) if self._free[k]), None)
        if k is None:
            return None
        offset = min(self._free[k])  # O(free blocks of this order); deterministic
        self._free[k].remove(offset)
        while k > need:  # split: keep the lower half, free the upper half (its buddy)
            k -= 1
            self._free[k].add(offset + (1 << k))
        self._allocated[offset] = 1 << need
        self._num_free -= 1 << need
        return offset

    def free(self, offset: int) -> None:
        """Give back the allocation that starts at ``offset``, merging with free buddies upward.

        Raises, changing nothing, for an offset that is not an allocation's start: a double free,
        or an offset inside an allocation.
        """
        self._check_allocation_start(offset, "free")
        size = self._allocated.pop(offset)
        self._num_free += size
        k = size.bit_length() - 1
        arena_size = self._arena_of(offset)[1]
        # Merge while the buddy is a free block of the same order. Buddies never cross an arena:
        # at the arena's size the block *is* the arena, and it stops there.
        while (1 << k) < arena_size and (offset ^ (1 << k)) in self._free[k]:
            self._free[k].remove(offset ^ (1 << k))
            offset &= ~(1 << k)  # the parent starts at the lower buddy
            k += 1
        self._free[k].add(offset)

    # --- checks --------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise :class:`PagedLearnError` naming the first broken rule of the pool."""
        blocks = [(o, 1 << k, "free") for k, offsets in enumerate(self._free) for o in offsets]
        for o, size in self._allocated.items():
            if not _is_int(size) or size < 1 or size & (size - 1):
                _fail(f"allocation at {o} has size {size!r}, not a power of two")
            blocks.append((o, size, "allocated"))
        # 1: every block lies inside one arena, aligned to its size there.
        for o, size, what in blocks:
            if not _is_int(o) or not 0 <= o < self._num_slots:
                _fail(f"{what} block at {o!r} is outside the pool of {self._num_slots} slots")
            start, arena_size = self._arena_of(o)
            if (o - start) % size or o + size > start + arena_size:
                _fail(
                    f"{what} block [{o}, {o + size}) is not aligned inside its arena "
                    f"[{start}, {start + arena_size})"
                )
        # 2: the blocks tile the pool exactly: no overlap, no gap.
        end = 0
        for o, size, what in sorted(blocks):
            if o != end:
                problem = "overlaps the block before it" if o < end else f"leaves [{end}, {o}) lost"
                _fail(f"{what} block [{o}, {o + size}) {problem}")
            end = o + size
        if end != self._num_slots:
            _fail(f"the blocks cover [0, {end}), not the whole pool [0, {self._num_slots})")
        # 3: two free buddies would have been merged when the second one was freed.
        for k, offsets in enumerate(self._free):
            for o in offsets:
                s, low = 1 << k, o & ~(1 << k)
                if o != low and s < self._arena_of(o)[1] and low in offsets:
                    _fail(f"free buddies [{low}, {o}) and [{o}, {o + s}) were never merged")
        # 4: the counters agree with the lists.
        free = sum(size for _, size, what in blocks if what == "free")
        held = sum(self._allocated.values())
        if free != self._num_free:
            _fail(f"num_free_slots is {self._num_free} but the free lists hold {free}")
        if free + held != self._num_slots:
            _fail(f"free ({free}) + allocated ({held}) != num_slots ({self._num_slots})")

    # --- helpers -------------------------------------------------------------------------------
    def _rounded(self, size: int) -> int:
        """Check a requested size and round it up to a power of two."""
        if not _is_int(size) or size < 1:
            raise PagedLearnError(f"size must be a positive int, got {size!r}")
        if size > self._num_slots:
            raise PagedLearnError(f"size {size} is larger than the pool of {self._num_slots} slots")
        rounded = 1 << (size - 1).bit_length()
        if rounded > self.largest_arena:
            raise PagedLearnError(
                f"size {size} rounds up to {rounded} slots, but the largest arena of this "
                f"{self._num_slots}-slot pool holds {self.largest_arena}: it can never fit"
            )
        return rounded

    def _arena_of(self, offset: int) -> tuple[int, int]:
        return self._arenas[bisect_right(self._arena_starts, offset) - 1]

    def _check_allocation_start(self, offset: int, op: str) -> None:
        if not _is_int(offset) or not 0 <= offset < self._num_slots:
            raise PagedLearnError(
                f"{op}({offset!r}): not a slot offset: offsets are ints 0..{self._num_slots - 1}"
            )
        if offset in self._allocated:
            return
        # Name the problem: an offset inside a live allocation, or a slot that is free (a
        # double free). The allocation holding ``offset``, if any, starts at ``offset`` rounded
        # down to some power of two (arena starts are aligned too), so O(log n) lookups find it.
        for k in range(len(self._free)):
            start = offset & ~((1 << k) - 1)
            if self._allocated.get(start) == 1 << k:
                raise PagedLearnError(
                    f"{op}({offset}): slot {offset} is inside the allocation [{start}, "
                    f"{start + (1 << k)}), which must be freed by its start offset {start}"
                )
        raise PagedLearnError(f"{op}({offset}): no allocation starts there (double free?)")

    def __repr__(self) -> str:
        return (
            f"BuddyAllocator(num_slots={self._num_slots}, free={self._num_free}, "
            f"allocations={len(self._allocated)}, largest_free_run={self.largest_free_run})"
        )


def _fail(message: str) -> None:
    raise PagedLearnError(f"buddy allocator invariant broken: {message}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # True is an int in Python; not here
