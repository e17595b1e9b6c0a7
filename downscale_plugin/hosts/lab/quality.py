"""Statistics of a twin quality study (``benchmarks/bench_quality.py``): paired intervals over seeds
and a run's validation loss read off at a given compute.

Each seed gives one paired difference (routed twin − native twin, same seed); seeds are independent,
so the mean difference gets a Student t interval. Its assumption: the per-seed differences are i.i.d.
draws from a distribution close enough to normal for a t interval at n ≈ 8 (a symmetric, light-tailed
one; the study prints every seed's difference so a reader can see whether that holds).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Interval:
    """Mean of paired differences and its two-sided interval (``lo``/``hi`` None below two values)."""

    mean: float
    lo: float | None
    hi: float | None
    n: int

    def as_dict(self) -> dict[str, float | None]:
        return {"mean": self.mean, "lo": self.lo, "hi": self.hi}

    @property
    def excludes_zero(self) -> bool:
        return self.lo is not None and (self.lo > 0 or self.hi < 0)


def paired_interval(diffs: Sequence[float], level: float = 0.95) -> Interval:
    """Student t interval for the mean of ``diffs`` (one paired difference per independent seed)."""
    from scipy import stats

    if not diffs:
        raise ValueError("paired_interval needs at least one difference")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1) (got {level})")
    n = len(diffs)
    mean = statistics.fmean(diffs)
    if n < 2:
        return Interval(mean, None, None, n)
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * statistics.stdev(diffs) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def value_at(xs: Sequence[float], ys: Sequence[float], x: float) -> float | None:
    """``ys`` linearly interpolated at ``x`` over increasing ``xs`` (a validation curve against
    cumulative FLOPs or seconds); None when ``x`` lies outside the curve (the run stopped short)."""
    if len(xs) != len(ys) or not xs:
        raise ValueError("value_at needs equally long, non-empty xs and ys")
    if any(b < a for a, b in itertools.pairwise(xs)):
        raise ValueError("value_at needs non-decreasing xs")
    if x < xs[0] or x > xs[-1]:
        return None
    for i in range(1, len(xs)):
        if x <= xs[i]:
            x0, x1 = xs[i - 1], xs[i]
            return ys[i] if x1 == x0 else ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)
    return ys[0]  # a one-point curve at x


def variance_ratio(paired: Sequence[float], unpaired: Sequence[float]) -> float | None:
    """var(unpaired differences) / var(paired ones): how many times fewer seeds twins need for the
    same interval width (None when either has fewer than two values or the paired variance is 0)."""
    if len(paired) < 2 or len(unpaired) < 2:
        return None
    vp = statistics.variance(paired)
    return None if vp == 0 else statistics.variance(unpaired) / vp
