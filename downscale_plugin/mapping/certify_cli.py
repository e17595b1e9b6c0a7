"""``python -m downscale_plugin certify``: certify (route, σ-bin) windows at a fraction of the map's cost.

    python -m downscale_plugin certify --lab --ratios 0.875,0.75,0.5 --margin 0.05 --budget 300 --out certify_out

It measures on the same backends as ``map`` (a host registers a map source with
``mapping.cli.register_source`` and, for ``certify``, the σ mass of its sampler with
:func:`register_sigma_mass`: what a window is worth depends on how often the host draws its σ).
Outputs in ``--out``: ``windows.toml`` (a plugin TOML, as ``map`` writes it) and ``certify.json``
(``cost.native_step_equivalents``, and per (route, σ-bin) its verdict, bound and evidence); the
console shows a progress bar over the budget, the table and the cost against the full map's.
The method is ``certify.py``'s; docs/FIDELITY.md has the lab study.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from ..bins import DEFAULT_BINS, parse_bins
from ..certify_config import DEFAULT_MARGIN
from ..cli import fail, register
from .arms import MapBackend, latent_arm

Mass = Callable[[float, float], float]
SIGMA_MASSES: dict[str, Callable[[MapBackend], tuple[Mass, str]]] = {}


def register_sigma_mass(flag: str, mass: Callable[[MapBackend], tuple[Mass, str]]) -> None:
    """``mass(backend)`` → (P(lo < σ ≤ hi) under the host's sampler at the backend's native grid, its description)."""
    if flag in SIGMA_MASSES:
        raise ValueError(f"certify: a σ mass for --{flag} is already registered")
    SIGMA_MASSES[flag] = mass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .cli import SOURCES

    group = parser.add_mutually_exclusive_group(required=True)
    for flag in SIGMA_MASSES:
        group.add_argument(f"--{flag}", action="store_true", help=SOURCES[flag].help)
    parser.add_argument("--ratios", default="0.875,0.75,0.5", help="route linear ratios, comma-separated (default 0.875,0.75,0.5)")
    parser.add_argument("--bins", default=DEFAULT_BINS, help=f"σ bins, as for map (default {DEFAULT_BINS}, with the σ = 1 bin)")
    parser.add_argument(
        "--margin",
        type=float,
        default=DEFAULT_MARGIN,
        help=f"ε: a bin is safe when its anytime-valid upper bound < ε (default {DEFAULT_MARGIN:g})",
    )
    parser.add_argument("--alpha", type=float, default=0.05, help="family-wise false-safe level over every route and bin (default 0.05)")
    parser.add_argument("--draws", type=int, default=4, help="paired draws per (image, bin), >= 2 (default 4)")
    parser.add_argument(
        "--looks",
        default="2,4,8,16",
        help="image counts at which a bin's bound is read, the first >= 2; the last is the image pool (default 2,4,8,16)",
    )
    parser.add_argument(
        "--safe_from",
        type=int,
        help="the first look that may end a bin safe (default: the last; earlier safe reads miss skewed tails, docs/FIDELITY.md §9.3)",
    )
    parser.add_argument("--budget", type=float, default=300.0, help="native-step-equivalent passes at most (default 300)")
    parser.add_argument(
        "--spot_checks", type=int, default=2, help="pruned bins tested per route, between two bins that ended unsafe or futile (default 2)"
    )
    parser.add_argument(
        "--unpaired", action="store_true", help="draw the route's noise independently (the baseline paired noise is measured against)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the certifier's seed: image order, σ and noise (default 0)")
    parser.add_argument(
        "--model_seed", type=int, default=0, help="the backend's seed: model, adapter and probes, as map's --seed (default 0)"
    )
    parser.add_argument(
        "--resume", metavar="CERTIFY_JSON", help="add evidence to a saved certify.json (same settings) instead of starting over"
    )
    parser.add_argument(
        "--windows_foreign",
        choices=("error", "warn"),
        default="error",
        help="--resume on another model, arch or tier: refuse (default) or warn",
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", default="certify_out", help="output directory (default certify_out)")
    parser.add_argument("--no_progress", action="store_true")
    for flag in SIGMA_MASSES:
        SOURCES[flag].add_arguments(parser.add_argument_group(f"--{flag}"))


def _looks(text: str, alpha: float, safe_from: int | None) -> Any:
    from .sequential import Looks

    return Looks(tuple(int(x) for x in text.split(",") if x.strip()), alpha, safe_from)


def command_line(args: argparse.Namespace, flag: str, source_words: list[str]) -> str:
    parts = [f"python -m downscale_plugin certify --{flag}", *source_words, f"--ratios {args.ratios}", f"--bins {args.bins}"]
    parts += [f"--margin {args.margin:g}", f"--alpha {args.alpha:g}", f"--draws {args.draws}", f"--looks {args.looks}"]
    parts += [f"--safe_from {args.safe_from}"] if args.safe_from is not None else []
    parts += [f"--budget {args.budget:g}", f"--spot_checks {args.spot_checks}", f"--seed {args.seed}", f"--model_seed {args.model_seed}"]
    parts += ["--unpaired"] if args.unpaired else []
    parts += [f"--resume {args.resume}", f"--windows_foreign {args.windows_foreign}"] if args.resume else []
    return " ".join([*parts, f"--out {args.out}"])


def run(args: argparse.Namespace) -> int:
    from .certify import BackendDraws, CertifySettings, load_tests, settings_problems
    from .cli import SOURCES

    flag = next(f for f in SIGMA_MASSES if getattr(args, f))
    problems: list[str] = []
    routes = bins = looks = settings = None
    try:
        routes = [latent_arm(float(r)) for r in args.ratios.split(",") if r.strip()]
        if not routes or any(not 0 < a.ratio < 1 for a in routes) or len({a.ratio for a in routes}) < len(routes):
            raise ValueError("give distinct ratios strictly between 0 and 1")
    except ValueError as err:
        problems.append(f"ratios: {args.ratios!r}: {err}")
    try:
        bins = parse_bins(args.bins)
    except ValueError as err:
        problems.append(str(err))
    try:
        looks = _looks(args.looks, args.alpha, args.safe_from)
    except ValueError as err:
        problems.append(str(err))
    if looks is not None:
        settings = CertifySettings(args.margin, args.draws, looks, args.budget, args.seed, args.spot_checks)
        problems += settings_problems(settings)
    prior = _read_prior(args.resume, problems) if args.resume else None
    if prior is not None and None not in (settings, bins, routes):
        problems += resume_problems(prior, settings, bins, routes)
    source_args = argparse.Namespace(**{**vars(args), "images": looks.last if looks else 16, "seed": args.model_seed})
    source_problems, make_backend, provenance, words = SOURCES[flag].prepare(source_args, routes or ())
    problems += source_problems
    if args.threads is not None and args.threads < 1:
        problems.append(f"threads: {args.threads} must be >= 1")
    if problems:
        return fail(problems)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = command_line(args, flag, words)
    t0 = time.perf_counter()
    backend = make_backend()
    mass, mass_text = SIGMA_MASSES[flag](backend)
    setup_s = time.perf_counter() - t0
    described = backend.describe()
    provenance = {"command": command, **provenance, "backend": described}
    tests = []
    if prior is not None:
        foreign = foreign_problems(prior.get("provenance", {}).get("backend", {}), described)
        if foreign and args.windows_foreign == "error":
            return fail([f"resume: {p} (--windows_foreign warn adds the evidence anyway)" for p in foreign])
        for p in foreign:
            print(f"warning: resume: {p}", file=sys.stderr)
        tests = load_tests(prior)
        provenance["resumed_from"] = {"file": args.resume, "native_step_equivalents": prior["cost"]["native_step_equivalents"]}
    source = BackendDraws(backend, bins, settings.draws, settings.seed, paired=not args.unpaired)
    result = _certify(source, routes, bins, settings, mass, not args.no_progress, provenance, tests)
    result.provenance.update(
        setup_s=round(setup_s, 2), sigma_sampler=mass_text, paired=not args.unpaired, torch_threads=torch.get_num_threads()
    )
    paths = write_outputs(result, source, args.out, command)
    print(console_table(result, source))
    print(
        f"\nsetup (model, adapter warm-up) {setup_s:.1f} s, certify {result.provenance['wall_s']:.1f} s, torch threads {torch.get_num_threads()}"
    )
    for path in paths:
        print(f"wrote {path}")
    return 0


IDENTITY_KEYS = ("model_identity", "arch", "native_latent_hw")  # what makes evidence about one model, arch and tier


def foreign_problems(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Each identity key on which a saved result's backend differs from this one, named with both values."""
    return [
        f"{key}: the saved evidence is for {saved.get(key)!r}, this backend is {current.get(key)!r}"
        for key in IDENTITY_KEYS
        if saved.get(key) != current.get(key)
    ]


