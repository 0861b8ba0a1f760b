"""Tensor parallelism, seen from the blocks: one block table, N slabs (paper section 4.6).

With ``LLM(..., tensor_parallel_size=N)`` the driver keeps the one scheduler and the one block
manager, and each of the N workers keeps a KV slab with *every* block id but only *its* KV heads
(pagedlearn/parallel/). This picture puts the two side by side, for one moment of an engine::

                         block id:  0   1   2   3   4   5   6   7
    driver (pid 100)               [a ][a ][a ][b ][b ][  ][  ][  ]   a.0 -> [0, 1, 2]
    one block table                                                   b.0 -> [3, 4]
    worker 0 (pid 101)    head 0   [a ][a ][a ][b ][b ][  ][  ][  ]
    KV heads 0-1          head 1   [a ][a ][a ][b ][b ][  ][  ][  ]
    worker 1 (pid 102)    head 2   [a ][a ][a ][b ][b ][  ][  ][  ]
    KV heads 2-3          head 3   [a ][a ][a ][b ][b ][  ][  ][  ]

The top row is the pool as the driver sees it: each block id coloured by the request whose
table holds it (the colours of every other picture: :mod:`pagedlearn.viz.colors`). Below, one
band per worker, one row per KV head it holds: a cell is coloured when that worker has written
its heads of that block (``Worker.block_usage``: mean |key| > 0 in ``layer``), else left empty.
What a learner should see: **the same block ids in every worker, different heads**. The
driver's block table says *which* block; each worker holds its own heads of it, so one table
serves all of them and the workers never agree on anything but the step they are sent.

A freed block keeps its old K/V until a new owner overwrites it; nothing points at it, so it
is drawn empty here as in the pool (a free block still in the prefix cache: light grey in both).

The worker rows come from ``collective_rpc(engine, "describe")`` and ``(engine,
"block_usage")`` -- the real slabs, in the worker processes. An rpc goes through the executor,
which is not thread-safe: read the slabs on the thread that steps the engine (the live view
does it inside the step event; a served engine: ``srv.call(draw_worker_slabs)``). With
``tensor_parallel_size=1`` the one "worker" is the engine itself: one band, every head.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.colors import to_hex, to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from pagedlearn.viz.pool import check_drawable
from pagedlearn.viz.state import PoolState, pool_state, step_label
from pagedlearn.viz.style import (
    CACHED_COLOR,
    FREE_COLOR,
    MIXED_COLOR,
    OUTLINE_COLOR,
    Palette,
    block_color,
    styled,
)

MAX_LEGEND_REQUESTS = 8
# Inches: the picture's geometry (a 10 pt label fits a 0.3-inch cell's block id).
CELL, ROW, DRIVER_ROW, LEFT, LEGEND_W, GRID_MAX_W = 0.3, 0.3, 0.34, 2.6, 3.2, 13.0
TOP, GAP, WORKER_GAP, BOTTOM = 1.1, 0.5, 0.22, 0.65


@dataclass(frozen=True, eq=False)
class WorkerSlab:
    """One worker's KV slab at one moment, as the picture needs it."""

    rank: int
    pid: int
    device: str
    head_ids: tuple[int, ...]  # the model's KV heads this worker holds, in its slab's order
    written: np.ndarray = field(repr=False)  # (num_blocks, len(head_ids)) bool: usage > 0
    layer: int = 0


def heads_label(head_ids) -> str:
    """``"KV head 0"``, ``"KV heads 0-1"`` (a contiguous run) or ``"KV heads 0, 2"``."""
    h = list(head_ids)
    if len(h) == 1:
        return f"KV head {h[0]}"
    if h == list(range(h[0], h[0] + len(h))):
        return f"KV heads {h[0]}-{h[-1]}"
    return "KV heads " + ", ".join(map(str, h))


