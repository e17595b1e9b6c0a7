"""End-to-end LoRA A/B on the lab DiT: two arms (native, or a plugin TOML), the same seeds and data order.

Per seed, both arms fine-tune the pretrained lab DiT from the same adapter init over the same batches;
the arm that runs first alternates per seed, so drift in machine speed hits both alike. Each run keeps
its wall time (forward + backward + optimizer, as ``train_lora`` counts it), its native-resolution
validation loss (every lab bucket at its own size, fixed σ values and noise, one held-out set for all
runs) and its LoRA ΔW. The report: validation loss mean ± sd per arm; A's seed lottery (the spread of
A's validation loss over seeds) and whether B's mean lies inside it; the cosine of B's ΔW to A's
same-seed twin beside the cosines between A's adapters of different seeds (the lottery in weight
space); wall saved; the routed share of plugin arms (realized and planned).

Full runs (3 seeds × 2 arms × 600 steps at B = 1: ≈ 7–8 min on 2 quiet cores at ~0.115 s a native step,
plus ~5 min once if the default pretrained lab DiT is not cached yet):

    # the map's derived windows vs native. The map tool's lab windows say arch = "flux": tiers count lab
    # latents at 8 px per cell, so the 512 px tier is every lab bucket. They route ~3 % of steps under
    # flux_shift (0.6 % under sigmoid), so the wall saved is ~1 %, inside the timing noise.
    python benchmarks/bench_ab.py --a native --b docs/fidelity/lab_n64_d8_n16/windows.toml --sampler flux_shift \
        --seeds 0,1,2 --steps 600 --threads 2 --out /tmp/ab_windows
    # FasterDiT's direction loss off vs on: a plugin TOML with only `direction_loss_weight = 1.0` (or the same
    # routes in both arms, one with the weight)
    python benchmarks/bench_ab.py --a native --b dirloss.toml --seeds 0,1,2 --steps 600 --threads 2 --out /tmp/ab_dirloss
    # a smoke run (~30 s)
    OMP_NUM_THREADS=1 python benchmarks/bench_ab.py --quick --seeds 0 --steps 4 --b PLUGIN_TOML --out /tmp/ab_smoke
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from bench_speed import SAMPLERS

from downscale_plugin.config import ConfigError, DownscaleConfig, load_config, read_plugin_toml
from downscale_plugin.grid import eligibility_table
from downscale_plugin.hosts.lab.adapter import LabPlugin
from downscale_plugin.lab.data import LabData, LabDataConfig
from downscale_plugin.lab.model import LabModelConfig
from downscale_plugin.lab.pretrain import load_or_pretrain
from downscale_plugin.lab.trainer import delta_cosine, native_validation_loss, train_lora


@dataclass(frozen=True)
class Arm:
    """One side of the A/B: ``spec`` is ``native`` or a plugin TOML path (``config`` None when native)."""

    name: str
    spec: str
    config: DownscaleConfig | None
    toml: dict[str, Any] | None

    @property
    def routes(self) -> bool:
        return self.config is not None and bool(self.config.routes)

    @property
    def label(self) -> str:
        return f"{self.name}: {'native' if self.config is None else os.path.basename(self.spec)}"


@dataclass
class Run:
    """What one (arm, seed) fine-tune leaves; ΔW stays in memory, everything else goes to the JSON."""

    arm: str
    seed: int
    order: int  # 0: ran first for its seed
    wall_s: float
    val_loss: float
    losses: list[float]
    step_times: list[float]
    routed_share: float = 0.0
    routed_share_planned: float = 0.0
    route_fractions: dict[str, float] = field(default_factory=dict)
    flop_saving: float | None = None
    flop_saving_planned: float = 0.0
    deltas: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)


def load_arm(name: str, spec: str, data: LabData, batch_size: int) -> tuple[Arm, list[str]]:
    """The arm and, for plugin arms, the problems that would make it train natively (checked before any compute)."""
    if spec == "native":
        return Arm(name, spec, None, None), []
    try:
        raw = read_plugin_toml(spec)
        cfg = load_config(plugin_toml=raw)
    except ConfigError as err:
        return Arm(name, spec, None, None), [f"--{name.lower()} {spec}: {p}" for p in err.problems]
    arm = Arm(name, spec, cfg, raw)
    if not cfg.enable or not (cfg.routes or cfg.fasterdit.direction_loss_weight):
        return arm, [f"--{name.lower()} {spec}: enable = false, or no routes and no direction loss: the arm would be native"]
    if not cfg.routes:
        return arm, []
    try:
        plugin = LabPlugin.for_lab(cfg, LabModelConfig(), data, batch_size)
    except ValueError as err:
        return arm, [f"--{name.lower()} {spec}: {err}"]
    table = eligibility_table(plugin.buckets, cfg.routes, plugin.arch, cfg.tier_tolerance)
    if not any(cell.eligible for row in table for cell in row):
        reasons = sorted({f"{cfg.routes[c.rule_index].label}: {c.reason}" for row in table for c in row})
        return arm, [f"--{name.lower()} {spec}: no route applies to any lab bucket at {plugin.arch.name}'s {plugin.arch.vae_factor} px "
                     f"per latent cell ({'; '.join(reasons)})"]  # fmt: skip
    return arm, []


def eligibility_lines(arm: Arm, data: LabData, batch_size: int) -> list[str]:
    """Which lab buckets each route of a plugin arm applies to, and the grid it runs them at."""
    plugin = LabPlugin.for_lab(arm.config, LabModelConfig(), data, batch_size)
    table = eligibility_table(plugin.buckets, arm.config.routes, plugin.arch, arm.config.tier_tolerance)
    lines = []
    for i, rule in enumerate(arm.config.routes):
        cells = [row[i] for row in table]
        hits = ", ".join(f"{c.latent_hw[0]}x{c.latent_hw[1]}→{c.target_hw[0]}x{c.target_hw[1]}" for c in cells if c.eligible)
        lines.append(f"  {arm.name} route r{i} {rule.label} σ {rule.window_text()} at {plugin.arch.name} tiers: {hits or 'no bucket'}")
    return lines


def train_arm(arm: Arm, seed: int, order: int, model, data: LabData, val_set: list[dict], args: argparse.Namespace) -> Run:
    plugin = None if arm.config is None else LabPlugin.for_lab(arm.config, LabModelConfig(), data, args.batch_size)
    result = train_lora(
        model, data, steps=args.steps, lr=args.lr, rank=args.rank, seed=seed, args_overrides=SAMPLERS[args.sampler],
        hook_installer=None if plugin is None else plugin.installer, batch_size=args.batch_size,
    )  # fmt: skip
    run = Run(
        arm=arm.name,
        seed=seed,
        order=order,
        wall_s=result.wall_time,
        val_loss=native_validation_loss(model, result.deltas, val_set, args.val_seed),
        losses=result.losses,
        step_times=result.step_times,
        deltas=result.deltas,
    )
    if plugin is not None:
        acc, plan = plugin.accounting, plugin.plan
        labels = [f"r{i} {rule.label}" for i, rule in enumerate(arm.config.routes)] + ["native"]
        run.routed_share, run.routed_share_planned = acc.demote_fraction(), 1.0 - plan.probs[-1]
        run.route_fractions = {label: acc.fractions()[i] for label, i in zip(labels, [*range(len(labels) - 1), -1], strict=True)}
        run.flop_saving, run.flop_saving_planned = acc.flop_saving(), plan.flop_saving
    return run


def _sd(xs: list[float]) -> float | None:
    return statistics.stdev(xs) if len(xs) > 1 else None


def _cross(runs: list[Run]) -> list[float]:
    """Cosines of ΔW between every pair of an arm's seeds."""
    return [delta_cosine(a.deltas, b.deltas) for a, b in itertools.combinations(runs, 2)]


