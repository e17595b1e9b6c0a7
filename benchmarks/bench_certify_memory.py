"""Peak extra memory of one certification, per adapter parameter (a benchmark, not a test).

A synthetic adapter of production size (default 20.1 M parameters: 204 rank-16 LoRA pairs at width
3 072, FLUX's) on a cheap model whose gradient is computed on ``--device``: the probe's latent, at
the route's grid when routed, noised with the step's ``randn_like`` noise (so the certifier pairs it),
pooled to 4×4, projected to the width by a frozen matrix, then through the LoRA stack; the loss is
the distance to half the clean latent's features (the noise is weak, so every bin ends safe). ``BackendDraws`` and ``run_certify`` run on it as on
a host's backend (routes 0.875 and 0.75, D draws, a margin every bin passes, so the search visits all
bins and every probe of each with route 0.75, whose windows leave 0.875 nothing to route: it is not tested). At least 8 probes: below that the heavy-tail calibrated safe read has no finite
critical value at this margin (``safe_read.safe_quantile`` at 4 probes and ε = 0.99 is +inf), so nothing
certifies and the search stops at its first bins.

Each setting (probe count × bin count) runs in its own process: the host figure is the peak resident
set during the certification (``VmHWM`` after resetting it through ``/proc/self/clear_refs``; where
that cannot be reset, the process's ``ru_maxrss``) minus the resident set before it; on CUDA also
``torch.cuda.max_memory_allocated`` minus the allocation before it. Both divided by the adapter's
parameter count. Each line gives the figure after ``certify peak bytes/param = ``:

    python benchmarks/bench_certify_memory.py --threads 1                       # CPU
    python benchmarks/bench_certify_memory.py --device cuda --json mem.json      # one GPU

The target: that figure at most ``--max_bytes_per_param`` (default 34, the bound README.md states for a
float32 adapter); each row says whether it is met, the JSON lists the settings that miss it (``missed``),
and ``--enforce`` exits 1 when one does.

What stays per parameter while a draw is taken: each arm's running sum (float32), the native draw of
the pair and the draw being taken (``mapping/sequential.py`` ``PairedSums``); before it, every
(probe, bin)'s D native draws were kept as float64 CPU copies.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

import torch

from downscale_plugin.bins import parse_bins
from downscale_plugin.grid import area_downsample
from downscale_plugin.mapping.arms import Arm, latent_arm
from downscale_plugin.mapping.certify import BackendDraws, CertifySettings, run_certify
from downscale_plugin.mapping.sequential import Looks

WIDTH, RANK, LATENT = 3072, 16, (4, 16, 16)  # FLUX's width, a common LoRA rank, a small latent
ROUTES = (0.875, 0.75)
MAX_BYTES_PER_PARAM = 34.0  # README.md: the certifier's memory is at most 22–34 bytes per float32 adapter parameter


class SyntheticAdapter:
    """A :class:`~downscale_plugin.mapping.arms.MapBackend` whose trainable part is a LoRA stack of ≥ ``params`` parameters."""

    def __init__(self, params: int, images: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        layers = math.ceil(params / (2 * WIDTH * RANK))
        self.device = device
        self.rng_devices = (device,) if device.type == "cuda" else ()
        self.latents = [torch.randn(1, *LATENT, generator=gen).to(device, dtype) for _ in range(images)]
        self.project = (torch.randn(LATENT[0] * 16, WIDTH, generator=gen) / 8).to(device, dtype)  # frozen
        self.params = []
        for _ in range(layers):
            down = torch.randn(RANK, WIDTH, generator=gen) / math.sqrt(WIDTH)
            up = torch.randn(WIDTH, RANK, generator=gen) * 0.01  # a trained LoRA's up is not zero
            self.params += [torch.nn.Parameter(down.to(device, dtype)), torch.nn.Parameter(up.to(device, dtype))]

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return self.params

    def num_images(self) -> int:
        return len(self.latents)

    def arm_input(self, image: int, arm: Arm) -> tuple[int, int] | None:
        return None if arm.kind == "native" else (round(LATENT[1] * arm.ratio), round(LATENT[2] * arm.ratio))

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.adaptive_avg_pool2d(x, 4).reshape(1, -1) @ self.project

    def loss(self, image: int, grid: tuple[int, int] | None, sigma: float) -> torch.Tensor:
        x = self.latents[image]
        if grid is not None:
            x = area_downsample(x.float(), grid).to(x.dtype)
        noise = torch.randn_like(x)
        h = self._features(x + 0.05 * sigma * noise)  # mostly the probe's own signal: every bin ends safe
        for down, up in zip(self.params[::2], self.params[1::2], strict=True):
            h = h + torch.tanh(h @ down.T) @ up.T
        return (h.float() - 0.5 * self._features(x).float()).pow(2).mean()


def host_bytes() -> tuple[int, int]:
    """(resident set, its peak since the last reset) in bytes, from /proc (ru_maxrss where there is none)."""
    try:
        with open("/proc/self/status") as fh:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in fh if line.startswith(("VmRSS", "VmHWM"))}
        return fields["VmRSS"], fields["VmHWM"]
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return peak, peak


def reset_host_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current resident set (Linux)
        return True
    except OSError:
        return False


def one_setting(args: argparse.Namespace, images: int, bins: int) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    backend = SyntheticAdapter(args.params, images, device, {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype])
    p = sum(t.numel() for t in backend.params)
    bin_grid = parse_bins(f"0,1,{bins}", endpoint=False)
    settings = CertifySettings(margin=0.99, draws=args.draws, looks=Looks((images // 2, images)), budget=1e9, spot_checks=0)
    source = BackendDraws(backend, bin_grid, settings.draws, settings.seed)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        device_before = torch.cuda.memory_allocated(device)
    rss_before, _ = host_bytes()
    exact = reset_host_peak()
    t0 = time.perf_counter()
    result = run_certify(source, [latent_arm(r) for r in ROUTES], bin_grid, settings, mass=lambda lo, hi: hi - lo)
    wall = time.perf_counter() - t0
    _, rss_peak = host_bytes()
    row = {
        "device": str(device),
        "dtype": args.dtype,
        "params": p,
        "probes": images,
        "bins": bins,
        "draws": settings.draws,
        "groups": sum(len(t.values) for t in result.tests) // len(ROUTES),
        "tests": len(result.tests),
        "safe": sum(t.safe for t in result.tests),
        "native_step_equivalents": result.spent,
        "wall_s": round(wall, 1),
        "host_peak_extra_bytes": rss_peak - rss_before,
        "host_peak": "VmHWM reset before the certification" if exact else "process ru_maxrss (includes setup)",
        "host_bytes_per_param": round((rss_peak - rss_before) / p, 2),
    }
    if device.type == "cuda":
        extra = torch.cuda.max_memory_allocated(device) - device_before
        row.update(device_peak_extra_bytes=extra, device_bytes_per_param=round(extra / p, 2))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="the adapter's dtype")
    parser.add_argument("--params", type=int, default=20_000_000, help="adapter parameters (at least; whole LoRA pairs)")
    parser.add_argument("--probes", default="8,16", help="probe counts (the last look; the first look is half)")
    parser.add_argument("--bins", default="2,4", help="σ bin counts")
    parser.add_argument("--draws", type=int, default=2)
    parser.add_argument("--threads", type=int, help="torch intra-op threads")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--max_bytes_per_param", type=float, default=MAX_BYTES_PER_PARAM, help="target: the figure, at most")
    parser.add_argument("--enforce", action="store_true", help="exit 1 when a setting misses the target")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # PROBES,BINS: one setting in this process
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        images, bins = (int(x) for x in args.one.split(","))
        print(json.dumps(one_setting(args, images, bins)), flush=True)
        return 0
    rows = []
    passthrough = ["--device", args.device, "--dtype", args.dtype, "--params", str(args.params), "--draws", str(args.draws)]
    passthrough += ["--threads", str(args.threads)] if args.threads else []
    for images in (int(x) for x in args.probes.split(",")):
        for bins in (int(x) for x in args.bins.split(",")):
            out = subprocess.run([sys.executable, os.path.abspath(__file__), *passthrough, "--one", f"{images},{bins}"],
                                 check=True, capture_output=True, text=True).stdout  # fmt: skip
            row = json.loads(out.strip().splitlines()[-1])
            row["bytes_per_param"] = row.get("device_bytes_per_param", row["host_bytes_per_param"])  # the figure the target bounds
            row["met"] = row["bytes_per_param"] <= args.max_bytes_per_param
            rows.append(row)
            figure = f"host {row['host_bytes_per_param']:.1f}"
            if "device_bytes_per_param" in row:
                figure = f"device {row['device_bytes_per_param']:.1f}, {figure}"
            print(f"{row['params'] / 1e6:.1f} M params, {images} probes x {bins} bins, D = {row['draws']}, "
                  f"{row['groups']} groups, {row['safe']}/{row['tests']} safe, {row['wall_s']} s: "
                  f"{figure}; certify peak bytes/param = {row['bytes_per_param']:.1f} (target <= {args.max_bytes_per_param:g}: "
                  f"{'met' if row['met'] else 'MISSED'})", flush=True)  # fmt: skip
            missed = [f"{r['probes']} probes x {r['bins']} bins: {r['bytes_per_param']} bytes/param" for r in rows if not r["met"]]
            if args.json:
                with open(args.json, "w") as fh:
                    summary = {"command": "python " + " ".join(sys.argv), "max_bytes_per_param": args.max_bytes_per_param}
                    json.dump({**summary, "rows": rows, "missed": missed, "ok": not missed}, fh, indent=1)
    return 1 if args.enforce and missed else 0


if __name__ == "__main__":
    sys.exit(main())
