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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


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


# ---- the quality study's statistics (docs/fidelity/quality/PROTOCOL.md §3, §5): vectorised over replicates ----

Decision = str  # "fails", "non-inferior" or "inconclusive"


def strata_sigmas(fixed: Sequence[float], bands: Sequence[tuple[float, float]]) -> list[float]:
    """PROTOCOL §3's strata: the ``fixed`` σ plus, for each routed band (lo, hi] that holds none of them,
    its midpoint; sorted, without repeats."""
    out = sorted(set(float(s) for s in fixed))
    if not out or any(not 0.0 < s <= 1.0 for s in out):
        raise ValueError(f"strata: the fixed σ must lie in (0, 1] (got {list(fixed)})")
    for lo, hi in bands:
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"strata: a routed band must satisfy 0 <= lo < hi <= 1 (got ({lo}, {hi}))")
        if not any(lo < s <= hi for s in out):
            out = sorted({*out, (lo + hi) / 2})
    return out


def stratum_weights(sigmas: Sequence[float], cdf: Callable[[float], float]) -> list[float]:
    """PROTOCOL §3's training-law weights: stratum k's cell is (0, 1] split at the midpoints between
    consecutive strata, its weight the training σ law's mass there (``cdf``: the law's CDF on [0, 1])."""
    s = list(sigmas)
    if not s or any(b <= a for a, b in itertools.pairwise(s)):
        raise ValueError(f"stratum_weights needs increasing σ (got {s})")
    edges = [0.0, *((a + b) / 2 for a, b in itertools.pairwise(s)), 1.0]
    total = cdf(1.0) - cdf(0.0)
    return [(cdf(hi) - cdf(lo)) / total for lo, hi in itertools.pairwise(edges)]


def isotonic_decreasing(y: np.ndarray) -> np.ndarray:
    """:func:`monotone_fit` over the last axis of ``y``, for every leading index at once: the min-max
    form of the non-increasing least-squares fit, f(i) = min over j ≤ i of max over k ≥ i of mean(y[j..k])."""
    n = y.shape[-1]
    csum = np.concatenate([np.zeros((*y.shape[:-1], 1)), np.cumsum(y, axis=-1)], axis=-1)
    j, k = np.arange(n)[:, None], np.arange(n)[None, :]
    with np.errstate(invalid="ignore", divide="ignore"):
        means = (csum[..., None, 1:] - csum[..., :-1, None]) / (k - j + 1)  # [..., j, k]: mean of y[j..k]
    means = np.where(k >= j, means, -np.inf)
    upper = np.flip(np.maximum.accumulate(np.flip(means, -1), axis=-1), -1)  # max over k' ≥ k
    lower = np.minimum.accumulate(upper, axis=-2)  # min over j' ≤ j
    return np.diagonal(lower, axis1=-2, axis2=-1).copy()


def first_reach_batch(xs: np.ndarray, ys: np.ndarray, target: np.ndarray) -> np.ndarray:
    """:func:`first_reach` of each curve (last axis), broadcast over the leading ones; NaN where never."""
    xs, ys = np.broadcast_arrays(xs, ys)
    hit = ys <= np.asarray(target)[..., None]
    first = np.argmax(hit, axis=-1)
    prev = np.maximum(first - 1, 0)
    take = lambda a, i: np.take_along_axis(a, i[..., None], -1)[..., 0]  # noqa: E731
    x0, x1, y0, y1 = take(xs, prev), take(xs, first), take(ys, prev), take(ys, first)
    with np.errstate(invalid="ignore", divide="ignore"):
        between = np.where(y0 == y1, x1, x0 + (x1 - x0) * (y0 - target) / (y0 - y1))
    out = np.where(first == 0, xs[..., 0], between)
    return np.where(hit.any(axis=-1), out, np.nan)


@dataclass(frozen=True)
class Curves:
    """One arm's runs of one concept, seeds aligned with its native twin's: per seed and validation point
    the per-item losses averaged over noise draws, ``losses[seed, point, item, stratum]``; the training
    FLOPs and CPU seconds spent at each point, ``flops``/``cpu`` ``[seed, point]`` (the last point is the
    budget). Every seed has the same points."""

    losses: np.ndarray
    flops: np.ndarray
    cpu: np.ndarray

    def __post_init__(self) -> None:
        s, p = self.losses.shape[:2]
        if self.losses.ndim != 4 or self.flops.shape != (s, p) or self.cpu.shape != (s, p):
            raise ValueError(f"Curves: losses [seed, point, item, stratum] and flops/cpu [seed, point] disagree "
                             f"({self.losses.shape}, {self.flops.shape}, {self.cpu.shape})")  # fmt: skip


