"""Swapping (preemption by swap) and the questions blocks_to_append and blocks_to_swap_in.

``snapshot`` from helpers sees only the GPU side; ``full_snapshot`` adds the swapped-out tables, the
CPU pool and ``stats()``, so that "a failed operation changed nothing" covers both pools.
"""

import random
from collections import Counter

import pytest
from helpers import replay_matches, snapshot

from pagedlearn import KVCacheManager, OutOfBlocksError, PagedLearnError

BS = 4


def make(num_blocks=16, num_cpu_blocks=16, caching=False, block_size=BS):
    return KVCacheManager(
        num_blocks, block_size, enable_prefix_caching=caching, num_cpu_blocks=num_cpu_blocks
    )


def cpu_table(kv, seq_id):
    return list(kv._seqs.cpu[seq_id].block_ids)


def full_snapshot(kv):
    cpu = kv.cpu_allocator
    swapped = {
        s: (cpu_table(kv, s), kv.token_ids(s), list(kv._seqs.cpu[s].block_hashes))
        for s in kv.swapped_sequences()
    }
    cpu_state = (
        ([cpu.refcount(b) for b in range(cpu.num_blocks)], cpu.free_queue()) if cpu else None
    )
    return snapshot(kv), swapped, cpu_state, kv.stats(), dict(kv._seqs.extra_keys)


def all_replay_matches(kv, state):
    swapped = {s: cpu_table(kv, s) for s in kv.swapped_sequences()}
    return replay_matches(kv, state) and state.swapped == swapped


def forked(kv, n, prompt=range(6)):
    """Sequence "s0" and n - 1 forks of it, "s1", "s2", ... sharing every block."""
    kv.add_sequence("s0", prompt)
    for i in range(1, n):
        kv.fork("s0", f"s{i}")
    return [f"s{i}" for i in range(n)]


# --- construction and plain swap out / in -----------------------------------------------------
def test_the_cpu_pool_exists_only_when_asked_for():
    assert make(num_cpu_blocks=0).cpu_allocator is None
    assert make(num_cpu_blocks=5).cpu_allocator.num_blocks == 5
    for bad in (-1, True, 2.0, "4"):
        with pytest.raises(PagedLearnError, match="num_cpu_blocks must be an int >= 0"):
            make(num_cpu_blocks=bad)


def test_a_sequence_moves_to_the_cpu_and_back_with_its_tokens():
    kv = make(num_blocks=8, num_cpu_blocks=4)
    kv.add_sequence("a", range(10))  # 3 blocks
    gpu = kv.block_table("a")
    copies = kv.swap_out(["a"])
    assert [g for g, _ in copies] == gpu and len({c for _, c in copies}) == 3
    assert cpu_table(kv, "a") == [c for _, c in copies]
    assert kv.is_swapped("a") and "a" in kv
    assert kv.sequences() == [] and kv.swapped_sequences() == ["a"]
    assert kv.token_ids("a") == list(range(10))
    assert kv.num_free_blocks == 8 and kv.cpu_allocator.num_free_blocks == 1
    kv.check_invariants()

    assert kv.blocks_to_swap_in(["a"]) == 3
    back = kv.swap_in(["a"])
    assert [c for c, _ in back] == [c for _, c in copies]
    assert kv.block_table("a") == [g for _, g in back] and not kv.is_swapped("a")
    assert kv.token_ids("a") == list(range(10)) and kv.swapped_sequences() == []
    assert kv.cpu_allocator.num_free_blocks == 4 and kv.num_free_blocks == 5
    kv.append_token("a", 10)  # it grows as before
    assert len(kv.slot_mapping("a")) == 11
    s = kv.stats()
    assert (s["swap_out_blocks"], s["swap_in_blocks"], s["swapped_seqs"]) == (3, 3, 0)
    kv.check_invariants()


