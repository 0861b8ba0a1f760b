"""Trace files from strangers: a corrupted recording fails with a TraceFileError, nothing else.

Two real recordings are the seeds: a KVCacheManager session driven by hand (forks, copy-on-write,
prefix caching, swaps, an abort while swapped out, a prefix-cache reset) and a tiny GPT-2 engine
run (parallel samples, beam search, swap preemption, an abort). Hypothesis corrupts their JSON
as a careless editor, a truncated download or a prankster would -- events deleted, repeated,
moved or renumbered, kinds changed, numbers made negative, huge, fractional, strings or null,
keys dropped, junk added, the text cut short -- and each result goes through everything a
student does with a file: load it, replay it, build every frame of the viewer, its panels, the
timeline and the queue history.

What must hold: the only exception is :class:`TraceFileError`; a file that loads is consistent
(every refcount equals the table entries that point at the block, every id is in its pool); no
example allocates more than 16 MiB, measured with tracemalloc (a file that asks for 10**12 blocks
is refused before any list of that size exists); and a replay that refuses an event has not
applied any of it.
"""

from __future__ import annotations

import copy
import functools
import json
import tracemalloc
from collections import Counter

import pytest

pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedlearn import KVCacheManager
from pagedlearn.engine.queue_changes import queue_changes
from pagedlearn.errors import TraceFileError
from pagedlearn.trace.events import Event, EventLog, PoolReplay
from pagedlearn.trace.file import SHAPES
from pagedlearn.viz.panels import RequestBook, inspect_block, stats_html
from pagedlearn.viz.state import replay_states
from pagedlearn.viz.timeline import timeline_rows

FUZZ = settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MAX_EXAMPLE_BYTES = 16 * 2**20  # using a seed as it was recorded takes < 1 MiB

# Values a corrupted field may take: wrong types, out-of-range and absurd sizes.
JUNK = [-1, -7, 2**31, 2**63, 10**12, 10**30, 0.5, 1e308, float("nan"), float("inf"), "x", "",
        "a.0", "7", None, True, False, [], {}, [1, 2], [-1], ["a"], {"k": 1}, [[]]]  # fmt: skip


@functools.cache
def seeds() -> tuple[str, ...]:
    """The JSON of the three real recordings."""
    kv = KVCacheManager(8, 2, enable_prefix_caching=True, num_cpu_blocks=6)
    log = kv.record()
    kv.add_sequence("a", [1, 2, 3])
    kv.add_sequence("b", [1, 2, 4])  # a prefix-cache hit
    kv.mark_step(step=1)
    kv.fork("a", "c")
    kv.append_token("c", 5)  # copy-on-write, then a full block is cached
    kv.pop_copies()  # as the engine does before it swaps
    kv.swap_out(["a"])
    kv.mark_step(step=2)
    kv.add_sequence("d", [7, 8, 9, 10, 11])  # evicts a cached block
    kv.swap_in(["a"])
    kv.swap_out(["c"])
    kv.free_sequence("c")  # aborted while swapped out: CPU blocks only
    kv.trace.emit("preempt", (), ("c",), mode="swap")
    kv.mark_step(step=3)
    kv.free_sequence("b")
    kv.mark_step(step=4)
    kv.free_sequence("a")
    kv.free_sequence("d")
    assert kv.reset_prefix_cache() > 0  # every cached block dropped: a frame of its own
    kv.add_sequence("e", [1, 2, 3])  # a miss: the cache is empty
    kv.mark_step(step=5)
    texts = log.to_json(), engine_run(), hybrid_run()
    for text in texts:  # they load, and every module the viewer needs is imported before the
        use(text)  # fuzzing measures memory
    return texts


def hybrid_run() -> str:
    """A full and a sliding group over one pool: window frees, a hit that skips, swaps."""
    from pagedlearn.hybrid.kv_cache_coordinator import KVCacheCoordinator
    from pagedlearn.hybrid.kv_cache_groups import group_layers

    kv = KVCacheCoordinator(group_layers([None, 4]), 16, 2, True, num_cpu_blocks=8)
    log = kv.record()
    kv.add_sequence("a", [1, 2, 3, 4, 5, 6, 7])
    kv.mark_step(step=1)
    assert kv.remove_skipped_blocks("a", 7) == 2  # query 7 sees 4..7: blocks 0 and 1 are dead
    kv.append_token("a", 8)
    # b's query 6 sees 3..6: the sliding group needs blocks 1 and 2 only (block 0 is skipped)
    assert kv.add_sequence("b", [1, 2, 3, 4, 5, 6, 9]) == 6
    kv.mark_step(step=2)
    kv.swap_out(["a"])
    kv.swap_in(["a"])
    kv.mark_step(step=3)
    kv.free_sequence("b")
    kv.mark_step(step=4)
    kv.check_invariants()
    return log.to_json()


