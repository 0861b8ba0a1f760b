"""Watch the KV blocks move: a live dashboard on a running engine, and a replay of a recorded run.

Both views show the same four things, drawn by the same code (so a replay shows exactly what the
live view showed at each step):

- the pool picture (:class:`~pagedlearn.viz.pool.PoolArtist` rendered to a PNG in an
  ``ipywidgets.Image``; no ipympl needed),
- a stats line: step, used / cached / free blocks, queues, preemptions, CoW copies, prefix hits,
- the request list: status, sequences, tokens and blocks held, finish reason,
- a block inspector: click a block (or type its id, for pools over 128 blocks) to see its owners,
  refcount, fill, hash and the tokens it holds.

:class:`LiveBlockView` subscribes to the engine's event trace and redraws at every ``step``
event, whoever called ``step()``. :class:`ReplayView` rebuilds every frame of an
:class:`~pagedlearn.trace.EventLog` with :func:`~pagedlearn.viz.state.replay_states` and scrubs
through them with a slider. Speed: the pool's static layer (outlines, ids, legend) is drawn once;
each frame redraws only what can change (blitting) -- see ``last_draw_seconds``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import html
import io
import os
import re
import time
import traceback

import ipywidgets as w
import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from PIL import Image

from pagedlearn.trace import EventLog
from pagedlearn.viz.panels import RequestBook, inspect_block, requests_html, stats_html
from pagedlearn.viz.pool import groups_in_order, pool_figure
from pagedlearn.viz.state import PoolState, RequestState, pool_state, replay_states
from pagedlearn.viz.style import STYLE, Palette, block_color, text_color

DPI = 80
MAX_BUTTONS = 128  # larger pools get a block-id box instead of one button per block


class _PoolView:
    """What both views share: the picture, stats line, request list and block inspector."""

    def __init__(self, num_blocks: int, block_size: int, per_row, tokenizer) -> None:
        self.palette = Palette()
        self.tokenizer = tokenizer
        with matplotlib.rc_context(STYLE):
            self.figure, self.artist = pool_figure(
                num_blocks, block_size, per_row=per_row, palette=self.palette
            )
        self._canvas = FigureCanvasAgg(self.figure)
        self.figure.set_dpi(DPI)
        self._background, self._layout_version = None, None
        self.last_draw_seconds = 0.0  # update + PNG render of the last frame
        self.state: PoolState | None = None
        self.selected: int | None = None
        self.last_error: BaseException | None = None

        self.image = w.Image(format="png")
        self.stats = w.HTML()
        self.error = w.HTML()
        self.requests = w.HTML()
        self.details = w.HTML("<i>click a block to inspect it</i>")
        if num_blocks <= MAX_BUTTONS:
            self.block_buttons = [
                w.Button(
                    description=str(b),
                    tooltip=f"inspect block {b}",
                    layout=w.Layout(width="44px", height="28px", padding="0"),
                )
                for b in range(num_blocks)
            ]
            for b, button in enumerate(self.block_buttons):
                button.on_click(lambda _, b=b: self.select(b))
            columns = f"repeat({self.artist.per_row}, 46px)"
            picker = w.GridBox(self.block_buttons, layout=w.Layout(grid_template_columns=columns))
        else:
            self.block_buttons = []
            self.block_box = w.BoundedIntText(min=0, max=num_blocks - 1, description="block")
            self.block_box.observe(lambda change: self.select(change["new"]), "value")
            picker = self.block_box
        self.inspector = w.VBox([w.HTML("<b>Inspect a block</b>"), picker, self.details])

    def _layout(self, controls: list) -> w.VBox:
        return w.VBox(
            [
                w.HBox(controls),
                self.image,
                self.stats,
                self.error,
                w.HBox([self.requests, self.inspector]),
            ]
        )

    # --- drawing --------------------------------------------------------------------------------
    def _draw(self, state: PoolState, finished: list[RequestState]) -> None:
        t0 = time.perf_counter()
        with matplotlib.rc_context(STYLE):
            self.artist.update(state)
            png = self._render()
        self.last_draw_seconds = time.perf_counter() - t0
        self.state = state
        self.image.value = png
        self.stats.value = stats_html(state)
        self.requests.value = requests_html(state, finished, self.palette)
        for blk, button in zip(state.blocks, self.block_buttons, strict=False):
            color = block_color(blk, state.group_of, self.palette)
            button.style.button_color = color
            button.style.text_color = text_color(color)
        if self.selected is not None:
            self.select(self.selected)

    def _render(self) -> bytes:
        """The figure as PNG bytes. The static layer is drawn once (again only when the legend
        changes); each frame restores it and draws just the artists an update changes."""
        canvas, dynamic = self._canvas, self.artist.dynamic_artists()
        if self._layout_version != self.artist.layout_version:
            for a in dynamic:
                a.set_visible(False)
            canvas.draw()
            self._background = canvas.copy_from_bbox(self.figure.bbox)
            for a in dynamic:
                a.set_visible(True)
            self._layout_version = self.artist.layout_version
        canvas.restore_region(self._background)
        for a in dynamic:
            self.figure.draw_artist(a)
        size = canvas.get_width_height(physical=True)
        img = Image.frombuffer("RGBA", size, canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
        buf = io.BytesIO()
        img.save(buf, format="png", compress_level=1)  # fast; a frame is ~30 KB anyway
        return buf.getvalue()

    def _report(self, exc: BaseException) -> None:
        """Show an error in the view (a failing step must not vanish in a background task)."""
        self.last_error = exc
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.error.value = (
            f"<pre style='color:#D55E00;white-space:pre-wrap'>{html.escape(text[-3000:])}</pre>"
        )

    # --- inspection -----------------------------------------------------------------------------
    def inspect(self, block_id: int) -> str:
        """Everything about one physical block now: kind, refcount, fill, owners (sequences and
        their requests), prefix-cache hash and the tokens it holds."""
        return inspect_block(self.state, block_id, self.tokenizer)

    def select(self, block_id: int) -> None:
        """Show :meth:`inspect` of ``block_id`` in the details panel (what a click does)."""
        text = self.inspect(block_id)
        self.selected = block_id
        self.details.value = f"<pre>{html.escape(text)}</pre>"

    @property
    def widget(self) -> w.VBox:
        return self._widget

    def _repr_mimebundle_(self, **kwargs):
        # The widget, for a running kernel; and the picture and stats line as they are now, for
        # every reader without one (a notebook read on GitHub, or opened before it is run).
        bundle = self._widget._repr_mimebundle_(**kwargs)
        bundle["image/png"] = base64.b64encode(self.image.value).decode("ascii")
        stats = re.sub(r"<[^>]+>", "", html.unescape(stats_html(self.state)))
        bundle["text/plain"] = f"{type(self).__name__}: {stats}"
        return bundle


class LiveBlockView(_PoolView):
    """A dashboard attached to a running engine: ``display(LiveBlockView(llm))``.

    ``.step()`` runs one engine step (the view redraws on the step event); ``.run(max_steps)``
    steps until every request is done (for notebooks executed headless). Play / Pause / Step
    buttons and a delay slider drive it interactively: Play runs as an asyncio task, so the
    kernel keeps handling clicks. ``.close()`` detaches it from the engine.
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
        self._book = RequestBook()
        self._task: asyncio.Task | None = None
        self.play_button = w.Button(description="Play", icon="play")
        self.pause_button = w.Button(description="Pause", icon="pause", disabled=True)
        self.step_button = w.Button(description="Step", icon="step-forward")
        self.speed = w.FloatSlider(
            value=delay, min=0.0, max=2.0, step=0.05, description="delay (s)"
        )
        self.play_button.on_click(lambda _: self.play())
        self.pause_button.on_click(lambda _: self.pause())
        self.step_button.on_click(lambda _: self._step_clicked())
        self._widget = self._layout(
            [self.play_button, self.pause_button, self.step_button, self.speed]
        )
        self._unsubscribe = engine.kv.trace.subscribe(self._on_event)
        self._show(pool_state(engine))

    def _show(self, state: PoolState) -> None:
        self._draw(state, self._book.update(state))

    def _on_event(self, event) -> None:
        if event.kind != "step":
            return
        try:  # a drawing bug must not break the engine's step: show it instead
            self._show(pool_state(self.engine.kv, event.info))
        except Exception as exc:
            self._report(exc)

    def step(self) -> list:
        """Run one engine step; returns its ``RequestOutput``s. Errors are shown and raised."""
        if self._unsubscribe is None:
            raise RuntimeError("this LiveBlockView is closed")
        if not self.engine.has_unfinished_requests():
            self.error.value = "<i>no unfinished requests: add some with engine.add_request</i>"
            return []
        self.error.value = ""
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
        on the kernel's loop). Without a running loop (a script), this is :meth:`run`."""
        if self._task is not None and not self._task.done():
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


