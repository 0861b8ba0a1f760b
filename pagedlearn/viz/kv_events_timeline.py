"""What a KV-event stream did over time: blocks stored and removed, and the cache's size.

Two panels share the x axis, seconds since the first batch the subscriber applied:

- **per batch** (top): blocks stored (up) and removed (down) by each batch -- a prompt's prefill
  is a spike up, eviction under memory pressure a run of spikes down; dash-dotted lines mark an
  ``AllBlocksCleared`` (vLLM's ``reset_prefix_cache``);
- **cached blocks** (bottom): how many blocks the cache held after each batch, as the events
  describe it (what was stored before the subscriber joined is not in it).

Drawn from :attr:`KVCacheState.timeline <pagedlearn.kv_events.cache_state.KVCacheState>`, a
bounded deque: a long run shows its latest ``history`` batches, and the title says so.
"""

from __future__ import annotations

import matplotlib
from matplotlib.figure import Figure

from pagedlearn.kv_events.cache_state import KVCacheState
from pagedlearn.viz.style import OKABE_ITO, STYLE

COLORS = {"stored": OKABE_ITO[0], "removed": OKABE_ITO[3], "cleared": OKABE_ITO[2],
          "size": "#000000"}  # fmt: skip


def timeline_points(state: KVCacheState) -> list[dict]:
    """One dict per applied batch: ``t`` (s since the first batch), ``seq``, ``stored``,
    ``removed``, ``cleared`` (blocks), ``size`` (blocks held after it)."""
    if not isinstance(state, KVCacheState):
        raise TypeError(f"needs a KVCacheState, got {type(state).__name__}")
    t0 = state.first_ts or 0.0
    return [{**p._asdict(), "t": p.ts - t0} for p in state.timeline]


def draw_kv_events_timeline(state: KVCacheState, *, title: str | None = None) -> Figure:
    """Blocks stored / removed per batch (top) and cached blocks (bottom) over time."""
    points = timeline_points(state)
    if not points:
        raise ValueError("no batch applied yet: there is no timeline to draw")
    with matplotlib.rc_context(STYLE):
        return _draw(state, points, title)


def _draw(state: KVCacheState, points: list[dict], title: str | None) -> Figure:
    fig = Figure(figsize=(10, 5.5))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[1, 1])
    t = [p["t"] for p in points]
    stored = [p["stored"] for p in points]
    removed = [-p["removed"] for p in points]
    width = max(3.0, 0.8 * (72 * 9 / max(len(points), 1)))  # points: thin bars for long runs
    top.vlines(t, 0, stored, color=COLORS["stored"], linewidth=min(width, 6),
               label=f"stored ({sum(stored)} blocks)")  # fmt: skip
    top.vlines(t, removed, 0, color=COLORS["removed"], linewidth=min(width, 6),
               label=f"removed ({-sum(removed)} blocks)")  # fmt: skip
    top.axhline(0, color="#8c8c8c", linewidth=0.8)
    cleared = [p for p in points if p["cleared"]]
    for i, p in enumerate(cleared):
        for ax in (top, bottom):
            ax.axvline(p["t"], color=COLORS["cleared"], linestyle="-.", linewidth=1.5,
                       label=f"all blocks cleared ({len(cleared)})" if i == 0 and ax is top
                       else None)  # fmt: skip
    top.set_ylabel("blocks per batch")
    top.legend(loc="upper left", frameon=False, ncols=3)
    top.margins(y=0.25)
    xs, ys = [], []
    for p in points:  # a step line: the size holds until the next batch
        xs += [p["t"], p["t"]]
        ys += [ys[-1] if ys else p["size"] - p["stored"] + p["removed"] + p["cleared"], p["size"]]
    bottom.plot(xs, ys, color=COLORS["size"], linewidth=1.5)
    bottom.fill_between(xs, ys, color=COLORS["stored"], alpha=0.15)
    bottom.set_ylabel("cached blocks")
    bottom.set_xlabel("seconds since the first batch")
    bottom.set_ylim(bottom=0)
    for ax in (top, bottom):
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    first, last = points[0]["seq"], points[-1]["seq"]
    seqs = f", seq {first}-{last}" if first is not None else ""
    more = state.received.get("batches", 0) - len(points)
    head = title or f"KV-cache events: {len(points)} batches{seqs}"
    fig.suptitle(head + (f" (the latest; {more} earlier not kept)" if more > 0 else ""))
    fig.tight_layout()
    return fig
