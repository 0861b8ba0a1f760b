"""Watch the KV blocks move: a live dashboard on a running engine.

:class:`LiveBlockView` subscribes to the engine's event trace and redraws at every ``step``
event, whoever called ``step()``, and at every prefix-cache reset (``llm.reset_prefix_cache()``:
its frame is named "step S (prefix cache reset: N cached blocks dropped)"): the pool picture, a
stats line (step, used / cached / free blocks, queues, preemptions, CoW copies, prefix hits),
the request list (status, sequences, tokens and blocks held, finish reason) and a block
inspector (click a block, or type its id for pools over 128 blocks). The shared parts are in
:mod:`pagedlearn.viz.view`; the replay of a recorded run,
:class:`~pagedlearn.viz.replay.ReplayView`, draws through the same code.

Colours: the view runs the run's colour rule (:mod:`pagedlearn.viz.colors`) over the frames it
sees, one per ``step`` event (and reset). Create it when you start recording (``log =
engine.record()``, then ``LiveBlockView(llm)``) and it colours every request as the replay of
``log`` does, and as every figure drawn from that replay does.

Play / Pause / Step buttons and a delay slider drive it interactively: Play runs as an asyncio
task, so the kernel keeps handling clicks; with nothing left to run, Play and Step say how to add
requests instead of doing nothing.
"""

from __future__ import annotations

import asyncio
import contextlib

import ipywidgets as w

from pagedlearn.trace_file import FRAME_KINDS
from pagedlearn.viz.colors import Palette
from pagedlearn.viz.panels import RequestBook
from pagedlearn.viz.state import LiveFrames, PoolState, pool_state, step_label
from pagedlearn.viz.view import DPI, MAX_BUTTONS, PoolView

__all__ = ["DPI", "MAX_BUTTONS", "LiveBlockView"]

# What Play and Step say when every request has finished: the one-liner that gives them work.
NOTHING_TO_RUN = (
    "Nothing to run: every request has finished. Add one in a new cell, e.g. "
    "<code>llm.engine.add_request('more', 'Once upon a time')</code> "
    "(16 tokens by default; pass <code>SamplingParams(max_tokens=...)</code> for more), "
    "then press Play."
)


class LiveBlockView(PoolView):
    """A dashboard attached to a running engine: ``display(LiveBlockView(llm))``.

    ``.step()`` runs one engine step (the view redraws on the step event); ``.run(max_steps)``
    steps until every request is done (for notebooks executed headless). ``.play()`` (the Play
    button) steps in the background, ``delay`` seconds apart, until every request is done.
    ``.palette`` is the run's colour assignment as this view sees it. ``.close()`` detaches it.
    """

    def __init__(self, llm, *, per_row: int | None = None, delay: float = 0.3) -> None:
        engine = getattr(llm, "engine", llm)
        if not (hasattr(engine, "kv") and hasattr(engine, "step")):
            raise TypeError(f"LiveBlockView needs an LLM or LLMEngine, got {type(llm).__name__}")
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or delay < 0:
            raise ValueError(f"delay must be a number of seconds >= 0, got {delay!r}")
        self.engine = engine
        super().__init__(
            engine.kv.allocator.num_blocks, engine.kv.block_size, per_row, engine.tokenizer
        )
        self.palette = Palette()
        self._book = RequestBook()
        self._task: asyncio.Task | None = None
        self.play_button = w.Button(
            description="Play",
            icon="play",
            tooltip="step the engine until every request has finished",
        )
        self.pause_button = w.Button(
            description="Pause", icon="pause", disabled=True, tooltip="stop after this step"
        )
        self.step_button = w.Button(
            description="Step", icon="step-forward", tooltip="run one engine step"
        )
        self.speed = w.FloatSlider(
            value=delay, min=0.0, max=2.0, step=0.05, description="delay (s)"
        )
        self.play_button.on_click(lambda _: self.play())
        self.pause_button.on_click(lambda _: self.pause())
        self.step_button.on_click(lambda _: self._step_clicked())
        self._widget = self._layout(
            [self.play_button, self.pause_button, self.step_button, self.speed]
        )
        self._frames = LiveFrames(engine)  # one per step event and per prefix-cache reset
        self._unsubscribe = engine.kv.trace.subscribe(self._on_event)
        # The pool as it is now is not a frame of the run (no step event): a palette of its own
        # colours it, so that the run's own frames decide ``self.palette``, as in its replay.
        self._show(Palette().paint(pool_state(engine)))

    def _show(self, state: PoolState) -> None:
        self._draw(state, self._book.update(state))

    def _on_event(self, event) -> None:
        if event.kind not in FRAME_KINDS:
            return
        try:  # a drawing bug must not break the engine's step: show it instead
            self._show(self.palette.paint(self._frames.at(event)))
        except Exception as exc:
            self._report(exc)

    def step(self) -> list:
        """Run one engine step; returns its ``RequestOutput``s. Errors are shown and raised."""
        if self._unsubscribe is None:
            raise RuntimeError("this LiveBlockView is closed")
        if not self.engine.has_unfinished_requests():
            self._say(NOTHING_TO_RUN)
            return []
        self._say("")
        try:
            return self.engine.step()
        except Exception as exc:
            self._report(exc)
            raise

    def run(self, max_steps: int | None = None) -> list:
        """Step until no request is unfinished (or ``max_steps`` steps); returns the outputs of
        the requests that finished meanwhile."""
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 0):
            raise ValueError(f"max_steps must be an int >= 0 or None, got {max_steps!r}")
        finished, steps = [], 0
        while self.engine.has_unfinished_requests() and (max_steps is None or steps < max_steps):
            finished += [o for o in self.step() if o.finished]
            steps += 1
        return finished

    def _step_clicked(self) -> None:
        with contextlib.suppress(Exception):  # step() has shown it in the view
            self.step()

    def play(self) -> None:
        """Step with ``speed.value`` seconds between steps, in the background (an asyncio task
        on the kernel's loop). Without a running loop (a script), this is :meth:`run`. With no
        unfinished request, it only says how to add some."""
        if self._task is not None and not self._task.done():
            return
        if self._unsubscribe is None:
            raise RuntimeError("this LiveBlockView is closed")
        if not self.engine.has_unfinished_requests():
            self._say(NOTHING_TO_RUN)
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self.run()
            return
        self._set_playing(True)
        self._task = asyncio.ensure_future(self._play())

    async def _play(self) -> None:
        try:
            while self.engine.has_unfinished_requests():
                self.step()
                await asyncio.sleep(self.speed.value)
            label = step_label(self.state) if self.state is not None else None
            self._say(f"Done{f' at {label}' if label else ''}: every request has finished. "
                      "Add requests and press Play to watch more.")  # fmt: skip
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # shown in the view by step(); keep it for the caller too
            self.last_error = exc
        finally:
            self._set_playing(False)

    def pause(self) -> None:
        """Stop playing after the step in progress."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._set_playing(False)

    def _set_playing(self, playing: bool) -> None:
        self.play_button.disabled = playing
        self.step_button.disabled = playing
        self.pause_button.disabled = not playing

    def close(self) -> None:
        """Stop following the engine (the last picture stays)."""
        self.pause()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self.play_button.disabled = self.step_button.disabled = True


def __getattr__(name: str):
    # ReplayView lived here before it got its own module; old imports keep working.
    if name == "ReplayView":
        from pagedlearn.viz.replay import ReplayView

        return ReplayView
    raise AttributeError(f"module 'pagedlearn.viz.live' has no attribute {name!r}")
