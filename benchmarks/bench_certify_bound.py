"""False-safe rate of the certifier's safe rule on populations shaped like the lab's per-image excess
(docs/FIDELITY.md §9.5).

    python benchmarks/bench_certify_bound.py --reps 20000 --seed 0

A bin is declared safe when the upper bound of the mean per-image excess, read on the probes, is below
ε. *False-safe* = declared safe although the population's true mean is above ε. Each population is
scaled so that its true mean is 1.01 ε (just above), and n probes are drawn from it with replacement:

- ``lab map``: each (route, bin) of the lab's full maps (docs/fidelity/lab_n64_d8_n16*, 16 per-image
  debiased excess values each, 75 sets), scaled by 1.01 ε / its mean: the lab's own skew (3 to 20 × the
  median on 5 of 16 probes) and its noise, including negative values;
- ``lab certify``: the certifier's own 16-value evidence (docs/fidelity/certify/seed*/certify.json);
- ``lognormal s``: exp(N(0, s²)) (skewness 6.2 at s = 1, 33 at s = 1.5), ``pareto a``: a Lomax tail of
  index a (a = 2.5: finite variance, infinite third moment; a = 1.5: infinite variance), ``student-t 3``:
  symmetric heavy tails (location 1.01 ε, scale ε);
- ``6 % subpopulation``: 94 % of images at 0.01 ± 0.005, 6 % far above ε (0.68): no 16-probe rule can
  see it when none of them is drawn (0.94^16 = 37 %).

The safe rules compared (one-sided level α = 0.05, read once the probes are in):

- ``t α/3``: the t bound at α/3, the certifier before this change (Bonferroni over three looks although
  only the last may read safe);
- ``t α``: the t bound at α (α spent only on the look that can read safe);
- ``Hall skew-t α/3``: the t bound at α/3 plus Hall's second-order skewness term (a candidate);
- ``t α/20 (now)``: the certifier's safe read now (``sequential.read``: the t bound at α × ``SKEW_SHARE`` = α/20,
  spent on the one look that can read safe); ``n=32 / 64``: the same with more probes;
- ``bernstein`` / ``betting``: valid for any distribution on the estimator's range [−1.5, 1.5]
  (Maurer–Pontil empirical Bernstein; a one-sided hedged-capital betting bound, Waudby-Smith &
  Ramdas 2023); they are reported with the share of truly safe bins they certify (power).

Power: the same rules on the lab bins whose full-map mean is below ε/2 (as measured, not rescaled).
Deterministic: one seed for every draw.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

import numpy as np
from scipy import stats

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from downscale_plugin.mapping.estimator import TRIM, Cell, excess  # noqa: E402
from downscale_plugin.mapping.sequential import Looks, read  # noqa: E402

MAPS = ("docs/fidelity/lab_n64_d8_n16/map.json", "docs/fidelity/lab_n64_d8_n16_pool/map.json")
CERTIFY = "docs/fidelity/certify/seed*/certify.json"
ALPHA, MARGIN, TARGET = 0.05, 0.05, 1.01


def lab_map_sets() -> list[np.ndarray]:
    """Per (map, route, bin): the 16 per-image debiased excess values (trimmed as the map trims)."""
    sets = []
    for path in MAPS:
        with open(path) as fh:
            blob = json.load(fh)

        def nan(d: dict) -> dict:
            return {k: math.nan if v is None else v for k, v in d.items()}

        cells = [Cell(c["image"], c["bin"], nan(c["half_cos"]), nan(c["cos"]), nan(c["norm"])) for c in blob["cells"]]
        arms = sorted({a for c in cells for a in c.half_cos if not a.startswith("native")})
        for arm in arms:
            for b in sorted({c.bin for c in cells}):
                v = np.array([excess(c, arm) for c in cells if c.bin == b])
                sets.append(v[np.isfinite(v) & (np.abs(v) <= TRIM)])
    return sets


def lab_certify_sets() -> list[np.ndarray]:
    sets = []
    for path in sorted(glob.glob(CERTIFY)):
        with open(path) as fh:
            for row in json.load(fh)["bins"]:
                if len(row["evidence"]["excess"]) == 16:
                    sets.append(np.array(row["evidence"]["excess"]))
    return sets


def scaled(values: np.ndarray) -> np.ndarray:
    return values * (TARGET * MARGIN / values.mean())


# -- the safe rules: (reps, n) samples -> (reps,) upper bounds -------------------------------------------


def t_upper(x: np.ndarray, alpha: float) -> np.ndarray:
    n = x.shape[1]
    return x.mean(1) + stats.t.ppf(1 - alpha, n - 1) * x.std(1, ddof=1) / math.sqrt(n)


def bernstein_upper(x: np.ndarray, alpha: float, lo: float = -TRIM, hi: float = TRIM) -> np.ndarray:
    """Maurer & Pontil (2009), one-sided: x̄ + √(2 V ln(2/α)/n) + 7 R ln(2/α) / (3(n − 1))."""
    n, r = x.shape[1], hi - lo
    log = math.log(2 / alpha)
    return x.mean(1) + np.sqrt(2 * x.var(1, ddof=1) * log / n) + 7 * r * log / (3 * (n - 1))


def betting_upper(x: np.ndarray, alpha: float, hi: float = TRIM, grid: int = 400) -> np.ndarray:
    """Smallest m on a grid of [0, 0.5] where the capital betting against μ ≥ m reaches 1/α (values ≤ hi):
    K(m) = Π (1 + λ_i (m − x_i)), λ_i predictable (the hedged-capital plug-in, capped at ½/(hi − m))."""
    reps, n = x.shape
    ms = np.linspace(0.0, 0.5, grid)
    out = np.full(reps, np.inf)
    mean_prev = np.concatenate([np.full((reps, 1), 0.5 * hi), np.cumsum(x, 1)[:, :-1] / np.arange(1, n)], 1)
    var_prev = np.concatenate([np.full((reps, 1), 0.25), np.maximum(_running_var(x)[:, :-1], 1e-4)], 1)
    lam0 = np.sqrt(2 * math.log(1 / alpha) / (n * var_prev))
    for m in ms[::-1]:
        lam = np.minimum(lam0, 0.5 / (hi - m))
        wealth = np.prod(1 + lam * (m - x), 1)
        out = np.where(wealth >= 1 / alpha, m, out)
    del mean_prev
    return out


def _running_var(x: np.ndarray) -> np.ndarray:
    k = np.arange(1, x.shape[1] + 1)
    mean = np.cumsum(x, 1) / k
    return np.maximum(np.cumsum(x * x, 1) / k - mean * mean, 0.0) + 0.25 / (k + 1)


def hall_upper(x: np.ndarray, alpha: float) -> np.ndarray:
    """The t bound plus Hall's (1992) second-order skewness term: x̄ + s/√n · (t + γ⁺(2t² + 1)/(6√n))."""
    n = x.shape[1]
    t = stats.t.ppf(1 - alpha, n - 1)
    centred = x - x.mean(1, keepdims=True)
    m2 = (centred**2).mean(1)
    skew = np.where(m2 > 0, (centred**3).mean(1) / np.maximum(m2, 1e-300) ** 1.5, 0.0)
    return x.mean(1) + x.std(1, ddof=1) / math.sqrt(n) * (t + np.maximum(skew, 0.0) * (2 * t * t + 1) / (6 * math.sqrt(n)))


