import json
import warnings

import pytest
from helpers import replay_matches

from pagedlearn import KVCacheManager
from pagedlearn.errors import TraceFileError
from pagedlearn.trace.events import Event, EventLog, PoolReplay, Trace


def test_nothing_is_built_when_nobody_listens(monkeypatch):
    trace = Trace()
    monkeypatch.setattr("pagedlearn.trace.events.Event", None)  # building one would raise
    trace.emit("allocate", [1], ["a"])
    assert not trace.listening


def test_subscribe_and_unsubscribe():
    trace, seen = Trace(), []
    stop = trace.subscribe(seen.append)
    trace.emit("allocate", [3], ["a"])
    stop()
    trace.emit("free", [3], ["a"])
    assert seen == [Event(0, "allocate", (3,), ("a",), {})]


class Drawing:
    """A subscriber with a bug: raises at every event of ``kinds`` (and records what it saw)."""

    def __init__(self, *kinds):
        self.kinds, self.seen, self.raised = kinds, [], []

    def __call__(self, event):
        self.seen.append(event.index)
        if event.kind in self.kinds:
            self.raised.append(ValueError(f"drawing bug at {event.kind}"))
            raise self.raised[-1]


def test_a_subscriber_that_raises_inside_an_operation_is_held_until_the_next_step_event():
    kv = KVCacheManager(6, 2, enable_prefix_caching=True)
    bug = Drawing("allocate")
    kv.trace.subscribe(bug)  # first: the others come after it
    log, replay = kv.record(), PoolReplay(6)
    kv.trace.subscribe(replay.apply)
    with pytest.warns(RuntimeWarning, match=r"Drawing raised ValueError.*event 0 \(allocate\)"):
        kv.add_sequence("a", [1, 2, 3])  # raised at its allocate: the operation still completes
    kv.add_sequence("b", [4, 5, 6])  # a second error: counted, not announced again
    assert kv.block_table("a") == [0, 1] and kv.block_table("b") == [2, 3]
    kv.check_invariants()
    assert replay_matches(kv, replay) and replay_matches(kv, log.replay())
    assert kv.trace.held_error is bug.raised[0]
    with pytest.raises(ValueError, match="drawing bug at allocate") as info:
        kv.mark_step(step=1)  # the safe point: every subscriber got the step event first
    assert info.value is bug.raised[0] and len(bug.raised) == 2
    assert "at event 0 (allocate)" in info.value.__notes__[0]
    assert "1 more subscriber error" in info.value.__notes__[1]
    assert [e.kind for e in log.events][-1] == "step" and replay.step_info == {"step": 1}
    assert bug.seen == [e.index for e in log.events]  # the culprit, too, saw every event
    assert kv.trace.held_error is None
    kv.mark_step(step=2)  # raised once, then forgotten
    kv.trace.raise_deferred()  # nothing held: nothing raised


def test_a_subscriber_that_raises_at_a_step_event_raises_after_the_others_saw_it(recwarn):
    kv = KVCacheManager(4, 2)
    bug = Drawing("step")
    kv.trace.subscribe(bug)
    log = kv.record()
    kv.add_sequence("a", [1])
    with pytest.raises(ValueError, match="drawing bug at step"):
        kv.mark_step(step=1)
    assert [e.kind for e in log.events] == ["allocate", "step"]
    assert not recwarn.list  # raised at once: no warning


def test_raise_deferred_is_the_safe_point_of_code_that_marks_no_steps():
    kv = KVCacheManager(4, 2)
    bug = Drawing("free")
    kv.trace.subscribe(bug)
    kv.add_sequence("a", [1, 2, 3])
    with pytest.warns(RuntimeWarning, match="raise_deferred"):
        kv.free_sequence("a")
    assert kv.num_free_blocks == 4  # freed all the same
    with pytest.raises(ValueError, match="drawing bug at free"):
        kv.trace.raise_deferred()


def test_a_keyboard_interrupt_from_a_subscriber_is_not_held():
    trace, seen = Trace(), []

    def interrupt(event):
        raise KeyboardInterrupt

    trace.subscribe(interrupt)
    trace.subscribe(seen.append)
    with pytest.raises(KeyboardInterrupt):
        trace.emit("allocate", [1], ["a"])
    assert seen == [] and trace.held_error is None


