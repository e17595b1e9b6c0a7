"""The same adapter, sooner? Time to quality of routed LoRA fine-tunes on a concept new to the base.

Task (``lab/concept.py``): the pretrained lab DiT learns the "hatched posters", a concept it never
saw (low-frequency layout and palette, plus a hatch and marks at the native latent grid's Nyquist
period that no smaller grid can hold), captioned with a new text class. Validation: held-out posters
only, ``--val_per_bucket`` crops per lab bucket × the σ of ``--val_sigmas`` ×
``--val_draws`` noise draws each, native grid; every item's loss is stored.

Per seed, every arm is a twin of the native run (``hosts/lab/twin.py``: same adapter init, data
order, σ draws and noise; a routed step gets the paired transform of the native draw), run to a
compute budget in units of its native twin's training FLOPs over ``--steps`` steps (the project's
FLOP model), validated when the FLOPs spent reach each 1/``--points`` of that unit. The learning
rate follows the FLOPs spent (``--schedule cosine``, the default: to zero at one unit), so every arm
stops at 1 unit and an arm that has not reached a target by then enters at 1 (a lower bound); under
``--schedule constant`` routed arms run to 1.1 units.

Read-offs per seed, from the monotone (non-increasing least-squares) fit of each validation curve:
native's improvement is base − its fitted end (its plateau: the last quarter's share of the
improvement is reported); an arm's time to q % quality is the FLOPs (and CPU seconds, one torch
thread) at which its fit first reaches base − q × that improvement, as a ratio to native's own. Over
seeds: the geometric-mean ratio with a paired 95 % t interval on the log-ratios (and a bootstrap
check), the seeds that reached the target within the arm's budget (the others enter at their cap: a
lower bound), and the arm − native difference at equal compute (0.5, 0.75, 1 × native FLOPs) and at
equal steps against a margin of a tenth of native's improvement.

Arms: ``native``; the concept map's windows at ε = 0.05 … 0.3 (``docs/fidelity/quality/
windows_eps*.toml``, re-derived from ``docs/fidelity/lab_concept_n64_d8_n16/map.json`` with the
family-wise read; ε = 0.05 certifies no window, so that arm is the native run and is not run);
``seed_recipe`` (the seed paper's uncertified stacked routes); ``all0.5`` (every step at half the
grid: the positive control, which must show the loss).

Runs are resumable (one JSON per (arm, seed) under OUT/runs) and each records the code revision and
the uncommitted change of the files a run's figures depend on (``STUDY_PATHS``); a stored run whose
figures could differ at the current code is stale and refused. The study:

    python benchmarks/bench_quality.py --jobs 2 --out docs/fidelity/quality

``--report`` only aggregates. Smoke (~2 min): ``--quick --seeds 0 --steps 8 --points 4 --arms native,all0.5 --out /tmp/q``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WINDOWS = ROOT / "docs" / "fidelity" / "quality"


@dataclass(frozen=True)
class ArmSpec:
    budget: float  # native-twin FLOP units the arm trains for
    describe: str


EPS = ("0.05", "0.1", "0.2", "0.3")
ARMS = {
    "native": ArmSpec(1.0, "native: no plugin"),
    **{f"eps{e}": ArmSpec(1.1, f"the concept map's windows at ε = {e}") for e in EPS},
    "seed_recipe": ArmSpec(1.1, "the seed paper's stacked recipe, uncertified (0.75 in 0.65 < σ < 0.95, 0.875 above σ 0.5)"),
    "all0.5": ArmSpec(1.0, "every step at half the grid (positive control)"),
}
DEFAULT_ARMS = ("native", "eps0.05", "eps0.1", "eps0.2", "seed_recipe", "all0.5")
VAL_SIGMAS = "0.1,0.6"  # low σ (the concept's detail) weighed like the mid σ, where most of the gain and the control's loss are
CONTROL = "all0.5"
QUALITY_LEVELS = (0.75, 0.9, 1.0)
EQUAL_COMPUTE = (0.5, 0.75, 1.0)
MARGIN_SHARE = 0.1  # the non-inferiority margin: a tenth of native's improvement
# The break-even extrapolation's production setting: Flux at 1 024 px (4 096 image tokens, 512 text tokens),
# and the share of the FLOP model's per-step saving realized in time there: SD3 at 512 px on sd-scripts'
# own classes realized 0.96 and 0.97 of it (benchmarks/RESULTS.md, "Production width", run 5).
PRODUCTION_ARCH, PRODUCTION_TOKENS, REALIZED = "flux", 4096, 0.96
# What a run's figures depend on besides its settings and its arm's table: a change here makes stored runs stale.
STUDY_PATHS = (
    "downscale_plugin/lab",
    "downscale_plugin/hosts/lab/twin.py",
    "downscale_plugin/hosts/lab/adapter.py",
    "downscale_plugin/hosts/lab/sampler.py",
    "downscale_plugin/hosts/sd_scripts/hook.py",
    "downscale_plugin/hosts/sd_scripts/families.py",
    "downscale_plugin/router.py",
    "downscale_plugin/sigma.py",
    "downscale_plugin/grid.py",
    "downscale_plugin/rng.py",
    "downscale_plugin/mapping/paired.py",
    "downscale_plugin/flops.py",
)


def windowless(name: str) -> bool:
    """Whether an ε arm's map certified no window at all (its file says ``enable = false``): such an arm
    is the native run, so the study records that instead of training it again."""
    return name.startswith("eps") and arm_table(name).get("enable") is False


def arm_table(name: str) -> dict[str, Any] | None:
    """The plugin table of an arm (None: native)."""
    from downscale_plugin.config import read_plugin_toml
    from downscale_plugin.hosts.lab.demo import DEMO_ROUTES

    if name == "native":
        return None
    if name.startswith("eps") and name.removeprefix("eps") in EPS:
        return read_plugin_toml(str(WINDOWS / f"windows_{name}.toml"))
    if name == "seed_recipe":
        return {"routes": list(DEMO_ROUTES)}
    if name == CONTROL:
        return {"routes": [{"route": "256:128", "sigma_min": 0.0}]}
    raise ValueError(f"arm: {name!r} is not an arm of the study (allowed: {', '.join(ARMS)})")


# ---- code revision ----


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def code_state() -> dict[str, str | None]:
    """HEAD and a hash of the uncommitted change to ``STUDY_PATHS`` ("" when clean)."""
    head = _git("rev-parse", "HEAD")
    diff = _git("diff", "HEAD", "--", *STUDY_PATHS) or ""
    untracked = _git("ls-files", "--others", "--exclude-standard", "--", *STUDY_PATHS) or ""
    change = diff + untracked
    return {"revision": head.strip() if head else None, "uncommitted": hashlib.sha256(change.encode()).hexdigest()[:16] if change else ""}


def stale_reason(run: dict[str, Any], now: dict[str, str | None]) -> str | None:
    """Why a stored run's figures could differ at the current code (None: it is current)."""
    then = run.get("code")
    if not then or not then.get("revision"):
        return "it records no code revision"
    if then["uncommitted"] != now["uncommitted"]:
        return f"it ran with another uncommitted change to the study's files ({then['uncommitted'] or 'none'})"
    if then["revision"] == now["revision"]:
        return None
    changed = _git("diff", "--name-only", then["revision"], now["revision"] or "HEAD", "--", *STUDY_PATHS)
    if changed is None:
        return f"its revision {then['revision'][:12]} is not in this checkout"
    return f"the study's files changed since {then['revision'][:12]}: {', '.join(changed.split())}" if changed.strip() else None