def certifier_upper(x: np.ndarray) -> np.ndarray:
    """The certifier's own safe read (``sequential.read``) at its default looks, ending at n = x.shape[1]."""
    n = x.shape[1]
    looks = Looks(at=(n // 4, n // 2, n))
    return np.array([read(row, looks).upper for row in x])


RULES = {
    "t α/3 (before)": (16, lambda x: t_upper(x, ALPHA / 3)),
    "t α": (16, lambda x: t_upper(x, ALPHA)),
    "Hall skew-t α/3": (16, lambda x: hall_upper(x, ALPHA / 3)),
    "t α/20 (now)": (16, certifier_upper),
    "t α/20, n=32": (32, certifier_upper),
    "t α/20, n=64": (64, certifier_upper),
    "bernstein": (16, lambda x: bernstein_upper(x, ALPHA)),
    "betting": (16, lambda x: betting_upper(x, ALPHA)),
}


def synthetic(name: str, rng: np.random.Generator, size: tuple[int, int]) -> np.ndarray:
    target = TARGET * MARGIN
    if name.startswith("lognormal"):
        s = float(name.split()[1])
        return rng.lognormal(0.0, s, size) * target / math.exp(s * s / 2)
    if name.startswith("pareto"):
        a = float(name.split()[1])
        return rng.pareto(a, size) * target * (a - 1)
    if name == "student-t 3":
        return target + MARGIN * rng.standard_t(3, size)
    if name == "6 % subpopulation":
        heavy = rng.random(size) < 0.06
        low = 0.01 + 0.005 * rng.standard_normal(size)
        return np.where(heavy, (target - 0.94 * 0.01) / 0.06, low)
    raise ValueError(name)


SYNTHETIC = ("lognormal 1", "lognormal 1.5", "pareto 2.5", "pareto 1.5", "student-t 3", "6 % subpopulation")


def rates(draw, reps: int, rng: np.random.Generator) -> dict[str, float]:
    """P(safe) per rule; ``draw(rng, (reps, n))`` samples the population."""
    out = {}
    for rule, (n, upper) in RULES.items():
        x = np.clip(draw(rng, (reps, n)), -TRIM, TRIM)
        out[rule] = float(np.mean(upper(x) < MARGIN))
    return out


def resampler(values: np.ndarray):
    return lambda rng, size: rng.choice(values, size=size, replace=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=20000, help="draws of the probe set per population")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write the table as JSON here")
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    table: dict[str, dict[str, float]] = {}
    maps = lab_map_sets()
    per_set = [rates(resampler(scaled(v)), max(args.reps // 20, 500), rng) for v in maps]
    table["lab map, mean over 75 sets"] = {r: float(np.mean([s[r] for s in per_set])) for r in RULES}
    table["lab map, worst set"] = {r: float(np.max([s[r] for s in per_set])) for r in RULES}
    cert = lab_certify_sets()
    per_cert = [rates(resampler(scaled(v)), max(args.reps // 20, 500), rng) for v in cert]
    table[f"lab certify, mean over {len(cert)} sets"] = {r: float(np.mean([s[r] for s in per_cert])) for r in RULES}
    table["lab certify, worst set"] = {r: float(np.max([s[r] for s in per_cert])) for r in RULES}
    for name in SYNTHETIC:
        table[name] = rates(lambda g, size, name=name: synthetic(name, g, size), args.reps, rng)
    safe_sets = [v for v in maps if v.mean() < MARGIN / 2]
    power = [rates(resampler(v), max(args.reps // 20, 500), rng) for v in safe_sets]
    table[f"power: lab sets with mean < ε/2 ({len(safe_sets)})"] = {r: float(np.mean([s[r] for s in power])) for r in RULES}
    width = max(len(k) for k in table)
    print(f"P(declared safe), true mean = {TARGET:g} ε (ε = {MARGIN:g}, α = {ALPHA:g}); reps {args.reps}, seed {args.seed}")
    print(" " * width + " | " + " | ".join(RULES))
    for name, row in table.items():
        print(name.ljust(width) + " | " + " | ".join(f"{row[r]:.3f}".rjust(len(r)) for r in RULES))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"command": " ".join(sys.argv), "alpha": ALPHA, "margin": MARGIN, "target": TARGET, "table": table}, fh, indent=1)


if __name__ == "__main__":
    main()
