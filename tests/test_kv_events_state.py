"""The picture of a prefix cache rebuilt from KV-cache events (kv_events/cache_state.py,
cache_summary.py) and the block hashes of a new prompt (kv_events/block_hashes.py)."""

import hashlib

import pytest

pytest.importorskip("msgspec")

from pagedlearn.core.prefix_cache import hash_blocks, make_extra_keys
from pagedlearn.errors import KVEventsError
from pagedlearn.kv_events import block_hashes as bh
from pagedlearn.kv_events.cache_state import BlockKey, KVCacheState
from pagedlearn.kv_events.from_trace import wire_hash
from pagedlearn.kv_events.messages import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

B = 2  # tokens per block


def stored(hashes, parent, tokens, medium="GPU", group=None, lora=None, size=B):
    return BlockStored(hashes, parent, tokens, size, None, medium, lora, group_idx=group)


def feed(state, *events, seq=None, ts=None, rank=None):
    seq = (state.last_seq + 1 if state.last_seq is not None else 0) if seq is None else seq
    return state.apply((seq, KVEventBatch(float(seq if ts is None else ts), list(events), rank)))


def two_prompts() -> KVCacheState:
    """[1 2][3 4][5 6] and [1 2][3 4][7 8][9 10]: they share the first two blocks."""
    s = KVCacheState()
    feed(s, stored([11, 12, 13], None, [1, 2, 3, 4, 5, 6]))
    feed(s, stored([14, 15], 12, [7, 8, 9, 10]))
    return s


def key(h, medium="GPU", group=None, rank=None):
    return BlockKey(rank, medium, group, h)


def test_the_tree_hangs_each_block_under_its_parent_and_shows_the_shared_prefix():
    s = two_prompts()
    assert [b.key.block_hash for b in s.roots()] == [11]
    assert list(s.blocks[key(12)].children) == [key(13), key(14)]
    assert s.blocks[key(15)].token_ids == (9, 10) and {b.key: d for b, d in s.walk()}[key(15)] == 3
    assert s.leaves_below()[key(11)] == 2 and s.leaves_below()[key(14)] == 1
    summary = s.summary()
    assert (summary.blocks, summary.deepest, summary.per_place) == (5, 4, {"GPU": 5})
    assert summary.longest_shared.block.key == key(12) and summary.longest_shared.tokens == 4
    assert [(r.leaves, r.depth + 1) for r in summary.top] == [(2, 2)]
    text = str(summary)
    assert "cached now: 5 blocks (10 tokens)" in text and "[1 2 3 4]" in text
    assert "PYTHONHASHSEED" in text  # what the stream cannot tell is said


def test_a_removed_parent_leaves_its_children_as_roots_until_it_comes_back():
    s = two_prompts()
    feed(s, BlockRemoved([12], "GPU"))
    assert key(12) not in s.blocks and not s.blocks[key(11)].children
    assert {b.key.block_hash for b in s.roots()} == {11, 13, 14}
    assert s.blocks[key(13)].parent_unseen and s.summary().parent_unseen == 2
    feed(s, stored([12], 11, [3, 4]))  # stored again: its children are adopted back
    assert sorted(s.blocks[key(12)].children) == [key(13), key(14)]
    assert [b.key.block_hash for b in s.roots()] == [11]
    assert s.removals[-1].key == key(12) and s.timeline[-2].removed == 1


def test_all_blocks_cleared_empties_the_picture_and_is_remembered():
    s = two_prompts()
    feed(s, AllBlocksCleared(), ts=9)
    assert s.blocks == {} and s.by_hash == {} and not s.counts
    assert s.removals[-1].key is None and s.removals[-1].count == 5
    assert s.timeline[-1].cleared == 5 and s.timeline[-1].size == 0
    feed(s, stored([11], None, [1, 2]))
    assert len(s.blocks) == 1 and s.problems == {}


def test_a_late_subscriber_keeps_blocks_whose_parent_it_never_saw_and_counts_them():
    s = KVCacheState()
    feed(s, stored([20, 21], 99, [1, 2, 3, 4]))
    assert s.problems == {"parent_unseen": 1}  # one per event: 21's parent (20) is held
    assert [b.key.block_hash for b in s.roots()] == [20] and s.blocks[key(20)].parent_unseen
    assert "not held; kept as a root" in s.notes[-1]


def test_duplicates_unknown_removals_bad_tokens_and_bad_events_are_counted_not_raised():
    s = two_prompts()
    feed(s, stored([11], None, [1, 2]))  # stored twice
    feed(s, BlockRemoved([404], "GPU"))  # never stored
    feed(s, stored([30], None, [1, 2, 3]))  # 3 tokens for one block of 2
    feed(s, stored([31], None, [1, 2], size=0), object())  # bad block_size, not an event
    assert s.problems == {
        "duplicate_stored": 1, "unknown_removed": 1, "token_mismatch": 1, "bad_event": 2,
    }  # fmt: skip
    assert len(s.blocks) == 6 and s.blocks[key(30)].token_ids is None and key(31) not in s.blocks
    assert "not a KV-cache event: object" in " ".join(s.notes)
    with pytest.raises(KVEventsError, match="needs a KVEventBatch"):
        s.apply("not a batch")


