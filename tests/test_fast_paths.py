"""The rules the core's fast paths must keep (each class has one implementation; its common case
is fast, and the unusual cases take the precise checks):

- :class:`~pagedlearn.BlockAllocator`: what counts as a block id (an int subclass is its value; a
  bool, a float or a numpy int is refused, naming it), the order blocks are handed out in through
  evictions, and a double free named for the same block however the ids are listed;
- :class:`~pagedlearn.core.prefix_cache.PrefixCache`: a forged hash collision is a miss, and the
  extra keys' remembered ``repr`` (``ExtraKeys``) hashes like the plain tuple, ``1 == True``
  included;
- ``check_tokens``: its conversions and the messages that name a bad position.
"""

from __future__ import annotations

import enum
import operator
import re

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from pagedlearn import BlockAllocator, PagedLearnError
from pagedlearn.core.prefix_cache import (
    ROOT_HASH,
    PrefixCache,
    hash_block,
    hash_blocks,
    make_extra_keys,
)
from pagedlearn.core.sequence_tables import check_token, check_tokens


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


class Id(enum.IntEnum):  # an int subclass: the pool treats it as its value
    TWO = 2


@pytest.mark.parametrize("op", ["refcount", "is_cached", "mark_cached", "incref", "free"])
@pytest.mark.parametrize("bad", [True, 2.0, np.int64(1), -1, 4, "1"])
def test_a_bad_block_id_is_named_and_changes_nothing(op, bad):
    pool = BlockAllocator(4)
    pool.allocate(3)
    pool.mark_cached(1)
    before = _state(pool)
    arg = [0, bad] if op in ("incref", "free") else bad
    with pytest.raises(PagedLearnError, match=re.escape(f"block id {bad!r} is not a valid id")):
        getattr(pool, op)(arg)
    assert _state(pool) == before


def test_an_int_subclass_is_a_block_id_and_a_count():
    pool = BlockAllocator(4)
    assert pool.allocate(Id.TWO) == [0, 1]
    assert pool.allocate(1) == [Id.TWO]
    pool.mark_cached(Id.TWO)
    pool.free(b for b in [Id.TWO, 0])  # any iterable, a generator too
    assert pool.refcount(2) == 0 and pool.is_cached(Id.TWO) and pool.free_queue() == [3, 0, 2]
    for n in (True, 2.0, np.int64(2), -1):
        with pytest.raises(PagedLearnError, match="allocate\\(n\\) needs an int n >= 0"):
            pool.allocate(n)


def test_a_double_free_names_the_first_block_counted_over_its_refcount():
    """Ids listed in any order: the error names the first block (in the order the ids are
    first listed) freed more times than it is referenced, and nothing changes."""
    pool = BlockAllocator(4)
    pool.allocate(2)
    pool.incref([1])  # block 1: refcount 2; block 0: 1; blocks 2, 3: free
    before = _state(pool)
    for ids, bad in (
        ([1, 1, 0, 0], "block 0 freed 2x but has refcount 1"),
        ([0, 2], "block 2 freed 1x but has refcount 0"),
        ([1, 1, 1], "block 1 freed 3x but has refcount 2"),
    ):
        with pytest.raises(PagedLearnError, match=f"double free: {bad}"):
            pool.free(ids)
        assert _state(pool) == before
    pool.free([1, 1, 0])  # a block listed as often as it is referenced is fine
    assert pool.num_free_blocks == 4 and pool.free_queue() == [2, 3, 1, 0]


def test_blocks_are_handed_out_empty_first_then_least_recently_used_cached():
    pool, evicted = BlockAllocator(6), []
    pool.on_evict = evicted.append
    ids = pool.allocate(6)
    for b in ids[:4]:
        pool.mark_cached(b)
    pool.free(ids[::-1])  # cached ones to the LRU queue, empty ones to theirs
    assert pool.free_queue() == [5, 4, 3, 2, 1, 0]
    assert pool.allocate(5) == [5, 4, 3, 2, 1]
    assert evicted == [3, 2, 1] and pool.num_evictions == 3
    assert _state(pool)[2] == [0]


def test_incref_names_a_free_empty_block_only_after_every_id_is_valid():
    pool = BlockAllocator(4)
    pool.allocate(1)
    with pytest.raises(PagedLearnError, match="block id 9 is not a valid id"):
        pool.incref([2, 9])  # 2 is free and empty, but the bad id is named first
    with pytest.raises(PagedLearnError, match="incref of block 2: it is free and holds no"):
        pool.incref([0, 2])
    assert pool.refcount(0) == 1


