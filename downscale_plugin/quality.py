"""Time to quality of paired runs: the lab study's twins (``benchmarks/bench_quality.py``) and a
user's native and routed runs in their own host (``ttq``): paired intervals over seeds, a run's
validation loss read off at a given compute, and when its smoothed curve reaches a target.

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


def monotone_fit(ys: Sequence[float]) -> list[float]:
    """The least-squares non-increasing fit of a validation curve (pool adjacent violators): the
    smoothed curve time to quality is read from. A fine-tune's expected validation loss falls as it
    trains; the fit removes the validation points' noise without a bandwidth to choose."""
    blocks: list[list[float]] = []  # [mean, weight]
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            m2, w2 = blocks.pop()
            m1, w1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    return [m for m, w in blocks for _ in range(int(w))]


def first_reach(xs: Sequence[float], ys: Sequence[float], target: float) -> float | None:
    """The first x at which the curve (``ys`` over increasing ``xs``) reaches ``target`` or below,
    linearly interpolated between the two points that bracket it; None if it never does."""
    if len(xs) != len(ys) or not xs:
        raise ValueError("first_reach needs equally long, non-empty xs and ys")
    if ys[0] <= target:
        return xs[0]
    for i in range(1, len(xs)):
        if ys[i] <= target:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return x1 if y0 == y1 else x0 + (x1 - x0) * (y0 - target) / (y0 - y1)
    return None


@dataclass(frozen=True)
class RatioInterval:
    """Geometric-mean ratio (arm ÷ native) over seeds with its paired 95 % interval from the t interval
    of the log-ratios, the bootstrap's percentile interval of the same mean as a check, and how many
    seeds reached the target (the others enter at the run's cap: their ratio is a lower bound)."""

    ratio: float
    lo: float | None
    hi: float | None
    boot_lo: float | None
    boot_hi: float | None
    reached: int
    seeds: int

    def as_dict(self) -> dict[str, float | int | None]:
        return {"ratio": self.ratio, "lo": self.lo, "hi": self.hi, "boot_lo": self.boot_lo, "boot_hi": self.boot_hi,
                "reached": self.reached, "seeds": self.seeds}  # fmt: skip


def bootstrap_mean_interval(values: Sequence[float], level: float = 0.95, reps: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean over independent values (seeds resampled with replacement)."""
    import numpy as np

    x = np.asarray(values, dtype=float)
    means = x[np.random.default_rng(seed).integers(len(x), size=(reps, len(x)))].mean(axis=1)
    return float(np.quantile(means, (1 - level) / 2)), float(np.quantile(means, (1 + level) / 2))


def ratio_interval(ratios: Sequence[float], reached: Sequence[bool], level: float = 0.95) -> RatioInterval:
    """:class:`RatioInterval` of per-seed ratios (each seed's arm ÷ its own native twin)."""
    if len(ratios) != len(reached) or not ratios or any(r <= 0 for r in ratios):
        raise ValueError("ratio_interval needs one positive ratio and one reached flag per seed")
    logs = [math.log(r) for r in ratios]
    iv = paired_interval(logs, level)
    boot = bootstrap_mean_interval(logs, level) if len(logs) > 1 else (None, None)
    exp = lambda v: None if v is None else math.exp(v)  # noqa: E731
    return RatioInterval(math.exp(iv.mean), exp(iv.lo), exp(iv.hi), exp(boot[0]), exp(boot[1]), sum(reached), len(ratios))
