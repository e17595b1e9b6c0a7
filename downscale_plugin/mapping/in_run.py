"""Certification inside a training run (``mode = "auto"``): one call from a host's probes to written windows.

A host hands over a :class:`~downscale_plugin.mapping.arms.MapBackend` over its own probes and step,
the σ mass of its own sampler and, to continue, an earlier ``certify.json``; this runs the certifier
(``certify.py``) in a fork of every generator the host draws from, writes ``windows.toml`` and
``certify.json`` as the ``certify`` command does, and returns what the host routes and reports by.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..arch import get_arch
from ..bins import SigmaBins, parse_bins
from ..config import DownscaleConfig
from ..grid import tokens
from ..rng import forked
from .arms import Arm, MapBackend, latent_arm
from .certify import (
    BackendDraws,
    CertifyResult,
    CertifySettings,
    Plan,
    load_tests,
    plan_tests,
    run_certify,
    settings_problems,
    token_fraction,
)
from .certify_cli import console_table, foreign_problems, write_outputs
from .sequential import Looks


@dataclass(frozen=True)
class InRunSetup:
    """What an auto run certifies: its routes and bins, the certifier's settings (the budget in
    native-step equivalents), and what is wrong with them, each problem named by its config key."""

    routes: list[Arm]
    bins: SigmaBins
    settings: CertifySettings
    problems: list[str]


def in_run_setup(cfg: DownscaleConfig, passes: int, seed: int) -> InRunSetup:
    """The config's certification for a run of ``passes`` single-sample native passes: the map's
    ratios, bins and ε, the ``certify_*`` keys, the default look schedule (its last look is the probe
    count), the budget ``certify_budget`` × ``passes``, and the passes after the probes as the horizon
    a window must pay back its evidence over (none with ``certify_unpaid = "buy"``: windows for later runs)."""
    looks = Looks()
    horizon = None if cfg.certify.unpaid == "buy" else float(max(passes - looks.last, 0))
    settings = CertifySettings(
        cfg.map.margin, cfg.certify.draws, looks, cfg.certify.budget * passes, seed, cfg.certify.spot_checks, horizon
    )
    problems = [f"{'map' if p.startswith('margin') else 'certify'}_{p}" for p in settings_problems(settings)]
    return InRunSetup([latent_arm(r) for r in cfg.map.ratios], parse_bins(cfg.map.bins), settings, problems)


def pass_costs(flop_model: Any, arch: str | None) -> Callable[[tuple[int, ...], tuple[int, ...]], float]:
    """A route pass's cost in native passes, (small latent shape, native latent shape) → F(small)/F(native) under
    the run's FLOP model (a video latent (B, C, F, H, W): every frame's tokens), so that the budget, the
    certification and the routed steps' saving are one unit; the token fraction without a model or arch."""
    if flop_model is None or arch is None:
        return token_fraction
    spec = get_arch(arch)

    def fraction(small: tuple[int, ...], native: tuple[int, ...]) -> float:
        frames = native[-3] if len(native) == 5 else 1
        return flop_model.flops(frames * tokens(small[-2:], spec)) / flop_model.flops(frames * tokens(native[-2:], spec))

    return fraction


def start_plan(setup: InRunSetup, fractions: Sequence[float], mass: Callable[[float, float], float]) -> Plan:
    """The certification's plan before any probe (``certify.plan_tests``): ``fractions`` each route's pass cost and
    ``mass`` the run's σ mass per bin, as the run's buckets give them."""
    costs = {arm.name: f for arm, f in zip(setup.routes, fractions, strict=True)}
    return plan_tests(setup.routes, setup.bins, setup.settings, mass, lambda arm: costs[arm.name])


