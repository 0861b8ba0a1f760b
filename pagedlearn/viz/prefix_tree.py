"""The prefix cache a KV-event stream describes, drawn as a tree: shared prefixes at a glance.

An *icicle* layout, left to right: column ``j`` holds the blocks that are the ``j``-th block of
their prompt (tokens ``j*B`` to ``(j+1)*B - 1``); a block's children sit to its right, stacked
inside its height, and a block is as tall as the number of cached continuations (leaves) below
it. So a tall box on the left is a prefix many prompts share -- a system prompt --, and the
place where one band splits is where those prompts part::

    [sys][tem][pro][mpt][ Q1 ][ ...]
    [   ][   ][   ][   ][ Q2 ][ ...]
    [   ][   ][   ][   ][ Q3 ]

Each box is coloured by its *age* (when its batch stored it: dark = old, light = recent) or by
its *medium* (GPU / CPU / ..., Okabe-Ito colours), and labelled with its first tokens (decoded
with a tokenizer, else the ids) where it is big enough. A root whose parent the subscriber never
saw (it joined late, or the parent was evicted) is hatched: its prefix starts before what is
known. Drawn from a :class:`~pagedlearn.kv_events.cache_state.KVCacheState`, read only.

Large caches stay drawable: at most ``max_depth`` columns (a ``+k`` says how many blocks go on),
subtrees thinner than a pixel are not split further, and at most ``max_boxes`` boxes are drawn
(shallow ones first); the title says when something was left out.
"""

from __future__ import annotations

import matplotlib
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from pagedlearn.kv_events import check_positive_ints
from pagedlearn.kv_events.cache_state import KVCacheState, StoredBlock
from pagedlearn.viz.style import OKABE_ITO, OUTLINE_COLOR, STYLE, text_color

COLOR_BY = ("age", "medium")
AGE_CMAP = "viridis"  # sequential, readable with colour blindness: old dark, recent light
MEDIUM_COLORS = {"GPU": OKABE_ITO[0], "CPU": OKABE_ITO[1], "DISK": OKABE_ITO[2]}
OTHER_COLORS = OKABE_ITO[3:7]
UNKNOWN_COLOR = "#bdbdbd"
LABEL_PT = 10  # the smallest font used (projector-readable, viz/style.py)
MAX_DEPTH, MAX_BOXES = 24, 3000


def medium_color(medium: str | None, others: dict) -> str:
    """GPU blue, CPU orange, DISK green; other media the next Okabe-Ito colours; None grey."""
    if medium is None:
        return UNKNOWN_COLOR
    if medium.upper() in MEDIUM_COLORS:
        return MEDIUM_COLORS[medium.upper()]
    return others.setdefault(medium, OTHER_COLORS[len(others) % len(OTHER_COLORS)])


def block_label(block: StoredBlock, tokenizer, chars: int) -> str:
    """The first tokens of ``block`` in at most ``chars`` characters ('' if none fit)."""
    if block.token_ids is None or chars < 3:
        return ""
    if tokenizer is not None:
        text = tokenizer.decode(list(block.token_ids)).replace("\n", "⏎")
        text = "".join(c if c.isprintable() else "·" for c in text)  # no control characters
    else:
        text = " ".join(map(str, block.token_ids))
    return text if len(text) <= chars else text[: chars - 1] + "…"


