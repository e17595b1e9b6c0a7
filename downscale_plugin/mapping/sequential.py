"""Sequential statistics of the certifier: a per-image paired estimate, a safe read calibrated on heavy
tails, and the family-wise levels of a run's safe reads.

Interface (``certify.py`` and ``estimator.py`` read every bin through it):

- ``read(values, looks, level, margin) -> Bound`` and ``verdict(bound, margin, looks, level)``: one test's
  bound and verdict, its safe read at the one-sided false-safe ``level`` (that test's share of the family).
- :class:`Family`: ``Family(chains, alpha)``, ``Family.both_ends(routes, alpha)``, ``family.level(key)``,
  ``family.settle(key, safe)``, ``Family.bonferroni(keys, alpha)``: turns the tests a run plans (chains of
  keys in a fixed order, two per route) and the family-wise α into per-test levels.

Per-image estimate. For one probe image and σ bin, D draws give native gradients n_d and, with paired
noise (``paired.py``), route gradients r_d (σ_d drawn i.i.d. uniform in the bin, shared by the pair).
U-statistics over distinct draws, U(x, y) = Σ_{i≠j} ⟨x_i, y_j⟩ / (D(D−1)), are unbiased for the inner
products of the population means, so the estimate of the map's estimand 1 − cos(μ_native, μ_route) is

    ê = 1 − U(n, r) / √(U(n, n)·U(r, r)).

No attenuation correction is needed (the U-statistics never pair a draw with itself), and so no second
native arm. A non-finite estimate (a non-positive U(x, x)) counts as
:data:`~downscale_plugin.mapping.estimator.TRIM`, conservative, never dropped; ê is clipped to ±TRIM, the
true excess lies in [0, 2]. ê is a ratio of U-statistics and so not unbiased: its bias is second order in
the draw noise, at most about Var(ê) in size, and low (optimistic) where the arms' noises are weakly
coupled (docs/FIDELITY.md §9.5 measures it over pairing correlations 0.5–0.9). A safe read needs the
per-image SD of ê below √n·ε/c, so where a bin can read safe the bias is a small fraction of ε; it is
not corrected (a jackknife needs every draw kept, and at high noise it is unstable).

Looks. Evidence arrives image by image and a bin stops as soon as its verdict is settled. A bin may end
``safe`` only from ``Looks.safe_from`` images on (default: the last look); earlier looks stop it only
toward not-safe (``unsafe``, ``futile``), which no tail can make optimistic, so a test's false-safe level is
spent on its safe-readable looks alone (split equally over them). The lower bound behind ``unsafe`` (an
error there costs a window, never soundness) is the t bound at α/K per look, K the number of looks. The
default looks are 2, 4, 8, 16 (K = 4, α/K = 0.0125): the first at 2 images makes a clearly not-safe bin cost
2 images' draws, an eighth of a safe read; there the t bound (1 degree of freedom) rarely confirms excess, so
such a bin often stops ``futile`` (``certify.py`` prunes between futile bins as between unsafe ones).

The safe read. Per-image excess is right-skewed (on the lab a few textures carry 3–20 × the median), and
a probe set that misses the tail has a small mean *and* a small SD, so the normal t bound reads such a bin
safe far more often than its level. Bounds valid for any law on the estimator's range certify nothing at
16 probes and ε = 0.05 (one probe may carry 1.5 = 30 ε). The safe read is therefore the studentized bound
mean + c·sd/√n with c = :func:`safe_quantile`: the (1 − level) quantile of (μ − x̄)/(s/√n) under the
heaviest laws of the calibration suite (:data:`REFERENCE_LAWS`: lognormal s = 1.5 and a Lomax tail of
index 1.5), each scaled to mean ε after clipping at 30 ε or the estimator's range, the farther (one shape
relative to ε at every margin: ``safe_read.SHAPE_MARGIN``). The false-safe rate is ≤ the level on those
laws by construction and, as measured, on lighter ones (lognormal s ≤ 1.5, Pareto index ≥ 1.5) and
family-wise on the lab's own worst per-image set (docs/FIDELITY.md §9.5). It is not distribution-free: when a few percent of images carry the
mean, a probe set misses them all with probability (1 − p)^n, and any rule that certifies the rest of the
population certifies the whole that often (docs/FIDELITY.md §9.5 tests where this fails).

The family. A run reads many bins; the guarantee is family-wise: P(any window of the run false-safe) ≤ α.
:class:`Family` is a graphical procedure (Bretz et al. 2009) of fallback chains (Wiens 2003): α is split
over the routes and, within a route, over two chains through the same bins, one in the search's fixed
order and one from its lowest bin up; a test's level is the sum over its chains of its own share plus
what that chain carried to it from the tests before it that settled safe, so levels accumulate along a
run of safe bins from either end and a not-safe bin does not end its chains. Strong control holds under
any dependence between the tests (same images, same draws) as long as the chains, shares and weights are
fixed before any evidence and each test is read safe at most at its level as it stands then
(``safe_read.py`` gives the argument).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from scipy import stats

from .estimator import Grads, grad_dot
from .safe_read import TRIM, Family, safe_quantile

__all__ = ["Family", "safe_quantile"]  # the family-wise levels live in safe_read.py (estimator.py reads them too)


def u_inner(x: torch.Tensor, y: torch.Tensor) -> float:
    """Σ_{i≠j} ⟨x_i, y_j⟩ / (D(D−1)) for (D, p) draw matrices: unbiased for ⟨E x, E y⟩ (i.i.d. draws)."""
    d = x.shape[0]
    if d < 2:
        raise ValueError(f"u_inner: {d} draws; a U-statistic needs at least 2")
    x, y = x.double(), y.double()
    return float(x.sum(0) @ y.sum(0) - (x * y).sum()) / (d * (d - 1))


def paired_excess(native: torch.Tensor, route: torch.Tensor) -> float:
    """ê = 1 − U(n, r)/√(U(n, n)·U(r, r)) of (D, p) draw matrices; see :func:`excess_of`."""
    return excess_of(u_inner(native, native), u_inner(route, route), u_inner(native, route))


def excess_of(nn: float, rr: float, nr: float) -> float:
    """1 − nr/√(nn·rr) from the three U-statistics, clipped to ±TRIM; TRIM when the norms are not positive."""
    if not (nn > 0.0 and rr > 0.0):
        return TRIM
    value = 1.0 - nr / math.sqrt(nn * rr)
    return float(min(max(value, -TRIM), TRIM)) if math.isfinite(value) else TRIM


class PairedSums:
    """The per-image estimate of one (image, bin), fed one draw at a time and never holding the draws.

    U(x, y) = (⟨Σx_d, Σy_d⟩ − Σ_d ⟨x_d, y_d⟩) / (D(D−1)), so all the estimate needs is, per arm, the
    sum of its draws (per parameter, float32 or wider, on the gradients' devices) and the float64
    scalars Σ_d ‖x_d‖² and, per route, Σ_d ⟨n_d, r_d⟩, the last taken while native draw d is at hand.
    Feed native draw d (``arm`` None), then each route's draw d, then native draw d + 1, and so on:
    the state is (1 + routes) sums and one native draw, whatever the number of draws, images and bins.
    """

    def __init__(self) -> None:
        self.draws = 0
        self.native: list[torch.Tensor] = []  # the current native draw, paired with the routes' draws of the same d
        self.sums: dict[str | None, list[torch.Tensor]] = {}
        self.squares: dict[str | None, float] = {}
        self.cross: dict[str, float] = {}
        self.counts: dict[str | None, int] = {}

    def add(self, arm: str | None, grads: Grads) -> None:
        """One draw: the native one (``arm`` None) opens draw d, a route's is paired with it."""
        if arm is None:
            self.draws += 1
            self.native = list(grads)
        elif self.counts.get(arm, 0) != self.draws - 1:
            raise ValueError(
                f"PairedSums: draw {self.counts.get(arm, 0)} of {arm} has no native draw to pair with (native first, then routes)"
            )
        else:
            self.cross[arm] = self.cross.get(arm, 0.0) + grad_dot(self.native, grads)
        self.squares[arm] = self.squares.get(arm, 0.0) + grad_dot(grads, grads)
        self.counts[arm] = self.counts.get(arm, 0) + 1
        if arm not in self.sums:
            self.sums[arm] = [g.to(torch.promote_types(g.dtype, torch.float32), copy=True) for g in grads]
        else:
            for total, g in zip(self.sums[arm], grads, strict=True):
                total.add_(g)

    def _u(self, x: str | None, y: str | None, diagonal: float) -> float:
        return (grad_dot(self.sums[x], self.sums[y]) - diagonal) / (self.draws * (self.draws - 1))

    def excess(self, route: str) -> float:
        """ê of ``route`` (:func:`excess_of`), the same number :func:`paired_excess` gives on the stacked draws."""
        if self.draws < 2 or self.counts.get(route) != self.draws:
            raise ValueError(
                f"PairedSums: {self.counts.get(route, 0)} draws of {route} for {self.draws} native draws (at least 2, one per native)"
            )
        return excess_of(
            self._u(None, None, self.squares[None]), self._u(route, route, self.squares[route]), self._u(None, route, self.cross[route])
        )


@dataclass(frozen=True)
class Looks:
    """A look schedule (images at which a bin's bound is read) and the lower bound's one-sided level α; the default's
    first look, 2 images, is where a clearly not-safe bin stops (see the module docstring)."""

    at: tuple[int, ...] = (2, 4, 8, 16)
    alpha: float = 0.05
    safe_from: int | None = None  # the first look that may end a bin safe (None: the last); see the module docstring

    def __post_init__(self) -> None:
        if not self.at or self.at[0] < 2 or any(b <= a for a, b in zip(self.at, self.at[1:], strict=False)):
            raise ValueError(f"looks: {list(self.at)} must be strictly increasing image counts, the first >= 2")
        if not 0.0 < self.alpha < 0.5:
            raise ValueError(f"looks: alpha {self.alpha} must be strictly between 0 and 0.5")
        if self.safe_from is not None and self.safe_from not in self.at:
            raise ValueError(f"looks: safe_from {self.safe_from} must be one of the looks {list(self.at)}")

    @property
    def first_safe(self) -> int:
        """Images a bin needs before a safe verdict may be read."""
        return self.last if self.safe_from is None else self.safe_from

    @property
    def level(self) -> float:
        """The per-look one-sided level α/K of the lower bound (``unsafe``)."""
        return self.alpha / len(self.at)

    @property
    def safe_looks(self) -> tuple[int, ...]:
        """The looks that may read safe: the only ones a test's false-safe level is spent on."""
        return tuple(k for k in self.at if k >= self.first_safe)

    @property
    def last(self) -> int:
        return self.at[-1]

    def next_look(self, n: int) -> int | None:
        """The first look after n images (None: n is at or past the last)."""
        return next((k for k in self.at if k > n), None)

    def t(self, n: int) -> float:
        """The lower bound's t quantile at n images."""
        return _t_quantile(1.0 - self.level, n - 1)

    def c_safe(self, n: int, level: float, margin: float) -> float:
        """The safe read's critical value at n images for a test at ``level`` (split over the safe-readable looks)."""
        return safe_quantile(level / len(self.safe_looks), n, margin)


@lru_cache(maxsize=256)
def _t_quantile(p: float, df: int) -> float:
    return float(stats.t.ppf(p, df))


@dataclass(frozen=True)
class Bound:
    """One look's reading: mean, SD, the lower bound (t) and the safe read's upper bound at ``level``."""

    n: int
    mean: float
    sd: float
    lower: float
    upper: float
    level: float = math.nan  # the test's false-safe level the upper bound was read at


def read(values: Sequence[float], looks: Looks, level: float, margin: float) -> Bound:
    """The bound after ``len(values)`` images (meant to be read at a look; valid there), the safe read at ``level``."""
    n = len(values)
    mean = float(np.mean(values))
    sd = float(np.std(values, ddof=1)) if n > 1 else math.inf
    if n < 2:
        return Bound(n, mean, sd, -math.inf, math.inf, level)
    half = sd / math.sqrt(n)
    return Bound(n, mean, sd, mean - looks.t(n) * half, _above(mean, looks.c_safe(n, level, margin), half), level)


def _above(mean: float, c: float, half: float) -> float:
    """mean + c·half; +inf when c is (a level the calibration cannot resolve), whatever the spread."""
    return math.inf if math.isinf(c) else mean + c * half


SAFE, UNSAFE, FUTILE, INCONCLUSIVE = "safe", "unsafe", "futile", "inconclusive"


def verdict(bound: Bound, margin: float, looks: Looks, level: float) -> str | None:
    """The settled verdict at a look, or None to gather more evidence.

    ``safe``: the upper bound is below ε, read at ``looks.first_safe`` images or later (before that a
    bound below ε only asks for more images). ``unsafe``: the lower bound is above ε (confirmed).
    ``futile``: were the mean to stay and the SD to fall to its 90 % lower confidence limit (a few images
    estimate it badly), even the last look's bound at ``level`` would not reach ε, so more images would buy
    nothing (only ever ends a bin not safe: it cannot raise the false-safe rate).
    ``inconclusive``: the last look passed without a verdict (not safe).
    """
    if bound.upper < margin:
        return SAFE if bound.n >= looks.first_safe else None
    if bound.lower > margin:
        return UNSAFE
    if bound.n >= looks.last:
        return INCONCLUSIVE
    sd_low = bound.sd * math.sqrt((bound.n - 1) / _chi2_quantile(FUTILITY_SD_CONFIDENCE, bound.n - 1))
    projected = _above(bound.mean, looks.c_safe(looks.last, level, margin), sd_low / math.sqrt(looks.last))
    return FUTILE if projected >= margin else None


FUTILITY_SD_CONFIDENCE = 0.9  # ``futile`` projects with the SD's lower confidence limit at this level (``verdict``)


@lru_cache(maxsize=256)
def _chi2_quantile(p: float, df: int) -> float:
    return float(stats.chi2.ppf(p, df))


def describe_safe_read(looks: Looks, margin: float) -> str:
    """One line for windows files, logs and banners: how a bin is read safe and at what family-wise α."""
    return (
        f"safe = mean + c·sd/√n < ε = {margin:g} on {looks.first_safe} distinct probe images, c the studentized quantile "
        f"of the heavy reference laws (lognormal 1.5, Lomax 1.5) at each test's level; levels from two fallback chains per route "
        f"(its bins in the plan's order, and from its lowest bin up): false-safe ≤ α = {looks.alpha:g} family-wise over routes and bins"
    )
