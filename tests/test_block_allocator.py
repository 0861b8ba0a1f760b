import pytest

from pagedlearn import BlockAllocator, OutOfBlocksError, PagedLearnError


def test_allocate_hands_out_distinct_blocks_with_refcount_one():
    pool = BlockAllocator(8)
    ids = pool.allocate(3) + pool.allocate(2)
    assert len(set(ids)) == 5
    assert all(pool.refcount(b) == 1 for b in ids)
    assert pool.num_free_blocks == 3 and pool.num_blocks == 8


def test_allocate_is_all_or_nothing_with_a_message_that_counts():
    pool = BlockAllocator(4)
    pool.allocate(3)
    before = (pool.free_queue(), [pool.refcount(b) for b in range(4)])
    with pytest.raises(OutOfBlocksError, match=r"need 3 blocks, 1 free of 4") as info:
        pool.allocate(3)
    assert (info.value.needed, info.value.free, info.value.total) == (3, 1, 4)
    assert (pool.free_queue(), [pool.refcount(b) for b in range(4)]) == before


def test_allocate_zero_and_negative():
    pool = BlockAllocator(2)
    assert pool.allocate(0) == []
    with pytest.raises(PagedLearnError, match="n >= 0"):
        pool.allocate(-1)
    for bad in (1.0, True):
        with pytest.raises(PagedLearnError):
            pool.allocate(bad)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", True])
def test_pool_size_must_be_positive_int(bad):
    with pytest.raises(PagedLearnError, match="num_blocks"):
        BlockAllocator(bad)


def test_incref_shares_and_free_decrements():
    pool = BlockAllocator(4)
    (b,) = pool.allocate(1)
    pool.incref([b, b])
    assert pool.refcount(b) == 3
    pool.free([b])
    assert pool.refcount(b) == 2 and b not in pool.free_queue()
    pool.free([b, b])
    assert pool.refcount(b) == 0 and b in pool.free_queue()


def test_double_free_raises_and_changes_nothing():
    pool = BlockAllocator(4)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(PagedLearnError, match=f"double free: block {a}"):
        pool.free([a])
    # a batch that frees b once too often is rejected whole: b keeps its reference
    with pytest.raises(PagedLearnError, match="double free"):
        pool.free([b, b])
    assert pool.refcount(b) == 1 and pool.num_free_blocks == 3


@pytest.mark.parametrize("bad", [-1, 4, 99, 1.0, None, True])
def test_ids_out_of_range_raise_and_change_nothing(bad):
    pool = BlockAllocator(4)
    ids = pool.allocate(2)
    for op in (pool.free, pool.incref):
        with pytest.raises(PagedLearnError, match="not a valid id"):
            op([ids[0], bad])
    assert [pool.refcount(b) for b in ids] == [1, 1]
    with pytest.raises(PagedLearnError):
        pool.refcount(bad)


def test_incref_of_free_empty_block_is_refused():
    pool = BlockAllocator(2)
    with pytest.raises(PagedLearnError, match="holds no cached KV"):
        pool.incref([0])
    assert pool.refcount(0) == 0 and pool.num_free_blocks == 2
    with pytest.raises(PagedLearnError, match="is free"):
        pool.mark_cached(0)


def test_freed_blocks_are_reused_fifo():
    pool = BlockAllocator(3)
    a, b, _ = pool.allocate(3)
    pool.free([b])
    pool.free([a])
    assert pool.allocate(2) == [b, a]


def test_empty_blocks_go_before_cached_ones_and_cached_ones_in_lru_order():
    evicted = []
    pool = BlockAllocator(5, on_evict=evicted.append)
    ids = pool.allocate(5)
    for b in (0, 1, 2):
        pool.mark_cached(b)
    pool.free([2, 0, 3, 1, 4])  # cached 2, 0, 1 in that LRU order; 3, 4 hold nothing
    assert pool.num_cached_free_blocks == 3
    assert pool.free_queue() == [3, 4, 2, 0, 1]
    assert pool.allocate(2) == [3, 4] and evicted == []
    assert pool.allocate(2) == [2, 0]
    assert evicted == [2, 0] and pool.num_evictions == 2
    assert not pool.is_cached(2) and pool.is_cached(1)
    assert sorted(ids) == list(range(5))


def test_incref_takes_a_cached_block_back_out_of_the_free_queue():
    evicted = []
    pool = BlockAllocator(3, on_evict=evicted.append)
    pool.allocate(3)
    pool.mark_cached(1)
    pool.free([0, 1, 2])
    pool.incref([1])  # a prefix-cache hit on a free block
    assert pool.refcount(1) == 1 and pool.free_queue() == [0, 2]
    assert pool.allocate(2) == [0, 2] and evicted == []
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