def test_a_forked_group_keeps_sharing_on_the_cpu_and_back():
    kv = make(num_blocks=8, num_cpu_blocks=8)
    p, c1, c2 = forked(kv, 3)  # 6 tokens: block 0 full, block 1 half full, shared by 3
    kv.append_token(c1, 6)  # c1 copies block 1 on write
    (cow,) = kv.pop_copies()
    b0, b1, own = kv.block_table(p)[0], kv.block_table(p)[1], cow[1]
    assert kv.block_table(c1) == [b0, own] and kv.block_table(c2) == [b0, b1]

    copies = kv.swap_out([p, c1, c2])
    # One CPU block per distinct GPU block, in the order the tables first name them.
    assert [g for g, _ in copies] == [b0, b1, own]
    to_cpu = dict(copies)
    cpu = kv.cpu_allocator
    assert [cpu.refcount(to_cpu[b]) for b in (b0, b1, own)] == [3, 2, 1]
    assert cpu_table(kv, c1) == [to_cpu[b0], to_cpu[own]]
    assert cpu_table(kv, c2) == cpu_table(kv, p) == [to_cpu[b0], to_cpu[b1]]
    assert kv.num_free_blocks == 8 and cpu.num_shared_blocks == 2
    assert kv.stats()["swap_out_blocks"] == 3
    kv.check_invariants()

    assert kv.blocks_to_swap_in([p, c1, c2]) == 3
    assert kv.blocks_to_swap_in([c1]) == 2
    back = kv.swap_in([c2, p, c1])  # any order: c2 names its blocks first now
    assert [c for c, _ in back] == [to_cpu[b0], to_cpu[b1], to_cpu[own]]
    to_gpu = dict(back)
    n0, n1, n_own = (to_gpu[to_cpu[b]] for b in (b0, b1, own))
    assert kv.block_table(p) == kv.block_table(c2) == [n0, n1]
    assert kv.block_table(c1) == [n0, n_own]
    a = kv.allocator
    assert [a.refcount(b) for b in (n0, n1, n_own)] == [3, 2, 1]
    assert cpu.num_free_blocks == 8 and kv.stats()["swap_in_blocks"] == 3
    # Still shared: the next writer into n1 copies on write, exactly once.
    assert kv.blocks_to_append([p, c2]) == 1
    kv.check_invariants()


def test_a_block_another_request_shares_stays_on_the_gpu():
    kv = make(num_blocks=8, num_cpu_blocks=8, caching=True)
    prompt = list(range(9))  # 2 full blocks + 1 token
    kv.add_sequence("x", prompt)
    assert kv.add_sequence("y", prompt) == 8  # shares x's 2 full blocks
    x = kv.block_table("x")
    y = kv.block_table("y")
    copies = kv.swap_out(["y"])
    assert [g for g, _ in copies] == y  # the shared blocks are copied too: y owns its copy
    assert [kv.allocator.refcount(b) for b in x] == [1, 1, 1]  # x keeps them
    assert kv.allocator.refcount(y[2]) == 0  # y's own last block is free
    assert kv.block_table("x") == x and kv.num_free_blocks == 8 - 3
    assert kv.add_sequence("z", prompt) == 8 and kv.block_table("z")[:2] == x[:2]
    kv.check_invariants()


def test_swapped_out_cached_blocks_stay_findable_and_swap_in_does_not_index_twice():
    kv = make(num_blocks=8, num_cpu_blocks=8, caching=True)
    prompt = list(range(9))
    kv.add_sequence("a", prompt)
    old = kv.block_table("a")
    kv.swap_out(["a"])
    assert kv.stats()["cached_blocks"] == 2  # a's full blocks: free, KV still valid
    assert kv.add_sequence("b", prompt) == 8 and kv.block_table("b")[:2] == old[:2]
    kv.swap_in(["a"])
    new = kv.block_table("a")
    assert not set(new) & set(old)  # fresh blocks: a owns its KV again
    # The content is indexed once, under b's (a's old) blocks; a's copies are not indexed.
    assert [kv.prefix_cache.hash_of(b) is None for b in new] == [True, True, True]
    assert kv.add_sequence("c", prompt) == 8 and kv.block_table("c")[:2] == old[:2]
    kv.check_invariants()


def test_swap_in_evicts_for_its_sequence_and_registers_the_blocks_again():
    kv = make(num_blocks=4, num_cpu_blocks=4, caching=True)
    prompt = list(range(9))
    kv.add_sequence("a", prompt)
    kv.swap_out(["a"])
    kv.add_sequence("hog", range(100, 116))  # all 4 blocks: evicts a's cached blocks
    kv.free_sequence("hog")  # 4 cached-free blocks, none of them a's prefix
    log = kv.record()
    kv.swap_in(["a"])
    evicts = [e for e in log.events if e.kind == "evict"]
    assert len(evicts) == 3 and all(e.seqs == ("a",) for e in evicts)
    stored = [e.blocks[0] for e in log.events if e.kind == "cache_store"]
    assert stored == kv.block_table("a")[:2]
    kv.free_sequence("a")
    assert kv.add_sequence("b", prompt) == 8  # found again after the round trip
    kv.check_invariants()


