"""The memory timeline: how full the block pool is, and who waits for it, step after step.

One picture answers "what did the pool do during this run?". Two panels share the x axis (the
engine step, i.e. one iteration of continuous batching):

- **blocks** (top): stacked areas of *used* blocks (referenced by a running sequence), *cached*
  blocks (free, but still holding a prefix that a later prompt can reuse: the first to be evicted
  when memory runs out) and *free* blocks, out of the pool's ``num_blocks``; a dashed line counts
  the *shared* blocks (refcount > 1: parallel samples, beams, a common prefix) when the source
  knows them; triangles mark the steps where cached blocks were evicted, and a dash-dotted line
  a prefix-cache reset (``reset_prefix_cache``, after that step: every cached block dropped).
- **requests** (bottom): how many requests are *running*, *waiting* and *swapped* out; vertical
  lines mark the steps where the scheduler preempted a request because a step could not get a
  block (*recompute*: its blocks are freed and it is prefilled again later; *swap*: its blocks are
  copied to the CPU pool and back).

Read together, they show the scheduler's rule: the pool fills, a step runs out of blocks, the
latest request is preempted, the waiting line grows, and the used area drops.

Every number comes from the run itself, through :func:`timeline_rows` (which notebooks can print
as a table): a recorded :class:`~pagedlearn.trace.events.EventLog` (replayed frame by frame with
:func:`~pagedlearn.viz.state.replay_states`), a list of :class:`~pagedlearn.viz.state.PoolState`,
or the engine's per-step :class:`~pagedlearn.engine.stats.StepStats`.
"""

from __future__ import annotations

import matplotlib
from matplotlib.figure import Figure  # no pyplot: no global state, no windows

from pagedlearn.sim.plots import STYLE
from pagedlearn.viz.state import PoolState, replay_states
from pagedlearn.viz.style import CACHED_COLOR, FREE_COLOR, OUTLINE_COLOR

# Okabe-Ito colours (colour-blind safe); cached and free blocks look as in draw_block_pool.
COLORS = {
    "used": "#0072B2",
    "cached": CACHED_COLOR,
    "free": FREE_COLOR,
    "shared": "#000000",
    "eviction": "#000000",
    "running": "#0072B2",
    "waiting": "#E69F00",
    "swapped": "#CC79A7",
    "recompute": "#D55E00",
    "swap": "#CC79A7",
    "reset": "#009E73",
}
LABELS = {
    "used": "used",
    "cached": "cached (free, holds a prefix)",
    "free": "free",
    "shared": "shared (refcount > 1)",
    "running": "running",
    "waiting": "waiting",
    "swapped": "swapped",
}
# Running totals since the engine started; the drawing marks the steps where they grow.
COUNTERS = ("preemptions_recompute", "preemptions_swap", "evictions")
# Per frame: a prefix-cache reset's frame (viz/frame.py) counts 1, and the blocks it dropped.
RESETS = ("cache_resets", "cache_reset_blocks")


def timeline_rows(source) -> list[dict]:
    """One dict per frame (engine step) of ``source``, in order; what the timeline draws.

    ``source``: an :class:`~pagedlearn.trace.events.EventLog` with ``step`` events (``log =
    llm.engine.record()`` before generating), a list of :class:`PoolState`, or a list of
    :class:`~pagedlearn.engine.stats.StepStats` (or their ``as_dict()``).

    Keys: ``step``; block counts ``used``, ``cached``, ``free`` (they sum to ``num_blocks``;
    ``cached`` blocks are free too, but hold a reusable prefix) and ``shared`` (refcount > 1;
    ``None`` from StepStats, which do not count it); request counts ``running``, ``waiting``,
    ``swapped``; running totals ``preemptions_recompute``, ``preemptions_swap``, ``evictions``,
    and ``new_<counter>``: how much each total grew since the previous frame; ``cache_resets``
    (1 for a prefix-cache reset's frame, else 0; always 0 from StepStats, which have no such
    frame) and ``cache_reset_blocks`` (the cached blocks it dropped). An aborted request, and a
    reset, add a frame with the same step number as the step before it (the drawing keeps the
    last frame of each step, with the events of all its frames).
    """
    rows = [_row_of(item, i) for i, item in enumerate(_items(source))]
    # The totals count from the engine's start. A recording that began mid-run cannot say in
    # which step the events before it happened, so its first frame is the baseline.
    first_step = rows[0]["step"]
    prev = dict.fromkeys(COUNTERS, 0) if first_step <= 1 else {c: rows[0][c] for c in COUNTERS}
    for row in rows:
        for c in COUNTERS:
            row[f"new_{c}"] = row[c] - prev[c]
        prev = {c: row[c] for c in COUNTERS}
    return rows


