"""Borrowing peer devices' host links: how a job's blocks are split over paths.

A device's own PCIe link bounds its host transfers (about 55 GB/s on Gen5). Where
devices are joined by NVLink, a job's bytes can also go host -> peer over the peer's
own link, then peer -> device over NVLink (and the reverse for stores); on a 4-GPU
host three borrowed links moved 2.85 times one link. A job is then cut into one
contiguous part per path, each path taking a share of its blocks in proportion to
the rate measured on it (:func:`split_units`).

Nothing here touches a device: the handler does not use these paths yet.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from offload_engine._checks import check_int


def split_units(
    units: int, rates: Sequence[float], *, min_units: int = 1
) -> tuple[tuple[int, int], ...]:
    """Cut ``units`` blocks into one contiguous ``(start, stop)`` range per path.

    ``rates`` holds each path's measured rate, the device's own link first; the
    result has one range per rate, in the same order, covering ``[0, units)``
    without gap or overlap (a path that gets nothing has ``start == stop``).

    Each path's part is its share of the rates, rounded so that the parts add up:
    the boundaries between parts are the cumulative shares rounded to the nearest
    unit, so every part lies within one unit of ``units * rate / sum(rates)``, the
    same inputs always give the same cut, and no unit is lost or moved twice. A
    rate that is zero, negative or NaN (a path that failed or was never measured)
    gets nothing; if no rate is positive, the own link takes every unit.

    A peer's part smaller than ``min_units`` folds into the own link: a borrowed
    path costs its own copies and events, which a part of a block or two does not
    repay. The own link's part is never folded (it is where the rest goes).

    Raises ``TypeError`` for a rate that is not a number, ``ValueError`` for an
    infinite rate, no rates at all, or ``units`` / ``min_units`` that are not
    ints of at least 0 / 1.
    """
    check_int(units, "units", minimum=0, error=ValueError)
    check_int(min_units, "min_units", error=ValueError)
    weights = _weights(rates)
    counts = _proportional(units, weights)
    for i in range(1, len(counts)):
        if 0 < counts[i] < min_units:
            counts[0] += counts[i]
            counts[i] = 0
    ranges = []
    start = 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return tuple(ranges)


def _weights(rates: Sequence[float]) -> list[float]:
    """The rates as weights in [0, 1] (divided by the largest, so their sum cannot
    overflow); a rate that is not positive, NaN included, weighs 0."""
    if isinstance(rates, (str, bytes)) or not isinstance(rates, Sequence):
        raise TypeError(f"rates must be a sequence of numbers, got {type(rates).__name__}")
    if not rates:
        raise ValueError("rates must name at least the own link, got none")
    weights = []
    for i, rate in enumerate(rates):
        if isinstance(rate, bool) or not isinstance(rate, (int, float)):
            raise TypeError(f"rates[{i}] must be a number, got {rate!r}")
        if rate == math.inf:
            raise ValueError(f"rates[{i}] must be finite, got {rate!r}")
        weights.append(float(rate) if rate > 0 else 0.0)
    top = max(weights)
    return [w / top for w in weights] if top > 0 else weights


def _proportional(units: int, weights: list[float]) -> list[int]:
    """Per-path counts: the boundaries are the cumulative weights' shares of
    ``units``, each rounded half up (monotone, so no count is negative); the last
    is ``units`` itself."""
    cumulative = list(itertools.accumulate(weights))
    total = cumulative[-1]
    if total == 0:
        return [units] + [0] * (len(weights) - 1)
    counts = []
    done = 0
    for acc in cumulative[:-1]:
        bound = min(units, math.floor(units * acc / total + 0.5))
        counts.append(bound - done)
        done = bound
    counts.append(units - done)
    return counts