def bootstrap_draws(seeds: int, items: int, reps: int = 2000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """PROTOCOL §5's two-way bootstrap: per replicate, seed indices and item (crop) indices resampled with
    replacement, independently. Returns ``(seed_idx [reps, seeds], item_weight [reps, items])``, the
    item weights being each item's count ÷ ``items``; row 0 is the data itself (every weight 1/items)."""
    rng = np.random.default_rng(seed)
    seed_idx = np.concatenate([np.arange(seeds)[None], rng.integers(seeds, size=(reps, seeds))])
    picks = rng.integers(items, size=(reps, items))
    counts = np.zeros((reps, items))
    np.add.at(counts, (np.arange(reps)[:, None], picks), 1.0)
    return seed_idx, np.concatenate([np.full((1, items), 1.0 / items), counts / items])


def _strata_means(c: Curves, item_weight: np.ndarray) -> np.ndarray:
    """[rep, seed, point, stratum]: each stratum's loss over the replicate's items."""
    return np.einsum("ri,spik->rspk", item_weight, c.losses, optimize=True)


def _bootstrap_t(estimate: np.ndarray, replicates: np.ndarray, levels: int, level: float) -> tuple[np.ndarray, np.ndarray]:
    """estimate ± q · SE, SE the replicates' SD × √(n / (n − 1)) and q Student's t quantile with n − 1 degrees of
    freedom, n = ``levels`` (the fewer of seeds and crops). With 10 crops the two-way percentile interval is narrow
    (it covered 87–89 % of known differences at 95 %, ``tests/test_quality_stats.py``): resampling n levels shrinks
    the variance by (n − 1) / n, and the SD of so few levels is itself uncertain; this corrects both."""
    from scipy import stats

    if levels < 2:  # one seed or one crop: no spread to read, no interval
        nan = np.full(np.shape(estimate), math.nan)
        return nan, nan
    se = replicates.std(axis=0, ddof=1) * math.sqrt(levels / (levels - 1))
    half = float(stats.t.ppf(0.5 + level / 2, levels - 1)) * se
    return estimate - half, estimate + half


def _interval(estimate: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> dict[str, Any]:
    scalar = lambda a: float(a)  # noqa: E731
    if np.ndim(estimate) == 0:
        return {"diff": scalar(estimate), "lo": scalar(lo), "hi": scalar(hi)}
    return {"diff": [float(v) for v in estimate], "lo": [float(v) for v in lo], "hi": [float(v) for v in hi]}


def native_gain(native: Curves, weights: Sequence[float]) -> dict[str, np.ndarray]:
    """Per native seed (PROTOCOL §5): L̄ at step 0, the improvement G (L̄(0) − the end of L̄'s monotone fit
    over FLOPs) and the last quarter's share of G (the fit from 3/4 of the FLOPs to the end)."""
    lbar = _strata_means(native, np.full((1, native.losses.shape[2]), 1 / native.losses.shape[2]))[0] @ np.asarray(weights)
    fit = isotonic_decreasing(lbar)
    base, end = lbar[:, 0], fit[:, -1]
    at = np.array([np.interp(0.75 * f[-1], f, y) for f, y in zip(native.flops, fit, strict=True)])
    gain = base - end
    with np.errstate(invalid="ignore", divide="ignore"):
        return {"base": base, "gain": gain, "gain_fraction": gain / base, "last_quarter_fraction": (at - end) / gain}


def arm_statistics(
    native: Curves,
    arm: Curves,
    weights: Sequence[float],
    *,
    quality: float = 0.9,
    reps: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> dict[str, Any]:
    """An arm against its native twins (same seeds, same items and strata), PROTOCOL §5: the time to
    ``quality`` of native's improvement in FLOPs and CPU seconds (geometric mean of per-seed ratios; an
    unreached seed enters at its budget, and ``reached`` counts the others), and the arm − native
    difference at the last point (one unit of native FLOPs) of L̄ and of each stratum; every interval
    from :func:`bootstrap_draws` (each replicate recomputes every per-seed figure from its items)."""
    if native.losses.shape[0] != arm.losses.shape[0] or native.losses.shape[2:] != arm.losses.shape[2:]:
        raise ValueError(f"arm_statistics: the arm's runs {arm.losses.shape} do not pair with native's {native.losses.shape}")
    w = np.asarray(weights, dtype=float)
    if w.shape != (native.losses.shape[3],):
        raise ValueError(f"arm_statistics: {len(w)} weights for {native.losses.shape[3]} strata")
    seed_idx, item_weight = bootstrap_draws(native.losses.shape[0], native.losses.shape[2], reps, seed)
    levels = min(native.losses.shape[0], native.losses.shape[2])
    nat_k, arm_k = _strata_means(native, item_weight), _strata_means(arm, item_weight)
    nat_l, arm_l = nat_k @ w, arm_k @ w  # [rep, seed, point]
    nat_fit, arm_fit = isotonic_decreasing(nat_l), isotonic_decreasing(arm_l)
    target = nat_l[..., 0] - quality * (nat_l[..., 0] - nat_fit[..., -1])
    pick = lambda a: np.take_along_axis(a, seed_idx, axis=1)  # noqa: E731  [rep, seed] resampled seeds
    out: dict[str, Any] = {}
    for clock, nat_x, arm_x in (("flops", native.flops, arm.flops), ("cpu", native.cpu, arm.cpu)):
        t_nat, t_arm = first_reach_batch(nat_x, nat_fit, target), first_reach_batch(arm_x, arm_fit, target)
        reached = ~np.isnan(t_arm)
        ratio = np.where(reached, t_arm, arm_x[:, -1]) / np.where(np.isnan(t_nat), nat_x[:, -1], t_nat)
        geo = np.exp(pick(np.log(ratio)).mean(axis=1))
        log_lo, log_hi = _bootstrap_t(np.log(geo[0]), np.log(geo[1:]), levels, level)
        lo, hi = np.exp(log_lo), np.exp(log_hi)
        out[clock] = {"ratio": float(geo[0]), "lo": float(lo), "hi": float(hi), "reached": int(reached[0].sum()),
                      "seeds": int(reached.shape[1])}  # fmt: skip
    diff_l = pick(arm_l[..., -1] - nat_l[..., -1]).mean(axis=1)
    diff_k = np.take_along_axis(arm_k[:, :, -1] - nat_k[:, :, -1], seed_idx[..., None], axis=1).mean(axis=1)  # [rep, stratum]
    return {
        "time_to_quality": out,
        "equal_compute": _interval(diff_l[0], *_bootstrap_t(diff_l[0], diff_l[1:], levels, level)),
        "equal_compute_by_stratum": _interval(diff_k[0], *_bootstrap_t(diff_k[0], diff_k[1:], levels, level)),
    }


def paired_item_difference(native: np.ndarray, arm: np.ndarray, *, reps: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """The mean arm − native difference of a per-(seed, item) figure ``[seed, item]`` (the sample metric:
    items are the samples' noise seeds), with the two-way bootstrap's interval."""
    if native.shape != arm.shape or native.ndim != 2:
        raise ValueError(f"paired_item_difference needs two equal [seed, item] arrays (got {native.shape}, {arm.shape})")
    seed_idx, item_weight = bootstrap_draws(*native.shape, reps, seed)
    per_seed = (arm - native) @ item_weight.T  # [seed, rep]
    diff = np.take_along_axis(per_seed.T, seed_idx, axis=1).mean(axis=1)
    return _interval(diff[0], *_bootstrap_t(diff[0], diff[1:], min(native.shape), level))


def decide(lbar: dict, strata: dict, routed: Sequence[bool], delta: float) -> Decision:
    """PROTOCOL §5's decision for an arm: *fails* when the interval of L̄ or of any stratum lies wholly
    above ``delta``; *non-inferior* when the upper end is below ``delta`` for L̄ and for every stratum
    inside a band the arm routes (``routed``, one flag per stratum); otherwise *inconclusive*."""
    if len(routed) != len(strata["hi"]):
        raise ValueError(f"decide: {len(routed)} routed flags for {len(strata['hi'])} strata")
    if lbar["lo"] > delta or any(lo > delta for lo in strata["lo"]):
        return "fails"
    if lbar["hi"] < delta and all(hi < delta for hi, r in zip(strata["hi"], routed, strict=True) if r):
        return "non-inferior"
    return "inconclusive"