# --- errors leave both pools as they were -----------------------------------------------------
def test_out_of_cpu_blocks_changes_nothing():
    kv = make(num_blocks=8, num_cpu_blocks=2)
    kv.add_sequence("a", range(10))  # 3 blocks
    before = full_snapshot(kv)
    with pytest.raises(
        OutOfBlocksError, match=r"swap_out\(\['a'\]\) to CPU: need 3 blocks, 2 free"
    ):
        kv.swap_out(["a"])
    assert full_snapshot(kv) == before and not kv.is_swapped("a")
    kv.check_invariants()


def test_out_of_gpu_blocks_on_swap_in_changes_nothing():
    kv = make(num_blocks=4, num_cpu_blocks=4, caching=True)
    kv.add_sequence("a", range(9))  # 3 blocks
    kv.fork("a", "b")
    kv.swap_out(["a", "b"])
    kv.add_sequence("c", range(100, 108))  # 2 of the 4 GPU blocks
    assert kv.blocks_to_swap_in(["a", "b"]) == 3
    before = full_snapshot(kv)
    with pytest.raises(OutOfBlocksError, match=r"swap_in\(\['a', 'b'\]\): need 3 blocks, 2 free"):
        kv.swap_in(["a", "b"])
    assert full_snapshot(kv) == before  # stats too: a failed swap is not an allocation failure
    kv.check_invariants()
    kv.free_sequence("c")
    kv.swap_in(["a", "b"])  # room now: the same call works
    kv.check_invariants()


def test_abort_of_a_swapped_sequence_frees_its_cpu_blocks():
    kv = make(num_blocks=8, num_cpu_blocks=8)
    p, c = forked(kv, 2)
    kv.swap_out([p, c])
    cpu = kv.cpu_allocator
    assert cpu.num_free_blocks == 6 and cpu.num_shared_blocks == 2
    kv.free_sequence(p)
    assert p not in kv and kv.swapped_sequences() == [c]
    assert cpu.num_free_blocks == 6 and cpu.num_shared_blocks == 0  # c still holds them
    kv.check_invariants()
    kv.free_sequence(c)
    assert cpu.num_free_blocks == 8 and kv.num_free_blocks == 8
    with pytest.raises(PagedLearnError, match="unknown sequence id 's1'"):
        kv.free_sequence(c)
    kv.check_invariants()


def test_a_swapped_sequence_cannot_grow_fork_or_be_read_but_keeps_its_id():
    kv = make()
    kv.add_sequence("a", range(5))
    kv.add_sequence("r", range(5))
    kv.swap_out(["a"])
    before = full_snapshot(kv)
    swapped_out = [
        lambda: kv.append_token("a", 1),
        lambda: kv.fork("a", "child"),
        lambda: kv.block_table("a"),
        lambda: kv.slot_mapping("a"),
        lambda: kv.blocks_to_append(["r", "a"]),
    ]
    for call in swapped_out:
        with pytest.raises(PagedLearnError, match=r"'a' is swapped out to the CPU: swap_in\(\["):
            call()
        assert full_snapshot(kv) == before
    for call in (lambda: kv.add_sequence("a", [1]), lambda: kv.fork("r", "a")):
        with pytest.raises(PagedLearnError, match="sequence id 'a' already exists"):
            call()
        assert full_snapshot(kv) == before
    assert "a" in kv and kv.token_ids("a") == list(range(5)) and kv.is_swapped("a")
    with pytest.raises(PagedLearnError, match="unknown sequence id 'zz'"):
        kv.is_swapped("zz")