def _items(source) -> list:
    """The frames of ``source`` (PoolStates or stats), with a clear error for anything else."""
    if hasattr(source, "events") and hasattr(source, "meta"):  # an EventLog
        frames = replay_states(source)
        if not frames:
            raise ValueError(
                "this event log has no 'step' events, so it has no frames to draw: record an "
                "engine run (log = llm.engine.record() before generating), or call "
                "kv.mark_step() after each step of a manager driven by hand"
            )
        return [state for _, state in frames]
    if not isinstance(source, (list, tuple)):
        raise TypeError(
            "draw_memory_timeline needs an EventLog, a list of PoolState or a list of StepStats, "
            f"got {type(source).__name__}"
        )
    if not source:
        raise ValueError("the source is empty: there are no steps to draw")
    kinds = {_kind(item) for item in source}
    if None in kinds:
        bad = next(item for item in source if _kind(item) is None)
        raise TypeError(
            "every item must be a PoolState or a StepStats (or its as_dict()), got "
            f"{type(bad).__name__}"
        )
    if len(kinds) > 1:
        raise TypeError("the list mixes PoolStates and StepStats: pass one kind")
    return list(source)


def _kind(item) -> str | None:
    if isinstance(item, PoolState):
        return "state"
    if hasattr(item, "as_dict") and hasattr(item, "used_blocks"):
        return "stats"
    if isinstance(item, dict) and {"used_blocks", "free_blocks", "num_running"} <= item.keys():
        return "stats"
    return None


def _row_of(item, index: int) -> dict:
    if isinstance(item, PoolState):
        return _row_of_state(item, index)
    stats = item if isinstance(item, dict) else item.as_dict()
    return {
        "step": stats["step"],
        "num_blocks": stats["num_blocks"],
        "used": stats["used_blocks"],
        # StepStats' free_blocks counts every refcount-0 block, the cached ones included.
        "cached": stats["cached_blocks"],
        "free": stats["free_blocks"] - stats["cached_blocks"],
        "shared": None,
        "running": stats["num_running"],
        "waiting": stats["num_waiting"],
        "swapped": stats["num_swapped"],
        **{c: stats.get(c, 0) for c in COUNTERS},
        **dict.fromkeys(RESETS, 0),
    }


def _row_of_state(state: PoolState, index: int) -> dict:
    stats = state.stats
    if stats:  # an engine frame: the scheduler's queues
        queues = [stats["num_running"], stats["num_waiting"], stats["num_swapped"]]
    elif state.requests:
        queues = [
            sum(r.status == s for r in state.requests) for s in ("running", "waiting", "swapped")
        ]
    else:  # a manager driven by hand: each sequence is a request of its own
        queues = [len(state.tables), 0, len(state.swapped)]
    step = state.step if state.step is not None else stats.get("step", index + 1)
    return {
        "step": step,
        "num_blocks": state.num_blocks,
        # Counted from the blocks themselves (the frame's truth); the tests check that they
        # equal the engine's own StepStats.
        "used": state.count("used") + state.count("shared"),
        "cached": state.count("cached"),
        "free": state.count("free"),
        "shared": state.count("shared"),
        "running": queues[0],
        "waiting": queues[1],
        "swapped": queues[2],
        **{c: stats.get(c, 0) for c in COUNTERS},
        "cache_resets": int(state.cache_reset is not None),
        "cache_reset_blocks": state.cache_reset or 0,
    }


def _steps(xs: list, ys: list) -> tuple[list, list]:
    """Each frame drawn as a flat segment [step - 0.5, step + 0.5]: the state *after* that
    step, held until the next; the first and last frames get their full width too."""
    px, py = [], []
    for x, y in zip(xs, ys, strict=True):
        px += [x - 0.5, x + 0.5]
        py += [y, y]
    return px, py


def draw_memory_timeline(source, *, title: str | None = None) -> Figure:
    """Blocks (top) and requests (bottom) over engine steps, with preemptions and evictions.

    ``source``: as :func:`timeline_rows` takes. Returns a matplotlib ``Figure`` (a notebook
    shows it; ``fig.savefig(path)`` writes it). Preemption, eviction and
    prefix-cache reset markers appear, with their totals in the legend, only when the run had
    some.
    """
    rows = _one_per_step(timeline_rows(source))
    with matplotlib.rc_context(STYLE):
        return _draw(rows, title)


