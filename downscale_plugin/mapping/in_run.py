"""Certification inside a training run (``mode = "auto"``): one call from a host's probes to written windows.

A host hands over a :class:`~downscale_plugin.mapping.arms.MapBackend` over its own probes and step,
the σ mass of its own sampler and, to continue, an earlier ``certify.json``; this runs the certifier
(``certify.py``) in a fork of every generator the host draws from, writes ``windows.toml`` and
``certify.json`` as the ``certify`` command does, and returns what the host routes and reports by.
"""

from __future__ import annotations

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
    first_verdict_cost,
    load_tests,
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
    a window must pay back its evidence over."""
    looks = Looks()
    horizon = float(max(passes - looks.last, 0))
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


def budget_problem(cfg: DownscaleConfig, settings: CertifySettings, passes: int, fractions: Sequence[float]) -> str | None:
    """``certify_budget`` too small for one safe verdict (every route's top bin on all its probes), with
    what it would need; None when it covers one."""
    need = first_verdict_cost(settings, fractions)
    if settings.budget >= need:
        return None
    return (
        f"certify_budget: {cfg.certify.budget:g} of this run's {passes} single-sample passes is {settings.budget:.1f} native-step "
        f"equivalents; one safe verdict costs {need:.1f} ({settings.looks.first_safe} probes × {settings.draws} draws × (1 native + "
        f"the routes' costs {' + '.join(f'{f:.3f}' for f in fractions)})): certify_budget >= {need / passes:.3f} at this length, "
        "or a longer run; certify_budget = 0 trains without certifying"
    )


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