def summarize(arms: tuple[Arm, Arm], runs: dict[tuple[str, int], Run], seeds: list[int]) -> dict[str, Any]:
    a = [runs["A", s] for s in seeds]
    b = [runs["B", s] for s in seeds]
    val_a, val_b = [r.val_loss for r in a], [r.val_loss for r in b]
    wall_a, wall_b = sum(r.wall_s for r in a), sum(r.wall_s for r in b)
    return {
        "val_loss": {
            arm: {"per_seed": v, "mean": statistics.fmean(v), "sd": _sd(v), "min": min(v), "max": max(v)}
            for arm, v in (("A", val_a), ("B", val_b))
        },
        "lottery_A": {"range": max(val_a) - min(val_a), "sd": _sd(val_a)},
        "B_mean_within_A_lottery": min(val_a) <= statistics.fmean(val_b) <= max(val_a) if len(seeds) > 1 else None,
        "paired_B_minus_A": {"per_seed": [y - x for x, y in zip(val_a, val_b, strict=True)]},
        "cos_B_to_A_twin": [delta_cosine(ra.deltas, rb.deltas) for ra, rb in zip(a, b, strict=True)],
        "cos_across_seeds": {"A": _cross(a), "B": _cross(b), "pairs": [list(p) for p in itertools.combinations(seeds, 2)]},
        "wall_s": {"A": [r.wall_s for r in a], "B": [r.wall_s for r in b], "A_total": wall_a, "B_total": wall_b},
        "wall_saved": {"per_seed": [1.0 - rb.wall_s / ra.wall_s for ra, rb in zip(a, b, strict=True)], "total": 1.0 - wall_b / wall_a},
        "routed_share": {arm.name: [runs[arm.name, s].routed_share for s in seeds] for arm in arms if arm.routes},
        "routed_share_planned": {arm.name: runs[arm.name, seeds[0]].routed_share_planned for arm in arms if arm.routes},
    }


