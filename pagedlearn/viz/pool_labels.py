"""The words of the pool picture: its title, its legend, and the tokens a block shows.

The grid (:class:`~pagedlearn.viz.pool.PoolArtist`) says everything with colour, fill and hatch;
this module says it again in words, for a reader who does not yet know the code:

- the **title** counts the blocks of each kind (used, shared, cached, free) and names the step;
- the **legend** gives each request on screen its colour (the colour the state carries, from
  viz/colors.py), then the fixed looks: several requests in one block, shared (hatched, with
  ``x<refcount>``), free but cached, free. Past ``max_groups`` requests it says "+N more";
- a block's **tokens** are decoded and escaped like a Python string literal, so that a newline
  or an odd byte stays visible in a 1-inch cell (the inspector panel shows them the same way);
- with several **KV-cache groups** (a model with sliding-window layers), each used block carries
  its group's **tag** -- ``F`` for the full-attention group, ``S`` for the sliding one, numbered
  when a kind has several groups (``S1``, ``S2``...) -- the legend names each tag's group, and
  the title adds the blocks each group holds. A block belongs to one group at a time: the
  coordinator's groups share the pool, never a block.

>>> from pagedlearn import KVCacheManager
>>> from pagedlearn.viz.state import pool_state
>>> kv = KVCacheManager(num_blocks=4, block_size=2)
>>> kv.add_sequence("a", [1, 2, 3]); kv.fork("a", "b")  # b shares a's two blocks
0
>>> pool_title(pool_state(kv))
'KV block pool: 2 used (2 shared), 0 cached, 2 free of 4'
>>> from pagedlearn.models.tokenizer import ByteTokenizer
>>> token_text([72, 105, 10]), token_text([72, 105, 10], ByteTokenizer())
('72 105 10', "'Hi\\\\n'")
>>> group_tags(("full", "sliding 24")), group_tags(("full", "sliding 8 #0", "sliding 8 #1"))
({'full': 'F', 'sliding 24': 'S'}, {'full': 'F', 'sliding 8 #0': 'S1', 'sliding 8 #1': 'S2'})
"""

from __future__ import annotations

from collections.abc import Hashable

from matplotlib.axes import Axes
from matplotlib.patches import Patch

from pagedlearn.viz.state import PoolState, step_label
from pagedlearn.viz.style import CACHED_COLOR, FREE_COLOR, MIXED_COLOR, OUTLINE_COLOR, SHARED_HATCH

MAX_LEGEND_GROUPS = 10  # requests listed by name; pool_figure fits it to the figure's height
# The looks of blocks that no one request colours, as the legend (and the live views' key beside
# their picture, viz/panels.py) list them: (fill, edge, hatch, label).
FIXED_LOOKS = (
    (MIXED_COLOR, None, None, "several requests"),
    ("#ffffff", "#000000", SHARED_HATCH, "shared (x = refcount)"),
    (CACHED_COLOR, OUTLINE_COLOR, None, "free, cached"),
    (FREE_COLOR, OUTLINE_COLOR, None, "free"),
)


def pool_title(state: PoolState) -> str:
    used = state.count("used") + state.count("shared")
    label = step_label(state)  # a reset's frame has one without a step number too
    step = "" if label is None else f", {label}"
    shared = f"{state.count('shared')} shared"
    if state.kv_groups:  # "10 used (F 6 + S 4; 2 shared)": the tags the cells carry
        tags = group_tags(state.kv_groups)
        per = " + ".join(f"{tags[g]} {n}" for g, n in state.group_counts().items())
        shared = f"{per}; {shared}"
    return (
        f"KV block pool{step}: {used} used ({shared}), "
        f"{state.count('cached')} cached, {state.count('free')} free of {state.num_blocks}"
    )


def group_tags(kv_groups: tuple[str, ...]) -> dict[str, str]:
    """A short tag per KV-cache group, what a block's cell shows: ``F`` (full attention) or ``S``
    (sliding window; another name: its first letter or digit, else ``G``), numbered from 1 when
    a kind has several."""
    letter = {g: "F" if g.startswith("full") else "S" if g.startswith("sliding") else
              g[:1].upper() if g[:1].isalnum() else "G" for g in kv_groups}  # fmt: skip
    count = {t: list(letter.values()).count(t) for t in letter.values()}
    seen: dict[str, int] = {}
    tags = {}
    for g in kv_groups:
        t = letter[g]
        seen[t] = seen.get(t, 0) + 1
        tags[g] = t if count[t] == 1 else f"{t}{seen[t]}"
    return tags


def group_entries(kv_groups: tuple[str, ...]) -> list[str]:
    """The legend's (and the live key's) words for the tags: ``"F: full group"``, ..."""
    return [f"{tag}: {g} group" for g, tag in group_tags(kv_groups).items()]


def legend_handles(
    groups: list[tuple[Hashable, str]],
    requests: bool,
    max_groups: int = MAX_LEGEND_GROUPS,
    kv_groups: tuple[str, ...] = (),
) -> list[Patch]:
    """The legend's entries: one per ``(group, colour)`` in ``groups`` (named "request g" when
    the groups are requests), at most ``max_groups`` of them, then the fixed looks, then what
    each KV-cache group's tag means (``kv_groups``: none for a one-group model)."""
    name = "request {}" if requests else "{}"
    handles = [Patch(facecolor=c, label=name.format(g)) for g, c in groups]
    if len(handles) > max_groups:
        more = len(handles) - max_groups + 1
        handles = handles[: max_groups - 1]
        handles.append(Patch(facecolor="none", edgecolor="none", label=f"+{more} more"))
    fixed = [Patch(facecolor=f, edgecolor=e, hatch=h, label=t) for f, e, h, t in FIXED_LOOKS]
    # A tag needs no swatch: its words say it all (an empty handle keeps the text aligned).
    tags = [Patch(facecolor="none", edgecolor="none", label=t) for t in group_entries(kv_groups)]
    return handles + fixed + tags


def draw_legend(
    ax: Axes,
    groups: list[tuple[Hashable, str]],
    requests: bool,
    max_groups: int,
    kv_groups: tuple[str, ...] = (),
) -> None:
    """Draw (or redraw) the legend of ``groups`` right of the grid on ``ax``."""
    handles = legend_handles(groups, requests, max_groups, kv_groups)
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0.0,
        frameon=False,
    )


def token_text(token_ids, tokenizer=None) -> str:
    """What a block holds, as text a reader can see: decoded by ``tokenizer`` and escaped like a
    Python string literal (so newlines and odd bytes stay visible), or the ids without one."""
    ids = list(token_ids)
    if tokenizer is None:
        return " ".join(map(str, ids))
    return repr(tokenizer.decode(ids))


def shorten(text: str, n: int = 8) -> str:
    """``text`` cut to ``n`` characters, the last one an ellipsis (what fits in a cell)."""
    return text if len(text) <= n else text[: n - 1] + "…"
