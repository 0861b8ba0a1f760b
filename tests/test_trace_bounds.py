"""Loading a trace file costs work in proportion to its size (issue 32: hostile input).

The caps in trace/limits.py bound every number a file states, but a replay also builds what no
number states: a table's null entries (-1), made by one ``cache_hit``'s ``info.skipped`` and, in
the code as it was, copied or scanned whole by every fork, swap, free and window free -- a
157-byte file raised a bare MemoryError, an 83 KB one took 5.6 GB, a 37 KB one an estimated 60
hours. Each row of the issue is a test below, its file built as the issue describes it (its size
to the byte), and a hypothesis test throws files of that family at ``EventLog.from_json`` and
measures the work per byte: peak traced memory and process time.

The bounds are generous on purpose: they separate "a small multiple of the file" from "gigabytes
and hours", not a fast machine from a slow one (this one is shared; the old code missed them by
orders of magnitude). Work is measured with tracemalloc (Python's allocations) and
``time.process_time`` (CPU time, so waiting for a shared core does not count).
"""

from __future__ import annotations

import json
import re
import time
import tracemalloc

import pytest

pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedlearn.errors import TraceFileError
from pagedlearn.trace import limits
from pagedlearn.trace.events import EventLog

# Bytes a loaded file may take per character of its text: json.loads and the Event records
# (a few per character), with room to spare, plus the 8-byte list slot of each null entry the
# budget allows a character.
BYTES_PER_CHAR = 32 + 8 * limits.NULL_ENTRIES_PER_CHAR
# CPU seconds per character. The old code spent 0.6 s on one 91-byte event (about 6,600 us a
# character: 60 hours for a 32 MiB file); the bound is "not hours", with room for a slow, shared
# machine, not a benchmark.
SECONDS_PER_CHAR = 20e-6


def allowed_bytes(text: str) -> int:
    """What loading ``text`` may allocate at most: a small multiple of it, plus the null entries
    the floor of the budget allows any file (8 bytes each) and a MiB for the replay itself."""
    return BYTES_PER_CHAR * len(text) + 8 * limits.NULL_ENTRIES_FLOOR + 2**20


def allowed_seconds(text: str) -> float:
    return 0.5 + SECONDS_PER_CHAR * len(text)


def ev(index: int, kind: str, blocks=(), seqs=("a",), **info) -> dict:
    return {"index": index, "kind": kind, "blocks": list(blocks), "seqs": list(seqs), "info": info}


def trace(events: list[dict], block_size: int = 16, **meta) -> str:
    meta = {"num_blocks": 4, "block_size": block_size, **meta}
    return json.dumps({"meta": meta, "events": events})


def load(text: str) -> tuple[TraceFileError | None, int, float]:
    """``EventLog.from_json(text)``: the TraceFileError it raised (or None), the peak of memory
    it allocated, and the CPU time it took. Any other exception fails the test."""
    error = None
    tracemalloc.start()
    start = time.process_time()
    try:
        EventLog.from_json(text)
    except TraceFileError as e:
        error = e
    finally:
        seconds = time.process_time() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return error, peak, seconds


def assert_bounded(text: str, peak: int, seconds: float) -> None:
    bytes_ok, seconds_ok = peak <= allowed_bytes(text), seconds <= allowed_seconds(text)
    assert bytes_ok and seconds_ok, (
        f"{peak / 2**20:.1f} MiB (allowed {allowed_bytes(text) / 2**20:.1f}) and {seconds:.2f} s "
        f"(allowed {allowed_seconds(text):.2f}) for {len(text)} characters"
    )


def refused(text: str, event: str, why: str) -> None:
    """Loading ``text`` raises a TraceFileError that names ``event`` and says ``why``, with
    bounded work."""
    error, peak, seconds = load(text)
    assert error is not None, "the file loaded"
    assert str(error).startswith(f"{event}: "), str(error)
    assert re.search(why, str(error)), str(error)
    assert_bounded(text, peak, seconds)


# --- the rows, at their sizes ------------------------------------------------------------
TOO_LONG = r"more than a sequence of MAX_SEQ_TOKENS = \d+ tokens fills .*raise pagedlearn"
OVER_BUDGET = r"above the budget NULL_ENTRIES_FLOOR \+ NULL_ENTRIES_PER_CHAR .*\(raise pagedlearn"


