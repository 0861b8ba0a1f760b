"""Watch a running server's prefix cache through its KV-event stream: a live notebook view.

``display(KVEventsLiveView(sub))`` for a running
:class:`~pagedlearn.kv_events.subscriber.KVEventSubscriber` (vLLM's stream or pagedlearn's own):
the view takes the batches the subscriber has received, applies them to its
:class:`~pagedlearn.kv_events.cache_state.KVCacheState` and redraws the prefix tree
(:mod:`pagedlearn.viz.prefix_tree`) and the timeline (:mod:`pagedlearn.viz.kv_events_timeline`)
at most ``max_fps`` times a second -- a tree of many blocks takes a while to draw, and the stream
may bring hundreds of batches a second. Laid out top to bottom, like the engine's live view::

    [Stop] [colour by: age | medium]
    [status: the subscriber's counters (received, malformed, gaps, replayed, dropped), its state
     ("live", "no batch for 12 s"), and the cache (blocks per medium, problems)]
    [the prefix tree]
    [the timeline]
    [problems: the last ones, said]

It never blocks the kernel: in a notebook it follows as an asyncio task on the kernel's own
loop (so every widget is touched on the kernel's thread; the subscriber's own thread does the
socket work), waking ``max_fps`` times a second to :meth:`~KVEventsLiveView.update`. Without a
running loop (a script) it follows on a thread of its own instead. Stop (the button, or
:meth:`stop`) ends the following; the subscriber keeps running (close it yourself).
``update(pairs)`` also takes ``(seq, batch)`` pairs directly -- a recording's, say -- with no
subscriber at all.
"""

from __future__ import annotations

import asyncio
import base64
import html
import io
import threading
import time
import traceback

import ipywidgets as w

from pagedlearn.kv_events.cache_state import KVCacheState
from pagedlearn.viz.prefix_tree import COLOR_BY
from pagedlearn.viz.view import DPI

COUNTERS = ("received", "malformed", "gaps", "missed", "replayed", "dropped", "duplicates",
            "out_of_order", "restarts")  # fmt: skip
DEFAULT_FPS = 2.0


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


