"""The event trace: every block operation, as a small record anyone can subscribe to.

The memory manager announces each thing it does to the physical pool -- a block allocated, shared,
copied on write, freed, cached, evicted -- as an :class:`Event`. The live view and the replay view
draw from these events, and the paper simulations count them, so the list is complete: replaying
the events from an empty pool rebuilds the pool exactly (:class:`PoolReplay`, in trace/replay.py;
checked by the tests after every random operation).

Event kinds (``blocks`` are physical block ids -- GPU ones unless said otherwise --, ``seqs``
sequence ids):

===============  ===================  ======  =====================================================
kind             blocks               seqs    what happened
===============  ===================  ======  =====================================================
``allocate``     new blocks           (s,)    free blocks got refcount 1, appended to s's table
``cache_hit``    cached blocks        (s,)    s reuses cached blocks (refcount +1), appended
                                              (after ``info["skipped"]`` null entries, if
                                              given: a sliding window needs no older block)
``incref``       parent's blocks      (p, c)  fork: child c shares all of p's blocks (only
                                              the first ``info["prefix"]`` entries, if given:
                                              ``fork_prefix``)
``cow_copy``     (src, dst)           (s,)    copy-on-write: s's last block src -> fresh dst
``free``         s's blocks           (s,)    s finished: refcount -1 each, its table is gone
``free``         s's CPU blocks       (s,)    ``info["cpu"]``: a swapped-out s finished (aborted)
``window_free``  s's oldest blocks    (s,)    a sliding window left them behind: refcount -1
                                              each; s's entries ``info["first"]...`` are now
                                              null (-1); s's table keeps its length
``cache_store``  (b,)                 (s,)    s's full block b registered: ``info["hash"]``,
                                              its tokens ``info["tokens"]``, the hash it
                                              chains on ``info["parent"]`` (newer traces;
                                              the KV-cache events need it: kv_events/)
``evict``        (b,)                 (s,)    cached block b taken for s's new data; hash gone
                                              (``info["reason"]``: dropped, not taken -- its KV
                                              may never have been written; recovery.py)
``cache_reset``  dropped blocks       ()      ``reset_prefix_cache``: every cached block (all
                                              free: no sequence holds a block) forgets its
                                              hash; free and empty now; not an eviction
``swap_out``     s's GPU blocks       (s,)    refcount -1 each; s's table is now
                                              ``info["cpu_blocks"]``, in the CPU pool
``swap_in``      s's new GPU blocks   (s,)    refcount +1 each, s's table again; it was
                                              ``info["cpu_blocks"]``
``preempt``      ()                   (s,)    the engine preempted s: ``info["mode"]`` is
                                              ``"recompute"`` (s is freed) or ``"swap"``;
                                              ``info["reason"]`` when it was not for room
                                              (recovery.py: the step that raised)
``step``         ()                   ()      a frame boundary (``kv.mark_step``): every
                                              sequence's token count, the tokens it gained
                                              since the last mark, and the caller's info
===============  ===================  ======  =====================================================

A group swapped together (the samples of one request) gets one ``swap_out`` / ``swap_in`` per
sequence; blocks they share appear in each of their events, as they do in their tables. The
manager emits every kind but ``preempt``, which the engine emits to say *why* blocks moved, and
``step``, which the engine asks for after each step: block events say which blocks a sequence
holds, step events say how full they are and what tokens they hold, so that a replay can draw
a recorded run exactly as the live view drew it (a frame at each ``step``, and at each
``cache_reset``: viz/state.py). When nobody subscribes, ``emit`` is a single
``if``: the manager pays nothing for the trace it is not asked for. A subscriber that raises
stops neither the other subscribers nor the manager: its error is held until the next step
event (:class:`Trace`).

A trace file comes from someone else: :meth:`EventLog.from_json` checks its sizes and shape
(trace/file.py) and that every event fits the pool (trace/checks.py), and raises
:class:`~pagedlearn.errors.TraceFileError` naming the first bad event; a log it returns replays.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pagedlearn.errors import TraceFileError, add_note
from pagedlearn.trace.checks import check_replay
from pagedlearn.trace.file import parse_trace
from pagedlearn.trace.replay import PoolReplay  # also imported from here (pagedlearn.trace.events)


@dataclass(frozen=True)
class Event:
    """One block operation. ``index`` is its position in the trace (0, 1, 2, ...)."""

    index: int
    kind: str
    blocks: tuple[int, ...]
    seqs: tuple[Hashable, ...] = ()
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        # Sequence ids may be any hashable; JSON keeps ints and strings and spells the rest.
        seqs = [s if isinstance(s, (int, str)) else repr(s) for s in self.seqs]
        return {
            "index": self.index,
            "kind": self.kind,
            "blocks": list(self.blocks),
            "seqs": seqs,
            "info": self.info,
        }


Subscriber = Callable[[Event], None]


class Trace:
    """Fan-out of block events to subscribers (the live view, an :class:`EventLog`, a test).

    **A subscriber that raises** must not cut a block-manager operation in half (``emit`` runs
    in the middle of them: a pool nobody could trust) nor hide the event from the subscribers
    after it (a recording would replay wrong). So every subscriber gets every event; the first
    ``Exception`` a subscriber raises is *held* (later ones are counted) and raised at the next
    **safe point**, where nothing is half done: the end of the next ``step`` event, after every
    subscriber saw it (``kv.mark_step``: the engine marks at the end of each step, which then
    raises with its work complete and nothing for recovery to undo), or
    :meth:`raise_deferred`. One held from a block event is also announced at once with a
    ``RuntimeWarning``: a manager driven by hand may never mark a step. It is the subscriber's
    own exception (its traceback leads into the subscriber), with a note naming the event.
    Not logged and dropped: a drawing bug would pass silently. ``KeyboardInterrupt`` is not
    held (the engine holds a real Ctrl-C itself: ``held_interrupts`` in engine/recovery.py).
    """

    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []
        self._next_index = 0
        self.num_subscriptions = 0  # ever made: tells a StepMarker that a new listener arrived
        self.held_error: Exception | None = None  # until the next safe point (raise_deferred)
        self._more_held = 0  # errors caught since the held one

    @property
    def listening(self) -> bool:
        return bool(self._subscribers)

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Call ``fn(event)`` for every future event; returns a function that unsubscribes."""
        self._subscribers.append(fn)
        self.num_subscriptions += 1
        return lambda: self._subscribers.remove(fn) if fn in self._subscribers else None

    def emit(self, kind: str, blocks: Iterable[int], seqs: Iterable[Hashable] = (), **info) -> None:
        """Give an event to every subscriber. A subscriber's ``Exception`` is held (see the
        class docstring) and raised at the end of the next ``step`` event."""
        if not self._subscribers:  # the common case in a benchmark: no record is even built
            return
        event = Event(self._next_index, kind, tuple(blocks), tuple(seqs), info)
        self._next_index += 1
        for fn in tuple(self._subscribers):
            try:
                fn(event)
            except Exception as exc:  # held, not lost: raised at the next safe point
                self._hold(fn, event, exc)
        if self.held_error is not None and kind == "step":  # a frame boundary: nothing half done
            self.raise_deferred()

    def raise_deferred(self) -> None:
        """Raise the subscriber error held since the last safe point, if any (and forget it).
        Call it where no block-manager operation is half done."""
        exc, more = self.held_error, self._more_held
        if exc is None:
            return
        self.held_error, self._more_held = None, 0
        if more:
            add_note(exc, f"pagedlearn: {more} more subscriber error(s) were caught after it")
        raise exc

    def _hold(self, fn: Subscriber, event: Event, exc: Exception) -> None:
        if self.held_error is not None:
            self._more_held += 1
            return
        self.held_error = exc
        name = getattr(fn, "__qualname__", None) or type(fn).__qualname__  # a callable object
        where = f"event {event.index} ({event.kind})"
        add_note(
            exc,
            f"pagedlearn: trace subscriber {name} raised this at {where}; every subscriber "
            "got that event and the block manager finished its operation: the error was held "
            "until the next safe point (the end of a step event, or Trace.raise_deferred())",
        )
        if event.kind != "step":  # a step event raises it at once: nothing to announce
            # Warnings turned into errors: no matter, the held error is raised anyway.
            with contextlib.suppress(Exception):
                warnings.warn(
                    f"trace subscriber {name} raised {exc!r} at {where}; the block manager "
                    "carried on, and the error will be raised at the next step event "
                    "(kv.mark_step; the engine marks after every step) or by "
                    "trace.raise_deferred()",
                    RuntimeWarning,
                    stacklevel=3,  # the line that emitted the event
                )