def layout(state: KVCacheState, max_depth: int = MAX_DEPTH, max_boxes: int = MAX_BOXES,
           min_leaves: float = 0.0, leaves: dict | None = None):  # fmt: skip
    """Boxes ``(block, depth, y, height)`` in leaf units, parents before children, and what was
    left out: ``(boxes, total_leaves, hidden_blocks, truncated_depth, bands)``. Siblings
    thinner than ``min_leaves`` are not drawn one by one: ``bands`` holds one ``(depth, y,
    height, count)`` per group of them (they are last among their siblings: sorted by leaves)."""
    leaves = leaves if leaves is not None else state.leaves_below()
    bands: list[tuple[int, float, float, int]] = []

    def place(blocks, depth, top):  # -> the siblings to draw, with their y
        placed, thin = [], None
        for b in sorted(blocks, key=lambda b: (-leaves[b.key], b.ts)):
            if leaves[b.key] >= min_leaves:
                placed.append((b, depth, top))
            else:
                thin = (top, 0.0, 0) if thin is None else thin
                thin = (thin[0], thin[1] + leaves[b.key], thin[2] + 1)
            top += leaves[b.key]
        if thin is not None:
            bands.append((depth, *thin))
        return placed, top

    queue, total = place(state.roots(), 0, 0.0)
    boxes, truncated, head = [], False, 0  # breadth first: shallow boxes win at max_boxes
    while head < len(queue) and len(boxes) < max_boxes:
        block, depth, top = queue[head]
        head += 1
        boxes.append((block, depth, top, leaves[block.key]))
        if block.children and depth + 1 >= max_depth:
            truncated = True
        elif block.children:
            queue += place([state.blocks[c] for c in block.children], depth + 1, top)[0]
    return boxes, total, len(state.blocks) - len(boxes), truncated, bands


def draw_prefix_tree(
    state: KVCacheState,
    *,
    color_by: str = "age",
    tokenizer=None,
    max_depth: int = MAX_DEPTH,
    max_boxes: int = MAX_BOXES,
    title: str | None = None,
    width: float | None = None,
) -> Figure:
    """The prefix tree of ``state`` (see the module docstring); a matplotlib ``Figure``.

    ``color_by``: ``"age"`` or ``"medium"``. ``tokenizer``: decodes the boxes' labels (any
    object with ``decode(ids)``). ``width``: inches (default: from the tree's depth)."""
    if color_by not in COLOR_BY:
        raise ValueError(f"color_by must be one of {COLOR_BY}, got {color_by!r}")
    if not isinstance(state, KVCacheState):
        raise TypeError(f"draw_prefix_tree needs a KVCacheState, got {type(state).__name__}")
    check_positive_ints(ValueError, max_depth=max_depth, max_boxes=max_boxes)
    with matplotlib.rc_context(STYLE):
        return _draw(state, color_by, tokenizer, max_depth, max_boxes, title, width)


