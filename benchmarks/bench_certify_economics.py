"""Does ``mode = "auto"`` pay for itself? The real certifier on simulated draws, priced by the project's FLOP model.

    python benchmarks/bench_certify_economics.py --out docs/fidelity/certify_economics

(the stored figures' one command: it prints the output and writes it, output.txt, with economics.json; 10 certifier
seeds per cell, 2 archs × 6 scenarios: about 4 minutes on one loaded CPU core; its figures are counts of the FLOP
model, not wall time, so it may run beside other jobs). To run it on another revision's certifier, copy this file into
that checkout's ``benchmarks/`` under a new (untracked) name and run it there: it imports the package of the checkout it
sits in and records that checkout's revision.

A run of 3 000 single-sample passes at 1024² (latent 128×128), default settings (``in_run.in_run_setup`` on the default
config: routes 0.875 / 0.75 / 0.5, the default bins, the default ε (``certify_config.DEFAULT_MARGIN``), D = 4, looks
2/4/8/16, ``certify_budget`` 0.1), for

- ``flux``: route pass costs from the Flux step FLOP model (``arch.get_arch("flux").flops``, 0.747 / 0.547 / 0.273),
  σ from sd-scripts' ``flux_shift`` (μ = 1.15 at 4 096 packed tokens, the same law as ``shift`` 3.1582 there);
- ``sdxl``: the UNet's linear model (r²: 0.766 / 0.5625 / 0.25), σ from DDPM t uniform on [0, 1000).

The bins' masses are the sampler's, as ``hosts/kohya/auto.py`` reads them (host σ draws at the probes' grid). Every
draw is the certifier's own (``run_certify`` over a :class:`SimulatedDraws`): per image a native mean gradient and a
route mean at cosine 1 − gap_i, D = 4 paired draws with noise of the signal's norm, the route's noise correlated
ρ = 0.9 with the native's (paired noise, as ``tests/test_certify.py``). The per-image true gaps, per scenario:

- ``all_safe``: every (route, bin) at ε/10 (gap_i ~ N(ε/10, (ε/25)²), clipped at 0): the ceiling. At the default
  ε 0.2, ε/10 = 0.02; the lab maps (docs/FIDELITY.md §3) measure 0.875 under it on σ > 0.95 (0.005-0.007; 0.020 on
  (0.925, 0.95]), 0.75 nowhere (its lowest: 0.025, at σ = 1) and 0.5 nowhere near (its lowest: 0.176, at σ ≤ 0.025,
  0.88 ε). So for 0.5 (and 0.75) ε/10 is not a measurement but the scenario's premise, a model unlike the lab's on which
  every route is as good as the lab's best 0.875 window; the output's ``# all_safe grounding`` line prints each route's
  lowest measured excess;
- ``lab_like``: the lab's measured per-image excess (docs/fidelity/lab_n64_d8_n16 for 0.875 / 0.75, its pooled map for
  0.5: the maps of docs/FIDELITY.md §3), bin for bin, clipped to [0, TRIM]: only the top high-σ bins are safe;
- ``none_safe``: every (route, bin) at 4 ε (gap_i ~ N(4ε, ε²));
- ``shallow_safe``: 0.875 and 0.75 as ``all_safe`` in the bins above σ 0.6 (lower edge ≥ 0.6) and as ``none_safe``
  below; 0.5 as ``none_safe`` everywhere: the deepest route fails first and must not hold the others hostage;
- ``lab_concept``: the lab's concept map (docs/fidelity/lab_concept_n64_d8_n16, docs/FIDELITY.md §10) for 0.875 / 0.75,
  per-image excess as measured, read at the default ε; 0.5, which that map did not measure, as ``none_safe`` (on the
  pooled map 0.5's excess is above 0.75's in every bin, and the concept's 0.75 is over the default ε below σ 0.9);
- ``multires_corpus``, ``multires_hatch``: the same two kinds of map on the shipped multi-size lab base
  (docs/fidelity/multires, every route measured at 1024 tokens): its corpus map reads 0.75 safe above σ 0.1 and 0.5
  above σ 0.925 at the default ε, its posters' map nowhere;
- ``borderline`` (printed as a comment, outside the contract): every (route, bin) under ε but spread (gap_i ~ N(0.6ε, (0.6ε)²)),
  where a test may run to its last look and end not safe (inconclusive): the plan's worst case.

Net = (routed saving − certification cost) / passes: the saving is what the written windows route over the passes
after the probes (each bin's mass × 1 − the pass cost of the first stacked window that covers it, ``windows.stack_windows``),
the cost is ``result.spent``; both in native-step equivalents of the FLOP model. ``reuse ARCH cost``: a second run of
the same key (``mapping/reuse.py``: each run's windows are stored under its ``WindowsKey`` in a private cache folder
and looked up again, as ``hosts/kohya/auto.py`` does): a hit certifies nothing, cost 0, and routes by the same
windows (checked: the cached text is the first run's); its net is those windows' saving alone.

``# oracle ARCH SCENARIO``: what a certifier that knew each (route, bin)'s mean excess over the probes could net under
the same pay rule: per bin, the most-saving route under ε whose window saves back one safe read, less that read (0 when
none does); a bound on what evidence can buy here, not a figure of this certifier. ``# worst case ARCH``: the plan's
stake (``Plan.stake``), what a run may lose.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence

import numpy as np
import toml
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from downscale_plugin.arch import get_arch  # noqa: E402
from downscale_plugin.bins import SigmaBins  # noqa: E402
from downscale_plugin.certify_config import DEFAULT_MARGIN  # noqa: E402
from downscale_plugin.config import load_config  # noqa: E402
from downscale_plugin.grid import target_grid  # noqa: E402
from downscale_plugin.mapping.arms import Arm  # noqa: E402
from downscale_plugin.mapping.certify import CertifyResult, Verdicts, run_certify, windows_toml  # noqa: E402
from downscale_plugin.mapping.estimator import Cell, excess  # noqa: E402
from downscale_plugin.mapping.in_run import in_run_setup, pass_costs  # noqa: E402
from downscale_plugin.mapping.reuse import WindowsKey, certifier_code, entry_of, lookup, sampler_fingerprint, store  # noqa: E402
from downscale_plugin.mapping.safe_read import TRIM  # noqa: E402
from downscale_plugin.mapping.windows import stack_windows, utc_now  # noqa: E402
from downscale_plugin.sigma import DdpmSampler, SigmaSampler  # noqa: E402

PASSES, NATIVE_HW = 3000, (128, 128)
SAMPLERS = {"flux": SigmaSampler(mode="flux_shift"), "sdxl": DdpmSampler()}
SCENARIOS = ("all_safe", "lab_like", "none_safe", "shallow_safe", "lab_concept", "multires_corpus", "multires_hatch", "borderline")
CONTRACT = SCENARIOS[:-1]  # printed as ``net ARCH SCENARIO = X %``; borderline as a comment
LAB_MAPS = {
    "docs/fidelity/lab_n64_d8_n16/map.json": ("latent_0.875", "latent_0.75"),
    "docs/fidelity/lab_n64_d8_n16_pool/map.json": ("latent_0.5",),
}
CONCEPT_MAP = {"docs/fidelity/lab_concept_n64_d8_n16/map.json": ("latent_0.875", "latent_0.75")}
ROUTES = ("latent_0.875", "latent_0.75", "latent_0.5")
MULTIRES_MAPS = {  # the shipped multi-size base's maps (docs/fidelity/multires), every route measured
    "multires_corpus": {"docs/fidelity/multires/corpus_t1024/map.json": ROUTES},
    "multires_hatch": {"docs/fidelity/multires/hatch_t1024/map.json": ROUTES},
}
SHALLOW_FROM = 0.6  # shallow_safe: 0.875 / 0.75 safe in the bins whose lower edge is at or above this σ
MASS_DRAWS = 1 << 16


class SimulatedDraws:
    """A :class:`~downscale_plugin.mapping.certify.DrawSource` with known per-image gaps: ``gaps[route, bin]`` is a
    function image → true 1 − cos(μ_native, μ_route); pass costs are the FLOP model's ``fractions``."""

    def __init__(self, gaps: Callable[[str, int, int], float], fractions: dict[str, float], images: int, seed: int, dim: int = 48):
        self.gaps, self.fractions, self.images, self.seed, self.dim = gaps, fractions, images, seed, dim

    def num_images(self) -> int:
        return self.images

    def cost(self, arm: Arm | None) -> float:
        return 1.0 if arm is None else self.fractions[arm.name]

    def draw_pairs(self, image: int, bin_: int, routes: Sequence[Arm], sink) -> None:
        rng = np.random.default_rng([self.seed, image, bin_, 0xD2A3])
        mu = rng.standard_normal(self.dim)
        mu /= np.linalg.norm(mu)
        draws = 4
        xi = rng.standard_normal((draws, self.dim)) / math.sqrt(self.dim)
        route_rows = {}
        for arm in routes:
            r = np.random.default_rng([self.seed, image, bin_, round(arm.ratio * 1000), 0x7A]).standard_normal((draws + 1, self.dim))
            c = 1.0 - min(max(self.gaps(arm.name, bin_, image), 0.0), TRIM)
            orth = r[0] - (r[0] @ mu) * mu
            mean = 0.9 * (c * mu + math.sqrt(max(1.0 - c * c, 0.0)) * orth / np.linalg.norm(orth))
            route_rows[arm.name] = mean + 0.9 * (0.9 * xi + math.sqrt(1 - 0.81) * r[1:] / math.sqrt(self.dim))
        for d in range(draws):
            sink(None, [torch.from_numpy(mu + xi[d])])
            for arm in routes:
                sink(arm.name, [torch.from_numpy(route_rows[arm.name][d])])


