"""The safe read's calibration and the family-wise levels of a run's safe reads (docs/FIDELITY.md §9.5).

Shared by the certifier (``sequential.py``, whose module docstring describes both) and the full map
(``estimator.py``): :func:`safe_quantile` is the critical value of the studentized upper bound calibrated
on heavy-tailed laws clipped to the estimator's range ±:data:`TRIM`; :class:`Family` turns a run's planned
tests and the family-wise α into per-test levels (a Bonferroni-based fallback procedure).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from functools import lru_cache

import numpy as np

TRIM = 1.5  # |excess| beyond this is an estimator failure, not a gap (anchor: 36-40 of 40 kept)

REFERENCE_LAWS = (("lognormal", 1.5), ("lomax", 1.5))  # the calibration suite's heaviest laws (module docstring)
CALIBRATION_DRAWS = 400_000  # probe sets per law: a level ≥ 1.25e-3 rests on ≥ 500 of them in its tail
SAFE_READ = "mean + c·sd/√n, c: lognormal 1.5 / Lomax 1.5 clipped to ±TRIM; fallback chains, head 0.8"  # recorded with the looks
HEAD_SHARE = 0.8  # a chain's first test's share of the chain's α; the rest, halving, below it (:class:`Family`)


@lru_cache(maxsize=16)
def _law_scale(law: tuple[str, float], margin: float) -> tuple[float, float]:
    """(k, μ): k such that min(k·X, TRIM) has mean ``margin`` for X of ``law`` (bisection on a fixed sample), and
    that mean as reached on the sample (the μ the studentized statistic is centred on)."""
    x = _law_draws(law, (1 << 20,), np.random.default_rng(0xCA11B))
    lo, hi = 1e-15, 1e6
    for _ in range(200):
        k = math.sqrt(lo * hi)
        lo, hi = (lo, k) if np.minimum(k * x, TRIM).mean() > margin else (k, hi)
    k = math.sqrt(lo * hi)
    return k, float(np.minimum(k * x, TRIM).mean())


def _law_draws(law: tuple[str, float], size: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    kind, shape = law
    if kind == "lognormal":
        return rng.lognormal(0.0, shape, size)
    if kind == "lomax":
        return rng.pareto(shape, size)
    raise ValueError(f"reference law: {kind!r} (lognormal, lomax)")


@lru_cache(maxsize=32)
def _studentized(n: int, margin: float) -> tuple[np.ndarray, ...]:
    """Per reference law, the sorted (μ − x̄)/(s/√n) of :data:`CALIBRATION_DRAWS` probe sets of n at mean μ = ``margin``."""
    out = []
    for law in REFERENCE_LAWS:
        (k, mu), rng, parts = _law_scale(law, margin), np.random.default_rng(0x5AFE + n), []
        for start in range(0, CALIBRATION_DRAWS, 50_000):
            x = np.minimum(k * _law_draws(law, (min(50_000, CALIBRATION_DRAWS - start), n), rng), TRIM)
            sd = x.std(1, ddof=1)
            with np.errstate(divide="ignore", invalid="ignore"):
                parts.append(np.where(sd > 0, (mu - x.mean(1)) / (sd / math.sqrt(n)), math.inf))
        out.append(np.sort(np.concatenate(parts)))
    return tuple(out)


def safe_quantile(level: float, n: int, margin: float) -> float:
    """c with P((μ − x̄)/(s/√n) > c) ≤ ``level`` at n probes for every reference law at mean μ = ε = ``margin``:
    the safe read mean + c·sd/√n < ε is then false-safe at most ``level`` on them. +inf below the level the
    calibration resolves (1 / :data:`CALIBRATION_DRAWS`): no evidence certifies there."""
    if not 0.0 < level < 0.5 or n < 2:
        return math.inf
    if level * CALIBRATION_DRAWS < 1.0:
        return math.inf
    rank = min(math.floor((1.0 - level) * CALIBRATION_DRAWS), CALIBRATION_DRAWS - 1)
    return float(max(t[rank] for t in _studentized(n, round(margin, 12))))


class Family:
    """Per-test levels of a run's safe reads with the family-wise false-safe rate ≤ α (module docstring).

    ``chains``: the planned tests as chains of keys in their fixed test order (one chain per route: its bins
    in the certifier's plan order, or from σ = 1 down in the map); every key once. α is split equally over the chains; within a chain, test i owns the
    share ``weights[c][i]`` (normalised; default :data:`HEAD_SHARE` for the first, the rest halving below
    it, the last taking what is left). ``level(key)``: its own share plus the level of the test before it
    when that one settled safe. ``settle(key, safe)``: record a final verdict; a safe one passes its level
    on down the chain (past tests already settled safe). Chains and weights must not depend on the evidence.
    """

    def __init__(self, chains: Sequence[Sequence[Hashable]], alpha: float, weights: Mapping[int, Sequence[float]] | None = None):
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"family: alpha {alpha} must be strictly between 0 and 1")
        keys = [key for chain in chains for key in chain]
        if len(set(keys)) != len(keys):
            raise ValueError("family: a test is in more than one place of the chains")
        self.alpha = alpha
        self.own: dict[Hashable, float] = {}
        self.next: dict[Hashable, Hashable | None] = {}
        self.carried: dict[Hashable, float] = dict.fromkeys(keys, 0.0)
        self.settled: dict[Hashable, bool] = {}
        chains = [list(c) for c in chains if c]
        for c, chain in enumerate(chains):
            w = list((weights or {}).get(c, default_weights(len(chain))))
            if len(w) != len(chain) or any(x < 0 for x in w) or not sum(w) > 0:
                raise ValueError(f"family: chain {c} has {len(chain)} tests and weights {w} (one non-negative weight each, not all 0)")
            for key, share, after in zip(chain, w, [*chain[1:], None], strict=True):
                self.own[key] = alpha / len(chains) * share / sum(w)
                self.next[key] = after

    @classmethod
    def bonferroni(cls, keys: Sequence[Hashable], alpha: float) -> Family:
        """Every test its own chain: each read at α / len(keys), nothing passed on."""
        return cls([[key] for key in keys], alpha)

    def level(self, key: Hashable) -> float:
        """The level ``key`` may be read safe at now."""
        if key not in self.own:
            raise KeyError(f"family: {key!r} is not one of the planned tests")
        return self.own[key] + self.carried[key]

    def settle(self, key: Hashable, safe: bool) -> None:
        """``key``'s final verdict; a safe one passes its level to the next test of its chain not settled safe."""
        if key in self.settled:
            raise ValueError(f"family: {key!r} was settled already")
        amount = self.level(key)
        self.settled[key] = safe
        after = self.next[key] if safe else None
        while after is not None and self.settled.get(after):
            after = self.next[after]
        if after is not None:
            self.carried[after] += amount


def default_weights(length: int) -> list[float]:
    """:data:`HEAD_SHARE` for the first test of a chain, the rest halving below it, the last taking what is left."""
    if length == 1:
        return [1.0]
    rest = [(1.0 - HEAD_SHARE) / 2 ** (i + 1) for i in range(length - 1)]
    rest[-1] *= 2
    return [HEAD_SHARE, *rest]