def test_a_skip_of_10_to_the_12_entries_is_a_trace_file_error_not_a_memory_error():
    text = trace([ev(0, "cache_hit", skipped=10**12)])
    assert len(text) == 157
    refused(text, "event 0 (cache_hit)", TOO_LONG)


def test_a_skip_of_half_a_billion_entries_is_refused_at_once():
    text = trace([ev(0, "cache_hit", skipped=5 * 10**8)])
    assert len(text) == 153  # was 3.9 GB and 19.5 s, then a MemoryError
    refused(text, "event 0 (cache_hit)", TOO_LONG)


def test_fifty_skips_of_twenty_million_entries_are_refused_at_the_first():
    text = trace([ev(i, "cache_hit", seqs=[f"s{i}"], skipped=2 * 10**7) for i in range(50)])
    assert 4900 <= len(text) < 5000  # was 5.6 GB, then a MemoryError
    refused(text, "event 0 (cache_hit)", TOO_LONG)


def test_fifty_skips_each_as_long_as_a_table_may_be_exhaust_the_budget():
    """The same file with skips the length rule allows (a table of 2**20 tokens in blocks of
    16): together they pass the budget, at the event that does."""
    most = -(-limits.MAX_SEQ_TOKENS // 16)
    text = trace([ev(i, "cache_hit", seqs=[f"s{i}"], skipped=most) for i in range(50)])
    budget = limits.NULL_ENTRIES_FLOOR + limits.NULL_ENTRIES_PER_CHAR * len(text)
    first_over = budget // most  # events 0..first_over build (first_over + 1) * most nulls
    refused(text, f"event {first_over} (cache_hit)", OVER_BUDGET)


def forks_of_a_table_of_nulls(nulls: int, block_size: int) -> str:
    """A table of ``nulls`` nulls, then 1000 forks of it (``incref`` with empty ``blocks``)."""
    forks = [ev(i, "incref", seqs=["a", f"c{i}"]) for i in range(1, 1001)]
    return trace([ev(0, "cache_hit", skipped=nulls), *forks], block_size)


def test_a_thousand_forks_of_a_table_of_a_million_nulls_are_refused():
    text = forks_of_a_table_of_nulls(10**6, block_size=16)
    assert 82_000 < len(text) < 84_000  # was 5.6 GB, then a MemoryError
    refused(text, "event 0 (cache_hit)", TOO_LONG)


def test_forks_of_a_table_the_length_rule_allows_exhaust_the_budget():
    """Blocks of one token allow a table of a million entries; the first fork would copy them
    all, past the budget of an 83 KB file."""
    text = forks_of_a_table_of_nulls(10**6, block_size=1)
    refused(text, "event 1 (incref)", OVER_BUDGET)


def swaps_of_a_table_of_nulls(nulls: int, block_size: int) -> str:
    """A table of ``nulls`` nulls, swapped out and in 200 times with empty lists."""
    events = [ev(0, "cache_hit", skipped=nulls)]
    for i in range(1, 401):
        events.append(ev(i, "swap_out" if i % 2 else "swap_in", cpu_blocks=[]))
    return trace(events, block_size)


def test_swaps_of_a_table_of_ten_million_nulls_are_refused():
    text = swaps_of_a_table_of_nulls(10**7, block_size=16)
    assert 36_000 < len(text) < 38_000  # was 0.6 s an event: 60 hours for a 32 MiB file
    refused(text, "event 0 (cache_hit)", TOO_LONG)


def test_swaps_of_a_table_the_length_rule_allows_cost_what_they_list():
    """A table of 2**20 nulls (blocks of one token): a swap moves its list without reading the
    nulls, so the file loads, and 400 swaps cost little more than one."""
    nulls = -(-limits.MAX_SEQ_TOKENS // 1)
    text = swaps_of_a_table_of_nulls(nulls, block_size=1)
    error, peak, seconds = load(text)
    assert error is None
    assert_bounded(text, peak, seconds)
    log = EventLog.from_json(text)
    assert log.replay().tables == {"a": [-1] * nulls}  # back on the GPU, nulls and all


def test_window_frees_of_a_table_of_nulls_read_only_what_they_list():
    """``window_free`` checks that its entries follow the table's null head: found by binary
    search, not by reading a million nulls for each 90-byte event."""
    nulls = -(-limits.MAX_SEQ_TOKENS // 1)
    frees = [ev(i, "window_free", first=nulls) for i in range(1, 1001)]
    text = trace([ev(0, "cache_hit", skipped=nulls), *frees], block_size=1)
    error, peak, seconds = load(text)
    assert error is None
    assert_bounded(text, peak, seconds)


def test_a_course_can_raise_the_budget_and_the_length_rule(monkeypatch):
    text = forks_of_a_table_of_nulls(2000, block_size=16)  # 1000 forks copy two million nulls
    with pytest.raises(TraceFileError, match=OVER_BUDGET):
        EventLog.from_json(text)
    monkeypatch.setattr(limits, "NULL_ENTRIES_PER_CHAR", 16)  # what the message says to raise
    assert len(EventLog.from_json(text).replay().tables) == 1001
    longer = trace([ev(0, "cache_hit", skipped=2**17)], block_size=16)
    with pytest.raises(TraceFileError, match=TOO_LONG):
        EventLog.from_json(longer)
    monkeypatch.setattr(limits, "MAX_SEQ_TOKENS", 2**21)
    assert EventLog.from_json(longer).replay().tables["a"] == [-1] * 2**17


def test_skipped_means_nothing_on_an_allocate():
    """Only a cache_hit skips entries (the table in trace/events.py); an ``info.skipped`` on an
    allocate is ignored, whatever it holds, as any other unknown field is."""
    for skipped in (10**12, "x", 2.5):
        text = trace([ev(0, "allocate", blocks=[0], skipped=skipped)])
        assert EventLog.from_json(text).replay().tables == {"a": [0]}


# --- hypothesis: adversarial files of the same family, work per byte ----------------------------
OPS = ["fork", "swap", "window_free", "free", "hit", "step"]


@st.composite
def adversarial_files(draw) -> str:
    """Tables of nulls (a cache_hit that skips), then many cheap events that copy or read them:
    forks (``incref``), swaps out and in, window frees, frees (on the GPU or swapped out), more
    skipping hits, and steps (a frame each). Every event fits the pool as the replay holds it
    -- the costly files are the valid ones -- until the bounds refuse one."""
    block_size = draw(st.sampled_from([1, 2, 16]))
    most = -(-limits.MAX_SEQ_TOKENS // block_size)  # the longest table the rules allow
    sizes = st.one_of(st.integers(0, 64), st.integers(most // 2, most), st.just(most))
    gpu, events, n = {}, [], 0  # the sequences on the GPU -> their null entries

    def add(kind, seqs=(), **info):
        events.append(ev(len(events), kind, seqs=list(seqs), **info))

    for op in draw(st.lists(st.sampled_from(OPS), min_size=1, max_size=120)):
        if op == "hit" or (not gpu and op != "step"):
            n += 1
            gpu[f"s{n}"] = skipped = draw(sizes)
            add("cache_hit", [f"s{n}"], skipped=skipped)
            continue
        s = draw(st.sampled_from(sorted(gpu))) if gpu else None
        if op == "fork":
            n += 1
            gpu[f"s{n}"] = gpu[s]
            add("incref", [s, f"s{n}"])
        elif op == "swap":
            add("swap_out", [s], cpu_blocks=[])
            for _ in range(draw(st.integers(0, 40))):  # out and in again, and again
                add("swap_in", [s], cpu_blocks=[])
                add("swap_out", [s], cpu_blocks=[])
            del gpu[s]  # swapped out for good, or freed there
            if draw(st.booleans()):
                add("free", [s], cpu=True)
        elif op == "window_free":
            for _ in range(draw(st.integers(1, 40))):
                add("window_free", [s], first=gpu[s])
        elif op == "free":
            add("free", [s])
            del gpu[s]
        else:
            add("step", num_tokens=[], new_tokens=[])
    return trace(events, block_size, num_cpu_blocks=4)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(adversarial_files())
def test_an_adversarial_file_costs_a_bounded_amount_per_byte(text):
    error, peak, seconds = load(text)
    if error is not None:  # refused: it says which event, and why
        assert re.match(r"event \d+ \((cache_hit|incref|step)\): ", str(error)), str(error)
        assert re.search(f"{OVER_BUDGET}|MAX_FRAME_CELLS", str(error)), str(error)
    assert_bounded(text, peak, seconds)
