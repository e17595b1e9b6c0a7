"""``python -m downscale_plugin demo``: the embedded default, end to end on the CPU.

The router is the lab map's certified windows at ε = 0.05 under the lab trainer's own σ sampler
(``--seed_recipe``: the seed paper's uncertified recipe and sampler, the former default, which on
the lab costs quality; docs/FIDELITY.md §10). Pretrains the lab DiT if it is not cached, then LoRA
fine-tunes it twice as twins
(``hosts/lab/twin.py``: same seed, data order, σ draws and noise) — natively, and with the plugin
routing σ-windowed steps to smaller grids through the same host hook sd-scripts runs. The routed
twin keeps training past the native step count until it has spent the native run's training FLOPs,
so the table compares the adapters where a user decides: at equal steps and at equal compute. It
prints wall time saved, the FLOP model's prediction, realized vs predicted route fractions, the
native-grid validation loss of both adapters at equal steps and at equal compute, and the cosine
between their weight deltas. A PNG shows each adapter's native-grid validation loss against the
training FLOPs spent (a routed step's train loss is measured at another grid, so train-loss curves
do not compare), and the route timeline.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...cli import fail
from ...config import ConfigError, DownscaleConfig, load_config, read_plugin_toml
from .quality import value_at

if TYPE_CHECKING:  # the lab's dependencies (diffusers, peft) load only when the demo runs
    from ...lab.trainer import LoraResult
    from .adapter import LabPlugin

# The default: the lab map's windows at ε = 0.05 (docs/fidelity/quality/windows_eps0.05.toml, from
# docs/fidelity/lab_n64_d8_n16/map.json), under the lab trainer's own σ sampler (sd-scripts'
# recommended Flux recipe, shift 3.1582). Tiers count lab latents at Flux's 8 px per cell, as the map
# writes them: the 512 px tier is every lab bucket. On the lab their quality cost is within the
# seed lottery; they save little (docs/FIDELITY.md §10).
DEMO_WINDOWS = {
    "arch": "flux",
    "routes": [{"route": "512:384", "sigma_min": 0.975, "sigma_max": 1.0}, {"route": "512:448", "sigma_min": 0.925}],
}
# `--seed_recipe`, the demo's former default: the seed paper's stacked recipe in lab pixels (a 0.75
# route inside a window, a 0.875 route above σ 0.5), uncertified for the lab model. At equal steps
# it loses more than half of the native run's improvement there (docs/FIDELITY.md §10).
DEMO_ROUTES = (
    {"route": "256:192", "sigma_min": 0.65, "sigma_max": 0.95},
    {"route": "256:224", "sigma_min": 0.5},
)
# The seed paper's σ sampler (with --seed_recipe): logit-normal(0, 1), no shift.
DEMO_SAMPLING = {"timestep_sampling": "sigmoid", "sigmoid_scale": 1.0}


@dataclass(frozen=True)
class DemoSettings:
    steps: int = 240
    batch_size: int = 1
    rank: int = 8
    lr: float = 2e-3
    seed: int = 0
    quick: bool = False
    seed_recipe: bool = False  # the seed paper's routes and σ sampler instead of the certified windows
    val_points: int = 12  # the picture's validation points per run, besides the one before the first step


# CI size: each validation point is 25 native-grid forwards of the lab DiT, more than a quick run's training
QUICK = DemoSettings(steps=16, rank=4, quick=True, val_points=3)


@dataclass
class DemoResult:
    """Both twins; ``*_flops``: cumulative training FLOPs after each step (the FLOP model's)."""

    settings: DemoSettings
    config: DownscaleConfig
    native: LoraResult
    routed: LoraResult
    plugin: LabPlugin
    native_flops: list[float]
    routed_flops: list[float]
    cosine: float  # the routed adapter at its last step (past equal compute) to the native one

    @property
    def val_base(self) -> float:
        return self.native.val_curve[0][2]  # before the first step: the base model's loss

    @property
    def val_native(self) -> float:
        return self.native.val_curve[-1][2]

    @property
    def val_routed(self) -> float:
        """The routed twin at the native run's step count (equal steps)."""
        return next(loss for _, steps, loss in self.routed.val_curve if steps == self.settings.steps)

    def routed_curve(self, column: int) -> tuple[list[float], list[float]]:
        """(training FLOPs, ``column`` of the routed val curve: 0 seconds, 2 loss) at each validation point."""
        return [self.routed_flops[steps - 1] if steps else 0.0 for _, steps, _ in self.routed.val_curve], [
            row[column] for row in self.routed.val_curve
        ]

    @property
    def val_routed_compute(self) -> float | None:
        """The routed twin's loss read off (linearly) at the native run's FLOPs: equal compute."""
        return value_at(*self.routed_curve(2), self.native_flops[-1])

    @property
    def seconds_routed_compute(self) -> float | None:
        return value_at(*self.routed_curve(0), self.native_flops[-1])

    @property
    def wall_saved(self) -> float:
        """At equal steps: the routed twin's seconds for the native run's steps."""
        return 1.0 - sum(self.routed.step_times[: self.settings.steps]) / self.native.wall_time


def run_demo(settings: DemoSettings, config: DownscaleConfig | None = None, progress: bool = True) -> DemoResult:
    from ...lab.data import LabData, LabDataConfig
    from ...lab.model import LabModelConfig
    from ...lab.pretrain import load_or_pretrain
    from ...lab.trainer import delta_cosine, lab_args, native_validation_loss, train_lora
    from .adapter import LabPlugin
    from .twin import TwinRun, equal_compute_steps, planned_saving

    model_cfg = LabModelConfig()
    data = LabData(LabDataConfig(latent_channels=model_cfg.latent_channels))
    model = load_or_pretrain(model_cfg, quick=settings.quick, progress=progress, data=data)
    config = config or load_config(table={"routes": list(DEMO_ROUTES)} if settings.seed_recipe else DEMO_WINDOWS)
    sampling = DEMO_SAMPLING if settings.seed_recipe else {}
    plugin = LabPlugin.for_lab(config, model_cfg, data, settings.batch_size)
    common = dict(
        model=model,
        data=data,
        steps=settings.steps,
        lr=settings.lr,
        rank=settings.rank,
        seed=settings.seed,
        args_overrides=sampling,
        batch_size=settings.batch_size,
    )
    val_set = data.validation_set(per_bucket=2, seed=settings.seed)
    common["validate"] = lambda deltas: native_validation_loss(model, deltas, val_set, settings.seed)
    every = max(1, settings.steps // settings.val_points)
    common["validate_at"] = {*range(every, settings.steps + 1, every), settings.steps}  # and each run's last step
    routed_steps = equal_compute_steps(settings.steps, planned_saving(plugin, lab_args(**sampling), settings.steps))
    twins = TwinRun(settings.seed, plugin.flop_model, settings.batch_size), TwinRun(settings.seed, plugin.flop_model, settings.batch_size)
    native = train_lora(**common, step_scope=twins[0], on_step=_progress("native", settings.steps, progress))
    common["steps"] = routed_steps
    routed = train_lora(**common, step_scope=twins[1], on_step=_progress("plugin", routed_steps, progress), hook_installer=plugin.installer)
    return DemoResult(
        settings=settings,
        config=config,
        native=native,
        routed=routed,
        plugin=plugin,
        native_flops=twins[0].flops()[0],
        routed_flops=twins[1].flops(plugin)[0],
        cosine=delta_cosine(native.deltas, routed.deltas),
    )


def _progress(name: str, steps: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    bar = tqdm(total=steps, desc=f"LoRA {name}", unit="step", leave=False)

    def on_step(step: int, logs: dict[str, float]) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{logs['loss/average']:.4f}")
        if step == steps - 1:
            bar.close()

    return on_step


def format_result(r: DemoResult) -> str:
    acc, plan = r.plugin.accounting, r.plugin.plan
    s = r.settings
    routed_steps = len(r.routed.losses)
    at_compute, seconds = r.val_routed_compute, r.seconds_routed_compute
    rows = [
        ("steps (batch size)", f"{s.steps} ({s.batch_size})", f"{s.steps} + {routed_steps - s.steps} ({s.batch_size})"),
        (
            "wall seconds (fwd+bwd+opt) for the native run's steps",
            f"{r.native.wall_time:.1f}",
            f"{sum(r.routed.step_times[: s.steps]):.1f}",
        ),
        ("wall saved at equal steps", "", f"{100 * r.wall_saved:.1f} %"),
        ("FLOP-model saving: realized / predicted", "", f"{100 * acc.flop_saving():.1f} % / {100 * plan.flop_saving:.1f} %"),
    ]
    fractions = acc.fractions()
    for i, rule in enumerate(r.config.routes):
        rows.append((f"route r{i} {rule.label} {rule.window_text()}: realized / predicted", "", _pair(fractions[i], plan.probs[i])))
    rows.append(("native steps: realized / predicted", "100.0 %", _pair(fractions[-1], plan.probs[-1])))
    rows.append((f"native-grid validation loss at equal steps (base {r.val_base:.4f})", f"{r.val_native:.4f}", f"{r.val_routed:.4f}"))
    rows.append((
        "native-grid validation loss at equal compute (the native run's FLOPs)",
        f"{r.val_native:.4f}",
        "not reached" if at_compute is None else f"{at_compute:.4f}",
    ))  # fmt: skip
    if seconds is not None:
        rows.append(("wall seconds at equal compute", f"{r.native.wall_time:.1f}", f"{seconds:.1f}"))
    rows.append(("cosine of ΔW to the native adapter (routed: its last step)", "1", f"{r.cosine:.3f}"))
    width = max(len(name) for name, _, _ in rows) + 2
    lines = [f"{'':<{width}}{'native':>12}{'plugin':>20}"]
    lines += [f"{name:<{width}}{a:>12}{b:>20}" for name, a, b in rows]
    return "\n".join(lines)


def _pair(realized: float, predicted: float) -> str:
    return f"{100 * realized:.1f} % / {100 * predicted:.1f} %"


def plot_result(r: DemoResult, path: str) -> None:
    """Native-grid validation loss of both adapters against training FLOPs (equal compute at 1), and
    the route timeline (tokens each plugin step ran at)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_route) = plt.subplots(2, 1, figsize=(9, 6), gridspec_kw={"height_ratios": [2, 1]})
    total = r.native_flops[-1]
    for result, flops, name in ((r.native, r.native_flops, "native"), (r.routed, r.routed_flops, "plugin")):
        x = [flops[steps - 1] / total if steps else 0.0 for _, steps, _ in result.val_curve]
        losses = [loss for _, _, loss in result.val_curve]
        label = f"{name}: {len(result.losses)} steps, {result.wall_time:.1f} s"
        ax_loss.plot(x, losses, marker="o", markersize=3, label=label)
    ax_loss.axvline(1.0, color="black", linewidth=0.8, linestyle="--", label="equal compute")
    ax_loss.axhline(r.val_base, color="grey", linewidth=0.8, linestyle=":", label="base model")
    ax_loss.set_xlabel("training FLOPs (FLOP model), as a fraction of the native run's")
    ax_loss.set_ylabel("native-grid validation loss")
    ax_loss.legend()
    labels = [f"r{i} {rule.label}" for i, rule in enumerate(r.config.routes)] + ["native"]
    for idx, label in zip([*range(len(r.config.routes)), -1], labels, strict=True):
        pts = [(t.step - 1, t.tokens_run) for t in r.plugin.trace if t.rule_index == idx]
        if pts:
            ax_route.scatter(*zip(*pts, strict=True), s=8, label=label)
    ax_route.set_xlabel("step")
    ax_route.set_ylabel("tokens run")
    ax_route.legend(fontsize="small", ncol=len(labels))
    at = r.val_routed_compute
    quality = "" if at is None else f", val. loss at equal compute {at - r.val_native:+.4f} vs native"
    fig.suptitle(f"lab LoRA twins: wall saved {100 * r.wall_saved:.1f} % at equal steps{quality}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="CI size: quick pretraining and a short fine-tune (about 1–1½ min on 2 cores)")
    parser.add_argument("--steps", type=int, help=f"fine-tune steps per run (default {DemoSettings.steps}, quick {QUICK.steps})")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--config", metavar="PLUGIN_TOML", help="plugin TOML with routes in lab pixels (default: the lab map's windows at ε = 0.05)"
    )
    parser.add_argument(
        "--seed_recipe",
        action="store_true",
        help="the seed paper's uncertified recipe (its routes and logit-normal σ sampler); on the lab it costs quality",
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
        quick=args.quick,
        seed_recipe=args.seed_recipe,
        val_points=base.val_points,
    )
    start = time.perf_counter()
    result = run_demo(settings, config, progress=args.progress)
    print(format_result(result))
    print()
    print(result.plugin.accounting.summary_text())
    plot_result(result, args.out)
    print(f"\nplot: {args.out}   total demo time {time.perf_counter() - start:.0f} s")
    return 0
