"""KV-cache groups: the grouping rule, the sliding-window manager, the coordinator over one pool."""

from __future__ import annotations

import random

import pytest
import torch

from pagedlearn import KVCacheManager, OutOfBlocksError, PagedLearnError
from pagedlearn.attention.kv_cache import KVCache, KVCacheSpec
from pagedlearn.hybrid.kv_cache_coordinator import KVCacheCoordinator
from pagedlearn.hybrid.kv_cache_groups import group_layers, sliding_blocks_held
from pagedlearn.hybrid.sliding_window_manager import SlidingWindowManager
from pagedlearn.trace.events import PoolReplay


def test_grouping_follows_vllms_uniform_page_rule():
    assert [g.name for g in group_layers([None, None])] == ["full"]
    assert [g.layer_ids for g in group_layers([5, None, 5, None])] == [(1, 3), (0, 2)]
    # 5 sliding to 1 full: groups of the smaller count, the last one padded
    groups = group_layers(([7] * 5 + [None]) * 2)
    assert [(g.name, len(g.layer_ids)) for g in groups] == [
        ("full", 2), ("sliding 7 #0", 2), ("sliding 7 #1", 2), ("sliding 7 #2", 2),
        ("sliding 7 #3", 2), ("sliding 7 #4", 2),
    ]  # fmt: skip
    # within 25%: the larger count, less padding (5 full, 6 sliding -> groups of 6)
    assert [len(g.layer_ids) for g in group_layers([None] * 5 + [3] * 6)] == [5, 6]
    assert [len(g.layer_ids) for g in group_layers([None] * 4 + [3] * 5)] == [4, 3, 2]
    # dealt round-robin, as vLLM does: sliding layers 4..8 -> (4, 6, 8) and (5, 7)
    assert [g.layer_ids for g in group_layers([None] * 4 + [3] * 5)][1:] == [(4, 6, 8), (5, 7)]
    for bad in ([], [0], [2.5], [True]):
        with pytest.raises(PagedLearnError):
            group_layers(bad)


def test_a_block_holds_one_groups_layers_and_the_bytes_follow():
    spec = KVCacheSpec(4, 2, 16, torch.float32, layer_windows=(24, None, 24, None))
    assert spec.is_hybrid and spec.layers_per_block == 2
    assert (
        spec.block_bytes(16) == 16 * 2 * 2 * 2 * 16 * 4
    )  # tokens x K,V x layers x heads x dim x B
    assert spec.num_blocks_for(spec.block_bytes(16) * 10, 16) == 10
    # 4096 tokens: the full group keeps 256 blocks, the sliding one 2
    assert spec.sequence_bytes(4096, 16) == (256 + 2) * spec.block_bytes(16)
    full = KVCacheSpec(4, 2, 16, torch.float32)
    assert full.sequence_bytes(4096, 16) == 256 * full.block_bytes(16)
    cache = KVCache(spec, num_blocks=3, block_size=16)
    assert cache.slab.shape == (2, 2, 3, 16, 2, 16)
    assert [cache.group_of(layer) for layer in range(4)] == [1, 0, 1, 0]
    assert cache.key_cache(0).data_ptr() == cache.key_cache(1).data_ptr()  # same slot, 2 groups
    with pytest.raises(PagedLearnError, match="3 entries for 4 layers"):
        KVCacheSpec(4, 2, 16, torch.float32, layer_windows=(1, 2, 3))


