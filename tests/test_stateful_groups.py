"""Property-based test of the KV-cache coordinator: random add / append (after the window frees
what it left behind) / fork / free / swap on a model with a full and a sliding-window group.

After every step: ``check_invariants()`` (the shared pool counted over every group's tables, the
window's null heads, no block in two groups), the replay of the trace rebuilds every group's
tables and every refcount, each sequence holds the tokens a shadow expects, every group agrees
on a prompt's prefix-cache hit, and an operation that raised changed nothing in any group.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pagedlearn import OutOfBlocksError, PagedLearnError
from pagedlearn.hybrid.kv_cache_coordinator import KVCacheCoordinator
from pagedlearn.hybrid.kv_cache_groups import group_layers
from pagedlearn.trace.events import PoolReplay

SYSTEM = [5, 6, 5, 6, 5, 6, 5, 6, 5, 6]
prompts = (
    st.tuples(st.integers(0, len(SYSTEM)), st.lists(st.integers(0, 2), max_size=5))
    .map(lambda t: SYSTEM[: t[0]] + t[1])
    .filter(bool)
)
SEEN = Counter()


def state(kv: KVCacheCoordinator) -> tuple:
    """Everything an operation could change, in every group."""
    tables = {name: (list(t.block_ids), list(t.token_ids)) for name, t in kv.group_tables().items()}
    pools = [kv.allocator.refcount(b) for b in range(kv.allocator.num_blocks)]
    cpu = [kv.cpu_allocator.refcount(b) for b in range(kv.cpu_allocator.num_blocks)]
    return tables, pools, cpu, kv.allocator.free_queue(), len(kv.prefix_cache)


class CoordinatorMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(2, 30),
        block_size=st.sampled_from([1, 2, 3]),
        window=st.integers(1, 7),
    )
    def setup(self, num_blocks, block_size, window):
        self.kv = KVCacheCoordinator(
            group_layers([None, window]), num_blocks, block_size, True, num_cpu_blocks=12
        )
        self.replay = PoolReplay(num_blocks, 12)
        self.kv.trace.subscribe(self.replay.apply)
        self.tokens: dict[int, list[int]] = {}
        self.out: set[int] = set()
        self.next_id = 0

    def _try(self, op, what: str) -> bool:
        before = state(self.kv)
        try:
            op()
        except (OutOfBlocksError, PagedLearnError):
            assert state(self.kv) == before, f"a failed {what} changed the pool"
            SEEN[f"{what} refused"] += 1
            return False
        return True

    def resident(self) -> list[int]:
        return sorted(s for s in self.tokens if s not in self.out)

    @rule(prompt=prompts)
    def add(self, prompt):
        s = self.next_id
        hit = self.kv.cached_prefix_tokens(prompt)
        if self._try(lambda: self.kv.add_sequence(s, prompt), "add"):
            self.tokens[s], self.next_id = list(prompt), s + 1
            SEEN["hit" if hit else "miss"] += 1
            hits = [m._counters["prefix_hit_tokens"] for m in self.kv.managers]
            assert len(set(hits)) == 1, f"the groups reused different prefixes: {hits}"

    @precondition(lambda self: self.resident())
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):
        s = data.draw(st.sampled_from(self.resident()))
        SEEN["freed"] += self.kv.remove_skipped_blocks(s, self.kv.num_tokens(s))
        if self._try(lambda: self.kv.append_token(s, token), "append"):
            self.tokens[s].append(token)
        self.kv.pop_copies()  # as the engine does each step

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def fork(self, data):
        parent, child = data.draw(st.sampled_from(self.resident())), self.next_id
        if self._try(lambda: self.kv.fork(parent, child), "fork"):
            self.tokens[child], self.next_id = list(self.tokens[parent]), child + 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free_sequence(s)
        del self.tokens[s]
        self.out.discard(s)

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def swap_out(self, data):
        s = data.draw(st.sampled_from(self.resident()))
        if self._try(lambda: self.kv.swap_out([s]), "swap_out"):
            self.out.add(s)
            SEEN["swapped"] += 1

    @precondition(lambda self: self.out)
    @rule(data=st.data())
    def swap_in(self, data):
        s = data.draw(st.sampled_from(sorted(self.out)))
        if self._try(lambda: self.kv.swap_in([s]), "swap_in"):
            self.out.discard(s)

    @invariant()
    def agrees_with_the_shadow_and_the_replay(self):
        kv = self.kv
        kv.check_invariants()
        assert {s: kv.token_ids(s) for s in self.tokens} == self.tokens
        assert set(kv.swapped_sequences()) == self.out
        gpu = {
            n: t.block_ids
            for n, t in kv.group_tables().items()
            if int(n.split("|")[0]) not in self.out
        }
        assert self.replay.tables == gpu
        assert self.replay.refcounts == [
            kv.allocator.refcount(b) for b in range(kv.allocator.num_blocks)
        ]

    def teardown(self):
        for s in list(self.tokens):
            self.kv.free_sequence(s)
        assert self.kv.num_free_blocks == self.kv.allocator.num_blocks
        assert self.kv.cpu_allocator.num_free_blocks == self.kv.cpu_allocator.num_blocks


def test_random_operations_keep_every_rule_in_every_group():
    SEEN.clear()
    run_state_machine_as_test(
        CoordinatorMachine,
        settings=settings(max_examples=120, stateful_step_count=40, deadline=None),
    )
    for what in ("hit", "freed", "swapped", "add refused", "append refused"):
        assert SEEN[what] > 0, f"the random runs never reached {what!r}: {dict(SEEN)}"
