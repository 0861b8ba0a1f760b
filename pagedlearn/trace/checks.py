"""Does an event fit the pool? The rules a replay checks before it applies each event.

:class:`~pagedlearn.trace.events.PoolReplay` calls :func:`check_event` before it changes anything,
so a replay that raises stays as it was after the event before. The rules (what each kind means: the
table in :mod:`pagedlearn.trace.events`):

- a known kind, with as many blocks and sequences as it takes (``trace_file.SHAPES``);
- block ids lie in the pool, CPU ids (swapped-out tables) in the CPU pool when its size is known;
- a sequence that is freed, forked, copied on write or swapped exists where the event says (on
  the GPU, or swapped out); a fork's child is new (not its parent), an allocation's owner is
  not swapped out;
- ``allocate`` and the copy of a ``cow_copy`` take free blocks (refcount 0), ``evict`` only free
  ones (a block the replay never saw cached may be evicted: a recording that began after an
  earlier run evicts what that run cached); a ``free`` or ``swap_out`` names exactly the
  sequence's table, so no refcount ever drops below zero; ``swap_in`` brings back exactly the
  CPU blocks the sequence was swapped out to; a ``window_free`` names the oldest live blocks
  of a table (a sliding window's null entries, -1, only ever form a table's head);
- a ``step`` sends each sequence's tokens from a position the replay holds, and its counts add up;
- a ``cache_reset`` (``reset_prefix_cache``) comes while no sequence holds a block, on the GPU or
  swapped out (the manager refuses it otherwise), names each block once, and names every block
  the replay holds as cached (it drops them all). Like ``evict``, it may name a free block the
  replay never saw cached: a recording that began after an earlier run resets what that run
  cached.

A trace recorded here obeys them all; a file that breaks one was edited, truncated, or recorded
after the run it describes had started (an event then names a sequence the replay never saw).

A check costs what the event lists, not what the table holds: a sliding window's null entries
only ever form a table's head (the rules above keep it so), so :func:`null_head` finds where they
end by binary search instead of reading them all. What a replay *builds* beyond what the file
lists is null entries (:func:`nulls_built`), and :func:`check_replay`, which replays a whole file
once at load (trace/file.py checked its types first), bounds them (the rules in
:mod:`pagedlearn.trace.limits`): no table longer than a sequence of ``MAX_SEQ_TOKENS`` tokens,
and no more nulls than a budget that grows with the file. It also bounds what a viewer will
build from the file: one picture of the pool per ``step`` event (and per ``cache_reset``). So
loading a file costs time and memory in proportion to its text, or to a cap a course can raise.
"""

from __future__ import annotations

import bisect

from pagedlearn.errors import TraceFileError
from pagedlearn.trace import limits as trace_limits
from pagedlearn.trace.file import FRAME_KINDS, SHAPES, check_token_lists
from pagedlearn.trace.limits import (
    Problem,
    above_cap,
    check_block_id,
    check_int,
    check_tokens,
    kind_text,
    show,
)


def check_pool(num_blocks, num_cpu_blocks=None) -> None:
    """The sizes a replay is built with: ints under the caps (checked before any allocation)."""
    try:
        check_int(num_blocks, "num_blocks", 1, "MAX_NUM_BLOCKS")
        if num_cpu_blocks is not None:
            check_int(num_cpu_blocks, "num_cpu_blocks", 0, "MAX_NUM_BLOCKS")
    except Problem as e:
        raise TraceFileError(f"cannot replay a pool whose {e}") from None


def check_event(replay, e) -> None:
    """Raise :class:`TraceFileError` unless event ``e`` fits the pool as ``replay`` (a
    :class:`~pagedlearn.trace.events.PoolReplay`) holds it now. Reads only: ``replay`` is
    unchanged."""
    try:
        _check_fits(replay, e)
    except Problem as bad:
        raise TraceFileError(f"event {e.index} ({kind_text(e.kind)}): {bad}") from None