class ReplayView(_PoolView):
    """Scrub through a recorded run: ``ReplayView(log)`` with ``log`` an ``EventLog``
    (``engine.record()``), its JSON text, or the path of a JSON file.

    ``.slider`` (an ``IntSlider`` linked to a ``Play`` widget) picks the frame -- one per engine
    step -- and ``.show(frame)`` does the same from code. Colours are assigned over the whole
    run first, so a request keeps its colour wherever you jump. ``tokenizer``: to decode the
    inspected blocks' tokens (else token ids are shown).
    """

    def __init__(self, log, *, per_row: int | None = None, tokenizer=None, interval=400) -> None:
        log = _load_log(log)
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
        for state in self.frames:  # colours in order of appearance over the whole run
            self.palette.assign(groups_in_order(state))
        book = RequestBook()
        self._finished = [book.update(state) for state in self.frames]
        last = len(self.frames) - 1
        self.player = w.Play(min=0, max=last, interval=interval, description="play")
        self.slider = w.IntSlider(min=0, max=last, description="frame")
        w.jslink((self.player, "value"), (self.slider, "value"))
        self.slider.observe(lambda change: self.show(change["new"]), "value")
        self.frame: int | None = None
        self._widget = self._layout([self.player, self.slider])
        self.show(0)

    @property
    def num_frames(self) -> int:
        return len(self.frames)

    def show(self, frame: int) -> None:
        """Draw frame ``frame`` (0 .. num_frames - 1) and move the slider there."""
        if isinstance(frame, bool) or not isinstance(frame, int):
            raise TypeError(f"frame must be an int, got {type(frame).__name__}")
        if not 0 <= frame < self.num_frames:
            raise ValueError(f"frame {frame} is out of range: this run has {self.num_frames}")
        if frame != self.frame:
            self.frame = frame
            self._draw(self.frames[frame], self._finished[frame])
        self.slider.value = frame  # no-op when the slider sent us here


def _load_log(log) -> EventLog:
    if isinstance(log, EventLog):
        return log
    if isinstance(log, str) and log.lstrip().startswith("{"):
        return EventLog.from_json(log)
    if isinstance(log, (str, os.PathLike)):
        if not os.path.exists(log):
            raise FileNotFoundError(
                f"no trace file {os.fspath(log)!r} (give an EventLog, its "
                "JSON text, or the path of a JSON file)"
            )
        with open(log, encoding="utf-8") as f:
            return EventLog.from_json(f.read())
    raise TypeError(
        f"ReplayView needs an EventLog, its JSON text or a path, got {type(log).__name__}"
    )
