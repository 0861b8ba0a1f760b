"""Property-based test: random add / append / fork / free / swap against an independent shadow.

Hypothesis drives a ``KVCacheManager`` with small pools, GPU and CPU (so allocations and swaps
fail) and a small token alphabet with a common system prompt (so prefixes are shared and cached).
After every step it checks

- ``check_invariants()``;
- the shadow model: each sequence's expected tokens, each block's expected refcount in both pools
  (the shadow applies its own rules: add +1 per block, fork +1 per shared block, append +1 on a
  fresh block, copy-on-write moves one reference, free -1, a swap moves each table reference to
  the block its copy names), and the KV each block was last written with, following the swap
  copies -- so a prefix-cache hit must hand back a block holding exactly the requester's prefix,
  also after its blocks went to the CPU and back;
- that ``blocks_to_append`` is exact: appending to the sequences it was asked about takes exactly
  that many blocks, or fails when fewer are free;
- that a failed operation changed nothing;
- that replaying the event trace rebuilds the same pool, swapped-out tables included.

At the end every sequence is freed and every block of both pools must be free.
"""

from collections import Counter

import hypothesis.strategies as st
import pytest
from helpers import replay_matches, snapshot
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pagedlearn import KVCacheManager, OutOfBlocksError, PagedLearnError
from pagedlearn.trace.events import PoolReplay
from pagedlearn.viz.state import pool_state, state_of_replay

SYSTEM = [7, 8, 9, 7, 8, 9, 7, 8]  # a shared prefix, repetitive on purpose
STEPS = Counter()  # steps run per configuration, to prove the test did its work
SEEN = Counter()  # (caching, what) -> how often the interesting cases happened

prompts = (
    st.tuples(st.integers(0, len(SYSTEM)), st.lists(st.integers(0, 3), max_size=6))
    .map(lambda t: SYSTEM[: t[0]] + t[1])
    .filter(bool)
)
salts = st.sampled_from([None, None, "tenant-b"])


def full_snapshot(kv):
    """``snapshot`` (the GPU side) plus the swapped-out tables, the CPU pool and ``stats()``."""
    cpu = kv.cpu_allocator
    swapped = {s: (list(kv._seqs.cpu[s].block_ids), kv.token_ids(s)) for s in kv._seqs.cpu}
    cpu_pool = [cpu.refcount(b) for b in range(cpu.num_blocks)], cpu.free_queue()
    return snapshot(kv), swapped, cpu_pool, kv.stats()


