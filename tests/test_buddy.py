"""Tests of the buddy allocator behind the paper's contiguous-reservation baselines (Figure 2).

Unit tests pin the facts a reader checks by hand: sizes round up to powers of two, the paper's
15.7K-slot pool holds exactly 7 "Max" reservations of 2048, free slots can be plentiful while an
allocation fails (external fragmentation), and freeing everything merges back to the arenas.

A hypothesis state machine then allocates and frees at random against a per-slot shadow model and
checks, after every step, that ``allocate`` fails *exactly* when the shadow has no aligned free run
of the rounded size inside one arena -- the buddy allocator never misses a block it could use.
"""

import random
from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pagedlearn import PagedLearnError
from pagedlearn.sim.buddy import BuddyAllocator

PAPER_POOL = 12 * 2**30 // (800 * 2**10)  # 12 GiB of KV at 800 KiB per token (OPT-13B) = 15728


def snapshot(pool: BuddyAllocator):
    """Everything an operation could change, to check that a refused one changed nothing."""
    return pool.free_runs(), pool.allocations(), pool.num_free_slots, pool.num_allocated_slots


def arenas(num_slots: int) -> list[tuple[int, int]]:
    """The binary decomposition, largest first from 0, computed independently of the allocator."""
    out, start = [], 0
    for bit in sorted(1 << k for k in range(num_slots.bit_length()) if num_slots >> k & 1)[::-1]:
        out.append((start, bit))
        start += bit
    return out


# --- unit tests --------------------------------------------------------------------------------
@pytest.mark.parametrize(("size", "held"), [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (1025, 2048)])
def test_sizes_round_up_to_powers_of_two(size, held):
    pool = BuddyAllocator(4096)
    offset = pool.allocate(size)
    assert offset == 0 and pool.allocated_size(offset) == held
    assert pool.num_allocated_slots == held and pool.num_free_slots == 4096 - held
    pool.check_invariants()


def test_a_pool_that_is_not_a_power_of_two_is_split_into_arenas():
    pool = BuddyAllocator(15_700)
    expected = [(0, 8192), (8192, 4096), (12288, 2048), (14336, 1024)]
    expected += [(15360, 256), (15616, 64), (15680, 16), (15696, 4)]
    assert pool.free_runs() == expected == arenas(15_700)
    assert pool.largest_arena == pool.largest_free_run == 8192
    pool.check_invariants()


@pytest.mark.parametrize("num_slots", [15_700, PAPER_POOL])
def test_the_papers_pool_fits_exactly_seven_max_reservations(num_slots):
    """Orca (Max) reserves 2048 slots per request: the 15.7K-slot pool batches exactly 7."""
    assert PAPER_POOL == 15_728
    pool = BuddyAllocator(num_slots)
    offsets = [pool.allocate(2048) for _ in range(7)]
    # The smallest free block that fits goes first: the 2048-slot arena, then the 4096 one, split.
    assert offsets == [12288, 8192, 10240, 0, 2048, 4096, 6144]
    assert not pool.can_allocate(2048) and pool.allocate(2048) is None  # 8th: no room
    assert pool.num_free_slots == num_slots - 7 * 2048  # 1364 or 1392 slots, all too scattered
    pool.free(4096)
    assert pool.allocate(2048) == 4096  # room again once one request finishes
    pool.check_invariants()


def test_external_fragmentation_free_slots_that_are_not_buddies():
    pool = BuddyAllocator(16)
    assert [pool.allocate(4) for _ in range(4)] == [0, 4, 8, 12]
    pool.free(4)
    pool.free(8)  # [4, 12) is free and contiguous, but [4, 8)'s buddy is [0, 4), not [8, 12)
    assert pool.num_free_slots >= 8 and pool.largest_free_run == 4
    assert pool.allocate(8) is None and not pool.can_allocate(8)
    assert pool.free_runs() == [(4, 4), (8, 4)]
    pool.free(0)  # now [0, 4) + [4, 8) are buddies and merge
    assert pool.free_runs() == [(0, 8), (8, 4)] and pool.allocate(8) == 0


def test_free_blocks_never_merge_across_arenas():
    pool = BuddyAllocator(24)  # arenas [0, 16) and [16, 24)
    assert pool.allocate(8) == 16  # the smallest free block that fits: the whole second arena
    assert pool.allocate(8) == 0 and pool.allocate(8) == 8
    pool.free(8)
    pool.free(16)  # [8, 24) is free and contiguous, but spans two arenas
    assert pool.free_runs() == [(8, 8), (16, 8)]
    assert pool.num_free_slots == 16 and pool.allocate(16) is None
    pool.check_invariants()


def test_smallest_block_first_then_lowest_offset():
    pool = BuddyAllocator(12)  # arenas [0, 8) and [8, 12)
    assert pool.allocate(4) == 8  # the 4-slot arena fits exactly: the 8-slot one is not split
    assert [pool.allocate(1), pool.allocate(1), pool.allocate(2)] == [0, 1, 2]
    assert pool.free_runs() == [(4, 4)]