def _engine_of(source):
    engine = getattr(source, "engine", source)
    if not (hasattr(engine, "runner") and hasattr(engine, "kv_cache") and hasattr(engine, "kv")):
        raise TypeError(
            f"worker slabs need an LLM or an LLMEngine, got {type(source).__name__} (a served "
            "engine: srv.call(lambda engine: draw_worker_slabs(engine)))"
        )
    return engine


def _check_layer(engine, layer):
    num_layers = engine.kv_cache.spec.num_layers
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise ValueError(f"layer must be an int in 0..{num_layers - 1}, got {layer!r}")
    return engine


def described(slab: WorkerSlab) -> dict:
    """The part of a worker's ``describe()`` a slab keeps (what :func:`read_slabs` takes back)."""
    return {"rank": slab.rank, "pid": slab.pid, "device": slab.device,
            "kv_heads": list(slab.head_ids)}  # fmt: skip


def read_slabs(source, layer: int = 0, workers: list[dict] | None = None) -> list[WorkerSlab]:
    """Every worker's slab now, by rank (two rpcs; ``workers``: their ``describe()`` if already
    read -- who holds which heads never changes). Call it on the thread that steps the engine.

    An rpc is a message to the workers like a step's: the executor's ``last_timings`` are put
    back afterwards, so a reader still finds those of the last step."""
    from pagedlearn.parallel import collective_rpc  # here: importing the executor is slow

    engine = _check_layer(_engine_of(source), layer)
    timings = getattr(engine.runner, "last_timings", None)
    try:
        if workers is None:
            workers = collective_rpc(engine, "describe")
        usage = collective_rpc(engine, "block_usage", (layer,))
    finally:
        if timings is not None:
            engine.runner.last_timings = timings
    num_blocks = engine.kv.allocator.num_blocks
    slabs = []
    for info, u in zip(workers, usage, strict=True):
        if tuple(u.shape) != (num_blocks, len(info["kv_heads"])):
            raise ValueError(
                f"worker {info['rank']}'s block_usage has shape {tuple(u.shape)}; expected "
                f"({num_blocks} blocks, {len(info['kv_heads'])} heads)"
            )
        written = (u > 0).numpy()
        slabs.append(WorkerSlab(info["rank"], info["pid"], info["device"],
                                tuple(info["kv_heads"]), written, layer))  # fmt: skip
    return slabs


def slab_cells(state: PoolState, slab: WorkerSlab) -> list[list[str]]:
    """The colour of each of ``slab``'s cells, ``[head row][block id]``: the block's colour in
    the pool (``state.colors``: a painted state) where this worker has written the block,
    else free (white)."""
    pool = pool_row(state)
    return [[pool[b] if slab.written[b, r] else FREE_COLOR for b in range(len(pool))]
            for r in range(len(slab.head_ids))]  # fmt: skip


def pool_row(state: PoolState) -> list[str]:
    """Each block's colour as the driver's table says (the pool picture's colours)."""
    group_of = {s: state.group_of(s) for s in state.tables}.__getitem__
    return [block_color(b, group_of, state.colors) for b in state.blocks]


