"""Router cost per train step, against the host's own σ draw (a benchmark, not a test).

The host draw is what sd-scripts' flux sampler does for ``sigmoid`` / ``flux_shift``: ``randn`` on
a tensor, sigmoid, then the time-shift with μ from the latent's token count. The router forks the
RNG, makes that draw, and (coupled, B > 1) a seeded lead draw and conditioned redraws.

    python benchmarks/bench_router.py [--steps 20000] [--device cpu|cuda]

On CPU the figures are process CPU time per step (wall time on a CUDA device).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from downscale_plugin.config import RouteRule
from downscale_plugin.router import Router

RULES = (RouteRule(0.65, 0.95, native=1024, target=768), RouteRule(0.5, None, native=1024, target=896))
LATENT_HW = (128, 128)  # a 1024 px Flux bucket


def host_draw(mode: str, latent_hw: tuple[int, int], device: torch.device):
    """sd-scripts ``get_noisy_model_input_and_timesteps``' σ for ``sigmoid`` and ``flux_shift``."""
    h, w = latent_hw
    slope = (1.15 - 0.5) / (4096 - 256)
    mu = slope * ((h // 2) * (w // 2)) + 0.5 - slope * 256

    def draw(n: int) -> torch.Tensor:
        sigmas = torch.randn((n,), device=device).sigmoid()
        if mode == "flux_shift":
            sigmas = math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1) ** 1.0)
        return sigmas

    return draw


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_call_us(fn, steps: int, device: torch.device) -> float:
    for i in range(min(500, steps)):
        fn(i + 1)
    _sync(device)
    clock = time.perf_counter if device.type == "cuda" else time.process_time  # CPU: robust to a shared machine
    start = clock()
    for i in range(steps):
        fn(i + 1)
    _sync(device)
    return (clock() - start) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    print(f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} threads, {args.steps} steps per case")
    print(f"{'sampler':<11}{'gate':<9}{'B':>3}{'router µs/step':>16}{'host draw µs':>14}{'ratio':>8}")
    for mode in ("sigmoid", "flux_shift"):
        draw = host_draw(mode, LATENT_HW, device)
        for gate, batch in (("coupled", 8), ("strict", 8), ("coupled", 1), ("strict", 1)):
            router = Router(RULES, "flux", gate=gate, seed=0, devices=devices)
            bare = per_call_us(lambda _step, d=draw, b=batch: d(b), args.steps, device)
            routed = per_call_us(lambda step, d=draw, r=router, b=batch: r.route(d, b, LATENT_HW, step), args.steps, device)
            print(f"{mode:<11}{gate:<9}{batch:>3}{routed:>16.1f}{bare:>14.1f}{routed / bare:>8.1f}")


if __name__ == "__main__":
    main()
