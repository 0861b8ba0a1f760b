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

**Following an engine that another thread steps** (a server's: ``LiveBlockView(srv)`` for a
:func:`pagedlearn.serve.serve` handle, or ``LiveBlockView(llm, follow=True)``): one thread may
step an engine -- two would corrupt its queues and its pool --, so the view's buttons are
disabled and a line says who steps it. The view then draws on the stepping thread, inside its
step event, and must not slow it down much: every frame still goes through the palette (so the
colours stay those of the replay) and the request list, which is cheap, but the picture -- a
matplotlib render and a PNG, ``last_draw_seconds`` -- is drawn at most ``max_fps`` times a second,
and always for a frame that shows the engine idle (nothing waiting, running or swapped), so that
the picture left on screen is the pool as it is. With a handle that has ``call(fn)`` (run ``fn``
on the engine's thread between steps), the view subscribes, reads its first frame and, on
``close()``, unsubscribes there too.

**Tensor parallelism** (``LLM(..., tensor_parallel_size=N)``): under the pool picture a second
one shows the driver's one block table over each worker's KV slab -- the same block ids, each
worker its own heads (:mod:`pagedlearn.viz.workers`). It is redrawn with the pool picture, from
rpcs to the workers made on the thread that steps the engine; a failing rpc is shown in the view.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import html
import time

import ipywidgets as w

from pagedlearn.trace.file import FRAME_KINDS
from pagedlearn.viz.colors import Palette
from pagedlearn.viz.live_workers import LiveSlabs, shows_workers, stacked_png
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
FOLLOW_FPS = 5.0  # a following view's default max_fps: enough to see blocks move, cheap to draw


def steps_elsewhere(source) -> bool:
    """Whether ``source`` is an engine handle whose own thread steps it (a server's handle:
    it has ``.engine`` and ``.call(fn)``), rather than an ``LLM`` or ``LLMEngine`` to step."""
    return hasattr(source, "engine") and callable(getattr(source, "call", None))


def is_idle(state: PoolState) -> bool:
    """Whether a frame shows the engine idle: no request waiting, running or swapped out."""
    return all(r.status == "finished" for r in state.requests)


class LiveBlockView(PoolView):
    """A dashboard attached to a running engine: ``display(LiveBlockView(llm))``.

    ``.step()`` runs one engine step (the view redraws on the step event); ``.run(max_steps)``
    steps until every request is done (for notebooks executed headless). ``.play()`` (the Play
    button) steps in the background, ``delay`` seconds apart, until every request is done.
    ``.palette`` is the run's colour assignment as this view sees it. ``.close()`` detaches it.

    ``follow``: another thread steps the engine (default: True for a server's handle, which
    it needs; False for an ``LLM`` / ``LLMEngine``). A following view never steps: its buttons
    are disabled and ``step`` / ``run`` / ``play`` raise. ``max_fps``: draw the picture at most
    this often (frames a second: 1 / max_fps s from the end of one drawing to the start of the
    next; an idle frame is always drawn); None draws every frame.
    Default: 5 when following, None otherwise. ``frames_seen`` / ``frames_drawn`` count the
    frames the view took in and those it drew (``last_draw_seconds``: what the last one cost).
    ``workers``: draw each worker's KV slab under the pool (``workers_image``; default: when the
    engine has more than one worker); False hides it, True shows it for one worker too.
    """

    def __init__(
        self,
        llm,
        *,
        per_row: int | None = None,
        delay: float = 0.3,
        follow: bool | None = None,
        max_fps: float | None = None,
        workers: bool | None = None,
    ) -> None:
        engine = getattr(llm, "engine", llm)
        if not (hasattr(engine, "kv") and hasattr(engine, "step")):
            raise TypeError(
                "LiveBlockView needs an LLM, an LLMEngine or a server's handle (serve(...)), "
                f"got {type(llm).__name__}"
            )
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or delay < 0:
            raise ValueError(f"delay must be a number of seconds >= 0, got {delay!r}")
        handle = llm if steps_elsewhere(llm) else None
        if follow is None:
            follow = handle is not None
        if not isinstance(follow, bool):
            raise TypeError(f"follow must be True, False or None, got {follow!r}")
        if handle is not None and not follow:
            raise ValueError(
                "follow=False on a server's handle: its engine thread steps the engine, and a "
                "second thread stepping it would corrupt it; leave follow at its default"
            )
        if max_fps is None and follow:
            max_fps = FOLLOW_FPS
        if max_fps is not None and (
            isinstance(max_fps, bool) or not isinstance(max_fps, (int, float)) or max_fps <= 0
        ):
            raise ValueError(
                f"max_fps must be a number of frames a second > 0 or None, got {max_fps!r}"
            )
        self.slabs = LiveSlabs(engine, dpi=DPI) if shows_workers(engine, workers) else None
        self.engine = engine
        self.following, self.max_fps = follow, max_fps
        # Run fn(engine) where the engine is safe to read: on its thread between steps (a
        # handle's call), else here (the caller steps it, or promises it is not stepping now).
        self._call = handle.call if handle is not None else (lambda fn: fn(engine))
        self.frames_seen = self.frames_drawn = 0
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
        controls = [self.play_button, self.pause_button, self.step_button, self.speed]
        self.driver = w.HTML()  # who steps the engine, when it is not this view
        if follow:
            for control in controls:
                control.disabled = True
            url = getattr(llm, "url", None)
            who = f"the server at <code>{html.escape(url)}</code>" if url else "another thread"
            often = f"at most {max_fps:g} times a second" if max_fps else "at every step"
            self.driver.value = (
                f"<i>Following: {who} steps this engine, not these buttons. The picture is "
                f"redrawn {often}, and when the engine goes idle: send requests, watch the "
                "blocks move.</i>"
            )
            controls.append(self.driver)
        self._widget = self._layout(controls)
        self.workers_image = None
        if self.slabs is not None:  # under the pool picture, as wide as the column allows
            self.workers_image = w.Image(format="png", layout=self.image.layout)
            kids = list(self._widget.children)
            kids.insert(kids.index(self.image) + 1, self.workers_image)
            self._widget.children = tuple(kids)
        self._frames = LiveFrames(engine)  # one per step event and per prefix-cache reset
        self._unsubscribe = None
        self._call(self._attach)

    def _attach(self, engine) -> None:
        # Where the engine is safe to read, with no step in between: draw the pool, then
        # subscribe (a first drawing that fails leaves nothing subscribed).
        # The pool as it is now is not a frame of the run (no step event): a palette of its own
        # colours it, so that the run's own frames decide ``self.palette``, as in its replay.
        first = Palette().paint(pool_state(engine))
        self._draw(first, self._book.update(first))
        self._last_drawn = time.monotonic()  # when the last drawing ended (max_fps counts on)
        self.frames_drawn = 1
        self._unsubscribe = engine.kv.trace.subscribe(self._on_event)

    def _on_event(self, event) -> None:
        # Runs inside the engine's step, on the thread that steps it: cheap unless it draws,
        # and it never raises into the engine (a drawing bug is shown in the view instead).
        if event.kind not in FRAME_KINDS or self._unsubscribe is None:
            return
        try:
            state = self.palette.paint(self._frames.at(event))  # every frame: the run's colours
            finished = self._book.update(state)
            self.frames_seen += 1
            # Counted from the end of the last drawing: however slow a drawing is, the engine
            # gets at least 1 / max_fps s of stepping between two.
            since = time.monotonic() - self._last_drawn
            if self.max_fps and since < 1.0 / self.max_fps and not is_idle(state):
                return  # too soon after the last picture; a later frame (or the idle one) draws
            self._draw(state, finished)
            self._last_drawn = time.monotonic()
            self.frames_drawn += 1
        except Exception as exc:
            self._report(exc)

    def _draw(self, state: PoolState, finished: list) -> None:
        super()._draw(state, finished)
        if self.slabs is not None:  # the same frame's slabs: rpcs, on the stepping thread
            try:
                self.workers_image.value = self.slabs.png(state)
            except Exception as exc:  # a worker's failure is shown; it never raises into a step
                self._report(exc)

    def _repr_mimebundle_(self, **kwargs):
        bundle = super()._repr_mimebundle_(**kwargs)
        if self.workers_image is not None and self.workers_image.value:  # both, for a reader
            png = stacked_png(self.image.value, self.workers_image.value)  # with no kernel
            bundle["image/png"] = base64.b64encode(png).decode("ascii")
        return bundle

    def _refuse_if_following(self) -> None:
        if self.following:
            raise RuntimeError(
                "this LiveBlockView follows an engine that another thread steps (a server's "
                "engine thread); stepping it from here too would corrupt it: send the server "
                "requests instead"
            )

    def step(self) -> list:
        """Run one engine step; returns its ``RequestOutput``s. Errors are shown and raised."""
        self._refuse_if_following()
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
        self._refuse_if_following()
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
        self._refuse_if_following()
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
        if self.following:  # nothing here steps it: every button stays disabled
            return
        self.play_button.disabled = playing
        self.step_button.disabled = playing
        self.pause_button.disabled = not playing

    def close(self) -> None:
        """Stop following the engine (the last picture stays). On a server's handle the view
        unsubscribes on the engine's thread, so no frame of it is drawn once this returns."""
        self.pause()
        unsubscribe, self._unsubscribe = self._unsubscribe, None  # _on_event stops here
        if unsubscribe is not None:
            try:
                self._call(lambda _: unsubscribe())
            except Exception:  # a stopped server: no step can run any more, detach from here
                unsubscribe()
        self.play_button.disabled = self.step_button.disabled = True


def __getattr__(name: str):
    # ReplayView lived here before it got its own module; old imports keep working.
    if name == "ReplayView":
        from pagedlearn.viz.replay import ReplayView

        return ReplayView
    raise AttributeError(f"module 'pagedlearn.viz.live' has no attribute {name!r}")
