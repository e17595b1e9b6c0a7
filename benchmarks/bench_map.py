"""Wall time of a full map: 3 routes × 15 σ bins (the default 14 segmented + σ = 1) on the lab DiT.

    python benchmarks/bench_map.py [--draws 4] [--images 4] [--threads 2] [--quick] [--out bench_map_out]

Target: ≤ 10 min on 2 CPU cores. Prints the setup time (pretrained model from cache or pretrain,
adapter warm-up), the map time, the number of forward+backward passes and the mean cost of one,
and writes the map's usual outputs to ``--out``. The model's one-off pretraining (cached under
``$DOWNSCALE_PLUGIN_CACHE``) is not part of the map's cost; run ``python -m downscale_plugin.lab.pretrain``
first to keep it out of the figure.
"""

from __future__ import annotations

import argparse
import time

import torch

from downscale_plugin.arch import get_arch
from downscale_plugin.bins import DEFAULT_BINS, parse_bins
from downscale_plugin.grid import target_grid, tokens
from downscale_plugin.hosts.lab.map_backend import LabBackend, LabMapConfig, describe_config
from downscale_plugin.mapping.arms import build_arms
from downscale_plugin.mapping.estimator import MapSettings, run_map
from downscale_plugin.mapping.report import console_table, write_outputs

RATIOS = (0.875, 0.75, 0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=4)
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--margin", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="quick lab pretrain instead of the default")
    parser.add_argument("--out", default="bench_map_out")
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    arms = build_arms(list(RATIOS))
    bins = parse_bins(DEFAULT_BINS)
    settings = MapSettings(margin=ns.margin, draws=ns.draws, images=ns.images)
    cfg = LabMapConfig(quick=ns.quick)
    t0, c0 = time.perf_counter(), time.process_time()
    backend = LabBackend(cfg, images=ns.images, progress=False)
    setup = time.perf_counter() - t0
    command = f"python benchmarks/bench_map.py --draws {ns.draws} --images {ns.images} --threads {ns.threads}" + (
        " --quick" if ns.quick else ""
    )
    c1 = time.process_time()
    result = run_map(backend, arms, bins, settings, progress=True, provenance={"command": command, "lab": describe_config(cfg)})
    map_cpu = time.process_time() - c1
    write_outputs(result, ns.out, command)
    arch = get_arch(cfg.arch)
    grids = [cfg.native_hw, cfg.native_hw] + [target_grid(cfg.native_hw, r, arch) for r in sorted(RATIOS)]
    passes = len(bins) * ns.draws * ns.images * len(grids)
    print(console_table(result))
    print()
    print(f"arms: {', '.join(f'{a.name} ({tokens(g, arch)} tok)' for a, g in zip(arms, grids, strict=True))}")
    print(f"map: {len(RATIOS)} routes x {len(bins)} bins, D={ns.draws}, N={ns.images}: {passes} forward+backward passes")
    print(f"setup {setup:.1f} s (model load/pretrain + {cfg.warm_steps} warm-up steps)")
    print(
        f"map wall {result.provenance['wall_s']:.1f} s ({result.provenance['wall_s'] / passes * 1000:.0f} ms/pass), torch threads {ns.threads}"
    )
    print(f"map CPU time {map_cpu:.1f} s over {ns.threads} threads (wall on an otherwise idle machine is about CPU / threads)")
    print(f"setup CPU time {c1 - c0:.1f} s")
    total = setup + result.provenance["wall_s"]
    print(f"total {total:.1f} s; target <= 600 s: {'met' if total <= 600 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
