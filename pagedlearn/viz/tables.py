"""Block tables: each sequence's logical blocks, with an arrow to the physical block that holds it.

This is the paper's Figure 6/7 drawn from the real state. Left, one row per sequence (grouped
and coloured by request): its logical blocks in order, ``logical 0, logical 1, ...``, each
filled in proportion to the tokens it holds -- only the last one may be partly empty. Right, the
physical pool exactly as :func:`~pagedlearn.viz.pool.draw_block_pool` draws it. An arrow runs
from every block-table entry to its physical block, so a block shared after a fork (or a prefix
cache hit) gets several incoming arrows and shows its refcount ("x2").

Sequences swapped out to the CPU have no arrows into the GPU pool: they are listed below as
"swapped out (CPU blocks ...)".

A model with several KV-cache groups (full and sliding-window layers) has a table per sequence
*per group*: one row each, labelled ``a · full``, ``a · sliding 24``, a sequence's rows together
and in its request's colour. A sliding group's table starts with **freed** entries: blocks its
window left behind, now back in the pool (the entry is -1, ``NULL_BLOCK``). They keep their
place -- logical block ``j`` still holds positions ``j * block_size ...`` -- but point nowhere:
drawn grey and crossed, without an arrow, and never read by attention. In a table longer than
``MAX_LOGICAL``, a run of them is drawn as one cell (``logical 0–12``, ``13 freed``).
"""

from __future__ import annotations

from collections.abc import Hashable

from matplotlib.figure import Figure
from matplotlib.patches import ConnectionPatch, Rectangle
from matplotlib.patheffects import Normal, Stroke

from pagedlearn.core.block_table import NULL_BLOCK
from pagedlearn.viz.pool import PoolArtist
from pagedlearn.viz.state import PoolState, groups_in_order, pool_state, step_label
from pagedlearn.viz.style import OUTLINE_COLOR, Palette, styled

MAX_SEQS = 8  # rows that stay readable; more are left out, and the title says so
MAX_LOGICAL = 10  # logical blocks drawn per row; the rest are summarised as "+k more"
ROW_H, BOX_W, BOX_H, LABEL_W = 0.75, 0.95, 0.6, 1.45  # inches
GROUPS_LABEL_W = 2.2  # inches: room for "a.0 · sliding 24" when a model has KV-cache groups
POOL_CELL, ARROW_GAP, LEGEND_W = 0.62, 1.3, 2.4  # inches
FREED_FACE, FREED_EDGE, FREED_HATCH = "#f0f0f0", "#9a9a9a", "xx"  # a null entry: grey, crossed
FREED_NOTE = (
    "grey crossed entries: blocks the sliding window left behind, back in the pool "
    "(null, -1: never read)"
)


