"""The caps a trace file must stay under, and the checks of one value that name what is wrong.

Layer 1 of reading a file (:mod:`pagedlearn.trace.file` has the whole picture): every number read
from a file is checked against its cap before anything is built in proportion to it, so that a
ten-line file cannot ask for a pool of 10**12 blocks. The caps are generous for a course, whose
recordings draw pools of tens of blocks: at the frame cap (2 million cells: say a pool of 1,000
blocks, half of them in use, drawn over 1,000 steps) ``replay_states`` holds about 0.6 GiB of
frames (~300 bytes a cell, measured with tracemalloc). They are read at each load, so a course
with bigger runs can raise them::

    import pagedlearn.trace.limits
    pagedlearn.trace.limits.MAX_FRAME_CELLS = 2**23

The caps on single numbers do not bound everything a replay builds: a table's null entries (-1,
blocks a sliding window no longer needs) are made from one number, a ``cache_hit``'s
``info.skipped``, and copied by each fork (``incref``), although the file lists none of them. So
a replay of a file (``check_replay`` in trace/checks.py) also keeps to two rules:

- a table holds at most as many entries as a sequence of ``MAX_SEQ_TOKENS`` tokens fills
  (``ceil(MAX_SEQ_TOKENS / block_size)``), so ``skipped = 10**12`` is refused at once;
- the null entries it builds, summed over the file, stay under a budget that grows with the
  file: ``NULL_ENTRIES_FLOOR + NULL_ENTRIES_PER_CHAR * len(text)``. A null entry costs 8 bytes
  (a list slot) and a few nanoseconds: at the defaults a file builds at most 8 MiB of them plus
  8 bytes a character of its text, less than ``json.loads`` takes for the text itself. Real
  recordings, a sliding-window model's included, stay far below it (tests/test_trace_fuzz.py
  checks that the seeds build under a hundredth of it).

Everything else a replay does costs what the event lists (its blocks, sequences and tokens), or
is a frame, which the frame caps bound.

Each ``check_*`` function returns the value it checked or raises :class:`Problem` with what is
wrong (``blocks[2] is -1, not a block id of this pool (0..11)``); the caller adds which event.
"""

from __future__ import annotations

from collections.abc import Hashable

MAX_TRACE_CHARS = 32 * 2**20  # the JSON text (json.loads may take up to ~20x that in memory)
MAX_EVENTS = 2**20
MAX_NUM_BLOCKS = 2**22  # a GPU pool (and a CPU pool); the replay keeps one int per block
MAX_BLOCK_SIZE = 2**16  # tokens per block (vLLM's default is 16)
MAX_SEQ_TOKENS = 2**20  # tokens of one sequence: a 1M-token context
MAX_STRING_CHARS = 1024  # a sequence or request id, a hash, a status, a reason
MAX_INT = 2**63 - 1  # any other int (an index, a step, a token id): it fits an int64
# What a viewer builds from a file (replay_states: one PoolState per step event), summed over the
# frames. A cell is a block, a table entry or a sequence (~0.3 KiB in a frame); a slot is a token
# that a frame's blocks hold (8 bytes).
MAX_FRAME_CELLS = 2**21
MAX_FRAME_SLOTS = 2**25
# Null table entries (-1) a replay builds that the file does not list (info.skipped, and the
# copies a fork makes of them): a floor, plus so many per character of the text.
NULL_ENTRIES_FLOOR = 2**20
NULL_ENTRIES_PER_CHAR = 1


class Problem(Exception):
    """What is wrong with a value, raised deep in a check; the caller (trace/file.py,
    trace/checks.py) turns it into a TraceFileError that names the event it was checking."""


def check_int(v, what: str, lo: int = 0, hi: int | str = MAX_INT) -> int:
    """``v`` as an int in ``lo..hi``; ``hi`` may name a cap (read now, so that it can be raised)."""
    cap = hi if isinstance(hi, str) else None
    top = globals()[cap] if cap else hi
    if type(v) is not int or not lo <= v <= top:
        if cap and type(v) is int and v > top:
            raise Problem(above_cap(f"{what} is {show(v)}", cap))
        raise Problem(f"{what} is {show(v)}, not an int in {lo}..{top}")
    return v


def above_cap(what: str, cap: str) -> str:
    """``what`` (a phrase ending in its size), the cap it passed, and how to raise that cap."""
    return f"{what}, above the cap {cap} = {globals()[cap]} (raise pagedlearn.trace.limits.{cap})"


def check_name(v, what: str) -> int | str:
    """A sequence or request id: JSON keeps ints and strings (EventLog.to_json spells the rest)."""
    if (type(v) is int and abs(v) <= MAX_INT) or (type(v) is str and len(v) <= MAX_STRING_CHARS):
        return v
    raise Problem(
        f"{what} is {show(v)}: an id is an int or a string of at most {MAX_STRING_CHARS} characters"
    )


def check_hashable(v, what: str):
    """A sequence id of a trace recorded in this process: any hashable (the engine keyed its
    tables by it already, so the type check is enough)."""
    if not isinstance(v, Hashable):
        raise Problem(f"{what} is {show(v)}: a sequence id must be hashable")
    return v


def check_string(v, what: str) -> str:
    if type(v) is not str or len(v) > MAX_STRING_CHARS:
        raise Problem(f"{what} is {show(v)}, not a string of at most {MAX_STRING_CHARS} characters")
    return v


def check_list(v, what: str) -> list:
    if type(v) is not list:
        raise Problem(f"{what} is {show(v)}, not a list")
    return v


def check_block_id(b, what: str, n: int, cpu: bool) -> None:
    if type(b) is not int or not 0 <= b < n:
        pool = "the CPU pool" if cpu else "this pool"
        ids = f"0..{n - 1}" if n else "it has no blocks"
        raise Problem(
            f"{what} is {show(b)}, not a {'CPU ' if cpu else ''}block id of {pool} ({ids})"
        )


def check_tokens(v, what: str, most: int) -> list[int]:
    check_list(v, what)
    if len(v) > most:
        raise Problem(f"{what} holds {len(v)} tokens, more than {most}")
    if all(type(t) is int for t in v) and (not v or (min(v) >= 0 and max(v) <= MAX_INT)):
        return v
    for i, t in enumerate(v):
        check_int(t, f"{what}[{i}]")
    return v


def show(v) -> str:
    """A short description of a JSON value for a message (never a megabyte of it)."""
    if type(v) is list:
        text = repr(v) if len(v) <= 16 else ""
        return text if 0 < len(text) <= 60 else f"a list of {len(v)}"
    if type(v) is dict:
        return f"an object with {len(v)} keys"
    if type(v) is str:
        return repr(v) if len(v) <= 40 else repr(v[:40]) + f"... ({len(v)} characters)"
    if type(v) is int and v.bit_length() > 96:
        return f"an int of {v.bit_length()} bits"
    return repr(v)


def kind_text(kind) -> str:
    return kind if type(kind) is str and len(kind) <= 40 else f"kind {show(kind)}"