class SlabArtist:
    """The picture on ``fig``: the driver's row on top, a band per worker below. Build once (the
    layout: ``workers``, their ``describe()``), then :meth:`update` with each moment."""

    def __init__(self, fig: Figure, num_blocks: int, workers: list[dict], *, legend: bool) -> None:
        check_drawable(num_blocks)
        self.fig, self.num_blocks, self.legend = fig, num_blocks, legend
        self.workers = workers
        cell, row = _sizes(num_blocks, workers)
        width, height = fig.get_size_inches()
        bands = [("driver", 1, DRIVER_ROW)] + [(w, len(w["kv_heads"]), row) for w in workers]
        y = height - TOP
        self.axes, self.images, self._lines = [], [], []
        for i, (who, rows, h) in enumerate(bands):
            y -= rows * h
            ax = fig.add_axes((LEFT / width, y / height, num_blocks * cell / width,
                               rows * h / height))  # fmt: skip
            y -= GAP if i == 0 else WORKER_GAP
            blank = np.ones((rows, num_blocks, 3))
            img = ax.imshow(blank, aspect="auto", interpolation="nearest",
                            extent=(-0.5, num_blocks - 0.5, rows - 0.5, -0.5))  # fmt: skip
            img.set_gid("driver" if i == 0 else f"worker {who['rank']}")
            self.axes.append(ax)
            self.images.append(img)
            if cell >= 0.12:  # cell borders, drawn over the colours; none when cells are slivers
                self._lines.append(ax.add_collection(_borders(num_blocks, rows)))
            for spine in ax.spines.values():
                spine.set_edgecolor(OUTLINE_COLOR)
            _label_band(ax, who, rows, num_blocks, cell, last=i == len(bands) - 1)
        note = ("every step sends these block ids to every worker; each writes only its heads"
                if len(workers) > 1 else "one worker: the whole model, every KV head")  # fmt: skip
        top = self.axes[0].get_position()
        fig.text(top.x0 + top.width / 2, top.y0 - 0.5 * GAP / height, note, ha="center",
                 va="center", style="italic", fontsize=10)  # fmt: skip
        self._title = fig.text(LEFT / width, 1 - 0.12 / height, "", ha="left", va="top")
        self.state: PoolState | None = None

    def update(self, state: PoolState, slabs: list[WorkerSlab], title: str | None = None) -> None:
        """Show ``state`` (with its colours) and the workers' ``slabs`` of the same moment."""
        if state.num_blocks != self.num_blocks or len(slabs) != len(self.workers):
            raise ValueError(
                f"this picture draws {self.num_blocks} blocks and {len(self.workers)} workers; "
                f"got {state.num_blocks} blocks and {len(slabs)} slabs"
            )
        self.images[0].set_data(_rgb([pool_row(state)]))
        for img, slab in zip(self.images[1:], slabs, strict=True):
            img.set_data(_rgb(slab_cells(state, slab)))
        if title is None:
            label = step_label(state) or "now"
            who = f"the same block ids in all {len(slabs)} workers, each with its own KV heads"
            if len(slabs) == 1:
                who = "tensor_parallel_size=1: one worker holds every head"
            head = "the driver's one block table and each worker's KV slab"
            title = f"{label}: {head} (layer {slabs[0].layer})\n{who}"
        self._title.set_text(title)
        if self.legend:
            _draw_legend(self.fig, self.axes[0], state)
        self.state = state

    def cell_colors(self) -> list[list[list[str]]]:
        """What is drawn: ``[band][row][block id]`` as "#rrggbb"; band 0 is the driver's row,
        band ``1 + r`` worker ``r``'s heads (tests compare it with the state)."""
        return [[[to_hex(c) for c in row] for row in np.asarray(img.get_array())]
                for img in self.images]  # fmt: skip

    def dynamic_artists(self) -> list:
        """What an update changes (the cell borders are redrawn over the colours)."""
        return [*self.images, *self._lines, self._title]


def _sizes(num_blocks: int, workers: list[dict]) -> tuple[float, float]:
    """A cell's width and a head row's height, in inches (shrunk for large pools, many heads)."""
    heads = sum(len(w["kv_heads"]) for w in workers)
    return min(CELL, GRID_MAX_W / num_blocks), min(ROW, 8.0 / max(heads, 1))


def _borders(num_blocks: int, rows: int) -> LineCollection:
    xs = np.arange(num_blocks + 1) - 0.5
    ys = np.arange(rows + 1) - 0.5
    segs = [[(x, -0.5), (x, rows - 0.5)] for x in xs]
    segs += [[(-0.5, y), (num_blocks - 0.5, y)] for y in ys]
    return LineCollection(segs, colors=OUTLINE_COLOR, linewidths=0.6)