# ---- one run ----


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """What a run's figures depend on besides the code: a stored run is reused only under the same settings."""
    keys = ("task", "steps", "rank", "lr", "schedule", "batch_size", "points", "val_per_bucket", "val_draws", "val_seed", "quick")
    return {**{k: getattr(args, k) for k in keys}, "val_sigmas": list(val_sigmas(args))}


def val_sigmas(args: argparse.Namespace) -> tuple[float, ...]:
    return tuple(float(s) for s in args.val_sigmas.split(","))


def budget_of(arm: str, args: argparse.Namespace) -> float:
    """The arm's budget in native FLOP units: under the cosine schedule the learning rate is zero from
    1 on, so every arm stops there."""
    return min(ARMS[arm].budget, 1.0) if args.schedule == "cosine" else ARMS[arm].budget


def run_path(out: Path, arm: str, seed: int) -> Path:
    return out / "runs" / f"{arm}_s{seed}.json"


class Lab:
    """What every run of a worker shares: the pretrained lab DiT, the concept data and its held-out set."""

    def __init__(self, args: argparse.Namespace) -> None:
        from downscale_plugin.flops import FlopModel
        from downscale_plugin.lab.concept import task_data
        from downscale_plugin.lab.data import LabData, LabDataConfig
        from downscale_plugin.lab.model import LabModelConfig, flop_shape
        from downscale_plugin.lab.pretrain import load_or_pretrain
        from downscale_plugin.lab.trainer import native_validation_losses

        self.model_cfg = LabModelConfig()
        base = LabData(LabDataConfig(latent_channels=self.model_cfg.latent_channels))
        self.model = load_or_pretrain(self.model_cfg, quick=args.quick, progress=False, data=base)
        self.data = task_data(args.task, base)
        self.flop_model = FlopModel(*flop_shape(self.model_cfg))
        val_set = self.data.validation_set(per_bucket=args.val_per_bucket, seed=args.val_seed)
        sigmas = val_sigmas(args)
        self.base_items = native_validation_losses(self.model, None, val_set, args.val_seed, sigmas, args.val_draws)
        # a fresh adapter's ΔW is zero (lora_B starts at 0): every run's first point is the base model's
        self.validate = lambda deltas: (
            self.base_items.clone() if all(not d.any() for d in deltas.values())
            else native_validation_losses(self.model, deltas, val_set, args.val_seed, sigmas, args.val_draws)
        )  # fmt: skip