def _one_per_step(rows: list[dict]) -> list[dict]:
    """An abort adds a frame with the step number of the step before it: draw the last frame
    of each step, with the events of all its frames."""
    merged: dict = {}
    for row in rows:
        before = merged.get(row["step"])
        if before is not None:
            row = {**row, **{f"new_{c}": before[f"new_{c}"] + row[f"new_{c}"] for c in COUNTERS}}
            row.update({k: before[k] + row[k] for k in RESETS})
        merged[row["step"]] = row
    return list(merged.values())


def _draw(rows: list[dict], title: str | None) -> Figure:
    fig = Figure(figsize=(10, 6.5))
    blocks_ax, requests_ax = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    xs = [r["step"] for r in rows]
    num_blocks = max(r["num_blocks"] for r in rows)

    # Top: stacked areas, used at the bottom (what holds KV now), then cached, then free.
    bottom = [0] * len(rows)
    for part in ("used", "cached", "free"):
        top = [b + r[part] for b, r in zip(bottom, rows, strict=True)]
        px, lo = _steps(xs, bottom)
        _, hi = _steps(xs, top)
        blocks_ax.fill_between(
            px,
            lo,
            hi,
            facecolor=COLORS[part],
            edgecolor=OUTLINE_COLOR,
            linewidth=0.3,
            label=LABELS[part],
        )
        bottom = top
    blocks_ax.axhline(num_blocks, color=OUTLINE_COLOR, linewidth=1)  # the pool's size
    if all(r["shared"] is not None for r in rows):
        px, py = _steps(xs, [r["shared"] for r in rows])
        blocks_ax.plot(px, py, color=COLORS["shared"], linestyle="--", label=LABELS["shared"])
    evicted = [(r["step"], r["new_evictions"]) for r in rows if r["new_evictions"] > 0]
    if evicted:
        total = sum(n for _, n in evicted)
        blocks_ax.plot([s for s, _ in evicted], [num_blocks] * len(evicted), linestyle="none",
                       marker="v", markersize=9, color=COLORS["eviction"], clip_on=False,
                       label=f"cached blocks evicted ({total})")  # fmt: skip
    resets = [r for r in rows if r["cache_resets"]]
    if resets:  # after the step: the frame of that step is the pool once the reset is done
        n = sum(r["cache_resets"] for r in resets)
        dropped = sum(r["cache_reset_blocks"] for r in resets)
        blocks_ax.vlines([r["step"] for r in resets], 0, 1,
                         transform=blocks_ax.get_xaxis_transform(), colors=COLORS["reset"],
                         linestyles="-.", linewidth=2,
                         label=f"prefix cache reset{'s' if n > 1 else ''} "
                               f"({dropped} cached blocks dropped)")  # fmt: skip
    blocks_ax.set_ylim(0, num_blocks)
    blocks_ax.set_ylabel(f"blocks (of {num_blocks})")
    blocks_ax.set_title(title or "Memory timeline: the block pool and the request queues", pad=14)

    # Bottom: the queues as step lines.
    for part in ("running", "waiting", "swapped"):
        px, py = _steps(xs, [r[part] for r in rows])
        requests_ax.plot(px, py, color=COLORS[part], linewidth=2.2, label=LABELS[part],
                         linestyle="-" if part != "swapped" else "-.")  # fmt: skip
    # Preemptions: a vertical line through both panels at each step where a total grew.
    for mode, style in (("recompute", "--"), ("swap", ":")):
        hits = [r for r in rows if r[f"new_preemptions_{mode}"] > 0]
        if not hits:
            continue
        total = sum(r[f"new_preemptions_{mode}"] for r in hits)
        kw = {"colors": COLORS[mode], "linestyles": style, "linewidth": 2}
        steps = [r["step"] for r in hits]
        blocks_ax.vlines(steps, 0, 1, transform=blocks_ax.get_xaxis_transform(), **kw)
        requests_ax.vlines(steps, 0, 1, transform=requests_ax.get_xaxis_transform(),
                           label=f"preemption: {mode} ({total})", **kw)  # fmt: skip
    top_requests = max(max(r["running"], r["waiting"], r["swapped"]) for r in rows)
    requests_ax.set_ylim(0, top_requests + 1)
    requests_ax.yaxis.get_major_locator().set_params(integer=True)
    requests_ax.set_ylabel("requests")
    requests_ax.set_xlabel("engine step")
    requests_ax.set_xlim(xs[0] - 0.5, xs[-1] + 0.5)
    for ax in (blocks_ax, requests_ax):
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig
