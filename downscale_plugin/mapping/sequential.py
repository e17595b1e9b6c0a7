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
sequence over a look schedule n_1 < … < n_K: the one-sided t bound at look k is taken at level α/K,
so by the union bound P(μ > UB at any look) ≤ α whatever the stopping rule (Bonferroni α-spending;
the t bound itself assumes per-image values i.i.d. normal, the assumption the map's bound makes).

Safe only at the last look. The t bound also assumes the per-image values are roughly normal, and on
real probes they are not: on the lab model a few textures carry 3–20 × the median excess, so a first
look at 4 of 16 probes misses all of them about one time in five and its bound, small SD and all,
reads safe where the full map over the 16 is not (docs/FIDELITY.md §9.3). So a bin may end ``safe``
only from ``Looks.safe_from`` images on (default: the last look, the full map's N); the earlier looks
stop a bin only toward not-safe (``unsafe``, ``futile``), which no tail can make optimistic.
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
    """ê = 1 − U(n, r)/√(U(n, n)·U(r, r)), clipped to ±TRIM; TRIM when the norms are not positive."""
    nn, rr = u_inner(native, native), u_inner(route, route)
    if not (nn > 0.0 and rr > 0.0):
        return TRIM
    value = 1.0 - u_inner(native, route) / math.sqrt(nn * rr)
    return float(min(max(value, -TRIM), TRIM)) if math.isfinite(value) else TRIM


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
        """The per-look one-sided level α/K."""
        return self.alpha / len(self.at)

    @property
    def last(self) -> int:
        return self.at[-1]

    def next_look(self, n: int) -> int | None:
        """The first look after n images (None: n is at or past the last)."""
        return next((k for k in self.at if k > n), None)

    def t(self, n: int) -> float:
        return _t_quantile(1.0 - self.level, n - 1)


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
    half = looks.t(n) * sd / math.sqrt(n) if n > 1 else math.inf
    return Bound(n, mean, sd, mean - half, mean + half)


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
    projected = bound.mean + looks.t(looks.last) * bound.sd / math.sqrt(looks.last)
    return FUTILE if projected >= margin else None
