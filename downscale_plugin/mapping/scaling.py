"""How a route's excess scales with token count: a two-parameter fit over maps at several native sizes, and its
extrapolation to a production size with an interval.

The seed paper's account of a routed step's gradient error has a noise-dependent term and a σ-independent floor set
by the smaller grid's absolute token count t, so the map's excess in one σ bin is modelled as a function of t:

- ``inverse``: excess = a + b / t (the floor falls as 1 / t toward a, the part no token count removes);
- ``power``: excess = c · t^(−p) (only where every measured excess is positive).

Both are fitted by weighted least squares, each map's excess weighted by its standard error (``power`` on log excess,
its standard error by the delta method), and the one with the smaller weighted residual χ² is chosen (both have two
parameters). With more points than parameters, the parameters' covariance is inflated by χ² / dof when that exceeds 1
(lack of fit) and the interval uses Student's t with dof degrees of freedom; with exactly two points the fit passes
through both and the interval rests on their standard errors alone (normal quantile), an assumption the caller
reports. The interval is for the mean excess at the target token count, not for one map's estimate there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

FORMS = ("inverse", "power")


@dataclass(frozen=True)
class ScalingFit:
    """One form fitted to ``(tokens, excess, se)`` points: parameters, their covariance (inflated for lack of fit)
    and the quantile an interval uses."""

    form: str
    params: tuple[float, float]  # inverse: (a, b); power: (log c, p)
    cov: np.ndarray
    chi2: float
    dof: int
    quantile: float  # of the two-sided interval at the fit's level

    def predict(self, tokens: float) -> tuple[float, float, float]:
        """(mean, lo, hi) of the mean excess at ``tokens`` small-grid tokens."""
        x = _design(self.form, np.array([float(tokens)]))[0]
        centre = float(x @ np.array(self.params))
        half = self.quantile * math.sqrt(max(float(x @ self.cov @ x), 0.0))
        if self.form == "inverse":
            return centre, centre - half, centre + half
        return math.exp(centre), math.exp(centre - half), math.exp(centre + half)

    def as_dict(self) -> dict[str, object]:
        names = ("a", "b") if self.form == "inverse" else ("log_c", "p")
        return {"form": self.form, "params": dict(zip(names, self.params, strict=True)), "chi2": self.chi2, "dof": self.dof}


def _design(form: str, tokens: np.ndarray) -> np.ndarray:
    if form == "inverse":
        return np.stack([np.ones_like(tokens), 1.0 / tokens], axis=1)
    return np.stack([np.ones_like(tokens), -np.log(tokens)], axis=1)


def fit_form(form: str, tokens: Sequence[float], excess: Sequence[float], se: Sequence[float], level: float = 0.95) -> ScalingFit | None:
    """Weighted least squares of one form; None where it cannot apply (``power`` with an excess ≤ 0)."""
    if form not in FORMS:
        raise ValueError(f"form: {form!r} is not a scaling form (allowed: {', '.join(FORMS)})")
    t, e, s = (np.asarray(v, dtype=np.float64) for v in (tokens, excess, se))
    if len(t) < 2 or len(set(t.tolist())) < 2:
        raise ValueError(f"a scaling fit needs excesses at two or more distinct token counts (got {t.tolist()})")
    if np.any(s <= 0):
        raise ValueError(f"every standard error must be positive (got {s.tolist()})")
    if form == "power":
        if np.any(e <= 0):
            return None
        e, s = np.log(e), s / e
    x = _design(form, t)
    w = 1.0 / s**2
    normal = x.T @ (w[:, None] * x)
    cov = np.linalg.inv(normal)
    params = cov @ (x.T @ (w * e))
    chi2 = float(np.sum(w * (e - x @ params) ** 2))
    dof = len(t) - 2
    inflation = chi2 / dof if dof > 0 else 1.0
    tail = (1 + level) / 2
    if dof > 0 and inflation > 1:
        cov, quantile = cov * inflation, float(stats.t.ppf(tail, dof))
    else:
        quantile = float(stats.norm.ppf(tail))
    return ScalingFit(form, (float(params[0]), float(params[1])), cov, chi2, dof, quantile)


def best_fit(tokens: Sequence[float], excess: Sequence[float], se: Sequence[float], level: float = 0.95) -> ScalingFit:
    """The form with the smaller weighted χ² (``inverse`` where ``power`` cannot apply or ties)."""
    fits = [f for form in FORMS if (f := fit_form(form, tokens, excess, se, level)) is not None]
    return min(fits, key=lambda f: (round(f.chi2, 12), FORMS.index(f.form)))
