"""The block manager's fast paths against the plain versions they stand in for.

Each fast class or function keeps the plain one's behaviour exactly; these tests drive both with
the same (random) inputs and compare everything a caller can see:

- :class:`~pagedlearn.core.block_pool.BlockPool` vs :class:`~pagedlearn.BlockAllocator` (results,
  errors word for word, refcounts, the free queue in order, cached blocks, counters, on_evict);
- :class:`~pagedlearn.core.prefix_cache_fast.FastPrefixCache` vs :class:`~pagedlearn.PrefixCache`
  (the same 32-byte hashes, the same hits);
- ``check_tokens`` vs ``check_tokens_plain`` (the same token values, the same error messages).
"""

from __future__ import annotations

import enum

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from pagedlearn import BlockAllocator, PagedLearnError
from pagedlearn.core.block_pool import BlockPool
from pagedlearn.core.prefix_cache import (
    ROOT_HASH,
    PrefixCache,
    hash_block,
    hash_blocks,
    make_extra_keys,
)
from pagedlearn.core.prefix_cache_fast import FastPrefixCache
from pagedlearn.core.sequence_tables import check_tokens, check_tokens_plain


# --- the block pool ------------------------------------------------------------------------------
def _state(pool) -> tuple:
    return (
        [pool.refcount(b) for b in range(pool.num_blocks)],
        pool.free_queue(),
        sorted(b for b in range(pool.num_blocks) if pool.is_cached(b)),
        pool.num_free_blocks,
        pool.num_cached_free_blocks,
        pool.num_shared_blocks,
        pool.num_evictions,
    )


def _call(pool, op: str, arg):
    try:
        return ("ok", getattr(pool, op)(arg))
    except PagedLearnError as e:  # OutOfBlocksError included
        return (type(e).__name__, str(e))


# Ids: mostly blocks in use (so that calls succeed and go deep), sometimes any id a little past
# the pool, a bool or a float (so that every error path is compared too).
class Id(enum.IntEnum):  # an int subclass: both pools must treat it as its value
    TWO = 2


BAD_ID = st.one_of(st.integers(-1, 9), st.sampled_from([True, 2.0, Id.TWO, np.int64(1)]))


def _draw_call(data, plain):
    used = [b for b in range(plain.num_blocks) if plain.refcount(b)]
    cached = [b for b in range(plain.num_blocks) if plain.is_cached(b)]
    good = st.sampled_from(used + cached) if used + cached else BAD_ID
    an_id = st.one_of(good, good, good, BAD_ID)
    op = data.draw(st.sampled_from(["allocate", "free", "incref", "mark_cached", "refcount"]))
    if op == "allocate":
        n = st.sampled_from([True, Id.TWO, np.int64(2), 2.0])
        return op, data.draw(st.one_of(st.integers(0, 3), st.integers(-1, 9), n))
    if op in ("free", "incref"):
        return op, data.draw(st.lists(an_id, max_size=4))
    return op, data.draw(an_id)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_block_pool_behaves_exactly_like_the_plain_allocator(data):
    evicted: dict[str, list[int]] = {"plain": [], "fast": []}
    plain = BlockAllocator(8, on_evict=evicted["plain"].append)
    fast = BlockPool(8, on_evict=evicted["fast"].append)
    for _ in range(data.draw(st.integers(0, 60))):
        op, arg = _draw_call(data, plain)
        assert _call(fast, op, arg) == _call(plain, op, arg), (op, arg)
        assert _state(fast) == _state(plain), (op, arg)
    assert evicted["fast"] == evicted["plain"]


def test_block_pool_hands_out_in_the_plain_order_through_evictions():
    plain, fast = BlockAllocator(6), BlockPool(6)
    for pool in (plain, fast):
        ids = pool.allocate(6)
        for b in ids[:4]:
            pool.mark_cached(b)
        pool.free(ids[::-1])  # cached ones to the LRU queue, empty ones to theirs
        assert pool.allocate(5) is not None
    assert _state(fast) == _state(plain)
    assert fast.num_evictions == 3


# --- the prefix cache ----------------------------------------------------------------------------
TOKENS = st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=40)
KEYS = st.sampled_from(
    [make_extra_keys(), make_extra_keys("m", "a", "s"), make_extra_keys(("gpt2", 1), 7, None)]
)