def lab_gaps(maps: dict[str, tuple[str, ...]] = LAB_MAPS) -> dict[tuple[str, int], list[float]]:
    """The lab maps' per-image excess by (route, bin), images in order (docs/FIDELITY.md §3)."""
    out: dict[tuple[str, int], list[float]] = {}
    for path, arms in maps.items():
        with open(path) as fh:
            cells = json.load(fh)["cells"]
        for c in sorted(cells, key=lambda c: (c["bin"], c["image"])):
            cell = Cell(
                c["image"], c["bin"], *({k: math.nan if v is None else v for k, v in c[f].items()} for f in ("half_cos", "cos", "norm"))
            )
            for arm in arms:
                value = excess(cell, arm)
                out.setdefault((arm, c["bin"]), []).append(TRIM if not math.isfinite(value) else value)
    return out


SYNTHETIC = {"all_safe": (0.1, 0.04), "none_safe": (4.0, 1.0), "borderline": (0.6, 0.6)}  # (centre, spread) in ε


def synthetic(kind: str, seed: int, margin: float) -> Callable[[str, int, int], float]:
    """gap_i ~ N(centre, spread²) of a synthetic kind, scaled with the run's ε, seeded per (image, bin, route)."""
    centre, spread = (margin * c for c in SYNTHETIC[kind])

    def gap(route: str, b: int, image: int) -> float:
        rng = np.random.default_rng([seed, image, b, round(float(route.split("_")[-1]) * 1000), 0x6A9])
        return float(centre + spread * rng.standard_normal())

    return gap


