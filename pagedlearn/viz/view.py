"""What the live view and the replay view share: the picture, the text panels, the inspector.

Laid out top to bottom, so that it fits a normal notebook column and nothing is cut off::

    [controls: Play / Pause / Step / delay, or play / step slider]
    [the pool picture: a PNG of PoolArtist, no legend -- it would leave a band that may grow]
    [stats line: step, blocks, queues]   [key: several requests / shared / free, cached / free]
                                         [and, with KV-cache groups: what each block tag means]
    [a message: what to do next, or the error a step raised]
    [request list: the legend, one coloured row each]  [Inspect a block: buttons that wrap]

The panels of a row wrap under each other in a narrow window, and the block buttons
wrap onto as many rows as the width allows. The request list is never wider than the column: its
lists of sequences wrap, and what is still too wide (a server's long request ids in a narrow
window) scrolls inside the list's own box. The picture is drawn by blitting: the static layer
(outlines, ids) once, then only what a frame changes (see ``last_draw_seconds``).
"""

from __future__ import annotations

import base64
import html
import io
import re
import time
import traceback

import ipywidgets as w
import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from PIL import Image

from pagedlearn.viz.panels import inspect_block, key_html, requests_html, stats_html
from pagedlearn.viz.pool import pool_figure
from pagedlearn.viz.state import PoolState, RequestState
from pagedlearn.viz.style import STYLE, text_color

DPI = 80
MAX_BUTTONS = 128  # larger pools get a block-id box instead of one button per block
BUTTON_W = 44  # px; each button takes BUTTON_W + 4 (its margins) in the wrapping box