class EventLog:
    """Keeps every event of a trace, with the pool's shape in ``meta``; saves and loads JSON::

    log = manager.record()               # an EventLog subscribed to the manager's trace
    text = log.to_json()                 # hand a recorded run to a lab
    EventLog.from_json(text).replay().tables
    """

    def __init__(self, trace: Trace | None = None, meta: dict[str, Any] | None = None) -> None:
        self.events: list[Event] = []
        self.meta = dict(meta or {})
        self._unsubscribe = trace.subscribe(self.events.append) if trace is not None else None

    def close(self) -> None:
        """Stop recording (the events so far stay)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def __len__(self) -> int:
        return len(self.events)

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(
            {"meta": self.meta, "events": [e.to_dict() for e in self.events]}, indent=indent
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> EventLog:
        """Load a trace that anyone may have written: check it all (trace/file.py), replaying
        it once, and raise :class:`TraceFileError` naming the first bad event."""
        meta, fields = parse_trace(text)
        log = cls(meta=meta)
        log.events = [Event(*f) for f in fields]
        replay = PoolReplay(meta["num_blocks"], meta.get("num_cpu_blocks"))
        check_replay(replay, log.events, meta["block_size"], len(text))
        return log

    def replay(self, upto: int | None = None) -> PoolReplay:
        """The pool as it stood after the first ``upto`` events (all of them by default)."""
        if "num_blocks" not in self.meta:
            raise TraceFileError("this log has no meta['num_blocks']; record it with kv.record()")
        meta = self.meta
        return PoolReplay.from_events(
            meta["num_blocks"], self.events[:upto], meta.get("num_cpu_blocks")
        )


class StepMarker:
    """Emits ``step`` events for a manager (``kv.mark_step(**info)`` calls it).

    A step event lists every sequence's token count (GPU and swapped) and, to keep a long
    recorded run small, only the tokens each gained since the previous mark: entries
    ``[seq, position, tokens]``. A sequence is sent whole (from position 0) the first time a
    mark sees it, when it is a new life under an old id (a new block table: finished, then added
    again), and after anyone subscribes to the trace (a new listener has seen nothing yet).
    """

    def __init__(self) -> None:
        # per sequence at the last mark: (its block table, how many of its tokens were sent)
        self._sent: dict[Hashable, tuple[Any, int]] = {}
        self._subscriptions = 0  # the trace's count at the last mark

    def mark(self, trace: Trace, tables: dict, info: dict[str, Any]) -> None:
        """``tables``: sequence id -> its BlockTable (``.token_ids``), GPU ones first."""
        if not trace.listening:
            return
        if trace.num_subscriptions != self._subscriptions:
            self._sent, self._subscriptions = {}, trace.num_subscriptions
        counts, new, sent = [], [], {}
        for s, table in tables.items():
            tokens = table.token_ids
            known, k = self._sent.get(s, (None, 0))
            k = k if known is table else 0
            counts.append([s, len(tokens)])
            if len(tokens) > k or known is not table:  # new tokens, or a new life
                new.append([s, k, tokens[k:]])
            sent[s] = (table, len(tokens))
        self._sent = sent
        trace.emit("step", (), (), num_tokens=counts, new_tokens=new, **info)
