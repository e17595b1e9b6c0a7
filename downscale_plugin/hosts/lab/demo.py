"""``python -m downscale_plugin demo``: the embedded default, end to end on the CPU.

A LoRA teaches the shipped lab base (``lab/base.py``, pretrained over 96–384 px) a style it never saw
(``lab/concept.py``: a colour grade and a halftone screen over photographs, a trigger class), twice, as twins (``hosts/lab/twin.py``: same seed, adapter init, data order, σ draws and
noise): natively, and with the plugin routing σ-windowed steps to smaller grids through the same host
hook sd-scripts runs. Both spend the native run's training FLOPs under one learning-rate curve over
the FLOPs spent (cosine to zero there, as the quality study trains), validated on the style's held-out photographs at
each 1/``val_points`` of those FLOPs. The table gives what the quality study
(``benchmarks/bench_quality.py``) reads per seed: the FLOP saving per step (realized and planned),
route fractions, the held-out validation loss at equal compute, and each run's time to 90 % of the
native run's improvement in FLOPs and seconds. A PNG shows both validation curves against FLOPs.

The router is the style map's windows at ε = 0.2 (``docs/fidelity/quality/windows/style_eps0.2.toml``);
``--seed_recipe`` runs the seed paper's uncertified recipe instead (on the hatched posters it routed their detail
away: a routed step taught less, and it was not sooner in CPU time, docs/FIDELITY.md §10).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...cli import fail
from ...config import ConfigError, DownscaleConfig, load_config, read_plugin_toml
from ...quality import first_reach, monotone_fit, value_at

if TYPE_CHECKING:  # the lab's dependencies (diffusers, peft) load only when the demo runs
    from .adapter import LabPlugin
    from .twin import BudgetRun

# The default: the style's map on the shipped base read at ε = 0.2 (docs/fidelity/quality/windows/style_eps0.2.toml,
# from docs/fidelity/multires/style_t1024/map.json), under the lab trainer's own σ sampler (sd-scripts' recommended
# Flux recipe, shift 3.1582). Of the concepts mapped, it is the one whose default windows route the most (85 % of
# the steps; the subject's 19 %, the posters' none). Tiers count lab latents at Flux's 8 px per cell, as the map
# writes them: the 512 px tier is every lab bucket.
DEMO_WINDOWS = {
    "arch": "flux",
    "routes": [
        {"route": "512:256", "sigma_min": 0.0, "sigma_max": 0.075},
        {"route": "512:256", "sigma_min": 0.9, "sigma_max": 1.0},
        {"route": "512:384", "sigma_min": 0.0, "sigma_max": 0.5},
        {"route": "512:384", "sigma_min": 0.633333333333},
    ],
}
# `--seed_recipe`: the seed paper's stacked recipe in lab pixels (a 0.75 route inside a window, a 0.875
# route above σ 0.5), uncertified for the lab model.
DEMO_ROUTES = (
    {"route": "256:192", "sigma_min": 0.65, "sigma_max": 0.95},
    {"route": "256:224", "sigma_min": 0.5},
)
DEMO_BASE = "multires"  # the shipped multi-size lab base (lab/base.py)
DEMO_CONCEPT = (
    "concept: style (a colour grade and a halftone screen) on the shipped lab base 'multires': of the concepts mapped "
    "on that base, the one whose windows at the default ε = 0.2 route the most steps (85 %; the subject's 19 %, the "
    "hatched posters' none)"
)
QUALITY = 0.9  # the time-to-quality target: this share of the native run's improvement


@dataclass(frozen=True)
class DemoSettings:
    steps: int = 400
    batch_size: int = 1
    rank: int = 8
    lr: float = 1e-2  # the peak of the cosine schedule both twins follow over the FLOPs spent
    seed: int = 0
    seed_recipe: bool = False  # the seed paper's routes instead of the certified windows
    val_points: int = 12  # per native-run FLOPs, besides the one before the first step


# CI size: each validation point is 20 native-grid forwards of the lab DiT, more than a quick run's training
QUICK = DemoSettings(steps=16, rank=4, val_points=3)


@dataclass
class DemoResult:
    settings: DemoSettings
    config: DownscaleConfig
    native: BudgetRun
    routed: BudgetRun
    plugin: LabPlugin

    @property
    def base(self) -> float:
        return self.native.val[0]  # before the first step: the base model's loss

    @property
    def improvement(self) -> float:
        """The native run's improvement: base − the end of its monotone fit (its plateau)."""
        return self.base - monotone_fit(self.native.val)[-1]

    def reach(self, run: BudgetRun, column: str) -> float | None:
        """When ``run``'s fitted curve reaches ``QUALITY`` of the native improvement: FLOPs (native-run units) or seconds."""
        xs = [f / self.native.native_flops for f in run.flops] if column == "flops" else run.seconds
        return first_reach(xs, monotone_fit(run.val), self.base - QUALITY * self.improvement)

    @property
    def routed_at_equal_compute(self) -> float | None:
        return value_at(self.routed.flops, self.routed.val, self.native.flops[-1])


