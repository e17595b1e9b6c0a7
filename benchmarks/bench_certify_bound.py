"""Family-wise false-safe rate and power of the certifier as it runs, on heavy-tailed per-image excess (docs/FIDELITY.md §9.5).

    python benchmarks/bench_certify_bound.py                   # a smoke run (20 runs per exact row, 5 per ρ row)
    python benchmarks/bench_certify_bound.py --reps 160 --out docs/fidelity/certify_bound   # 19 CPU minutes

Every simulated run IS a certification: ``certify.run_certify`` with the default settings (ε =
``certify_config.DEFAULT_MARGIN``, D = 4, looks 2/4/8/16, family-wise α = 0.05, the default 14 bins with σ mass, routes
0.875 / 0.75 / 0.5), its plan built by ``plan_tests`` from Flux's ``flux_shift`` σ mass at 1024² (latent 128×128) and
the Flux FLOP model's pass costs (as benchmarks/bench_certify_economics.py), over a synthetic ``DrawSource`` whose
per-image excess is the truth population. Two modes:

- ``certify``: the ``certify`` command (no horizon, spot checks 2) with an unbounded budget, so every planned test that
  is not pruned is read (the budget only removes reads);
- ``auto``: ``mode = "auto"`` on a run of 10 000 passes (``in_run.in_run_setup`` on the default config: budget 0.1 ×
  passes, the passes after the probes as the horizon): the pay, budget and stake rules decide which tests run.

*False-safe*: a (route, bin) the certifier ends ``safe`` although its population's mean excess is above ε; a run counts
once if it has any (family-wise). Spot checks are never windows and never count.

One probe pool per run, as the certifier reads it: 16 images, image i the same image in every (route, bin) test, each
bin in the certifier's own seeded order. Its excess in test (route, bin) is a law's quantile of a normal score
z = a·g_i + b·h_(i, bin) + c·e_(i, route, bin) (shares a² = 0.45, b² = 0.33, c² = 0.22: the lab maps' normal-score
correlations, 0.42–0.47 between bins of an image and 0.78 between routes in one bin), so tests on one image are
dependent as real ones are. The laws (each scaled so that its mean *after clipping to [0, TRIM]* is the wanted mean):
``lognormal s`` for s = 0.5, 1, 1.5; ``pareto a``: a Lomax tail of index 1.5, 2, 3; ``lab worst``: the lab's per-image
set (of 100: docs/fidelity/lab_n64_d8_n16*/map.json, docs/fidelity/certify/seed*/certify.json) whose resampled
per-test false-safe rate is the largest, its values at the score's rank. Estimators:

- ``exact``: the source feeds ``PairedSums`` two noiseless draws per arm at cosine 1 − e, so the certifier's own read
  (``PairedSums.excess`` → ``sequential.read``/``verdict``) sees e exactly (tests/test_certify_bound.py checks it);
- ``ρ 0.5 / 0.7 / 0.9``: D = 4 paired draws of a synthetic gradient per (image, bin) (unit native mean, the route's mean
  of norm 0.9 at cosine 1 − e, per-draw noise of the signal's norm in a 60-dim subspace of 200, the route's noise ρ-
  correlated with the native's; native draws shared by the routes, as ``BackendDraws`` seeds them), so ê's bias and
  noise are in the rates.

Truth profiles, per route over the bins with σ mass (the σ = 1 endpoint has none), in units of ε; ``U`` = 1.01 ε
(truly unsafe just above ε, next to the safe bins, read at the level its chain carries to it), every other bin 3 ε:

- ``top``: from the highest bin down, 0.875: ε/8, ε/4, U; 0.75: ε/2, U; 0.5: U;
- ``low``: the same from the lowest bin up;
- ``middle``: around the middle bin m, 0.875: U at m ± 2, ε/4 at m ± 1, ε/8 at m; 0.75: U at m ± 1, ε/2 at m; 0.5: U at m;
- ``both``: ``top`` and ``low`` at once (the middle bins 3 ε);
- ``broad``: lab-like and what an auto run meets when it pays: ε/4 from the top down through the sampler's mass peak p,
  the edge U at p − 1 (0.5), p − 2 (0.75), p − 3 (0.875), so the plan's first test is safe and its chain's next is U.

The map (``estimator.summarize``: ``map_family``'s chains from σ = 1 down, one read on 16 probes per bin) reads the same
truths (every bin, the unplanned ones at their nearest planned bin's value) through cells whose debiased excess is e
(``exact`` only: the map's own two-native estimator is not simulated).

Also printed, through the real read (``sequential.read``/``verdict`` at each look) at the level of the plan's first
test: one test's false-safe rate at a mean of 1.01 ε; the probes a safe verdict needs (16 / 32 / 64); outside the
claim, populations whose mean is carried by a few images; and ê's bias at a true gap of ε (``PairedSums.excess`` of the
noisy source at per-draw noise κ = 0.5–2 × the signal).
Deterministic: every draw from --seed.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from scipy import stats
from scipy.special import ndtr

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_certify_economics import NATIVE_HW, sampler_mass  # noqa: E402

from downscale_plugin.arch import get_arch  # noqa: E402
from downscale_plugin.bins import SigmaBins  # noqa: E402
from downscale_plugin.certify_config import DEFAULT_MARGIN  # noqa: E402
from downscale_plugin.config import load_config  # noqa: E402
from downscale_plugin.grid import target_grid  # noqa: E402
from downscale_plugin.mapping.arms import NATIVE_A, NATIVE_B, Arm  # noqa: E402
from downscale_plugin.mapping.certify import CertifySettings, plan_tests, run_certify  # noqa: E402
from downscale_plugin.mapping.estimator import Cell, MapSettings, excess, summarize  # noqa: E402
from downscale_plugin.mapping.in_run import InRunSetup, in_run_setup, pass_costs  # noqa: E402
from downscale_plugin.mapping.safe_read import TRIM  # noqa: E402
from downscale_plugin.mapping.sequential import SAFE, Looks, PairedSums, read, verdict  # noqa: E402

MAPS = ("docs/fidelity/lab_n64_d8_n16/map.json", "docs/fidelity/lab_n64_d8_n16_pool/map.json")
CERTIFY = "docs/fidelity/certify/seed*/certify.json"
MARGIN, ALPHA, UNSAFE_AT, FAR, PASSES = DEFAULT_MARGIN, 0.05, 1.01, 3.0, 10_000
SHARES = (0.45, 0.33, 0.22)  # normal-score variance of image, image × bin, image × bin × route (module docstring)
LAWS = ("lognormal 0.5", "lognormal 1", "lognormal 1.5", "pareto 1.5", "pareto 2", "pareto 3")
ESTIMATORS = ("exact", "ρ 0.5", "ρ 0.7", "ρ 0.9")
PROFILES = ("top", "low", "middle", "both", "broad")
MODES = ("certify", "auto")
EDGE = {"0.875": (1 / 8, 1 / 4, UNSAFE_AT), "0.75": (1 / 2, UNSAFE_AT), "0.5": (UNSAFE_AT,)}  # a route's safe run and its edge
NOISE_DIM, NOISE_RANK, DRAWS = 200, 60, 4
LOOKS = Looks()  # the certifier's default look schedule (its last look: the probe pool)


# -- populations --------------------------------------------------------------------------------------------


class Law:
    """Per-image true excess of one shape as a function of a normal score, at any mean, bounded to [0, TRIM]."""

    def __init__(self, name: str, unit: Callable[[np.ndarray], np.ndarray], support: np.ndarray | None = None):
        """``support``: the unit values the scale is fitted on (a measured set: itself; a law: 2^20 seeded draws)."""
        self.name, self.unit = name, unit
        self._support = support
        self._scale: dict[float, float] = {}

    def values(self, z: np.ndarray, mean: float) -> np.ndarray:
        """The law's values at normal scores ``z``, scaled so that the clipped population has mean ``mean``."""
        if mean not in self._scale:
            if self._support is None:
                self._support = self.unit(np.random.default_rng(1).standard_normal(1 << 20))
            lo, hi = 1e-12, 1e6
            for _ in range(60):
                k = math.sqrt(lo * hi)
                lo, hi = (lo, k) if np.clip(k * self._support, 0.0, TRIM).mean() > mean else (k, hi)
            self._scale[mean] = math.sqrt(lo * hi)
        return np.clip(self._scale[mean] * self.unit(z), 0.0, TRIM)