def _check_fits(replay, e) -> None:
    kind, info, rc = e.kind, e.info, replay.refcounts
    if type(kind) is not str or kind not in SHAPES:
        raise Problem(f"a replay knows the kinds {', '.join(SHAPES)}")
    if not isinstance(info, dict) or not all(
        isinstance(x, (tuple, list)) for x in (e.blocks, e.seqs)
    ):
        raise Problem("an Event holds a tuple of blocks, a tuple of sequences and a dict of info")
    _check_shape(kind, e.blocks, e.seqs)
    on_cpu = kind == "free" and info.get("cpu")
    ncpu = trace_limits.MAX_NUM_BLOCKS if replay.num_cpu_blocks is None else replay.num_cpu_blocks
    for i, b in enumerate(e.blocks):
        check_block_id(b, f"blocks[{i}]", ncpu if on_cpu else len(rc), bool(on_cpu))
    s = e.seqs[0] if e.seqs else None
    if kind in ("allocate", "cache_hit") and s in replay.swapped:
        raise Problem(f"sequence {s!r} is swapped out: it takes GPU blocks only after its swap_in")
    if kind in ("allocate", "cow_copy"):
        for b in e.blocks if kind == "allocate" else e.blocks[1:]:
            if rc[b]:
                raise Problem(
                    f"takes block {b}, which is in use (refcount {rc[b]}): not a free block"
                )
    twice = len(set(e.blocks)) != len(e.blocks)  # a block table never holds a block twice
    if twice and kind in ("allocate", "cache_hit", "cow_copy", "swap_in", "cache_reset"):
        raise Problem("names a block twice")
    if kind == "incref":
        parent, child = e.seqs
        table = _gpu_table(replay, parent, "forks")
        if child == parent:
            raise Problem(f"forks sequence {parent!r} into itself")
        if child in replay.tables or child in replay.swapped:
            raise Problem(f"forks into sequence {child!r}, which already exists")
        end = e.info.get("prefix", len(table))  # fork_prefix: the first entries
        shared = table[min(null_head(table), end) : end]  # their blocks, less the null head
        if list(e.blocks) != shared:
            raise Problem(f"shares blocks {show(list(e.blocks))}, not the table of {parent!r}")
    elif kind == "cow_copy":
        table = _gpu_table(replay, s, "copies on write for")
        if not table or table[-1] != e.blocks[0]:
            raise Problem(f"copies block {e.blocks[0]}, which is not the last block of {s!r}")
    elif kind == "free" and on_cpu:
        if s not in replay.swapped:
            raise Problem(f"frees the CPU blocks of sequence {s!r}, which is not swapped out")
        if sorted(e.blocks) != sorted(live(replay.swapped[s])):
            raise Problem(f"frees CPU blocks that are not the swapped-out table of {s!r}")
    elif kind in ("free", "swap_out"):  # each block of s's table loses the reference s held
        table = _gpu_table(replay, s, "frees" if kind == "free" else "swaps out")
        if sorted(e.blocks) != sorted(live(table)):
            raise Problem(f"names blocks {show(list(e.blocks))}, not the table of {s!r}")
    elif kind == "window_free":  # the oldest live entries of s's table, right after its nulls
        table, first = _gpu_table(replay, s, "frees the window of"), info.get("first")
        if first != null_head(table) or table[first : first + len(e.blocks)] != list(e.blocks):
            raise Problem(
                f"frees blocks {show(list(e.blocks))} from entry {show(first)}, not the oldest "
                f"live blocks of {s!r}"
            )
    elif kind == "cache_hit" and (info.get("skipped") or 0) and s in replay.tables:
        raise Problem(f"skips the first entries of {s!r}, whose table already exists")
    if kind in ("swap_out", "swap_in"):
        if "cpu_blocks" not in info:
            raise Problem("info.cpu_blocks is missing")
        cpu_blocks = info["cpu_blocks"]
        if type(cpu_blocks) is not list or len(cpu_blocks) != len(e.blocks):
            raise Problem(
                f"info.cpu_blocks is {show(cpu_blocks)}: it must list one CPU block per GPU "
                f"block ({len(e.blocks)})"
            )
        for i, b in enumerate(cpu_blocks):
            check_block_id(b, f"info.cpu_blocks[{i}]", ncpu, True)
        if kind == "swap_in" and (s not in replay.swapped or live(replay.swapped[s]) != cpu_blocks):
            why = "is not swapped out" if s not in replay.swapped else "has other CPU blocks"
            raise Problem(f"swaps in sequence {s!r}, which {why}")
    elif kind == "cache_store":
        if type(info.get("hash")) is not str:
            raise Problem("info.hash (the block's hash, in hex) is missing")
        check_tokens(info.get("tokens", []), "info.tokens", trace_limits.MAX_BLOCK_SIZE)
    elif kind == "evict" and rc[e.blocks[0]]:
        b = e.blocks[0]
        raise Problem(f"evicts block {b}, which is in use (refcount {rc[b]}): only free blocks are")
    elif kind == "step":
        _check_step_counts(replay, info)
    elif kind == "cache_reset":
        _check_reset(replay, e.blocks)