def run_one(arm: str, seed: int, args: argparse.Namespace, lab: Lab) -> dict[str, Any]:
    """One twin fine-tune to its arm's budget; returns the run's JSON blob."""
    import torch

    from downscale_plugin.config import load_config
    from downscale_plugin.hosts.lab.adapter import LabPlugin
    from downscale_plugin.hosts.lab.twin import SCHEDULES, run_to_budget

    table = arm_table(arm)
    plugin = None if table is None else LabPlugin.for_lab(load_config(plugin_toml=table), lab.model_cfg, lab.data, args.batch_size)
    cpu_start = time.process_time()
    run = run_to_budget(
        lab.model, lab.data, plugin, seed=seed, native_steps=args.steps, budget=budget_of(arm, args), points=args.points,
        lr=args.lr, rank=args.rank, validate=lab.validate, flop_model=lab.flop_model, batch_size=args.batch_size,
        schedule=SCHEDULES[args.schedule],
    )  # fmt: skip
    return {
        "arm": arm,
        "seed": seed,
        "settings": settings_of(args),
        "code": code_state(),
        "table": table,
        "budget": budget_of(arm, args),
        "threads": torch.get_num_threads(),
        "native_flops": run.native_flops,
        "curve": [
            {"step": s, "flops": f, "cpu_s": c, "val": v} for s, f, c, v in zip(run.steps, run.flops, run.seconds, run.val, strict=True)
        ],
        "items": run.items,
        "tokens_run": run.tokens_run,
        "step_cpu_s": [round(t, 5) for t in run.step_seconds],
        "routed": [] if plugin is None else [t.rule_index for t in plugin.trace],
        "cpu_s_total": time.process_time() - cpu_start,  # training, validation and bookkeeping
    }


# ---- aggregation ----


def _fit(run: dict[str, Any], key: str) -> tuple[list[float], list[float]]:
    from downscale_plugin.quality import monotone_fit

    return [p[key] for p in run["curve"]], monotone_fit([p["val"] for p in run["curve"]])


