"""``python -m downscale_plugin map``: measure the (route, σ) gradient map and write the windows.

    python -m downscale_plugin map --lab [--quick] --ratios 0.875,0.75,0.5 --draws 8 --images 8 \\
        --margin 0.05 --out map_out
    python -m downscale_plugin map --from_json map_out/map.json --margin 0.1 --out map_out_eps0.1

Every input is checked before the model is built (exit 2 listing every problem). Outputs in
``--out``: ``windows.toml`` (a plugin TOML: ``downscale_config=.../windows.toml``), ``map.csv``,
``map.json`` (rows, per-image cells, provenance), ``map.png``; the table is printed as well.
``--from_json`` re-derives verdicts and windows at another margin/level from a saved map: the margin
is a policy choice, the gradients are the expensive part, and they are never recomputed.

``--policies``/``--positions`` add, per ratio, one latent arm per (σ policy, positions) pair
(``latent_0.75@res_shift``, ``latent_0.75+interp``, ...); ``--pixel`` adds a pixel-then-encode arm
per ratio, ``--reenc`` the re-encode control. The plugin runs one ``sigma_policy``/``positions``
setting for every routed step, so each measured setting gets its own windows file
(``windows.toml`` for keep/plain, ``windows@res_shift+interp.toml`` ... setting both keys); pixel
and reenc arms are comparisons, never routes.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ..cli import fail, register
from .arms import build_arms
from .bins import DEFAULT_BINS, parse_bins
from .estimator import MapInputError, MapResult, MapSettings, check_inputs, run_map, settings_problems
from .lab_backend import LabBackend, LabMapConfig, describe_config, lab_problems
from .report import console_table, write_outputs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--lab", action="store_true", help="measure on the built-in lab DiT (the only backend so far)")
    source.add_argument("--from_json", metavar="MAP_JSON", help="re-derive verdicts/windows from a saved map.json (no gradients)")
    parser.add_argument(
        "--quick", action="store_true", help="use the quick (seconds) lab pretrain instead of the default (minutes, cached)"
    )
    parser.add_argument("--ratios", default="0.875,0.75,0.5", help="route linear ratios, comma-separated (default 0.875,0.75,0.5)")
    parser.add_argument(
        "--policies", default="keep", help="σ policies of the latent arms, comma-separated: keep,res_shift,snr_match (default keep)"
    )
    parser.add_argument(
        "--positions", default="plain", help="positions of the latent arms, comma-separated: plain,interpolate (default plain)"
    )
    parser.add_argument("--pixel", action="store_true", help="add a pixel-downscale-then-encode arm per ratio (lab: true crop pixels)")
    parser.add_argument("--reenc", action="store_true", help="add the re-encode control (decode, encode at native size)")
    parser.add_argument(
        "--bins", default=DEFAULT_BINS, help=f"σ bins: 'LO,HI,K:...' segments or an edge list over [0, 1] (default {DEFAULT_BINS})"
    )
    parser.add_argument("--no_endpoint", action="store_true", help="no σ = 1 endpoint bin (then no window is open at the top)")
    parser.add_argument(
        "--draws",
        type=int,
        default=8,
        help="D: noise draws per arm and bin, even; >= 8 advised: halves of 1-2 draws make the debiasing unstable (default 8)",
    )
    parser.add_argument("--images", type=int, default=8, help="N: probe images (default 8)")
    parser.add_argument("--margin", type=float, default=0.05, help="ε: a bin is safe when its upper bound < ε (default 0.05)")
    parser.add_argument("--alpha", type=float, default=0.05, help="one-sided level of the upper bound (default 0.05: 95%%)")
    parser.add_argument("--simultaneous", action="store_true", help="Bonferroni over each route's bins (the anchor's window rule)")
    parser.add_argument("--native_size", default="64x64", help="probe latent HxW in lab cells, 4 px each (default 64x64: 1024 tokens)")
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank (default 4)")
    parser.add_argument("--warm_steps", type=int, default=30, help="native warm-up steps of the adapter (default 30; 0: peft init, B = 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", default="map_out", help="output directory (default map_out)")
    parser.add_argument("--no_progress", action="store_true")


def _native_size(text: str) -> tuple[int, int]:
    h, sep, w = text.lower().partition("x")
    if not sep or not h.isdigit() or not w.isdigit():
        raise ValueError(f"native_size: {text!r} must be HxW in latent cells, e.g. 64x64")
    return int(h), int(w)


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def command_line(args: argparse.Namespace) -> str:
    """The canonical command that reproduces this run (every setting spelled out)."""
    parts = ["python -m downscale_plugin map --lab"]
    parts += ["--quick"] if args.quick else []
    parts += [f"--ratios {args.ratios}", f"--policies {args.policies}", f"--positions {args.positions}"]
    parts += ["--pixel"] if args.pixel else []
    parts += ["--reenc"] if args.reenc else []
    parts += [f"--bins {args.bins}", f"--draws {args.draws}", f"--images {args.images}"]
    parts += [f"--margin {args.margin:g}", f"--alpha {args.alpha:g}", f"--native_size {args.native_size}", f"--rank {args.rank}"]
    parts += [f"--warm_steps {args.warm_steps}", f"--seed {args.seed}", f"--out {args.out}"]
    parts += ["--no_endpoint"] if args.no_endpoint else []
    parts += ["--simultaneous"] if args.simultaneous else []
    return " ".join(parts)


# Flags that only mean something when gradients are measured; --from_json refuses them.
MEASUREMENT_FLAGS = ("quick", "ratios", "policies", "positions", "pixel", "reenc", "bins", "no_endpoint", "draws", "images",
                     "native_size", "rank", "warm_steps", "seed")  # fmt: skip


def rederive(args: argparse.Namespace, parser_defaults: dict) -> int:
    """``--from_json``: load a saved map, re-derive at ``--margin``/``--alpha``/``--simultaneous``."""
    problems = [f"--{k}: a measurement flag; with --from_json only --margin, --alpha, --simultaneous and --out apply"
                for k in MEASUREMENT_FLAGS if getattr(args, k) != parser_defaults[k]]  # fmt: skip
    settings = MapSettings(margin=args.margin, alpha=args.alpha)
    problems += [p for p in settings_problems(settings) if p.startswith(("margin", "alpha"))]
    try:
        with open(args.from_json) as fh:
            blob = json.load(fh)
    except (OSError, ValueError) as err:
        problems.append(f"from_json: cannot read {args.from_json}: {err}")
    if problems:
        return fail(problems)
    result = MapResult.from_json(blob, margin=args.margin, alpha=args.alpha, simultaneous=args.simultaneous)
    command = f"python -m downscale_plugin map --from_json {args.from_json} --margin {args.margin:g} --alpha {args.alpha:g}"
    command += " --simultaneous" if args.simultaneous else ""
    result.provenance["rederived_by"] = command
    paths = write_outputs(result, args.out, f"{result.provenance.get('command', '?')}; re-derived: {command}")
    print(console_table(result))
    for path in paths.values():
        print(f"wrote {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.from_json:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return rederive(args, vars(parser.parse_args(["--lab"])))
    problems: list[str] = []
    arms = bins = lab_cfg = None
    try:
        ratios = [float(r) for r in args.ratios.split(",") if r.strip()]
    except ValueError as err:
        problems.append(f"ratios: {args.ratios!r}: {err}")
    else:
        try:
            arms = build_arms(ratios, args.pixel, args.reenc, _names(args.policies), _names(args.positions))
        except ValueError as err:
            problems.append(str(err))
    try:
        bins = parse_bins(args.bins, endpoint=not args.no_endpoint)
    except ValueError as err:
        problems.append(str(err))
    settings = MapSettings(
        margin=args.margin, draws=args.draws, images=args.images, seed=args.seed, alpha=args.alpha, simultaneous=args.simultaneous
    )
    if arms is not None and bins is not None:
        try:
            check_inputs(arms, bins, settings)
        except MapInputError as err:
            problems += err.problems
    else:
        problems += settings_problems(settings)
    try:
        lab_cfg = LabMapConfig(
            quick=args.quick, native_hw=_native_size(args.native_size), rank=args.rank, warm_steps=args.warm_steps, seed=args.seed
        )
        problems += lab_problems(lab_cfg, arms or ())
    except ValueError as err:
        problems.append(str(err))
    if args.threads is not None and args.threads < 1:
        problems.append(f"threads: {args.threads} must be >= 1")
    if problems:
        return fail(problems)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = command_line(args)
    t0 = time.perf_counter()
    backend = LabBackend(lab_cfg, images=args.images, progress=not args.no_progress)
    setup_s = time.perf_counter() - t0
    result = run_map(
        backend, arms, bins, settings, progress=not args.no_progress, provenance={"command": command, "lab": describe_config(lab_cfg)}
    )
    result.provenance["setup_s"] = round(setup_s, 2)
    paths = write_outputs(result, args.out, command)
    print(console_table(result))
    print(
        f"\nsetup (model, adapter warm-up) {setup_s:.1f} s, map {result.provenance['wall_s']:.1f} s, torch threads {torch.get_num_threads()}"
    )
    for path in paths.values():
        print(f"wrote {path}")
    return 0


register("map", "measure the (route, σ) gradient map on the lab DiT; write windows TOML, CSV/JSON and a heatmap", add_arguments, run)