def run_demo(settings: DemoSettings, config: DownscaleConfig | None = None, progress: bool = True) -> DemoResult:
    from ...flops import FlopModel
    from ...lab.base import get_base, load_base
    from ...lab.concept import StyleData
    from ...lab.data import LabData, LabDataConfig
    from ...lab.model import flop_shape
    from ...lab.trainer import native_validation_losses
    from .adapter import LabPlugin
    from .twin import cosine_decay, run_to_budget

    model_cfg = get_base(DEMO_BASE).model
    base = LabData(LabDataConfig(latent_channels=model_cfg.latent_channels))
    model = load_base(DEMO_BASE)  # shipped weights, digest checked: nothing to pretrain
    data = StyleData(base)
    config = config or load_config(table={"routes": list(DEMO_ROUTES)} if settings.seed_recipe else DEMO_WINDOWS)
    plugin = LabPlugin.for_lab(config, model_cfg, data, settings.batch_size)
    val_set = data.validation_set(per_bucket=1, seed=settings.seed)
    common = dict(
        seed=settings.seed, native_steps=settings.steps, points=settings.val_points, lr=settings.lr, rank=settings.rank,
        validate=lambda deltas: native_validation_losses(model, deltas, val_set, settings.seed, (0.1, 0.35, 0.6, 0.85)),
        flop_model=FlopModel(*flop_shape(model_cfg)), batch_size=settings.batch_size, schedule=cosine_decay,
        clock=time.perf_counter, budget=1.0,  # the schedule's lr is zero from the native run's FLOPs on
    )  # fmt: skip
    if progress:
        print(f"training the native twin ({settings.steps} steps) and the routed twin (to the same FLOPs) ...", flush=True)
    native = run_to_budget(model, data, None, **common)
    routed = run_to_budget(model, data, plugin, **common)
    return DemoResult(settings=settings, config=config, native=native, routed=routed, plugin=plugin)


def _num(value: float | None, fmt: str) -> str:
    return "not reached" if value is None else format(value, fmt)


def format_result(r: DemoResult) -> str:
    acc, plan = r.plugin.accounting, r.plugin.plan
    s = r.settings
    n_native, n_routed = len(r.native.tokens_run), len(r.routed.tokens_run)
    rows = [
        ("steps (batch size)", f"{n_native} ({s.batch_size})", f"{n_routed} ({s.batch_size})"),
        ("training FLOPs (the native run's = 1)", "1.00", f"{r.routed.flops[-1] / r.native.native_flops:.2f}"),
        ("wall seconds (fwd+bwd+opt)", f"{r.native.seconds[-1]:.1f}", f"{r.routed.seconds[-1]:.1f}"),
        ("FLOP-model saving per step: realized / predicted", "", f"{100 * acc.flop_saving():.1f} % / {100 * plan.flop_saving:.1f} %"),
    ]
    fractions = acc.fractions()
    for i, rule in enumerate(r.config.routes):
        rows.append((f"route r{i} {rule.label} {rule.window_text()}: realized / predicted", "", _pair(fractions[i], plan.probs[i])))
    rows.append(("native steps: realized / predicted", "100.0 %", _pair(fractions[-1], plan.probs[-1])))
    rows.append((
        f"held-out validation loss at the native run's FLOPs (base {r.base:.4f})",
        f"{r.native.val[-1]:.4f}",
        _num(r.routed_at_equal_compute, ".4f"),
    ))  # fmt: skip
    native_flops, routed_flops = r.reach(r.native, "flops"), r.reach(r.routed, "flops")
    native_s, routed_s = r.reach(r.native, "seconds"), r.reach(r.routed, "seconds")
    target = f"{round(100 * QUALITY)} % of native's improvement ({r.improvement:.4f})"
    rows.append((f"time to {target}: FLOPs (native run = 1)", _num(native_flops, ".2f"), _num(routed_flops, ".2f")))
    rows.append((f"time to {round(100 * QUALITY)} %: wall seconds", _num(native_s, ".1f"), _num(routed_s, ".1f")))
    if native_flops and routed_flops:
        rows.append((f"time to {round(100 * QUALITY)} %, routed ÷ native: FLOPs / wall seconds", "",
                     f"{routed_flops / native_flops:.2f} / {routed_s / native_s:.2f}"))  # fmt: skip
    width = max(len(name) for name, _, _ in rows) + 2
    lines = [f"{'':<{width}}{'native':>12}{'plugin':>20}"]
    lines += [f"{name:<{width}}{a:>12}{b:>20}" for name, a, b in rows]
    return "\n".join(lines)


