"""Block tables: each sequence's logical blocks, with an arrow to the physical block that holds it.

This is the paper's Figure 6/7 drawn from the real state. Left, one row per sequence (grouped
and coloured by request): its logical blocks in order, ``logical 0, logical 1, ...``, each
filled in proportion to the tokens it holds -- only the last one may be partly empty. Right, the
physical pool exactly as :func:`~pagedlearn.viz.pool.draw_block_pool` draws it. An arrow runs
from every block-table entry to its physical block, so a block shared after a fork (or a prefix
cache hit) gets several incoming arrows and shows its refcount ("x2").

Sequences swapped out to the CPU have no arrows into the GPU pool: they are listed below as
"swapped out (CPU blocks ...)".
"""

from __future__ import annotations

from collections.abc import Hashable

from matplotlib.figure import Figure
from matplotlib.patches import ConnectionPatch, Rectangle
from matplotlib.patheffects import Normal, Stroke

from pagedlearn.viz.pool import PoolArtist
from pagedlearn.viz.state import PoolState, groups_in_order, pool_state, step_label
from pagedlearn.viz.style import OUTLINE_COLOR, Palette, styled

MAX_SEQS = 8  # rows that stay readable; more are left out, and the title says so
MAX_LOGICAL = 10  # logical blocks drawn per row; the rest are summarised as "+k more"
ROW_H, BOX_W, BOX_H, LABEL_W = 0.75, 0.95, 0.6, 1.45  # inches
POOL_CELL, ARROW_GAP, LEGEND_W = 0.62, 1.3, 2.4  # inches


@styled
def draw_block_tables(
    source,
    seqs=None,
    *,
    palette: Palette | None = None,
    title: str | None = None,
) -> Figure:
    """Each sequence's block table as arrows from its logical blocks to physical blocks.

    ``source``: a ``KVCacheManager``, ``LLMEngine``, ``LLM`` or ``PoolState``; colours as
    :func:`~pagedlearn.viz.pool.draw_block_pool` picks them. ``seqs``: the
    sequence ids to show (default: all, GPU-resident first, then swapped out; at most
    ``MAX_SEQS``). The arrows are ``ConnectionPatch`` artists in ``fig.artists``, one per drawn
    block-table entry, with ``gid`` ``"<seq>:<logical>-><physical>"``.
    """
    state = pool_state(source)
    if palette is not None and not isinstance(palette, Palette):
        raise TypeError(f"palette must be a Palette, got {type(palette).__name__}")
    if not state.colors:  # a live manager's state: the palette colours it (viz/colors.py)
        state = (palette if palette is not None else Palette()).paint(state)
    chosen, notes = _choose(state, seqs)
    gpu = [s for s in chosen if s in state.tables]
    cpu = [s for s in chosen if s in state.swapped]
    longest = max((len(state.tables[s]) for s in gpu), default=1)
    shown = min(longest, MAX_LOGICAL)
    if longest > MAX_LOGICAL:
        notes.append(f"first {MAX_LOGICAL - 1} logical blocks per sequence")

    # Sizes in inches; the left axes uses inches as data units, so boxes keep their shape.
    n = state.num_blocks
    pcols = 1 if n <= 12 else min(16, -(-n // max(8, round(len(chosen) * ROW_H / POOL_CELL))))
    prows = -(-n // pcols)
    left_w = LABEL_W + shown * (BOX_W + 0.1)
    left_h = max(len(chosen), 1) * ROW_H
    grid_h = prows * POOL_CELL
    body_h = max(left_h, grid_h, 2.25)
    width = left_w + ARROW_GAP + pcols * POOL_CELL + LEGEND_W + 0.3
    height = body_h + 0.9
    fig = Figure(figsize=(width, height))
    top = (height - 0.6) / height  # below the title
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
        name = f"{seq}\n(request {state.group_of(seq)})" if state.requests else f"seq {seq}"
        left.text(0.15, y + BOX_H / 2, name, va="center", fontsize=10)
        if seq in cpu:
            blocks = ", ".join(map(str, state.swapped[seq]))
            left.text(
                LABEL_W,
                y + BOX_H / 2,
                f"swapped out (CPU blocks {blocks})",
                va="center",
                fontsize=10,
                style="italic",
                color="#555555",
            )
            continue
        table = state.tables[seq]
        tokens = state.num_tokens.get(seq, 0)
        drawn = table if len(table) <= MAX_LOGICAL else table[: MAX_LOGICAL - 1]
        for j, block in enumerate(drawn):
            x = LABEL_W + j * (BOX_W + 0.1)
            fill = min(max(tokens - j * state.block_size, 0), state.block_size) / state.block_size
            left.add_patch(Rectangle((x, y), BOX_W, BOX_H, fill=False, edgecolor=OUTLINE_COLOR))
            left.add_patch(
                Rectangle((x, y), BOX_W * fill, BOX_H * 0.45, facecolor=color, linewidth=0)
            )
            left.text(
                x + BOX_W / 2,
                y + BOX_H * 0.73,
                f"logical {j}",
                ha="center",
                va="center",
                fontsize=10,
            )
            # The physical id is written too: with many sequences, arrows cross.
            left.text(
                x + BOX_W - 0.05,
                y + BOX_H * 0.22,
                f"→{block}",
                ha="right",
                va="center",
                fontsize=10,
                bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.85},
            )
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
        if len(drawn) < len(table):
            x = LABEL_W + len(drawn) * (BOX_W + 0.1)
            left.text(
                x + 0.05,
                y + BOX_H / 2,
                f"+{len(table) - len(drawn)} more",
                va="center",
                fontsize=10,
            )

    if title is None:
        step = "" if state.step is None else f", {step_label(state)}"
        title = f"Block tables: logical -> physical blocks{step}"
        if notes:
            title += f"\n({'; '.join(notes)})"
    fig.suptitle(title, fontsize=12, y=1 - 0.08 / height, va="top")
    return fig


def _choose(state: PoolState, seqs) -> tuple[list[Hashable], list[str]]:
    """The sequences to draw, grouped by request (in palette order), and notes on what was cut."""
    known = [*state.tables, *state.swapped]
    if seqs is None:
        order = {g: i for i, g in enumerate(groups_in_order(state))}
        chosen = sorted(state.tables, key=lambda s: order.get(state.group_of(s), len(order)))
        chosen += sorted(state.swapped, key=repr)
    else:
        if isinstance(seqs, (str, int)):
            seqs = [seqs]
        try:
            chosen = list(dict.fromkeys(seqs))
        except TypeError:
            raise TypeError(
                f"seqs must be a list of sequence ids, got {type(seqs).__name__}"
            ) from None
        missing = [s for s in chosen if s not in state.tables and s not in state.swapped]
        if missing:
            raise ValueError(
                f"no sequence {missing[0]!r} in this pool; its sequences are {known[:12]!r}"
            )
    notes = []
    if len(chosen) > MAX_SEQS:
        notes.append(f"first {MAX_SEQS} of {len(chosen)} sequences")
        chosen = chosen[:MAX_SEQS]
    return chosen, notes