def _check_shape(kind: str, blocks, seqs) -> None:
    """As many blocks and sequences as an event of ``kind`` takes (:data:`SHAPES`)."""
    num_blocks, num_seqs = SHAPES[kind]
    a = "an" if kind[0] in "aeiou" else "a"
    if num_blocks is not None and len(blocks) != num_blocks:
        raise Problem(f"has {len(blocks)} blocks; {a} {kind} event has {num_blocks}")
    if num_seqs is not None and len(seqs) != num_seqs:
        raise Problem(f"has {len(seqs)} sequences; {a} {kind} event has {num_seqs}")


NULL = -1  # a table entry whose block a sliding window freed (block_table.NULL_BLOCK)


def null_head(table: list[int]) -> int:
    """How many null entries (-1) ``table`` starts with. They only ever form its head, so a
    binary search finds where they end: a table of a million nulls costs 20 looks, not a
    million (a check of a tiny event must not cost the whole table)."""
    return bisect.bisect_left(table, True, key=lambda b: b != NULL)


def live(table: list[int]) -> list[int]:
    """A table's blocks, less the null (-1) entries a sliding window left (block_table.py)."""
    return table[null_head(table) :]


def nulls_built(replay, e) -> int:
    """The null entries that applying event ``e`` to ``replay`` builds although ``e`` lists none
    of them: a ``cache_hit``'s ``info.skipped``, and the nulls of the parent's table a fork
    copies. Every other entry an event builds, copies or reads is one it lists (a swap moves
    its table's list, nulls and all, without copying it). Reads only, and never raises on an
    event that does not fit (:func:`check_event` says what is wrong with it)."""
    if e.kind == "cache_hit":
        return e.info.get("skipped") or 0
    if e.kind == "incref" and e.seqs:
        table = replay.tables.get(e.seqs[0], [])
        return min(null_head(table), e.info.get("prefix", len(table)))
    return 0


def _gpu_table(replay, s, verb: str) -> list[int]:
    if s not in replay.tables:
        where = "swapped out" if s in replay.swapped else "not in the pool"
        raise Problem(
            f"{verb} sequence {s!r}, which is {where} (its allocate is missing, or the "
            "recording started after it)"
        )
    return replay.tables[s]


def _check_reset(replay, blocks) -> None:
    """A prefix-cache reset: nothing holds a block, and every cached block is dropped."""
    held = [*replay.tables, *replay.swapped]
    if held:
        raise Problem(
            f"resets the prefix cache while sequences {show(held)} hold blocks (the manager "
            "refuses a reset until every sequence is freed)"
        )
    kept = sorted(set(replay.cached) - set(blocks))
    if kept:
        raise Problem(f"drops the cached blocks but not {show(kept)}: a reset drops them all")


def _check_step_counts(replay, info: dict) -> None:
    """After the step, each listed sequence holds exactly the tokens its count says."""
    check_token_lists(info, in_file=False)  # shapes (a file's were checked at load already)
    counts, new = info["num_tokens"], info["new_tokens"]
    length = {s: len(replay.tokens.get(s, ())) for s, _ in counts}
    for s, start, tokens in new:
        if start > length[s]:
            raise Problem(
                f"sends {s!r}'s tokens from position {start}, but the replay holds only "
                f"{length[s]} of them"
            )
        length[s] = start + len(tokens)
    for s, count in counts:
        if length[s] != count:
            raise Problem(
                f"says sequence {s!r} holds {count} tokens; its tokens add up to {length[s]}"
            )


