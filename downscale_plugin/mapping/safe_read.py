"""The safe read's calibration and the family-wise levels of a run's safe reads (docs/FIDELITY.md §9.5).

Shared by the certifier (``sequential.py``, whose module docstring describes the read) and the full map
(``estimator.py``): :func:`safe_quantile` is the critical value of the studentized upper bound calibrated
on heavy-tailed laws held at one shape relative to ε (:data:`SHAPE_MARGIN`); :class:`Family` turns a run's planned
tests and the family-wise α into per-test levels.

The family: chains through one key. Each test asks "is this (route, bin) safe" (its null: the bin's excess
is ≥ ε); a false safe is a rejected true null. α is split over chains of tests fixed before any evidence;
a key may be in several chains (two per route: :meth:`Family.both_ends`), and each chain carries its own
flow of α: a key's level is the sum, over the chains it is in, of its own share there plus what that chain
carried to it; a key that settles safe passes each chain's part of its level to the next key of *that*
chain not settled safe (a chain is a cycle: past its last key, its first). Why the family-wise false-safe
rate stays ≤ α under any dependence between the tests (the sequential rejection principle, Goeman &
Solari 2010, Ann. Statist. 38(6)):

(i) monotone: more safe verdicts only lengthen the runs of settled keys that shares are passed along, so
    a key's level only grows as other keys settle safe (never depends on a not-safe verdict);
(ii) with every truly safe key settled safe and no truly unsafe one, each share of each chain ends at no
    more than one truly unsafe key (the first not settled safe after it around that chain; none when all
    its keys are safe), so the levels of the truly unsafe keys sum to ≤ Σ shares = α.

Let L_k be the level of a truly unsafe key k in (ii) (fixed by the truth, not by the data) and E the event
that no truly unsafe key reads safe at L_k: P(not E) ≤ Σ L_k ≤ α by Bonferroni, whatever the dependence.
On E no truly unsafe key ever settles safe: while only truly safe keys have, each level is ≤ its L_k (i),
and a read that is not safe at L_k is not safe at a smaller level (c grows as the level falls). The chains
and shares must be fixed before any evidence; the order the tests are *read* in may depend on it, and a
test read before its chains' predecessors settle simply gets the smaller level it has then.

The split (:data:`SEARCH_SHARE`): 0.9 of a route's α to the chain in the search's order, 0.1 to the chain
from its lowest bin up. Why not half each: the σ mass is at the top under every shifted flow sampler (Flux's
``flux_shift`` at 1 024 px draws σ < 0.1 on 0.04 % of steps), so a low window routes little, and on the
stored lab maps (docs/fidelity/both_ends/) the lowest bins read 0.5-1.0 even at an even split's level while
it costs top windows (``lab_n32_d8_n16``'s 0.75 on (0.95, 1)). The low chain's head then has α/R·0.1·0.8
(0.002 with two routes): a low bin certifies only on strong evidence. The top chain's head falls from
α/R·0.8 to 0.9 of that.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from functools import lru_cache

import numpy as np

TRIM = 1.5  # |excess| beyond this is an estimator failure, not a gap (anchor: 36-40 of 40 kept)

REFERENCE_LAWS = (("lognormal", 1.5), ("lomax", 1.5))  # the calibration suite's heaviest laws (module docstring)
CALIBRATION_DRAWS = 400_000  # probe sets per law: a level ≥ 1.25e-3 rests on ≥ 500 of them in its tail
SAFE_READ = "mean + c·sd/√n, c: lognormal 1.5 / Lomax 1.5 clipped at 30 ε or ±TRIM, the farther; fallback chains from both ends, head 0.8, search 0.9"  # recorded with the looks
# The calibration's shape: the reference laws are scaled to mean ε and clipped at TRIM·ε/SHAPE_MARGIN (30 ε), the clip
# the estimator's range puts on them at ε = SHAPE_MARGIN, whatever ε is. Clipping at the range itself (1.5 = 7.5 ε at
# ε = 0.2) cut their tails as ε grew and made them lighter than the lab's own measured per-image sets: at ε = 0.2 the
# lab's worst set, resampled at a mean of 1.01 ε, read false-safe 0.033-0.044 at level 0.012, and the family-wise rate
# reached 0.062 (docs/FIDELITY.md §9.5). The studentized statistic is scale-free, so a clip at 30 ε calibrates as
# ε = SHAPE_MARGIN does; a smaller ε keeps its own, heavier, clip.
SHAPE_MARGIN = 0.05
HEAD_SHARE = 0.8  # a chain's first test's share of the chain's α; the rest, halving, after it (:class:`Family`)
SEARCH_SHARE = 0.9  # of a route's α, the chain in the search's order; the rest the chain from its lowest bin up (module docstring)


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
    """c with P((μ − x̄)/(s/√n) > c) ≤ ``level`` at n probes for every reference law at mean μ = ε = ``margin``, its
    tail clipped at 30 ε or the estimator's range, whichever is farther (:data:`SHAPE_MARGIN`): the safe read
    mean + c·sd/√n < ε is then false-safe at most ``level`` on them. +inf below the level the calibration resolves
    (1 / :data:`CALIBRATION_DRAWS`): no evidence certifies there."""
    if not 0.0 < level < 0.5 or n < 2:
        return math.inf
    if level * CALIBRATION_DRAWS < 1.0:
        return math.inf
    rank = min(math.floor((1.0 - level) * CALIBRATION_DRAWS), CALIBRATION_DRAWS - 1)
    return float(max(t[rank] for t in _studentized(n, round(min(margin, SHAPE_MARGIN), 12))))


class Family:
    """Per-test levels of a run's safe reads with the family-wise false-safe rate ≤ α (module docstring).

    ``chains``: the planned tests as chains of keys, each in its fixed test order; a key may be in several
    chains (at most once in each). ``shares``: each chain's part of α (normalised; default equal). Within a
    chain, test i owns the share ``weights[c][i]`` of the chain's part (normalised; default :data:`HEAD_SHARE`
    for the first, the rest halving after it, the last taking what is left). ``level(key)``: the sum over
    the chains it is in of its own share there plus what that chain carried to it. ``settle(key, safe)``:
    record a final verdict; a safe one passes each chain's part of its level to the next test of *that*
    chain not settled safe, from the chain's last test on to its first (a chain is a cycle: nothing is lost
    while one of its tests is open). Chains, shares and weights must not depend on the evidence.
    """

    def __init__(
        self,
        chains: Sequence[Sequence[Hashable]],
        alpha: float,
        weights: Mapping[int, Sequence[float]] | None = None,
        shares: Sequence[float] | None = None,
    ):
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"family: alpha {alpha} must be strictly between 0 and 1")
        shares = [1.0] * len(chains) if shares is None else list(shares)
        if len(shares) != len(chains) or any(not x >= 0 for x in shares):
            raise ValueError(f"family: {len(chains)} chains and shares {shares} (one non-negative share each)")
        kept = [c for c, chain in enumerate(chains) if chain]
        total = math.fsum(shares[c] for c in kept)
        if kept and not total > 0:
            raise ValueError(f"family: shares {shares} give no chain any part of alpha")
        self.alpha = alpha
        self.own: dict[Hashable, dict[int, float]] = {}  # key -> chain -> its own share there
        self.carried: dict[Hashable, dict[int, float]] = {}  # key -> chain -> what that chain passed to it
        self.next: dict[Hashable, dict[int, Hashable]] = {}  # key -> chain -> the test after it there (cyclic)
        self.settled: dict[Hashable, bool] = {}
        for c in kept:
            chain = list(chains[c])
            if len(set(chain)) != len(chain):
                raise ValueError(f"family: a test is in more than one place of chain {c}")
            w = list((weights or {}).get(c, default_weights(len(chain))))
            if len(w) != len(chain) or any(x < 0 for x in w) or not sum(w) > 0:
                raise ValueError(f"family: chain {c} has {len(chain)} tests and weights {w} (one non-negative weight each, not all 0)")
            for key, share, after in zip(chain, w, [*chain[1:], chain[0]], strict=True):  # the last one's next: the first
                self.own.setdefault(key, {})[c] = alpha * shares[c] / total * share / sum(w)
                self.carried.setdefault(key, {})[c] = 0.0
                self.next.setdefault(key, {})[c] = after

    @classmethod
    def bonferroni(cls, keys: Sequence[Hashable], alpha: float) -> Family:
        """Every test its own chain: each read at α / len(keys), nothing passed on."""
        return cls([[key] for key in keys], alpha)

    @classmethod
    def both_ends(cls, routes: Sequence[tuple[Sequence[Hashable], Sequence[Hashable]]], alpha: float) -> Family:
        """Two chains per route through the same tests: (the search's order, its lowest bin up); α equally over
        the routes, :data:`SEARCH_SHARE` of a route's part to the first chain, the rest to the second."""
        chains = [chain for pair in routes for chain in pair]
        return cls(chains, alpha, shares=[x for _ in routes for x in (SEARCH_SHARE, 1.0 - SEARCH_SHARE)])

    @property
    def keys(self) -> list[Hashable]:
        """Every planned test once, first seen first."""
        return list(self.own)

    def level(self, key: Hashable) -> float:
        """The level ``key`` may be read safe at now."""
        if key not in self.own:
            raise KeyError(f"family: {key!r} is not one of the planned tests")
        return math.fsum(self.own[key][c] + self.carried[key][c] for c in self.own[key])

    def settle(self, key: Hashable, safe: bool) -> None:
        """``key``'s final verdict; a safe one passes each chain's part of its level to the next test of that
        chain not settled safe (after the last, the first)."""
        if key in self.settled:
            raise ValueError(f"family: {key!r} was settled already")
        self.level(key)  # a planned test
        self.settled[key] = safe
        if not safe:
            return
        for c, after in self.next[key].items():
            while after != key and self.settled.get(after):
                after = self.next[after][c]
            if after != key:  # back at the key: every test of the chain is safe, nothing left to pass to
                self.carried[after][c] += self.own[key][c] + self.carried[key][c]


def default_weights(length: int) -> list[float]:
    """:data:`HEAD_SHARE` for the first test of a chain, the rest halving below it, the last taking what is left."""
    if length == 1:
        return [1.0]
    rest = [(1.0 - HEAD_SHARE) / 2 ** (i + 1) for i in range(length - 1)]
    rest[-1] *= 2
    return [HEAD_SHARE, *rest]
