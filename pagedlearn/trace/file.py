"""Reading a trace file you did not write: sizes and types, checked before anything is built.

A trace file is data from someone else -- a classmate, an instructor, a web page -- so
:meth:`~pagedlearn.trace.events.EventLog.from_json` checks it in three layers and raises
:class:`~pagedlearn.errors.TraceFileError` naming the first event that breaks a rule
(``events[12] (free): ...``: the 13th entry of the file's list; ``event 12 (free): ...`` once it
replays, by the event's own index):

1. **Sizes** (:mod:`pagedlearn.trace.limits`, which a course can raise): the text, the number
   of events, the pool (``num_blocks``, ``block_size``), ids, strings and token lists stay under
   caps, so that a ten-line file cannot ask for a pool of 10**12 blocks. Nothing is allocated in
   proportion to a number read from the file before that number passed its cap.
2. **Types** (here): the top level is ``{"meta": {...}, "events": [...]}``; each event has an
   ``index`` (one more than the event before it), a known ``kind`` (:data:`SHAPES`; what each
   means: the table in :mod:`pagedlearn.trace.events`), a list of ``blocks``, a list of ``seqs``
   (ints or strings), and ``info`` fields of the types that the replay and the pictures read.
3. **Meaning** (:mod:`pagedlearn.trace.checks`, the checks every replay makes, of a file or of
   events in memory): replayed once at load, every event must fit the pool as it stands -- as
   many blocks and sequences as its kind takes, block ids in the pool, sequences known, no
   refcount below zero. What the replay builds stays in proportion to the file: no table is
   longer than a sequence of ``MAX_SEQ_TOKENS`` tokens fills, the null entries (-1) it builds
   that the file does not list (a ``cache_hit``'s ``info.skipped``, copied by forks)
   stay under a budget that grows with the text (``NULL_ENTRIES_FLOOR`` +
   ``NULL_ENTRIES_PER_CHAR`` a character), and the frames a viewer builds stay under
   ``MAX_FRAME_CELLS`` and ``MAX_FRAME_SLOTS``.

So loading a file takes time and memory in proportion to its size (json.loads itself takes up to
~20 times the text), or to a cap a course raised; a refused file leaves nothing behind.

A trace recorded in this process (``kv.record()``) is built by the manager and skips layers 1-2.

>>> from pagedlearn.trace.events import EventLog
>>> text = ('{"meta": {"num_blocks": 4, "block_size": 2}, "events": [{"index": 0, '
...         '"kind": "allocate", "blocks": [-1], "seqs": ["a"]}]}')
>>> try:
...     EventLog.from_json(text)
... except TraceFileError as e:
...     print(e)
event 0 (allocate): blocks[0] is -1, not a block id of this pool (0..3)
"""

from __future__ import annotations

import json
import math

from pagedlearn.errors import TraceFileError
from pagedlearn.trace import limits as trace_limits
from pagedlearn.trace.limits import (
    MAX_INT,
    Problem,
    above_cap,
    check_hashable,
    check_int,
    check_list,
    check_name,
    check_string,
    check_tokens,
    kind_text,
    show,
)

# kind -> (how many blocks, how many sequences) it takes; None: any number (trace/checks.py).
SHAPES = {
    "allocate": (None, 1),
    "cache_hit": (None, 1),
    "incref": (None, 2),
    "cow_copy": (2, 1),
    "free": (None, 1),
    "window_free": (None, 1),
    "cache_store": (1, 1),
    "evict": (1, 1),
    "swap_out": (None, 1),
    "swap_in": (None, 1),
    "preempt": (0, None),
    "step": (0, 0),
    "cache_reset": (None, 0),
}
# The events a viewer draws a frame at (viz/state.py): each step, and each prefix-cache reset.
FRAME_KINDS = ("step", "cache_reset")
# What the stats line and the timeline read from a step's ``info["stats"]`` (when it has any).
STATS_SHOWN = (
    "num_running",
    "num_waiting",
    "num_swapped",
    "preemptions_recompute",
    "preemptions_swap",
    "cow_copies",
    "prefix_hit_rate",
)


