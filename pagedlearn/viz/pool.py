"""The physical KV block pool as a grid: who owns each block, how full it is, who shares it.

One cell per physical block, in block-id order (row by row, ``per_row`` blocks a row)::

    ┌──────────┐   top band: the block id, and "x<refcount>" when several tables point here
    │  12 x2   │
    │█████░░[S]│   bar: filled in proportion to num_tokens / block_size, in the owning request's
    └──────────┘   colour; hatched when shared; light grey when free but still cached

``[S]``: in a model with several KV-cache groups (full and sliding-window layers), the tag of
the group whose table holds the block (pool_labels.group_tags; the legend names them). A
request's blocks have its colour in every group; the tag tells its groups apart.

:class:`PoolArtist` builds these matplotlib artists once and then only *changes* their
properties (colour, width, hatch, text) for each new :class:`~pagedlearn.viz.state.PoolState`.
That is what makes the live view fast: no figure, axes or patch is created per frame, and the
live view and the replay view draw through the very same code. :func:`draw_block_pool` is the
one-call static version.
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from pagedlearn.errors import PagedLearnError
from pagedlearn.viz.pool_labels import (
    MAX_LEGEND_GROUPS,
    draw_legend,
    group_tags,
    pool_title,
    shorten,
    token_text,
)
from pagedlearn.viz.state import PoolState, pool_state
from pagedlearn.viz.style import (
    FREE_COLOR,
    OUTLINE_COLOR,
    SHARED_HATCH,
    Palette,
    block_color,
    styled,
    text_color,
)

PAD = 0.06  # gap around a cell, in cell widths
# The most blocks a picture draws: a cell of 4-5 matplotlib artists each, 16 a row, so at the limit
# a figure is 256 rows (160 inches) tall, about 0.5 GiB to draw (measured), and no reader finds a
# block in it. The chapters draw at most 160; a trace file within its caps may describe 4 million
# (trace/limits.py), a GPU engine sized by memory tens of thousands. Read at each call: a course
# may raise it (pagedlearn.viz.pool.MAX_DRAWN_BLOCKS = ...).
MAX_DRAWN_BLOCKS = 4096


class PoolTooLargeError(PagedLearnError, ValueError):
    """A pool with more blocks than a picture draws (:data:`MAX_DRAWN_BLOCKS`)."""


def check_drawable(num_blocks) -> None:
    """Refuse a pool of more than :data:`MAX_DRAWN_BLOCKS` blocks, before anything is built
    for it (a figure, a frame, a button per block). Not an int: left to the caller's checks."""
    if isinstance(num_blocks, int) and num_blocks > MAX_DRAWN_BLOCKS:
        raise PoolTooLargeError(
            f"a pool of {num_blocks} blocks is too large to draw: the pictures draw at most "
            f"MAX_DRAWN_BLOCKS = {MAX_DRAWN_BLOCKS} (one cell per block). Draw a smaller pool "
            "(LLM(..., num_blocks=...)), or raise pagedlearn.viz.pool.MAX_DRAWN_BLOCKS"
        )