def test_a_batch_not_after_the_last_one_is_skipped():
    s = two_prompts()  # seqs 0 and 1
    assert feed(s, BlockRemoved([11], "GPU"), seq=1) is False
    assert key(11) in s.blocks and s.problems == {"stale_batch": 1}


def test_memory_is_bounded_by_max_blocks_and_history():
    s = KVCacheState(max_blocks=3, history=4)
    feed(s, stored([1, 2, 3, 4, 5], None, list(range(10))))
    assert len(s.blocks) == 3 and s.problems["dropped_at_cap"] == 2 and s.capped
    assert "cap of 3 blocks reached" in str(s.summary())
    for i in range(10):
        feed(s, BlockRemoved([100 + i], "GPU"))
    assert len(s.timeline) == 4 and len(s.notes) <= 20
    with pytest.raises(KVEventsError, match="max_blocks"):
        KVCacheState(max_blocks=0)


def test_groups_media_and_ranks_are_separate_caches():
    s = KVCacheState()
    feed(s, stored([7], None, [1, 2], group=0), stored([7], None, [1, 2], group=1))
    feed(s, stored([7], None, [1, 2], medium="CPU", group=0))
    feed(s, stored([7], None, [1, 2], group=0), rank=1)
    assert len(s.blocks) == 4 and s.problems == {}
    assert s.summary().per_place == {"CPU/group 0": 1, "GPU/group 0": 2, "GPU/group 1": 1}
    feed(s, BlockRemoved([7], "GPU", group_idx=1))
    assert key(7, group=1) not in s.blocks and len(s.blocks) == 3
    feed(s, BlockRemoved([7], None))  # a sender that names no medium nor group: all of rank None
    assert list(s.blocks) == [key(7, group=0, rank=1)]


def test_a_crafted_loop_of_parents_cannot_hang_the_walk():
    s = KVCacheState()
    feed(s, stored([1], 2, [1, 2]), stored([2], 1, [3, 4]), stored([3], 3, [5, 6]))
    assert len(list(s.walk())) <= 3 and s.problems["bad_event"] >= 1
    s.summary()  # terminates


def test_hit_opportunities_by_tokens_and_by_pagedlearns_hash_agree():
    hasher = bh.PagedLearnHasher(B, "tiny")
    prompt = [5, 6, 7, 8, 9, 10, 11]
    h = hasher(prompt)  # what pagedlearn's publisher sends for these blocks
    s = KVCacheState()
    feed(s, stored(h[:2], None, prompt[:4]))
    report = s.hit_opportunities([*prompt, 1], hasher)
    assert (report.by_tokens, report.by_hash, report.full_blocks) == (2, 2, 4)
    assert report.reusable == 2 and "2 blocks (4 tokens) reusable" in "\n".join(report.lines())
    assert s.hit_opportunities(prompt[:4]).reusable == 1  # the last token is always computed
    wrong = s.hit_opportunities(prompt, bh.PagedLearnHasher(B, "other-model"))
    assert wrong.by_hash == 0 and "not the server's" in "\n".join(wrong.lines())
    feed(s, stored([77], None, [20, 21], lora="adapter"))
    assert s.hit_opportunities([20, 21, 22]).keyed_skipped == 1
    assert s.hit_opportunities([5, 6, 7], medium="CPU").by_tokens == 0
    with pytest.raises(KVEventsError, match="ints"):
        s.hit_opportunities("text")


# --- block hashes ------------------------------------------------------------------------------
def test_sha256_cbor_matches_a_value_computed_by_hand_from_the_definition():
    # NONE_HASH with PYTHONHASHSEED=0 is H("0"): canonical CBOR of "0" is 0x61 0x30.
    root = hashlib.sha256(bytes([0x61, 0x30])).digest()
    # Block [1, 2] chains on it, no extra keys: the CBOR of (root, (1, 2), None) is an array of 3
    # (0x83): 32 bytes (0x58 0x20 + root), an array of 2 small ints (0x82 01 02), null (0xf6).
    cbor = bytes([0x83, 0x58, 0x20]) + root + bytes([0x82, 0x01, 0x02, 0xF6])
    digest = hashlib.sha256(cbor).digest()
    hasher = bh.VLLMHasher(2, "sha256_cbor", python_hash_seed="0")
    assert hasher.root == root and hasher.digests([1, 2, 3]) == [digest]
    assert hasher([1, 2]) == [int.from_bytes(digest[-8:], "big")]  # the wire: the last 8 bytes
    assert bh.VLLMHasher(2, "sha256_cbor", python_hash_seed="0", int_hashes=False)([1, 2]) == [
        digest
    ]