class KVEventsLiveView:
    """The live view of a KV-event stream (module docstring). ``source``: a subscriber (an
    object with ``poll()`` and ``status()``), or None to feed :meth:`update` by hand. ``state``:
    the picture to update (default a new one). ``color_by``: ``"age"`` or ``"medium"``;
    ``tokenizer`` labels blocks with text; ``timeline``: draw it too. ``follow``: start
    following at once (default: when there is a source). ``frames_drawn`` and
    ``last_draw_seconds`` say what drawing cost."""

    def __init__(
        self,
        source=None,
        state: KVCacheState | None = None,
        *,
        color_by: str = "age",
        tokenizer=None,
        max_fps: float = DEFAULT_FPS,
        timeline: bool = True,
        follow: bool | None = None,
    ) -> None:
        if source is not None and not (hasattr(source, "poll") and hasattr(source, "status")):
            raise TypeError(
                f"KVEventsLiveView needs a KVEventSubscriber (or None), got {type(source).__name__}"
            )
        if isinstance(max_fps, bool) or not isinstance(max_fps, (int, float)) or max_fps <= 0:
            raise ValueError(f"max_fps must be a number of frames a second > 0, got {max_fps!r}")
        if color_by not in COLOR_BY:
            raise ValueError(f"color_by must be 'age' or 'medium', got {color_by!r}")
        self.source, self.state = source, state if state is not None else KVCacheState()
        self.tokenizer, self.max_fps, self.with_timeline = tokenizer, float(max_fps), timeline
        self.frames_drawn, self.last_draw_seconds, self.last_error = 0, 0.0, None
        self._last_draw = -float("inf")  # time.monotonic() at the end of the last drawing
        # The cache's summary walks the whole tree (a third of a second at 90,000 blocks): it is
        # made again only when the state took in something new, not at every update.
        self._summary, self._summary_of = None, None
        self._dirty = True
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._task: asyncio.Task | None = None
        self._thread: threading.Thread | None = None

        self.stop_button = w.Button(description="Stop", icon="stop", tooltip="stop following")
        self.stop_button.on_click(lambda _: self.stop())
        self.color = w.ToggleButtons(options=list(COLOR_BY), value=color_by,
                                     description="colour by")  # fmt: skip
        self.color.observe(lambda _: self._redraw_now(), "value")
        self.status = w.HTML()
        picture = w.Layout(max_width="100%", height="auto", align_self="flex-start")
        self.tree_image = w.Image(format="png", layout=picture)
        self.timeline_image = w.Image(format="png", layout=picture)
        self.problems = w.HTML()
        row = w.Layout(display="flex", flex_flow="row wrap", align_items="center")
        kids = [w.Box([self.stop_button, self.color], layout=row), self.status, self.tree_image]
        kids += [self.timeline_image] if timeline else []
        self.widget = w.VBox([*kids, self.problems])
        self.update(force=True)
        if follow if follow is not None else source is not None:
            self.start()

    # --- one update: take in what came, redraw at most max_fps times a second ------------------
    def update(self, pairs=None, *, force: bool = False) -> int:
        """Apply ``pairs`` (default: what the subscriber has received since the last update),
        refresh the status line, and redraw if something changed and the last drawing is at
        least ``1 / max_fps`` s old (``force``: now). Returns the batches applied. An error is
        shown in the view and kept in ``last_error``, never raised into a background task."""
        with self._lock:  # the follower thread and a caller: one update at a time
            return self._update(pairs, force)

    def _update(self, pairs, force: bool) -> int:
        try:
            if pairs is None and self.source is not None:
                pairs = self.source.poll()
            applied = self.state.extend(pairs or [])
            self._dirty = self._dirty or applied > 0
            self.status.value = self.status_html()
            due = time.monotonic() - self._last_draw >= 1.0 / self.max_fps
            if self._dirty and (due or force):
                self._draw()
            return applied
        except Exception as exc:
            self._report(exc)
            return 0

    def status_html(self) -> str:
        """The status line: the subscriber's counters and state, and the cache in numbers."""
        parts = []
        if self.source is not None:
            st = self.source.status()
            counts = " · ".join(f"{k} {st[k]}" for k in COUNTERS if st.get(k) or k == "received")
            parts.append(f"<b>{html.escape(str(st.get('state', '')))}</b> · {counts}")
        s = self.summary()
        where = ", ".join(f"{k} {n}" for k, n in s.per_place.items()) or "empty"
        line = f"cached now: {s.blocks} blocks ({where}), {s.roots} roots, deepest {s.deepest}"
        if s.problems:
            line += " · " + ", ".join(f"{k} {n}" for k, n in s.problems.items())
        parts.append(html.escape(line) + (" · <b>stopped</b>" if self._stop.is_set() else ""))
        if s.capped:
            parts.append(f"<span style='color:#D55E00'>{html.escape(s.capped)}</span>")
        return "<br>".join(parts)

    def summary(self):
        """The state's :meth:`~KVCacheState.summary` (``top=0``), kept while nothing new came."""
        received = self.state.received
        now = (received["batches"], received["events"])
        if self._summary is None or self._summary_of != now:
            self._summary, self._summary_of = self.state.summary(top=0), now
        return self._summary

    def _draw(self) -> None:
        from pagedlearn.viz.kv_events_timeline import draw_kv_events_timeline
        from pagedlearn.viz.prefix_tree import draw_prefix_tree

        t0 = time.perf_counter()
        self.tree_image.value = png(
            draw_prefix_tree(self.state, color_by=self.color.value, tokenizer=self.tokenizer)
        )
        if self.with_timeline and self.state.timeline:
            self.timeline_image.value = png(draw_kv_events_timeline(self.state))
        notes = list(self.state.notes)[-5:]
        self.problems.value = "".join(f"<div><i>{html.escape(n)}</i></div>" for n in notes)
        self.last_draw_seconds = time.perf_counter() - t0
        self._last_draw, self._dirty = time.monotonic(), False
        self.frames_drawn += 1

    def _redraw_now(self) -> None:
        self._dirty = True
        self.update(pairs=[], force=True)

    def _report(self, exc: BaseException) -> None:
        self.last_error = exc
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-3000:]
        self.problems.value = f"<pre style='color:#D55E00'>{html.escape(text)}</pre>"

    # --- following -------------------------------------------------------------------------------
    def start(self) -> None:
        """Follow the subscriber: an asyncio task on the running loop (a notebook's kernel), or
        a thread where no loop runs (a script)."""
        if self.source is None:
            raise RuntimeError("this view has no subscriber to follow: feed it with update(pairs)")
        if self.following:
            return
        self._stop.clear()
        self.stop_button.disabled = False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._thread = threading.Thread(target=self._follow_thread, daemon=True,
                                            name="pagedlearn-kv-view")  # fmt: skip
            self._thread.start()
        else:
            self._task = loop.create_task(self._follow())

    async def _follow(self) -> None:
        while not self._stop.is_set():
            self.update()
            await asyncio.sleep(1.0 / self.max_fps)

    def _follow_thread(self) -> None:
        while not self._stop.wait(1.0 / self.max_fps):
            self.update()

    @property
    def following(self) -> bool:
        task_on = self._task is not None and not self._task.done()
        return task_on or (self._thread is not None and self._thread.is_alive())

    def stop(self) -> None:
        """Stop following (the picture stays; the subscriber keeps running)."""
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)  # its update in progress ends first
        self.stop_button.disabled = True
        self.update(pairs=[], force=True)  # the last picture, with "stopped" in the status

    def _repr_mimebundle_(self, **kwargs):
        # The widget for a live kernel; the tree as a PNG for a reader without one.
        bundle = self.widget._repr_mimebundle_(**kwargs)
        if self.tree_image.value:
            bundle["image/png"] = base64.b64encode(self.tree_image.value).decode("ascii")
        bundle["text/plain"] = f"KVEventsLiveView: {len(self.state.blocks)} blocks"
        return bundle
