"""Wall time of ``benchmarks/gpu_check.sh`` on one GPU, estimated before a GPU is lent.

Each part's device work from the FLOP model (``downscale_plugin/flops.py``, ``arch_flops``: forward, backward and
gradient checkpointing of one LoRA step at the run's tokens) at ``--tflops`` effective bf16 TFLOP/s (default 400: half
an H100's dense bf16 peak, a little over half what a large matrix product reached there, for steps at batch size 1
whose routed grids and attention run below the peak), plus what does not shrink on a GPU, taken from a CPU smoke run of
the same script (``gpu_check.sh OUT --cpu-smoke``, whose JSON files ``--smoke OUT`` reads): the install, each process's
start-up and imports, the models' building and the plugin's start (a step's time subtracted), and the RNG and memory
parts whole (their device work at smoke sizes counted as overhead: an upper bound), plus ``--cuda_init`` seconds for
each process's CUDA start. Parts:

- production: per architecture (warmup + reps) rounds of the four arms (native, r0.875, r0.75, never) at 1 024 px,
  the published depth and production text lengths, gradient checkpointing where ``--checkpointed`` names it;
- rng: Flux at the reduced depth, 1 024 px: ``--rng_steps`` steps of five runs (three native where native does not
  repeat itself, unrouted, routed);
- certify_memory: a 20 M-parameter synthetic adapter: its device work is negligible; four processes.

    python benchmarks/gpu_time_estimate.py --smoke OUT_OF_A_SMOKE_RUN
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from downscale_plugin.arch import get_arch
from downscale_plugin.flops import arch_flops
from downscale_plugin.grid import target_grid, tokens

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TEXT = {
    "flux": {"text_tokens": 512},
    "sd3": {"t5_tokens": 256},
    "lumina": {"text_tokens": 256},
    "anima": {"t5_tokens": 512, "qwen_tokens": 512},
}
ARMS = {"native": 1.0, "r0.875": 0.875, "r0.75": 0.75, "never": 1.0}  # the arms and the grid each runs at


def step_flops(arch: str, ratio: float, *, reduced: bool, checkpointing: bool, px: int = 1024) -> float:
    """FLOPs of one LoRA step (rank 16) of ``arch`` at ``px`` on the grid ``ratio`` routes to."""
    spec = get_arch(arch)
    side = px // spec.vae_factor
    grid = (side, side) if ratio == 1.0 else target_grid((side, side), ratio, spec)
    model = arch_flops(arch, reduced=reduced, lora_rank=16, checkpointing=checkpointing, **TEXT[arch])
    return model.flops(tokens(grid, spec))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", required=True, help="the OUT folder of a gpu_check.sh --cpu-smoke run")
    parser.add_argument("--tflops", type=float, default=400.0, help="effective bf16 TFLOP/s of one step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--checkpointed", default="flux")
    parser.add_argument("--rng_steps", type=int, default=3)
    parser.add_argument("--cuda_init", type=float, default=10.0, help="seconds of CUDA start-up a process")
    args = parser.parse_args()
    with open(os.path.join(args.smoke, "gpu_check.json")) as fh:
        smoke = json.load(fh)
    with open(os.path.join(args.smoke, "production.json")) as fh:
        production = json.load(fh)
    rate = args.tflops * 1e12
    seconds = {"install": smoke["parts"]["install"]["seconds"]}

    # production: the smoke's time less its steps is start-up and set-up; the device adds its steps' FLOPs
    smoke_steps = sum(sum(sum(t) for t in a["times_s"].values()) for a in production["archs"])
    overhead = smoke["parts"]["production"]["seconds"] - smoke_steps + args.cuda_init
    rounds = args.warmup + args.reps
    compute = {
        arch: rounds
        * sum(step_flops(arch, r, reduced=False, checkpointing=arch in args.checkpointed.split(",")) for r in ARMS.values())
        / rate
        for arch in ("sd3", "anima", "lumina", "flux")
    }
    seconds["production"] = overhead + sum(compute.values())
    # rng: five runs of the reduced Flux; the smoke's whole part counts as overhead
    rng_compute = args.rng_steps * (
        4 * step_flops("flux", 1.0, reduced=True, checkpointing=False) + step_flops("flux", 0.75, reduced=True, checkpointing=False)
    )
    seconds["rng"] = smoke["parts"]["rng"]["seconds"] + args.cuda_init + rng_compute / rate
    seconds["certify_memory"] = smoke["parts"]["certify_memory"]["seconds"] + 4 * args.cuda_init  # a process a setting
    total = sum(seconds.values())
    for arch, s in compute.items():
        print(f"production {arch}: {rounds} rounds x 4 arms, {s:.1f} s of steps at {args.tflops:g} TFLOP/s")
    for name, s in seconds.items():
        print(f"{name}: {s:.0f} s")
    print(f"total {total:.0f} s = {total / 60:.1f} min (smoke run at {smoke['revision']}, {smoke['total_seconds']} s on its CPU)")
    revision = subprocess.run(["git", "-C", HERE, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(
        json.dumps(
            {"command": "python " + " ".join(sys.argv), "revision": revision, "tflops": args.tflops, "seconds": seconds, "total_s": total}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