def measured(maps: dict[str, tuple[str, ...]], otherwise: Callable[[str, int, int], float]) -> Callable[[str, int, int], float]:
    """The maps' per-image excess as measured where they have the route, ``otherwise`` where they do not."""
    lab = lab_gaps(maps)
    return lambda route, b, image: lab[route, b][image % len(lab[route, b])] if (route, b) in lab else otherwise(route, b, image)


def scenario_gaps(name: str, seed: int, margin: float, bins: SigmaBins) -> Callable[[str, int, int], float]:
    """Per-image true gaps of a scenario; the synthetic ones scale with the run's ε, the lab's are as measured."""
    if name == "lab_like":
        return measured(LAB_MAPS, synthetic("none_safe", seed, margin))
    if name == "lab_concept":
        return measured(CONCEPT_MAP, synthetic("none_safe", seed, margin))
    if name in MULTIRES_MAPS:
        return measured(MULTIRES_MAPS[name], synthetic("none_safe", seed, margin))
    if name == "shallow_safe":
        safe, unsafe = synthetic("all_safe", seed, margin), synthetic("none_safe", seed, margin)
        shallow = lambda route, b: route != "latent_0.5" and bins.bounds(b)[0] >= SHALLOW_FROM  # noqa: E731
        return lambda route, b, image: (safe if shallow(route, b) else unsafe)(route, b, image)
    return synthetic(name, seed, margin)