@pytest.mark.parametrize(("window", "block_size"), [(1, 1), (6, 4), (8, 4), (24, 16), (5, 3)])
def test_the_sliding_manager_holds_the_windows_blocks_only(window, block_size):
    kv = SlidingWindowManager(64, block_size, sliding_window=window)
    kv.add_sequence("a", [1])
    for n in range(1, 120):
        kv.remove_skipped_blocks("a", n)
        kv.append_token("a", n % 250)
        table = kv.block_table("a")
        live = [b for b in table if b >= 0]
        assert len(live) == sliding_blocks_held(n + 1, window, block_size)
        assert len(live) <= -(-window // block_size) + 1
        assert table[: len(table) - len(live)] == [-1] * (len(table) - len(live))  # nulls: head
        # every position the newest query sees has a slot; no older one does
        slots = kv.slot_mapping("a")
        assert all(s >= 0 for s in slots[max(0, n - window + 1) :])
        kv.check_invariants()
    assert kv.stats()["window_freed_blocks"] == len(kv.block_table("a")) - len(live)


def test_remove_skipped_blocks_refuses_bad_input_and_changes_nothing():
    kv = SlidingWindowManager(8, 4, sliding_window=4)
    kv.add_sequence("a", list(range(10)))
    for bad in (-1, 11, 2.0, True, None):
        with pytest.raises(PagedLearnError, match="num_computed_tokens"):
            kv.remove_skipped_blocks("a", bad)
    assert kv.block_table("a") == [0, 1, 2]
    with pytest.raises(PagedLearnError, match="unknown sequence"):
        kv.remove_skipped_blocks("zz", 3)
    with pytest.raises(PagedLearnError, match="sliding_window must be an int >= 1"):
        SlidingWindowManager(8, 4, sliding_window=0)


def test_a_window_hit_needs_only_the_windows_blocks():
    """Prefix hit from the right (vLLM's rule): the blocks before the window may be gone."""
    kv = SlidingWindowManager(12, 4, sliding_window=6, enable_prefix_caching=True)
    prompt = list(range(1, 18))  # 17 tokens: 4 full blocks
    kv.add_sequence("a", prompt)
    kv.free_sequence("a")  # all cached, free
    # A fresh allocation takes (and evicts) the least recently freed cached blocks first: the
    # tail of "a" was freed first, so evict 2 blocks by hand in a second pool instead.
    kv2 = SlidingWindowManager(12, 4, sliding_window=6, enable_prefix_caching=True)
    kv2.add_sequence("a", prompt)
    first_blocks = kv2.block_table("a")
    kv2.free_sequence("a")
    for b in first_blocks[:2]:  # forget logical blocks 0 and 1
        kv2.prefix_cache.evict(b)
        kv2.allocator._cached.discard(b)
        kv2.allocator._free_cached.pop(b, None)
        kv2.allocator._free_empty.append(b)
    # The query at 16 sees 11..16: blocks 2 and 3 are enough for a 16-token hit.
    assert kv2.add_sequence("b", prompt) == 16
    assert kv2.block_table("b")[:2] == [-1, -1]
    kv2.check_invariants()
    # A full-attention manager in the same spot hits nothing: block 0 is gone.
    assert kv.add_sequence("b", prompt) == 16  # (kv still had everything cached)


def test_the_coordinator_is_all_or_nothing_across_groups():
    kv = KVCacheCoordinator(group_layers([None, 8]), num_blocks=10, block_size=4)
    kv.add_sequence("a", list(range(12)))  # 3 blocks in each group: 6
    before = (kv.block_tables("a"), kv.num_free_blocks)
    with pytest.raises(OutOfBlocksError, match="need 6 blocks, 4 free"):
        kv.add_sequence("b", list(range(12)))
    assert "b" not in kv and (kv.block_tables("a"), kv.num_free_blocks) == before
    assert kv.stats()["allocation_failures"] == 1
    kv.add_sequence("c", [1, 2, 3, 4])  # 1 + 1 blocks: 2 left
    kv.append_token("c", 5)  # a new block in each group: 0 left
    with pytest.raises(OutOfBlocksError):
        kv.append_token("a", 7)  # a's last blocks are full: one new block per group
    assert kv.num_tokens("a") == 12 and kv.block_tables("a") == before[0]
    kv.check_invariants()


def test_groups_agree_on_one_hit_length():
    kv = KVCacheCoordinator(group_layers([None, 6]), 40, 4, enable_prefix_caching=True)
    prompt = list(range(1, 22))  # 21 tokens: 5 full blocks
    kv.add_sequence("a", prompt)
    assert kv.cached_prefix_tokens(prompt) == 20
    assert kv.add_sequence("b", prompt) == 20
    tables = kv.block_tables("b")
    assert tables[0][:5] == kv.block_tables("a")[0][:5]  # full: all five shared
    assert tables[1][:3] == [-1, -1, -1]  # sliding: the query at 20 sees 15..20 only
    kv.check_invariants()


def test_random_operations_keep_every_invariant_and_the_replay_agrees():
    """Random add / append (with window frees) / fork / free / swap on a full + sliding model;
    after each, the invariants hold and a replay of the trace rebuilds every group's tables."""
    rng = random.Random(0)
    kv = KVCacheCoordinator(group_layers([None, 5, None, 5]), 48, 2, True, num_cpu_blocks=48)
    log = kv.record()
    live, swapped, next_id = [], [], 0
    for _ in range(400):
        op = rng.choice(["add", "append", "append", "append", "fork", "free", "swap"])
        try:
            if op == "add" or not (live or swapped):
                tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
                kv.add_sequence(f"s{next_id}", tokens)
                live.append(f"s{next_id}")
                next_id += 1
            elif op == "append" and live:
                s = rng.choice(live)
                kv.remove_skipped_blocks(s, kv.num_tokens(s))
                kv.append_token(s, rng.randrange(4))
            elif op == "fork" and live:
                kv.fork(rng.choice(live), f"s{next_id}")
                live.append(f"s{next_id}")
                next_id += 1
            elif op == "free" and (live or swapped):
                s = rng.choice(live + swapped)
                kv.free_sequence(s)
                (live if s in live else swapped).remove(s)
            elif op == "swap":
                kv.pop_copies()
                if swapped and rng.random() < 0.5:
                    s = swapped.pop()
                    kv.swap_in([s])
                    live.append(s)
                elif live:
                    s = rng.choice(live)
                    kv.swap_out([s])
                    live.remove(s)
                    swapped.append(s)
        except OutOfBlocksError:
            pass
        kv.check_invariants()
    replay = PoolReplay.from_events(48, log.events, 48)
    on_gpu = {k: t.block_ids for k, t in kv.group_tables().items() if k.split("|")[0] in live}
    assert replay.tables == on_gpu
    assert replay.refcounts == [kv.allocator.refcount(b) for b in range(48)]


def test_every_groups_hit_is_pinned_before_any_group_allocates():
    """Group 0's new blocks must not evict the cached blocks group 1's agreed hit counts on
    (found in review: the sliding group then reused fewer tokens than reported)."""
    kv = KVCacheCoordinator(group_layers([4, None]), 6, 4, enable_prefix_caching=True)
    a, d = list(range(100, 108)), list(range(200, 204))
    kv.add_sequence("A", a)
    kv.add_sequence("D", d)
    kv.free_sequence("A")
    kv.free_sequence("D")
    assert kv.cached_prefix_tokens([*a, 1]) == 8
    assert kv.add_sequence("B", [*a, 1]) == 8
    assert [m._counters["prefix_hit_tokens"] for m in kv.managers] == [8, 8]
    kv.check_invariants()


def test_an_add_that_fits_in_total_never_stops_half_way():
    kv = KVCacheCoordinator(group_layers([4, None]), 8, 4, enable_prefix_caching=True)
    a = list(range(100, 108))
    kv.add_sequence("A", a)
    kv.add_sequence("E", list(range(300, 308)))
    kv.free_sequence("A")
    kv.remove_skipped_blocks("E", 8)
    assert kv.add_sequence("B", [*a, 1]) == 8  # the total fits: every group adds it
    assert all("B" in m._seqs.gpu for m in kv.managers)
    kv.check_invariants()


def test_a_swap_that_one_group_refuses_changes_no_group():
    kv = KVCacheCoordinator(group_layers([None, 5]), 12, 2, num_cpu_blocks=8)
    kv.add_sequence("a", [1, 2, 3])
    kv.fork("a", "b")
    kv.append_token("b", 9)  # copy-on-write in both groups, not yet applied
    kv.free_sequence("b")  # its copies' destinations go back to the pool...
    kv.add_sequence("c", list(range(8)))  # ...and to c, in the sliding group
    with pytest.raises(PagedLearnError, match="pending copy-on-write"):
        kv.swap_out(["c"])
    assert not any(m.is_swapped("c") for m in kv.managers)
    kv.check_invariants()


def test_ids_that_the_trace_would_confuse_are_refused():
    kv = KVCacheCoordinator(group_layers([None, 4]), 16, 4)
    kv.add_sequence(3, [1, 2])
    with pytest.raises(PagedLearnError, match="would be traced as"):
        kv.add_sequence("3", [1, 2])
    with pytest.raises(PagedLearnError, match="would be traced as"):
        kv.fork(3, "3")
    kv.free_sequence(3)
    kv.add_sequence("3", [1, 2])  # free again
    kv.check_invariants()


def test_the_checker_catches_a_window_freed_too_far():
    kv = KVCacheCoordinator(group_layers([None, 8]), 16, 4)
    kv.add_sequence("a", list(range(14)))
    kv.managers[1]._seqs.gpu["a"].block_ids[:3] = [-1, -1, -1]  # the query at 14 reads block 1
    with pytest.raises(PagedLearnError, match="still reads block 1"):
        kv.check_invariants()


def test_a_sliding_request_that_grew_past_the_pool_can_come_back_in_chunks():
    """min_blocks_to_run: a sliding group needs only its window's blocks, so a request that
    grew long is not failed as "can never fit" after a recompute preemption."""
    sliding = SlidingWindowManager(16, 4, sliding_window=24)
    assert sliding.min_blocks_to_run(1000) == 7 and sliding.min_blocks_to_run(9) == 3
    kv = KVCacheCoordinator(group_layers([None, 24]), 16, 4)
    assert kv.min_blocks_to_run(1000) == 250 + 7


def test_the_text_pool_map_shows_every_groups_blocks():
    """``python -m pagedlearn demo`` prints the pool with format_pool: for a hybrid model every
    used block must appear with its group (found at the end: the sliding group's were shown
    as free)."""
    from pagedlearn.cli.blocks import format_pool

    kv = KVCacheCoordinator(group_layers([None, 4]), 12, 2)
    kv.add_sequence("a", list(range(7)))  # 4 blocks per group
    kv.remove_skipped_blocks("a", 7)  # the sliding group keeps blocks 2 and 3 of "a"
    text = format_pool(kv, {"a": "A"}, per_row=4)
    assert text.count("A/F") == 4 and text.count("A/S") == 2
    assert kv.stats()["used_blocks"] == 6
    single = KVCacheManager(4, 2)
    single.add_sequence("b", [1, 2, 3])
    assert "/" not in format_pool(single)