def _read_prior(path: str, problems: list[str]) -> dict[str, Any] | None:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError) as err:
        problems.append(f"resume: cannot read {path}: {err}")
        return None


def resume_problems(prior: dict[str, Any], settings: Any, bins: Any, routes: list) -> list[str]:
    """Evidence continues a confidence sequence only under the same estimand and sequence: same ε,
    draws, looks, seed (image order and noise), bins and routes; anything else is a new certification."""
    saved = prior.get("settings", {})
    from .certify import looks_json

    now = {"margin": settings.margin, "draws": settings.draws, "seed": settings.seed, "looks": looks_json(settings.looks)}
    problems = [
        f"resume: {key} is {saved.get(key)!r} in the saved result, {value!r} now" for key, value in now.items() if saved.get(key) != value
    ]
    if prior.get("bins_spec") != {"edges": list(bins.edges), "endpoint": bins.endpoint}:
        problems.append(f"resume: bins {prior.get('bins_spec')} in the saved result, {bins.spec()} now")
    saved_routes = sorted({row["route"] for row in prior.get("bins", [])})
    if saved_routes != sorted(a.name for a in routes):
        problems.append(f"resume: routes {saved_routes} in the saved result, {sorted(a.name for a in routes)} now")
    return problems


def _certify(
    source: Any, routes: list, bins: Any, settings: Any, mass: Mass, progress: bool, provenance: dict[str, Any], prior: list
) -> Any:
    from tqdm.auto import tqdm

    from .certify import run_certify

    bar = tqdm(
        total=settings.budget,
        desc="certify",
        unit="pass",
        disable=not progress,
        bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} native-step eq. [{elapsed}{postfix}]",
    )

    def step(spent: float, text: str) -> None:
        bar.update(spent - bar.n)
        bar.set_postfix_str(text)

    try:
        return run_certify(source, routes, bins, settings, mass, step, provenance, prior)
    finally:
        bar.close()