def time_to(run: dict[str, Any], key: str, target: float) -> float | None:
    from downscale_plugin.quality import first_reach

    return first_reach(*_fit(run, key), target)


def _raw(run: dict[str, Any], key: str) -> tuple[list[float], list[float]]:
    return [p[key] for p in run["curve"]], [p["val"] for p in run["curve"]]


def native_facts(native: dict[str, Any]) -> dict[str, float]:
    """A native run's base, plateau (its fitted end), improvement and the last quarter's share of it."""
    from downscale_plugin.quality import value_at

    xs, fit = _fit(native, "flops")
    base, plateau = native["curve"][0]["val"], fit[-1]
    at_three_quarters = value_at(xs, fit, 0.75 * xs[-1])
    gain = base - plateau
    return {
        "base": base,
        "plateau": plateau,
        "gain": gain,
        "last_quarter_share": (at_three_quarters - plateau) / gain if gain > 0 else math.nan,
    }


def validation_error(native: dict[str, Any]) -> float:
    """Standard error of native's improvement due to the validation set itself: the items' paired
    (end − start) differences, averaged per crop over its σ and draws, spread over crops."""
    first, last = native["items"][0], native["items"][-1]
    per_crop = len(native["settings"]["val_sigmas"]) * native["settings"]["val_draws"]
    crops = [statistics.fmean(a - b for a, b in zip(first[i : i + per_crop], last[i : i + per_crop], strict=True))
             for i in range(0, len(first), per_crop)]  # fmt: skip
    return statistics.stdev(crops) / math.sqrt(len(crops))


def summarize(runs: dict[tuple[str, int], dict[str, Any]], arms: list[str]) -> dict[str, Any]:
    """Per arm, paired against the same seed's native twin (seeds that have both)."""
    from downscale_plugin.quality import paired_interval, ratio_interval, value_at

    natives = {s: r for (a, s), r in runs.items() if a == "native"}
    facts = {s: native_facts(r) for s, r in natives.items()}
    out: dict[str, Any] = {"arms": {}, "windowless": {}}
    if natives:
        out["base_val"] = statistics.fmean(f["base"] for f in facts.values())
        out["native_gain"] = statistics.fmean(f["gain"] for f in facts.values())
        out["native_gain_fraction"] = statistics.fmean(f["gain"] / f["base"] for f in facts.values())
        out["native_last_quarter_share"] = {"mean": statistics.fmean(f["last_quarter_share"] for f in facts.values()),
                                            "max": max(f["last_quarter_share"] for f in facts.values())}  # fmt: skip
        out["validation_se_of_gain"] = statistics.fmean(validation_error(r) for r in natives.values())
        out["seed_sd_of_gain"] = statistics.stdev(f["gain"] for f in facts.values()) if len(facts) > 1 else None
    for arm in arms:
        if windowless(arm):
            out["windowless"][arm] = f"{ARMS[arm].describe}: the map certified none, so the plugin is off and the arm is the native run"
            continue
        seeds = sorted(s for (a, s) in runs if a == arm and s in natives)
        if not seeds:
            continue
        entry: dict[str, Any] = {"seeds": len(seeds), "seed_list": seeds, "describe": ARMS[arm].describe}
        rs = [runs[arm, s] for s in seeds]
        entry["budget"] = rs[0].get("budget", ARMS[arm].budget)
        n_steps = rs[0]["settings"]["steps"]
        entry["routed_share"] = statistics.fmean(sum(i >= 0 for i in r["routed"]) / len(r["routed"]) if r["routed"] else 0.0 for r in rs)
        entry["flop_saving_per_step"] = statistics.fmean(
            1 - r["curve"][-1]["flops"] / (r["native_flops"] * len(r["tokens_run"]) / n_steps) for r in rs
        )
        entry["time_to_quality"] = {}
        for key, name in (("flops", "flops"), ("cpu_s", "cpu"), ("step", "steps")):
            per_level = {}
            for q in QUALITY_LEVELS:
                ratios, reached = [], []
                for s in seeds:
                    target = facts[s]["base"] - q * facts[s]["gain"]
                    native_t = time_to(natives[s], key, target)
                    t = time_to(runs[arm, s], key, target)
                    cap = runs[arm, s]["curve"][-1][key]
                    reached.append(t is not None)
                    ratios.append((t if t is not None else cap) / native_t)
                per_level[f"{round(100 * q)}"] = {**ratio_interval(ratios, reached).as_dict(), "per_seed": ratios}
            entry["time_to_quality"][name] = {**per_level["90"], "levels": per_level}
        entry["equal_compute"] = {}
        margin = MARGIN_SHARE * out["native_gain"]
        for frac in EQUAL_COMPUTE:
            diffs = []
            for s in seeds:
                x = frac * natives[s]["native_flops"]
                a, b = value_at(*_raw(runs[arm, s], "flops"), x), value_at(*_raw(natives[s], "flops"), x)
                if a is not None and b is not None:
                    diffs.append(a - b)
            if diffs:
                iv = paired_interval(diffs)
                entry["equal_compute"][f"{frac:g}"] = {**iv.as_dict(), "n": iv.n, "margin": margin,
                                                      "non_inferior": iv.hi is not None and iv.hi < margin}  # fmt: skip
        diffs = [value_at(*_raw(runs[arm, s], "step"), n_steps) - value_at(*_raw(natives[s], "step"), n_steps) for s in seeds]
        entry["equal_steps"] = {**paired_interval(diffs).as_dict(), "margin": margin}
        cpu_ratio = [
            (runs[arm, s]["curve"][-1]["cpu_s"] / len(runs[arm, s]["tokens_run"])) / (natives[s]["curve"][-1]["cpu_s"] / len(natives[s]["tokens_run"]))
            for s in seeds
        ]  # fmt: skip
        entry["cpu_per_step_vs_native"] = statistics.fmean(cpu_ratio)
        entry["production"] = production_extrapolation(rs, entry["time_to_quality"]["steps"])
        out["arms"][arm] = entry
    return out


