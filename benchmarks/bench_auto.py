"""``mode = "auto"`` on the lab, end to end (docs/FIDELITY.md §9.4): seeds × {native, auto}, side by side.

    python benchmarks/bench_auto.py --seeds 0,1,2 --steps 300 --budget 0.5 --margin 0.1 --threads 1 --out docs/fidelity/auto

Each seed trains the lab LoRA twice from the same init and data order on the pretrained lab DiT
(the lab trainer's default σ sampler, sd-scripts' Flux recipe ``shift`` 3.1582; ``--sampling sigmoid``:
the demo's logit-normal, which puts almost no mass above σ 0.95): natively, and with ``mode = "auto"`` at the seed paper's
routes (ratios 0.875 and 0.75) over the default bins. Printed per seed: wall seconds of both
(the auto run's include its certification, which runs inside its 16th step), the certification's
cost in native-step equivalents and seconds, the routed share, the realized FLOP saving, the net
saving, and both adapters' native-grid validation loss: against the same seed's native run, and with
``--val_seed`` (one validation set for all seeds) against the native seeds' spread (the lottery a
routed run has to stay inside; without it each seed validates on its own crops).

``--recheck W1,W2`` measures instead whether the windows move as the adapter trains: the same
certification (same probes, seed, budget) on the lab map backend with the adapter warm-trained W1 and
W2 native steps, bin by bin.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from downscale_plugin.bins import DEFAULT_BINS, parse_bins  # noqa: E402
from downscale_plugin.config import load_config  # noqa: E402

RATIOS = [0.875, 0.75]  # the seed paper's stacked routes (1024 → 896, 1024 → 768)


def end_to_end(args: argparse.Namespace) -> dict:
    from downscale_plugin.hosts.lab.adapter import LabPlugin
    from downscale_plugin.hosts.lab.demo import DEMO_SAMPLING

    sampling = DEMO_SAMPLING if args.sampling == "sigmoid" else {}
    from downscale_plugin.lab.data import LabData, LabDataConfig
    from downscale_plugin.lab.model import LabModelConfig
    from downscale_plugin.lab.pretrain import load_or_pretrain
    from downscale_plugin.lab.trainer import native_validation_loss, train_lora

    model_cfg = LabModelConfig()
    data = LabData(LabDataConfig(latent_channels=model_cfg.latent_channels))
    model = load_or_pretrain(model_cfg, quick=False, progress=False, data=data)
    rows = []
    for seed in args.seeds:
        val_seed = seed if args.val_seed is None else args.val_seed
        val_set = data.validation_set(per_bucket=2, seed=val_seed)
        common = dict(
            model=model, data=data, steps=args.steps, lr=2e-3, rank=8, seed=seed, args_overrides=sampling,
            validate=lambda deltas, v=val_set, s=val_seed: native_validation_loss(model, deltas, v, s),
        )  # fmt: skip
        native = train_lora(**common)
        out = os.path.join(args.out, f"seed{seed}")
        table = {
            "mode": "auto", "arch": "flux", "map_out": out, "map_ratios": RATIOS, "map_bins": args.bins,
            "map_margin": args.margin, "certify_budget": args.budget, "certify_draws": args.draws, "certify_unpaid": args.unpaid,
        }  # fmt: skip
        plugin = LabPlugin.for_lab(load_config(table=table), model_cfg, data)
        auto = train_lora(**common, hook_installer=plugin.installer)
        done = plugin.auto.done
        acc = plugin.accounting
        passes = args.steps  # batch 1, no accumulation: single-sample native passes of the run
        spent = done.result.spent if done else 0.0
        row = {
            "seed": seed,
            "native_wall_s": round(native.wall_time, 2),
            "auto_wall_s": round(auto.wall_time, 2),
            "wall_saving": round(1.0 - auto.wall_time / native.wall_time, 4),
            "certify_s": round(done.seconds, 2) if done else 0.0,
            "certify_native_step_equivalents": round(spent, 2),
            "certify_share_of_run": round(spent / passes, 4),
            "safe_bins": [f"{t.route} {t.lo:g}-{t.hi:g}" for t in done.result.tests if t.safe] if done else [],
            "routes": [f"{r.label} {r.window_text()}" for r in plugin.cfg.routes],
            "routed_share": round(acc.demote_fraction(), 4),
            "flop_saving": round(acc.flop_saving() or 0.0, 4),
            "net_flop_saving": round((acc.flop_saving() or 0.0) - spent / passes, 4),
            "val_native": round(native.val_curve[-1][2], 5),
            "val_auto": round(auto.val_curve[-1][2], 5),
            "val_base": round(native.val_curve[0][2], 5),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    natives = [r["val_native"] for r in rows]
    summary = {
        "validation": "one set for every seed"
        if args.val_seed is not None
        else "each seed's own set: compare auto with its seed's native run",
        "native_val_mean": statistics.fmean(natives),
        "native_val_range": [min(natives), max(natives)],
        "auto_val_mean": statistics.fmean(r["val_auto"] for r in rows),
        "auto_inside_native_range": [min(natives) <= r["val_auto"] <= max(natives) for r in rows],
        "wall_saving_mean": statistics.fmean(r["wall_saving"] for r in rows),
        "net_flop_saving_mean": statistics.fmean(r["net_flop_saving"] for r in rows),
    }
    return {"rows": rows, "summary": summary}


def recheck(args: argparse.Namespace) -> dict:
    """The same certification at two adapter states: do the verdicts move as the adapter trains?"""
    from downscale_plugin.hosts.lab.certify import lab_sigma_mass
    from downscale_plugin.hosts.lab.map_backend import LabBackend, LabMapConfig
    from downscale_plugin.mapping.arms import latent_arm
    from downscale_plugin.mapping.certify import BackendDraws, CertifySettings, run_certify

    bins = parse_bins(args.bins)
    routes = [latent_arm(r) for r in RATIOS]
    out = {}
    for warm in args.recheck:
        backend = LabBackend(LabMapConfig(warm_steps=warm, seed=0), images=16, progress=False)
        mass, _ = lab_sigma_mass(backend)
        settings = CertifySettings(margin=args.margin, draws=args.draws, budget=args.recheck_budget, seed=0)
        t0 = time.perf_counter()
        result = run_certify(BackendDraws(backend, bins, settings.draws, settings.seed), routes, bins, settings, mass)
        out[str(warm)] = {
            "wall_s": round(time.perf_counter() - t0, 1),
            "spent": round(result.spent, 1),
            "bins": {
                f"{t.route} {bins.label(t.bin)}": {"verdict": t.verdict, "mean": t.bound.mean if t.bound else None, "n": len(t.values)}
                for t in result.tests
            },
        }
        print(warm, json.dumps(out[str(warm)]), flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--budget", type=float, default=0.5, help="certify_budget (fraction of the run's native compute)")
    parser.add_argument("--margin", type=float, default=0.1)
    parser.add_argument("--draws", type=int, default=4)
    parser.add_argument(
        "--unpaid", default="skip", help='certify_unpaid: "skip" (as a user\'s run) or "buy" (certify although it cannot pay)'
    )
    parser.add_argument(
        "--sampling", choices=("shift", "sigmoid"), default="shift", help="the lab trainer's σ sampler (default shift 3.1582)"
    )
    parser.add_argument("--bins", default=DEFAULT_BINS)
    parser.add_argument(
        "--val_seed", type=int, help="one validation set for every seed (default: each seed's own; a cross-seed lottery needs one)"
    )
    parser.add_argument("--recheck", type=lambda s: [int(x) for x in s.split(",")], help="adapter warm-up steps to certify at, e.g. 30,300")
    parser.add_argument("--recheck_budget", type=float, default=300.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="docs/fidelity/auto")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    blob = {"command": "python benchmarks/bench_auto.py " + " ".join(sys.argv[1:]), "torch_threads": args.threads}
    if args.recheck:
        blob["recheck"] = recheck(args)
        name = "recheck.json"
    else:
        blob.update(end_to_end(args))
        name = "bench_auto.json"
        print(json.dumps(blob["summary"], indent=1))
    blob["wall_s"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(args.out, name), "w") as fh:
        json.dump(blob, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