def cost_summary(result: Any, source: Any) -> dict[str, Any]:
    """The certifier's cost against the full map's on the same grids (N = the last look, D = 8)."""
    from .certify import full_map_cost

    fractions = [source.cost(a) for a in result.routes]
    full = full_map_cost(result.settings.looks.last, 8, len(result.bins), fractions)
    before = result.provenance.get("resumed_from", {}).get("native_step_equivalents", 0.0)
    return {
        "native_step_equivalents": round(before + result.spent, 3),
        "this_run": round(result.spent, 3),
        "budget": result.settings.budget,
        "full_map_native_step_equivalents": full,
        "full_map": f"N = {result.settings.looks.last}, D = 8, {len(result.bins)} bins, 2 native arms + {len(fractions)} routes",
        "fraction_of_full_map": round((before + result.spent) / full, 4),
        "route_pass_cost": {a.name: round(f, 6) for a, f in zip(result.routes, fractions, strict=True)},
        "model": "a native pass (forward + backward at the native grid) is 1; a route pass is its token fraction (h_r·w_r)/(h·w)",
    }


def write_outputs(result: Any, source: Any, out_dir: str, command: str) -> list[str]:
    from .certify import windows_toml
    from .report import _finite

    os.makedirs(out_dir, exist_ok=True)
    blob = result.to_json()
    blob["cost"] = cost_summary(result, source)
    json_path, toml_path = os.path.join(out_dir, "certify.json"), os.path.join(out_dir, "windows.toml")
    with open(json_path, "w") as fh:
        json.dump(_finite(blob), fh, indent=1, allow_nan=False)
    with open(toml_path, "w") as fh:
        fh.write(windows_toml(result, command))
    return [toml_path, json_path]


def _cell(t: Any) -> str:
    if t.bound is None:
        return t.verdict
    b = t.bound
    return f"{t.verdict[:6]:<6} {b.mean:+.3f} ≤{b.upper:+.3f} n={b.n}{' spot' if t.spot else ''}"


def console_table(result: Any, source: Any) -> str:
    """Bins from σ = 1 down, routes across: verdict, mean estimate, upper bound, images; spot checks and scope."""
    from .certify import scope_text
    from .sequential import describe_safe_read

    s = result.settings
    width = 30
    head = f"{'σ bin':<16}" + "".join(f"{a.name:>{width}}" for a in result.routes)
    lines = [
        f"certify: paired U-statistic excess, looks {list(s.looks.at)}; {describe_safe_read(s.looks, s.margin)}; D = {s.draws}",
        head,
        "-" * len(head),
    ]
    rows = {a.name: result.rows(a) for a in result.routes}
    for b in reversed(range(len(result.bins))):
        lines.append(f"{result.bins.label(b):<16}" + "".join(_cell(rows[a.name][b]).rjust(width) for a in result.routes))
    cost = cost_summary(result, source)
    lines += [
        "",
        f"cost: {cost['native_step_equivalents']:.1f} native-step equivalents (budget {s.budget:g}); the full map on the same grids "
        f"({cost['full_map']}): {cost['full_map_native_step_equivalents']:.0f}, i.e. {100 * cost['fraction_of_full_map']:.1f} %",
    ]
    lines += [result.spot_text(), scope_text(result.provenance.get("backend", {}))]
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)


register(
    "certify",
    "certify (route, σ) windows sequentially with paired noise at a fraction of map's cost; write windows TOML and certify.json",
    add_arguments,
    run,
)