def test_sha256_with_pickle_matches_the_opcodes_written_by_hand():
    root = b"\x00" * 32
    body = b"C\x20" + root + b"\x94" + b"K\x01K\x02\x86\x94N\x87\x94."  # bytes, (1, 2), None
    pickled = b"\x80\x05\x95" + len(body).to_bytes(8, "little") + body  # protocol 5, one frame
    hasher = bh.VLLMHasher(2, "sha256", root=root)
    assert hasher.digests([1, 2]) == [hashlib.sha256(pickled).digest()]


def test_sha256_msgpack_matches_the_bytes_written_by_hand():
    root = bytes(range(32))
    packed = bytes([0x93, 0xC4, 0x20]) + root + bytes([0x92, 0x01, 0x02, 0xC0])  # bin 8, nil
    assert bh.VLLMHasher(2, "sha256_msgpack", root=root).digests([1, 2]) == [
        hashlib.sha256(packed).digest()
    ]


def test_canonical_cbor_uses_the_shortest_heads():
    cases = {
        0: "00", 23: "17", 24: "1818", 255: "18ff", 256: "190100", 65536: "1a00010000",
        2**32: "1b0000000100000000", -1: "20", -25: "3818", 2**64: "c249010000000000000000",
        "a": "6161", b"": "40", (): "80", None: "f6", True: "f5",
    }  # fmt: skip
    for value, hex_ in cases.items():
        assert bh.canonical_cbor(value).hex() == hex_, value
    with pytest.raises(bh.BlockHashError, match="float"):
        bh.canonical_cbor(1.5)


def test_extra_keys_follow_vllms_order_and_the_salt_is_in_the_first_block_only():
    hasher = bh.VLLMHasher(2, "sha256", python_hash_seed="1", lora_name="l", cache_salt="s")
    assert hasher.extra_keys(0) == ("l", "s") and hasher.extra_keys(1) == ("l",)
    assert bh.VLLMHasher(2, python_hash_seed="1").extra_keys(0) is None
    plain, salted = (
        bh.VLLMHasher(2, python_hash_seed="1"),
        bh.VLLMHasher(2, python_hash_seed="1", cache_salt="s"),
    )
    assert plain([1, 2, 3, 4]) != salted([1, 2, 3, 4])


def test_what_cannot_be_known_is_refused_with_the_reason():
    with pytest.raises(bh.BlockHashError, match="random bytes unless the server ran"):
        bh.VLLMHasher(16)
    with pytest.raises(bh.BlockHashError, match="unknown hash algorithm 'md5'"):
        bh.VLLMHasher(16, "md5", python_hash_seed="0")
    with pytest.raises(bh.BlockHashError, match="block_size"):
        bh.VLLMHasher(0, python_hash_seed="0")
    try:
        import xxhash  # noqa: F401
    except ImportError:
        with pytest.raises(bh.BlockHashError, match="pip install xxhash"):
            bh.VLLMHasher(16, "xxhash", python_hash_seed="0")


def test_pagedlearns_hasher_is_what_its_publisher_puts_on_the_wire():
    tokens = list(range(9))
    digests = hash_blocks(tokens, 4, make_extra_keys("gpt2"))
    assert bh.make_hasher("pagedlearn", 4, model_id="gpt2")(tokens) == [
        wire_hash(d.hex()) for d in digests
    ]
    raw = bh.PagedLearnHasher(4, "gpt2", hash_format="bytes")(tokens)
    assert raw == [wire_hash(d.hex(), "bytes") for d in digests]


def test_the_picture_equals_the_managers_prefix_cache_block_by_block():
    """pagedlearn's own manager, its trace turned into events (from_trace.py), applied here: the
    picture holds exactly the manager's cached blocks, with their tokens and parents."""
    from pagedlearn.core.kv_cache_manager import KVCacheManager
    from pagedlearn.kv_events.from_trace import TraceToEvents, cached_blocks

    kv = KVCacheManager(num_blocks=12, block_size=B, enable_prefix_caching=True, model_id="m")
    s = KVCacheState()
    seqs = iter(range(10_000))
    kv.trace.subscribe(TraceToEvents(B, lambda batch: s.apply(batch, next(seqs))))
    prompts = {"a": [1, 2, 3, 4, 5, 6, 7], "b": [1, 2, 3, 4, 9, 9, 8], "c": [5] * 9}
    for name, prompt in prompts.items():
        kv.add_sequence(name, prompt)
        kv.append_token(name, 0)
        kv.mark_step()
        kv.free_sequence(name)
    kv.add_sequence("d", list(range(20, 40)))  # needs 10 blocks: evicts cached ones
    kv.mark_step()
    held = cached_blocks(kv)  # the manager's cache as the stream names it
    seen = s.cached_blocks()
    assert seen == held and len(held) >= 4 and s.removals and s.problems == {}