def engine_run() -> str:
    from pagedlearn import LLM, BeamSearchParams, SamplingParams

    llm = LLM("tiny-gpt2", num_blocks=20, block_size=4, verbose=False, preemption_mode="swap")
    engine = llm.engine
    log = engine.record()
    sample = SamplingParams(max_tokens=12, n=3, seed=1, temperature=1.0, ignore_eos=True)
    engine.add_request("a", "Hello there, my friend", sample)
    engine.add_request("b", "Hello there, you", SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("c", "Hello there, you", BeamSearchParams(beam_width=3, max_tokens=6))
    engine.step()
    engine.abort_request("b")
    while engine.has_unfinished_requests():
        engine.step()
    return log.to_json()


# --- corrupting a trace --------------------------------------------------------------------------
def places(node) -> list[tuple]:
    """Every (container, key) inside ``node``, depth first."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        out.append((node, key))
        if isinstance(value, (dict, list)):
            out += places(value)
    return out


def values(draw, data, mild: bool = False) -> object:
    """A value for a corrupted field: junk, or (``mild``: only) one that fits its type."""
    meta = data.get("meta") if isinstance(data, dict) else None
    n = meta.get("num_blocks", 8) if isinstance(meta, dict) else 8
    n = n if isinstance(n, int) and 0 < n < 100 else 8
    fitting = [
        st.integers(0 if mild else -2, n - 1 if mild else n + 2),  # ids that (almost) fit
        st.sampled_from(["a", "b", "c", "d", "a.0", "a.1", "c.0", "c.2"]),  # known ids
    ]
    if mild:
        return draw(st.one_of(*fitting))
    return draw(st.one_of(st.sampled_from(JUNK), st.sampled_from([*SHAPES, "teleport"]), *fitting))


def corrupt_tree(draw, data, mild: bool = False) -> object:
    """One edit of the parsed JSON; returns the (possibly replaced) top level. ``mild``: edits
    of events only, with values of the right type (more of them load, or fail in the replay)."""
    events = data.get("events") if isinstance(data, dict) else None
    where = draw(
        st.sampled_from(
            ["event", "events"] if mild else ["event"] * 4 + ["events"] * 3 + ["meta", "top"]
        )
    )
    if where == "top":
        choice = draw(st.sampled_from(["replace", "drop_meta", "drop_events", "junk"]))
        if choice == "replace":
            return values(draw, data)
        if isinstance(data, dict):
            if choice == "drop_meta":
                data.pop("meta", None)
            elif choice == "drop_events":
                data.pop("events", None)
            else:
                data[draw(st.sampled_from(["meta", "events", "extra"]))] = values(draw, data)
        return data
    if where == "meta" and isinstance(data, dict) and isinstance(data.get("meta"), dict):
        meta = data["meta"]
        key = draw(st.sampled_from(["num_blocks", "block_size", "num_cpu_blocks", "other"]))
        if draw(st.booleans()):
            meta.pop(key, None)
        else:
            meta[key] = draw(st.one_of(st.sampled_from(JUNK), st.integers(-2, 40)))
        return data
    if not isinstance(events, list) or not events:
        return data
    i = draw(st.integers(0, len(events) - 1))
    if where == "events":  # whole events: delete, repeat, move, swap, change kind
        op = draw(st.sampled_from(["delete", "repeat", "move", "swap", "kind"]))
        j = draw(st.integers(0, len(events) - 1))
        if op == "delete":
            del events[i]
        elif op == "repeat":
            events.insert(j, copy.deepcopy(events[i]))
        elif op == "move":
            events.insert(j, events.pop(i))
        elif op == "swap":
            events[i], events[j] = events[j], events[i]
        elif isinstance(events[i], dict):
            events[i]["kind"] = draw(st.sampled_from([*SHAPES, "teleport", 3, None]))
        return data
    spots = places(events[i]) if isinstance(events[i], (dict, list)) else []
    if not spots:
        return data
    parent, key = draw(st.sampled_from(spots))
    op = draw(
        st.sampled_from(["replace"] if mild else ["replace", "replace", "drop", "repeat", "add"])
    )
    if op == "replace":
        parent[key] = values(draw, data, mild and not isinstance(parent[key], (dict, list)))
    elif op == "drop":
        del parent[key]
    elif op == "repeat" and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(parent[key]))
    elif isinstance(parent, dict):
        parent[draw(st.sampled_from(["junk", "cpu", "hash", "tokens", "mode"]))] = values(
            draw, data
        )
    return data


def renumber(data) -> None:
    """Make the indices count up again, so that the replay's own checks meet the edit."""
    events = data.get("events") if isinstance(data, dict) else None
    for i, e in enumerate(events if isinstance(events, list) else []):
        if isinstance(e, dict):
            e["index"] = i


@st.composite
def corrupted(draw, mild: bool = False) -> str:
    """A seed's JSON after 1-3 edits; the indices counted up again (mostly), so that the replay
    meets what the edits did; sometimes the text itself cut or broken (not ``mild``)."""
    text = draw(st.sampled_from(seeds()))
    data = json.loads(text)
    for _ in range(draw(st.integers(1, 1 if mild else 3))):
        data = corrupt_tree(draw, data, mild)
    if mild or draw(st.integers(0, 3)):
        renumber(data)
    text = json.dumps(data)
    cut = "none" if mild else draw(st.sampled_from(["none"] * 12 + ["truncate", "digits", "byte"]))
    if cut == "truncate":
        text = text[: draw(st.integers(0, len(text)))]
    elif cut == "digits":  # an int longer than Python parses (4300 digits)
        text = text.replace("0", "1" + "0" * 5000, 1)
    elif cut == "byte":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(["{", "]", '"', ",", "\\", "\x00"])) + text[at:]
    return text


