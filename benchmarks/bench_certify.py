"""The certifier's lab study (docs/FIDELITY.md §9): cost and agreement with the full map, and the
variance reduction of paired noise, on the map's own model, adapter and probes.

    python benchmarks/bench_certify.py --seeds 0,1,2 --threads 1 --variance_seeds 16 --unpaired --out docs/fidelity/certify
    python benchmarks/bench_certify.py --seeds 3,4,5,6,7,8,9 --threads 1 --out docs/fidelity/certify/more_seeds
    python benchmarks/bench_certify.py --map_check --out docs/fidelity/certify   # and --out .../more_seeds

One lab backend (model seed 0, 16 probes at 64×64: the backend of docs/fidelity/lab_n64_d8_n16) serves
every certifier seed, so the full map's verdicts (``--maps``: 0.875 and 0.75 from the exact-filter map,
0.5 from the pooled map, which is the same filter at an integer ratio) are the reference for each:
false-safe = certified safe where the full map is not; missed = the other way round. The variance
study (``--variance_seeds K``) redraws the noise K times per (image, bin) cell and compares the SD of
the per-image estimate with the route's noise paired vs drawn independently (same native draws, same σ).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from downscale_plugin.bins import parse_bins  # noqa: E402
from downscale_plugin.hosts.lab.certify import lab_sigma_mass  # noqa: E402
from downscale_plugin.hosts.lab.map_backend import LabBackend, LabMapConfig  # noqa: E402
from downscale_plugin.mapping.arms import latent_arm  # noqa: E402
from downscale_plugin.mapping.certify import BackendDraws, CertifySettings, run_certify  # noqa: E402
from downscale_plugin.mapping.certify_cli import cost_summary, write_outputs  # noqa: E402
from downscale_plugin.mapping.sequential import PairedSums  # noqa: E402

MAPS = "docs/fidelity/lab_n64_d8_n16/map.json:latent_0.875,latent_0.75;docs/fidelity/lab_n64_d8_n16_pool/map.json:latent_0.5"


def full_map_verdicts(spec: str, margin: float) -> dict[tuple[str, int], bool]:
    from downscale_plugin.mapping.estimator import MapResult

    out = {}
    for part in spec.split(";"):
        path, arms = part.split(":")
        with open(path) as fh:
            result = MapResult.from_json(json.load(fh), margin=margin)
        out.update({(r.arm, r.bin): r.safe for r in result.rows if r.arm in arms.split(",")})
    return out


def agreement(result, reference: dict[tuple[str, int], bool]) -> dict:
    false_safe, missed, untested_endpoint = [], [], []
    for route in result.routes:
        for t in result.rows(route):
            ref = reference[route.name, t.bin]
            if t.safe and not ref:
                false_safe.append(f"{route.name} {result.bins.label(t.bin)}")
            elif ref and not t.safe:
                (untested_endpoint if result.bins.is_endpoint(t.bin) else missed).append(
                    f"{route.name} {result.bins.label(t.bin)} ({t.verdict})"
                )
    return {"false_safe": false_safe, "missed": missed, "missed_sigma1_no_mass": untested_endpoint}


def test_rows(result) -> list[dict]:
    """Every test the certifier ran: verdict, bound at its last reading, images used and cost."""
    rows = []
    for t in result.tests:
        b = t.bound
        rows.append({"route": t.route, "bin": result.bins.label(t.bin), "spot_check": t.spot, "verdict": t.verdict, "n": len(t.values),
                     "mean": None if b is None else round(b.mean, 5), "upper": None if b is None else round(b.upper, 5),
                     "cost": round(t.cost, 3)})  # fmt: skip
    return rows


def map_per_image(spec: str) -> dict[tuple[str, int], list[float]]:
    """The full map's per-image debiased excess (``estimator.excess``), by (route, bin), images in order."""
    from downscale_plugin.mapping.estimator import Cell, excess

    out: dict[tuple[str, int], list[float]] = {}
    for part in spec.split(";"):
        path, arms = part.split(":")
        with open(path) as fh:
            cells = sorted(json.load(fh)["cells"], key=lambda c: (c["bin"], c["image"]))
        for c in cells:
            cell = Cell(c["image"], c["bin"], c["half_cos"], c["cos"], c["norm"])
            for arm in arms.split(","):
                out.setdefault((arm, c["bin"]), []).append(excess(cell, arm))
    return out


def map_check(out: str, spec: str, margin: float) -> dict:
    """Why the certifier and the full map disagree, from the map's own per-image values: for each
    certified test, the map's mean on the certifier's images and on all probes. (A bin is read safe only
    at the last look, on every probe image, so an early look has no false-safe rate to measure.)"""
    per_image = map_per_image(spec)
    reference = full_map_verdicts(spec, margin)
    with open(os.path.join(out, "study.json")) as fh:
        study = json.load(fh)
    tests = []
    for run in study["runs"]:
        with open(os.path.join(out, f"seed{run['seed']}{'' if run['paired'] else '_unpaired'}", "certify.json")) as fh:
            blob = json.load(fh)
        for row in blob["bins"]:
            if row["verdict"] in (None, "untested"):
                continue
            values = per_image[row["route"], row["bin"]]
            images = row["evidence"]["images"]
            tests.append({"seed": run["seed"], "paired": run["paired"], "route": row["route"], "bin": row["label"], "verdict": row["verdict"],
                          "spot_check": row["spot_check"], "full_map_safe": reference[row["route"], row["bin"]], "n": len(images),
                          "certify_mean": float(np.mean(row["evidence"]["excess"])) if images else None,
                          "map_mean_same_images": float(np.mean([values[i] for i in images])) if images else None,
                          "map_mean_all": float(np.mean(values)),
                          "corr": float(np.corrcoef(row["evidence"]["excess"], [values[i] for i in images])[0, 1]) if len(images) > 2 else None})  # fmt: skip
    return {"tests": tests, "note": map_check.__doc__}