def blit_png(canvas, figure, dynamic: list, background):
    """``figure`` as PNG bytes, redrawing only its ``dynamic`` artists: the static layer is
    drawn once (when ``background`` is None) and restored for every frame after. Returns the
    PNG and the background to pass next time."""
    if background is None:
        for a in dynamic:
            a.set_visible(False)
        canvas.draw()
        background = canvas.copy_from_bbox(figure.bbox)
        for a in dynamic:
            a.set_visible(True)
    canvas.restore_region(background)
    for a in dynamic:
        figure.draw_artist(a)
    size = canvas.get_width_height(physical=True)
    img = Image.frombuffer("RGBA", size, canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
    buf = io.BytesIO()
    img.save(buf, format="png", compress_level=1)  # fast; a frame is ~30 KB anyway
    return buf.getvalue(), background


class PoolView:
    """The picture, stats line, request list and block inspector of one pool."""

    def __init__(self, num_blocks: int, block_size: int, per_row, tokenizer) -> None:
        self.tokenizer = tokenizer
        with matplotlib.rc_context(STYLE):
            self.figure, self.artist = pool_figure(
                num_blocks, block_size, per_row=per_row, legend=False
            )
        self._canvas = FigureCanvasAgg(self.figure)
        self.figure.set_dpi(DPI)
        self._background, self._layout_version = None, None
        self.last_draw_seconds = 0.0  # update + PNG render of the last frame
        self.state: PoolState | None = None
        self.selected: int | None = None
        self.last_error: BaseException | None = None

        # Its own size (a flex column would stretch it, blurring it), shrunk to a narrow column
        # less its margins (2px a side): at exactly 100% the whole view would scroll by 4 px.
        picture = w.Layout(max_width="calc(100% - 4px)", height="auto", align_self="flex-start")
        self.image = w.Image(format="png", layout=picture)
        self.stats = w.HTML()
        self.key = w.HTML(key_html())
        self.error = w.HTML()
        # At most the column's width: a wider table (long request ids) wraps its lists of
        # sequences (panels.NAMES), and scrolls in this box, right under it, if still too wide.
        # Padding, not margin, keeps the gap to the inspector inside that width.
        fit = w.Layout(margin="0", padding="0 24px 0 0", max_width="100%", overflow="auto")
        self.requests = w.HTML(layout=fit)
        self.details = w.HTML("<i>click a block to inspect it</i>")
        if num_blocks <= MAX_BUTTONS:
            self.block_buttons = [
                w.Button(
                    description=str(b),
                    tooltip=f"inspect block {b}",
                    layout=w.Layout(width=f"{BUTTON_W}px", height="28px", padding="0"),
                )
                for b in range(num_blocks)
            ]
            for b, button in enumerate(self.block_buttons):
                button.on_click(lambda _, b=b: self.select(b))
            # A row of the picture per row of buttons when there is room; fewer when not.
            wrap = w.Layout(
                display="flex",
                flex_flow="row wrap",
                max_width=f"{self.artist.per_row * (BUTTON_W + 4)}px",
            )
            picker = w.Box(self.block_buttons, layout=wrap)
        else:
            self.block_buttons = []
            self.block_box = w.BoundedIntText(min=0, max=num_blocks - 1, description="block")
            self.block_box.observe(lambda change: self.select(change["new"]), "value")
            picker = self.block_box
        self.inspector = w.VBox(
            [w.HTML("<b>Inspect a block</b>"), picker, self.details],
            layout=w.Layout(flex="1 1 auto", min_width="0"),
        )

    def _layout(self, controls: list) -> w.VBox:
        row_wrap = w.Layout(display="flex", flex_flow="row wrap", align_items="flex-start")
        return w.VBox(
            [
                w.Box(controls, layout=row_wrap),
                self.image,
                w.Box([self.stats, self.key], layout=row_wrap),
                self.error,
                w.Box([self.requests, self.inspector], layout=row_wrap),
            ]
        )

    # --- drawing --------------------------------------------------------------------------------
    def _draw(self, state: PoolState, finished: list[RequestState]) -> None:
        """Show ``state``, which carries its colours (``state.colors``)."""
        t0 = time.perf_counter()
        with matplotlib.rc_context(STYLE):
            self.artist.update(state)
            png = self._render()
        self.last_draw_seconds = time.perf_counter() - t0
        self.state = state
        self.image.value = png
        self.stats.value = stats_html(state)
        key = key_html(state)  # with KV-cache groups, it also says what the block tags mean
        if self.key.value != key:
            self.key.value = key
        self.requests.value = requests_html(state, finished)
        for color, button in zip(self.artist.block_colors, self.block_buttons, strict=False):
            button.style.button_color = color  # the picture's colour, not computed again
            button.style.text_color = text_color(color)
        if self.selected is not None:
            self.select(self.selected)

    @property
    def colors(self) -> dict:
        """Request -> colour in the frame shown (what the picture, the buttons and the request
        list use; ``{}`` before the first frame)."""
        return dict(self.state.colors) if self.state is not None else {}

    def _render(self) -> bytes:
        """The figure as PNG bytes; the static layer is drawn again only when the layout
        changes (:func:`blit_png`)."""
        if self._layout_version != self.artist.layout_version:
            self._background, self._layout_version = None, self.artist.layout_version
        png, self._background = blit_png(
            self._canvas, self.figure, self.artist.dynamic_artists(), self._background
        )
        return png

    def _report(self, exc: BaseException) -> None:
        """Show an error in the view (a failing step must not vanish in a background task)."""
        self.last_error = exc
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.error.value = (
            f"<pre style='color:#D55E00;white-space:pre-wrap'>{html.escape(text[-3000:])}</pre>"
        )

    def _say(self, text: str) -> None:
        """A one-line message under the picture (what to do next, say)."""
        self.error.value = f"<i>{text}</i>" if text else ""

    # --- inspection -----------------------------------------------------------------------------
    def inspect(self, block_id: int) -> str:
        """Everything about one physical block now: kind, refcount, fill, owners (sequences and
        their requests), prefix-cache hash and the tokens it holds."""
        return inspect_block(self.state, block_id, self.tokenizer)

    def select(self, block_id: int) -> None:
        """Show :meth:`inspect` of ``block_id`` in the details panel (what a click does)."""
        text = self.inspect(block_id)
        self.selected = block_id
        # Wrap at spaces; a long run of token text may break anywhere rather than overflow.
        style = "white-space:pre-wrap;overflow-wrap:anywhere;margin:4px 0"
        self.details.value = f"<pre style='{style}'>{html.escape(text)}</pre>"

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