# --- what a student does with a file -------------------------------------------------------------
def use(text: str) -> None:
    """Load, replay, build every frame and the text the viewer shows beside it (the widget
    itself, slower to build, has a test of its own below)."""
    log = EventLog.from_json(text)
    assert_consistent(log.replay(), log.meta)
    frames = replay_states(log)
    book = RequestBook()
    for _, state in frames:
        book.update(state)
        stats_html(state)
        for b in {0, state.num_blocks - 1}:
            inspect_block(state, b)
    if frames:
        timeline_rows(log)
    queue_changes(log)
    assert EventLog.from_json(log.to_json()).events == log.events  # it saves and loads again


def assert_consistent(replay: PoolReplay, meta: dict) -> None:
    """What a loaded trace guarantees: refcounts match the tables, every id is in its pool, and
    a sliding window's null entries (-1, no block) only ever form a table's head."""
    held = Counter(b for table in replay.tables.values() for b in table)
    assert replay.refcounts == [held[b] for b in range(meta["num_blocks"])]
    cpu = meta.get("num_cpu_blocks")
    for table in [*replay.tables.values(), *replay.swapped.values()]:
        live = [b for b in table if b != -1]
        assert table == [-1] * (len(table) - len(live)) + live
    for table in replay.swapped.values():
        live = [c for c in table if c != -1]
        assert all(0 <= c < cpu for c in live) if cpu is not None else True


@FUZZ
@given(corrupted())
def test_a_corrupted_trace_raises_a_trace_file_error_and_nothing_else(text):
    tracemalloc.start()
    try:
        use(text)
    except TraceFileError as e:
        assert str(e)  # says what is wrong
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < MAX_EXAMPLE_BYTES, f"one example allocated {peak / 2**20:.0f} MiB"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corrupted(mild=True), st.data())
def test_the_replay_view_opens_a_corrupted_trace_or_raises_a_trace_file_error(text, data):
    from pagedlearn.viz import ReplayView

    try:
        frames = replay_states(EventLog.from_json(text))
    except TraceFileError:
        return
    if not frames:  # nothing to draw: the view says so (a ValueError of its own)
        return
    view = ReplayView(text)  # the JSON text, as a lab passes it: every frame, colours, panels
    view.show(data.draw(st.integers(0, view.num_frames - 1)))
    view.inspect(data.draw(st.integers(0, view.state.num_blocks - 1)))