def _pair(realized: float, predicted: float) -> str:
    return f"{100 * realized:.1f} % / {100 * predicted:.1f} %"


def plot_result(r: DemoResult, path: str) -> None:
    """Held-out validation loss of both twins against training FLOPs (the native run's = 1) with the
    time-to-quality target, and the route timeline (tokens each plugin step ran at)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_route) = plt.subplots(2, 1, figsize=(9, 6), gridspec_kw={"height_ratios": [2, 1]})
    for run, name in ((r.native, "native"), (r.routed, "plugin")):
        x = [f / r.native.native_flops for f in run.flops]
        ax_loss.plot(x, run.val, marker="o", markersize=3, label=f"{name}: {len(run.tokens_run)} steps, {run.seconds[-1]:.1f} s")
    ax_loss.axvline(1.0, color="black", linewidth=0.8, linestyle="--", label="equal compute")
    ax_loss.axhline(r.base - QUALITY * r.improvement, color="grey", linewidth=0.8, linestyle=":",
                    label=f"{round(100 * QUALITY)} % of native's improvement")  # fmt: skip
    ax_loss.set_xlabel("training FLOPs (FLOP model), in units of the native run's")
    ax_loss.set_ylabel("held-out native-grid validation loss")
    ax_loss.legend()
    labels = [f"r{i} {rule.label}" for i, rule in enumerate(r.config.routes)] + ["native"]
    for idx, label in zip([*range(len(r.config.routes)), -1], labels, strict=True):
        pts = [(t.step - 1, t.tokens_run) for t in r.plugin.trace if t.rule_index == idx]
        if pts:
            ax_route.scatter(*zip(*pts, strict=True), s=8, label=label)
    ax_route.set_xlabel("step")
    ax_route.set_ylabel("tokens run")
    ax_route.legend(fontsize="small", ncol=len(labels))
    native, routed = r.reach(r.native, "flops"), r.reach(r.routed, "flops")
    ratio = (
        f"FLOPs to {round(100 * QUALITY)} % quality, routed ÷ native: {routed / native:.2f}"
        if native and routed
        else "routed twin: target not reached"
    )
    fig.suptitle(f"lab LoRA twins on a new concept: {ratio}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="CI size: a short fine-tune")
    parser.add_argument("--steps", type=int, help=f"fine-tune steps per run (default {DemoSettings.steps}, quick {QUICK.steps})")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--config", metavar="PLUGIN_TOML", help="plugin TOML with routes in lab pixels (default: the style map's windows at ε = 0.2)"
    )
    parser.add_argument(
        "--seed_recipe",
        action="store_true",
        help="the seed paper's uncertified routes instead of the certified windows; on the concept it costs quality",
    )
    parser.add_argument("--out", default="downscale_demo.png", help="PNG with loss curves and the route timeline")
    parser.add_argument("--no-progress", dest="progress", action="store_false")


def run(args: argparse.Namespace) -> int:
    base = QUICK if args.quick else DemoSettings()
    steps = base.steps if args.steps is None else args.steps
    if steps < 1 or args.batch_size < 1:
        return fail([f"--steps and --batch_size must be >= 1 (got {steps}, {args.batch_size})"])
    if args.config and args.seed_recipe:
        return fail(["--config and --seed_recipe: give one (--seed_recipe is a router of its own)"])
    try:
        config = load_config(plugin_toml=read_plugin_toml(args.config)) if args.config else None
    except ConfigError as err:
        return fail(err.problems)
    settings = DemoSettings(
        steps=steps,
        batch_size=args.batch_size,
        rank=base.rank,
        lr=base.lr,
        seed=args.seed,
        seed_recipe=args.seed_recipe,
        val_points=base.val_points,
    )
    start = time.perf_counter()
    result = run_demo(settings, config, progress=args.progress)
    print(f"{DEMO_CONCEPT}\n")
    print(format_result(result))
    print()
    print(result.plugin.accounting.summary_text())
    plot_result(result, args.out)
    print(f"\nplot: {args.out}   total demo time {time.perf_counter() - start:.0f} s")
    return 0
