"""Issue 34's "done when": after the load test's mix, the picture a subscriber builds from
pagedlearn's KV-event stream is the manager's prefix cache, block by block.

The engine runs the whole mix of pagedlearn.loadtest (a Poisson mix, a squeeze that preempts, a
cold pass after ``reset_prefix_cache``, a warm pass, a pass under a new ``model_version``) on a
pool small enough that cached blocks are evicted, with a publisher attached; a
``KVEventSubscriber`` follows it over real ZeroMQ sockets on 127.0.0.1 into a ``KVCacheState``.
Once the stream is drained, every block the manager has cached must be in the picture under the
hash that goes on the wire, with its parent and its tokens, and nothing else may be.
"""

import math

import pytest
from helpers import wait_until

from pagedlearn import LLM
from pagedlearn.kv_events.cache_state import BlockKey, KVCacheState
from pagedlearn.kv_events.from_trace import cached_blocks
from pagedlearn.kv_events.publisher import publish_kv_events
from pagedlearn.kv_events.subscriber import KVEventSubscriber
from pagedlearn.loadtest.driver import Driver
from pagedlearn.loadtest.mix import MIN_REQUESTS, PHASES, build_mix, default_pool

ANY = "tcp://127.0.0.1:*"
BLOCK_SIZE = 16


def drain(pub, sub, state: KVCacheState) -> None:
    """Apply every batch the engine made so far to ``state``, as the subscriber received it."""
    wait_until(lambda: pub.status()["published"] == pub.status()["accepted"], "sending", 30.0)
    last = pub.status()["published"] - 1
    # (last_seq moves before a batch is queued for poll(): wait for the picture itself)
    wait_until(
        lambda: state.extend(sub.poll()) >= 0 and state.last_seq == last, f"batch {last}", 30.0
    )


def compare(state: KVCacheState, kv, phase: str) -> None:
    """The picture equals the manager's prefix cache: every cached block under its wire hash,
    with its parent and its tokens; nothing extra, nothing missing."""
    want = cached_blocks(kv)  # the manager's prefix cache as the stream should say it
    have = {k.block_hash for k in state.blocks}
    assert have == set(want), f"after {phase}: {len(have - set(want))} extra, " \
        f"{len(set(want) - have)} missing"  # fmt: skip
    for key, block in state.blocks.items():
        parent, tokens = want[key.block_hash]
        where = f"after {phase}, block {key.block_hash:016x}"
        assert key == BlockKey(0, "GPU", 0, key.block_hash), where  # rank 0, GPU pool, group 0
        assert block.parent_hash == parent, f"{where}: wrong parent"
        assert block.token_ids == tuple(tokens), f"{where}: wrong tokens"
        assert block.block_size == BLOCK_SIZE, where
        # The tree links a block under its parent exactly when the parent is still cached.
        linked = None if block.parent is None else block.parent.block_hash
        assert linked == (parent if parent in want else None), f"{where}: wrong link"


def test_after_each_phase_of_the_load_tests_mix_the_picture_is_the_managers_cache():
    max_len = 512  # tiny-gpt2's context
    num_blocks, swap_blocks = default_pool(max_len, BLOCK_SIZE)  # two full contexts: evictions
    llm = LLM("tiny-gpt2", block_size=BLOCK_SIZE, num_blocks=num_blocks, swap_blocks=swap_blocks,
              preemption_mode="swap", enable_prefix_caching=True, verbose=False)  # fmt: skip
    engine, state = llm.engine, KVCacheState()
    kv = engine.kv
    assert engine.max_model_len == max_len
    # The load test's own mix and phases (loadtest/in_process.run_loadtest), run phase by phase
    # so that the picture is compared whenever the engine is idle, not only at the end.
    specs = build_mix(MIN_REQUESTS, 0, math.inf, max_len, BLOCK_SIZE, num_blocks, swap_blocks)
    driver, version = Driver(engine), engine.model_version
    removed, cached = {}, {}
    with (
        publish_kv_events(llm, ANY, ANY) as pub,
        KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub,
    ):
        # A batch sent before the subscription reaches the PUB socket is lost on the live path;
        # the next one shows the gap and the replay socket fills it: nothing may be missing.
        try:
            for phase in PHASES:
                if phase == "cold":
                    engine.reset_prefix_cache()
                if phase == "version":
                    engine.model_version = f"{version}+loadtest"  # new weights: new hashes
                before = state.received["blocks_removed"]
                driver.run_phase(phase, [s for s in specs if s.phase == phase])
                drain(pub, sub, state)
                compare(state, kv, phase)
                removed[phase] = state.received["blocks_removed"] - before
                cached[phase] = len(state.blocks)
        finally:
            driver.close()
            engine.model_version = version
        st = sub.status()
    assert not driver.invariant_errors and not driver.stuck
    assert st["malformed"] == st["missed"] == st["dropped"] == st["out_of_order"] == 0, st
    assert state.problems.get("unknown_removed", 0) == 0  # every removal named a stored block
    assert state.problems.get("duplicate_stored", 0) == 0
    # The run did what makes the comparison mean something: the pool evicted cached blocks
    # (in the mix and the squeeze), the cold pass cleared the cache, and every phase left
    # blocks cached.
    assert state.received["AllBlocksCleared"] == 1
    assert removed["mix"] + removed["squeeze"] > 0, removed
    assert all(cached.values()), cached


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
