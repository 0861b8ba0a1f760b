"""Operator metrics: distributions and windows over the engine's life (issue 16; being written).

:func:`percentiles` is shared by the metrics and the load test.
"""

from __future__ import annotations

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
