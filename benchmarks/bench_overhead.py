"""The plugin's own cost: lab LoRA steps with the plugin installed but routing nothing, against no plugin.

Two trainers share one LoRA'd lab DiT, one batch list and one optimizer, and alternate step by step in
one process at one torch thread (so the machine's drift hits both alike): the host's plain trainer,
and the same trainer with the plugin's hook installed on a window no σ falls in (every step the
host's own, bitwise, after the hook's per-step work: binding the host sampler, the forked dry-run σ
draw, the route decision, the step record). Prints the overhead per step as the ratio of the two
arms' mean CPU seconds with a bootstrap 95 % interval over rounds, and the hook's own time measured
directly (its wrapper's time less the host call inside it), which the machine's noise does not
blur. Run it on a quiet machine; the goal is ≤ 1 % of a step.

    python benchmarks/bench_overhead.py [--rounds 60] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any


def measure(rounds: int, quick: bool) -> dict[str, Any]:
    import copy

    import torch

    from downscale_plugin.config import load_config
    from downscale_plugin.hosts.lab.adapter import LabPlugin
    from downscale_plugin.lab.concept import HatchData
    from downscale_plugin.lab.data import LabData, LabDataConfig
    from downscale_plugin.lab.model import LabModelConfig, LabTextEncoder
    from downscale_plugin.lab.pretrain import load_or_pretrain
    from downscale_plugin.lab.trainer import LabAccelerator, LabTrainer, inject_lora, lab_args, make_noise_scheduler
    from downscale_plugin.quality import bootstrap_mean_interval

    torch.set_num_threads(1)
    clock = time.process_time
    model_cfg = LabModelConfig()
    base = LabData(LabDataConfig(latent_channels=model_cfg.latent_channels))
    model = copy.deepcopy(load_or_pretrain(model_cfg, quick=quick, progress=False, data=base)).train()
    data = HatchData(base)
    optimizer = torch.optim.AdamW(inject_lora(model, 8, 8.0, seed=0), lr=1e-3)
    args = lab_args(max_train_steps=2 * rounds)
    text_encoder, accelerator, scheduler = LabTextEncoder(model_cfg), LabAccelerator(), make_noise_scheduler(args)

    class HostCallTimer(LabTrainer):
        """The host's step, timed from inside: what the hook's wrapper calls."""

        inner = 0.0

        def get_noise_pred_and_target(self, *a: Any, **k: Any) -> Any:
            t0 = clock()
            out = super().get_noise_pred_and_target(*a, **k)
            self.inner += clock() - t0
            return out

    plain, hooked = LabTrainer(), HostCallTimer()
    nothing = {"arch": "flux", "routes": [{"route": "512:448", "sigma_min": 0.0, "sigma_max": 1e-9}]}  # no σ falls in it
    plugin = LabPlugin.for_lab(load_config(table=nothing), model_cfg, data)
    installed = plugin.installer(hooked, args)
    installed.__enter__()
    wrapper, outer = hooked.get_noise_pred_and_target, [0.0]

    def timed_wrapper(*a: Any, **k: Any) -> Any:
        t0 = clock()
        out = wrapper(*a, **k)
        outer[0] += clock() - t0
        return out

    hooked.get_noise_pred_and_target = timed_wrapper
    batches = [data.batch(i, 1, seed=0) for i in range(8)]

    def step(trainer: LabTrainer, batch: dict) -> float:
        t0 = clock()
        loss = trainer.process_batch(batch, text_encoder, model, model, scheduler, torch.float32, accelerator, args)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return clock() - t0

    for batch in batches[:2]:  # warm-up, both arms
        step(plain, batch), step(hooked, batch)
    outer[0] = hooked.inner = 0.0
    times: dict[str, list[float]] = {"plain": [], "hooked": []}
    for r in range(rounds):
        batch = batches[r % len(batches)]
        order = ("plain", "hooked") if r % 2 == 0 else ("hooked", "plain")
        for arm in order:
            times[arm].append(step(plain if arm == "plain" else hooked, batch))
    installed.__exit__(None, None, None)
    assert plugin.accounting.fractions()[-1] == 1.0, "the plugin routed a step"
    diffs = [h - p for h, p in zip(times["hooked"], times["plain"], strict=True)]
    native = statistics.fmean(times["plain"])
    lo, hi = bootstrap_mean_interval(diffs)
    own = (outer[0] - hooked.inner) / rounds
    return {
        "rounds": rounds,
        "native_step_cpu_s": native,
        "overhead": statistics.fmean(diffs) / native,
        "overhead_lo": lo / native,
        "overhead_hi": hi / native,
        "hook_own_s": own,
        "hook_own_share": own / native,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60, help="steps per arm, alternating (default 60)")
    parser.add_argument("--quick", action="store_true", help="quick-pretrained lab DiT (smoke runs)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be >= 2")
    r = measure(args.rounds, args.quick)
    print(f"native lab step (1 024 tokens, LoRA rank 8, one thread): {r['native_step_cpu_s'] * 1000:.1f} ms CPU")
    print(f"plugin installed, routing nothing: {100 * r['overhead']:+.2f} % per step "
          f"[{100 * r['overhead_lo']:+.2f}, {100 * r['overhead_hi']:+.2f}] (bootstrap 95 %, {r['rounds']} alternating rounds)")  # fmt: skip
    print(f"the hook's own work: {r['hook_own_s'] * 1000:.2f} ms per step = {100 * r['hook_own_share']:.2f} % of a native step")
    if args.json:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=os.path.dirname(__file__)).stdout.strip()
        with open(args.json, "w") as fh:
            json.dump(
                {**r, "code_revision": head or None, "command": "python benchmarks/bench_overhead.py " + " ".join(argv or sys.argv[1:])},
                fh,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