def production_extrapolation(runs: list[dict[str, Any]], steps_to_90: dict[str, Any]) -> dict[str, Any]:
    """The arm's time to 90 % quality on a production model, extrapolated: the lab's steps-to-target
    ratio (the inverse of its per-step teaching efficiency) × the per-step time ratio its routes would
    have on Flux at 1 024 px (the FLOP model's cost of each route's grid, its realized share of the
    predicted saving taken as ``REALIZED``). Assumes the lab's teaching efficiency and routed shares
    transfer, which is what a user must check on their own model."""
    from downscale_plugin.arch import get_arch
    from downscale_plugin.config import load_config

    cost = get_arch(PRODUCTION_ARCH).flops.flops
    native = cost(PRODUCTION_TOKENS)
    shares: dict[float, float] = {}
    for run in runs:
        ratios = [rule.ratio for rule in load_config(plugin_toml=run["table"]).routes] if run["table"] else []
        for index in run["routed"]:
            if index >= 0:
                shares[ratios[index]] = shares.get(ratios[index], 0.0) + 1 / len(run["routed"]) / len(runs)
    saving = sum(share * (1 - cost(PRODUCTION_TOKENS * ratio**2) / native) for ratio, share in shares.items())
    out = {"flop_saving_per_step": saving, "realized_share": REALIZED, "time_ratio": {}}
    for name, realized in (("flop_model", 1.0), ("realized", REALIZED)):
        per_step = 1 - saving * realized
        out["time_ratio"][name] = {k: (None if steps_to_90[k] is None else steps_to_90[k] * per_step) for k in ("ratio", "lo", "hi")}
    return out


def _ratio(d: dict[str, Any]) -> str:
    if d["lo"] is None:
        return f"{d['ratio']:.2f}"
    cens = "" if d["reached"] == d["seeds"] else " (≥: some capped)"
    return f"{d['ratio']:.2f} [{d['lo']:.2f}, {d['hi']:.2f}]{cens}"


def _iv(d: dict[str, Any] | None) -> str:
    if not d:
        return "not reached"
    if d["lo"] is None:
        return f"{d['mean']:+.4f}"
    return f"{d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}]"


