"""Sequential statistics of the certifier: a per-image paired estimate and an anytime-valid bound.

Per-image estimate. For one probe image and σ bin, D draws give native gradients n_d and, with paired
noise (``paired.py``), route gradients r_d (σ_d drawn i.i.d. uniform in the bin, shared by the pair).
U-statistics over distinct draws, U(x, y) = Σ_{i≠j} ⟨x_i, y_j⟩ / (D(D−1)), are unbiased for the inner
products of the population means, so the estimate of the map's estimand 1 − cos(μ_native, μ_route) is

    ê = 1 − U(n, r) / √(U(n, n)·U(r, r)).

No attenuation correction is needed (the map's Spearman–Brown debiasing, ``estimator.py``, corrects
cosines of noisy sums; the U-statistics never pair a draw with itself), and so no second native arm:
the redraw floor is 0 by construction. The map's debiased cosine would be wrong here: it assumes the
arms' noises are independent, and paired noise would inflate ĉ(native, route), i.e. read as safer.
Pairing pays through the correlated errors of the three U-statistics, which cancel in the ratio.
A non-finite estimate (a non-positive U(x, x)) counts as :data:`~downscale_plugin.mapping.estimator.TRIM`,
the worst value the map keeps: conservative, never dropped.

Anytime-valid bound. Evidence arrives image by image and a bin stops as soon as its verdict is settled,
so a fixed-n t bound would be read at a data-dependent time. :class:`Looks` makes it a confidence
sequence over a look schedule n_1 < … < n_K. A bin may end ``safe`` only from ``Looks.safe_from`` images
on (default: the last look, the full map's N); the earlier looks stop a bin only toward not-safe
(``unsafe``, ``futile``), which no tail can make optimistic. So the false-safe level is spent only on the
looks that can read safe (one by default), each at ``Looks.safe_level``; the lower bound behind
``unsafe`` (an error there costs a window, never soundness) keeps α/K per look.

Skewed per-image values. The t bound assumes per-image values roughly normal, and on real probes they
are not: on the lab model a few textures carry 3–20 × the median excess (docs/FIDELITY.md §9.3). A
probe set that draws few of them has a small mean *and* a small SD, so the t bound at level α declares
such a bin safe 10–13 % of the time at a true mean just above ε, not 5 % (simulated on populations
resampled from the lab's per-image excess, lognormal and Pareto tails: §9.5,
``benchmarks/bench_certify_bound.py``). Bounds valid for any distribution on the estimator's range
[−1.5, 1.5] (empirical Bernstein, betting) certify nothing at 16 probes and ε = 0.05: even 16 probes
reading exactly 0 leave a betting bound at 0.26. The safe read therefore takes the t quantile at
α × :data:`SKEW_SHARE`, the level at which the simulated false-safe rate on the lab's own shapes is
≤ α. It is not distribution-free: a subpopulation of a few percent far above ε that no probe draws
(37 % of the time at 6 %) is missed by any 16-probe rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from scipy import stats

from .estimator import TRIM


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


Grads = Sequence[torch.Tensor]  # one draw's gradient: a tensor per adapter parameter, on that parameter's device


def grad_dot(xs: Grads, ys: Grads) -> float:
    """Σ_k ⟨x_k, y_k⟩ over per-parameter tensors, each summed in float64 on its own device (products in
    float32 or wider); one host sync per device, no copy of a gradient leaves its device."""
    per_device: dict[torch.device, list[torch.Tensor]] = {}
    for x, y in zip(xs, ys, strict=True):
        wide = torch.promote_types(x.dtype, torch.float32)
        per_device.setdefault(x.device, []).append((x.to(wide) * y.to(wide)).sum(dtype=torch.float64))
    return math.fsum(float(torch.stack(parts).sum()) for parts in per_device.values())


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


SKEW_SHARE = 0.05  # the safe read's t level is α × this over the safe-readable looks (module docstring; FIDELITY.md §9.5)


@dataclass(frozen=True)
class Looks:
    """A look schedule (images at which a bin's bound is read) and its one-sided level α."""

    at: tuple[int, ...] = (4, 8, 16)
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
        """The looks that may read safe: the only ones the false-safe level is spent on."""
        return tuple(k for k in self.at if k >= self.first_safe)

    @property
    def safe_level(self) -> float:
        """The per-look one-sided level of the upper bound: α × :data:`SKEW_SHARE` over the safe-readable looks."""
        return self.alpha * SKEW_SHARE / len(self.safe_looks)

    @property
    def last(self) -> int:
        return self.at[-1]

    def next_look(self, n: int) -> int | None:
        """The first look after n images (None: n is at or past the last)."""
        return next((k for k in self.at if k > n), None)

    def t(self, n: int) -> float:
        """The lower bound's t quantile at n images."""
        return _t_quantile(1.0 - self.level, n - 1)

    def t_safe(self, n: int) -> float:
        """The upper bound's t quantile at n images."""
        return _t_quantile(1.0 - self.safe_level, n - 1)


@lru_cache(maxsize=256)
def _t_quantile(p: float, df: int) -> float:
    return float(stats.t.ppf(p, df))


@dataclass(frozen=True)
class Bound:
    """One look's reading: mean, SD, the anytime-valid lower and upper bounds of the mean."""

    n: int
    mean: float
    sd: float
    lower: float
    upper: float


def read(values: Sequence[float], looks: Looks) -> Bound:
    """The bound after ``len(values)`` images (meant to be read at a look; valid there)."""
    n = len(values)
    mean = float(np.mean(values))
    sd = float(np.std(values, ddof=1)) if n > 1 else math.inf
    if n < 2:
        return Bound(n, mean, sd, -math.inf, math.inf)
    return Bound(n, mean, sd, mean - looks.t(n) * sd / math.sqrt(n), mean + looks.t_safe(n) * sd / math.sqrt(n))


SAFE, UNSAFE, FUTILE, INCONCLUSIVE = "safe", "unsafe", "futile", "inconclusive"


def verdict(bound: Bound, margin: float, looks: Looks) -> str | None:
    """The settled verdict at a look, or None to gather more evidence.

    ``safe``: the upper bound is below ε, read at ``looks.first_safe`` images or later (before that a
    bound below ε only asks for more images). ``unsafe``: the lower bound is above ε (confirmed).
    ``futile``: were the mean and SD to stay, even the last look's bound would not reach ε, so more
    images would buy nothing (only ever ends a bin unsafe: it cannot raise the false-safe rate).
    ``inconclusive``: the last look passed without a verdict (not safe).
    """
    if bound.upper < margin:
        return SAFE if bound.n >= looks.first_safe else None
    if bound.lower > margin:
        return UNSAFE
    if bound.n >= looks.last:
        return INCONCLUSIVE
    projected = bound.mean + looks.t_safe(looks.last) * bound.sd / math.sqrt(looks.last)
    return FUTILE if projected >= margin else None