def test_bad_swap_calls_raise_clear_errors_and_change_nothing():
    kv = make(caching=True)
    kv.add_sequence("a", range(5))
    kv.add_sequence("b", range(5))
    kv.add_sequence("out", range(5))
    kv.swap_out(["out"])
    before = full_snapshot(kv)
    cases = [
        (lambda: kv.swap_out([]), "swap_out needs at least one sequence id"),
        (lambda: kv.swap_out(["a", "b", "a"]), "swap_out: sequence id 'a' is listed twice"),
        (lambda: kv.swap_out(["a", "zz"]), "unknown sequence id 'zz'"),
        (lambda: kv.swap_out(["a", "out"]), "swap_out: sequence 'out' is already swapped out"),
        (lambda: kv.swap_out("a"), "swap_out takes a list of sequence ids, got 'a'"),
        (lambda: kv.swap_out(7), "takes a list of sequence ids, got 7"),
        (lambda: kv.swap_out([["unhashable"]]), "unknown sequence id"),
        (lambda: kv.swap_in([]), "swap_in needs at least one sequence id"),
        (lambda: kv.swap_in(["out", "out"]), "listed twice"),
        (lambda: kv.swap_in(["out", "a"]), "swap_in: sequence 'a' is not swapped out"),
        (lambda: kv.swap_in(["zz"]), "unknown sequence id 'zz'"),
        (lambda: kv.blocks_to_swap_in(["a"]), "blocks_to_swap_in: sequence 'a' is not swapped"),
        (lambda: kv.blocks_to_append(["zz"]), "unknown sequence id 'zz'"),
        (lambda: kv.blocks_to_append("a"), "blocks_to_append takes a list of sequence ids"),
    ]
    for call, message in cases:
        with pytest.raises(PagedLearnError, match=message):
            call()
        assert full_snapshot(kv) == before, message
    assert kv.blocks_to_append([]) == 0


@pytest.mark.parametrize(
    "call",
    [
        lambda kv: kv.swap_out(["a"]),
        lambda kv: kv.swap_in(["a"]),
        lambda kv: kv.blocks_to_swap_in(["a"]),
    ],
    ids=["swap_out", "swap_in", "blocks_to_swap_in"],
)
def test_swap_without_a_cpu_pool_says_what_is_missing(call):
    kv = make(num_cpu_blocks=0)
    kv.add_sequence("a", range(5))
    before = full_snapshot(kv)
    with pytest.raises(PagedLearnError, match="swap needs num_cpu_blocks > 0"):
        call(kv)
    assert full_snapshot(kv) == before


def test_a_swap_refuses_only_where_the_copy_order_would_move_wrong_kv():
    kv = make()
    p, c = forked(kv, 2)  # 6 tokens: the half-full block 1 is shared
    kv.add_sequence("out", range(3))
    kv.swap_out(["out"])
    kv.append_token(c, 9)  # pending copy-on-write (src, dst): dst gets its KV only with it
    ((src, dst),) = kv._copies
    before = full_snapshot(kv)
    with pytest.raises(PagedLearnError, match=rf"swap_out: block {dst} gets its KV from the pend"):
        kv.swap_out([p, c])  # the swap-out copy of dst would run before dst is filled
    assert full_snapshot(kv) == before
    kv.swap_out([p])  # src is read, not written: fine, and src is free now
    before = full_snapshot(kv)
    with pytest.raises(PagedLearnError, match=rf"pending copy-on-write \({src}, {dst}\) names a"):
        kv.swap_in(["out"])  # it could take src, and the copy-on-write would then read "out"
    assert full_snapshot(kv) == before
    assert kv.blocks_to_swap_in(["out"]) == 1  # a question is always fine
    kv.pop_copies()  # the engine applied it: nothing waits any more
    kv.swap_in(["out"])
    kv.swap_out([c])
    kv.check_invariants()


def test_a_freed_copy_on_write_destination_also_blocks_swap_in():
    kv = make()
    _, c = forked(kv, 2)
    kv.add_sequence("out", range(3))
    kv.swap_out(["out"])
    kv.append_token(c, 9)
    kv.free_sequence(c)  # aborted: dst is free, and the pending copy would overwrite it
    before = full_snapshot(kv)
    with pytest.raises(PagedLearnError, match="names a free block"):
        kv.swap_in(["out"])
    assert full_snapshot(kv) == before


def test_copy_on_write_pending_during_a_scheduler_step_moves_the_right_kv():
    """The scheduler's order: append for the oldest request (a copy-on-write stays pending),
    then preempt a younger one by swap; later resume it after another request appended."""
    kv = make(num_blocks=8, num_cpu_blocks=8)
    gpu: dict[int, str] = {}
    cpu: dict[int, str] = {}

    def prefill(seq):
        for j, b in enumerate(kv.block_table(seq)):
            gpu[b] = f"{seq}{j}"

    def apply(swap_out=(), swap_in=()):  # what the engine does before the forward
        for g, c in swap_out:
            cpu[c] = gpu[g]
        for c, g in swap_in:
            gpu[g] = cpu[c]
        for src, dst in kv.pop_copies():
            gpu[dst] = gpu[src]

    p, c = forked(kv, 2)
    prefill(p)
    kv.add_sequence("young", range(100, 108))
    prefill("young")
    kv.append_token(c, 9)  # the oldest request appends: copy-on-write pending
    apply(swap_out=kv.swap_out(["young"]))  # then the youngest is preempted
    assert [gpu[b] for b in kv.block_table(c)] == ["s00", "s01"]
    kv.append_token(p, 9)  # next step: p appends (owns its block), young comes back
    apply(swap_in=kv.swap_in(["young"]))
    assert [gpu[b] for b in kv.block_table("young")] == ["young0", "young1"]
    kv.check_invariants()


