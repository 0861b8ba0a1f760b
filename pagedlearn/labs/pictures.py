"""The picture under a failed memory-lab check: the student's pool beside the reference's.

Both pools are drawn by :class:`pagedlearn.viz.pool.PoolArtist` -- the same grid as the chapters
and the live view -- from two :class:`~pagedlearn.viz.state.PoolState`s, with one palette, so a
sequence has the same colour on both sides and a difference jumps out: a block that is shared
on one side and not on the other, a table pointing at the wrong block, a block that should be
free.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from pagedlearn.viz.pool import PoolArtist, default_per_row
from pagedlearn.viz.state import PoolState
from pagedlearn.viz.style import Palette, styled


@styled
def side_by_side(yours: PoolState, reference: PoolState, caption: str = "") -> Figure:
    """One figure: ``yours`` on the left, ``reference`` on the right, ``caption`` below."""
    num_blocks = max(yours.num_blocks, reference.num_blocks)
    per_row = default_per_row(num_blocks)
    rows = -(-num_blocks // per_row)
    cell = 0.55  # inches per block
    width = max(2 * per_row * cell + 1.0, 8.0)
    height = rows * cell + 1.4 + (0.3 if caption else 0)
    fig = Figure(figsize=(width, height))
    palette = Palette()
    for i, (state, who) in enumerate(((yours, "yours"), (reference, "reference"))):
        ax = fig.add_axes((0.02 + 0.5 * i, 0.28, 0.46, 0.55))
        artist = PoolArtist(
            ax, state.num_blocks, state.block_size, per_row=per_row, palette=palette
        )
        artist.title = who
        artist.update(state)
        if ax.get_legend() is not None:  # the tables are listed below instead
            ax.get_legend().remove()
        tables = "\n".join(
            f"{seq}: {list(blocks)}" for seq, blocks in list(state.tables.items())[:6]
        )
        ax.text(
            0,
            -0.15,
            tables or "(no block tables)",
            transform=ax.transAxes,
            va="top",
            fontsize=9,
            family="monospace",
        )
    if caption:
        fig.text(0.5, 0.97, caption, ha="center", va="top", fontsize=10, wrap=True)
    return fig