def law(name: str) -> Law:
    kind, shape = name.split()
    if kind == "lognormal":
        return Law(name, lambda z, s=float(shape): np.exp(s * z))
    return Law(name, lambda z, a=float(shape): ndtr(-z) ** (-1.0 / a) - 1.0)  # Lomax: the survival's inverse


def ranked(values: np.ndarray, name: str) -> Law:
    """A measured per-image set as a law: the score's rank picks the value (a heavy image stays heavy in every test)."""
    unit = np.sort(np.clip(values, 0.0, None)) / max(float(np.clip(values, 0.0, None).mean()), 1e-12)
    return Law(name, lambda z: unit[np.minimum((ndtr(z) * len(unit)).astype(int), len(unit) - 1)], support=unit)


def lab_sets() -> list[np.ndarray]:
    """The lab's per-image sets: each (map, route, bin) of the full maps and each 16-value certifier evidence."""
    sets = []
    for path in MAPS:
        with open(path) as fh:
            blob = json.load(fh)
        cells = [Cell(c["image"], c["bin"], *({k: math.nan if v is None else v for k, v in c[f].items()} for f in ("half_cos", "cos", "norm")))
                 for c in blob["cells"]]  # fmt: skip
        for arm in sorted({a for c in cells for a in c.half_cos if not a.startswith("native")}):
            for b in sorted({c.bin for c in cells}):
                v = np.array([excess(c, arm) for c in cells if c.bin == b])
                sets.append(v[np.isfinite(v) & (np.abs(v) <= TRIM)])
    for path in sorted(glob.glob(CERTIFY)):
        with open(path) as fh:
            sets += [np.array(r["evidence"]["excess"]) for r in json.load(fh)["bins"] if len(r["evidence"]["excess"]) == 16]
    return [v for v in sets if v.mean() > 0]