def _options(cfg: DownscaleConfig) -> str:
    """The config's non-default keys other than routes (gate, seed, arch, FasterDiT options, ...)."""
    default = DownscaleConfig()
    return ", ".join(
        f"{f.name} = {getattr(cfg, f.name)!r}"
        for f in fields(cfg)
        if f.name not in ("routes", "sources") and getattr(cfg, f.name) != getattr(default, f.name)
    )


def _f(x: float | None, digits: int = 5) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _seq(xs: list[float], digits: int = 4) -> str:
    return ", ".join(f"{x:.{digits}f}" for x in xs)


def _spread(xs: list[float]) -> str:
    return "n/a (one seed)" if not xs else f"{statistics.fmean(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]"


def _pct(xs: list[float]) -> str:
    return ", ".join(f"{100 * x:.1f} %" for x in xs)


def report(arms: tuple[Arm, Arm], s: dict[str, Any], seeds: list[int], base_val: float) -> tuple[str, str]:
    """The markdown table and the verdict line."""
    va, vb = s["val_loss"]["A"], s["val_loss"]["B"]
    paired = s["paired_B_minus_A"]["per_seed"]
    inside = s["B_mean_within_A_lottery"]
    routed = {name: f"{_pct(shares)} ({100 * s['routed_share_planned'][name]:.1f} % planned)" for name, shares in s["routed_share"].items()}
    routed |= {arm.name: "no routes" for arm in arms if arm.config is not None and not arm.routes}
    rows = [
        (f"native-res. val loss per seed ({', '.join(map(str, seeds))}); base {base_val:.5f}", _seq(va["per_seed"], 5), _seq(vb["per_seed"], 5)),
        ("val loss mean ± sd", f"{va['mean']:.5f} ± {_f(va['sd'])}", f"{vb['mean']:.5f} ± {_f(vb['sd'])}"),
        ("seed lottery: [min, max] (max−min)", f"[{va['min']:.5f}, {va['max']:.5f}] ({s['lottery_A']['range']:.5f})",
         "B mean inside A's: " + ("n/a (one seed)" if inside is None else "yes" if inside else "no")),
        ("paired B − A per seed (mean)", "", f"{_seq(paired, 5)} ({statistics.fmean(paired):+.5f})"),
        ("ΔW cosine to A's same-seed twin", "1", _seq(s["cos_B_to_A_twin"], 3)),
        ("ΔW cosine across seeds (weight-space lottery): mean [min, max]", _spread(s["cos_across_seeds"]["A"]), _spread(s["cos_across_seeds"]["B"])),
        ("wall s per seed (total)", f"{_seq(s['wall_s']['A'], 1)} ({s['wall_s']['A_total']:.1f})", f"{_seq(s['wall_s']['B'], 1)} ({s['wall_s']['B_total']:.1f})"),
        ("wall saved vs A per seed (total)", "", f"{_pct(s['wall_saved']['per_seed'])} ({100 * s['wall_saved']['total']:.1f} %)"),
        ("routed share per seed (plan)", routed.get("A", "native"), routed.get("B", "native")),
    ]  # fmt: skip
    lines = [f"| | {arms[0].label} | {arms[1].label} |", "|---|---|---|"] + [f"| {name} | {x} | {y} |" for name, x, y in rows]
    sd = va["sd"]
    delta = vb["mean"] - va["mean"]
    parts = [
        f"B's val loss mean {vb['mean']:.5f} vs A's {va['mean']:.5f} (Δ {delta:+.5f}"
        + (f" = {delta / sd:+.2f} sd of A's lottery" if sd else "")
        + ")",
        "inside A's seed lottery" if inside else "OUTSIDE A's seed lottery" if inside is not None else "lottery needs ≥ 2 seeds",
        f"ΔW cosine to twin {statistics.fmean(s['cos_B_to_A_twin']):.3f}"
        + (f" vs {statistics.fmean(s['cos_across_seeds']['A']):.3f} across A's seeds" if s["cos_across_seeds"]["A"] else ""),
        f"wall saved {100 * s['wall_saved']['total']:.1f} %",
    ]
    for name, shares in s["routed_share"].items():
        parts.append(f"{name} routed {100 * statistics.fmean(shares):.1f} % of steps" + (" — NOTHING ROUTED" if max(shares) == 0 else ""))
    if not any(paired) and min(s["cos_B_to_A_twin"]) > 1 - 1e-12:
        parts.append("B TRAINED EXACTLY LIKE A (same val loss and ΔW): the arms' difference had no effect")
    return "\n".join(lines), "verdict: " + "; ".join(parts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", default="native", help="arm A: 'native' or a plugin TOML (default native)")
    parser.add_argument("--b", required=True, help="arm B: 'native' or a plugin TOML")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds (≥ 2 for a seed lottery)")
    parser.add_argument("--steps", type=int, help="fine-tune steps per run (default 600, quick 8)")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--rank", type=int, help="LoRA rank (default 8, quick 4)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--sampler", default="sigmoid", choices=list(SAMPLERS), help="host timestep_sampling (sigmoid_scale 1)")
    parser.add_argument("--val_per_bucket", type=int, default=4, help="held-out crops per lab bucket for the validation loss")
    parser.add_argument("--val_seed", type=int, default=0, help="seed of the held-out set and its noise (the same for every run)")
    parser.add_argument("--quick", action="store_true", help="quick pretrain size and a tiny fine-tune (smoke runs)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's, i.e. OMP_NUM_THREADS)")
    parser.add_argument("--out", default="out/bench_ab", help="writes OUT.md (table + verdict) and OUT.json (all raw numbers)")
    args = parser.parse_args(argv)
    args.steps = args.steps if args.steps is not None else 8 if args.quick else 600
    args.rank = args.rank if args.rank is not None else 4 if args.quick else 8
    problems = [
        f"--{k} must be >= 1 (got {getattr(args, k)})" for k in ("steps", "batch_size", "rank", "val_per_bucket") if getattr(args, k) < 1
    ]
    problems += [f"--lr must be > 0 (got {args.lr})"] if args.lr <= 0 else []
    problems += [f"--threads must be >= 1 (got {args.threads})"] if args.threads is not None and args.threads < 1 else []
    try:
        args.seed_list = [int(x) for x in args.seeds.split(",")]
        if len(set(args.seed_list)) != len(args.seed_list):
            problems.append(f"--seeds: repeated seed in {args.seeds!r}")
    except ValueError:
        problems.append(f"--seeds: {args.seeds!r} is not a comma-separated list of integers")
    if problems:
        parser.error("; ".join(problems))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model_cfg = LabModelConfig()
    data = LabData(LabDataConfig(latent_channels=model_cfg.latent_channels))
    loaded = [load_arm(name, spec, data, args.batch_size) for name, spec in (("A", args.a), ("B", args.b))]
    problems = [p for _, ps in loaded for p in ps]
    if problems:
        print("\n".join(["bench_ab: cannot run:", *problems]), file=sys.stderr)
        return 2
    arms = (loaded[0][0], loaded[1][0])
    model = load_or_pretrain(model_cfg, quick=args.quick, progress=False, data=data)
    val_set = data.validation_set(per_bucket=args.val_per_bucket, seed=args.val_seed)
    t0 = time.perf_counter()
    base_val = native_validation_loss(model, None, val_set, args.val_seed)
    val_s = time.perf_counter() - t0
    header = (
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads); "
        f"lab DiT{' (quick pretrain)' if args.quick else ''}; {args.steps} steps × B={args.batch_size}, LoRA rank {args.rank}, lr {args.lr:g}, "
        f"σ sampler {args.sampler}; seeds {args.seeds}; val: {args.val_per_bucket} crops × {len(val_set)} buckets, seed {args.val_seed}"
    )  # fmt: skip
    print(header)
    for arm in arms:
        print(f"arm {arm.label}" + ("" if arm.config is None else f" ({arm.spec}; {_options(arm.config) or 'default options'})"))
        if arm.routes:
            print("\n".join(eligibility_lines(arm, data, args.batch_size)))
    runs: dict[tuple[str, int], Run] = {}
    for i, seed in enumerate(args.seed_list):
        for order, arm in enumerate(arms if i % 2 == 0 else arms[::-1]):
            run = runs[arm.name, seed] = train_arm(arm, seed, order, model, data, val_set, args)
            share = "" if not arm.routes else f", routed {100 * run.routed_share:.1f} % (plan {100 * run.routed_share_planned:.1f} %)"
            print(
                f"  seed {seed} {arm.name}: wall {run.wall_s:.1f} s ({1e3 * run.wall_s / args.steps:.0f} ms/step), val {run.val_loss:.5f}{share}",
                flush=True,
            )
    summary = summarize(arms, runs, args.seed_list)
    table, verdict = report(arms, summary, args.seed_list, base_val)
    total = time.perf_counter() - start
    print(f"\n{table}\n\n{verdict}\n\ntotal {total:.0f} s (one validation pass {val_s:.1f} s)")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(f"{args.out}.md", "w", encoding="utf-8") as f:
        f.write(f"{header}\n\n{table}\n\n{verdict}\n")
    blob = {
        "command": " ".join(sys.argv),
        "machine": header,
        "settings": {k: v for k, v in vars(args).items() if k != "seed_list"},
        "arms": {arm.name: {"spec": arm.spec, "toml": arm.toml} for arm in arms},
        "base_val_loss": base_val,
        "runs": [{f.name: getattr(r, f.name) for f in fields(r) if f.name != "deltas"} for r in runs.values()],
        "summary": summary,
        "total_s": total,
    }
    with open(f"{args.out}.json", "w", encoding="utf-8") as f:
        json.dump(blob, f, indent=1)
    print(f"wrote {args.out}.md, {args.out}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