def unpaid_problem(cfg: DownscaleConfig, plan: Plan, bins: SigmaBins, passes: int) -> str | None:
    """Why no planned test can pay back its evidence within this run and the budget, and what would pay; None when
    one can (the run certifies)."""
    if any(t.cost <= plan.budget for t in plan.paying):
        return None
    if not plan.tests:
        return f"the σ sampler draws no σ in any of the bins {bins.spec()}: no window could route a step"
    best, horizon, probes = plan.tests[0], plan.horizon, passes - (plan.horizon or 0.0)
    text = f"the best test, {best.route.name} on σ {bins.label(best.bin)} (σ mass {best.mass:.3f}), costs {best.cost:.1f} native-step equivalents"
    would = []
    if horizon is not None and horizon * best.value < best.cost:
        pay_from = probes + math.ceil(best.cost / best.value)
        text += f" and, safe, would save {horizon * best.value:.1f} over the run's {horizon:g} later passes"
        would.append(f"a run of at least {pay_from:.0f} single-sample passes (more steps)")
    if best.cost > plan.budget:
        text += f"; certify_budget {cfg.certify.budget:g} of the run's {passes} passes is {plan.budget:.1f}"
        would.append(f"certify_budget >= {best.cost / passes:.3f}")
    if cfg.certify.draws > 2:
        cheaper = best.cost * 2 / cfg.certify.draws
        paid = f", paying from {probes + math.ceil(cheaper / best.value):.0f} passes" if best.value > 0 else ""
        would.append(f"a cheaper probe setting, certify_draws = 2 ({cheaper:.1f} per verdict{paid}; noisier estimates)")
    would.append(
        "a windows file certified once on this model and reused (the windows cache: an earlier auto run with this run's key, "
        "or python -m downscale_plugin windows import FILE; or downscale_config = its windows.toml)"
    )
    return f"certification cannot pay in this run: {text}. What would pay: {'; '.join(would)}"


class ForeignEvidence(ValueError):
    """The continued ``certify.json`` was measured on another model, arch or tier."""


@dataclass(frozen=True)
class InRunCertification:
    result: CertifyResult
    windows_toml: str
    certify_json: str
    seconds: float
    table: str  # the console table, for the host's log
    foreign: tuple[str, ...] = ()  # mismatches of continued evidence used anyway (foreign = "warn"), for the host's log


def certify_in_run(
    backend: MapBackend,
    routes: Sequence[Arm],
    bins: SigmaBins,
    settings: CertifySettings,
    mass: Callable[[float, float], float],
    mass_text: str,
    out_dir: str,
    command: str,
    prior: tuple[str, dict[str, Any]] | None = None,
    foreign: str = "error",
    fraction: Callable[[tuple[int, ...], tuple[int, ...]], float] | None = None,
) -> InRunCertification:
    """Certify ``routes`` over ``backend``'s probes and write the outputs to ``out_dir``.

    ``prior`` is (path, the parsed ``certify.json``) whose evidence continues (its settings are the
    host's to check before the run starts, ``certify_cli.resume_problems``); one measured on another
    model, arch or tier raises :class:`ForeignEvidence` unless ``foreign = "warn"``. ``fraction``: a route
    pass's cost in native passes (the run's FLOP model; default its token fraction)."""
    described = backend.describe()
    provenance: dict[str, Any] = {"command": command, "backend": described, "sigma_sampler": mass_text}
    tests, mismatches = [], []
    if prior is not None:
        path, blob = prior
        mismatches = foreign_problems(blob.get("provenance", {}).get("backend", {}), described)
        if mismatches and foreign == "error":
            raise ForeignEvidence("certify_resume:\n  - " + "\n  - ".join(mismatches))
        tests = load_tests(blob)
        provenance["resumed_from"] = {"file": path, "native_step_equivalents": blob["cost"]["native_step_equivalents"]}
    source = BackendDraws(backend, bins, settings.draws, settings.seed, fraction=fraction)
    grids = getattr(backend, "grids", None)  # each probe's latent grid (ProbeBackend): route costs known before any pass
    for arm in routes if grids else ():
        source.fractions[arm.name] = source.fraction(tuple(backend.arm_input(0, arm)[0]), tuple(grids[0]))
    t0 = time.perf_counter()
    with forked(backend.rng_devices):
        result = run_certify(source, routes, bins, settings, mass, provenance=provenance, prior=tests)
    seconds = time.perf_counter() - t0
    toml_path, json_path = write_outputs(result, source, out_dir, command)
    return InRunCertification(result, toml_path, json_path, seconds, console_table(result, source), tuple(mismatches))
