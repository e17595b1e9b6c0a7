"""Device memory of ``bench_production.py --full_depth`` per architecture, estimated on a CPU before a GPU is lent.

Whether the published depth at production width fits one 80 GB card, with and without gradient
checkpointing, and so which architectures ``benchmarks/gpu_check.sh`` checkpoints:

- parameters: the full-depth denoiser built on the meta device (sd-scripts' own class, as
  ``bench_production.py`` builds it), every floating tensor in bf16; the LoRA (rank ``--rank``, float32)
  with its gradient and AdamW's two moments, 16 bytes a parameter, counted on that meta model;
- activations: the tensors autograd keeps for backward (unique storages, by a ``saved_tensors_hooks``)
  during one native ``process_batch`` of ``bench_production``'s reduced model (two blocks of each kind,
  production width and text lengths, bf16 weights and autocast) at two image sizes, each attributed to
  the block it was saved in (forward hooks). Each block's bytes and the rest are fitted linear in image
  tokens (the attention kernels keep O(tokens) for backward) and evaluated at 1 024 px; a block of the
  published model counts as the kept block of its kind (``bench_production.REDUCED_BLOCKS``);
- with gradient checkpointing a block keeps only its inputs, and backward recomputes one block at a
  time: its activations come once on top.

The build's own peak is listed too: the bench builds in float32 and converts to bf16. Measured on the
CPU: CUDA's autocast and attention kernels may keep a little more or less; the GPU check records
``torch.cuda.max_memory_allocated`` per architecture (``production.json``, ``device_peak_gib``).

    SD_SCRIPTS_DIR=... python benchmarks/gpu_memory_estimate.py --threads 1 --json mem_estimate.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

GIB = 2**30
CARD_GIB = 78.0  # what an 80 GB H100 leaves usable (81 559 MiB in all)
BUDGET_GIB = 0.75 * CARD_GIB  # checkpoint above this: a quarter of the card for backward's transient buffers, the
# allocator's fragmentation, and CUDA's autocast and attention kernels keeping more than the CPU's measured here
LORA_BYTES = 16  # float32 LoRA parameter, its gradient, AdamW's exp_avg and exp_avg_sq


def full_depth_bytes(bp, arch: str, rank: int) -> tuple[int, int]:
    """(bf16 bytes of the published denoiser's floating tensors, LoRA parameters) counted on the meta device."""
    with torch.device("meta"):
        unet = bp.BUILDERS[arch](True)
        tensors = [*unet.parameters(), *unet.buffers()]
        weights = sum(2 * t.numel() for t in tensors if t.is_floating_point())
        script, _, inner = bp.SCRIPTS[arch]
        bp._module(script)  # the trainer module sets what its network module reads
        encoders = [torch.nn.Linear(2, 2) for _ in range(3)]
        network = bp._module(inner).create_network(1.0, rank, rank, None, encoders, unet)
        network.apply_to(encoders, unet, False, True)
        lora = sum(p.numel() for p in network.parameters() if p.requires_grad)
    return weights, lora


class SavedBytes:
    """Bytes autograd keeps for backward, per block (``blocks``: name -> module) and for the rest, each storage once;
    the model's own tensors (``model``: the frozen weights a linear keeps for its input gradient, the LoRA) are not
    activations and are left out."""

    def __init__(self, blocks: dict[str, torch.nn.Module], *models: torch.nn.Module):
        self.blocks, self.current = blocks, "rest"
        self.bytes: dict[str, int] = defaultdict(int)
        self.inputs: dict[str, int] = defaultdict(int)
        self.seen = {t.untyped_storage().data_ptr() for m in models for t in [*m.parameters(), *m.buffers()]}
        self.handles = []

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.seen and storage.nbytes():
            self.seen.add(storage.data_ptr())
            self.bytes[self.current] += storage.nbytes()
        return t

    def __enter__(self) -> SavedBytes:
        for name, block in self.blocks.items():

            def enter(_module, args, kwargs, name=name):
                self.current = name
                self.inputs[name] = sum(a.nbytes for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor))

            def leave(*_, name=name):
                self.current = "rest"

            self.handles += [block.register_forward_pre_hook(enter, with_kwargs=True), block.register_forward_hook(leave)]
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)
        for handle in self.handles:
            handle.remove()