def report(summary: dict[str, Any], header: str) -> str:
    lines = [header, ""]
    if "native_gain" in summary:
        lq = summary["native_last_quarter_share"]
        lines += [
            f"base model {summary['base_val']:.4f}; native improvement {summary['native_gain']:.4f} "
            f"({100 * summary['native_gain_fraction']:.1f} % of the base loss); its last quarter gains "
            f"{100 * lq['mean']:.1f} % of it (max over seeds {100 * lq['max']:.1f} %); the validation set's own standard error of the "
            f"improvement {summary['validation_se_of_gain']:.4f} (seed SD {summary['seed_sd_of_gain'] or 0:.4f})",
            "",
        ]
    lines += [f"{arm}: {why}." for arm, why in summary["windowless"].items()] + [""] * bool(summary["windowless"])
    lines += [
        "Time to 90 % of native's improvement, arm ÷ native (geometric mean over seeds, paired 95 % t interval on the log-ratio; "
        "reached = seeds that reached it within the arm's budget):",
        "",
        "| arm | seeds | routed share | FLOPs saved per step | CPU s per step vs native | FLOPs to 90 % | reached | CPU s to 90 % | reached | bootstrap check (FLOPs) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, e in summary["arms"].items():
        f, c = e["time_to_quality"]["flops"], e["time_to_quality"]["cpu"]
        boot = "n/a" if f["boot_lo"] is None else f"[{f['boot_lo']:.2f}, {f['boot_hi']:.2f}]"
        lines.append(
            f"| {arm} | {e['seeds']} | {100 * e['routed_share']:.1f} % | {100 * e['flop_saving_per_step']:.1f} % | "
            f"{e['cpu_per_step_vs_native']:.2f} | {_ratio(f)} | {f['reached']}/{f['seeds']} | {_ratio(c)} | {c['reached']}/{c['seeds']} | {boot} |"
        )
    lines += ["", "Time to 75 % / 100 % of native's improvement (FLOPs ratio):", "", "| arm | 75 % | 100 % |", "|---|---|---|"]
    for arm, e in summary["arms"].items():
        lv = e["time_to_quality"]["flops"]["levels"]
        lines.append(f"| {arm} | {_ratio(lv['75'])} ({lv['75']['reached']}/{lv['75']['seeds']}) | "
                     f"{_ratio(lv['100'])} ({lv['100']['reached']}/{lv['100']['seeds']}) |")  # fmt: skip
    margin = MARGIN_SHARE * summary.get("native_gain", 0.0)
    lines += [
        "",
        f"Validation loss, arm − native (paired 95 % interval; margin = a tenth of native's improvement, {margin:.4f}):",
        "",
        "| arm | equal compute 0.5× | 0.75× | 1× native FLOPs | equal steps |",
        "|---|---|---|---|---|",
    ]
    for arm, e in summary["arms"].items():
        ec = e["equal_compute"]
        lines.append(f"| {arm} | {_iv(ec.get('0.5'))} | {_iv(ec.get('0.75'))} | {_iv(ec.get('1'))} | {_iv(e['equal_steps'])} |")
    lines += [
        "",
        f"Break-even toward production (an extrapolation): steps to 90 % (arm ÷ native, the lab's) × the per-step time ratio of the "
        f"arm's routes on {PRODUCTION_ARCH} at 1 024 px (FLOP model; realized share {REALIZED:g}); below 1 = sooner there:",
        "",
        "| arm | steps to 90 % | production FLOP saving per step | time to 90 % at production (FLOP model) | at realized share |",
        "|---|---|---|---|---|",
    ]
    for arm, e in summary["arms"].items():
        st, prod = e["time_to_quality"]["steps"], e["production"]
        fm, rl = prod["time_ratio"]["flop_model"], prod["time_ratio"]["realized"]
        lines.append(
            f"| {arm} | {_ratio(st)} | {100 * prod['flop_saving_per_step']:.1f} % | {_ratio({**st, **fm})} | {_ratio({**st, **rl})} |"
        )
    return "\n".join(lines)


def plot(runs: dict[tuple[str, int], dict[str, Any]], summary: dict[str, Any], path: Path, title: str) -> None:
    """Mean validation curve per arm against FLOPs (in native-run units), and the time-to-90 % ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from downscale_plugin.quality import value_at

    fig, (ax_curve, ax_ttq) = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    grid = [k / 40 for k in range(51)]
    for i, (arm, e) in enumerate(summary["arms"].items()):
        mean = []
        for x in grid:
            vals = [value_at(*_raw(runs[arm, s], "flops"), x * runs["native", s]["native_flops"]) for s in e["seed_list"]]
            mean.append(statistics.fmean(vals) if all(v is not None for v in vals) else math.nan)
        ax_curve.plot(grid, mean, color=f"C{i}", label=f"{arm} ({100 * e['flop_saving_per_step']:.0f} % FLOPs/step)")
        f = e["time_to_quality"]["flops"]
        if f["lo"] is not None:
            ax_ttq.errorbar([f["ratio"]], [i], xerr=[[f["ratio"] - f["lo"]], [f["hi"] - f["ratio"]]], fmt="o", color=f"C{i}")
    ax_curve.axhline(summary["base_val"] - 0.9 * summary["native_gain"], color="grey", linestyle=":", label="90 % of native's improvement")
    ax_curve.set_xlabel("training FLOPs, in units of the native run's")
    ax_curve.set_ylabel("held-out native-grid validation loss (mean over seeds)")
    ax_curve.legend(fontsize="small")
    ax_ttq.axvline(1.0, color="black", linewidth=0.8)
    ax_ttq.set_yticks(range(len(summary["arms"])), list(summary["arms"]))
    ax_ttq.set_xlabel("FLOPs to 90 % quality, arm ÷ native (95 % CI)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the study ----


def load_runs(out: Path) -> dict[tuple[str, int], dict[str, Any]]:
    return {(b["arm"], b["seed"]): b for b in (json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json")))}


def refusals(runs: dict[tuple[str, int], dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """Stored runs that cannot be reused under these settings and this code, each with why."""
    now, settings, out = code_state(), settings_of(args), []
    for (arm, seed), run in sorted(runs.items()):
        reason = "its settings differ" if run["settings"] != settings else stale_reason(run, now)
        if reason is None and arm in ARMS and run["table"] != arm_table(arm):
            reason = "its arm's table changed"
        if reason:
            out.append(f"{arm} seed {seed}: {reason}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated arms of {','.join(ARMS)}")
    parser.add_argument("--seeds", default=",".join(str(s) for s in range(16)), help="comma-separated training seeds (default 0-15)")
    parser.add_argument("--task", default="concept", help="lab.concept.TASKS: concept (default) or corpus")
    parser.add_argument("--steps", type=int, default=400, help="the native run's steps: the budget's unit (default 400)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (default 1e-2)")
    parser.add_argument(
        "--schedule",
        default="cosine",
        choices=("constant", "cosine"),
        help="lr over the FLOPs spent ÷ the native unit: constant, or cosine to zero at 1 (every arm then stops at 1)",
    )
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--points", type=int, default=16, help="validation points per native-run FLOPs (default 16)")
    parser.add_argument("--val_per_bucket", type=int, default=2, help="held-out crops per lab bucket (default 2)")
    parser.add_argument("--val_sigmas", default=VAL_SIGMAS, help=f"comma-separated validation σ (default {VAL_SIGMAS})")
    parser.add_argument("--val_draws", type=int, default=2, help="noise draws per (crop, σ) (default 2)")
    parser.add_argument("--val_seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="quick pretrain (smoke runs only)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, one process and one torch thread each")
    parser.add_argument("--report", action="store_true", help="only aggregate the runs already stored")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="out/bench_quality")
    args = parser.parse_args(argv)
    args.arm_list = [a for a in args.arms.split(",") if a]
    problems = [f"--arms: {a!r} is not an arm (allowed: {', '.join(ARMS)})" for a in args.arm_list if a not in ARMS]
    if "native" not in args.arm_list:
        problems.append("--arms must include native (every ratio is against the native twin)")
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        problems.append(f"--seeds: {args.seeds!r} is not a comma-separated list of integers")
    problems += [
        f"--{k} must be >= 1"
        for k in ("steps", "rank", "batch_size", "points", "val_per_bucket", "val_draws", "jobs")
        if getattr(args, k) < 1
    ]
    if args.task not in ("concept", "corpus"):
        problems.append(f"--task: {args.task!r} (allowed: concept, corpus)")
    if problems:
        parser.error("; ".join(problems))
    return args


def _worker_command(argv: list[str]) -> list[str]:
    """This command as a worker: ``--jobs`` (and its value) dropped, ``--worker`` added."""
    keep, skip = [], False
    for a in argv:
        if skip or a.startswith("--jobs"):
            skip = a == "--jobs"
            continue
        keep.append(a)
    return [sys.executable, __file__, *keep, "--worker"]


def todo(args: argparse.Namespace) -> list[tuple[str, int]]:
    """Seed by seed (a stopped study leaves whole seeds), native first within a seed."""
    arms = [a for a in sorted(args.arm_list, key=lambda a: a != "native") if not windowless(a)]
    return [(a, s) for s in args.seed_list for a in arms]


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
        tmp.write_text(json.dumps(blob))
        os.replace(tmp, path)
        path.with_suffix(".claim").unlink()
        print(f"{arm} seed {seed}: {len(blob['tokens_run'])} steps, CPU {blob['cpu_s_total']:.0f} s, wall {time.perf_counter() - t0:.0f} s, "
              f"val {blob['curve'][0]['val']:.4f} -> {blob['curve'][-1]['val']:.4f}", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    if args.worker:
        work(args)
        return 0
    refused = refusals(load_runs(out), args)
    if refused:
        print(f"bench_quality: {out} holds runs that cannot be reused (move them away or use another --out):", file=sys.stderr)
        print("\n".join(f"  {r}" for r in refused), file=sys.stderr)
        return 2
    if not args.report:
        for claim in (out / "runs").glob("*.claim"):  # a stopped study's unfinished runs
            claim.unlink()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        codes = [w.wait() for w in [subprocess.Popen(_worker_command(argv), env=env) for _ in range(args.jobs)]]
        if any(codes):
            print(f"bench_quality: worker exit codes {codes}", file=sys.stderr)
            return 1
    runs = {k: v for k, v in load_runs(out).items() if k[0] in args.arm_list and k[1] in args.seed_list}
    summary = summarize(runs, args.arm_list)
    header = (
        f"lab DiT{' (quick pretrain)' if args.quick else ''} LoRA (rank {args.rank}, lr {args.lr:g} {args.schedule}, B = {args.batch_size}) on the "
        f"'{args.task}' task; native {args.steps} steps; σ sampler shift 3.1582; twins per seed; validation at {args.points} points per "
        f"native-run FLOPs on held-out images: {args.val_per_bucket} crops × 5 buckets × {len(val_sigmas(args))} σ × {args.val_draws} noise draws; "
        "CPU seconds at one torch thread"
    )
    code = code_state()
    summary.update(
        task={"name": args.task, "pretraining_overlap": args.task == "corpus",
              "validation": f"held-out {'posters' if args.task == 'concept' else 'crops'}: {args.val_per_bucket} crops per bucket × 5 buckets, "
                            f"{len(val_sigmas(args))} σ {val_sigmas(args)} × {args.val_draws} noise draws each, native grid, per-item losses stored"},
        code_revision=code["revision"] + (f"+{code['uncommitted']}" if code["uncommitted"] else ""),
        settings=settings_of(args),
        command="python benchmarks/bench_quality.py " + " ".join(argv),
    )  # fmt: skip
    text = report(summary, header)
    print(text)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "report.md").write_text(text + "\n")
    if summary["arms"] and "native" in summary["arms"]:
        plot(runs, summary, out / "quality.png", header)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
