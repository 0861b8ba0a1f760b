"""Scrub through a recorded run: the live view's picture and panels, frame by frame, no model.

:class:`ReplayView` rebuilds every frame of an :class:`~pagedlearn.trace.events.EventLog` with
:func:`~pagedlearn.viz.state.replay_states` -- the same ``PoolState`` s the live view drew, with
the same colours (the run's colour assignment travels in the states, see
:mod:`pagedlearn.viz.colors`) -- and draws them through the same code
(:mod:`pagedlearn.viz.view`). So a figure drawn from ``replay.state`` shows a request in the
colour the widget shows it in.

Numbering, one rule everywhere: a frame is named by the **step** it shows -- the engine's step
counter (or the ``step=`` a hand-driven manager passed to ``mark_step``) -- in the slider, the
stats line and every figure title; the extra frame an abort records after step S is "S
(abort)", a prefix-cache reset's after step S "S (reset)". ``replay.show(i)`` takes a frame's
position in ``replay.frames`` (a Python list, from 0); ``replay.show_step(S)`` takes a step.
"""

from __future__ import annotations

import os

import ipywidgets as w

from pagedlearn.errors import TraceFileError
from pagedlearn.trace import limits as trace_limits
from pagedlearn.trace.events import EventLog
from pagedlearn.viz.panels import RequestBook
from pagedlearn.viz.pool import check_drawable
from pagedlearn.viz.state import PoolState, aborted, replay_states
from pagedlearn.viz.view import PoolView


def frame_name(state: PoolState, index: int) -> str:
    """The slider's name for a frame: its step ("7", "5 (abort)", "5 (reset)" for a prefix-cache
    reset's), or "mark i" (counted from 1) for a frame a manager marked without a step number
    ("reset i" for a reset's)."""
    reset = state.cache_reset is not None
    if state.step is None:
        return f"{'reset' if reset else 'mark'} {index + 1}"
    return f"{state.step}" + (" (abort)" if aborted(state) else " (reset)" if reset else "")


class ReplayView(PoolView):
    """Scrub through a recorded run: ``ReplayView(log)`` with ``log`` an ``EventLog``
    (``engine.record()``), its JSON text (str or bytes), or the path of a JSON file (str or
    ``pathlib.Path``).

    ``.slider`` (a ``SelectionSlider`` named by step, linked to a ``Play`` widget) picks the
    frame; ``.show(i)`` and ``.show_step(step)`` do the same from code. ``.state`` is the frame
    shown (with its colours, ``.colors``). ``tokenizer``: to decode the inspected blocks' tokens
    (else token ids are shown).
    """

    def __init__(self, log, *, per_row: int | None = None, tokenizer=None, interval=400) -> None:
        log = _load_log(log)
        check_drawable(log.meta.get("num_blocks"))  # before building a frame of a huge pool
        frames = replay_states(log)
        if not frames:
            raise ValueError(
                "this log has no step events, so there is nothing to replay: record an engine "
                "run (log = engine.record() before stepping), or call kv.mark_step() after "
                "each change when driving a KVCacheManager by hand"
            )
        self.event_indices = [i for i, _ in frames]
        self.frames = [s for _, s in frames]
        first = self.frames[0]
        super().__init__(first.num_blocks, first.block_size, per_row, tokenizer)
        book = RequestBook()
        self._finished = [book.update(state) for state in self.frames]
        last = len(self.frames) - 1
        self.player = w.Play(min=0, max=last, interval=interval, description="play")
        self.slider = w.SelectionSlider(
            options=[(frame_name(s, i), i) for i, s in enumerate(self.frames)],
            description="step",
            continuous_update=True,
        )
        w.jslink((self.player, "value"), (self.slider, "index"))
        self.slider.observe(lambda change: self.show(change["new"]), "index")
        self.frame: int | None = None
        self._widget = self._layout([self.player, self.slider])
        self.show(0)

    @property
    def num_frames(self) -> int:
        return len(self.frames)

    def show(self, frame: int) -> None:
        """Draw frame ``frame`` (its position in ``.frames``: 0 .. num_frames - 1) and move the
        slider there."""
        if isinstance(frame, bool) or not isinstance(frame, int):
            raise TypeError(f"frame must be an int, got {type(frame).__name__}")
        if not 0 <= frame < self.num_frames:
            raise ValueError(f"frame {frame} is out of range: this run has {self.num_frames}")
        if frame != self.frame:
            self.frame = frame
            self._draw(self.frames[frame], self._finished[frame])
        self.slider.index = frame  # no-op when the slider sent us here

    def show_step(self, step: int) -> None:
        """Draw the frame of engine step ``step`` (the first one named so: an abort's extra
        frame comes after it)."""
        for i, state in enumerate(self.frames):
            if state.step == step:
                self.show(i)
                return
        steps = sorted({s.step for s in self.frames if s.step is not None})
        span = f"steps {steps[0]}..{steps[-1]}" if steps else "no step numbers"
        raise ValueError(f"no frame of step {step!r} in this run: it has {span}")


def _load_log(log) -> EventLog:
    """What a ``ReplayView`` was given, as an ``EventLog``: an ``EventLog``; JSON text -- bytes
    (a file's contents), or a str that starts, after blanks, with ``{`` or ``[`` (a malformed one
    gets the :class:`~pagedlearn.errors.TraceFileError` that names what is wrong); else the path
    of a JSON file (a str or a ``pathlib.Path``)."""
    if isinstance(log, EventLog):
        return log
    if isinstance(log, (bytes, bytearray)) or (
        isinstance(log, str) and log.lstrip()[:1] in ("{", "[")
    ):
        return EventLog.from_json(log)
    if isinstance(log, (str, os.PathLike)):
        path = os.fspath(log)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"no trace file {_brief(os.fsdecode(path))} (give an EventLog, its JSON text, or "
                "the path of a JSON file)"
            )
        if (size := os.path.getsize(path)) > trace_limits.MAX_TRACE_CHARS:  # before reading it
            raise TraceFileError(
                trace_limits.above_cap(f"the trace file is {size} bytes", "MAX_TRACE_CHARS")
            )
        with open(path, "rb") as f:
            return EventLog.from_json(f.read())
    raise TypeError(
        "ReplayView needs an EventLog, its JSON text (str or bytes) or the path of a JSON file, "
        f"got {type(log).__name__}"
    )


def _brief(name: str, keep: int = 32) -> str:
    """A name for a message: whole when short, else its two ends (a path's file name is last)."""
    if len(name) <= 2 * keep + 8:
        return repr(name)
    return f"{name[:keep]!r}...{name[-keep:]!r} ({len(name)} characters)"