@settings(max_examples=200, deadline=None)
@given(TOKENS, st.integers(1, 6), KEYS)
def test_fast_prefix_cache_hashes_like_the_reference(tokens, block_size, extra):
    fast = FastPrefixCache()
    hashes, hits = fast.match(tokens, block_size, extra)
    assert hashes == hash_blocks(tokens, block_size, extra) and hits == []
    if hashes:
        tail = tokens[:block_size]
        assert fast.hash_block(b"\0" * 32, tail, extra) == hash_block(b"\0" * 32, tail, extra)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=30), st.integers(1, 4), st.data())
def test_fast_prefix_cache_finds_the_same_hits(prompt, block_size, data):
    plain, fast = PrefixCache(), FastPrefixCache()
    extra = make_extra_keys("m")
    # Index some blocks of some prompts (a few tokens each, so that prefixes collide often).
    for _ in range(data.draw(st.integers(0, 4))):
        other = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=30))
        for cache in (plain, fast):
            hashes = hash_blocks(other, block_size, extra)
            for j, h in enumerate(hashes):
                parent = hashes[j - 1] if j else ROOT_HASH
                block_tokens = other[j * block_size : (j + 1) * block_size]
                cache.insert(h, 100 * len(cache) + j, parent, block_tokens, extra)
    assert fast.match(prompt, block_size, extra) == plain.match(prompt, block_size, extra)
    other_keys = make_extra_keys("m", cache_salt="tenant-2")  # never hits another tenant's
    assert fast.match(prompt, block_size, other_keys) == plain.match(prompt, block_size, other_keys)
    assert [e.block_id for _, e in fast.items()] == [e.block_id for _, e in plain.items()]


@pytest.mark.parametrize("cache_class", [PrefixCache, FastPrefixCache])
@pytest.mark.parametrize("forged", ["parent", "tokens", "extra"])
def test_a_hash_collision_is_a_miss(cache_class, forged):
    """An entry stored under the very hash a prompt's block has, but holding other content (a
    forged SHA-256 collision): a hit must verify the parent, the tokens and the extra keys."""
    cache, extra, prompt = cache_class(), make_extra_keys("m"), [1, 2, 3, 4, 5]
    hashes = hash_blocks(prompt, 2, extra)
    stored = {"parent": (b"x" * 32, (1, 2), extra), "tokens": (ROOT_HASH, (1, 9), extra)}
    stored["extra"] = (ROOT_HASH, (1, 2), make_extra_keys("other model"))
    cache.insert(hashes[0], 7, *stored[forged])
    assert cache.match(prompt, 2, extra) == (hashes, [])
    honest = cache_class()
    honest.insert(hashes[0], 7, ROOT_HASH, (1, 2), extra)
    assert honest.match(prompt, 2, extra) == (hashes, [7])


def test_fast_prefix_cache_tells_equal_but_different_keys_apart():
    """``1 == True``, but their reprs (what is hashed) differ: the remembered bytes are per
    tuple object, never per equal tuple."""
    fast = FastPrefixCache()
    one, true = make_extra_keys(1), make_extra_keys(True)
    assert one == true
    assert fast.match([5, 6, 7], 2, one)[0] == hash_blocks([5, 6, 7], 2, one)
    assert fast.match([5, 6, 7], 2, true)[0] == hash_blocks([5, 6, 7], 2, true)
    assert hash_blocks([5, 6, 7], 2, one) != hash_blocks([5, 6, 7], 2, true)


# --- token checks --------------------------------------------------------------------------------
def _checked(fn, tokens):
    try:
        return ("ok", fn(tokens))
    except PagedLearnError as e:
        return ("error", str(e))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.integers(-3, 2**64 + 3),
            st.sampled_from([1.5, None, "7", True, False, 2**63]),
        ),
        max_size=12,
    )
)
def test_check_tokens_agrees_with_the_plain_check(tokens):
    fast = _checked(check_tokens, tokens)
    assert fast == _checked(check_tokens_plain, tokens)
    # Plain ints come back, unless the list's first and last ids were plain ints already (then
    # it is copied as it is: the documented rule).
    if fast[0] == "ok" and not (type(tokens[0]) is type(tokens[-1]) is int):
        assert all(type(t) is int for t in fast[1]), fast