def oracle_net(gaps: Callable[[str, int, int], float], setup, fractions: dict[str, float], mass, images: int, later: float) -> float:
    """What a certifier knowing each (route, bin)'s mean excess over the probes could net under the pay rule: per bin, the
    best route under ε whose window saves back its one safe read (``certify.safe_cost``), less that read; 0 where none does."""
    s, total = setup.settings, 0.0
    for b in range(len(setup.bins)):
        m, best = mass(*setup.bins.bounds(b)), 0.0
        for arm in setup.routes:
            mean = float(np.mean([min(max(gaps(arm.name, b, i), 0.0), TRIM) for i in range(images)]))
            if mean < s.margin:
                best = max(best, later * m * (1.0 - fractions[arm.name]) - s.looks.first_safe * s.draws * (1.0 + fractions[arm.name]))
        total += best
    return total


def grounding(bins: SigmaBins) -> str:
    """The lab maps' lowest per-bin mean excess per route (what ``all_safe``'s ε/10 stands for, or not)."""
    lowest: dict[str, tuple[float, int]] = {}
    for (route, b), values in lab_gaps().items():
        lowest[route] = min(lowest.get(route, (math.inf, -1)), (float(np.mean(values)), b))
    ordered = sorted(lowest.items(), key=lambda kv: -float(kv[0].split("_")[-1]))
    return ", ".join(f"{route} {mean:.4f} at {bins.label(b)}" for route, (mean, b) in ordered)


def sampler_mass(arch: str) -> Callable[[float, float], float]:
    """P(lo < σ ≤ hi) (a point bin: P(σ = hi)) under the arch's sampler at the native grid, as ``AutoSession.sigma_mass``."""
    sigmas = SAMPLERS[arch].sample(MASS_DRAWS, NATIVE_HW, torch.Generator().manual_seed(0)).double()

    def mass(lo: float, hi: float) -> float:
        inside = (sigmas == hi) if hi <= lo else (sigmas > lo) & (sigmas <= hi)
        return float(inside.double().mean())

    return mass


def routed_saving(result: CertifyResult, mass: Callable[[float, float], float], fractions: dict[str, float], passes: float) -> float:
    """Native-step equivalents the written windows save over ``passes``: per bin, its mass × (1 − the pass cost of the
    first stacked window covering it)."""
    windows = stack_windows(Verdicts(result)).windows  # type: ignore[arg-type]
    bins: SigmaBins = result.bins
    total = 0.0
    for b in range(len(bins)):
        lo, hi = bins.bounds(b)
        for w in windows:
            top = math.inf if w.sigma_max is None else w.sigma_max
            if w.sigma_min <= lo and (hi < top or (hi == top and not bins.is_endpoint(b))):
                total += mass(lo, hi) * (1.0 - fractions[w.arm])
                break
    return passes * total