def variance_study(backend, bins, cells: list[tuple[int, int]], seeds: int, draws: int) -> dict:
    """Per (image, bin): SD over noise seeds of each route's per-image estimate, paired vs independent noise."""
    routes = [latent_arm(r) for r in (0.875, 0.75, 0.5)]
    rows = []
    for image, b in cells:
        values = {(a.name, p): [] for a in routes for p in (True, False)}
        for seed in range(seeds):
            for paired in (True, False):  # the same seed: the same native draws, only the route's noise differs
                sums = PairedSums()
                BackendDraws(backend, bins, draws, 1000 + seed, paired=paired).draw_pairs(image, b, routes, sums.add)
                for a in routes:
                    values[a.name, paired].append(sums.excess(a.name))
        for a in routes:
            sp, si = float(np.std(values[a.name, True], ddof=1)), float(np.std(values[a.name, False], ddof=1))
            rows.append({"image": image, "bin": bins.label(b), "route": a.name, "mean_paired": float(np.mean(values[a.name, True])),
                         "mean_independent": float(np.mean(values[a.name, False])), "sd_paired": sp, "sd_independent": si,
                         "variance_ratio": (sp / si) ** 2 if si > 0 else None})  # fmt: skip
        print(json.dumps(rows[-3:]), flush=True)
    return {"cells": rows, "seeds": seeds, "draws": draws}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--budget", type=float, default=300.0)
    parser.add_argument("--draws", type=int, default=4)
    parser.add_argument("--margin", type=float, default=0.05)
    parser.add_argument("--maps", default=MAPS)
    parser.add_argument("--variance_seeds", type=int, default=0, help="noise seeds per cell of the variance study (0: skip it)")
    parser.add_argument("--variance_images", default="0,5", help="probe images of the variance study's cells")
    parser.add_argument("--variance_bins", default="13,11,9", help="bin indices of the variance study's cells (13: (0.975, 1])")
    parser.add_argument("--unpaired", action="store_true", help="also certify with independent noise, per seed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="docs/fidelity/certify")
    parser.add_argument("--map_check", action="store_true", help="only compare a finished study (--out) with the maps' per-image values")
    args = parser.parse_args()
    if args.map_check:
        with open(os.path.join(args.out, "map_check.json"), "w") as fh:
            json.dump(map_check(args.out, args.maps, args.margin), fh, indent=1)
        print(f"wrote {os.path.join(args.out, 'map_check.json')}")
        return 0
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    backend = LabBackend(LabMapConfig(native_hw=(64, 64), seed=0), images=16, progress=False)
    setup_s = time.perf_counter() - t0
    bins = parse_bins("0,0.1,4:0.1,0.9,6:0.9,1,4")
    mass, mass_text = lab_sigma_mass(backend)
    reference = full_map_verdicts(args.maps, args.margin)
    routes = [latent_arm(r) for r in (0.875, 0.75, 0.5)]
    summary = {"setup_s": round(setup_s, 1), "sigma_sampler": mass_text, "torch_threads": torch.get_num_threads(),
               "command": "python " + " ".join(sys.argv), "reference_maps": args.maps,
               "reference_safe": sorted(f"{a} {bins.label(b)}" for (a, b), ok in reference.items() if ok), "runs": []}  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    for seed in [int(s) for s in args.seeds.split(",") if s.strip()]:
        for paired in (True, False) if args.unpaired else (True,):
            settings = CertifySettings(margin=args.margin, draws=args.draws, budget=args.budget, seed=seed)
            source = BackendDraws(backend, bins, args.draws, seed, paired=paired)
            command = f"python benchmarks/bench_certify.py --seeds {seed} --budget {args.budget:g} --draws {args.draws}" + (
                "" if paired else " --unpaired"
            )
            result = run_certify(source, routes, bins, settings, mass, provenance={"command": command, "backend": backend.describe()})
            result.provenance.update(sigma_sampler=mass_text, paired=paired)
            out = os.path.join(args.out, f"seed{seed}{'' if paired else '_unpaired'}")
            write_outputs(result, source, out, command)
            run = {"seed": seed, "paired": paired, "wall_s": result.provenance["wall_s"], "cost": cost_summary(result, source),
                   "safe": [f"{t.route} {bins.label(t.bin)}" for t in result.tests if t.safe], **agreement(result, reference),
                   "spot_check_violations": [f"{t.route} {bins.label(t.bin)}" for t in result.tests if t.spot and t.safe],
                   "notes": list(result.notes), "tests": test_rows(result)}  # fmt: skip
            summary["runs"].append(run)
            print(json.dumps(run), flush=True)
            save(summary, args.out)  # after every run: an interrupted study keeps what finished
    if args.variance_seeds:
        cells = [(int(i), int(b)) for i in args.variance_images.split(",") for b in args.variance_bins.split(",")]
        summary["variance"] = variance_study(backend, bins, cells, args.variance_seeds, args.draws)
    save(summary, args.out)
    print(f"wrote {os.path.join(args.out, 'study.json')}")
    return 0


def save(summary: dict, out: str) -> None:
    with open(os.path.join(out, "study.json"), "w") as fh:
        json.dump(summary, fh, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
