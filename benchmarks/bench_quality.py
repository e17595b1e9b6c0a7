"""Quality dose-response on the lab DiT: the same adapter, sooner, measured with twins.

Per seed, every arm fine-tunes the pretrained lab DiT's LoRA as a twin of the native run
(``hosts/lab/twin.py``): same init, data order, σ draws and noise (a routed step gets the paired
transform of the native draw), so arm − native isolates what routing does. Each run logs the
native-grid validation loss (one held-out set, fixed σ grid and noise, for every run) along the way
against its cumulative training FLOPs (the project's FLOP model, ``flops.FlopModel`` with the lab
DiT's shape) and its process CPU seconds (one torch thread: the wall proxy; other jobs on a shared
machine do not inflate it). Routed arms keep training past the native step count until they have
spent at least the native twin's FLOPs. Read-offs, per arm, as paired arm − native differences
(positive = worse) with a 95 % t interval over seeds (``hosts/lab/quality.py``):

- equal steps: at the native run's step count;
- equal compute: linearly interpolated on the run's (FLOPs, loss) curve at the native twin's FLOPs.

Arms: ``native``; the lab map's windows at ε = 0.05, 0.1, 0.2, 0.3 (``docs/fidelity/quality/
windows_eps*.toml``, re-derived from ``docs/fidelity/lab_n64_d8_n16/map.json``); ``seed_recipe`` (the
demo's router, the seed paper's stacked routes); the negative controls ``all0.75`` and ``all0.5``
(every step routed at that ratio). One σ sampler for all arms: the lab trainer's default, sd-scripts'
recommended Flux recipe (``shift``, discrete_flow_shift 3.1582).

Resumable: one JSON per (arm, seed) under ``OUT/runs``; a run whose JSON exists (with the same
settings) is skipped. The study (writes OUT/summary.json, OUT/report.md, OUT/quality.png):

    python benchmarks/bench_quality.py --jobs 2 --out docs/fidelity/quality

``--report`` only aggregates what is there. A smoke run (~1 min): ``--quick --seeds 0 --steps 4
--arms native,all0.5 --out /tmp/q_smoke``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WINDOWS = ROOT / "docs" / "fidelity" / "quality"
EPS_ARMS = ("eps0.05", "eps0.1", "eps0.2", "eps0.3")
ARMS = ("native", *EPS_ARMS, "seed_recipe", "all0.75", "all0.5")
DEFAULT_ARMS = tuple(a for a in ARMS if a != "eps0.3")  # eps0.3: only worth its compute if eps0.2 costs nothing
CONTROLS = ("all0.75", "all0.5")
FLOP_FRACTIONS = tuple(k / 8 for k in range(9))  # the picture's common x grid, in native-run FLOPs
EXTRA = 1.1  # a routed run's steps beyond its planned equal-compute point (the realized saving scatters)


def arm_table(name: str, native_size: int = 64) -> dict[str, Any] | None:
    """The plugin table of an arm (None: native) for lab buckets of ``native_size`` latent cells a side
    (64: the lab's five buckets; 32: one 128 px square bucket, windows from the 32×32 lab map)."""
    from downscale_plugin.config import read_plugin_toml
    from downscale_plugin.hosts.lab.demo import DEMO_ROUTES

    if name == "native":
        return None
    if name in EPS_ARMS:
        return read_plugin_toml(str((WINDOWS if native_size == 64 else WINDOWS / f"n{native_size}") / f"windows_{name}.toml"))
    if name == "seed_recipe":
        if native_size != 64:
            raise ValueError("seed_recipe: its routes are for the 256 px lab buckets (native_size 64)")
        return {"routes": list(DEMO_ROUTES)}
    if name in CONTROLS:
        ratio, side = float(name.removeprefix("all")), 4 * native_size  # lab pixels: 4 per latent cell
        return {"routes": [{"route": f"{side}:{round(side * ratio)}", "sigma_min": 0.0}]}
    raise ValueError(f"arm: {name!r} is not an arm of the study (allowed: {', '.join(ARMS)})")


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """What a run's figures depend on: a stored run is reused only under the same settings."""
    keys = ("steps", "rank", "lr", "val_per_bucket", "val_seed", "quick", "batch_size") + (
        ("native_size",) if args.native_size != 64 else ()
    )
    return {k: getattr(args, k) for k in keys}


def run_path(out: Path, arm: str, seed: int) -> Path:
    return out / "runs" / f"{arm}_s{seed}.json"


def validation_steps(native_steps: int, total: int, flop_saving: float) -> list[int]:
    """Half and all of the native step count, and the planned equal-compute step of a routed run
    (its last step, ``EXTRA`` × that, is validated too: the two bracket the native twin's FLOPs)."""
    points = {native_steps // 2, native_steps}
    if total > native_steps:
        points.add(round(native_steps / (1.0 - flop_saving)))
    return sorted(p for p in points if 0 < p <= total)


class Lab:
    """What every run of a worker process shares: the pretrained lab DiT, the data, the held-out set
    and the base model's validation loss (a run's step-0 point: its adapter starts at ΔW = 0)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from downscale_plugin.flops import FlopModel
        from downscale_plugin.lab.data import LabData, LabDataConfig
        from downscale_plugin.lab.model import LabModelConfig, flop_shape
        from downscale_plugin.lab.pretrain import load_or_pretrain
        from downscale_plugin.lab.trainer import native_validation_loss

        self.model_cfg = LabModelConfig()
        buckets = {} if args.native_size == 64 else {"buckets": ((4 * args.native_size,) * 2,)}
        self.data = LabData(LabDataConfig(latent_channels=self.model_cfg.latent_channels, **buckets))
        self.model = load_or_pretrain(self.model_cfg, quick=args.quick, progress=False, data=self.data)
        self.flop_model = FlopModel(*flop_shape(self.model_cfg))
        self.val_set = self.data.validation_set(per_bucket=args.val_per_bucket, seed=args.val_seed)
        self.loss = lambda deltas: native_validation_loss(self.model, deltas, self.val_set, args.val_seed)
        self.base = self.loss(None)

    def validate(self, deltas: dict) -> float:
        return self.base if all(not d.any() for d in deltas.values()) else self.loss(deltas)


def run_one(arm: str, seed: int, args: argparse.Namespace, lab: Lab) -> dict[str, Any]:
    """One twin fine-tune; returns the run's JSON blob."""
    import torch

    from downscale_plugin.config import load_config
    from downscale_plugin.hosts.lab.adapter import LabPlugin
    from downscale_plugin.hosts.lab.twin import TwinRun, equal_compute_steps, planned_saving
    from downscale_plugin.lab.trainer import lab_args, train_lora

    cpu_start = time.process_time()
    table = arm_table(arm, args.native_size)
    plugin, total, planned = None, args.steps, 0.0
    if table is not None:
        plugin = LabPlugin.for_lab(load_config(plugin_toml=table), lab.model_cfg, lab.data, args.batch_size)
        planned = planned_saving(plugin, lab_args(), args.steps)
        total = equal_compute_steps(args.steps, planned, EXTRA)
    twin = TwinRun(seed, lab.flop_model, args.batch_size)
    result = train_lora(
        lab.model, lab.data, steps=total, lr=args.lr, rank=args.rank, seed=seed, batch_size=args.batch_size,
        hook_installer=None if plugin is None else plugin.installer, validate=lab.validate,
        validate_at=validation_steps(args.steps, total, planned), step_scope=twin, clock=time.process_time,
    )  # fmt: skip
    flops_run, flops_native = twin.flops(plugin)
    cpu = list(itertools.accumulate(result.step_times))
    routed = [t.rule_index >= 0 for t in plugin.trace] if plugin is not None else [False] * total
    n = args.steps
    return {
        "arm": arm,
        "seed": seed,
        "settings": settings_of(args),
        "table": table,
        "steps_run": total,
        "flop_saving_planned": planned,
        "routed_share": sum(routed[:n]) / n,  # over the native step count
        "flop_saving": 1.0 - flops_run[n - 1] / flops_native[n - 1],
        "native_flops_at_steps": flops_native[n - 1],  # what the same steps cost at the native grid
        "cpu_s_at_steps": cpu[n - 1],
        "curve": [
            {"step": s, "flops": flops_run[s - 1] if s else 0.0, "cpu_s": cpu[s - 1] if s else 0.0, "val": v}
            for _, s, v in result.val_curve
        ],
        "threads": torch.get_num_threads(),
        "route_ratios": [] if plugin is None else [rule.ratio for rule in plugin.cfg.routes],
        "steps_trace": [] if plugin is None else [[t.rule_index, t.sigmas[0]] for t in plugin.trace[:n]],  # (rule, σ) per step
        "cpu_s_total": time.process_time() - cpu_start,  # training, validation and bookkeeping
    }


def map_rows(native_size: int = 64) -> dict[float, list[dict[str, Any]]]:
    """The lab map's bins per route ratio at that native size (0.875, 0.75 from the exact-filter map;
    0.5 from the pool map)."""
    maps = [ROOT / "docs" / "fidelity" / f"lab_n{native_size}_d8_n16{tail}" / "map.json" for tail in ("", "_pool")]
    rows: dict[float, list[dict[str, Any]]] = {}
    for path in maps:
        for row in json.loads(path.read_text())["rows"]:
            if row["kind"] == "latent" and row["ratio"] not in rows:
                rows.setdefault(row["ratio"], [])
            if row["kind"] == "latent" and (path == maps[0] or row["ratio"] == 0.5):
                rows[row["ratio"]].append(row)
    return rows


def bin_of(rows: list[dict[str, Any]], sigma: float) -> dict[str, Any]:
    for row in rows:
        if (row["endpoint"] and sigma >= 1.0) or (not row["endpoint"] and row["lo"] < sigma <= row["hi"]):
            return row
    return rows[0]  # σ = 0 exactly


def gradient_criteria(run: dict[str, Any], rows: dict[float, list[dict[str, Any]]]) -> dict[str, float]:
    """The map's cosine-gap excess over a routed run's own steps (first ``steps``): the largest upper
    bound of any bin it routed in (what a window's ε bounds) and the mean excess per step (native
    steps count 0: the dose the run received)."""
    excess, worst = [], 0.0
    for rule, sigma in run["steps_trace"]:
        if rule < 0:
            excess.append(0.0)
            continue
        row = bin_of(rows[run["route_ratios"][rule]], sigma)
        excess.append(row["excess"])
        worst = max(worst, row["ub"])
    return {"max_ub": worst, "mean_excess": statistics.fmean(excess) if excess else 0.0}


# ---- aggregation (pure: tested on synthetic runs in tests/test_quality.py through hosts/lab/quality.py) ----


def _curve(run: dict[str, Any], key: str) -> tuple[list[float], list[float]]:
    return [p[key] for p in run["curve"]], [p["val"] for p in run["curve"]]


def val_at_step(run: dict[str, Any], step: int) -> float:
    for p in run["curve"]:
        if p["step"] == step:
            return p["val"]
    raise KeyError(f"{run['arm']} seed {run['seed']}: no validation point at step {step}")


def summarize(runs: dict[tuple[str, int], dict[str, Any]], steps: int, base_val: float | None, native_size: int = 64) -> dict[str, Any]:
    """Per arm: paired read-offs against the same seed's native twin (only seeds that have both)."""
    from downscale_plugin.hosts.lab.quality import paired_interval, value_at, variance_ratio

    natives = {seed: run for (arm, seed), run in runs.items() if arm == "native"}
    out: dict[str, Any] = {"arms": {}}
    nat_final = {s: val_at_step(r, steps) for s, r in natives.items()}
    if natives:
        vals = list(nat_final.values())
        out["native_improvement"] = None if base_val is None else base_val - statistics.fmean(vals)
        out["base_val"] = base_val
    for arm in ARMS:
        seeds = sorted(s for (a, s) in runs if a == arm and s in natives)
        if not seeds:
            continue
        rs = [runs[arm, s] for s in seeds]
        eq_steps = [val_at_step(runs[arm, s], steps) - nat_final[s] for s in seeds]
        eq_compute, cpu_ratio, compute_missing = [], [], []
        for s in seeds:
            native_flops = natives[s]["curve"][-1]["flops"]
            xs, ys = _curve(runs[arm, s], "flops")
            v = value_at(xs, ys, native_flops)
            if v is None:
                compute_missing.append(s)
                continue
            eq_compute.append(v - nat_final[s])
            cx, cy = _curve(runs[arm, s], "flops")[0], [p["cpu_s"] for p in runs[arm, s]["curve"]]
            cpu_ratio.append(value_at(cx, cy, native_flops) / natives[s]["curve"][-1]["cpu_s"])
        # independent-seed differences: the arm's seed s against another seed's native run
        unpaired = [val_at_step(runs[arm, s], steps) - nat_final[t] for s in seeds for t in seeds if t != s]
        entry = {
            "seeds": len(seeds),
            "seed_list": seeds,
            "routed_share": statistics.fmean(r["routed_share"] for r in rs),
            "flop_saving": statistics.fmean(r["flop_saving"] for r in rs),
            "flop_saving_planned": rs[0]["flop_saving_planned"],
            "wall_saving": 1.0 - statistics.fmean(r["cpu_s_at_steps"] for r in rs) / statistics.fmean(
                natives[s]["cpu_s_at_steps"] for s in seeds),
            "equal_steps": paired_interval(eq_steps).as_dict(),
            "equal_steps_per_seed": eq_steps,
            "equal_compute": paired_interval(eq_compute).as_dict() if eq_compute else None,
            "equal_compute_per_seed": eq_compute,
            "equal_compute_missing_seeds": compute_missing,
            "cpu_at_equal_compute_vs_native": statistics.fmean(cpu_ratio) if cpu_ratio else None,
            "steps_to_equal_compute": statistics.fmean(steps / (1.0 - r["flop_saving"]) for r in rs),
            "variance_ratio_unpaired_over_twin": variance_ratio(eq_steps, unpaired) if arm != "native" else None,
        }  # fmt: skip
        if arm != "native" and all(r.get("steps_trace") for r in rs):
            rows = map_rows(native_size)
            crit = [gradient_criteria(r, rows) for r in rs]
            entry["map_max_ub"] = max(c["max_ub"] for c in crit)
            entry["map_mean_excess"] = statistics.fmean(c["mean_excess"] for c in crit)
        out["arms"][arm] = entry
    return out


def band(runs: dict[tuple[str, int], dict[str, Any]], arm: str, seeds: list[int]) -> list[tuple[float, float, float, float]]:
    """(x, mean, lo, hi) of an arm's validation loss at fractions of each seed's native-run FLOPs."""
    from downscale_plugin.hosts.lab.quality import paired_interval, value_at

    rows = []
    for q in FLOP_FRACTIONS:
        vals = []
        for s in seeds:
            xs, ys = _curve(runs[arm, s], "flops")
            v = value_at(xs, ys, q * runs["native", s]["curve"][-1]["flops"])
            if v is not None:
                vals.append(v)
        if len(vals) == len(seeds):
            iv = paired_interval(vals)
            rows.append((q, iv.mean, iv.lo if iv.lo is not None else iv.mean, iv.hi if iv.hi is not None else iv.mean))
    return rows


def diff_band(runs: dict[tuple[str, int], dict[str, Any]], arm: str, seeds: list[int]) -> list[tuple[float, float, float, float]]:
    """(x, mean, lo, hi) of the paired difference arm − native twin at equal FLOPs (fractions of the native run's)."""
    from downscale_plugin.hosts.lab.quality import paired_interval, value_at

    rows = []
    for q in FLOP_FRACTIONS[1:]:
        diffs = []
        for s in seeds:
            native_flops = runs["native", s]["curve"][-1]["flops"]
            a = value_at(*_curve(runs[arm, s], "flops"), q * native_flops)
            b = value_at(*_curve(runs["native", s], "flops"), q * native_flops)
            if a is not None and b is not None:
                diffs.append(a - b)
        if len(diffs) == len(seeds) and len(diffs) > 1:
            iv = paired_interval(diffs)
            rows.append((q, iv.mean, iv.lo, iv.hi))
    return rows


def plot(runs: dict[tuple[str, int], dict[str, Any]], summary: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_abs, ax_diff) = plt.subplots(2, 1, figsize=(9, 9), sharex=True)
    for i, (arm, entry) in enumerate(summary["arms"].items()):
        color = f"C{i}"
        seeds = entry["seed_list"]
        rows = band(runs, arm, seeds)
        if rows:
            x, m, lo, hi = zip(*rows, strict=True)
            ax_abs.plot(x, m, color=color, label=f"{arm} ({100 * entry['flop_saving']:.0f} % FLOPs saved/step)")
            ax_abs.fill_between(x, lo, hi, color=color, alpha=0.15)
        if arm != "native":
            rows = diff_band(runs, arm, seeds)
            if rows:
                x, m, lo, hi = zip(*rows, strict=True)
                ax_diff.plot(x, m, color=color, label=arm)
                ax_diff.fill_between(x, lo, hi, color=color, alpha=0.15)
    if summary.get("base_val") is not None:
        ax_abs.axhline(summary["base_val"], color="grey", linewidth=0.8, linestyle=":", label="base model")
    ax_diff.axhline(0.0, color="black", linewidth=0.8)
    ax_abs.set_ylabel("native-grid validation loss (mean, 95 % band over seeds)")
    ax_diff.set_ylabel("arm − native twin at equal FLOPs (95 % paired band)")
    ax_diff.set_xlabel("training FLOPs, as a fraction of the native run's")
    ax_abs.legend(fontsize="small")
    ax_diff.legend(fontsize="small", ncol=2)
    fig.suptitle(title.replace("; twins", ";\ntwins"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _iv(d: dict[str, float] | None, digits: int = 5) -> str:
    if d is None:
        return "not reached"
    if d["lo"] is None:
        return f"{d['mean']:+.{digits}f}"
    return f"{d['mean']:+.{digits}f} [{d['lo']:+.{digits}f}, {d['hi']:+.{digits}f}]"


def report(summary: dict[str, Any], header: str) -> str:
    """The markdown tables: savings and read-offs per arm, then the map's excess beside the cost."""
    improvement = summary.get("native_improvement")
    rows = ["| arm | seeds | routed share | FLOP saving (per step) | CPU-time saving (per step) | equal steps: arm − native [95 % CI] | "
            "equal compute: arm − native [95 % CI] | steps to equal compute | CPU time at equal compute / native | var. ratio independent / twin |",
            "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    criteria = [
        "| arm | map: largest UB routed in | map: mean excess per step | equal-steps cost, % of the native improvement |",
        "|---|---|---|---|",
    ]
    for arm, e in summary["arms"].items():
        vr = e["variance_ratio_unpaired_over_twin"]
        cpu = e["cpu_at_equal_compute_vs_native"]
        rows.append(
            f"| {arm} | {e['seeds']} | {100 * e['routed_share']:.1f} % | {100 * e['flop_saving']:.1f} % | {100 * e['wall_saving']:.1f} % | "
            f"{_iv(e['equal_steps'])} | {_iv(e['equal_compute'])} | {e['steps_to_equal_compute']:.0f} | "
            f"{'n/a' if cpu is None else f'{cpu:.2f}'} | {'n/a' if vr is None else f'{vr:.0f}×'} |"
        )
        if "map_max_ub" in e:
            share = "n/a" if not improvement else f"{100 * e['equal_steps']['mean'] / improvement:.0f} %"
            criteria.append(f"| {arm} | {e['map_max_ub']:.3f} | {e['map_mean_excess']:.4f} | {share} |")
    lines = [header, ""]
    if summary.get("base_val") is not None and improvement is not None:
        lines.append(f"base model {summary['base_val']:.5f}; native improvement over base {improvement:.5f}")
    return "\n".join([*lines, "", *rows, "", *criteria])


def load_runs(out: Path, settings: dict[str, Any], other: bool = False) -> dict[tuple[str, int], dict[str, Any]]:
    """The stored runs made under ``settings`` (``other``: those made under different ones)."""
    runs = {}
    for path in sorted((out / "runs").glob("*.json")):
        blob = json.loads(path.read_text())
        if (blob["settings"] == settings) != other:
            runs[blob["arm"], blob["seed"]] = blob
    return runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated arms of {','.join(ARMS)} (default all but eps0.3)")
    parser.add_argument("--seeds", default="0,1,2,3,4,5,6,7", help="comma-separated training seeds (default 8)")
    parser.add_argument("--steps", type=int, default=64, help="the native run's steps (default 64)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--val_per_bucket", type=int, default=1, help="held-out crops per lab bucket (default 1)")
    parser.add_argument("--val_seed", type=int, default=0, help="seed of the held-out set and its noise (one for every run)")
    parser.add_argument("--quick", action="store_true", help="quick pretrain (smoke runs only)")
    parser.add_argument(
        "--native_size",
        type=int,
        default=64,
        choices=(64, 32),
        help="latent cells a side: 64 (the lab's buckets, 1 024 tokens) or 32 (one 128 px bucket, 256 tokens)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, one process and one torch thread each")
    parser.add_argument("--report", action="store_true", help="only aggregate the runs already stored")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="out/bench_quality")
    args = parser.parse_args(argv)
    args.arm_list = [a for a in args.arms.split(",") if a]
    problems = [f"--arms: {a!r} is not an arm (allowed: {', '.join(ARMS)})" for a in args.arm_list if a not in ARMS]
    if "native" not in args.arm_list:
        problems.append("--arms must include native (every difference is against the native twin)")
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        problems.append(f"--seeds: {args.seeds!r} is not a comma-separated list of integers")
    problems += [f"--{k} must be >= 1" for k in ("steps", "rank", "batch_size", "val_per_bucket", "jobs") if getattr(args, k) < 1]
    if args.steps % 2:
        problems.append(f"--steps must be even (validation at half of it; got {args.steps})")
    if args.native_size != 64 and "seed_recipe" in args.arm_list:
        problems.append("--arms: seed_recipe routes the 256 px lab buckets only (--native_size 64)")
    if problems:
        parser.error("; ".join(problems))
    return args


def _worker_command(args: argparse.Namespace) -> list[str]:
    keep = ["--arms", args.arms, "--seeds", args.seeds, "--steps", str(args.steps), "--rank", str(args.rank), "--lr", str(args.lr),
            "--batch_size", str(args.batch_size), "--val_per_bucket", str(args.val_per_bucket), "--val_seed", str(args.val_seed),
            "--native_size", str(args.native_size),
            "--out", str(args.out)]  # fmt: skip
    return [sys.executable, __file__, *keep, *(["--quick"] if args.quick else []), "--worker"]


def todo(args: argparse.Namespace) -> list[tuple[str, int]]:
    """Seed by seed (so a stopped study leaves whole seeds), native first within a seed."""
    return [(a, s) for s in args.seed_list for a in sorted(args.arm_list, key=lambda a: a != "native")]


def work(args: argparse.Namespace) -> None:
    """A worker: claims the next unclaimed, not yet stored run (an exclusive ``.claim`` file) until none is left."""
    import torch

    torch.set_num_threads(1)
    out, lab = Path(args.out), None
    for arm, seed in todo(args):
        path = run_path(out, arm, seed)
        if path.exists():
            continue
        try:
            os.close(os.open(path.with_suffix(".claim"), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            continue
        lab = lab or Lab(args)
        t0 = time.perf_counter()
        blob = run_one(arm, seed, args, lab)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(blob, indent=1))
        os.replace(tmp, path)
        path.with_suffix(".claim").unlink()
        print(f"{arm} seed {seed}: {blob['steps_run']} steps, CPU {blob['cpu_s_total']:.0f} s (training {blob['curve'][-1]['cpu_s']:.0f} s), "
              f"wall {time.perf_counter() - t0:.0f} s, val at {args.steps} steps {val_at_step(blob, args.steps):.5f}", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    settings = settings_of(args)
    if args.worker:
        work(args)
        return 0
    if not args.report:
        stale = load_runs(out, settings, other=True)
        if stale:
            print(f"bench_quality: {out} holds {len(stale)} runs made under other settings; use another --out", file=sys.stderr)
            return 2
        for claim in (out / "runs").glob("*.claim"):  # a stopped study's unfinished runs
            claim.unlink()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        workers = [subprocess.Popen(_worker_command(args), env=env) for _ in range(args.jobs)]
        codes = [w.wait() for w in workers]
        if any(codes):
            print(f"bench_quality: worker exit codes {codes}", file=sys.stderr)
    runs = load_runs(out, settings)
    base_val = _base_val(args)
    summary = summarize({k: v for k, v in runs.items() if k[0] in args.arm_list}, args.steps, base_val, args.native_size)
    size = (
        "" if args.native_size == 64 else f", native {args.native_size}x{args.native_size} latents ({(args.native_size // 2) ** 2} tokens)"
    )
    header = (f"lab DiT{' (quick pretrain)' if args.quick else ''}{size}, LoRA rank {args.rank}, lr {args.lr:g}, B = {args.batch_size}, "
              f"native {args.steps} steps, σ sampler shift 3.1582; twins per seed; validation: {args.val_per_bucket} crop(s) × {5 if args.native_size == 64 else 1} bucket(s) × "
              f"5 σ, seed {args.val_seed}; CPU seconds at one torch thread")  # fmt: skip
    summary["settings"] = settings
    summary["command"] = "python benchmarks/bench_quality.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(summary, header)
    print(text)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "report.md").write_text(text + "\n")
    if summary["arms"]:
        plot(runs, summary, out / "quality.png", header)
    return 0


def _base_val(args: argparse.Namespace) -> float | None:
    """The base model's validation loss, from any stored run's first point (step 0: no adapter yet)."""
    for path in sorted((Path(args.out) / "runs").glob("*.json")):
        blob = json.loads(path.read_text())
        if blob["settings"] == settings_of(args) and blob["curve"] and blob["curve"][0]["step"] == 0:
            return blob["curve"][0]["val"]
    return None


if __name__ == "__main__":
    raise SystemExit(main())
