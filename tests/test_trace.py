import pytest
from helpers import replay_matches

from pagedlearn import KVCacheManager
from pagedlearn.trace import Event, EventLog, PoolReplay, Trace


def test_nothing_is_built_when_nobody_listens(monkeypatch):
    trace = Trace()
    monkeypatch.setattr("pagedlearn.trace.Event", None)  # building one would raise
    trace.emit("allocate", [1], ["a"])
    assert not trace.listening


def test_subscribe_and_unsubscribe():
    trace, seen = Trace(), []
    stop = trace.subscribe(seen.append)
    trace.emit("allocate", [3], ["a"])
    stop()
    trace.emit("free", [3], ["a"])
    assert seen == [Event(0, "allocate", (3,), ("a",), {})]


def test_every_operation_is_in_the_trace_and_replay_rebuilds_the_pool():
    kv = KVCacheManager(6, 2, enable_prefix_caching=True)
    log = kv.record()
    states = []
    ops = [
        lambda: kv.add_sequence("a", [1, 2, 3]),
        lambda: kv.add_sequence("b", [1, 2, 4]),  # cache hit
        lambda: kv.fork("a", "c"),
        lambda: kv.append_token("c", 5),  # copy-on-write, cache store
        lambda: kv.append_token("a", 6),
        lambda: kv.free_sequence("a"),
        lambda: kv.add_sequence("d", [7, 8, 9, 10, 11, 12]),  # evicts
        lambda: kv.free_sequence("b"),
    ]
    for op in ops:
        op()
        states.append(len(log))
        assert replay_matches(kv, log.replay())
    kinds = {e.kind for e in log.events}
    assert kinds == {"allocate", "cache_hit", "incref", "cow_copy", "free", "cache_store", "evict"}
    evictions = [e for e in log.events if e.kind == "evict"]
    assert evictions and all(e.seqs == ("d",) for e in evictions)  # evicted for d's new blocks
    # JSON round trip replays to the same pool, step by step.
    loaded = EventLog.from_json(log.to_json())
    assert loaded.meta == {"num_blocks": 6, "block_size": 2}
    assert loaded.events == log.events
    assert replay_matches(kv, loaded.replay())
    assert loaded.replay(upto=states[0]).tables == {"a": [0, 1]}


def test_a_closed_log_stops_recording():
    kv = KVCacheManager(4, 2)
    log = kv.record()
    kv.add_sequence("a", [1])
    log.close()
    kv.add_sequence("b", [1])
    assert len(log) == 1 and not kv.trace.listening


def test_swaps_and_aborts_of_swapped_sequences_replay_and_survive_json():
    kv = KVCacheManager(6, 2, enable_prefix_caching=True, num_cpu_blocks=4)
    log = kv.record()
    kv.add_sequence("a", [1, 2, 3])
    kv.fork("a", "b")
    kv.swap_out(["a", "b"])
    assert kv.add_sequence("c", [1, 2, 3, 4, 5]) == 2  # hits a's cached block 0 while a is out
    kv.swap_in(["a", "b"])
    kv.swap_out(["c"])
    kv.free_sequence("c")  # abort while swapped out: CPU blocks only
    kv.trace.emit("preempt", (), ("c",), mode="swap")  # as the engine does; replay ignores it
    assert log.meta == {"num_blocks": 6, "block_size": 2, "num_cpu_blocks": 4}
    loaded = EventLog.from_json(log.to_json())
    assert loaded.events == log.events
    state = loaded.replay()
    assert replay_matches(kv, state) and state.swapped == {}
    kinds = [e.kind for e in log.events]
    assert kinds.count("swap_out") == 3 and kinds.count("swap_in") == 2
    (cpu_free,) = [e for e in log.events if e.kind == "free"]
    assert cpu_free.seqs == ("c",) and cpu_free.info == {"cpu": True}
    # Step by step: after the first swap-out, both tables sit in the CPU pool.
    upto = kinds.index("swap_out") + 2
    assert loaded.replay(upto=upto).swapped == {"a": [0, 1], "b": [0, 1]}
    assert loaded.replay(upto=upto).tables == {}


def test_preempt_changes_nothing_in_a_replay():
    state = PoolReplay(2)
    state.apply(Event(0, "allocate", (1,), ("a",)))
    state.apply(Event(1, "preempt", (), ("a",), {"mode": "recompute"}))
    assert state.tables == {"a": [1]} and state.refcounts == [0, 1]


def test_replay_refuses_unknown_kinds_and_logs_without_a_pool_size():
    with pytest.raises(ValueError, match="teleport"):
        PoolReplay(2).apply(Event(0, "teleport", (0,), ("a",)))
    with pytest.raises(ValueError, match="num_blocks"):
        EventLog().replay()