class KVCacheMachine(RuleBasedStateMachine):
    caching = True

    @initialize(
        num_blocks=st.integers(1, 24),
        block_size=st.sampled_from([1, 2, 3, 4]),
        num_cpu_blocks=st.integers(1, 16),
    )
    def setup(self, num_blocks, block_size, num_cpu_blocks):
        self.kv = KVCacheManager(
            num_blocks,
            block_size,
            enable_prefix_caching=self.caching,
            num_cpu_blocks=num_cpu_blocks,
        )
        self.bs = block_size
        self.replay = PoolReplay(num_blocks)  # follows the trace event by event, as a view would
        self.kv.trace.subscribe(self.replay.apply)
        self.tokens: dict[int, list[int]] = {}  # shadow: tokens per live sequence (both pools)
        self.salt: dict[int, object] = {}
        self.out: set[int] = set()  # shadow: the swapped-out sequences
        self.refs = [0] * num_blocks  # shadow refcounts
        self.cpu_refs = [0] * num_cpu_blocks
        self.content: dict[int, tuple] = {}  # block -> (salt, prefix up to its end) last written
        self.cpu_content: dict[int, tuple] = {}  # the same for the CPU pool
        self.next_id = 0
        self.freed: list[int] = []

    def resident(self):
        return sorted(s for s in self.tokens if s not in self.out)

    def _write(self, seq, j):
        """Record the KV that sequence ``seq`` writes into its logical block ``j``."""
        block = self.kv.block_table(seq)[j]
        self.content[block] = (self.salt[seq], tuple(self.tokens[seq][: (j + 1) * self.bs]))

    def _attempt(self, op, what="out of blocks"):
        before = full_snapshot(self.kv)
        try:
            return True, op()
        except OutOfBlocksError:
            SEEN[self.caching, what] += 1
            after = full_snapshot(self.kv)
            if what == "out of blocks":  # add / append count it in stats(); a swap does not
                before, after = before[:-1], after[:-1]
            assert after == before, "a failed operation changed the state"
            return False, None

    @rule(prompt=prompts, salt=salts)
    def add(self, prompt, salt):
        seq = self.next_id
        ok, reused = self._attempt(lambda: self.kv.add_sequence(seq, prompt, cache_salt=salt))
        if not ok:
            return
        self.next_id += 1
        self.tokens[seq], self.salt[seq] = list(prompt), salt
        table = self.kv.block_table(seq)
        assert len(table) == -(-len(prompt) // self.bs)
        assert reused % self.bs == 0 and 0 <= reused <= len(prompt) - 1
        if not self.caching:
            assert reused == 0
        for j, block in enumerate(table):
            if j < reused // self.bs:  # a hit: the block must already hold this exact prefix
                assert self.content[block] == (salt, tuple(prompt[: (j + 1) * self.bs]))
                SEEN[self.caching, "cache hit"] += 1
            else:
                assert self.refs[block] == 0, "a fresh block was still in use"
                self._write(seq, j)
            self.refs[block] += 1

    @precondition(lambda self: self.resident())
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        self._append(data.draw(st.sampled_from(self.resident())), token)

    def _append(self, seq, token):
        old = self.kv.block_table(seq)
        ok, slot = self._attempt(lambda: self.kv.append_token(seq, token))
        if not ok:
            return False
        pos = len(self.tokens[seq])
        self.tokens[seq].append(token)
        new = self.kv.block_table(seq)
        copies = self.kv.pop_copies()
        if pos % self.bs == 0:  # a new block
            assert new[:-1] == old and copies == [] and self.refs[new[-1]] == 0
            self.refs[new[-1]] += 1
        elif self.refs[old[-1]] > 1:  # shared partial block: copy-on-write
            assert copies == [(old[-1], new[-1])] and self.refs[new[-1]] == 0
            SEEN[self.caching, "copy-on-write"] += 1
            self.refs[old[-1]] -= 1
            self.refs[new[-1]] += 1
        else:
            assert new == old and copies == []
        assert slot == new[pos // self.bs] * self.bs + pos % self.bs
        self._write(seq, pos // self.bs)
        return True

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def append_to_many(self, data):
        """One step of a scheduler: ask what appending to these sequences costs, then do it."""
        seqs = data.draw(st.lists(st.sampled_from(self.resident()), max_size=6))
        before = full_snapshot(self.kv)
        need = self.kv.blocks_to_append(seqs)
        assert full_snapshot(self.kv) == before, "blocks_to_append changed the state"
        free = self.kv.num_free_blocks
        done = 0
        for seq in seqs:
            if not self._append(seq, 0):
                break
            done += 1
        if need <= free:
            assert done == len(seqs), f"{need} blocks were enough, yet an append failed"
            assert free - self.kv.num_free_blocks == need
            SEEN[self.caching, "appends as predicted"] += need > 0
        else:
            assert done < len(seqs), f"{need} blocks > {free} free, yet every append fitted"

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def swap_out(self, data):
        group = data.draw(st.lists(st.sampled_from(self.resident()), min_size=1, unique=True))
        tables = {s: self.kv.block_table(s) for s in group}
        ok, copies = self._attempt(lambda: self.kv.swap_out(group), "CPU out of blocks")
        if not ok:
            distinct = {b for t in tables.values() for b in t}
            assert len(distinct) > self.kv.cpu_allocator.num_free_blocks
            return
        to_cpu = dict(copies)
        assert list(to_cpu) == list(dict.fromkeys(b for t in tables.values() for b in t))
        assert len(set(to_cpu.values())) == len(to_cpu)
        for c in to_cpu.values():
            assert self.cpu_refs[c] == 0, "a fresh CPU block was still in use"
        for table in tables.values():
            for b in table:
                self.refs[b] -= 1
                self.cpu_refs[to_cpu[b]] += 1
                self.cpu_content[to_cpu[b]] = self.content[b]  # the engine's GPU -> CPU copy
        self.out.update(group)
        SEEN[self.caching, "swap out"] += 1
        SEEN[self.caching, "shared swap"] += len(to_cpu) < sum(map(len, tables.values()))

    @precondition(lambda self: self.out)
    @rule(data=st.data())
    def swap_in(self, data):
        group = data.draw(st.lists(st.sampled_from(sorted(self.out)), min_size=1, unique=True))
        tables = {s: list(self.kv._seqs.cpu[s].block_ids) for s in group}
        need = self.kv.blocks_to_swap_in(group)
        assert need == len({c for t in tables.values() for c in t})
        ok, copies = self._attempt(lambda: self.kv.swap_in(group), "GPU out of blocks on swap in")
        if not ok:
            assert need > self.kv.num_free_blocks
            return
        to_gpu = dict(copies)
        assert len(to_gpu) == need and len(set(to_gpu.values())) == need
        for g in to_gpu.values():
            assert self.refs[g] == 0, "a fresh GPU block was still in use"
        for s, table in tables.items():
            assert self.kv.block_table(s) == [to_gpu[c] for c in table]
            for c in table:
                self.cpu_refs[c] -= 1
                self.refs[to_gpu[c]] += 1
                self.content[to_gpu[c]] = self.cpu_content[c]  # the engine's CPU -> GPU copy
        self.out.difference_update(group)
        SEEN[self.caching, "swap in"] += 1

    @precondition(lambda self: self.out and self.resident())
    @rule(data=st.data())
    def swapped_out_cannot_grow(self, data):
        seq = data.draw(st.sampled_from(sorted(self.out)))
        before = full_snapshot(self.kv)
        for call in (lambda: self.kv.append_token(seq, 0), lambda: self.kv.fork(seq, -1)):
            with pytest.raises(PagedLearnError, match="swapped out"):
                call()
        assert full_snapshot(self.kv) == before

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.resident()))
        child = self.next_id
        self.next_id += 1
        self.kv.fork(parent, child)
        self.tokens[child], self.salt[child] = list(self.tokens[parent]), self.salt[parent]
        for block in self.kv.block_table(child):
            self.refs[block] += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if seq in self.out:  # an abort while swapped out: only CPU blocks are returned
            for block in self.kv._seqs.cpu[seq].block_ids:
                self.cpu_refs[block] -= 1
            self.out.remove(seq)
            SEEN[self.caching, "free swapped"] += 1
        else:
            for block in self.kv.block_table(seq):
                self.refs[block] -= 1
        self.kv.free_sequence(seq)
        del self.tokens[seq], self.salt[seq]
        self.freed.append(seq)

    @precondition(lambda self: self.freed)
    @rule()
    def free_twice(self):
        before = full_snapshot(self.kv)
        with pytest.raises(PagedLearnError, match="unknown sequence id"):
            self.kv.free_sequence(self.freed[-1])
        assert full_snapshot(self.kv) == before

    @invariant()
    def agrees_with_the_shadow_model(self):
        STEPS[self.caching] += 1
        self.kv.check_invariants()
        a, cpu = self.kv.allocator, self.kv.cpu_allocator
        assert [a.refcount(b) for b in range(a.num_blocks)] == self.refs
        assert [cpu.refcount(b) for b in range(cpu.num_blocks)] == self.cpu_refs
        assert set(self.kv.swapped_sequences()) == self.out
        everyone = self.kv.sequences() + self.kv.swapped_sequences()
        assert {s: self.kv.token_ids(s) for s in everyone} == self.tokens
        assert replay_matches(self.kv, self.replay)
        swapped = {s: list(self.kv._seqs.cpu[s].block_ids) for s in self.out}
        assert self.replay.swapped == swapped
        # A frame (step event) later, the pictures' state rebuilt from events equals the live one:
        # fill levels, token contents, cached blocks' old tokens included.
        self.kv.mark_step()
        assert state_of_replay(self.replay, self.kv.block_size) == pool_state(self.kv, {})

    def teardown(self):
        SEEN[self.caching, "evictions"] += self.kv.stats()["evictions"]
        for seq in list(self.tokens):
            self.kv.free_sequence(seq)
        assert self.kv.num_free_blocks == self.kv.allocator.num_blocks
        assert self.kv.cpu_allocator.num_free_blocks == self.kv.cpu_allocator.num_blocks
        self.kv.check_invariants()


MIN_STEPS = 2000


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-caching"])
def test_random_operations_keep_every_rule(caching):
    machine = type(f"KVCacheMachine_{caching}", (KVCacheMachine,), {"caching": caching})
    STEPS[caching] = 0
    run_state_machine_as_test(
        machine, settings=settings(max_examples=150, stateful_step_count=40, deadline=None)
    )
    assert STEPS[caching] >= MIN_STEPS, f"only {STEPS[caching]} steps ran"
    # The run must have reached the cases worth testing, not only the easy paths.
    wanted = ["out of blocks", "copy-on-write", "swap out", "swap in", "shared swap"]
    wanted += ["CPU out of blocks", "GPU out of blocks on swap in", "free swapped"]
    wanted += ["appends as predicted"] + (["cache hit", "evictions"] if caching else [])
    for what in wanted:
        assert SEEN[caching, what] > 0, f"no {what} in {STEPS[caching]} steps"
    print(f"{STEPS[caching]} steps;", {k[1]: n for k, n in SEEN.items() if k[0] == caching})
