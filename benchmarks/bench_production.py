"""Routed vs native LoRA steps on sd-scripts' own denoiser classes at production width.

Each architecture's denoiser is built from sd-scripts' own class (``library/flux_models.py``,
``sd3_models.py``, ``lumina_models.py``, ``anima_models.py``) at its production width and head
layout, with two blocks of each kind (``--full_depth``: the published depth). A LoRA from the
architecture's inner network module trains through the real trainer class's ``process_batch``
with the plugin installed by its own ``start`` (the router, the step hook of
``hosts/sd_scripts/hook.py``, the accounting), then backward and AdamW. The arms alternate step by
step in one process, so drift in machine speed hits them alike:

- ``native``: the trainer class's own step, no plugin;
- ``r0.875``, ``r0.75``: the seed paper's two routes, each with a window that always fires;
- ``never``: a route whose window has zero mass (the plugin's whole cost when nothing routes).

Printed per architecture: median step time per arm; per route the measured relative cost and
saving against the FLOP model's (``downscale_plugin/flops.py`` evaluated at the benchmark's own
depth, text tokens and rank), the prediction error as a share of the native step, the overhead of
``never``, and the targets beside them. The last lines read ``ARCH realized/predicted = X``
(X: the mean over the two routes). ``--json PATH`` writes the figures, each architecture's targets
(``targets``: value, bound, met) and the ones missed (``missed``); ``--enforce`` exits 1 when one is
missed. On CUDA each architecture's peak device memory is recorded (``device_peak_gib``).

    SD_SCRIPTS_DIR=/path/to/sd-scripts python benchmarks/bench_production.py   # CPU: 256 px, reduced depth
    SD_SCRIPTS_DIR=... python benchmarks/bench_production.py --threads 1 --clock cpu   # a CPU shared with other jobs
    SD_SCRIPTS_DIR=... python benchmarks/bench_production.py --device cuda --dtype bf16 --full_depth --json gpu.json
    SD_SCRIPTS_DIR=... python benchmarks/bench_production.py ... --gradient_checkpointing flux   # only Flux checkpointed

The CPU default is 256 px because a production-width step at 1 024 px takes minutes on two cores;
``--full_depth`` (the published depths) defaults to 1 024 px and the trainers' default text lengths.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import Value
from typing import Any
from unittest.mock import MagicMock

import torch

from downscale_plugin.arch import get_arch
from downscale_plugin.flops import StepFlops
from downscale_plugin.grid import target_grid, tokens
from downscale_plugin.hosts.sd_scripts.flop_args import run_flops

ARCHS = ("sd3", "anima", "lumina", "flux")  # cheapest first
SCRIPTS = {
    "flux": ("flux_train_network", "FluxNetworkTrainer", "networks.lora_flux"),
    "sd3": ("sd3_train_network", "Sd3NetworkTrainer", "networks.lora_sd3"),
    "lumina": ("lumina_train_network", "LuminaNetworkTrainer", "networks.lora_lumina"),
    "anima": ("anima_train_network", "AnimaNetworkTrainer", "networks.lora_anima"),
}
ROUTES = {
    "r0.875": {"routes": [{"scale": 0.875, "sigma_min": 0.0}]},
    "r0.75": {"routes": [{"scale": 0.75, "sigma_min": 0.0}]},
    "never": {"routes": [{"scale": 0.75, "sigma_min": 0.999999, "sigma_max": 0.9999995}]},  # zero mass: nothing routes
}
TARGET_REALIZED = 0.95  # realized saving ≥ 95 % of the predicted one at B = 1
TARGET_OVERHEAD = 0.005  # nothing routes: ≤ 0.5 % of the native step
TARGET_ERROR = 0.03  # |predicted − measured relative cost| ≤ 3 % of the native step
MIXED_PRECISION = {torch.float32: "no", torch.bfloat16: "bf16"}  # sd-scripts' --mixed_precision for each step dtype
SD3_X_ATTN_BLOCKS = 13  # SD3.5-Medium's first 13 joint blocks carry the extra image self-attention (MMDiT-X)
# Each denoiser's block lists, their published lengths, and the blocks the reduced model keeps (indices into the
# published list; a list not named is kept whole): two of each kind, SD3 two with the extra attention, two without, the last.
BLOCK_LISTS = {"flux": ("double_blocks", "single_blocks"), "sd3": ("joint_blocks",),
               "lumina": ("context_refiner", "noise_refiner", "layers"), "anima": ("blocks",)}  # fmt: skip
FULL_BLOCKS = {"flux": {"double_blocks": 19, "single_blocks": 38}, "sd3": {"joint_blocks": 24},
               "lumina": {"context_refiner": 2, "noise_refiner": 2, "layers": 26}, "anima": {"blocks": 28}}  # fmt: skip
REDUCED_BLOCKS = {"flux": {"double_blocks": (0, 1), "single_blocks": (0, 1)},
                  "sd3": {"joint_blocks": (0, 1, SD3_X_ATTN_BLOCKS, SD3_X_ATTN_BLOCKS + 1, 23)},
                  "lumina": {"layers": (0, 1)}, "anima": {"blocks": (0, 1)}}  # fmt: skip


@dataclass(frozen=True)
class Size:
    """One benchmark cell: image edge in px, text tokens (the trainer's own length arguments), depth."""

    px: int
    text: dict[str, int]
    full_depth: bool


# The CPU default: 2 cores cannot run a production-width step at 1024 px (Flux: 11.6 TFLOP a step at
# reduced depth, minutes per step), so the default cell is the largest that keeps the whole run
# within 10 minutes: 256 px images and short captions set through the trainers' own arguments.
CPU_TEXT = {"flux": {"t5xxl_max_token_length": 64}, "sd3": {"t5xxl_max_token_length": 32}, "lumina": {"gemma2_max_token_length": 64},
            "anima": {"t5_max_token_length": 64, "qwen3_max_token_length": 64}}  # fmt: skip
PRODUCTION_TEXT = {"flux": {"t5xxl_max_token_length": 512}, "sd3": {"t5xxl_max_token_length": 256},
                   "lumina": {"gemma2_max_token_length": 256}, "anima": {"t5_max_token_length": 512, "qwen3_max_token_length": 512}}  # fmt: skip


def _module(name: str) -> Any:
    return importlib.import_module(name)


def _depth(arch: str, blocks: str, full: bool) -> int:
    return FULL_BLOCKS[arch][blocks] if full else len(REDUCED_BLOCKS[arch][blocks])


def build_flux(full: bool) -> torch.nn.Module:
    """FLUX.1-dev's width and heads (``flux_models.configs['dev']``): hidden 3072, 24 heads."""
    flux_models = _module("library.flux_models")
    params = flux_models.FluxParams(
        in_channels=64, vec_in_dim=768, context_in_dim=4096, hidden_size=3072, mlp_ratio=4.0, num_heads=24,
        depth=_depth("flux", "double_blocks", full), depth_single_blocks=_depth("flux", "single_blocks", full), axes_dim=[16, 56, 56], theta=10_000,
        qkv_bias=True, guidance_embed=True,
    )  # fmt: skip
    return flux_models.Flux(params)


def build_sd3(full: bool) -> torch.nn.Module:
    """SD3.5-Medium's MMDiT-X: depth 24 fixes hidden 64·24 = 1536 (``sd3_models.MMDiT``), so the reduced
    model is the full one with blocks kept: two with the extra image self-attention, two without, the last."""
    sd3_models, strategy_base, strategy_sd3 = (
        _module("library.sd3_models"),
        _module("library.strategy_base"),
        _module("library.strategy_sd3"),
    )
    if strategy_base.TextEncodingStrategy.get_strategy() is None:  # the SD3 trainer reads it from there
        strategy_base.TextEncodingStrategy.set_strategy(strategy_sd3.Sd3TextEncodingStrategy())
    with torch.device("meta"):
        model = sd3_models.MMDiT(
            input_size=None, pos_embed_max_size=64, patch_size=2, in_channels=16, adm_in_channels=2048, depth=FULL_BLOCKS["sd3"]["joint_blocks"], mlp_ratio=4,
            num_patches=64 * 64, context_embedder_in_features=4096, context_embedder_out_features=1536, qk_norm="rms",
            x_block_self_attn_layers=list(range(SD3_X_ATTN_BLOCKS)), model_type="sd3.5m",
        )  # fmt: skip
    if not full:
        keep = REDUCED_BLOCKS["sd3"]["joint_blocks"]
        model.joint_blocks = torch.nn.ModuleList(model.joint_blocks[i] for i in keep)
        model.num_blocks = len(keep)
    model.to_empty(device=torch.get_default_device())  # the device the caller builds on
    model.initialize_weights()
    for name, p in model.named_parameters():  # initialize_weights zeroes the modulation and output layers
        if "adaLN" in name or "final_layer" in name:
            torch.nn.init.normal_(p, std=0.02)
    for module in model.modules():  # the qk RMSNorm scales are torch.empty even off the meta device (a checkpoint sets
        if isinstance(module, sd3_models.RMSNorm) and module.weight is not None:  # them): uninitialized memory gave NaN
            torch.nn.init.ones_(module.weight)
    return model


def build_lumina(full: bool) -> torch.nn.Module:
    """Lumina-Image-2.0's NextDiT 2B (``lumina_models.LuminaParams.get_2b_config``): dim 2304, 24 heads, 8 kv heads."""
    lumina_models = _module("library.lumina_models")
    p = lumina_models.LuminaParams.get_2b_config()
    return lumina_models.NextDiT(
        patch_size=p.patch_size, in_channels=p.in_channels, dim=p.dim, n_layers=_depth("lumina", "layers", full), n_refiner_layers=FULL_BLOCKS["lumina"]["noise_refiner"],
        n_heads=p.n_heads, n_kv_heads=p.n_kv_heads, axes_dims=p.axes_dims, axes_lens=p.axes_lens, qk_norm=p.qk_norm,
        cap_feat_dim=p.cap_feat_dim,
    )  # fmt: skip


def build_anima(full: bool) -> torch.nn.Module:
    """Anima's fixed DiT config (``anima_utils``: model_channels 2048, 16 heads) with its 6-layer LLM adapter."""
    anima_models = _module("library.anima_models")
    return anima_models.Anima(
        max_img_h=512, max_img_w=512, max_frames=128, in_channels=16, out_channels=16, patch_spatial=2, patch_temporal=1,
        concat_padding_mask=True, model_channels=2048, num_blocks=_depth("anima", "blocks", full), num_heads=16, crossattn_emb_channels=1024,
        pos_emb_cls="rope3d", pos_emb_learnable=True, use_adaln_lora=True, adaln_lora_dim=256, rope_h_extrapolation_ratio=4.0,
        rope_w_extrapolation_ratio=4.0, rope_enable_fps_modulation=False, use_llm_adapter=True,
    )  # fmt: skip


BUILDERS: dict[str, Callable[[bool], torch.nn.Module]] = {
    "flux": build_flux,
    "sd3": build_sd3,
    "lumina": build_lumina,
    "anima": build_anima,
}


def text_conds(arch: str, text: dict[str, int], gen: torch.Generator) -> list:
    """Cached text-encoder outputs at production widths, in the layout each trainer unpacks."""
    randn = lambda *shape: torch.randn(1, *shape, generator=gen)  # noqa: E731
    if arch == "flux":
        t = text["t5xxl_max_token_length"]
        return [randn(768), randn(t, 4096), torch.zeros(1, t, 3), torch.ones(1, t)]
    if arch == "sd3":
        t = text["t5xxl_max_token_length"]
        return [randn(77, 2048), randn(t, 4096), randn(2048), torch.ones(1, 77), torch.ones(1, 77), torch.ones(1, t)]
    if arch == "lumina":
        t = text["gemma2_max_token_length"]
        return [randn(t, 2304), torch.zeros(1, t, dtype=torch.long), torch.ones(1, t, dtype=torch.long)]
    t5, qwen = text["t5_max_token_length"], text["qwen3_max_token_length"]
    return [randn(qwen, 1024), torch.ones(1, qwen), torch.zeros(1, t5, dtype=torch.long), torch.ones(1, t5), torch.zeros(1)]


def fake_accelerator(device: torch.device, dtype: torch.dtype) -> MagicMock:
    """What the trainer's step and the plugin read from an accelerate ``Accelerator`` (one process)."""
    acc = MagicMock()
    acc.device = device
    acc.process_index, acc.num_processes, acc.is_main_process = 0, 1, True
    mixed = dtype != torch.float32
    acc.autocast.side_effect = (lambda: torch.autocast(device.type, dtype=dtype)) if mixed else contextlib.nullcontext
    acc.unwrap_model.side_effect = lambda model: model
    acc.reduce.side_effect = lambda tensor, reduction="sum": tensor
    return acc


def train(self: Any, args: Any, accelerator: Any, network: Any) -> str:
    """Stands in for ``NetworkTrainer.train``'s frame, where the plugin's ``start`` finds the trainer and its
    ``weight_dtype``, set as the host sets it (``train_util.prepare_dtype`` of ``--mixed_precision``); returns
    the weight dtype the plugin reads from this frame."""
    from downscale_plugin.hosts.sd_scripts.start import start
    from downscale_plugin.hosts.sd_scripts.trainer import find_trainer

    current_step = Value("i", 0)  # noqa: F841 (read by the plugin from this frame)
    weight_dtype, _ = _module("library.train_util").prepare_dtype(args)  # noqa: F841
    start(network, SCRIPTS[self.arch][2], {}, args)
    return str(find_trainer().weight_dtype)


@dataclass
class Arm:
    name: str
    trainer: Any
    args: Any
    times: list[float] = field(default_factory=list)


@dataclass
class Bench:
    """One architecture's model, LoRA, optimizer and arms."""

    arch: str
    size: Size
    device: torch.device
    dtype: torch.dtype
    rank: int
    unet: torch.nn.Module = None
    network: Any = None
    optimizer: Any = None
    arms: list[Arm] = field(default_factory=list)
    scheduler: Any = None
    encoding: Any = None
    latent_side: int = 0
    clock: Callable[[], float] = time.perf_counter
    checkpointing: bool = False
    weight_dtype: str = ""  # what the plugin read from the trainer's frame (``train``)

    def setup(self) -> None:
        script, cls, inner = SCRIPTS[self.arch]
        module = _module(script)
        argv = ["--network_module", "downscale_plugin", "--network_dim", str(self.rank), "--seed", "0"]
        argv += ["--mixed_precision", MIXED_PRECISION[self.dtype]]  # the host's weight_dtype is the steps' dtype
        argv += ["--gradient_checkpointing"] if self.checkpointing else []
        for key, value in self.size.text.items():
            argv += [f"--{key}", str(value)]
        base_args = module.setup_parser().parse_args(argv)
        with torch.device(self.device):  # a full-depth model initialises on the accelerator, not in host memory
            self.unet = BUILDERS[self.arch](self.size.full_depth).to(self.dtype)
        if self.checkpointing:
            self.unet.enable_gradient_checkpointing()
        self.unet.requires_grad_(False)
        text_encoders = [torch.nn.Linear(2, 2) for _ in range(3)]
        self.network = _module(inner).create_network(1.0, self.rank, self.rank, None, text_encoders, self.unet)
        self.network.apply_to(text_encoders, self.unet, False, True)
        self.network.to(self.device)
        self.optimizer = torch.optim.AdamW([p for p in self.network.parameters() if p.requires_grad], lr=1e-5)
        acc = fake_accelerator(self.device, self.dtype)
        for name in ("native", *ROUTES):
            trainer = getattr(module, cls)()
            trainer.model_type = getattr(base_args, "model_type", None)
            trainer.arch = self.arch
            args = copy.deepcopy(base_args)
            if name != "native":
                args.downscale = ROUTES[name]
                self.weight_dtype = train(trainer, args, acc, self.network)
            self.arms.append(Arm(name, trainer, args))
        self.scheduler = self.arms[0].trainer.get_noise_scheduler(base_args, self.device)
        self.encoding = self.arms[0].trainer.get_text_encoding_strategy(base_args) if self.arch == "anima" else None
        self.acc = acc
        self.latent_side = self.size.px // get_arch(self.arch).vae_factor

    def batch(self, seed: int) -> dict:
        """A cached-latents batch on the device, as accelerate's prepared dataloader hands it over."""
        # a stream apart from the step's global seed (``step``): on the same seed the host's randn_like(latents) drew the
        # latents themselves, so noise = latents, the noisy input was the clean latent and the flow target 0 (Lumina's
        # native loss read exactly 0.0 at 128 px)
        gen = torch.Generator().manual_seed(1_000_003 + seed)
        side = self.latent_side
        batch = {
            "latents": torch.randn(1, 16, side, side, generator=gen),
            "text_encoder_outputs_list": text_conds(self.arch, self.size.text, gen),
            "loss_weights": torch.ones(1),
            "original_sizes_hw": torch.tensor([[self.size.px, self.size.px]]),
            "crop_top_lefts": torch.tensor([[0, 0]]),
            "target_sizes_hw": torch.tensor([[self.size.px, self.size.px]]),
        }
        return {k: [t.to(self.device) for t in v] if isinstance(v, list) else v.to(self.device) for k, v in batch.items()}

    def step(self, arm: Arm, seed: int) -> float:
        """One train step of ``arm`` (forward, backward, AdamW), in seconds of ``self.clock``."""
        batch = self.batch(seed)
        torch.manual_seed(seed)
        self._sync()
        start = self.clock()
        loss = arm.trainer.process_batch(
            batch, [], self.unet, self.network, None, self.scheduler, self.dtype, self.dtype, self.acc, arm.args, self.encoding, None,
            is_train=True, train_text_encoder=False, train_unet=True,
        )  # fmt: skip
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._sync()
        return self.clock() - start

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def run(self, warmup: int, reps: int) -> None:
        """Interleave the arms step by step, rotating the order each round."""
        for r in range(warmup + reps):
            order = self.arms[r % len(self.arms) :] + self.arms[: r % len(self.arms)]
            for arm in order:
                t = self.step(arm, seed=r)
                if r >= warmup:
                    arm.times.append(t)

    def hook_cost(self, steps: int = 50) -> float:
        """Seconds per step of the hook's own work when nothing routes (the ``never`` run's sampler
        bind, dry-run draw and route), timed alone: a figure the step-time noise cannot hide."""
        run = self.network.downscale_run  # the last start(): the never arm's run
        hook, args = run.hook, self.arms[-1].args
        latents = self.batch(0)["latents"].to(self.device)
        hw = tuple(latents.shape[-2:])
        start = self.clock()
        for _ in range(steps):
            hook.step += 1
            sampler = hook.family.bind(args, self.scheduler, latents, self.device, self.dtype)
            hook.router.route(sampler.draw, 1, hw, hook.step, first=sampler.first, law=sampler.law)
        return (self.clock() - start) / steps

    def model(self) -> StepFlops:
        """The FLOP model the plugin builds for this run's arguments, at the benchmark's depth."""
        return run_flops(self.arch, self.arms[0].args, self.arms[0].trainer, reduced=not self.size.full_depth)


def summarize(bench: Bench) -> dict:
    """Per-arm medians, per-route realized vs predicted saving, overhead, prediction errors."""
    med = {arm.name: statistics.median(arm.times) for arm in bench.arms}
    spec = get_arch(bench.arch)
    native_hw = (bench.latent_side, bench.latent_side)
    model = bench.model()
    n_native = tokens(native_hw, spec)
    out: dict[str, Any] = {
        "arch": bench.arch,
        "px": bench.size.px,
        "text": bench.size.text,
        "median_s": med,
        "times_s": {arm.name: arm.times for arm in bench.arms},
        "image_tokens": {"native": n_native},
        "weight_dtype": bench.weight_dtype,
    }
    routes = {}
    for name in ("r0.875", "r0.75"):
        ratio = float(name[1:])
        n = tokens(target_grid(native_hw, ratio, spec), spec)  # the grid the plugin runs the route at
        predicted_rel = model.flops(n) / model.flops(n_native)
        measured_rel = med[name] / med["native"]
        routes[name] = {
            "image_tokens": n,
            "measured_rel": measured_rel,
            "predicted_rel": predicted_rel,
            "realized_saving": 1 - measured_rel,
            "predicted_saving": 1 - predicted_rel,
            "realized_over_predicted": (1 - measured_rel) / (1 - predicted_rel),
            "error": predicted_rel - measured_rel,
        }
    out["routes"] = routes
    out["overhead"] = med["never"] / med["native"] - 1
    out["hook_s"] = bench.hook_cost()
    out["hook_share"] = out["hook_s"] / med["native"]
    out["realized_over_predicted"] = statistics.mean(r["realized_over_predicted"] for r in routes.values())
    out["text_tokens"] = model.text_tokens
    out["flop_model"] = model.describe()
    out["block_share"] = model.block_share(n_native)
    return out


@dataclass(frozen=True)
class Bounds:
    """The targets' bounds (``--min_realized``, ``--max_error``, ``--max_overhead``)."""

    min_realized: float = TARGET_REALIZED
    max_error: float = TARGET_ERROR
    max_overhead: float = TARGET_OVERHEAD


def targets(s: dict, bounds: Bounds) -> list[dict]:
    """Each target of one architecture's summary: per route realized/predicted ≥ ``min_realized`` and |error| ≤
    ``max_error``; with nothing routed, the end-to-end overhead and the hook's own share ≤ ``max_overhead``. A NaN
    figure misses."""
    rows = []
    for name, r in s["routes"].items():
        rows.append({"target": f"{name} realized/predicted", "value": r["realized_over_predicted"], "bound": f">= {bounds.min_realized}",
                     "met": r["realized_over_predicted"] >= bounds.min_realized})  # fmt: skip
        rows.append(
            {
                "target": f"{name} |error|",
                "value": abs(r["error"]),
                "bound": f"<= {bounds.max_error}",
                "met": abs(r["error"]) <= bounds.max_error,
            }
        )
    for name in ("overhead", "hook_share"):
        rows.append({"target": name, "value": s[name], "bound": f"<= {bounds.max_overhead}", "met": s[name] <= bounds.max_overhead})
    return rows


def report(s: dict) -> str:
    """The summary as markdown, each figure beside its target (``s["targets"]``)."""
    verdict = {t["target"]: f"{t['bound']}: {'met' if t['met'] else 'MISSED'}" for t in s["targets"]}
    lines = [f"## {s['arch']}: {s['px']} px ({s['image_tokens']['native']} image + {s['text_tokens']} text tokens), {s['flop_model']}"]
    lines.append("| arm | median step s | ratio to native |")
    lines.append("|---|---|---|")
    for name, t in s["median_s"].items():
        lines.append(f"| {name} | {t:.3f} | {t / s['median_s']['native']:.4f} |")
    lines.append(
        "| route | image tokens | measured cost | FLOP model | error (of native step) | saving realized | predicted | realized/predicted |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    for name, r in s["routes"].items():
        lines.append(
            f"| {name} | {r['image_tokens']} | {r['measured_rel']:.4f} | {r['predicted_rel']:.4f} | {100 * r['error']:+.2f} % "
            f"({verdict[name + ' |error|']}) | {100 * r['realized_saving']:.1f} % | {100 * r['predicted_saving']:.1f} % "
            f"| {r['realized_over_predicted']:.3f} ({verdict[name + ' realized/predicted']}) |"
        )
    lines.append(f"overhead when nothing routes: end to end {100 * s['overhead']:+.2f} % of the native step ({verdict['overhead']}); "
                 f"the hook's own work {1e3 * s['hook_s']:.2f} ms = {100 * s['hook_share']:.3f} % ({verdict['hook_share']}); "
                 f"blocks' share of the native step's FLOPs at this depth: {100 * s['block_share']:.1f} %")  # fmt: skip
    if "device_peak_gib" in s:
        lines.append(
            f"peak device memory {s['device_peak_gib']:.1f} GiB{' (gradient checkpointing)' if s['gradient_checkpointing'] else ''}"
        )
    return "\n".join(lines)


def profile(bench: Bench, arm_name: str, rows: int = 18) -> str:
    """One step of ``arm_name`` under ``torch.profiler``: the ops by self CPU time, and the share of
    the step in matrix products (what the FLOP model counts) against everything else."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    arm = next(a for a in bench.arms if a.name == arm_name)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        bench.step(arm, seed=10_000)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    products = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
    table = events.table(sort_by="self_cpu_time_total", row_limit=rows)
    return f"profile of one {bench.arch} {arm_name} step: matrix products {100 * products / total:.1f} % of self CPU time\n{table}"


MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::convolution_backward", "aten::mkldnn_convolution"}  # fmt: skip


def use_sd_scripts(parser: argparse.ArgumentParser, threads: int | None) -> None:
    """Every sd-scripts bench's start: the checkout at SD_SCRIPTS_DIR importable, and the thread count if given."""
    sd_scripts = os.environ.get("SD_SCRIPTS_DIR")
    if not sd_scripts:
        parser.error("set SD_SCRIPTS_DIR to an sd-scripts checkout (main 48d368fa)")
    sys.path.insert(0, sd_scripts)
    if threads:
        torch.set_num_threads(threads)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--full_depth", action="store_true", help="the published depths at 1024 px and the production text lengths")
    parser.add_argument("--px", type=int, help="image edge (default: 256 on CPU, 1024 with --full_depth)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (network_dim = network_alpha)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds (each runs every arm once)")
    parser.add_argument("--reps", type=int, default=3, help="timed rounds")
    parser.add_argument(
        "--gradient_checkpointing", nargs="?", const=",".join(ARCHS), default="", metavar="ARCHS",
        help="the trainers' --gradient_checkpointing (the FLOP model counts it): for every architecture, or for those listed",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--clock", default="wall", choices=("wall", "cpu"),
        help="time steps by wall clock, or by this process's CPU time (with --threads 1 on a machine shared with other jobs: "
        "their load then barely moves the figures)",
    )  # fmt: skip
    parser.add_argument("--json", help="write the figures here (after each architecture)")
    parser.add_argument("--min_realized", type=float, default=TARGET_REALIZED, help="target: realized/predicted saving per route, at least")
    parser.add_argument("--max_error", type=float, default=TARGET_ERROR, help="target: |predicted - measured relative cost|, at most")
    parser.add_argument("--max_overhead", type=float, default=TARGET_OVERHEAD, help="target: the cost of routing nothing, at most")
    parser.add_argument("--enforce", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument(
        "--profile", metavar="ARM", help="after the timed rounds, profile one step of this arm (native, r0.875, …): where the time goes"
    )
    args = parser.parse_args()
    use_sd_scripts(parser, args.threads)
    logging.getLogger("downscale_plugin").setLevel(logging.WARNING)  # the per-run resume notes; the banners still print
    if args.clock == "cpu" and args.device != "cpu":
        parser.error("--clock cpu measures CPU work; on an accelerator use the wall clock")
    checkpointed = {a for a in args.gradient_checkpointing.split(",") if a}
    if checkpointed - set(ARCHS):
        parser.error(f"--gradient_checkpointing {args.gradient_checkpointing}: allowed architectures {', '.join(ARCHS)}")
    bounds = Bounds(args.min_realized, args.max_error, args.max_overhead)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    device, dtype = torch.device(args.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    px = args.px or (1024 if args.full_depth else 256)
    for arch in args.archs.split(","):
        spec = get_arch(arch)
        side = px // spec.vae_factor
        if px % spec.vae_factor or any(target_grid((side, side), r, spec) is None for r in (0.875, 0.75)):
            parser.error(f"--px {px}: {arch} has no smaller grid for both routes at this size (try 128 or more, a multiple of 16)")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load {load:.2f}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"device {device}, {args.dtype}, {'full' if args.full_depth else 'reduced (2 of each block kind)'} depth, {px} px, LoRA rank {args.rank}, "
          f"{args.warmup} + {args.reps} rounds, {args.clock} clock", flush=True)  # fmt: skip
    results = []
    start = time.perf_counter()
    for arch in args.archs.split(","):
        text = PRODUCTION_TEXT[arch] if args.full_depth or device.type == "cuda" else CPU_TEXT[arch]
        size = Size(px, text, args.full_depth)
        bench = Bench(arch, size, device, dtype, args.rank, clock=clock, checkpointing=arch in checkpointed)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        bench.setup()
        bench.run(args.warmup, args.reps)
        if args.profile:
            print(profile(bench, args.profile), flush=True)
        s = summarize(bench)
        s["wall_s"] = time.perf_counter() - t0
        s["gradient_checkpointing"] = bench.checkpointing
        if device.type == "cuda":
            s["device_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        s["targets"] = targets(s, bounds)
        s["missed"] = [t["target"] for t in s["targets"] if not t["met"]]
        results.append(s)
        print(report(s), f"\n({s['wall_s']:.0f} s, load {os.getloadavg()[0]:.2f})\n", flush=True)
        del bench
        gc.collect()  # this architecture's model goes before the next one is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.json:
            meta = {"device": str(device), "dtype": args.dtype, "full_depth": args.full_depth, "px": px, "rank": args.rank,
                    "clock": args.clock, "threads": torch.get_num_threads(), "torch": torch.__version__, "warmup": args.warmup,
                    "reps": args.reps, "bounds": vars(bounds), "command": "python " + " ".join(sys.argv)}  # fmt: skip
            missed = [f"{r['arch']}: {m}" for r in results for m in r["missed"]]
            with open(args.json, "w") as fh:
                json.dump({"run": meta, "archs": results, "missed": missed, "ok": not missed}, fh, indent=1)
    for s in results:
        print(f"{s['arch']} realized/predicted = {s['realized_over_predicted']:.3f}")
    missed = [f"{r['arch']}: {m}" for r in results for m in r["missed"]]
    print(f"targets missed: {'; '.join(missed) if missed else 'none'}")
    print(f"total {time.perf_counter() - start:.0f} s, load {os.getloadavg()[0]:.2f}")
    return 1 if args.enforce and missed else 0


if __name__ == "__main__":
    sys.exit(main())
