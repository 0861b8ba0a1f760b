"""How the pictures look: one colour-blind-safe palette, fixed looks for block kinds, font sizes.

Every drawing colours a block by the *request* that owns it (the samples or beams of one request
share a colour), so that a reader can follow a request from picture to picture. :class:`Palette`
hands out the Okabe-Ito colours -- chosen to stay distinct for the common kinds of colour
blindness -- in order of first appearance, and keeps them: request ``"b"`` is orange in every
frame of a run, live or replayed.

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
from collections.abc import Callable, Hashable, Iterable

import matplotlib
from matplotlib.colors import to_hex, to_rgb

from pagedlearn.sim import plots  # the paper figures' palette and fonts: one look everywhere

OKABE_ITO = plots.OKABE_ITO
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


class Palette:
    """A stable colour per group (request id), assigned in order of first appearance.

    >>> p = Palette()
    >>> p.color("a"), p.color("b"), p.color("a")
    ('#0072b2', '#e69f00', '#0072b2')

    No colour is reused until all of them are taken; after that they cycle (the 9th request gets
    the 1st colour again). Share one ``Palette`` between drawings to keep colours consistent.
    """

    def __init__(self, colors: Iterable[str] = OKABE_ITO) -> None:
        colors = [to_hex(c) for c in colors]  # raises ValueError for something not a colour
        if not colors:
            raise ValueError("a Palette needs at least one colour")
        self.colors = colors
        self._assigned: dict[Hashable, str] = {}

    def color(self, group: Hashable) -> str:
        """The colour of ``group`` (a hex string), handing out the next one on first sight."""
        try:
            return self._assigned[group]
        except KeyError:
            pass
        except TypeError:
            raise TypeError(
                f"a palette group must be hashable, got {type(group).__name__}"
            ) from None
        c = self.colors[len(self._assigned) % len(self.colors)]
        self._assigned[group] = c
        return c

    def assign(self, groups: Iterable[Hashable]) -> None:
        """Give colours to ``groups`` in this order (those already coloured keep theirs)."""
        for g in groups:
            self.color(g)

    @property
    def groups(self) -> list[Hashable]:
        """The groups seen so far, in the order they got their colours."""
        return list(self._assigned)

    def __contains__(self, group: Hashable) -> bool:
        return group in self._assigned

    def __len__(self) -> int:
        return len(self._assigned)

    def __repr__(self) -> str:
        return f"Palette({self._assigned!r})"


def text_color(background: str) -> str:
    """Black or white, whichever reads better on ``background`` (by its relative luminance)."""
    r, g, b = to_rgb(background)
    return "#000000" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.45 else "#ffffff"


def block_color(block, group_of: Callable[[Hashable], Hashable], palette: Palette) -> str:
    """The colour a block is drawn in: its owners' request colour, the fixed free / cached-free
    look, or :data:`MIXED_COLOR` when sequences of several requests share it.

    ``block`` is a :class:`~pagedlearn.viz.state.BlockState`; ``group_of`` maps a sequence to its
    request (``PoolState.group_of``)."""
    if not block.owners:
        return CACHED_COLOR if block.cached else FREE_COLOR
    groups = {group_of(s) for s in block.owners}
    if len(groups) > 1:
        return MIXED_COLOR
    return palette.color(groups.pop())
