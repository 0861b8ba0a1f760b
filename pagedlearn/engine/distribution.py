"""A measured quantity over a server's life: a fixed-bucket histogram plus a recent window.

:class:`Distribution` is what every number in :class:`~pagedlearn.engine.metrics.EngineMetrics`
is kept in (TTFT, inter-token gaps, prompt lengths, ...): the histogram is what Prometheus
scrapes (:mod:`pagedlearn.engine.prometheus`), the window gives the exact recent percentiles the
summaries print. Separate from metrics.py because it knows nothing of engines: the load tests
(:mod:`pagedlearn.loadtest`) and the benchmarks call :func:`percentiles` on their own lists.

>>> d = Distribution((1, 2, 5), window=3)
>>> for x in (0.5, 1.5, 4, 9): d.observe(x)
>>> d.cumulative(), list(d.recent)  # the histogram saw all four, the window keeps three
([('1.0', 1), ('2.0', 2), ('5.0', 3), ('+Inf', 4)], [1.5, 4, 9])
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Sequence


def percentiles(values: Iterable[float], qs: Sequence[float] = (50, 90, 99)) -> dict[float, float]:
    """``{q: the q-th percentile of values}`` (linear interpolation between the closest ranks,
    as numpy's default); NaN for each q when there are no values."""
    xs = sorted(values)
    out = {}
    for q in qs:
        if not xs:
            out[q] = float("nan")
            continue
        pos = (len(xs) - 1) * q / 100
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        out[q] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return out


def one_two_five(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value``.

    >>> one_two_five(100)
    (1, 2, 5, 10, 20, 50, 100)
    """
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class Distribution:
    """One measured quantity: a histogram over the engine's life (``bounds``: bucket upper
    bounds, a value counts in the first bucket whose bound is >= it, as Prometheus' ``le``) and
    the last ``window`` values, for exact recent percentiles. Memory: fixed."""

    __slots__ = ("bounds", "count", "counts", "recent", "sum")

    def __init__(self, bounds: Sequence[float], window: int) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.count, self.sum = 0, 0.0
        self.recent: deque[float] = deque(maxlen=window)

    def observe(self, x: float) -> None:
        self.counts[bisect_left(self.bounds, x)] += 1
        self.count += 1
        self.sum += x
        self.recent.append(x)

    def percentiles(self, qs: Sequence[float] = (50, 90, 99)) -> dict[float, float]:
        """Over the recent window (NaN while empty)."""
        return percentiles(self.recent, qs)

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(le, observations <= le), ..., ("+Inf", count)]``: Prometheus' bucket samples."""
        out, total = [], 0
        for bound, n in zip((*map(repr, self.bounds), "+Inf"), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out