def test_every_kind_of_event_is_in_the_seeds():
    kinds = [{e.kind for e in EventLog.from_json(text).events} for text in seeds()]
    assert set.union(*kinds) == set(SHAPES)  # so that the fuzzing reaches every rule
    assert all("step" in k for k in kinds)


def test_real_recordings_build_far_fewer_nulls_than_the_budget_allows():
    """The null-entry budget (trace/limits.py) refuses files that build nulls out of proportion
    to their text; the seeds -- a sliding-window run among them, skipping, window-freeing and
    swapping -- build a hundredth of what it allows a character, or less."""
    from pagedlearn.trace import limits
    from pagedlearn.trace.checks import nulls_built

    built = []
    for text in seeds():
        log = EventLog.from_json(text)
        replay, nulls = PoolReplay(log.meta["num_blocks"], log.meta.get("num_cpu_blocks")), 0
        for e in log.events:
            nulls += nulls_built(replay, e)
            replay.apply(e)
        assert nulls <= limits.NULL_ENTRIES_PER_CHAR * len(text) / 100
        built.append(nulls)
    assert any(built)  # the hybrid seed skips entries: the count is not vacuous


@pytest.mark.parametrize(
    "meta",
    [
        {"num_blocks": 10**12, "block_size": 16},
        {"num_blocks": 4, "block_size": 16, "num_cpu_blocks": 10**12},
        {"num_blocks": 2**40, "block_size": 2**40},
    ],
)
def test_a_huge_pool_is_refused_before_anything_of_its_size_exists(meta):
    text = json.dumps({"meta": meta, "events": [{"index": 0, "kind": "step", "blocks": [],
                       "seqs": [], "info": {"num_tokens": [], "new_tokens": []}}]})  # fmt: skip
    tracemalloc.start()
    try:
        with pytest.raises(TraceFileError, match="above the cap MAX_"):
            EventLog.from_json(text)
        with pytest.raises(TraceFileError, match="above the cap MAX_NUM_BLOCKS"):
            PoolReplay(10**12)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 2**20


@st.composite
def replay_and_a_bad_event(draw):
    """A replay part-way through a seed, and the next event with one field corrupted."""
    log = EventLog.from_json(draw(st.sampled_from(seeds())))
    k = draw(st.integers(0, len(log.events) - 1))
    replay = log.replay(upto=k)
    e = log.events[k]
    field = draw(st.sampled_from(["blocks", "seqs", "kind", "info"]))
    if field == "blocks":
        new = draw(st.lists(st.integers(-2, 25), max_size=6))
        e = Event(e.index, e.kind, tuple(new), e.seqs, e.info)
    elif field == "seqs":
        new = draw(st.lists(st.sampled_from(["a", "b", "c", "zz", "a.0", "c.1"]), max_size=3))
        e = Event(e.index, e.kind, e.blocks, tuple(new), e.info)
    elif field == "kind":
        e = Event(e.index, draw(st.sampled_from([*SHAPES, "teleport"])), e.blocks, e.seqs, e.info)
    else:
        info = json.loads(json.dumps(e.info))
        key = draw(st.sampled_from(["cpu", "cpu_blocks", "hash", "num_tokens", "new_tokens"]))
        info[key] = draw(st.sampled_from([True, [], [0], [99], [["zz", 0]], [["a", 50, [1]]]]))
        e = Event(e.index, e.kind, e.blocks, e.seqs, info)
    return replay, e


def snapshot(replay: PoolReplay):
    fields = ("refcounts", "tables", "swapped", "cached", "cached_tokens", "tokens", "step_info")
    return copy.deepcopy({f: getattr(replay, f) for f in fields})


@FUZZ
@given(replay_and_a_bad_event())
def test_a_refused_event_leaves_the_replay_as_it_was(case):
    replay, event = case
    before = snapshot(replay)
    try:
        replay.apply(event)
    except TraceFileError as e:
        assert str(e).startswith(f"event {event.index} (")  # names the event
        assert snapshot(replay) == before
    else:  # accepted: the pool is still consistent
        held = Counter(b for table in replay.tables.values() for b in table)
        assert replay.refcounts == [held[b] for b in range(len(replay.refcounts))]