# --- the copy order the engine follows --------------------------------------------------------
def test_the_documented_copy_order_moves_the_right_kv():
    """Play the engine: KV contents as dicts, copies applied swap-out, swap-in, then CoW."""
    kv = make(num_blocks=7, num_cpu_blocks=4)
    gpu: dict[int, str] = {}
    cpu: dict[int, str] = {}

    def prefill(seq):
        for j, b in enumerate(kv.block_table(seq)):
            gpu[b] = f"{seq}{j}"

    def step(*, out=(), into=()):
        swap_out = kv.swap_out(list(out)) if out else []
        swap_in = kv.swap_in(list(into)) if into else []
        for g, c in swap_out:
            cpu[c] = gpu[g]
        for c, g in swap_in:
            gpu[g] = cpu[c]
        for src, dst in kv.pop_copies():
            gpu[dst] = gpu[src]

    kv.add_sequence("a", range(8))
    kv.add_sequence("b", range(8))
    prefill("a")
    prefill("b")
    step(out=["b"])  # b goes to the CPU
    kv.add_sequence("f", range(20))  # f takes every free block, b's old ones too
    prefill("f")
    # One step: a goes out, and b comes back into the very blocks a just left. Swap-out copies
    # first, so a's KV reaches the CPU before b's lands in those blocks.
    a_blocks = kv.block_table("a")
    step(out=["a"], into=["b"])
    assert sorted(kv.block_table("b")) == sorted(a_blocks)
    assert [gpu[g] for g in kv.block_table("b")] == ["b0", "b1"]
    kv.free_sequence("f")
    kv.add_sequence("g", range(5))  # and a copy-on-write in the same step as a swap-in
    kv.fork("g", "h")
    prefill("g")
    step(into=["a"])
    kv.append_token("h", 1)
    step()
    assert [gpu[g] for g in kv.block_table("a")] == ["a0", "a1"]
    assert [gpu[g] for g in kv.block_table("h")] == ["g0", "g1"]
    kv.check_invariants()


# --- blocks_to_append: the exact number of blocks one step of appends takes ---------------------
@pytest.mark.parametrize(
    ("block_size", "prompt_len", "sharers", "ids", "expected"),
    [
        (4, 6, 1, ["s0"], 0),  # room in the last block
        (4, 8, 1, ["s0"], 1),  # full last block
        (4, 6, 2, ["s0", "s1"], 1),  # 2 sharers: one copy, the last writer owns the block
        (4, 6, 2, ["s1"], 1),  # one of 2 sharers writes: it copies
        (4, 6, 3, ["s0", "s1", "s2"], 2),  # 3 sharers: min(3, 3 - 1) copies
        (4, 6, 3, ["s2", "s0"], 2),  # 2 of 3 sharers: min(2, 2) copies
        (4, 6, 3, ["s1"], 1),
        (4, 8, 2, ["s0", "s1"], 2),  # shared but full: each needs a new block
        (4, 8, 3, ["s0", "s1", "s2"], 3),
        (1, 3, 1, ["s0"], 1),  # block size 1: every token a block
        (1, 3, 3, ["s0", "s1", "s2"], 3),
        (2, 3, 1, ["s0", "s0", "s0"], 1),  # fills block 1, then a new block, then fills it
        (4, 5, 2, ["s0", "s0", "s1"], 1),  # s0 copies once, then writes its own copy
        (4, 5, 3, ["s0", "s1", "s1", "s2"], 2),
        (3, 7, 2, ["s0", "s1", "s0", "s1", "s0", "s1"], 3),  # 1 copy, then a new block each
    ],
)
def test_blocks_to_append_counts_what_append_token_allocates(
    block_size, prompt_len, sharers, ids, expected
):
    kv = make(block_size=block_size)
    forked(kv, sharers, prompt=range(prompt_len))
    assert appends_cost_as_predicted(kv, ids) == expected


