"""How the pictures look: fixed looks for block kinds, font sizes, and the request colours.

Every drawing colours a block by the *request* that owns it (the samples or beams of one request
share a colour), so that a reader can follow a request from picture to picture. Which request
gets which colour is decided in one place, :mod:`pagedlearn.viz.colors` (:class:`Palette`,
re-exported here): once per run, never the same colour for two requests on screen together.

Blocks that no request owns get fixed looks that are not in the palette:

- free (empty): white with a grey outline -- nothing to see;
- cached-free: light grey -- free, but still holding a findable prefix (a prefix-cache hit can
  take it back until it is evicted);
- shared by several requests (a prefix-cache hit across requests): mid grey, hatched.

Fonts are at least 10 pt so that a figure stays readable on a projector. :func:`styled` applies
them to one drawing without touching the caller's matplotlib settings (as ``sim/plots.py`` does).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Mapping

import matplotlib
from matplotlib.colors import to_rgb

from pagedlearn.sim import plots  # the paper figures' fonts: one look everywhere
from pagedlearn.viz.colors import OKABE_ITO, Palette  # noqa: F401 (their old home: re-exported)

FREE_COLOR = "#ffffff"
CACHED_COLOR = "#d9d9d9"  # light grey: free, but its KV is still a findable prefix
MIXED_COLOR = "#7f7f7f"  # mid grey: one block shared by sequences of different requests
OUTLINE_COLOR = "#8c8c8c"
SHARED_HATCH = "//"  # refcount > 1: several block tables point here

STYLE = {**plots.STYLE, "hatch.linewidth": 1.5}  # thicker hatching: shared blocks read at a glance
MIN_FONT_SIZE = 10


def styled(draw: Callable) -> Callable:
    """Decorator: run ``draw`` under the project's font sizes (``STYLE``), restoring the caller's
    matplotlib settings afterwards."""

    @functools.wraps(draw)
    def wrapper(*args, **kwargs):
        with matplotlib.rc_context(STYLE):
            return draw(*args, **kwargs)

    return wrapper


def text_color(background: str) -> str:
    """Black or white, whichever reads better on ``background`` (by its relative luminance)."""
    r, g, b = to_rgb(background)
    return "#000000" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.45 else "#ffffff"


def block_color(
    block, group_of: Callable[[Hashable], Hashable], colors: Mapping[Hashable, str] | Palette
) -> str:
    """The colour a block is drawn in: its owners' request colour, the fixed free / cached-free
    look, or :data:`MIXED_COLOR` when sequences of several requests share it.

    ``block`` is a :class:`~pagedlearn.viz.state.BlockState`; ``group_of`` maps a sequence to its
    request (``PoolState.group_of``); ``colors``: request -> colour (``PoolState.colors``), or a
    :class:`Palette` to ask."""
    if not block.owners:
        return CACHED_COLOR if block.cached else FREE_COLOR
    groups = {group_of(s) for s in block.owners}
    if len(groups) > 1:
        return MIXED_COLOR
    group = groups.pop()
    return colors[group] if isinstance(colors, Mapping) else colors.color(group)