def test_freeing_everything_merges_back_to_the_arenas():
    rng = random.Random(0)
    pool = BuddyAllocator(15_700)
    live = []
    while (offset := pool.allocate(rng.choice([1, 3, 17, 100, 513, 2048]))) is not None:
        live.append(offset)
    assert len(live) > 20 and pool.num_free_slots < 2048
    rng.shuffle(live)
    for offset in live:
        pool.free(offset)
        pool.check_invariants()
    assert pool.free_runs() == arenas(15_700) and pool.allocations() == {}
    assert pool.num_free_slots == 15_700 and pool.num_allocated_slots == 0


@pytest.mark.parametrize(
    ("size", "message"),
    [
        (0, "positive int"),
        (-3, "positive int"),
        (True, "positive int"),  # a bool is an int in Python, but not a size
        (2.0, "positive int"),
        ("8", "positive int"),
        (None, "positive int"),
        (101, "larger than the pool"),
        (65, "can never fit"),  # 65 <= 100 slots, but rounds to 128 > the 64-slot arena
    ],
)
def test_bad_sizes_raise_and_change_nothing(size, message):
    pool = BuddyAllocator(100)
    pool.allocate(5)
    before = snapshot(pool)
    with pytest.raises(PagedLearnError, match=message):
        pool.allocate(size)
    with pytest.raises(PagedLearnError, match=message):
        pool.can_allocate(size)
    assert snapshot(pool) == before


@pytest.mark.parametrize("num_slots", [0, -1, True, 16.0, "16", None])
def test_bad_pool_sizes_raise(num_slots):
    with pytest.raises(PagedLearnError, match="num_slots must be a positive int"):
        BuddyAllocator(num_slots)


@pytest.mark.parametrize(
    ("offset", "message"),
    [
        (8, "double free"),  # was freed already
        (5, r"inside the allocation \[4, 8\)"),  # an interior slot of a live allocation
        (12, "double free"),  # a free slot that never started anything
        (16, "not a slot offset"),
        (-1, "not a slot offset"),
        (True, "not a slot offset"),
        (4.0, "not a slot offset"),
    ],
)
def test_bad_frees_raise_and_change_nothing(offset, message):
    pool = BuddyAllocator(16)
    assert [pool.allocate(4), pool.allocate(4), pool.allocate(4)] == [0, 4, 8]
    pool.free(8)
    before = snapshot(pool)
    with pytest.raises(PagedLearnError, match=message):
        pool.free(offset)
    with pytest.raises(PagedLearnError, match=message):
        pool.allocated_size(offset)
    assert snapshot(pool) == before
    pool.check_invariants()


def test_a_large_pool_is_cheap():
    """No per-slot state: 100K slots, many small allocations, all in well under a second."""
    pool = BuddyAllocator(100_000)
    live = [pool.allocate(7) for _ in range(10_000)]
    assert None not in live and pool.num_allocated_slots == 80_000
    for offset in live[::2]:
        pool.free(offset)
    assert pool.largest_free_run == 16384  # the untouched part of the pool, not the holes
    pool.check_invariants()


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda p: p._free[2].add(8), "overlaps"),  # a live allocation also listed as free
        (lambda p: p._free[0].remove(3), r"leaves \[3, 4\) lost"),
        (lambda p: p._free[1].add(5), "not aligned"),  # [5, 7) starts off its 2-slot grid
        (lambda p: p._allocated.update({8: 3}), "not a power of two"),
        (lambda p: (p._allocated.pop(2), p._free[0].add(2)), "never merged"),  # [2,3) + [3,4)
        (lambda p: setattr(p, "_num_free", 0), "num_free_slots"),
    ],
)
def test_check_invariants_names_the_broken_rule(corrupt, message):
    """The checker is not vacuous: each kind of corruption is caught, and named."""
    pool = BuddyAllocator(12)  # arenas [0, 8) and [8, 12)
    assert [pool.allocate(4), pool.allocate(2), pool.allocate(1)] == [8, 0, 2]
    assert pool.free_runs() == [(3, 1), (4, 4)]
    pool.check_invariants()
    corrupt(pool)
    with pytest.raises(PagedLearnError, match=message):
        pool.check_invariants()


# --- random operations against a shadow model --------------------------------------------------
STEPS = Counter()
SEEN = Counter()  # how often the interesting cases happened, to prove the test reached them