def test_warnings_turned_into_errors_do_not_cut_an_operation_short():
    kv = KVCacheManager(4, 2)
    kv.trace.subscribe(Drawing("allocate"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kv.add_sequence("a", [1, 2, 3])  # the warning would raise: it is dropped instead
    assert kv.block_table("a") == [0, 1]
    with pytest.raises(ValueError, match="drawing bug"):
        kv.mark_step()


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
    with pytest.raises(TraceFileError, match=r"event 0 \(teleport\): a replay knows the kinds"):
        PoolReplay(2).apply(Event(0, "teleport", (0,), ("a",)))
    with pytest.raises(TraceFileError, match="num_blocks"):
        EventLog().replay()


# --- trace files from someone else (trace/file.py, trace/checks.py) ----------------------------
def session() -> str:
    """A small recorded session (a fork, swaps, a copy-on-write, cached blocks), as JSON."""
    kv = KVCacheManager(6, 2, enable_prefix_caching=True, num_cpu_blocks=4)
    log = kv.record()
    kv.add_sequence("a", [1, 2, 3])  # 0 allocate [0, 1], 1 cache_store
    kv.mark_step(step=1)  # 2
    kv.fork("a", "b")  # 3 incref
    kv.swap_out(["a", "b"])  # 4, 5 swap_out
    kv.swap_in(["a", "b"])  # 6, 7 swap_in [2, 3]
    kv.append_token("b", 4)  # 8 cow_copy (3, 4), 9 cache_store
    kv.free_sequence("b")  # 10 free [4, 2]
    kv.mark_step(step=2)  # 11
    return log.to_json()


def edited(edit) -> str:
    data = json.loads(session())
    edit(data)
    return json.dumps(data)


def test_the_issues_negative_block_id_is_refused_and_changes_nothing():
    # Before: refcount of block 3 (= -1 of 4) went up and the table held -1.
    text = json.dumps(
        {
            "meta": {"num_blocks": 4, "block_size": 2},
            "events": [{"index": 0, "kind": "allocate", "blocks": [-1], "seqs": ["a"]}],
        }
    )
    with pytest.raises(TraceFileError, match=r"^event 0 \(allocate\): blocks\[0\] is -1"):
        EventLog.from_json(text)
    replay = PoolReplay(4)
    with pytest.raises(TraceFileError, match=r"event 0 \(allocate\): blocks\[0\] is -1"):
        replay.apply(Event(0, "allocate", (-1,), ("a",)))
    assert replay.refcounts == [0, 0, 0, 0] and replay.tables == {}


def set_(path, value):
    def edit(data):
        *where, last = path
        node = data
        for key in where:
            node = node[key]
        if value is DROP:
            del node[last]
        else:
            node[last] = value

    return edit


DROP = object()


@pytest.mark.parametrize(
    "edit, message",
    [
        (set_(["events", 3, "seqs"], DROP), r"^events\[3\] \(incref\): has no 'seqs'"),
        (set_(["events", 3, "kind"], "teleport"), r"^events\[3\] \(teleport\): kind 'teleport'"),
        (set_(["events", 0, "blocks"], "x"), r"^events\[0\] \(allocate\): blocks is 'x', not a"),
        (set_(["events", 0, "blocks", 1], 2.0), r"blocks\[1\] is 2.0, not a block id"),
        (set_(["events", 0, "blocks", 1], 6), r"blocks\[1\] is 6, not a block id of this pool"),
        (set_(["events", 10, "seqs", 0], None), r"^events\[10\] \(free\): seqs\[0\] is None: an"),
        (set_(["events", 4, "info"], DROP), r"^event 4 \(swap_out\): info.cpu_blocks is miss"),
        (set_(["events", 4, "info", "cpu_blocks", 0], 4), r"cpu_blocks\[0\] is 4, not a CPU block"),
        (set_(["events", 5, "index"], 7), r"^events\[5\] \(swap_out\): index is 7, expected 5"),
        (set_(["events", 3, "seqs", 1], "a"), r"^event 3 \(incref\): forks sequence 'a' into it"),
        (set_(["events", 11, "info", "new_tokens"], [["zz", 0, []]]), r"tokens of sequence 'zz'"),
        (set_(["events", 11, "info", "num_tokens"], {}), r"info.num_tokens is an object"),
        (set_(["meta", "num_blocks"], 10**12), r"^meta: num_blocks is 1000000000000, above the"),
        (set_(["meta", "num_blocks"], True), r"^meta: num_blocks is True, not an int"),
        (set_(["meta", "block_size"], DROP), r"^meta: block_size is missing"),
        (set_(["meta"], DROP), r"^a trace is an object"),
        (set_(["events"], {"0": {}}), r"^events is an object with 1 keys, not a list"),
    ],
)  # fmt: skip
def test_a_malformed_file_names_its_first_bad_event(edit, message):
    with pytest.raises(TraceFileError, match=message):
        EventLog.from_json(edited(edit))


def double_free(data):  # event 10 twice, numbered as the 11th
    data["events"].insert(11, {**data["events"][10], "index": 11})
    data["events"][12]["index"] = 12


@pytest.mark.parametrize(
    "edit, message",
    [
        (double_free, r"^event 11 \(free\): frees sequence 'b', which is not in the pool"),
        (set_(["events", 3, "seqs", 0], "zz"), r"^event 3 \(incref\): forks sequence 'zz', which"),
        (set_(["events", 6, "blocks", 0], 3), r"^event 6 \(swap_in\): names a block twice"),
        (set_(["events", 6, "seqs", 0], "zz"), r"^event 6 \(swap_in\): swaps in sequence 'zz'"),
        (set_(["events", 7, "info", "cpu_blocks", 0], 3), r"^event 7 \(swap_in\): swaps in seq"),
        (set_(["events", 8, "blocks", 1], 2), r"^event 8 \(cow_copy\): takes block 2, which is in"),
        (set_(["events", 8, "blocks", 0], 2), r"^event 8 \(cow_copy\): copies block 2, which is"),
        (set_(["events", 10, "blocks"], [4]), r"^event 10 \(free\): names blocks \[4\], not the"),
        (set_(["events", 11, "info", "num_tokens", 0, 1], 4), r"^event 11 \(step\): says seq"),
        (set_(["events", 11, "info", "new_tokens"], [["a", 9, [5]]]), r"holds only 3 of them"),
        (set_(["events", 0, "kind"], "free"), r"^event 0 \(free\): frees sequence 'a', which is"),
    ],
)  # fmt: skip
def test_a_file_that_does_not_fit_its_pool_names_the_event_at_load(edit, message):
    with pytest.raises(TraceFileError, match=message):
        EventLog.from_json(edited(edit))


def test_recorded_files_load_as_they_were_written():
    text = session()
    assert EventLog.from_json(text).to_json() == text
    assert EventLog.from_json(text.encode()).events == EventLog.from_json(text).events  # bytes
    with pytest.raises(TraceFileError, match="got NoneType"):
        EventLog.from_json(None)
    with pytest.raises(TraceFileError, match="not valid JSON"):
        EventLog.from_json(text[:-2])


def test_a_recording_begun_after_an_earlier_run_evicts_what_that_run_cached():
    kv = KVCacheManager(4, 2, enable_prefix_caching=True)
    kv.add_sequence("old", [1, 2, 3, 4])
    kv.free_sequence("old")  # its two full blocks stay cached
    log = kv.record()
    kv.add_sequence("new", [5, 6, 7, 8, 9, 10, 11, 12])  # takes all four blocks: evicts two
    assert [e.kind for e in log.events].count("evict") == 2
    replay = EventLog.from_json(log.to_json()).replay()
    assert replay.tables == {"new": kv.block_table("new")} and replay.refcounts == [1] * 4


def test_the_caps_are_read_at_each_load(monkeypatch):
    import pagedlearn.trace.limits as limits

    text = session()
    monkeypatch.setattr(limits, "MAX_NUM_BLOCKS", 5)
    with pytest.raises(TraceFileError, match="num_blocks is 6, above the cap MAX_NUM_BLOCKS = 5"):
        EventLog.from_json(text)
    monkeypatch.setattr(limits, "MAX_NUM_BLOCKS", 6)
    monkeypatch.setattr(limits, "MAX_FRAME_CELLS", 12)  # two frames of 6 blocks, and more
    with pytest.raises(TraceFileError, match=r"event 11 \(step\): drawing every step up to"):
        EventLog.from_json(text)
    monkeypatch.setattr(limits, "MAX_FRAME_CELLS", 2**21)
    monkeypatch.setattr(limits, "MAX_EVENTS", 10)
    with pytest.raises(TraceFileError, match="12 events, above the cap MAX_EVENTS = 10"):
        EventLog.from_json(text)
    monkeypatch.setattr(limits, "MAX_TRACE_CHARS", 100)
    with pytest.raises(TraceFileError, match="above the cap MAX_TRACE_CHARS = 100"):
        EventLog.from_json(text)