class PoolArtist:
    """The pool grid on ``ax``: build once, then :meth:`update` with each new state.

    ``per_row``: blocks per row (default: up to 16). Colours come from the state
    (``state.colors``, see :mod:`pagedlearn.viz.colors`); ``palette`` colours the states that
    carry none (a live manager's), and observes them. ``show_tokens``: also print the first
    characters of each block's tokens (decoded with ``tokenizer``, else ids) -- for small pools.
    ``legend``: draw the legend right of the grid (the live views list requests beside it).

    After an update, :attr:`block_colors` holds each block's colour (the live views paint their
    block buttons with it), and :meth:`face_colors`, :meth:`fill_fractions`, :meth:`hatches` and
    :meth:`labels` read back what is drawn for each block (tests compare them with the state).
    """

    def __init__(
        self,
        ax: Axes,
        num_blocks: int,
        block_size: int,
        *,
        per_row: int | None = None,
        palette: Palette | None = None,
        show_tokens: bool = False,
        tokenizer=None,
        legend: bool = True,
    ) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        check_drawable(num_blocks)
        per_row = _per_row(per_row, num_blocks)
        if palette is not None and not isinstance(palette, Palette):
            raise TypeError(f"palette must be a Palette, got {type(palette).__name__}")
        self.ax, self.num_blocks, self.block_size = ax, num_blocks, block_size
        self.per_row = per_row
        self.palette = palette if palette is not None else Palette()
        self.show_tokens, self.tokenizer, self.legend = show_tokens, tokenizer, legend
        self.title: str | None = None  # None: a title that counts the blocks of each kind
        self.state: PoolState | None = None
        self.block_colors: list[str] = []  # each block's colour as of the last update
        self.rows = -(-num_blocks // per_row)
        self._legend_key = None
        self.layout_version = 0
        self.max_legend_groups = MAX_LEGEND_GROUPS  # pool_figure fits it to the figure's height
        band = 0.55 if show_tokens else 0.42  # the label band's share of a cell's height
        self._bar_h = (1 - 2 * PAD) * (1 - band)
        self._bar_w = 1 - 2 * PAD
        # Static: outlines and block ids never change. Dynamic: bars, "x<refcount>", KV-cache
        # group tags, tokens, title.
        self._outlines, self._ids, self._bars, self._refs, self._tokens = [], [], [], [], []
        self._tags: list = []  # made by the first frame with KV-cache groups (_make_tags)
        band_h = 1 - 2 * PAD - self._bar_h
        h, label = 1 - 2 * PAD, {"va": "center", "fontsize": 10}
        for b in range(num_blocks):
            x, y = b % per_row + PAD, self.rows - 1 - b // per_row + PAD
            top = y + self._bar_h + band_h * (0.72 if show_tokens else 0.5)
            outline = Rectangle((x, y), self._bar_w, h, fill=False, edgecolor=OUTLINE_COLOR)
            bar = Rectangle((x, y), 0, self._bar_h, linewidth=0, facecolor=FREE_COLOR)
            self._outlines.append(ax.add_patch(outline))
            self._bars.append(ax.add_patch(bar))
            bar.set_gid(f"fill {b}")
            self._ids.append(ax.text(x + 0.08, top, str(b), ha="left", gid=f"id {b}", **label))
            right = x + self._bar_w - 0.06
            ref = ax.text(
                right, top, "", ha="right", fontweight="bold", gid=f"refcount {b}", **label
            )
            self._refs.append(ref)
            if show_tokens:
                mid = y + self._bar_h + band_h * 0.26
                self._tokens.append(ax.text(x + self._bar_w / 2, mid, "", ha="center", **label))
        ax.set_xlim(0, per_row)
        ax.set_ylim(0, self.rows)
        ax.set_aspect("equal")
        ax.set_axis_off()
        self._title = ax.set_title("", y=1.0, pad=8)  # a fixed y skips a slow layout pass

    # --- drawing --------------------------------------------------------------------------------
    def update(self, state: PoolState) -> None:
        """Show ``state``: change each block's colour, fill, hatch and label (nothing is created
        but the legend, and that only when the set of requests on screen changes)."""
        if not isinstance(state, PoolState):
            raise TypeError(f"PoolArtist.update needs a PoolState, got {type(state).__name__}")
        if state.num_blocks != self.num_blocks or state.block_size != self.block_size:
            raise ValueError(
                f"this artist draws {self.num_blocks} blocks of {self.block_size} tokens; the "
                f"state has {state.num_blocks} blocks of {state.block_size}"
            )
        if not state.colors:  # a live manager's state: this artist's palette colours it
            state = self.palette.paint(state)
        colors = state.colors
        group_of = {s: state.group_of(s) for s in state.tables}.__getitem__  # once per sequence
        self.block_colors = [block_color(blk, group_of, colors) for blk in state.blocks]
        for blk, color, bar, ref in zip(
            state.blocks, self.block_colors, self._bars, self._refs, strict=True
        ):
            bar.set_facecolor(color)
            bar.set_width(self._bar_w * blk.num_tokens / self.block_size)
            shared = blk.refcount > 1
            bar.set_hatch(SHARED_HATCH if shared else None)
            _set_hatch_color(bar, text_color(color))
            ref.set_text(f"x{blk.refcount}" if shared else "")
        tags = group_tags(state.kv_groups)  # {} for a one-group model: no tags
        if tags and not self._tags:
            self._make_tags()
        for blk, tag in zip(state.blocks, self._tags, strict=False):
            # One group per block: the coordinator's groups share the pool, never a block.
            tag.set_text(tags[state.kv_group_of(blk.owners[0])] if tags and blk.owners else "")
        for blk, text in zip(state.blocks, self._tokens, strict=False):
            text.set_text(
                shorten(token_text(blk.token_ids, self.tokenizer)) if blk.token_ids else ""
            )
        self._title.set_text(self.title if self.title is not None else pool_title(state))
        if self.legend:
            self._update_legend(state, {group_of(s) for s in state.tables})
        self.state = state

    def _make_tags(self) -> None:
        """A KV-cache group tag per cell: a white badge at the bar's right end, legible on any
        fill. Made once, by the first frame that has groups (a GPT-2 pool never has them)."""
        badge = {"boxstyle": "round,pad=0.15", "fc": "white", "ec": OUTLINE_COLOR, "lw": 0.6}
        for b, outline in enumerate(self._outlines):
            x, y = outline.get_xy()
            self._tags.append(
                self.ax.text(x + self._bar_w - 0.06, y + self._bar_h / 2, "", ha="right",
                             va="center", fontsize=10, bbox=badge, gid=f"group {b}")
            )  # fmt: skip
        self.layout_version += 1  # more dynamic artists: a renderer takes its background again

    def _update_legend(self, state: PoolState, owning: set) -> None:
        groups = [(g, c) for g, c in state.colors.items() if g in owning]  # in the state's order
        key = (tuple(groups), state.kv_groups)
        if key == self._legend_key:
            return
        self._legend_key = key
        self.layout_version += 1  # the legend is part of the static layer: redraw that too
        draw_legend(self.ax, groups, bool(state.requests), self.max_legend_groups, state.kv_groups)

    # --- what is drawn, per block (for tests and for the inspection buttons) --------------------
    def face_colors(self) -> list[str]:
        """The fill colour of each block, as "#rrggbb"."""
        from matplotlib.colors import to_hex

        return [to_hex(bar.get_facecolor()) for bar in self._bars]

    def fill_fractions(self) -> list[float]:
        """How much of each block's bar is filled (num_tokens / block_size as drawn)."""
        return [bar.get_width() / self._bar_w for bar in self._bars]

    def hatches(self) -> list[str]:
        """Each block's hatch pattern, "" when not shared."""
        return [bar.get_hatch() or "" for bar in self._bars]

    def group_tags(self) -> list[str]:
        """Each block's KV-cache group tag as drawn ("" for a free block, or one group)."""
        return [t.get_text() for t in self._tags] or [""] * self.num_blocks

    def labels(self) -> list[str]:
        """Each block's label: its id, and "x<refcount>" when shared."""
        return [
            f"{i.get_text()} {r.get_text()}".strip()
            for i, r in zip(self._ids, self._refs, strict=True)
        ]

    def cell_anchor(self, block_id: int) -> tuple[float, float]:
        """Data coordinates of the middle of a block cell's left edge (where arrows point)."""
        x, y = self._outlines[block_id].get_xy()
        return x, y + (1 - 2 * PAD) / 2

    def dynamic_artists(self) -> list:
        """The artists an update may change. A renderer may draw everything else once and
        then redraw only these (blitting) -- until :attr:`layout_version` changes."""
        return [*self._bars, *self._refs, *self._tags, *self._tokens, self._title]

    def drawn(self) -> list[tuple[str, float, str, str]]:
        """Everything drawn per block: (colour, fill fraction, hatch, label)."""
        return list(
            zip(
                self.face_colors(),
                self.fill_fractions(),
                self.hatches(),
                self.labels(),
                strict=True,
            )
        )


def default_per_row(num_blocks: int) -> int:
    return min(num_blocks, 16)


def _per_row(per_row, num_blocks: int) -> int:
    """``per_row`` (by default :func:`default_per_row`), checked: a positive int."""
    per_row = default_per_row(num_blocks) if per_row is None else per_row
    if not isinstance(per_row, int) or isinstance(per_row, bool) or per_row < 1:
        raise ValueError(f"per_row must be a positive int, got {per_row!r}")
    return per_row


def pool_figure(
    num_blocks: int,
    block_size: int,
    *,
    per_row: int | None = None,
    palette: Palette | None = None,
    show_tokens: bool = False,
    tokenizer=None,
    legend: bool = True,
) -> tuple[Figure, PoolArtist]:
    """A Figure sized for the pool, with its :class:`PoolArtist` (the live views use this too,
    with ``legend=False``: their request list is the legend, and the picture has no band left
    empty for a legend that may grow)."""
    check_drawable(num_blocks)  # before a figure is sized for it
    per_row = _per_row(per_row, num_blocks)
    cell = 0.95 if show_tokens else 0.62  # inches: room for a 10 pt label (and tokens)
    rows = -(-num_blocks // per_row)
    legend_w = 2.4 if legend else 0.0  # inches on the right for the legend
    grid_h = rows * cell
    # With a legend: tall enough for its 4 fixed entries and a few requests, 0.25 inch each.
    width = max(per_row * cell + legend_w + 0.3, 7.5)
    height = (max(grid_h, 2.25) if legend else grid_h) + 0.6
    fig = Figure(figsize=(width, height))
    bottom = (height - 0.5 - grid_h) / height  # the grid hangs from the top, under the title
    ax = fig.add_axes((0.15 / width, bottom, per_row * cell / width, grid_h / height))
    artist = PoolArtist(
        ax,
        num_blocks,
        block_size,
        per_row=per_row,
        palette=palette,
        show_tokens=show_tokens,
        tokenizer=tokenizer,
        legend=legend,
    )
    artist.max_legend_groups = max(2, int((height - 0.6) / 0.25) - 4)
    return fig, artist


@styled
def draw_block_pool(
    source,
    *,
    per_row: int | None = None,
    palette: Palette | None = None,
    title: str | None = None,
    show_tokens: bool = False,
    tokenizer=None,
) -> Figure:
    """The physical block pool as a grid: each block coloured by the request owning it, filled
    in proportion to the tokens it holds, hatched with "x<refcount>" when shared; free blocks
    white, free-but-cached blocks light grey.

    ``source``: a ``KVCacheManager``, ``LLMEngine``, ``LLM`` or a ``PoolState``. ``show_tokens``
    prints each block's first tokens (decoded with ``tokenizer``, by default the engine's).
    Colours: a replayed state's own (``state.colors``: those of its run, as the replay view
    shows them); else ``palette``'s (``Palette.follow(kv)`` for a live manager), else a fresh
    palette's. A pool of more than :data:`MAX_DRAWN_BLOCKS` blocks is refused
    (:class:`PoolTooLargeError`) before it is read.
    """
    check_drawable(_num_blocks(source))
    state = pool_state(source)
    if show_tokens and tokenizer is None:
        tokenizer = getattr(getattr(source, "engine", source), "tokenizer", None)
    fig, artist = pool_figure(
        state.num_blocks,
        state.block_size,
        per_row=per_row,
        palette=palette,
        show_tokens=show_tokens,
        tokenizer=tokenizer,
    )
    artist.title = title
    artist.update(state)
    return fig


def _num_blocks(source) -> int | None:
    """The size of the pool ``source`` holds (see :func:`pool_state`), without reading it."""
    if isinstance(source, PoolState):
        return source.num_blocks
    kv = getattr(getattr(source, "engine", source), "kv", source)
    return getattr(getattr(kv, "allocator", None), "num_blocks", None)


def _set_hatch_color(patch, color: str) -> None:
    if hasattr(patch, "set_hatchcolor"):  # matplotlib >= 3.10
        patch.set_hatchcolor(color)
    else:  # before, a hatch took the edge colour (the bars have no edge line: linewidth 0)
        patch.set_edgecolor(color)
