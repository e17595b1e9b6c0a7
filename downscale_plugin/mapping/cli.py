"""``python -m downscale_plugin map``: measure the (route, σ) gradient map and write the windows.

    python -m downscale_plugin map --lab [--quick] --ratios 0.875,0.75,0.5 --draws 8 --images 8 \\
        --margin 0.05 --out map_out
    python -m downscale_plugin map --from_json map_out/map.json --margin 0.1 --out map_out_eps0.1

A measurement runs on a backend a host package registers (:func:`register_source`; the lab's is
``--lab``). Every input is checked before the model is built (exit 2 listing every problem).
Outputs in ``--out``: ``windows.toml`` (a plugin TOML: ``downscale_config=.../windows.toml``),
``map.csv``, ``map.json`` (rows, per-image cells, provenance), ``map.png``; the table is printed as
well. ``--from_json`` re-derives verdicts and windows at another margin/level from a saved map: the
margin is a policy choice, the gradients are the expensive part, and they are never recomputed.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..bins import DEFAULT_BINS, parse_bins
from ..certify_config import DEFAULT_MARGIN
from ..cli import fail, register
from ..provenance import code_revision
from .arms import Arm, MapBackend, build_arms
from .journal import JOURNAL, CellJournal, JournalError


@dataclass(frozen=True)
class MapSource:
    """A backend ``map`` can measure on: ``--<flag>`` plus its own options.

    ``prepare(args, arms)`` → (problems, a factory building the backend, its provenance, the
    command-line words that reproduce it); nothing is built before every problem is known.
    """

    flag: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    options: tuple[str, ...]  # its option names (dest), refused with --from_json
    prepare: Callable[[argparse.Namespace, Sequence[Arm]], tuple[list[str], Callable[[], MapBackend], dict[str, Any], list[str]]]


SOURCES: dict[str, MapSource] = {}


def register_source(source: MapSource) -> None:
    if source.flag in SOURCES:
        raise ValueError(f"map source --{source.flag} is already registered")
    SOURCES[source.flag] = source


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group(required=True)
    for source in SOURCES.values():
        group.add_argument(f"--{source.flag}", action="store_true", help=source.help)
    group.add_argument("--from_json", metavar="MAP_JSON", help="re-derive verdicts/windows from a saved map.json (no gradients)")
    parser.add_argument("--ratios", default="0.875,0.75,0.5", help="route linear ratios, comma-separated (default 0.875,0.75,0.5)")
    parser.add_argument(
        "--policies", default="keep", help="σ policies of the latent arms, comma-separated: keep,res_shift,snr_match (default keep)"
    )
    parser.add_argument(
        "--positions", default="plain", help="positions of the latent arms, comma-separated: plain,interpolate (default plain)"
    )
    parser.add_argument(
        "--attention",
        default="plain",
        help="attention of the latent arms, comma-separated: plain,proportional (default plain; proportional: the lab only)",
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
    parser.add_argument(
        "--margin", type=float, default=DEFAULT_MARGIN, help=f"ε: a bin is safe when its upper bound < ε (default {DEFAULT_MARGIN:g})"
    )
    parser.add_argument("--alpha", type=float, default=0.05, help="family-wise false-safe level over every arm and bin (default 0.05)")
    parser.add_argument(
        "--simultaneous",
        action="store_true",
        help="Bonferroni over every (arm, bin) instead of fallback chains from both ends (both family-wise)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", default="map_out", help="output directory (default map_out)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help=f"keep the cells of an earlier run's {JOURNAL} in --out (same settings and code) and measure the rest",
    )
    parser.add_argument("--no_progress", action="store_true")
    for source in SOURCES.values():
        source.add_arguments(parser.add_argument_group(f"--{source.flag}"))


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def command_line(args: argparse.Namespace, source: MapSource, source_words: Sequence[str]) -> str:
    """The canonical command that reproduces this run (every setting spelled out)."""
    parts = [f"python -m downscale_plugin map --{source.flag}", *source_words]
    parts += [f"--ratios {args.ratios}", f"--policies {args.policies}", f"--positions {args.positions}", f"--attention {args.attention}"]
    parts += ["--pixel"] if args.pixel else []
    parts += ["--reenc"] if args.reenc else []
    parts += [f"--bins {args.bins}", f"--draws {args.draws}", f"--images {args.images}"]
    parts += [f"--margin {args.margin:g}", f"--alpha {args.alpha:g}", f"--seed {args.seed}", f"--out {args.out}"]
    parts += ["--no_endpoint"] if args.no_endpoint else []
    parts += ["--simultaneous"] if args.simultaneous else []
    return " ".join(parts)


# Flags that only mean something when gradients are measured; --from_json refuses them (and every source's options).
MEASUREMENT_FLAGS = (
    "ratios",
    "policies",
    "positions",
    "attention",
    "pixel",
    "reenc",
    "bins",
    "no_endpoint",
    "draws",
    "images",
    "seed",
    "resume",
)


def measurement_key(args: argparse.Namespace, source: MapSource, source_words: Sequence[str]) -> dict[str, Any]:
    """What a map's cells depend on: a journal written under another key is not resumed (``journal.py``)."""
    key = {flag: getattr(args, flag) for flag in MEASUREMENT_FLAGS if flag != "resume"}
    return {"source": source.flag, "source_words": list(source_words), **key, "code_revision": code_revision()}


