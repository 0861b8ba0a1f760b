"""The picture under a failed memory-lab check: the student's pool beside the reference's.

Both pools are drawn by :class:`pagedlearn.viz.pool.PoolArtist` -- the same grid as the chapters
and the live view -- from two :class:`~pagedlearn.viz.state.PoolState`s, with one palette, so a
sequence has the same colour on both sides and a difference jumps out: a block that is shared
on one side and not on the other, a table pointing at the wrong block, a block that should be
free. Each side lists its block tables under the grid.
"""

from __future__ import annotations

import textwrap

from matplotlib.figure import Figure

from pagedlearn.viz.pool import PoolArtist, default_per_row
from pagedlearn.viz.state import PoolState
from pagedlearn.viz.style import Palette, styled

CELL = 0.55  # inches per block
LINE = 0.19  # inches per line of 9 pt text
MAX_TABLES = 6  # block tables listed under each grid


@styled
def side_by_side(yours: PoolState, reference: PoolState, caption: str = "") -> Figure:
    """One figure: ``caption`` on top, then ``yours`` on the left, ``reference`` on the right."""
    num_blocks = max(yours.num_blocks, reference.num_blocks)
    per_row = default_per_row(num_blocks)
    rows = -(-num_blocks // per_row)
    width = max(2 * per_row * CELL + 1.0, 9.0)
    lines = textwrap.wrap(caption, width=int(width * 14)) if caption else []
    n_tables = min(MAX_TABLES, max(len(yours.tables), len(reference.tables), 1))
    # Heights, top to bottom: caption, panel titles, grid, tables.
    cap_h, title_h, grid_h, tab_h = LINE * len(lines) + 0.15, 0.35, rows * CELL, LINE * n_tables
    height = cap_h + title_h + grid_h + tab_h + 0.25
    fig = Figure(figsize=(width, height))
    if lines:
        fig.text(0.01, 1 - 0.08 / height, "\n".join(lines), ha="left", va="top", fontsize=9)
    palette = Palette()
    grid_w = per_row * CELL / width  # each grid at its natural size, the same on both sides
    bottom = (tab_h + 0.25) / height
    for i, (state, who) in enumerate(((yours, "yours"), (reference, "reference"))):
        left = 0.02 + 0.5 * i
        ax = fig.add_axes((left, bottom, grid_w, grid_h / height))
        artist = PoolArtist(
            ax, state.num_blocks, state.block_size, per_row=per_row, palette=palette
        )
        artist.title = who
        artist.update(state)
        if ax.get_legend() is not None:  # the tables are listed below instead
            ax.get_legend().remove()
        tables = [f"{seq}: {list(blocks)}" for seq, blocks in state.tables.items()]
        if len(tables) > MAX_TABLES:
            tables = [*tables[: MAX_TABLES - 1], f"... and {len(tables) - MAX_TABLES + 1} more"]
        fig.text(
            left,
            bottom - 0.08 / height,
            "\n".join(tables) or "(no block tables)",
            ha="left",
            va="top",
            fontsize=9,
            family="monospace",
        )
    return fig