def measure(arch: str, px: int, rank: int) -> dict:
    """One native forward of the reduced model at ``px``: saved bytes and input bytes per block, and the rest."""
    import bench_production as bp

    bench = bp.Bench(arch, bp.Size(px, bp.PRODUCTION_TEXT[arch], False), torch.device("cpu"), torch.bfloat16, rank)
    bench.setup()
    blocks = {f"{attr}.{i}": block for attr in bp.BLOCK_LISTS[arch] for i, block in enumerate(getattr(bench.unet, attr))}
    batch = bench.batch(0)
    arm = bench.arms[0]
    torch.manual_seed(0)
    with SavedBytes(blocks, bench.unet, bench.network) as saved:
        loss = arm.trainer.process_batch(
            batch, [], bench.unet, bench.network, None, bench.scheduler, bench.dtype, bench.dtype, bench.acc, arm.args, bench.encoding, None,
            is_train=True, train_text_encoder=False, train_unet=True,
        )  # fmt: skip
    del loss
    from downscale_plugin.arch import get_arch
    from downscale_plugin.grid import tokens

    side = px // get_arch(arch).vae_factor
    return {"px": px, "image_tokens": tokens((side, side), get_arch(arch)), "saved": dict(saved.bytes), "inputs": dict(saved.inputs)}


def linear(a: dict, b: dict, key: str, n: int) -> float:
    """Bytes of ``key`` at ``n`` image tokens, on the line through the two measurements."""
    (xa, ya), (xb, yb) = (a["image_tokens"], a[key]), (b["image_tokens"], b[key])
    return ya + (yb - ya) * (n - xa) / (xb - xa)


def estimate(arch: str, small: dict, large: dict, weights: int, lora: int, n: int) -> dict:
    import bench_production as bp

    def at(field: str, name: str) -> float:
        return linear({**small, "v": small[field].get(name, 0)}, {**large, "v": large[field].get(name, 0)}, "v", n)

    blocks, inputs, largest = 0.0, 0.0, 0.0
    for attr in bp.BLOCK_LISTS[arch]:
        kept = bp.REDUCED_BLOCKS[arch].get(attr)
        for i in range(bp.FULL_BLOCKS[arch][attr]):
            j = i if kept is None else max(k for k, index in enumerate(kept) if index <= i)  # the kept block of its kind
            act = at("saved", f"{attr}.{j}")
            blocks, inputs, largest = blocks + act, inputs + at("inputs", f"{attr}.{j}"), max(largest, act)
    rest = at("saved", "rest")
    fixed = weights + LORA_BYTES * lora
    plain, checkpointed = fixed + rest + blocks, fixed + rest + inputs + largest
    return {
        "arch": arch,
        "image_tokens": n,
        "weights_gib": weights / GIB,
        "lora_params": lora,
        "lora_states_gib": LORA_BYTES * lora / GIB,
        "block_activations_gib": blocks / GIB,
        "other_activations_gib": rest / GIB,
        "checkpointed_inputs_gib": inputs / GIB,
        "largest_block_gib": largest / GIB,
        "plain_gib": plain / GIB,
        "checkpointed_gib": checkpointed / GIB,
        "build_peak_gib": 2 * weights / GIB,  # float32 before the conversion to bf16
        "checkpointing": plain / GIB > BUDGET_GIB,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="sd3,anima,lumina,flux")
    parser.add_argument("--px", default="128,256", help="the two image sizes measured")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--json", help="write the estimate here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # ARCH,PX: one measurement in this process
    args = parser.parse_args()
    import bench_production as bp

    bp.use_sd_scripts(parser, args.threads)
    if args.one:
        arch, px = args.one.split(",")
        print(json.dumps(measure(arch, int(px), args.rank)), flush=True)
        return 0

    rows = []
    start = time.perf_counter()
    for arch in args.archs.split(","):
        runs = []
        for px in args.px.split(","):  # each in its own process: a fresh allocator, no storage address reused across runs
            cmd = [sys.executable, os.path.abspath(__file__), "--rank", str(args.rank), "--one", f"{arch},{px}"]
            cmd += ["--threads", str(args.threads)] if args.threads else []
            runs.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]))
        weights, lora = full_depth_bytes(bp, arch, args.rank)
        row = estimate(arch, *runs, weights, lora, n=4096)
        row["measured"] = runs
        rows.append(row)
        print(f"{arch}: weights {row['weights_gib']:.1f} GiB, LoRA states {row['lora_states_gib']:.2f}, activations {row['block_activations_gib']:.1f} "
              f"in blocks + {row['other_activations_gib']:.1f} = {row['plain_gib']:.1f} GiB without checkpointing, "
              f"{row['checkpointed_gib']:.1f} with; build peak {row['build_peak_gib']:.1f}: "
              f"{'gradient checkpointing' if row['checkpointing'] else 'no checkpointing'}", flush=True)  # fmt: skip
    revision = subprocess.run(["git", "-C", HERE, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {
        "command": "python " + " ".join(sys.argv),
        "revision": revision,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "card_gib": CARD_GIB,
        "budget_gib": BUDGET_GIB,
        "seconds": round(time.perf_counter() - start),
        "archs": rows,
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