def appends_cost_as_predicted(kv, ids):
    """Ask blocks_to_append, check that asking changed nothing, append, compare; returns it."""
    before = full_snapshot(kv)
    predicted = kv.blocks_to_append(ids)
    assert full_snapshot(kv) == before
    free = kv.num_free_blocks
    for s in ids:
        kv.append_token(s, 0)
    copies = kv.pop_copies()
    allocated = free - kv.num_free_blocks  # a new block and a copy each take one free block
    assert allocated == predicted, (ids, predicted, allocated)
    assert len(copies) == kv.stats()["cow_copies"] - before[3]["cow_copies"]
    kv.check_invariants()
    return predicted


@pytest.mark.parametrize("seed", range(40))
def test_blocks_to_append_matches_random_families(seed):
    rng = random.Random(seed)
    kv = make(num_blocks=400, block_size=rng.choice([1, 2, 3, 4]), caching=rng.random() < 0.5)
    seqs = []
    for i in range(rng.randint(1, 4)):  # a few requests, some with a common prompt
        seqs.append(f"r{i}")
        kv.add_sequence(seqs[-1], [1, 2, 3, 4, 5, 6, 7][: rng.randint(1, 7)])
    for _ in range(rng.randint(0, 12)):  # grow families: forks and appends
        s = rng.choice(seqs)
        if rng.random() < 0.5:
            seqs.append(f"{s}.{len(seqs)}")
            kv.fork(s, seqs[-1])
        else:
            kv.append_token(s, rng.randint(0, 3))
            kv.pop_copies()
    for _ in range(3):  # a few steps, each appending to a random list (repeats allowed)
        appends_cost_as_predicted(kv, [rng.choice(seqs) for _ in range(rng.randint(0, 8))])


# --- stats and the trace ----------------------------------------------------------------------
def test_stats_report_the_cpu_pool():
    s = make(num_cpu_blocks=0).stats()
    assert (s["swapped_seqs"], s["cpu_blocks"], s["cpu_used_blocks"]) == (0, 0, 0)
    assert (s["swap_out_blocks"], s["swap_in_blocks"]) == (0, 0)
    kv = make(num_blocks=8, num_cpu_blocks=6)
    forked(kv, 2)
    kv.add_sequence("x", range(3))
    kv.swap_out(["s0", "s1"])
    s = kv.stats()
    assert (s["num_seqs"], s["swapped_seqs"], s["cpu_blocks"], s["cpu_used_blocks"]) == (1, 2, 6, 2)
    assert (s["swap_out_blocks"], s["swap_in_blocks"], s["used_blocks"]) == (2, 0, 1)
    kv.swap_in(["s1", "s0"])
    kv.swap_out(["x"])
    s = kv.stats()
    assert (s["swap_out_blocks"], s["swap_in_blocks"], s["cpu_used_blocks"]) == (3, 2, 1)


def test_the_trace_replays_every_swap():
    kv = make(num_blocks=6, num_cpu_blocks=6, caching=True, block_size=2)
    log = kv.record()
    ops = [
        lambda: kv.add_sequence("a", [1, 2, 3]),
        lambda: kv.fork("a", "b"),
        lambda: kv.add_sequence("c", [1, 2, 9]),  # shares a's cached block 0
        lambda: kv.swap_out(["a", "b"]),
        lambda: kv.append_token("c", 4),
        lambda: kv.add_sequence("d", [5, 6, 7, 8, 9]),  # evicts a's and b's cached-free block
        lambda: kv.free_sequence("d"),
        lambda: kv.swap_in(["b", "a"]),  # evicts for b and a, registers their full block
        lambda: kv.swap_out(["c"]),
        lambda: kv.free_sequence("c"),  # abort while swapped out
        lambda: kv.append_token("a", 4),
        lambda: kv.pop_copies(),
    ]
    for op in ops:
        op()
        assert all_replay_matches(kv, log.replay())
        kv.check_invariants()
    outs = [e for e in log.events if e.kind == "swap_out"]
    assert [e.seqs for e in outs] == [("a",), ("b",), ("c",)]
    assert outs[0].blocks == outs[1].blocks and outs[0].info == outs[1].info  # shared, shared
    ins = [e for e in log.events if e.kind == "swap_in"]
    assert [e.seqs for e in ins] == [("b",), ("a",)]
    assert Counter(e.kind for e in log.events)["evict"] >= 1