def _draw(state, color_by, tokenizer, max_depth, max_boxes, title, width) -> Figure:
    leaves, roots = state.leaves_below(), state.roots()
    leaves_total = sum(leaves[b.key] for b in roots) or 1
    height_in = min(11.0, 3.2 + 0.3 * min(leaves_total, 26))
    min_leaves = leaves_total / (height_in * 72)  # thinner than a point: not split further
    boxes, total, hidden, truncated, bands = layout(state, max_depth, max_boxes, min_leaves, leaves)
    columns = max([d for _, d, _, _ in boxes] + [d for d, *_ in bands], default=0) + 1
    width = width or min(16.0, max(9.0, 2.5 + 1.25 * columns))
    fig = Figure(figsize=(width, height_in))
    # In inches from the edges: a band of 1.1 in on top (title, key), 0.8 in below (the axis).
    ax = fig.add_axes((0.06, 0.8 / height_in, 0.9, 1 - 1.9 / height_in))
    age = Normalize(state.first_ts or 0.0, max(state.last_ts or 0.0, (state.first_ts or 0) + 1e-9))
    cmap, others = matplotlib.colormaps[AGE_CMAP], {}
    pt_per_leaf = ax.get_position().height * height_in * 72 / max(total, 1)
    box_pt = ax.get_position().width * width * 72 / max(columns, 1)
    chars = int(box_pt * 0.9 / (0.65 * LABEL_PT))  # DejaVu Sans: ~0.6 em a character
    for block, depth, top, h in boxes:
        color = (matplotlib.colors.to_hex(cmap(age(block.ts))) if color_by == "age"
                 else medium_color(block.key.medium, others))  # fmt: skip
        unseen = depth == 0 and block.parent_unseen
        pad = 0.04 * min(h, 1)  # a gap between siblings, in leaf units
        box = ax.add_patch(Rectangle((depth + 0.03, top + pad), 0.94, h - 2 * pad,
                                     facecolor=color, edgecolor=OUTLINE_COLOR, linewidth=0.6,
                                     hatch="//" if unseen else None))  # fmt: skip
        if h * pt_per_leaf >= LABEL_PT * 1.4:
            label = block_label(block, tokenizer, chars)
            if label:
                text = ax.text(depth + 0.08, top + h / 2, label, va="center", ha="left",
                               fontsize=LABEL_PT, color=text_color(color))  # fmt: skip
                text.set_clip_path(box)  # never over the next box
        if depth + 1 >= max_depth and block.children:
            more = sum(1 for _ in _below(state, block))
            ax.text(depth + 1.02, top + h / 2, f"+{more}", va="center", fontsize=LABEL_PT)
    for depth, top, h, count in bands:  # siblings too thin to draw one by one: one band
        shape = Rectangle((depth + 0.03, top), 0.94, h, facecolor=UNKNOWN_COLOR,
                          edgecolor=OUTLINE_COLOR, linewidth=0.6, hatch="..")  # fmt: skip
        band = ax.add_patch(shape)
        if h * pt_per_leaf >= LABEL_PT * 1.4:
            text = ax.text(depth + 0.08, top + h / 2, f"{count} more (thin)", va="center",
                           fontsize=LABEL_PT)  # fmt: skip
            text.set_clip_path(band)
    ax.set_xlim(0, columns + (0.5 if truncated else 0))
    ax.set_ylim(max(total, 1), 0)  # the largest shared prefix on top
    if not boxes and not bands:
        ax.text(0.5, 0.5, "no cached block yet", ha="center", va="center", color=OUTLINE_COLOR)
    size = state.block_size
    step = max(1, columns // 12)
    ax.set_xticks([j + 0.5 for j in range(0, columns, step)])
    ax.set_xticklabels([f"{j}" + (f"\n@{j * size}" if size else "")
                        for j in range(0, columns, step)])  # fmt: skip
    ax.set_xlabel("block of the prompt (@ first token's position)")
    ax.set_yticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    _legend(fig, ax, state, color_by, age, cmap, others, boxes)
    left_out = []
    if hidden:
        left_out.append(f"{hidden} blocks not drawn one by one")
    if truncated:
        left_out.append(f"cut at {max_depth} blocks deep")
    head = title or (f"prefix tree: {len(state.blocks)} cached blocks, {len(roots)} roots, "
                     f"{int(total)} cached continuations")  # fmt: skip
    fig.suptitle(head, fontsize=12, y=1 - 0.08 / height_in, va="top")
    if left_out:  # top right, over the colour bar: what the picture does not show
        fig.text(0.96, 1 - 0.4 / height_in, "; ".join(left_out), ha="right", va="top",
                 fontsize=LABEL_PT, style="italic")  # fmt: skip
    return fig


def _below(state, block):
    stack = list(block.children)
    while stack:
        key = stack.pop()
        yield key
        stack += state.blocks[key].children


def _legend(fig, ax, state, color_by, age, cmap, others, boxes) -> None:
    handles = []
    if color_by == "age":
        from matplotlib.cm import ScalarMappable

        span = Normalize(0.0, (state.last_ts or 0.0) - (state.first_ts or 0.0) or 1.0)
        h = fig.get_figheight()  # the bar 0.66-0.8 in from the top, its ticks under it
        cax = fig.add_axes((0.66, 1 - 0.8 / h, 0.3, 0.14 / h))  # its label on its left
        fig.colorbar(ScalarMappable(span, cmap), cax=cax, orientation="horizontal")
        cax.set_ylabel("stored at (s after\nthe first batch)", rotation=0, ha="right",
                       va="center", fontsize=LABEL_PT, labelpad=8)  # fmt: skip
    else:
        media = sorted({b.key.medium for b, *_ in boxes}, key=str)
        handles = [Patch(facecolor=medium_color(m, others), edgecolor=OUTLINE_COLOR,
                         label=m or "medium not said") for m in media]  # fmt: skip
    if any(b.parent_unseen for b, d, *_ in boxes if d == 0):
        handles.append(Patch(facecolor="white", edgecolor=OUTLINE_COLOR, hatch="//",
                             label="parent unseen (joined late, or evicted)"))  # fmt: skip
    if handles:
        fig.legend(handles=handles, loc="upper left", ncols=len(handles), frameon=False,
                   bbox_to_anchor=(0.05, 1 - 0.45 / fig.get_figheight()),
                   fontsize=LABEL_PT)  # fmt: skip