def check_replay(replay, events, block_size: int, text_chars: int) -> None:
    """Apply ``events`` (a file's, of ``text_chars`` characters) to ``replay`` (an empty
    :class:`~pagedlearn.trace.events.PoolReplay`: each apply checks first), and refuse with a
    :class:`TraceFileError` the first event that takes the replay past a bound (the rules in
    :mod:`pagedlearn.trace.limits`), before it is applied:

    - a table longer than a sequence of ``MAX_SEQ_TOKENS`` tokens fills;
    - more null entries built (:func:`nulls_built`) than ``NULL_ENTRIES_FLOOR +
      NULL_ENTRIES_PER_CHAR * text_chars``;
    - frames (one per ``step`` and ``cache_reset``) a viewer would build of more than
      ``MAX_FRAME_CELLS`` cells or ``MAX_FRAME_SLOTS`` token slots.

    So its cost is linear in the file, or bounded by those caps (counting a frame is no dearer
    than the frame's own cells)."""
    cells = slots = nulls = 0
    num_blocks = len(replay.refcounts)
    budget = trace_limits.NULL_ENTRIES_FLOOR + trace_limits.NULL_ENTRIES_PER_CHAR * text_chars
    for e in events:
        where = f"event {e.index} ({kind_text(e.kind)})"
        try:
            _check_table_length(replay, e, block_size)
        except Problem as bad:
            raise TraceFileError(f"{where}: {bad}") from None
        nulls += nulls_built(replay, e)
        if nulls > budget:
            raise TraceFileError(
                f"{where}: replaying the file up to this event builds {nulls} null table entries "
                "(-1: entries a sliding window skipped, made by info.skipped and copied by forks) "
                "that it does not list, above the budget NULL_ENTRIES_FLOOR + "
                f"NULL_ENTRIES_PER_CHAR * {text_chars} characters = {budget} (raise "
                "pagedlearn.trace.limits.NULL_ENTRIES_PER_CHAR or NULL_ENTRIES_FLOOR)"
            )
        replay.apply(e)
        if e.kind not in FRAME_KINDS:
            continue
        tables, swapped, tokens = replay.tables, replay.swapped, replay.tokens
        cells += num_blocks + len(tables) + sum(map(len, tables.values()))
        cells += len(swapped) + sum(map(len, swapped.values())) + len(tokens)
        slots += sum(min(len(tokens.get(s, ())), len(t) * block_size) for s, t in tables.items())
        for total, cap, what in (
            (cells, "MAX_FRAME_CELLS", "cells (blocks, table entries and sequences)"),
            (slots, "MAX_FRAME_SLOTS", "token slots"),
        ):
            if total > getattr(trace_limits, cap):
                drawing = f"drawing every step up to this one takes {total} {what}"
                raise TraceFileError(f"{where}: {above_cap(drawing, cap)}")


def _check_table_length(replay, e, block_size: int) -> None:
    """An ``allocate`` or ``cache_hit`` leaves its table no longer than a sequence of
    ``MAX_SEQ_TOKENS`` tokens fills (the other kinds never lengthen a table)."""
    if e.kind not in ("allocate", "cache_hit"):
        return
    s = e.seqs[0] if e.seqs else None
    skipped = (e.info.get("skipped") or 0) if e.kind == "cache_hit" else 0
    entries = len(replay.tables.get(s, ())) + skipped + len(e.blocks)
    most = -(-trace_limits.MAX_SEQ_TOKENS // block_size)  # ceil: a last block partly full
    if entries > most:
        of = f" ({skipped} of them skipped)" if 0 < skipped < entries else ""
        raise Problem(
            f"the table of {show(s)} would hold {entries} entries{of}, more than a sequence of "
            f"MAX_SEQ_TOKENS = {trace_limits.MAX_SEQ_TOKENS} tokens fills in blocks of "
            f"{block_size} ({most}) (raise pagedlearn.trace.limits.MAX_SEQ_TOKENS)"
        )