def test_check_tokens_converts_lists_of_numpy_ints_and_bools():
    np = pytest.importorskip("numpy")
    for given_ in ([np.int64(1), np.int64(2), 4], [True, False, 3], [np.int32(5)]):
        tokens = check_tokens(given_)
        assert tokens == check_tokens_plain(given_)
        assert all(type(t) is int for t in tokens), tokens


@pytest.mark.parametrize(
    "tokens", [range(5), (3, 4), iter([1, -1]), iter([]), "abc", b"ab", 7, [[1]]]
)
def test_check_tokens_agrees_on_other_iterables(tokens):
    import itertools

    a, b = itertools.tee(tokens) if hasattr(tokens, "__next__") else (tokens, tokens)
    assert _checked(check_tokens, a) == _checked(check_tokens_plain, b)


def test_check_tokens_turns_tensors_and_arrays_into_plain_ints():
    torch = pytest.importorskip("torch")
    for given_ in (torch.tensor([5, 6, 7]), torch.tensor([5, 6, 7]).numpy()):
        tokens = check_tokens(given_)
        assert tokens == [5, 6, 7] and all(type(t) is int for t in tokens)


# --- a table's slots -----------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.integers(0, 23), st.integers(0, 3), st.integers(-2, 25), st.randoms())
def test_live_slots_are_slot_of_each_position(block_size, num_tokens, nulls, start, rnd):
    """``live_slots`` (a block at a time) against ``slot(i)`` per position, -1 where a sliding
    window freed the block (null entries only ever form the head of a table)."""
    from pagedlearn.core.block_table import NULL_BLOCK, BlockTable

    n_blocks = -(-num_tokens // block_size)
    ids = rnd.sample(range(100), n_blocks)
    ids[: min(nulls, n_blocks)] = [NULL_BLOCK] * min(nulls, n_blocks)
    table = BlockTable(block_size, ids, list(range(num_tokens)))
    if start < 0:  # not a position: refused, as slot() refuses it
        with pytest.raises(IndexError, match=f"token position {start} out of range"):
            table.live_slots(start)
        return
    want = [
        NULL_BLOCK if ids[i // block_size] == NULL_BLOCK else table.slot(i)
        for i in range(start, num_tokens)
    ]
    assert table.live_slots(start) == want


# --- plugged-in parts keep their say ------------------------------------------------------------
class _ShiftedTable(__import__("pagedlearn.core.block_table", fromlist=["BlockTable"]).BlockTable):
    """A table whose slots are 1000 further: a lab answer with its own ``slot`` rule."""

    def slot(self, i: int) -> int:
        return super().slot(i) + 1000


def test_a_plugged_in_block_table_computes_the_slots():
    from pagedlearn import KVCacheManager

    class Manager(KVCacheManager):
        block_table_class = _ShiftedTable

    kv = Manager(num_blocks=8, block_size=4)
    kv.add_sequence("a", [1, 2, 3])
    assert kv.slot_mapping("a") == [1000, 1001, 1002]
    assert kv.append_token("a", 4) == 1003 and kv.append_token("a", 5) == 1000 + 4 * 1
    assert kv.slots("a", 2) == [[1002, 1003, 1004]]


def test_an_allocator_that_does_not_count_evictions_still_forgets_evicted_hashes():
    """The manager asks its prefix cache about every block it is handed, whatever the pool's
    counters say: a stale entry would hand a later prompt another prompt's K/V."""
    from pagedlearn import KVCacheManager

    class NoCount(BlockAllocator):
        def allocate(self, n: int = 1) -> list[int]:
            before = self.num_evictions
            ids = super().allocate(n)
            self.num_evictions = before  # a pool that forgets to count
            return ids

    class Manager(KVCacheManager):
        allocator_class = NoCount

    kv = Manager(num_blocks=2, block_size=2, enable_prefix_caching=True)
    kv.add_sequence("a", [1, 2, 3])  # block 0 holds [1, 2], cached
    kv.free_sequence("a")
    kv.add_sequence("b", [7, 8, 9, 9])  # takes both blocks: block 0 is evicted, rewritten
    kv.free_sequence("b")
    assert kv.add_sequence("c", [1, 2, 3]) == 0  # [1, 2] is gone: no hit
    kv.check_invariants()
