"""Latency tails against the pool's headroom: what an operator reads off a load test.

A dashboard shows the pool's free blocks and the latency percentiles side by side; the question
behind them is "when the pool ran short, who paid?". :func:`tails_by_headroom` answers it from
load-test reports (loadtest/report.py): each request is placed by the **fewest free blocks it
lived through** -- the minimum of the free GPU blocks after every step from its arrival to its
end (the report's per-step ``series``) -- and the requests of each range of that number are
summarised by their TTFT p50 / p99 and their ITL p99 and max (the longest single gap between two
of a request's tokens: a preempted request's wait shows there, while the few preemptions of a run
may hide below its p99).

>>> series = {"t": [0.1, 0.2, 0.3], "free_blocks": [5, 0, 7]}  # after each step
>>> fewest_free_blocks(series, {"arrival": 0.0, "end": 0.05})  # ended in the first step
5
>>> fewest_free_blocks(series, {"arrival": 0.25, "end": 0.4})  # lived through the third
7
>>> fewest_free_blocks(series, {"arrival": 0.0, "end": 0.15})  # the first two
0
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

from pagedlearn.engine.distribution import percentiles

EDGES = (0, 1, 4, 16, 64)  # ranges of the fewest free blocks: 0, 1-3, 4-15, 16-63, 64 and more


def fewest_free_blocks(series: dict, record: dict) -> int | None:
    """The fewest free GPU blocks after any step from ``record``'s arrival to its end (the
    steps' times are ``series["t"]``, as the record's ``arrival`` and ``end``); None for a
    request that never ran (rejected) or when no step falls in its life."""
    if record.get("arrival") is None or record.get("end") is None:
        return None
    t = series["t"]
    lo = bisect.bisect_left(t, record["arrival"])
    hi = bisect.bisect_right(t, record["end"])
    # The step that ended just after its end counts too: it may be the step that finished it.
    window = series["free_blocks"][lo : min(hi + 1, len(t))]
    return min(window) if window else None


def tails_by_headroom(reports: Iterable, edges: Sequence[int] = EDGES) -> list[dict]:
    """One row per range of the fewest free blocks (``edges[i] <= x < edges[i + 1]``, the last
    range open), over every request of every report that got a first token: its ``label``, the
    ``requests`` in it, ``ttft_p50`` / ``ttft_p99`` and ``itl_p99`` / ``itl_max`` in seconds
    (NaN where the range has none), and ``preempted`` (requests preempted at least once).
    Empty ranges are kept, so that rows line up across calls."""
    groups: list[list[dict]] = [[] for _ in edges]
    for report in reports:
        for r in report.requests:
            x = fewest_free_blocks(report.series, r)
            if x is None or r["ttft"] is None:
                continue
            groups[bisect.bisect_right(edges, x) - 1].append(r)
    rows = []
    for i, members in enumerate(groups):
        hi = edges[i + 1] - 1 if i + 1 < len(edges) else None
        label = f"{edges[i]}" if hi == edges[i] else f"{edges[i]}-{hi}" if hi else f"{edges[i]}+"
        ttft = percentiles([r["ttft"] for r in members], (50, 99))
        gaps = [g for r in members for g in r["itl"]]
        rows.append(
            {
                "label": label,
                "requests": len(members),
                "preempted": sum(r["num_preemptions"] > 0 for r in members),
                "ttft_p50": ttft[50],
                "ttft_p99": ttft[99],
                "itl_p99": percentiles(gaps, (99,))[99],
                "itl_max": max(gaps, default=float("nan")),
            }
        )
    return rows
