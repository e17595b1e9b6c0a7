"""On one device: the plugin never reseeds or rewinds a global generator, and a run it routes nothing
in is the host's own (a check, not a timing; ``benchmarks/gpu_check.sh`` runs it on CUDA).

The model, LoRA and trainer class are ``bench_production.py``'s (sd-scripts' own denoiser at
production width, two blocks of each kind, the trainer's ``process_batch``, AdamW). From the same
LoRA init and the same per-step seeds, ``--steps`` train steps are run:

- ``native`` twice: the trainer's own step, no plugin. Whether the two end bitwise equal says whether
  this device repeats itself at all (deterministic algorithms are requested, but on CUDA a kernel
  without a deterministic version, e.g. an attention backward, only warns);
- ``never`` under ``tests/rng_trap.py``'s ``RngTrap``: the plugin installed by its own ``start`` with
  a route whose window has zero mass, so the hook binds the sampler, dry-runs its draw in a fork and
  routes nothing. Its generators' states after the last step must equal native's. Its final LoRA must
  equal native's bitwise where native repeats itself; where it does not, a third native run gives the
  native runs' own spread (the largest max-abs difference between two of them), and ``never`` must lie
  within ``NOISE_FACTOR`` times that spread of every native run, while the routed run must lie farther
  (else the comparison could not tell a changed step from the device's own noise);
- ``r0.75`` under the trap: every step routed (the trap only: a routed run is not native).

    SD_SCRIPTS_DIR=... python benchmarks/gpu_rng_check.py --device cuda --dtype bf16 --json rng.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS' deterministic mode (read at its first use)

import torch  # noqa: E402

sys.path[:0] = [HERE, os.path.join(REPO, "tests")]  # bench_production's Bench; the trap (importable without pytest)


def lora_state(bench) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in bench.network.state_dict().items()}


def generator_states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def run_arm(bench, name: str, init: dict[str, torch.Tensor], steps: int, trap=None) -> tuple[dict, list[torch.Tensor]]:
    """``steps`` steps of one arm from ``init`` with a fresh AdamW; (final LoRA, generator states after)."""
    arm = next(a for a in bench.arms if a.name == name)
    bench.network.load_state_dict(init)
    bench.optimizer = torch.optim.AdamW([p for p in bench.network.parameters() if p.requires_grad], lr=1e-3)
    with trap if trap is not None else contextlib.nullcontext():
        for step in range(steps):
            bench.step(arm, seed=step)
    return lora_state(bench), generator_states(bench.device)


NOISE_FACTOR = 2.0  # where native does not repeat itself: ``never`` within this many times the native runs' own spread


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def compare(natives: list[dict[str, torch.Tensor]], never: dict[str, torch.Tensor], routed: dict[str, torch.Tensor]) -> dict:
    """The unrouted run against the native runs: bitwise where the first two native runs are bitwise equal; else within
    ``NOISE_FACTOR`` × the native runs' own spread of each of them (pass at least three), with the routed run outside
    that band. ``unrouted_ok`` is the verdict."""
    repeatable = bitwise(natives[0], natives[1])
    out: dict = {"native_repeatable": repeatable, "unrouted_bitwise": bitwise(natives[0], never)}
    out["unrouted_max_abs_diff"] = max(max_diff(n, never) for n in natives)
    out["routed_max_abs_diff"] = min(max_diff(n, routed) for n in natives)
    if repeatable:
        out["compared"] = "bitwise"
        out["unrouted_ok"] = out["unrouted_bitwise"]
        return out
    if len(natives) < 3:
        raise ValueError("native does not repeat itself: its spread needs three native runs")
    spread = max(max_diff(a, b) for i, a in enumerate(natives) for b in natives[i + 1 :])
    tolerance = NOISE_FACTOR * spread
    out.update(compared="within the native runs' spread", native_spread=spread, tolerance=tolerance)
    out["routed_outside_tolerance"] = out["routed_max_abs_diff"] > tolerance
    out["unrouted_ok"] = out["unrouted_max_abs_diff"] <= tolerance and out["routed_outside_tolerance"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="flux", help="an sd-scripts architecture of bench_production.py")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--px", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    import bench_production as bp

    bp.use_sd_scripts(parser, args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    from rng_trap import RngTrap

    device, dtype = torch.device(args.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    text = bp.PRODUCTION_TEXT[args.arch] if device.type == "cuda" else bp.CPU_TEXT[args.arch]
    bench = bp.Bench(args.arch, bp.Size(args.px, text, False), device, dtype, args.rank)
    bench.setup()
    init = lora_state(bench)
    native, native_states = run_arm(bench, "native", init, args.steps)
    again, again_states = run_arm(bench, "native", init, args.steps)
    natives = [native, again]
    if not bitwise(native, again):  # the device's own spread needs a third run
        natives.append(run_arm(bench, "native", init, args.steps)[0])
    never_trap, routed_trap = RngTrap(), RngTrap()
    never, never_states = run_arm(bench, "never", init, args.steps, never_trap)
    routed, _ = run_arm(bench, "r0.75", init, args.steps, routed_trap)
    out = {
        "arch": args.arch,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "weight_dtype": bench.weight_dtype,
        "px": args.px,
        "steps": args.steps,
        "torch": torch.__version__,
        "native_runs": len(natives),
        **compare(natives, never, routed),
        "native_generators_repeat": all(torch.equal(x, y) for x, y in zip(native_states, again_states, strict=True)),
        "unrouted_generators_equal": all(torch.equal(x, y) for x, y in zip(native_states, never_states, strict=True)),
        "trap": {
            name: {"violations": trap.violations, "restores_checked": trap.restores, "seeds_checked": trap.seeded}
            for name, trap in (("never", never_trap), ("r0.75", routed_trap))
        },
    }
    checks = {
        f"unrouted run equals native ({out['compared']})": out["unrouted_ok"],
        "unrouted generators' states equal native's": out["unrouted_generators_equal"],
        "no trap violation": not any(t["violations"] for t in out["trap"].values()),
        "the trap saw the hook's forks": all(t["restores_checked"] for t in out["trap"].values()),  # it was in the step
    }
    out["missed"] = [name for name, met in checks.items() if not met]
    out["ok"] = not out["missed"]
    text_out = json.dumps(out, indent=1)
    print(text_out)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text_out)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