def one_run(arch: str, scenario: str, seed: int) -> dict:
    cfg = load_config(table={"mode": "auto", "map_out": "unused"})
    setup = in_run_setup(cfg, PASSES, seed)
    spec = get_arch(arch)
    price = pass_costs(spec.flops, arch)
    fractions = {a.name: price(target_grid(NATIVE_HW, a.ratio, spec), NATIVE_HW) for a in setup.routes}
    mass = sampler_mass(arch)
    gaps = scenario_gaps(scenario, seed, setup.settings.margin, setup.bins)
    source = SimulatedDraws(gaps, fractions, setup.settings.looks.last, seed)
    result = run_certify(
        source, setup.routes, setup.bins, setup.settings, mass, provenance={"backend": {"arch": arch, "native_latent_hw": list(NATIVE_HW)}}
    )
    later = PASSES - setup.settings.looks.last
    saving = routed_saving(result, mass, fractions, later)
    text = windows_toml(result)
    key = WindowsKey(
        f"sha256:bench-{arch}", "none", arch, "networks.lora", 16, (f"{NATIVE_HW[0]}x{NATIVE_HW[1]}",),
        sampler_fingerprint(SAMPLERS[arch], [NATIVE_HW]), "none", "bench", "none", certifier_code(),
        tuple(a.ratio for a in setup.routes), setup.bins.spec(), setup.settings.margin, setup.settings.looks.alpha,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as cache:  # the first run stores its windows; a second run of the same key finds them
        store(entry_of(key, result, text, result.spent, utc_now(), "benchmarks/bench_certify_economics.py"), cache)
        horizon = math.inf if setup.settings.horizon is None else setup.settings.horizon
        hit = lookup(key, cache, horizon, setup.settings.budget).entry
    reuse_cost = 0.0 if hit is not None and hit.windows_text == text else math.nan
    second = load_config(plugin_toml=toml.loads(text))
    oracle = oracle_net(gaps, setup, fractions, mass, setup.settings.looks.last, later)
    worst = result.plan.stake if result.plan is not None else math.nan
    return {"arch": arch, "scenario": scenario, "seed": seed, "spent": result.spent, "saving": saving, "net": saving - result.spent,
            "oracle": oracle, "worst_case": worst,
            "safe": [f"{t.route} {result.bins.label(t.bin)}" for t in result.safe_tests()], "reuse_rules": len(second.routes),
            "reuse_cost": reuse_cost, "notes": list(result.notes)}  # fmt: skip


def revision() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True, cwd=os.path.dirname(__file__)
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=os.path.dirname(__file__)
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def report(summary: dict, seeds: int, rev: str) -> list[str]:
    """The output's lines: per cell spent / saving / net, the oracle, the worst case, all_safe's grounding, then the
    contract lines (``net ARCH SCENARIO = X %``, ``reuse ARCH cost = C``)."""
    out = [
        f"# revision {rev}; {PASSES} passes at {NATIVE_HW[0] * 8}², {seeds} certifier seeds per cell; native-step equivalents",
        "# arch scenario: spent, routed saving, net (mean; worst seed)",
    ]
    out += [f"# {a} {c}: {s['spent']:.1f}, {s['saving']:.1f}, {s['net']:+.1f} (worst {s['net_min']:+.1f})" for (a, c), s in summary.items()]
    out += [
        f"# oracle {a} {c} = {100 * s['oracle'] / PASSES:+.2f} % (knowing each bin's mean excess, the same pay rule)"
        for (a, c), s in summary.items()
    ]
    for arch in SAMPLERS:
        w = summary[arch, "none_safe"]["worst_case"]
        out.append(f"# worst case {arch} (the plan's stake) = {-w:.1f} ({-100 * w / PASSES:+.2f} %)")
    bins = in_run_setup(load_config(table={"mode": "auto", "map_out": "unused"}), PASSES, 0).bins
    out.append(
        f"# all_safe grounding: the lab maps' lowest per-bin mean excess (all_safe: ε/10 = {0.1 * DEFAULT_MARGIN:g}): {grounding(bins)}"
    )
    out += [
        f"# reuse {arch}: a second all_safe run finds the first one's windows under its key, certifies nothing: "
        f"net {100 * summary[arch, 'all_safe']['saving'] / PASSES:+.2f} %"
        for arch in SAMPLERS
    ]
    for (arch, scenario), s in summary.items():
        line = f"net {arch} {scenario} = {100 * s['net'] / PASSES:+.2f} %"
        out.append(line if scenario in CONTRACT else f"# {line} (outside the contract: gaps under ε, spread)")
    out += [f"reuse {arch} cost = {summary[arch, 'all_safe']['reuse_cost']:g}" for arch in SAMPLERS]
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=10, help="certifier seeds per (arch, scenario)")
    parser.add_argument("--out", default=None, help="directory for output.txt and economics.json (default: print only)")
    args = parser.parse_args()
    rev = revision()  # before anything is written: the outputs may be tracked files
    torch.set_num_threads(1)
    runs, summary = [], {}
    for arch in SAMPLERS:
        for scenario in SCENARIOS:
            cell = [one_run(arch, scenario, seed) for seed in range(args.seeds)]
            runs += cell
            summary[arch, scenario] = {k: float(np.mean([r[k] for r in cell])) for k in ("spent", "saving", "net", "oracle", "worst_case")}
            summary[arch, scenario]["net_min"] = float(min(r["net"] for r in cell))
            costs = [r["reuse_cost"] for r in cell]  # NaN: a second run of the key found no windows
            summary[arch, scenario]["reuse_cost"] = math.nan if any(math.isnan(c) for c in costs) else max(costs)
    lines = report(summary, args.seeds, rev)
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "output.txt"), "w") as fh:
            fh.write("\n".join(lines) + "\n")
        with open(os.path.join(args.out, "economics.json"), "w") as fh:
            json.dump({"revision": rev, "command": "python " + " ".join(sys.argv), "passes": PASSES, "runs": runs,
                       "summary": [{"arch": a, "scenario": s, **v} for (a, s), v in summary.items()]}, fh, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
