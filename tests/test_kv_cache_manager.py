import pytest
from helpers import snapshot

import pagedlearn.core.prefix_cache
from pagedlearn import KVCacheManager, OutOfBlocksError, PagedLearnError

BS = 4


def make(num_blocks=16, caching=True, **kw):
    return KVCacheManager(num_blocks, BS, enable_prefix_caching=caching, **kw)


# --- allocation and slots ----------------------------------------------------------------------
def test_prompt_gets_ceil_blocks_and_slots_follow_the_table():
    kv = make(caching=False)
    assert kv.add_sequence("a", range(1, 10)) == 0  # 9 tokens -> 3 blocks
    table = kv.block_table("a")
    assert len(table) == 3 and kv.num_free_blocks == 13
    assert kv.slot_mapping("a") == [table[i // BS] * BS + i % BS for i in range(9)]
    assert kv.token_ids("a") == list(range(1, 10))


def test_append_allocates_only_on_a_block_boundary():
    kv = make(caching=False)
    kv.add_sequence("a", [1, 2, 3])
    free = kv.num_free_blocks
    slot = kv.append_token("a", 4)  # fills block 0
    assert kv.num_free_blocks == free and slot == kv.block_table("a")[0] * BS + 3
    slot = kv.append_token("a", 5)  # needs block 1
    assert kv.num_free_blocks == free - 1 and slot == kv.block_table("a")[1] * BS
    assert kv.slot_mapping("a")[-1] == slot


def test_token_ids_may_be_a_tensor():
    torch = pytest.importorskip("torch")
    kv = make()
    kv.add_sequence("a", torch.tensor([5, 6, 7]))
    kv.append_token("a", torch.tensor(8))
    assert kv.token_ids("a") == [5, 6, 7, 8]
    assert all(type(t) is int for t in kv.token_ids("a"))


def test_free_returns_every_block():
    kv = make(caching=False)
    kv.add_sequence("a", range(10))
    kv.fork("a", "b")
    kv.free_sequence("a")
    assert kv.num_free_blocks == 16 - 3  # b still holds them
    kv.free_sequence("b")
    assert kv.num_free_blocks == 16
    kv.check_invariants()


# --- copy-on-write ----------------------------------------------------------------------------
def test_fork_shares_and_the_first_writer_copies_exactly_once():
    kv = make(caching=False)
    kv.add_sequence("p", [1, 2, 3, 4, 5, 6])  # 2 blocks, the last one half full
    kv.fork("p", "c")
    b0, b1 = kv.block_table("p")
    assert kv.block_table("c") == [b0, b1]
    assert kv.allocator.refcount(b0) == kv.allocator.refcount(b1) == 2

    kv.append_token("c", 7)  # c writes into the shared partial block: copy it
    (copy,) = kv.pop_copies()
    assert copy[0] == b1 and kv.block_table("c") == [b0, copy[1]]
    assert kv.allocator.refcount(b1) == 1 and kv.allocator.refcount(copy[1]) == 1
    assert kv.pop_copies() == []  # cleared on read

    kv.append_token("p", 8)  # p now owns b1 alone: no copy
    assert kv.pop_copies() == [] and kv.block_table("p") == [b0, b1]
    assert kv.stats()["cow_copies"] == 1
    kv.check_invariants()


def test_fork_on_a_block_boundary_needs_no_copy():
    kv = make(caching=False)
    kv.add_sequence("p", [1, 2, 3, 4])
    kv.fork("p", "c")
    kv.append_token("c", 5)
    kv.append_token("p", 6)
    assert kv.pop_copies() == [] and kv.stats()["cow_copies"] == 0
    assert kv.block_table("p")[0] == kv.block_table("c")[0]
    assert kv.block_table("p")[1] != kv.block_table("c")[1]


# --- prefix caching ---------------------------------------------------------------------------
def test_same_prompt_back_to_back_hits_and_shares():
    kv = make()
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert kv.add_sequence("a", prompt) == 0
    assert kv.add_sequence("b", prompt) == 8
    a, b = kv.block_table("a"), kv.block_table("b")
    assert a[:2] == b[:2] and a[2] != b[2]
    assert all(kv.allocator.refcount(x) == 2 for x in a[:2])
    s = kv.stats()
    assert (s["prefix_query_tokens"], s["prefix_hit_tokens"], s["used_blocks"]) == (20, 8, 4)
    kv.check_invariants()


@pytest.mark.parametrize(("length", "reused"), [(4, 0), (5, 4), (8, 4), (9, 8), (12, 8)])
def test_a_fully_cached_prompt_still_computes_its_last_token(length, reused):
    kv = make()
    kv.add_sequence("warm", list(range(12)))
    kv.free_sequence("warm")  # every full block of it stays cached
    got = kv.add_sequence("a", list(range(length)))
    assert got == reused and got <= length - 1
    kv.check_invariants()


def test_only_full_blocks_are_cached():
    kv = make()
    kv.add_sequence("a", [1, 2, 3, 4, 5, 6])
    assert len(kv.prefix_cache) == 1
    kv.append_token("a", 7)
    assert len(kv.prefix_cache) == 1
    kv.append_token("a", 8)  # block 1 is full now
    assert len(kv.prefix_cache) == 2
    kv.add_sequence("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.block_table("b")[:2] == kv.block_table("a")


def test_cached_blocks_outlive_their_sequence_until_evicted():
    kv = make(num_blocks=4)
    kv.add_sequence("a", [1, 2, 3, 4, 5])  # blocks 0 (full, cached) and 1
    kv.free_sequence("a")
    assert kv.stats()["cached_blocks"] == 1
    assert kv.add_sequence("b", [1, 2, 3, 4, 9]) == 4  # hit while free
    kv.free_sequence("b")
    old = kv.prefix_cache.hash_of(0)
    kv.add_sequence("big", range(16))  # needs all 4 blocks: evicts block 0
    assert kv.stats()["evictions"] == 1
    assert kv.prefix_cache.hash_of(0) != old
    kv.free_sequence("big")
    # block 0 now holds "big"'s first block: the old prompt must miss
    assert kv.add_sequence("c", [1, 2, 3, 4, 9]) == 0
    kv.check_invariants()


def test_eviction_is_least_recently_used_and_tail_first():
    kv = make(num_blocks=6)
    kv.add_sequence("old", range(0, 8))  # 2 full blocks
    kv.add_sequence("new", range(100, 108))
    old, new = kv.block_table("old"), kv.block_table("new")
    kv.free_sequence("old")
    kv.free_sequence("new")
    # Cached-free queue: old's tail, old's head, new's tail, new's head.
    assert kv.allocator.free_queue()[-4:] == [old[1], old[0], new[1], new[0]]
    kv.add_sequence("x", range(200, 212))  # 3 blocks: 2 empty ones, then evict old's tail
    assert old[1] in kv.block_table("x") and kv.prefix_cache.hash_of(old[0]) is not None
    assert kv.add_sequence("y", [*range(100, 108), 1]) == 8  # the recent prefix survived


@pytest.mark.parametrize("key", ["cache_salt", "adapter_id"])
def test_salt_and_adapter_isolate_the_cache(key):
    kv = make()
    prompt = list(range(9))
    kv.add_sequence("a", prompt, **{key: "tenant-1"})
    assert kv.add_sequence("b", prompt, **{key: "tenant-2"}) == 0
    assert kv.add_sequence("c", prompt) == 0
    assert kv.add_sequence("d", prompt, **{key: "tenant-1"}) == 8
    kv.fork("d", "e")  # a fork keeps its parent's salt for the blocks it fills later
    for t in (9, 10, 11):
        kv.append_token("e", t)
    assert kv.add_sequence("f", [*prompt, 9, 10, 11, 12], **{key: "tenant-1"}) == 12
    kv.check_invariants()


def test_model_id_is_part_of_every_block_hash():
    hashes = []
    for model in ("gpt2", "facebook/opt-125m"):
        kv = make(model_id=model)
        log = kv.record()
        kv.add_sequence("a", range(8))
        hashes.append([e.info["hash"] for e in log.events if e.kind == "cache_store"])
    assert len(hashes[0]) == 2 and not set(hashes[0]) & set(hashes[1])


def test_a_hash_collision_never_shares_wrong_kv(monkeypatch):
    monkeypatch.setattr(pagedlearn.core.prefix_cache, "hash_block", lambda *args: b"\0" * 32)
    kv = make()
    kv.add_sequence("a", [1, 2, 3, 4, 5])
    assert kv.add_sequence("b", [9, 9, 9, 9, 5]) == 0  # same (fake) hash, other tokens
    assert kv.block_table("a")[0] != kv.block_table("b")[0]
    assert kv.add_sequence("c", [1, 2, 3, 4, 6]) == 4


def test_caching_off_never_shares():
    kv = make(caching=False)
    kv.add_sequence("a", range(9))
    assert kv.add_sequence("b", range(9)) == 0
    assert not set(kv.block_table("a")) & set(kv.block_table("b"))
    assert kv.stats()["prefix_query_tokens"] == 0


# --- errors leave the state as it was ---------------------------------------------------------
def test_add_sequence_out_of_blocks_is_atomic():
    kv = make(num_blocks=4)
    kv.add_sequence("a", range(9))  # 3 blocks
    before = snapshot(kv)
    with pytest.raises(OutOfBlocksError, match=r"add_sequence\('b'\) with 8 tokens: need 2 blocks"):
        kv.add_sequence("b", range(100, 108))
    assert snapshot(kv) == before and "b" not in kv
    assert kv.stats()["allocation_failures"] == 1


def test_cache_hits_that_are_free_count_against_free_space():
    kv = make(num_blocks=4)
    kv.add_sequence("a", range(9))  # blocks 0, 1 cached
    kv.free_sequence("a")
    kv.add_sequence("hog", range(100, 104))  # takes the one empty block... and one more
    kv.add_sequence("hog2", range(200, 202))
    before = snapshot(kv)
    # 2 hits (both free) + 1 new block needs 3 free blocks; 2 are free.
    with pytest.raises(OutOfBlocksError, match="need 3 blocks, 2 free of 4"):
        kv.add_sequence("b", range(10))
    assert snapshot(kv) == before


def test_append_and_copy_on_write_out_of_blocks_are_atomic():
    kv = make(num_blocks=3, caching=False)
    kv.add_sequence("a", range(6))  # 2 blocks, last one partial
    kv.fork("a", "b")
    kv.add_sequence("c", range(4))  # the last free block
    before = snapshot(kv)
    with pytest.raises(OutOfBlocksError, match="copy-on-write for 'b'"):
        kv.append_token("b", 1)
    assert snapshot(kv) == before
    with pytest.raises(OutOfBlocksError, match=r"append_token\('c'\) at position 4"):
        kv.append_token("c", 1)
    assert snapshot(kv) == before and kv.stats()["allocation_failures"] == 2


def test_bad_calls_raise_clear_errors_and_change_nothing():
    kv = make()
    kv.add_sequence("a", range(5))
    before = snapshot(kv)
    cases = [
        (lambda: kv.add_sequence("a", [1]), "already exists"),
        (lambda: kv.add_sequence("x", []), "at least one token"),
        (lambda: kv.add_sequence("x", [1, -2]), ">= 0: position 1 is -2"),
        (lambda: kv.add_sequence("x", [1, 2.5]), "must be ints: position 1 is 2.5"),
        (lambda: kv.add_sequence("x", "abc"), "got a string: tokenize it first"),
        (lambda: kv.add_sequence("x", None), "must be ints"),
        (lambda: kv.add_sequence(["unhashable"], [1]), "not hashable"),
        (lambda: kv.append_token("zz", 1), "unknown sequence id 'zz'"),
        (lambda: kv.append_token("a", -1), ">= 0"),
        (lambda: kv.fork("zz", "y"), "unknown sequence id"),
        (lambda: kv.fork("a", "a"), "already exists"),
        (lambda: kv.free_sequence("zz"), "unknown sequence id"),
        (lambda: kv.block_table("zz"), "unknown sequence id"),
    ]
    for call, message in cases:
        with pytest.raises(PagedLearnError, match=message):
            call()
        assert snapshot(kv) == before, message
    kv.free_sequence("a")
    with pytest.raises(PagedLearnError, match="unknown sequence id 'a'"):
        kv.free_sequence("a")  # double free of a sequence
    with pytest.raises(PagedLearnError, match="block_size"):
        KVCacheManager(4, 0)


# --- statistics and invariants ----------------------------------------------------------------
def test_stats_have_the_documented_keys_and_add_up():
    kv = make()
    kv.add_sequence("a", range(9))
    kv.fork("a", "b")
    s = kv.stats()
    for key in (
        "num_blocks",
        "used_blocks",
        "free_blocks",
        "cached_blocks",
        "prefix_query_tokens",
        "prefix_hit_tokens",
        "evictions",
        "cow_copies",
        "allocation_failures",
        "swapped_seqs",
        "cpu_blocks",
        "cpu_used_blocks",
        "swap_out_blocks",
        "swap_in_blocks",
    ):
        assert key in s
    assert s["used_blocks"] + s["free_blocks"] == s["num_blocks"] == 16
    assert (s["used_blocks"], s["shared_blocks"], s["num_seqs"]) == (3, 3, 2)
    assert s["cpu_blocks"] == s["swapped_seqs"] == 0  # no swap pool unless asked for


def test_check_invariants_names_what_broke():
    kv = make()
    kv.add_sequence("a", range(9))
    kv.check_invariants()
    b = kv.block_table("a")[0]
    kv.allocator._refcounts[b] += 1
    with pytest.raises(PagedLearnError, match=f"block {b} has refcount 2 but 1 table references"):
        kv.check_invariants()
    kv.allocator._refcounts[b] -= 1
    kv._seqs.gpu["a"].token_ids[0] = 99  # the cached block no longer holds what its hash says
    with pytest.raises(PagedLearnError, match=f"cached block {b} is used by 'a'"):
        kv.check_invariants()
    kv._seqs.gpu["a"].token_ids[0] = 0
    kv.allocator._free_empty.append(b)  # a used block also sits in the free queue
    with pytest.raises(PagedLearnError, match=r"used \(3\) \+ free \(14\) != num_blocks \(16\)"):
        kv.check_invariants()


def test_cached_prefix_tokens_answers_what_add_sequence_would_reuse_and_changes_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = list(range(10))
    assert kv.cached_prefix_tokens(prompt) == 0
    kv.add_sequence("a", prompt)
    before = snapshot(kv)
    assert kv.cached_prefix_tokens(prompt) == 8  # 2 full blocks; the last token is computed
    assert kv.cached_prefix_tokens(prompt[:8]) == 4  # capped: one token must be left to compute
    assert kv.cached_prefix_tokens(prompt, cache_salt="tenant-2") == 0  # salted: no sharing
    assert snapshot(kv) == before
    assert kv.add_sequence("b", prompt) == 8
    assert KVCacheManager(8, 4).cached_prefix_tokens(prompt) == 0  # caching off