# --- the prefix cache ----------------------------------------------------------------------------
@pytest.mark.parametrize("forged", ["parent", "tokens", "extra"])
def test_a_hash_collision_is_a_miss(forged):
    """An entry stored under the very hash a prompt's block has, but holding other content (a
    forged SHA-256 collision): a hit must verify the parent, the tokens and the extra keys."""
    cache, extra, prompt = PrefixCache(), make_extra_keys("m"), [1, 2, 3, 4, 5]
    hashes = hash_blocks(prompt, 2, extra)
    stored = {"parent": (b"x" * 32, (1, 2), extra), "tokens": (ROOT_HASH, (1, 9), extra)}
    stored["extra"] = (ROOT_HASH, (1, 2), make_extra_keys("other model"))
    cache.insert(hashes[0], 7, *stored[forged])
    assert cache.match(prompt, 2, extra) == (hashes, [])
    honest = PrefixCache()
    honest.insert(hashes[0], 7, ROOT_HASH, (1, 2), extra)
    assert honest.match(prompt, 2, extra) == (hashes, [7])


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=20),
    st.sampled_from([(None, None, None), ("m", "a", "s"), (("gpt2", 1), 7, None), (1, True, 0)]),
)
def test_extra_keys_hash_like_the_plain_tuple(tokens, keys):
    """``make_extra_keys`` remembers its ``repr`` (what ``hash_block`` serialises): the hashes
    are those of the plain tuple."""
    extra = make_extra_keys(*keys)
    plain = tuple(extra)
    assert type(plain) is tuple and extra == plain and repr(extra) == repr(plain)
    assert hash_block(ROOT_HASH, tokens, extra) == hash_block(ROOT_HASH, tokens, plain)
    assert hash_blocks(tokens, 3, extra) == hash_blocks(tokens, 3, plain)


def test_equal_but_different_extra_keys_hash_apart():
    """``1 == True``, but their reprs (what is hashed) differ: each ExtraKeys remembers its own."""
    one, true = make_extra_keys(1), make_extra_keys(True)
    assert one == true and repr(one) != repr(true)
    assert hash_blocks([5, 6, 7], 2, one) != hash_blocks([5, 6, 7], 2, true)
    assert hash_blocks([5, 6, 7], 2, true) == hash_blocks([5, 6, 7], 2, tuple(true))


# --- token checks --------------------------------------------------------------------------------
def _checked(fn, tokens):
    try:
        return ("ok", fn(tokens))
    except PagedLearnError as e:
        return ("error", str(e))


def _rule(tokens) -> tuple:
    """What check_tokens must say, one token at a time: the first that is not an int >= 0."""
    for i, t in enumerate(tokens):
        try:
            v = operator.index(t)
        except TypeError:
            return ("error", f"token ids must be ints: position {i} is {t!r}")
        if v < 0:
            return ("error", f"token ids must be >= 0: position {i} is {t!r}")
    if not tokens:
        return ("error", "a sequence needs at least one token")
    return ("ok", [operator.index(t) for t in tokens])


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
def test_check_tokens_names_the_first_bad_position(tokens):
    got = _checked(check_tokens, tokens)
    assert got == _rule(tokens)
    # Plain ints come back, unless the list's first and last ids were plain ints already (then
    # it is copied as it is: the documented rule).
    if got[0] == "ok" and not (type(tokens[0]) is type(tokens[-1]) is int):
        assert all(type(t) is int for t in got[1]), got
    if len(tokens) == 1:
        assert _checked(check_token, tokens[0]) == (got[0], got[1][0] if got[0] == "ok" else got[1])


def test_check_tokens_converts_lists_of_numpy_ints_and_bools():
    for given_, want in (
        ([np.int64(1), np.int64(2), 4], [1, 2, 4]),
        ([True, False, 3], [1, 0, 3]),
        ([np.int32(5)], [5]),
    ):
        tokens = check_tokens(given_)
        assert tokens == want and all(type(t) is int for t in tokens), tokens


@pytest.mark.parametrize(
    "tokens, want",
    [
        (range(5), ("ok", [0, 1, 2, 3, 4])),
        ((3, 4), ("ok", [3, 4])),
        (iter([1, -1]), ("error", "token ids must be >= 0: position 1 is -1")),
        (iter([]), ("error", "a sequence needs at least one token")),
        ("abc", ("error", "token ids must be ints, got a string: tokenize it first")),
        (b"ab", ("error", "token ids must be ints, got a string: tokenize it first")),
        (7, ("error", "token ids must be ints, got 7")),
        ([[1]], ("error", "token ids must be ints: position 0 is [1]")),
    ],
)
def test_check_tokens_on_other_iterables(tokens, want):
    assert _checked(check_tokens, tokens) == want


def test_check_tokens_turns_tensors_and_arrays_into_plain_ints():
    torch = pytest.importorskip("torch")
    for given_ in (torch.tensor([5, 6, 7]), torch.tensor([5, 6, 7]).numpy()):
        tokens = check_tokens(given_)
        assert tokens == [5, 6, 7] and all(type(t) is int for t in tokens)


# --- a table's slots -----------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.integers(0, 23), st.integers(0, 3), st.integers(-2, 25), st.randoms())
def test_slot_mapping_is_slot_of_each_position(block_size, num_tokens, nulls, start, rnd):
    """``slot_mapping`` (a block at a time) against ``slot(i)`` per position, -1 where a sliding
    window freed the block (null entries only ever form the head of a table)."""
    from pagedlearn.core.block_table import NULL_BLOCK, BlockTable

    n_blocks = -(-num_tokens // block_size)
    ids = rnd.sample(range(100), n_blocks)
    ids[: min(nulls, n_blocks)] = [NULL_BLOCK] * min(nulls, n_blocks)
    table = BlockTable(block_size, ids, list(range(num_tokens)))
    if start < 0:  # not a position: refused, as slot() refuses it
        with pytest.raises(IndexError, match=f"token position {start} out of range"):
            table.slot_mapping(start)
        return
    want = [
        NULL_BLOCK if ids[i // block_size] == NULL_BLOCK else table.slot(i)
        for i in range(start, num_tokens)
    ]
    assert table.slot_mapping(start) == want


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
    assert kv.slot_mappings("a", 2) == [[1002, 1003, 1004]]


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
