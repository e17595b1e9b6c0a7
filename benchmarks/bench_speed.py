"""Wall-clock saving of routed LoRA training vs native on the lab DiT, measured side by side.

For each cell (batch size × σ sampler × gate) the same LoRA fine-tune runs natively and with the
plugin, alternating in rounds inside one process so drift in machine speed hits both alike. Per cell:
the measured wall saving, the FLOP model's prediction for the plan (``plan``'s route odds), the
FLOP saving of the routes that actually fired, and the ratios. A last cell measures the plugin's
overhead when nothing routes (a window of zero mass: dry-run draw + router + wrapper only).

    python benchmarks/bench_speed.py              # the committed RESULTS.md
    python benchmarks/bench_speed.py --steps 8 --rounds 1   # a smoke run
    python benchmarks/bench_speed.py --overhead_only        # just the nothing-routes cells
    python benchmarks/bench_speed.py --batch_sizes 4 --samplers flux_shift --gates strict   # one cell
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from downscale_plugin.config import load_config
from downscale_plugin.flops import FlopModel
from downscale_plugin.hosts.lab.adapter import LabPlugin
from downscale_plugin.lab.data import LabData, LabDataConfig
from downscale_plugin.lab.model import LabModelConfig, flop_shape
from downscale_plugin.lab.pretrain import load_or_pretrain
from downscale_plugin.lab.trainer import train_lora

STACKED = [
    {"route": "256:192", "sigma_min": 0.65, "sigma_max": 0.95},  # the 0.75 route inside its window
    {"route": "256:224", "sigma_min": 0.5},  # the 0.875 route above σ 0.5
]
NEVER = [{"route": "256:192", "sigma_min": 0.999999, "sigma_max": 0.9999995}]  # zero mass: nothing routes
SAMPLERS = {
    "sigmoid": {"timestep_sampling": "sigmoid", "sigmoid_scale": 1.0},
    "flux_shift": {"timestep_sampling": "flux_shift", "sigmoid_scale": 1.0},
}


def run_cell(model, data, model_cfg, routes, gate, sampler, batch_size, steps, rounds, seed):
    """Alternate native and routed runs; return summed wall times and the plugin's figures."""
    cfg = load_config(table={"gate": gate, "routes": routes})
    buckets = [data.cfg.latent_hw(b) for b in data.cfg.buckets]
    native_s = routed_s = 0.0
    flop_realized = []
    plugin = None
    for r in range(rounds):
        plugin = LabPlugin(cfg, FlopModel(*flop_shape(model_cfg)), buckets, batch_size)
        common = dict(steps=steps, lr=1e-3, rank=8, seed=seed + r, args_overrides=SAMPLERS[sampler], batch_size=batch_size)
        pair = [("native", None), ("routed", plugin.installer)]
        if r % 2:
            pair.reverse()
        for name, installer in pair:
            wall = train_lora(model, data, hook_installer=installer, **common).wall_time
            if name == "native":
                native_s += wall
            else:
                routed_s += wall
        flop_realized.append(plugin.accounting.flop_saving())
    return {
        "native_s": native_s,
        "routed_s": routed_s,
        "saving": 1.0 - routed_s / native_s,
        "predicted": plugin.plan.flop_saving,
        "realized_flops": sum(flop_realized) / len(flop_realized),
        "routed_frac": plugin.accounting.demote_fraction(),
        "predicted_frac": 1.0 - plugin.plan.probs[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="native/routed alternations per cell")
    parser.add_argument("--batch_sizes", default="1,4")
    parser.add_argument("--samplers", default=",".join(SAMPLERS), help="σ samplers of the routed cells")
    parser.add_argument("--gates", default="coupled,strict", help="gates of the routed cells")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overhead_only", action="store_true", help="skip the routed cells")
    args = parser.parse_args()
    for key, given, allowed in (("--samplers", args.samplers, SAMPLERS), ("--gates", args.gates, ("coupled", "strict"))):
        bad = [v for v in given.split(",") if v not in allowed]
        if bad:
            parser.error(f"{key}: {bad} not allowed (allowed: {', '.join(allowed)})")
    model_cfg = LabModelConfig()
    data = LabData(LabDataConfig(latent_channels=model_cfg.latent_channels))
    model = load_or_pretrain(model_cfg, progress=False, data=data)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads); lab DiT {model_cfg}; {args.steps} steps × {args.rounds} rounds per arm"
    )
    header = "| B | σ sampler | gate | routed (pred.) | native s | plugin s | wall saved | FLOP model: plan | wall/plan | FLOPs of routes run | wall/run |"
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    b1_plan = {}
    start = time.perf_counter()
    for batch_size in (int(b) for b in args.batch_sizes.split(",")) if not args.overhead_only else ():
        for sampler in args.samplers.split(","):
            for gate in args.gates.split(","):
                c = run_cell(model, data, model_cfg, STACKED, gate, sampler, batch_size, args.steps, args.rounds, args.seed)
                if batch_size == 1:
                    b1_plan[(sampler, gate)] = c["predicted"]
                ref = b1_plan.get((sampler, gate), c["predicted"])
                print(
                    f"| {batch_size} | {sampler} | {gate} | {100 * c['routed_frac']:.0f} % ({100 * c['predicted_frac']:.0f} %) "
                    f"| {c['native_s']:.1f} | {c['routed_s']:.1f} | {100 * c['saving']:.1f} % | {100 * c['predicted']:.1f} % "
                    f"| {c['saving'] / c['predicted']:.2f} (vs B=1 plan {c['saving'] / ref:.2f}) "
                    f"| {100 * c['realized_flops']:.1f} % | {c['saving'] / c['realized_flops']:.2f} |",
                    flush=True,
                )
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        c = run_cell(model, data, model_cfg, NEVER, "coupled", "sigmoid", batch_size, args.steps, args.rounds, args.seed)
        hook_s, hook_c = hook_cost(batch_size, data), hook_cost(batch_size, data, contiguous=True)
        step_s = c["native_s"] / (args.steps * args.rounds)
        print(f"overhead when nothing routes, B={batch_size}: native {c['native_s']:.1f} s, plugin {c['routed_s']:.1f} s, "
              f"end to end {-100 * c['saving']:+.2f} %; the hook's own work {1e3 * hook_s:.2f} ms/step "
              f"= {100 * hook_s / step_s:.2f} % of a native step ({1e3 * hook_c:.2f} ms = {100 * hook_c / step_s:.2f} % "
              "with contiguous latents)", flush=True)  # fmt: skip
    print(f"total {time.perf_counter() - start:.0f} s")