def rederive(args: argparse.Namespace, parser_defaults: dict) -> int:
    """``--from_json``: load a saved map, re-derive at ``--margin``/``--alpha``/``--simultaneous``."""
    from .estimator import MapResult, MapSettings, settings_problems
    from .report import console_table, write_outputs

    flags = (*MEASUREMENT_FLAGS, *(option for source in SOURCES.values() for option in source.options))
    problems = [f"--{k}: a measurement flag; with --from_json only --margin, --alpha, --simultaneous and --out apply"
                for k in flags if getattr(args, k) != parser_defaults[k]]  # fmt: skip
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
        return rederive(args, vars(parser.parse_args(["--from_json", args.from_json])))
    from .estimator import MapInputError, MapSettings, check_inputs, run_map, settings_problems
    from .report import console_table, write_outputs

    source = next(s for s in SOURCES.values() if getattr(args, s.flag))
    problems: list[str] = []
    arms = bins = None
    try:
        ratios = [float(r) for r in args.ratios.split(",") if r.strip()]
    except ValueError as err:
        problems.append(f"ratios: {args.ratios!r}: {err}")
    else:
        try:
            arms = build_arms(ratios, args.pixel, args.reenc, _names(args.policies), _names(args.positions), _names(args.attention))
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
    source_problems, make_backend, provenance, source_words = source.prepare(args, arms or ())
    problems += source_problems
    if args.threads is not None and args.threads < 1:
        problems.append(f"threads: {args.threads} must be >= 1")
    journal = CellJournal(args.out, measurement_key(args, source, source_words))
    done: list = []
    if args.resume and journal.exists():
        try:
            done = journal.read()
        except JournalError as err:
            problems.append(str(err))
    if problems:
        return fail(problems)
    if args.resume:
        print(f"resume: {len(done)} cells from {journal.path}" if journal.exists() else f"resume: no {journal.path}; measuring every cell")
    if args.threads:
        torch.set_num_threads(args.threads)
    command = command_line(args, source, source_words)
    t0 = time.perf_counter()
    backend = make_backend()
    setup_s = time.perf_counter() - t0
    journal.start(done)
    clock = [time.perf_counter()]

    def record(cell: Any) -> None:
        now = time.perf_counter()
        journal.append(cell, now - clock[0])
        clock[0] = now

    kept = [cell for cell, _ in done]
    result = run_map(backend, arms, bins, settings, not args.no_progress, {"command": command, **provenance}, kept, record)
    result.provenance["setup_s"] = round(setup_s, 2)
    if done:
        result.provenance["resumed"] = {"cells": len(done), "their_seconds": round(sum(s for _, s in done), 2)}
    paths = write_outputs(result, args.out, command)
    journal.remove()
    print(console_table(result))
    print(
        f"\nsetup (model, adapter warm-up) {setup_s:.1f} s, map {result.provenance['wall_s']:.1f} s, torch threads {torch.get_num_threads()}"
    )
    for path in paths.values():
        print(f"wrote {path}")
    return 0


register("map", "measure the (route, σ) gradient map (e.g. on the lab DiT); write windows TOML, CSV/JSON and a heatmap", add_arguments, run)
