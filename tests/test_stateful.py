"""Property-based test: random add / append / fork / free against an independent shadow model.

Hypothesis drives a ``KVCacheManager`` with small pools (so allocations fail) and a small token
alphabet with a common system prompt (so prefixes are shared and cached). After every step it checks

- ``check_invariants()``;
- the shadow model: each sequence's expected tokens, each block's expected refcount (the shadow
  applies its own rules: add +1 per block, fork +1 per shared block, append +1 on a fresh block,
  copy-on-write moves one reference, free -1), and the KV each block was last written with -- so a
  prefix-cache hit must hand back a block holding exactly the requester's prefix;
- that a failed operation changed nothing;
- that replaying the event trace rebuilds the same pool.

At the end every sequence is freed and every block must be free.
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
from pagedlearn.trace import PoolReplay

SYSTEM = [7, 8, 9, 7, 8, 9, 7, 8]  # a shared prefix, repetitive on purpose
STEPS = Counter()  # steps run per configuration, to prove the test did its work
SEEN = Counter()  # (caching, what) -> how often the interesting cases happened

prompts = (
    st.tuples(st.integers(0, len(SYSTEM)), st.lists(st.integers(0, 3), max_size=6))
    .map(lambda t: SYSTEM[: t[0]] + t[1])
    .filter(bool)
)
salts = st.sampled_from([None, None, "tenant-b"])


class KVCacheMachine(RuleBasedStateMachine):
    caching = True

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 3, 4]))
    def setup(self, num_blocks, block_size):
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=self.caching)
        self.bs = block_size
        self.replay = PoolReplay(num_blocks)  # follows the trace event by event, as a view would
        self.kv.trace.subscribe(self.replay.apply)
        self.tokens: dict[int, list[int]] = {}  # shadow: tokens per live sequence
        self.salt: dict[int, object] = {}
        self.refs = [0] * num_blocks  # shadow refcounts
        self.content: dict[int, tuple] = {}  # block -> (salt, prefix up to its end) last written
        self.next_id = 0
        self.freed: list[int] = []

    def _write(self, seq, j):
        """Record the KV that sequence ``seq`` writes into its logical block ``j``."""
        block = self.kv.block_table(seq)[j]
        self.content[block] = (self.salt[seq], tuple(self.tokens[seq][: (j + 1) * self.bs]))

    def _attempt(self, op):
        before = snapshot(self.kv)
        try:
            return True, op()
        except OutOfBlocksError:
            SEEN[self.caching, "out of blocks"] += 1
            assert snapshot(self.kv) == before, "a failed operation changed the state"
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

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        old = self.kv.block_table(seq)
        ok, slot = self._attempt(lambda: self.kv.append_token(seq, token))
        if not ok:
            return
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

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
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
        for block in self.kv.block_table(seq):
            self.refs[block] -= 1
        self.kv.free_sequence(seq)
        del self.tokens[seq], self.salt[seq]
        self.freed.append(seq)

    @precondition(lambda self: self.freed)
    @rule()
    def free_twice(self):
        before = snapshot(self.kv)
        with pytest.raises(PagedLearnError, match="unknown sequence id"):
            self.kv.free_sequence(self.freed[-1])
        assert snapshot(self.kv) == before

    @invariant()
    def agrees_with_the_shadow_model(self):
        STEPS[self.caching] += 1
        self.kv.check_invariants()
        a = self.kv.allocator
        assert [a.refcount(b) for b in range(a.num_blocks)] == self.refs
        assert {s: self.kv.token_ids(s) for s in self.kv.sequences()} == self.tokens
        assert replay_matches(self.kv, self.replay)

    def teardown(self):
        SEEN[self.caching, "evictions"] += self.kv.stats()["evictions"]
        for seq in list(self.tokens):
            self.kv.free_sequence(seq)
        assert self.kv.num_free_blocks == self.kv.allocator.num_blocks
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
    wanted = ["out of blocks", "copy-on-write"] + (["cache hit", "evictions"] if caching else [])
    for what in wanted:
        assert SEEN[caching, what] > 0, f"no {what} in {STEPS[caching]} steps"
    print(f"{STEPS[caching]} steps;", {k[1]: n for k, n in SEEN.items() if k[0] == caching})