def hook_cost(batch_size: int, data: LabData, steps: int = 500, contiguous: bool = False) -> float:
    """Seconds per step the hook adds when nothing routes: bind the sampler, dry-run draw, route.

    Lab batches are channels-last views; torch's CPU ``normal_`` takes a serial path ~10× slower on
    a non-contiguous tensor, and the dry run must draw the host's noise in the host's layout.
    ``contiguous=True`` prices it for contiguous latents (sd-scripts stacks its cached latents).
    """
    from downscale_plugin.hosts.lab.adapter import LAB_ARCH
    from downscale_plugin.hosts.sd_scripts.families import FlowFamily
    from downscale_plugin.lab import flux_train_utils
    from downscale_plugin.lab.trainer import lab_args, make_noise_scheduler
    from downscale_plugin.router import Router

    args = lab_args(**SAMPLERS["sigmoid"])
    router = Router.from_config(load_config(table={"routes": NEVER}), LAB_ARCH, seed=0, total_forwards=steps)
    family, scheduler = FlowFamily(flux_train_utils, "flux"), make_noise_scheduler(args)
    latents = data.batch(0, batch_size, 0)["latents"]
    latents = latents.contiguous() if contiguous else latents
    start = time.perf_counter()
    for step in range(1, steps + 1):
        bound = family.bind(args, scheduler, latents, "cpu", torch.float32)
        router.route(bound.draw, batch_size, tuple(latents.shape[-2:]), step, first=bound.first)
    return (time.perf_counter() - start) / steps


if __name__ == "__main__":
    main()
