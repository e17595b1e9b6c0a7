"""``python -m downscale_plugin demo``: the embedded default, end to end on the CPU.

Pretrains the lab DiT if it is not cached, then LoRA fine-tunes it twice from the same seed and
data order — natively, and with the plugin routing σ-windowed steps to smaller grids through the
same host hook sd-scripts runs — and prints one table: wall time saved, the FLOP model's
prediction, realized vs predicted route fractions, native-grid validation loss of both adapters,
and the cosine between their weight deltas. A PNG shows what a user decides by: each adapter's
native-grid validation loss against the training seconds spent (a routed step's train loss is
measured at another grid, so train-loss curves do not compare), and the route timeline.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...cli import fail
from ...config import ConfigError, DownscaleConfig, load_config, read_plugin_toml

if TYPE_CHECKING:  # the lab's dependencies (diffusers, peft) load only when the demo runs
    from ...lab.trainer import LoraResult
    from .adapter import LabPlugin

# The seed paper's stacked recipe, in lab pixels: a 0.75 route inside a window, a 0.875 route above
# σ 0.5. Not certified for this model: `python -m downscale_plugin map --lab` measures that.
DEMO_ROUTES = (
    {"route": "256:192", "sigma_min": 0.65, "sigma_max": 0.95},
    {"route": "256:224", "sigma_min": 0.5},
)
# The seed paper's σ sampler: logit-normal(0, 1), no shift.
DEMO_SAMPLING = {"timestep_sampling": "sigmoid", "sigmoid_scale": 1.0}


@dataclass(frozen=True)
class DemoSettings:
    steps: int = 240
    batch_size: int = 1
    rank: int = 8
    lr: float = 2e-3
    seed: int = 0
    quick: bool = False
    val_points: int = 12  # the picture's validation points per run, besides the one before the first step


# CI size: each validation point is 25 native-grid forwards of the lab DiT, more than a quick run's training
QUICK = DemoSettings(steps=16, rank=4, quick=True, val_points=3)


@dataclass
class DemoResult:
    settings: DemoSettings
    config: DownscaleConfig
    native: LoraResult
    routed: LoraResult
    plugin: LabPlugin
    val_base: float
    val_native: float
    val_routed: float
    cosine: float

    @property
    def wall_saved(self) -> float:
        return 1.0 - self.routed.wall_time / self.native.wall_time


def run_demo(settings: DemoSettings, config: DownscaleConfig | None = None, progress: bool = True) -> DemoResult:
    from ...lab.data import LabData, LabDataConfig
    from ...lab.model import LabModelConfig
    from ...lab.pretrain import load_or_pretrain
    from ...lab.trainer import delta_cosine, native_validation_loss, train_lora
    from .adapter import LabPlugin

    model_cfg = LabModelConfig()
    data = LabData(LabDataConfig(latent_channels=model_cfg.latent_channels))
    model = load_or_pretrain(model_cfg, quick=settings.quick, progress=progress, data=data)
    config = config or load_config(table={"routes": list(DEMO_ROUTES)})
    plugin = LabPlugin.for_lab(config, model_cfg, data, settings.batch_size)
    common = dict(
        model=model,
        data=data,
        steps=settings.steps,
        lr=settings.lr,
        rank=settings.rank,
        seed=settings.seed,
        args_overrides=DEMO_SAMPLING,
        batch_size=settings.batch_size,
    )
    val_set = data.validation_set(per_bucket=2, seed=settings.seed)
    common["validate"] = lambda deltas: native_validation_loss(model, deltas, val_set, settings.seed)
    common["validate_every"] = max(1, settings.steps // settings.val_points)
    native = train_lora(**common, on_step=_progress("native", settings.steps, progress))
    routed = train_lora(**common, on_step=_progress("plugin", settings.steps, progress), hook_installer=plugin.installer)
    return DemoResult(
        settings=settings,
        config=config,
        native=native,
        routed=routed,
        plugin=plugin,
        val_base=native.val_curve[0][2],  # before the first step: the base model's loss
        val_native=native.val_curve[-1][2],
        val_routed=routed.val_curve[-1][2],
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
    rows = [
        ("steps (batch size)", f"{s.steps} ({s.batch_size})", f"{s.steps} ({s.batch_size})"),
        ("wall seconds (fwd+bwd+opt)", f"{r.native.wall_time:.1f}", f"{r.routed.wall_time:.1f}"),
        ("wall saved", "", f"{100 * r.wall_saved:.1f} %"),
        ("FLOP-model saving: realized / predicted", "", f"{100 * acc.flop_saving():.1f} % / {100 * plan.flop_saving:.1f} %"),
    ]
    fractions = acc.fractions()
    for i, rule in enumerate(r.config.routes):
        rows.append((f"route r{i} {rule.label} {rule.window_text()}: realized / predicted", "", _pair(fractions[i], plan.probs[i])))
    rows.append(("native steps: realized / predicted", "100.0 %", _pair(fractions[-1], plan.probs[-1])))
    rows.append((f"native-grid validation loss (base {r.val_base:.4f})", f"{r.val_native:.4f}", f"{r.val_routed:.4f}"))
    rows.append(("cosine of ΔW to the native adapter", "1", f"{r.cosine:.3f}"))
    width = max(len(name) for name, _, _ in rows) + 2
    lines = [f"{'':<{width}}{'native':>12}{'plugin':>20}"]
    lines += [f"{name:<{width}}{a:>12}{b:>20}" for name, a, b in rows]
    return "\n".join(lines)


def _pair(realized: float, predicted: float) -> str:
    return f"{100 * realized:.1f} % / {100 * predicted:.1f} %"


def plot_result(r: DemoResult, path: str) -> None:
    """Native-grid validation loss of both adapters against training seconds, and the route timeline
    (tokens each plugin step ran at)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_route) = plt.subplots(2, 1, figsize=(9, 6), gridspec_kw={"height_ratios": [2, 1]})
    for result, name in ((r.native, "native"), (r.routed, "plugin")):
        seconds, _, losses = zip(*result.val_curve, strict=True)
        ax_loss.plot(seconds, losses, marker="o", markersize=3, label=f"{name}: {result.wall_time:.1f} s for {r.settings.steps} steps")
    ax_loss.axhline(r.val_base, color="grey", linewidth=0.8, linestyle=":", label="base model")
    ax_loss.set_xlabel("training seconds (forward + backward + optimizer)")
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
    fig.suptitle(f"lab LoRA, native vs plugin: wall saved {100 * r.wall_saved:.1f} %, ΔW cosine {r.cosine:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="CI size: quick pretraining and a short fine-tune (about 1–1½ min on 2 cores)")
    parser.add_argument("--steps", type=int, help=f"fine-tune steps per run (default {DemoSettings.steps}, quick {QUICK.steps})")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", metavar="PLUGIN_TOML", help="plugin TOML with routes in lab pixels (default: the seed paper's recipe)")
    parser.add_argument("--out", default="downscale_demo.png", help="PNG with loss curves and the route timeline")
    parser.add_argument("--no-progress", dest="progress", action="store_false")


def run(args: argparse.Namespace) -> int:
    base = QUICK if args.quick else DemoSettings()
    steps = base.steps if args.steps is None else args.steps
    if steps < 1 or args.batch_size < 1:
        return fail([f"--steps and --batch_size must be >= 1 (got {steps}, {args.batch_size})"])
    try:
        config = load_config(plugin_toml=read_plugin_toml(args.config)) if args.config else None
    except ConfigError as err:
        return fail(err.problems)
    settings = DemoSettings(
        steps=steps, batch_size=args.batch_size, rank=base.rank, lr=base.lr, seed=args.seed, quick=args.quick, val_points=base.val_points
    )
    start = time.perf_counter()
    result = run_demo(settings, config, progress=args.progress)
    print(format_result(result))
    print()
    print(result.plugin.accounting.summary_text())
    plot_result(result, args.out)
    print(f"\nplot: {args.out}   total demo time {time.perf_counter() - start:.0f} s")
    return 0