# -- the run's setting: routes, bins, σ mass, pass costs, settings ------------------------------------------


class Setting:
    """What every simulated run shares: the default auto setup, Flux's σ mass and pass costs at 1024², and the truth
    profiles over the bins with mass."""

    def __init__(self) -> None:
        self.setup: InRunSetup = in_run_setup(load_config(table={"mode": "auto", "map_out": "unused"}), PASSES, 0)
        self.routes: list[Arm] = self.setup.routes
        self.bins: SigmaBins = self.setup.bins
        spec = get_arch("flux")
        price = pass_costs(spec.flops, "flux")
        self.fractions = {a.name: price(target_grid(NATIVE_HW, a.ratio, spec), NATIVE_HW) for a in self.routes}
        self.mass = functools.lru_cache(maxsize=None)(sampler_mass("flux"))
        self.planned = [b for b in range(len(self.bins)) if self.mass(*self.bins.bounds(b)) > 0.0]
        self.sampler = "flux_shift at 1024² (latent 128×128), 65 536 σ draws"

    def settings(self, mode: str, seed: int) -> CertifySettings:
        if mode == "certify":
            return CertifySettings(margin=MARGIN, budget=math.inf, seed=seed)
        s = self.setup.settings
        return CertifySettings(s.margin, s.draws, s.looks, s.budget, seed, s.spot_checks, s.horizon)

    def plan_order(self) -> list[tuple[str, int]]:
        plan = plan_tests(self.routes, self.bins, CertifySettings(margin=MARGIN), self.mass, lambda a: self.fractions[a.name])
        return [(t.route.name, t.bin) for t in plan.tests]

    def profile(self, name: str) -> np.ndarray:
        """(routes, bins) true mean excess in units of ε (module docstring); unplanned bins at their nearest planned bin's."""
        planned, out = self.planned, np.full((len(self.routes), len(self.bins)), FAR)
        mid = planned[len(planned) // 2]
        peak = max(planned, key=lambda b: self.mass(*self.bins.bounds(b)))
        for r, arm in enumerate(self.routes):
            run = EDGE[f"{arm.ratio:g}"]
            if name in ("top", "both"):
                for i, v in enumerate(run):
                    out[r, planned[-1 - i]] = v
            if name in ("low", "both"):
                for i, v in enumerate(run):
                    out[r, planned[i]] = v
            if name == "middle":
                for i, v in enumerate(run):
                    out[r, mid - i] = out[r, mid + i] = v
            if name == "broad":  # safe at ε/4 from the top down through the mass peak, the milder routes deeper
                edge = peak - 1 - (len(self.routes) - 1 - r)
                out[r, [b for b in planned if b > edge]] = 1 / 4
                out[r, edge] = UNSAFE_AT
        for b in range(len(self.bins)):
            if b not in planned:
                out[:, b] = out[:, min(planned, key=lambda p: abs(p - b))]
        return out


# -- the draw sources ---------------------------------------------------------------------------------------


def truth_values(pop: Law, profile: np.ndarray, rng: np.random.Generator, images: int) -> np.ndarray:
    """(routes, bins, images) per-image true excess of one probe pool: dependent scores (module docstring) → the law."""
    routes, bins = profile.shape
    a, b, c = (math.sqrt(s) for s in SHARES)
    z = a * rng.standard_normal(images) + b * rng.standard_normal((bins, images)) + c * rng.standard_normal((routes, bins, images))
    out = np.empty_like(z)
    for r in range(routes):
        for k in range(bins):
            out[r, k] = pop.values(z[r, k], profile[r, k] * MARGIN)
    return out


class TruthDraws:
    """A :class:`~downscale_plugin.mapping.certify.DrawSource` over known per-image excess ``truth[route, bin, image]``.

    ``rho`` None (exact): two noiseless draws per arm, the native a unit vector and the route's at cosine 1 − e, so
    ``PairedSums.excess`` is e. Else D = 4 paired draws with noise (module docstring), pre-drawn per run."""

    def __init__(
        self,
        truth: np.ndarray,
        routes: Sequence[Arm],
        fractions: dict[str, float],
        rho: float | None,
        rng: np.random.Generator,
        kappa: float = 1.0,
    ):
        """``kappa``: the per-draw noise norm over the signal's (noisy draws only)."""
        self.truth, self.fractions, self.rho = truth, fractions, rho
        self.index = {a.name: i for i, a in enumerate(routes)}
        _, bins, images = truth.shape
        if rho is not None:
            basis = kappa * rng.standard_normal((NOISE_RANK, NOISE_DIM)) / math.sqrt(NOISE_RANK * NOISE_DIM)
            mu = rng.standard_normal((bins, images, NOISE_DIM))
            mu /= np.linalg.norm(mu, axis=-1, keepdims=True)
            ortho = rng.standard_normal((len(routes), bins, images, NOISE_DIM))
            ortho -= (ortho * mu).sum(-1, keepdims=True) * mu
            ortho /= np.linalg.norm(ortho, axis=-1, keepdims=True)
            cos = 1.0 - truth[..., None]
            route_mean = 0.9 * (cos * mu + np.sqrt(np.maximum(1.0 - cos * cos, 0.0)) * ortho)
            xi = rng.standard_normal((bins, images, DRAWS, NOISE_RANK))
            eta = rng.standard_normal((len(routes), bins, images, DRAWS, NOISE_RANK))
            self.native = torch.from_numpy(mu[:, :, None] + xi @ basis)  # (bins, images, D, dim)
            self.route = torch.from_numpy(route_mean[:, :, :, None] + (rho * xi + math.sqrt(1.0 - rho * rho) * eta) @ basis)

    def num_images(self) -> int:
        return self.truth.shape[2]

    def cost(self, arm: Arm | None) -> float:
        return 1.0 if arm is None else self.fractions[arm.name]

    def draw_pairs(self, image: int, bin_: int, routes: Sequence[Arm], sink) -> None:
        if self.rho is None:
            native = torch.tensor([1.0, 0.0], dtype=torch.float64)
            rows = {}
            for arm in routes:
                c = 1.0 - float(self.truth[self.index[arm.name], bin_, image])
                rows[arm.name] = torch.tensor([c, math.sqrt(max(1.0 - c * c, 0.0))], dtype=torch.float64)
            for _ in range(2):
                sink(None, [native])
                for arm in routes:
                    sink(arm.name, [rows[arm.name]])
            return
        for d in range(DRAWS):
            sink(None, [self.native[bin_, image, d]])
            for arm in routes:
                sink(arm.name, [self.route[self.index[arm.name], bin_, image, d]])


# -- the family -----------------------------------------------------------------------------------------------


def one_certification(setting: Setting, mode: str, profile: np.ndarray, source: TruthDraws, seed: int) -> dict[str, float]:
    """One real certification: any false-safe (0/1), the share of truly safe planned tests certified, tests read."""
    result = run_certify(source, setting.routes, setting.bins, setting.settings(mode, seed), setting.mass)
    index = {a.name: i for i, a in enumerate(setting.routes)}
    safe = {(t.route, t.bin) for t in result.tests if t.safe}
    wrong = any(profile[index[r], b] > 1.0 for r, b in safe)
    good = [(a.name, b) for a in setting.routes for b in setting.planned if profile[index[a.name], b] < 1.0]
    power = sum(key in safe for key in good) / len(good) if good else math.nan
    read_ = sum(1 for t in result.tests if not t.spot and t.values)
    return {"false": float(wrong), "power": power, "tests": float(read_)}


def map_cells(truth: np.ndarray, routes: Sequence[Arm]) -> list[Cell]:
    """Map cells whose debiased excess for route r is ``truth[r, bin, image]`` (halves in perfect agreement)."""
    cells = []
    _, bins, images = truth.shape
    arms = (NATIVE_A, NATIVE_B, *(a.name for a in routes))
    for b in range(bins):
        for i in range(images):
            cos = {f"{NATIVE_A}|{NATIVE_B}": 1.0}
            for r, a in enumerate(routes):
                cos[f"{NATIVE_A}|{a.name}"] = cos[f"{NATIVE_B}|{a.name}"] = 1.0 - float(truth[r, b, i])
            cells.append(Cell(i, b, dict.fromkeys(arms, 1.0), cos, dict.fromkeys(arms, 1.0)))
    return cells


def one_map(setting: Setting, truth: np.ndarray, profile: np.ndarray) -> dict[str, float]:
    arms = (Arm(NATIVE_A, "native"), Arm(NATIVE_B, "native"), *setting.routes)
    rows = summarize(map_cells(truth, setting.routes), arms, setting.bins, MapSettings(margin=MARGIN, images=truth.shape[2]))
    index = {a.name: i for i, a in enumerate(setting.routes)}
    wrong = any(r.safe and profile[index[r.arm], r.bin] > 1.0 for r in rows)
    good = [r for r in rows if profile[index[r.arm], r.bin] < 1.0]
    return {"false": float(wrong), "power": sum(r.safe for r in good) / len(good) if good else math.nan}


def family_cell(
    setting: Setting, pop: Law, estimator: str, profile_name: str, reps: int, seed: int, modes: Sequence[str] = MODES
) -> dict[str, float]:
    """``reps`` simulated runs of one (population, estimator, profile), each run a fresh probe pool and certifier seed: per
    mode (``certify``, ``auto``, ``map``: exact only), the family-wise false-safe rate, power and tests read."""
    profile = setting.profile(profile_name)
    rho = None if estimator == "exact" else float(estimator.split()[1])
    totals: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for rep in range(reps):
        rng = np.random.default_rng([seed, rep, sum(map(ord, f"{pop.name}|{estimator}|{profile_name}"))])
        truth = truth_values(pop, profile, rng, LOOKS.last)
        source = TruthDraws(truth, setting.routes, setting.fractions, rho, rng)
        for mode in modes:
            if mode == "map":
                totals[mode].append(one_map(setting, truth, profile))
            else:
                totals[mode].append(one_certification(setting, mode, profile, source, seed * 1_000_003 + rep))
    return {f"{m}: {k}": float(np.mean([o[k] for o in outs])) for m, outs in totals.items() for k in outs[0]}


# -- one test, through the real read -----------------------------------------------------------------------


def sequential_safe(values: np.ndarray, level: float, looks: Looks = LOOKS) -> bool:
    """One test read look by look as ``Certifier._settle`` reads it (``sequential.read``/``verdict``): safe at the end?"""
    for n in looks.at:
        found = verdict(read(values[:n].tolist(), looks, level, MARGIN), MARGIN, looks, level)
        if found is not None:
            return found == SAFE
    return False


def head_level(setting: Setting) -> float:
    """The level the certifier reads its plan's first test at (a clearly unsafe truth: it stops at the first look)."""
    truth = np.full((len(setting.routes), len(setting.bins), LOOKS.last), FAR * MARGIN)
    source = TruthDraws(truth, setting.routes, setting.fractions, None, np.random.default_rng(0))
    return run_certify(source, setting.routes, setting.bins, setting.settings("certify", 0), setting.mass).tests[0].bound.level


def per_test(pop: Law, level: float, rng: np.random.Generator, reps: int, mean: float = UNSAFE_AT * MARGIN) -> float:
    """One test's safe rate on i.i.d. probes of ``pop`` at ``mean``, read at ``level``."""
    z = rng.standard_normal((reps, 16))
    return float(np.mean([sequential_safe(pop.values(row, mean), level) for row in z]))


def subpopulation(p: float, level: float, rng: np.random.Generator, reps: int, n: int = 16) -> dict[str, float]:
    """A share p of images high enough for a mean of 1.01 ε, the rest at ε/4 (± 20 %): the false-safe rate at ``level``
    and the floor (1 − p)^n·π every n-probe rule has (π: its safe rate on the bulk alone)."""
    bulk = 0.25 * MARGIN
    high = (UNSAFE_AT * MARGIN - (1 - p) * bulk) / p
    if high > TRIM:
        raise ValueError(f"subpopulation {p}: its images would need an excess of {high:.2f}, beyond the estimator's range")
    rows = np.where(rng.random((reps, n)) < p, high, bulk * (1 + 0.2 * rng.standard_normal((reps, n))))
    power = float(np.mean([sequential_safe(bulk * (1 + 0.2 * rng.standard_normal(n)), level) for _ in range(reps)]))
    return {"heavy value / ε": high / MARGIN, "false-safe": float(np.mean([sequential_safe(r, level) for r in rows])),
            "bulk safe rate π": power, f"floor (1 − p)^{n}·π": (1 - p) ** n * power}  # fmt: skip


def probe_table(pops: Sequence[Law], level: float, rng: np.random.Generator, reps: int) -> dict[str, dict[str, float]]:
    """One test's safe rate at ``level`` against the probes it reads (looks n/8, n/4, n/2, n: the default's shape), at means ε/8, ε/4, ε/2."""
    table = {}
    for pop in pops:
        for frac in (1 / 8, 1 / 4, 1 / 2):
            row = {}
            for n in (16, 32, 64):
                looks = Looks((n // 8, n // 4, n // 2, n), ALPHA)
                z = rng.standard_normal((reps, n))
                row[f"{n} probes"] = float(np.mean([sequential_safe(pop.values(r, frac * MARGIN), level, looks) for r in z]))
            table[f"{pop.name} at ε/{round(1 / frac)}"] = row
    return table


def bias_table(routes: Sequence[Arm], fractions: dict[str, float], rng: np.random.Generator, images: int) -> dict[str, dict[str, float]]:
    """Mean and SD of the certifier's ê (``PairedSums.excess`` of the noisy source's D = 4 draws) at a true gap of ε,
    per pairing ρ and per-draw noise-to-signal κ."""
    table = {}
    route = routes[-1:]
    for kappa in (0.5, 1.0, 1.5, 2.0):
        for rho in (0.5, 0.7, 0.9):
            source = TruthDraws(np.full((1, 1, images), MARGIN), route, fractions, rho, rng, kappa)
            values = []
            for i in range(images):
                sums = PairedSums()
                source.draw_pairs(i, 0, route, sums.add)
                values.append(sums.excess(route[0].name))
            table[f"κ {kappa:g}, ρ {rho:g}"] = {
                "mean ê": float(np.mean(values)),
                "bias": float(np.mean(values)) - MARGIN,
                "sd ê": float(np.std(values)),
            }
    return table


# -- main ---------------------------------------------------------------------------------------------------


def fmt_table(title: str, table: dict[str, dict[str, float]]) -> str:
    cols = list(next(iter(table.values())))
    width = max(len(k) for k in table)
    lines = [title, " " * width + " | " + " | ".join(cols)]
    lines += [k.ljust(width) + " | " + " | ".join(f"{row[c]:.3f}".rjust(len(c)) for c in cols) for k, row in table.items()]
    return "\n".join(lines)


def revision() -> str:
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True).stdout
        return rev + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def rows_of(worst: np.ndarray) -> list[tuple[Law, str]]:
    laws = [law(name) for name in LAWS]
    return [(pop, est) for pop in laws for est in ESTIMATORS] + [(ranked(worst, "lab worst"), "exact")]


def upper_95(rate: float, n: int) -> float:
    """The one-sided 95 % Clopper–Pearson upper limit of a rate seen in n runs (the Monte Carlo's own error)."""
    k = round(rate * n)
    return 1.0 if k >= n else float(stats.beta.ppf(0.95, k + 1, n - k))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=20, help="simulated runs per exact row and profile (default 20: a smoke run)")
    p.add_argument("--rho-reps", type=int, default=None, help="simulated runs per ρ row and profile (default: --reps / 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="write bound.txt and bound.json here")
    args = p.parse_args()
    rho_reps = args.rho_reps or max(args.reps // 4, 1)
    torch.set_num_threads(1)
    t0, code = time.process_time(), revision()  # the code that runs (docs may be committed while it does)
    setting = Setting()
    rng = np.random.default_rng(args.seed)
    head = head_level(setting)
    sets = lab_sets()
    per_set = [(per_test(ranked(v, f"lab set {i}"), head, rng, 400), i) for i, v in enumerate(sets)]
    worst = sets[max(per_set)[1]]
    suite: dict[str, dict[str, float]] = {}
    maps: dict[str, dict[str, float]] = {}
    single: dict[str, dict[str, float]] = {}
    for pop, est in rows_of(worst):
        exact = est == "exact"
        if exact:
            single[pop.name] = {"per-test false-safe": per_test(pop, head, rng, 20 * args.reps)}
        for profile in PROFILES:
            cell = family_cell(setting, pop, est, profile, args.reps if exact else rho_reps, args.seed, (*MODES, "map") if exact else MODES)
            suite[f"{pop.name}, {est}, {profile}"] = {k: v for k, v in cell.items() if not k.startswith("map")}
            if exact:
                maps[f"{pop.name}, {profile}"] = {k: v for k, v in cell.items() if k.startswith("map")}
    runs = {k: args.reps if ", exact," in k else rho_reps for k in suite}
    worst_row = max(suite, key=lambda k: max(suite[k]["certify: false"], suite[k]["auto: false"]))
    worst_case = max(suite[worst_row]["certify: false"], suite[worst_row]["auto: false"])
    worst_map = max(row["map: false"] for row in maps.values())
    outside = {f"subpopulation {q:g}": subpopulation(q, head, rng, 40 * args.reps) for q in (0.12, 0.15, 0.3)}
    probes = probe_table([law("lognormal 1"), law("lognormal 1.5"), law("pareto 2")], head, rng, 2 * args.reps)
    bias = bias_table(setting.routes, setting.fractions, rng, 10 * args.reps)
    minutes = (time.process_time() - t0) / 60
    command = "python " + " ".join(sys.argv)
    order = setting.plan_order()
    fwer = {k: {c.replace(": false", ": FWER"): v for c, v in row.items()} for k, row in suite.items()}
    profiles = "\n".join(
        f"  {name}: " + "; ".join(f"{a.name}: {np.round(setting.profile(name)[i], 3).tolist()}" for i, a in enumerate(setting.routes))
        for name in PROFILES
    )
    text = "\n\n".join(
        [
            f"{command}; code revision {code}; ε = {MARGIN:g} (DEFAULT_MARGIN), family-wise α = {ALPHA:g}; runs per row: "
            f"{args.reps} (exact), {rho_reps} (ρ); {minutes:.1f} CPU minutes",
            f"family-wise false-safe, worst case = {worst_case:.3f} ({worst_row}; 95 % upper limit of the Monte Carlo "
            f"{upper_95(worst_case, runs[worst_row]):.3f})",
            f"(map, the same truths read once on 16 probes per bin, exact rows: worst case {worst_map:.3f})",
            f"setting: routes {[a.name for a in setting.routes]} (Flux pass costs {[round(f, 3) for f in setting.fractions.values()]}), "
            f"bins {setting.bins.spec()}, σ mass {setting.sampler}: bins with mass {setting.planned}; "
            f"plan order (ratio@bin) {[r.split('_')[1] + '@' + str(b) for r, b in order]}; the first test read at level {head:.4f}; "
            f"auto: {PASSES} passes, budget {setting.setup.settings.budget:g}, horizon {setting.setup.settings.horizon:g}",
            f"truth profiles (routes × bins, units of ε, bin 0 = lowest σ):\n{profiles}",
            fmt_table(
                "Certifier, per population, estimator and profile: family-wise false-safe (FWER), power (share of the truly safe "
                "planned tests certified) and tests read, for the certify command and an auto run",
                fwer,
            ),
            fmt_table(
                "Map (estimator.summarize, exact): family-wise false-safe and power",
                {k: {c.replace(": false", ": FWER"): v for c, v in r.items()} for k, r in maps.items()},
            ),
            fmt_table(f"One test at a mean of 1.01 ε, read at the first test's level {head:.4f} (i.i.d. probes, exact)", single),
            f"lab sets ({len(sets)}, resampled, 400 tests each): mean per-test false-safe at that level = "
            f"{np.mean([r for r, _ in per_set]):.4f}; worst set {max(per_set)[0]:.4f} (its values: {np.round(np.sort(worst), 3).tolist()})",
            fmt_table(
                f"Probes a safe verdict needs: one test's safe rate at level {head:.4f} by probes read (looks n/8, n/4, n/2, n)", probes
            ),
            fmt_table(
                "Outside the claim: a share p of images carries the mean, the rest at ε/4; any rule's floor is (1 − p)^16 × its power on the bulk",
                outside,
            ),
            fmt_table(
                f"Bias of the certifier's ê at a true gap ε = {MARGIN:g} (D = 4 paired draws; κ = per-draw noise norm / signal norm)", bias
            ),
        ]
    )
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bound.txt"), "w") as fh:
            fh.write(text + "\n")
        blob = {
            "command": command,
            "revision": code,
            "alpha": ALPHA,
            "margin": MARGIN,
            "reps": args.reps,
            "rho_reps": rho_reps,
            "cpu_minutes": minutes,
            "worst_case": worst_case,
            "worst_row": worst_row,
            "worst_case_map": worst_map,
            "first_level": head,
            "plan_order": order,
            "profiles": {name: setting.profile(name).tolist() for name in PROFILES},
            "suite": suite,
            "map": maps,
            "per_test": single,
            "lab_per_test": {
                "mean": float(np.mean([r for r, _ in per_set])),
                "worst": max(per_set)[0],
                "worst_set": np.sort(worst).tolist(),
            },
            "outside": outside,
            "probes": probes,
            "bias": bias,
        }
        with open(os.path.join(args.out, "bound.json"), "w") as fh:
            json.dump(blob, fh, indent=1)


if __name__ == "__main__":
    main()