def _label_band(ax, who, rows: int, num_blocks: int, cell: float, last: bool) -> None:
    every = max(1, int(np.ceil(0.25 / cell)))  # a 10 pt block id every quarter inch at most
    ticks = list(range(0, num_blocks, every))
    ax.set_xticks(ticks if who == "driver" or last else [])
    if who == "driver":
        ax.xaxis.tick_top()
        ax.xaxis.set_label_position("top")
        ax.set_xlabel("physical block id")
        ax.set_yticks([])
        text = f"driver (pid {os.getpid()})\none block table"
    else:
        ax.set_yticks(range(rows), [f"head {h}" for h in who["kv_heads"]])
        if last:
            ax.set_xlabel("physical block id: the same in every worker")
        text = f"worker {who['rank']} (pid {who['pid']})\n{heads_label(who['kv_heads'])}"
    ax.tick_params(labelsize=10, length=2)
    ax.set_ylabel(text, rotation=0, ha="right", va="center", labelpad=10)


def _rgb(cells: list[list[str]]) -> np.ndarray:
    lookup: dict[str, tuple] = {}
    return np.array([[lookup.setdefault(c, to_rgb(c)) for c in row] for row in cells])


def _draw_legend(fig: Figure, ax, state: PoolState) -> None:
    """Each request holding blocks (its colour, its tables' block ids), then the fixed looks."""
    handles = []
    for g, color in state.colors.items():
        tables = [f"{s}: {list(t)}" for s, t in state.tables.items() if state.group_of(s) == g]
        if tables:
            text = "; ".join(tables)
            handles.append(Patch(facecolor=color, label=text if len(text) <= 34 else
                                 text[:33] + "…"))  # fmt: skip
    if len(handles) > MAX_LEGEND_REQUESTS:
        more = len(handles) - MAX_LEGEND_REQUESTS + 1
        handles = handles[: MAX_LEGEND_REQUESTS - 1]
        handles.append(Patch(facecolor="none", edgecolor="none", label=f"+{more} more"))
    handles += [
        Patch(facecolor=MIXED_COLOR, label="several requests"),
        Patch(facecolor=CACHED_COLOR, edgecolor=OUTLINE_COLOR, label="free, cached"),
        Patch(facecolor=FREE_COLOR, edgecolor=OUTLINE_COLOR, label="free / not written"),
    ]
    for old in list(fig.legends):
        old.remove()
    pos = ax.get_position()
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(pos.x1 + 0.01, pos.y1),
               frameon=False, title="block tables (sequence: block ids)")  # fmt: skip


def slabs_figure(num_blocks: int, workers: list[dict], *, legend: bool = True):
    """A Figure sized for ``num_blocks`` blocks and ``workers`` (their ``describe()``), with its
    :class:`SlabArtist`; ``legend``: the block tables right of the picture (the live view has
    its request list instead)."""
    check_drawable(num_blocks)
    if not workers:
        raise ValueError("slabs_figure needs at least one worker's describe()")
    cell, row = _sizes(num_blocks, workers)
    heads = sum(len(w["kv_heads"]) for w in workers)
    width = max(LEFT + num_blocks * cell + (LEGEND_W if legend else 0.3), 8.0)
    height = TOP + DRIVER_ROW + GAP + heads * row + WORKER_GAP * (len(workers) - 1) + BOTTOM
    fig = Figure(figsize=(width, height))
    return fig, SlabArtist(fig, num_blocks, workers, legend=legend)


@styled
def draw_worker_slabs(
    source, *, layer: int = 0, palette: Palette | None = None, title: str | None = None
) -> Figure:
    """The driver's one block table over each worker's KV slab (the module's picture), for an
    ``LLM`` or ``LLMEngine`` as it is now; ``layer``: whose keys say "written". Colours: those
    of ``palette`` (``Palette.follow(llm)``: as the live view and the replay colour the run),
    else a fresh palette's. Call it on the thread that steps the engine."""
    engine = _engine_of(source)
    slabs = read_slabs(engine, layer)
    state = (palette if palette is not None else Palette()).paint(pool_state(engine))
    fig, artist = slabs_figure(state.num_blocks, [described(s) for s in slabs])
    artist.update(state, slabs, title)
    return fig
