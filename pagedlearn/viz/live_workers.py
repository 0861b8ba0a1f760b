"""The live view's second picture under tensor parallelism: each worker's slab, every frame.

:class:`LiveSlabs` draws :mod:`pagedlearn.viz.workers`' picture for the frame the pool picture
shows, reading the slabs from the workers on the thread that steps the engine (the executor
is not thread-safe). :func:`stacked_png` puts both pictures in one PNG for readers without a
running kernel (a notebook read on GitHub).
"""

from __future__ import annotations

import io
import time

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pagedlearn.viz.state import PoolState
from pagedlearn.viz.style import STYLE
from pagedlearn.viz.view import blit_png
from pagedlearn.viz.workers import (
    SlabArtist,
    _check_layer,
    _engine_of,
    described,
    read_slabs,
    slabs_figure,
)


def shows_workers(engine, workers: bool | None) -> bool:
    """Whether a live view draws the worker slabs: ``workers``, or by default when the engine
    has more than one worker."""
    if workers is None:
        return getattr(getattr(engine, "kv_cache", None), "num_workers", 1) > 1
    if not isinstance(workers, bool):
        raise TypeError(f"workers must be True, False or None, got {workers!r}")
    return workers


class LiveSlabs:
    """The live view's second picture: :meth:`png` reads the slabs and draws them beside a
    frame (on the thread that steps the engine). The layout is built at the first frame (the
    workers' ``describe()`` is read there, on that thread too); later frames redraw only the
    cells and the title (blitting, as the pool picture does)."""

    def __init__(self, engine, *, layer: int = 0, dpi: int = 80) -> None:
        self.engine, self.layer, self.dpi = _check_layer(_engine_of(engine), layer), layer, dpi
        self.figure: Figure | None = None
        self.artist: SlabArtist | None = None
        self.workers: list[dict] | None = None
        self.last_draw_seconds = 0.0  # the rpcs + the render of the last frame

    def png(self, state: PoolState) -> bytes:
        t0 = time.perf_counter()
        slabs = read_slabs(self.engine, self.layer, self.workers)
        with matplotlib.rc_context(STYLE):
            if self.artist is None:
                self.workers = [described(s) for s in slabs]
                self.figure, self.artist = slabs_figure(state.num_blocks, self.workers,
                                                        legend=False)  # fmt: skip
                self.figure.set_dpi(self.dpi)
                self._canvas, self._background = FigureCanvasAgg(self.figure), None
            self.artist.update(state, slabs)
            dynamic = self.artist.dynamic_artists()
            png, self._background = blit_png(self._canvas, self.figure, dynamic, self._background)
        self.last_draw_seconds = time.perf_counter() - t0
        return png


def stacked_png(top: bytes, bottom: bytes) -> bytes:
    """Two PNGs as one, ``top`` above ``bottom``, left-aligned on white."""
    from PIL import Image

    a, b = Image.open(io.BytesIO(top)), Image.open(io.BytesIO(bottom))
    out = Image.new("RGB", (max(a.width, b.width), a.height + b.height), "white")
    out.paste(a, (0, 0))
    out.paste(b, (0, a.height))
    buf = io.BytesIO()
    out.save(buf, format="png", compress_level=1)
    return buf.getvalue()