class BuddyMachine(RuleBasedStateMachine):
    # Small pools fill up and fragment within 40 steps; large ones exercise deep splits.
    @initialize(num_slots=st.one_of(st.integers(1, 32), st.integers(1, 300)))
    def setup(self, num_slots):
        self.pool = BuddyAllocator(num_slots)
        self.n = num_slots
        self.arenas = arenas(num_slots)
        self.owner: list[int | None] = [None] * num_slots  # shadow: allocation start per slot
        self.live: dict[int, int] = {}  # shadow: start -> rounded size

    def _fits(self, rounded: int) -> bool:
        """Whether the shadow holds an aligned, wholly free run of ``rounded`` slots in an arena."""
        return any(
            all(self.owner[s] is None for s in range(o, o + rounded))
            for start, size in self.arenas
            if size >= rounded
            for o in range(start, start + size, rounded)
        )

    @rule(data=st.data())
    def allocate(self, data):
        # Small requests, any size, and the largest power of two the free slots add up to (it
        # can fail only through external fragmentation).
        free = max(1, self.pool.num_free_slots)
        fitting = st.just(1 << (free.bit_length() - 1))
        sizes = st.one_of(st.integers(1, min(4, self.n)), st.integers(1, self.n), fitting)
        self._allocate(data.draw(sizes))

    @rule(size=st.integers(1, 4))
    def fill(self, size):
        """A burst of equal requests until one fails, as a batch of Orca "Max" reservations
        fills the pool; frees afterwards leave holes between live allocations."""
        if size <= self.n:
            while self._allocate(size) is not None:
                pass

    def _allocate(self, size: int) -> int | None:
        rounded = 1 << (size - 1).bit_length()
        before = snapshot(self.pool)
        if rounded > self.arenas[0][1]:
            with pytest.raises(PagedLearnError, match="can never fit"):
                self.pool.allocate(size)
            assert snapshot(self.pool) == before
            SEEN["never fits"] += 1
            return None
        fits = self._fits(rounded)
        assert self.pool.can_allocate(size) == fits
        offset = self.pool.allocate(size)
        if offset is None:
            assert not fits and self.pool.largest_free_run < rounded
            assert snapshot(self.pool) == before
            SEEN["none"] += 1
            if self.pool.num_free_slots >= rounded:
                SEEN["external fragmentation"] += 1
            return None
        assert fits and self.pool.allocated_size(offset) == rounded
        start, size_ = next((a, s) for a, s in self.arenas if a <= offset < a + s)
        assert (offset - start) % rounded == 0 and offset + rounded <= start + size_
        assert all(self.owner[s] is None for s in range(offset, offset + rounded)), "overlap"
        self.owner[offset : offset + rounded] = [offset] * rounded
        self.live[offset] = rounded
        SEEN["allocated"] += 1
        return offset

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        offset = data.draw(st.sampled_from(sorted(self.live)))
        self.pool.free(offset)
        size = self.live.pop(offset)
        self.owner[offset : offset + size] = [None] * size
        SEEN["freed"] += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_a_bad_offset_first(self, data):
        """A double free or an interior offset is refused, changing nothing; then a good free."""
        offset = data.draw(st.integers(-1, self.n))
        if offset not in self.live:
            before = snapshot(self.pool)
            with pytest.raises(PagedLearnError):
                self.pool.free(offset)
            assert snapshot(self.pool) == before
            SEEN["bad free"] += 1
        self.free(data)

    @invariant()
    def agrees_with_the_shadow_model(self):
        STEPS["steps"] += 1
        self.pool.check_invariants()
        assert self.pool.allocations() == dict(sorted(self.live.items()))
        free_slots = {s for s in range(self.n) if self.owner[s] is None}
        runs = self.pool.free_runs()
        assert {s for o, size in runs for s in range(o, o + size)} == free_slots
        assert self.pool.num_free_slots == len(free_slots)
        assert self.pool.num_allocated_slots == self.n - len(free_slots)
        # The largest free block is the largest aligned free run the shadow can find.
        largest = max((1 << k for k in range(self.n.bit_length()) if self._fits(1 << k)), default=0)
        assert self.pool.largest_free_run == largest
        # Fragmented: the free slots add up to a block larger than any free block.
        free = self.pool.num_free_slots
        SEEN["fragmented state"] += free > 0 and largest < 1 << (free.bit_length() - 1)

    def teardown(self):
        for offset in list(self.live):
            self.pool.free(offset)
        self.pool.check_invariants()
        assert self.pool.free_runs() == self.arenas


def test_random_operations_agree_with_a_shadow_model():
    STEPS.clear()
    SEEN.clear()
    run_state_machine_as_test(
        BuddyMachine, settings=settings(max_examples=150, stateful_step_count=40, deadline=None)
    )
    assert STEPS["steps"] >= 2000, f"only {STEPS['steps']} steps ran"
    # The run must have reached the cases worth testing, not only the easy paths.
    wanted = ["allocated", "freed", "bad free", "none", "never fits", "fragmented state"]
    for what in [*wanted, "external fragmentation"]:
        assert SEEN[what] > 0, f"no {what} in {STEPS['steps']} steps"
    print(f"{STEPS['steps']} steps;", dict(SEEN))