@styled
def draw_block_tables(
    source,
    seqs=None,
    *,
    palette: Palette | None = None,
    title: str | None = None,
) -> Figure:
    """Each sequence's block table as arrows from its logical blocks to physical blocks.

    ``source``: a ``KVCacheManager`` (or ``KVCacheCoordinator``), ``LLMEngine``, ``LLM`` or
    ``PoolState``; colours as :func:`~pagedlearn.viz.pool.draw_block_pool` picks them.
    ``seqs``: the sequence ids to show (default: all, GPU-resident first, then swapped out; at
    most ``MAX_SEQS`` rows); with KV-cache groups, a sequence id shows its table in every group
    and a table's name (``"a|full"``) that one. The arrows are ``ConnectionPatch`` artists in
    ``fig.artists``, one per drawn block-table entry, with ``gid``
    ``"<seq>:<logical>-><physical>"`` (``<seq>``: the table's name); a freed entry has none.
    """
    state = pool_state(source)
    if palette is not None and not isinstance(palette, Palette):
        raise TypeError(f"palette must be a Palette, got {type(palette).__name__}")
    if not state.colors:  # a live manager's state: the palette colours it (viz/colors.py)
        state = (palette if palette is not None else Palette()).paint(state)
    chosen, notes = _choose(state, seqs)
    gpu = [s for s in chosen if s in state.tables]
    cpu = [s for s in chosen if s in state.swapped]
    cells = {s: row_cells(state.tables[s]) for s in gpu}
    shown = max((len(c) for c in cells.values()), default=1) or 1
    if any(c and c[-1][0] == "more" for c in cells.values()):
        notes.append(f"first {MAX_LOGICAL - 1} logical blocks per sequence")
    freed = any(kind == "freed" for c in cells.values() for kind, *_ in c)
    label_w = GROUPS_LABEL_W if state.kv_groups else LABEL_W

    # Sizes in inches; the left axes uses inches as data units, so boxes keep their shape.
    n = state.num_blocks
    pcols = 1 if n <= 12 else min(16, -(-n // max(8, round(len(chosen) * ROW_H / POOL_CELL))))
    prows = -(-n // pcols)
    left_w = label_w + shown * (BOX_W + 0.1)
    left_h = max(len(chosen), 1) * ROW_H
    grid_h = prows * POOL_CELL
    body_h = max(left_h, grid_h, 2.25)
    width = left_w + ARROW_GAP + pcols * POOL_CELL + LEGEND_W + 0.3
    title_h = 0.6 + (0.22 * (1 + bool(notes)) if freed else 0)  # room for FREED_NOTE
    height = body_h + title_h + 0.3
    fig = Figure(figsize=(width, height))
    top = (height - title_h) / height  # below the title
    left = fig.add_axes((0.1 / width, top - left_h / height, left_w / width, left_h / height))
    left.set_xlim(0, left_w)
    left.set_ylim(0, left_h)
    left.set_axis_off()
    right = fig.add_axes(
        (
            (0.1 + left_w + ARROW_GAP) / width,
            top - grid_h / height,
            pcols * POOL_CELL / width,
            grid_h / height,
        )
    )
    pool = PoolArtist(right, n, state.block_size, per_row=pcols)
    pool.max_legend_groups = max(2, int(body_h / 0.25) - 4)
    pool.title = "physical blocks"
    pool.update(state)

    if not chosen:
        left.text(0, left_h / 2, "no sequences in the pool", va="center", fontsize=11)
    for row, seq in enumerate(chosen):
        y = left_h - (row + 1) * ROW_H + (ROW_H - BOX_H) / 2
        color = state.colors[state.group_of(seq)]
        left.add_patch(Rectangle((0, y), 0.08, BOX_H, facecolor=color, linewidth=0))
        left.text(0.15, y + BOX_H / 2, row_label(state, seq), va="center", fontsize=10)
        if seq in cpu:
            left.text(label_w, y + BOX_H / 2, _swapped_text(state.swapped[seq]), va="center",
                      fontsize=10, style="italic", color="#555555")  # fmt: skip
            continue
        tokens = state.num_tokens.get(seq, 0)
        for i, (kind, j, block) in enumerate(cells[seq]):
            x = label_w + i * (BOX_W + 0.1)
            if kind == "more":
                left.text(x + 0.05, y + BOX_H / 2, f"+{block} more", va="center", fontsize=10)
            elif kind == "freed":
                _freed_cell(left, x, y, j, block)
            else:
                fill = min(max(tokens - j * state.block_size, 0), state.block_size)
                _block_cell(left, x, y, j, block, color, fill / state.block_size)
                arrow = ConnectionPatch(
                    (x + BOX_W, y + BOX_H * 0.5),
                    pool.cell_anchor(block),
                    coordsA=left.transData,
                    coordsB=right.transData,
                    arrowstyle="-|>",
                    mutation_scale=12,
                    color=color,
                    linewidth=1.3,
                    alpha=0.85,
                    zorder=5,
                    # a thin dark edge: light colours (yellow, sky blue) stay visible on white
                    path_effects=[Stroke(linewidth=2.3, foreground="#555555"), Normal()],
                )
                arrow.set_gid(f"{seq}:{j}->{block}")
                fig.add_artist(arrow)

    if title is None:
        label = step_label(state)  # a reset's frame has one without a step number too
        step = "" if label is None else f", {label}"
        each = ", one table per sequence and KV-cache group" if state.kv_groups else ""
        title = f"Block tables: logical -> physical blocks{each}{step}"
        if notes:
            title += f"\n({'; '.join(notes)})"
        if freed:
            title += f"\n{FREED_NOTE}"
    fig.suptitle(title, fontsize=12, y=1 - 0.08 / height, va="top")
    return fig


def row_cells(table) -> list[tuple[str, int | str, int]]:
    """What a table's row draws, left to right: ``("block", j, physical id)`` per entry;
    ``("freed", j, 1)`` per null entry (a run of them ``("freed", "a–b", n)`` when the table is
    longer than ``MAX_LOGICAL``); and, when more remain than fit, ``("more", "", k)``: ``k``
    entries left out."""
    cells: list[tuple[str, int | str, int]] = []
    for j, b in enumerate(table):
        if b != NULL_BLOCK:
            cells.append(("block", j, b))
        elif len(table) > MAX_LOGICAL and cells and cells[-1][0] == "freed":
            first = str(cells[-1][1]).split("–")[0]
            cells[-1] = ("freed", f"{first}–{j}", cells[-1][2] + 1)
        else:
            cells.append(("freed", j, 1))
    if len(cells) > MAX_LOGICAL:
        kept = cells[: MAX_LOGICAL - 1]
        cells = [
            *kept,
            ("more", "", len(table) - sum(n if k == "freed" else 1 for k, _, n in kept)),
        ]
    return cells


def row_label(state: PoolState, seq: Hashable) -> str:
    """A row's name: ``seq a`` (hand-driven) or ``a.0`` over ``(request a)`` (an engine's), with
    its KV-cache group after a dot when the model has several: ``a.0 · sliding 24``."""
    group = state.kv_group_of(seq)
    name = f"{state.seq_of(seq)} · {group}" if group is not None else str(seq)
    return f"{name}\n(request {state.group_of(seq)})" if state.requests else f"seq {name}"


def _block_cell(ax, x: float, y: float, j: int, block: int, color: str, fill: float) -> None:
    """A table entry: ``logical j``, a bar filled with its tokens, and ``→block``."""
    ax.add_patch(Rectangle((x, y), BOX_W, BOX_H, fill=False, edgecolor=OUTLINE_COLOR))
    ax.add_patch(Rectangle((x, y), BOX_W * fill, BOX_H * 0.45, facecolor=color, linewidth=0))
    ax.text(x + BOX_W / 2, y + BOX_H * 0.73, f"logical {j}", ha="center", va="center",
            fontsize=10)  # fmt: skip
    # The physical id is written too: with many sequences, arrows cross.
    white = {"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.85}
    ax.text(x + BOX_W - 0.05, y + BOX_H * 0.22, f"→{block}", ha="right", va="center",
            fontsize=10, bbox=white)  # fmt: skip


def _freed_cell(ax, x: float, y: float, j, n: int) -> None:
    """A null entry (or a run of ``n``): grey, crossed, dashed, labelled "freed"; no arrow."""
    box = Rectangle((x, y), BOX_W, BOX_H, facecolor=FREED_FACE, edgecolor=FREED_EDGE,
                    hatch=FREED_HATCH, linestyle="--", linewidth=0.8)  # fmt: skip
    box.set_gid(f"freed {j}")
    ax.add_patch(box)
    white = {"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.9}
    ax.text(x + BOX_W / 2, y + BOX_H * 0.73, f"logical {j}", ha="center", va="center",
            fontsize=10, bbox=white)  # fmt: skip
    ax.text(x + BOX_W / 2, y + BOX_H * 0.25, "freed" if n == 1 else f"{n} freed", ha="center",
            va="center", fontsize=10, style="italic", color="#555555", bbox=white)  # fmt: skip


def _swapped_text(blocks) -> str:
    """A swapped-out row: its CPU blocks (and its null entries: they stay null on the CPU)."""
    live = [b for b in blocks if b != NULL_BLOCK]
    nulls = len(blocks) - len(live)
    freed = f"; {nulls} freed entries" if nulls else ""
    return f"swapped out (CPU blocks {', '.join(map(str, live))}{freed})"


def _choose(state: PoolState, seqs) -> tuple[list[Hashable], list[str]]:
    """The tables to draw, grouped by request (in palette order), a sequence's KV-cache groups
    together and in order, and notes on what was cut."""
    known = [*state.tables, *state.swapped]
    if seqs is None:
        order = {g: i for i, g in enumerate(groups_in_order(state))}
        first = {}  # a sequence's first appearance: its rows stay together
        for s in state.tables:
            first.setdefault(state.seq_of(s), len(first))
        kv = {g: i for i, g in enumerate(state.kv_groups)}

        def key(s):
            return (order.get(state.group_of(s), len(order)), first[state.seq_of(s)],
                    kv.get(state.kv_group_of(s), 0))  # fmt: skip

        chosen = sorted(state.tables, key=key)
        swapped = sorted(
            state.swapped, key=lambda s: (repr(state.seq_of(s)), kv.get(state.kv_group_of(s), 0))
        )
        chosen += swapped
    else:
        if isinstance(seqs, (str, int)):
            seqs = [seqs]
        try:
            wanted = list(dict.fromkeys(seqs))
        except TypeError:
            raise TypeError(
                f"seqs must be a list of sequence ids, got {type(seqs).__name__}"
            ) from None
        chosen = []
        for s in wanted:
            names = state.tables_of(s)
            if not names:
                raise ValueError(
                    f"no sequence {s!r} in this pool; its sequences are {known[:12]!r}"
                )
            chosen += [n for n in names if n not in chosen]
    notes = []
    if len(chosen) > MAX_SEQS:
        what = "tables" if state.kv_groups else "sequences"
        notes.append(f"first {MAX_SEQS} of {len(chosen)} {what}")
        chosen = chosen[:MAX_SEQS]
    return chosen, notes