def parse_trace(text: str | bytes) -> tuple[dict, list[tuple]]:
    """Parse and check a trace file's text; returns its ``meta`` and, per event, the fields of
    an :class:`~pagedlearn.trace.events.Event` ``(index, kind, blocks, seqs, info)``."""
    if not isinstance(text, (str, bytes, bytearray)):
        raise TraceFileError(f"a trace is JSON text (str or bytes), got {type(text).__name__}")
    if len(text) > trace_limits.MAX_TRACE_CHARS:
        raise TraceFileError(above_cap(f"the trace is {len(text)} characters", "MAX_TRACE_CHARS"))
    try:
        data = json.loads(text)
    except RecursionError:
        raise TraceFileError("the trace is not a trace: its JSON is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, a bad UTF-8 byte, an int of > 4300 digits
        raise TraceFileError(f"the trace is not valid JSON: {e}") from None
    if type(data) is not dict or "events" not in data or "meta" not in data:
        raise TraceFileError(
            f'a trace is an object {{"meta": {{...}}, "events": [...]}} (EventLog.to_json), '
            f"got {show(data)}"
        )
    meta, events = data["meta"], data["events"]
    try:
        _check_meta(meta)
    except Problem as e:
        raise TraceFileError(f"meta: {e}") from None
    if type(events) is not list:
        raise TraceFileError(f"events is {show(events)}, not a list of events")
    if len(events) > trace_limits.MAX_EVENTS:
        raise TraceFileError(above_cap(f"the trace has {len(events)} events", "MAX_EVENTS"))
    fields, expected = [], None
    for pos, d in enumerate(events):
        try:
            fields.append(_event_fields(d, expected, meta))
        except Problem as e:
            kind = d.get("kind") if type(d) is dict else None
            raise TraceFileError(f"events[{pos}] ({kind_text(kind)}): {e}") from None
        expected = fields[-1][0] + 1
    return meta, fields


def _check_meta(meta) -> None:
    if type(meta) is not dict:
        raise Problem(f"is {show(meta)}, not an object")
    for key, cap in (("num_blocks", "MAX_NUM_BLOCKS"), ("block_size", "MAX_BLOCK_SIZE")):
        if key not in meta:
            raise Problem(f"{key} is missing (kv.record() and engine.record() write it)")
        check_int(meta[key], key, 1, cap)
    if "num_cpu_blocks" in meta:
        check_int(meta["num_cpu_blocks"], "num_cpu_blocks", 0, "MAX_NUM_BLOCKS")
    if "kv_groups" in meta:  # a hybrid model's KV-cache groups (kv_cache_coordinator.py)
        for i, name in enumerate(check_list(meta["kv_groups"], "kv_groups")):
            check_string(name, f"kv_groups[{i}]")


def _event_fields(d, expected: int | None, meta: dict) -> tuple:
    if type(d) is not dict:
        raise Problem(f"is {show(d)}, not an object")
    for key in ("index", "kind", "blocks", "seqs"):
        if key not in d:
            raise Problem(f"has no {key!r}")
    kind, info = d["kind"], d.get("info", {})
    if type(kind) is not str or kind not in SHAPES:
        raise Problem(f"kind {show(kind)} is not one of {', '.join(SHAPES)}")
    index = check_int(d["index"], "index")
    if expected is not None and index != expected:
        raise Problem(
            f"index is {index}, expected {expected}: events are missing, repeated or moved"
        )
    if type(info) is not dict:
        raise Problem(f"info is {show(info)}, not an object")
    if kind == "free" and type(info.get("cpu", False)) is not bool:
        raise Problem(f"info.cpu is {show(info['cpu'])}, not true or false")
    blocks, seqs = check_list(d["blocks"], "blocks"), d["seqs"]  # ids in the pool: the replay
    if type(seqs) is not list:
        raise Problem(f"seqs is {show(seqs)}, not a list of sequence ids")
    for i, s in enumerate(seqs):
        check_name(s, f"seqs[{i}]")
    if kind == "window_free":
        check_int(info.get("first"), "info.first")
    elif kind == "cache_hit" and "skipped" in info:
        check_int(info["skipped"], "info.skipped")
    elif kind == "incref" and "prefix" in info:
        check_int(info["prefix"], "info.prefix")
    if kind == "cache_store":
        check_string(info.get("hash"), "info.hash")
        if "parent" in info:  # the hash it chains on (newer traces)
            check_string(info["parent"], "info.parent")
        if "tokens" in info:
            check_tokens(info["tokens"], "info.tokens", meta["block_size"])
    elif kind == "evict" and "hash" in info:
        check_string(info["hash"], "info.hash")
    elif kind == "preempt" and "mode" in info:
        check_string(info["mode"], "info.mode")
    elif kind == "step":
        _check_step_info(info)
    return index, kind, tuple(blocks), tuple(seqs), info


def _check_step_info(info: dict) -> None:
    """A frame: token counts and new tokens (the replay), the requests and stats (the views)."""
    check_token_lists(info)
    if info.get("step") is not None:
        check_int(info["step"], "info.step")
    elif "requests" in info:  # engine.queue_changes reads the step of every such frame
        raise Problem("info.step is missing: a frame that lists requests needs its step number")
    for i, r in enumerate(check_list(info.get("requests", []), "info.requests")):
        what = f"info.requests[{i}]"
        _fields(r, what, ("id", "status", "seqs"))
        check_name(r["id"], f"{what}.id")
        check_string(r["status"], f"{what}.status")
        for j, s in enumerate(check_list(r["seqs"], f"{what}.seqs")):
            check_name(s, f"{what}.seqs[{j}]")
    for i, f in enumerate(check_list(info.get("finished", []), "info.finished")):
        what = f"info.finished[{i}]"
        _fields(f, what, ("id",))
        check_name(f["id"], f"{what}.id")
        if f.get("reason") is not None:
            check_string(f["reason"], f"{what}.reason")
    stats = info.get("stats", {})
    if type(stats) is not dict:
        raise Problem(f"info.stats is {show(stats)}, not an object")
    for key, value in stats.items():
        # A number, or (group_blocks: per KV-cache group) an object of numbers.
        for k, v in value.items() if type(value) is dict else [(None, value)]:
            if type(v) not in (int, float) or not math.isfinite(v) or abs(v) > MAX_INT:
                where = show(key) if k is None else f"{show(key)}][{show(k)}"
                raise Problem(f"info.stats[{where}] is {show(v)}, not a number")
    missing = [key for key in STATS_SHOWN if key not in stats]
    if stats and missing:
        raise Problem(f"info.stats has no {', '.join(missing)} (the stats line shows them)")


def check_token_lists(info: dict, in_file: bool = True) -> None:
    """What a replay reads from a step: ``num_tokens`` (``[sequence, count]`` each, every
    sequence once) and ``new_tokens`` (``[sequence, position, tokens]``, listed sequences only).
    ``in_file``: sequence ids are ints or strings (in memory, any hashable will do)."""
    ident = check_name if in_file else check_hashable
    counts, new = info.get("num_tokens"), info.get("new_tokens")
    listed = set()
    for i, entry in enumerate(check_list(counts, "info.num_tokens")):
        if type(entry) is not list or len(entry) != 2:
            raise Problem(f"info.num_tokens[{i}] is {show(entry)}, not [sequence, count]")
        s = ident(entry[0], f"info.num_tokens[{i}][0]")
        check_int(entry[1], f"info.num_tokens[{i}][1]", 0, "MAX_SEQ_TOKENS")
        if s in listed:
            raise Problem(f"info.num_tokens lists sequence {s!r} twice")
        listed.add(s)
    sent = set()
    for i, entry in enumerate(check_list(new, "info.new_tokens")):
        if type(entry) is not list or len(entry) != 3:
            raise Problem(
                f"info.new_tokens[{i}] is {show(entry)}, not [sequence, position, tokens]"
            )
        s = ident(entry[0], f"info.new_tokens[{i}][0]")
        if s not in listed or s in sent:
            why = "twice" if s in sent else "but info.num_tokens does not list it"
            raise Problem(f"info.new_tokens[{i}] sends tokens of sequence {s!r} {why}")
        sent.add(s)
        start = check_int(entry[1], f"info.new_tokens[{i}][1]", 0, "MAX_SEQ_TOKENS")
        check_tokens(entry[2], f"info.new_tokens[{i}][2]", trace_limits.MAX_SEQ_TOKENS - start)


def _fields(d, what: str, required: tuple[str, ...]) -> None:
    """An object with the ``required`` keys; its counts, where present, are ints >= 0."""
    if type(d) is not dict:
        raise Problem(f"{what} is {show(d)}, not an object")
    for key in required:
        if key not in d:
            raise Problem(f"{what} has no {key!r}")
    for key in ("prompt_tokens", "output_tokens"):
        if key in d:
            check_int(d[key], f"{what}.{key}")
