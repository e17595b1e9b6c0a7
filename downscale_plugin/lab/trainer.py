"""A mini LoRA trainer that keeps sd-scripts' Flux trainer method contract.

``LabTrainer.get_noise_pred_and_target`` does what ``FluxNetworkTrainer.get_noise_pred_and_target``
does, step for step (noise first, then the σ sampler and ``prepare_img_ids`` looked up as module
attributes at call time, pack, DiT call, unpack, prediction type, target = noise − latents), and
``process_batch`` / ``generate_step_logs`` are called on the instance, so the plugin can wrap them on
the instance exactly as it does in the host. ``process_batch`` computes its elementwise loss with the
module-level :func:`conditional_loss` (sd-scripts' ``train_util.conditional_loss`` signature), looked
up at call time, so the direction-loss scope wraps it exactly as in the host. Not mirrored: Chroma's modulation vectors, differential
output preservation, masked loss, text-encoder training (the lab has no text encoder to train).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import time
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import FlowMatchEulerDiscreteScheduler
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import Linear as LoraLinear
from torch.func import functional_call

from . import flux_train_utils, flux_utils
from .data import LabData
from .model import LabDiT, LabTextEncoder

# Attention projections of diffusers' Flux blocks (image and text streams; single blocks have no to_out).
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
VAL_SIGMAS = (0.1, 0.3, 0.5, 0.7, 0.9)
VALIDATION_STREAM = 0x7A11D  # the validation noise's streams: (this, seed, batch, σ index, draw), apart from every training stream


def lab_args(**overrides: Any) -> argparse.Namespace:
    """sd-scripts-named training args. Defaults follow sd-scripts' recommended Flux LoRA recipe
    (``--timestep_sampling shift --discrete_flow_shift 3.1582 --model_prediction_type raw
    --guidance_scale 1.0``); everything else is the host parser's default. Any key may be
    overridden or added (the plugin reads its own table from here, as from the host's args)."""
    args = dict(
        timestep_sampling="shift",
        sigmoid_scale=1.0,
        discrete_flow_shift=3.1582,
        model_prediction_type="raw",
        weighting_scheme="uniform",
        logit_mean=0.0,
        logit_std=1.0,
        mode_scale=1.29,
        guidance_scale=1.0,
        ip_noise_gamma=None,
        ip_noise_gamma_random_strength=False,
        gradient_checkpointing=False,
        apply_t5_attn_mask=False,
        max_train_steps=100,
        gradient_accumulation_steps=1,
        train_batch_size=1,
        learning_rate=1e-3,
        network_dim=4,
        network_alpha=4.0,
        network_train_unet_only=True,
        optimizer_type="AdamW",
        mixed_precision="no",
        loss_type="l2",
        seed=0,
    )
    args.update(overrides)
    return argparse.Namespace(**args)


def conditional_loss(
    model_pred: torch.Tensor, target: torch.Tensor, loss_type: str, reduction: str, huber_c: torch.Tensor | None = None
) -> torch.Tensor:
    """The host's loss switch for the lab's loss types (``l2``, ``l1``); the Huber types need the host's
    scheduled threshold, which the lab does not compute."""
    if loss_type == "l2":
        return F.mse_loss(model_pred, target, reduction=reduction)
    if loss_type == "l1":
        return F.l1_loss(model_pred, target, reduction=reduction)
    raise NotImplementedError(f"loss_type: {loss_type!r} is not available in the lab trainer (allowed: l2, l1)")


class LabAccelerator:
    """The few ``accelerate.Accelerator`` members the trainer touches; single CPU process, fp32."""

    device = torch.device("cpu")
    is_main_process = True
    num_processes = 1

    def autocast(self) -> AbstractContextManager:
        return contextlib.nullcontext()

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model


def make_noise_scheduler(args: argparse.Namespace) -> FlowMatchEulerDiscreteScheduler:
    """The host's Flux scheduler (``num_train_timesteps=1000``, ``shift=discrete_flow_shift``)."""
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=args.discrete_flow_shift)


class LabTrainer:
    """Host-contract trainer methods; the plugin wraps them on the instance."""

    def get_noise_pred_and_target(
        self,
        args: argparse.Namespace,
        accelerator: LabAccelerator,
        noise_scheduler,
        latents: torch.Tensor,
        batch: dict,
        text_encoder_conds: list[torch.Tensor],
        unet: LabDiT,
        network: torch.nn.Module | None,
        weight_dtype: torch.dtype,
        train_unet: bool,
        is_train: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Returns ``(model_pred, target, timesteps, weighting)`` like the host's Flux trainer."""
        noise = torch.randn_like(latents)
        bsz = latents.shape[0]
        noisy_model_input, timesteps, sigmas = flux_train_utils.get_noisy_model_input_and_timesteps(
            args, noise_scheduler, latents, noise, accelerator.device, weight_dtype
        )

        packed_noisy_model_input = flux_utils.pack_latents(noisy_model_input)
        packed_h, packed_w = noisy_model_input.shape[2] // 2, noisy_model_input.shape[3] // 2
        img_ids = flux_utils.prepare_img_ids(bsz, packed_h, packed_w).to(device=accelerator.device)
        guidance_vec = torch.full((bsz,), float(args.guidance_scale), device=accelerator.device)

        if args.gradient_checkpointing:
            noisy_model_input.requires_grad_(True)
            for t in text_encoder_conds:
                if t is not None and t.dtype.is_floating_point:
                    t.requires_grad_(True)
            img_ids.requires_grad_(True)
            guidance_vec.requires_grad_(True)

        l_pooled, t5_out, txt_ids, _t5_attn_mask = text_encoder_conds  # lab context has no padding
        with torch.set_grad_enabled(is_train), accelerator.autocast():
            model_pred = unet(
                img=packed_noisy_model_input,
                img_ids=img_ids,
                txt=t5_out,
                txt_ids=txt_ids,
                y=l_pooled,
                timesteps=timesteps / 1000,
                guidance=guidance_vec,
            )
        model_pred = flux_utils.unpack_latents(model_pred, packed_h, packed_w)
        model_pred, weighting = flux_train_utils.apply_model_prediction_type(args, model_pred, noisy_model_input, sigmas)
        target = noise - latents
        return model_pred, target, timesteps, weighting

    def process_batch(
        self,
        batch: dict,
        text_encoders: LabTextEncoder,
        unet: LabDiT,
        network: torch.nn.Module | None,
        noise_scheduler,
        weight_dtype: torch.dtype,
        accelerator: LabAccelerator,
        args: argparse.Namespace,
        is_train: bool = True,
        train_unet: bool = True,
    ) -> torch.Tensor:
        """Per-sample mean of the (weighted) elementwise loss, × ``loss_weights``, batch mean."""
        with torch.no_grad():
            latents = batch["latents"].to(accelerator.device)
        text_encoder_conds = batch.get("text_encoder_outputs_list") or text_encoders.encode(batch["class_ids"], accelerator.device)
        noise_pred, target, timesteps, weighting = self.get_noise_pred_and_target(
            args,
            accelerator,
            noise_scheduler,
            latents,
            batch,
            text_encoder_conds,
            unet,
            network,
            weight_dtype,
            train_unet,
            is_train=is_train,
        )
        loss = conditional_loss(noise_pred.float(), target.float(), args.loss_type, "none", None)
        if weighting is not None:
            loss = loss * weighting
        loss = loss.mean(dim=list(range(1, loss.ndim)))
        loss = loss * batch["loss_weights"].to(loss.device)
        return loss.mean()

    def generate_step_logs(
        self,
        args: argparse.Namespace,
        current_loss: float,
        avr_loss: float,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
        lr_descriptions: list[str] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> dict[str, float]:
        """The host's scalar dict (``loss/current``, ``loss/average``, ``lr/*``), same signature head."""
        logs = {"loss/current": current_loss, "loss/average": avr_loss}
        lrs = lr_scheduler.get_last_lr()
        for i, lr in enumerate(lrs):
            name = lr_descriptions[i] if lr_descriptions is not None else ("unet" if len(lrs) == 1 else f"group{i}")
            logs[f"lr/{name}"] = float(lr)
        return logs


def inject_lora(model: LabDiT, rank: int, alpha: float, seed: int) -> list[torch.nn.Parameter]:
    """LoRA on every attention projection via peft, base frozen; A's init is a function of ``seed``."""
    for p in model.parameters():
        p.requires_grad_(False)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(LORA_TARGETS), lora_dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(config, model)
    params = []
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
        if p.requires_grad:
            params.append(p)
    return params


def lora_deltas(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """ΔW = B·A·scale per adapted module, keyed by the base module's name."""
    return {name: m.get_delta_weight("default").detach().clone() for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def delta_cosine(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Cosine between two adapters' ΔW, all modules concatenated (same keys required)."""
    if a.keys() != b.keys():
        raise ValueError("adapters cover different modules")
    va = torch.cat([a[k].flatten().double() for k in sorted(a)])
    vb = torch.cat([b[k].flatten().double() for k in sorted(b)])
    return float(torch.dot(va, vb) / (va.norm() * vb.norm()).clamp_min(1e-300))


@dataclass
class LoraResult:
    """What a lab LoRA run leaves: adapter deltas, per-step losses and compute times, step logs, and
    ``val_curve``: (training seconds so far, steps done, validation loss) at each validation point."""

    args: argparse.Namespace
    deltas: dict[str, torch.Tensor] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    logs: list[dict[str, float]] = field(default_factory=list)
    val_curve: list[tuple[float, int, float]] = field(default_factory=list)

    @property
    def wall_time(self) -> float:
        return sum(self.step_times)


def stream_seed(*parts: int) -> int:
    """A generator seed for one stream named by ``parts``: hashed to 32 bits (``np.random.SeedSequence``),
    since torch's CPU generator keeps only a seed's low 32 bits (a seed in the high bits would give
    every training seed the same stream); streams named by different parts are unrelated."""
    if any(p < 0 for p in parts):
        raise ValueError(f"stream seed parts must be >= 0 (got {parts})")
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def step_seed(seed: int, micro_step: int) -> int:
    """The CPU generator's seed for one micro-step of a twin run (``hosts/lab/twin.py``)."""
    return stream_seed(seed, micro_step)


def seed_micro_step(seed: int, micro_step: int) -> None:
    """Start one micro-step from its own state of the lab trainer's CPU stream, whatever the steps
    before drew: the trainer seeds its own generator here, as it does for ``seed`` at the start of a
    run (a host's seeding, which the plugin never does in a host's run: ``rng.py``)."""
    torch.manual_seed(step_seed(seed, micro_step))


HookInstaller = Callable[[LabTrainer, argparse.Namespace], AbstractContextManager]
StepScope = Callable[[int, dict], AbstractContextManager]  # (micro-step, its batch) → entered around its loss
Validator = Callable[[dict[str, torch.Tensor]], float]  # the adapter's ΔW → a validation loss


def train_lora(
    model: LabDiT,
    data: LabData,
    steps: int,
    lr: float,
    rank: int,
    seed: int,
    args_overrides: dict[str, Any] | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    hook_installer: HookInstaller | None = None,
    *,
    batch_size: int = 1,
    alpha: float | None = None,
    validate: Validator | None = None,
    validate_every: int = 0,
    validate_at: Collection[int] = (),
    validate_if: Callable[[int], bool] | None = None,
    stop_if: Callable[[int], bool] | None = None,
    step_scope: StepScope | None = None,
    lr_factor: Callable[[int], float] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> LoraResult:
    """Train a LoRA on a copy of ``model`` (the caller's model is untouched).

    Same ``seed`` ⇒ same adapter init, same batches (``data.batch(micro_step, B, seed)``) and, for
    native steps, the same noise/σ draws. ``hook_installer(trainer, args)`` (the plugin) is entered
    around the whole loop; without it the run is native. Step time counts the forward, backward and
    optimizer step (not the lab's batch synthesis, which a real host caches).

    ``validate(deltas)`` runs before the first step, every ``validate_every`` steps, after each step
    count in ``validate_at`` or for which ``validate_if(steps done)`` holds, and after the last, outside the step timer and between steps, so a
    routed and a native run compare on the same native-grid loss against the same clock; it must
    draw from private generators only (:func:`native_validation_loss` does), so the run's own
    figures do not depend on it. ``stop_if(steps done)`` ends the run early (a budget in FLOPs rather
    than steps: ``steps`` is then the most it may run, and the plugin's spans still count it).

    ``step_scope(micro_step, batch)`` is entered around each micro-step's ``process_batch`` (a twin
    A/B, ``hosts/lab/twin.py``, reseeds and pairs the step's noise there). ``lr_factor(steps done)``
    scales ``lr`` for the next step (``LambdaLR``, as the kohya hosts' schedulers do; default constant).
    ``clock`` times the steps
    (``time.process_time`` at one thread: CPU seconds, which other jobs on the machine do not inflate).
    """
    alpha = float(rank if alpha is None else alpha)
    args = lab_args(
        max_train_steps=steps,
        seed=seed,
        learning_rate=lr,
        network_dim=rank,
        network_alpha=alpha,
        train_batch_size=batch_size,
        **(args_overrides or {}),
    )
    accum = args.gradient_accumulation_steps
    lora_model = copy.deepcopy(model).train()
    params = inject_lora(lora_model, rank, alpha, seed)
    if args.gradient_checkpointing:
        lora_model.transformer.enable_gradient_checkpointing()
    optimizer = torch.optim.AdamW(params, lr=lr)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor or (lambda _: 1.0))
    trainer, accelerator = LabTrainer(), LabAccelerator()
    noise_scheduler = make_noise_scheduler(args)
    text_encoder = LabTextEncoder(model.cfg)

    result = LoraResult(args=args)
    installer = hook_installer(trainer, args) if hook_installer is not None else contextlib.nullcontext()
    torch.manual_seed(seed)
    _validate(result, lora_model, validate, 0)
    with installer:
        for step in range(steps):
            step_loss, elapsed = 0.0, 0.0
            for k in range(accum):
                batch = data.batch(step * accum + k, batch_size, seed)
                scope = step_scope(step * accum + k, batch) if step_scope is not None else contextlib.nullcontext()
                t0 = clock()
                with scope:
                    loss = trainer.process_batch(
                        batch, text_encoder, lora_model, lora_model, noise_scheduler,
                        torch.float32, accelerator, args,
                    )  # fmt: skip
                (loss / accum).backward()
                elapsed += clock() - t0
                step_loss += loss.item() / accum
            t0 = clock()
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            elapsed += clock() - t0
            if not math.isfinite(step_loss):
                raise FloatingPointError(f"non-finite loss at step {step}")
            result.losses.append(step_loss)
            result.step_times.append(elapsed)
            logs = trainer.generate_step_logs(args, step_loss, sum(result.losses) / len(result.losses), lr_scheduler)
            logs["time/step"] = elapsed
            result.logs.append(logs)
            if on_step is not None:
                on_step(step, logs)
            done = step + 1
            stopping = stop_if is not None and stop_if(done)  # both called after every step: they may keep count
            asked = validate_if is not None and validate_if(done)
            last = done == steps or stopping
            if last or asked or (validate_every and done % validate_every == 0) or done in validate_at:
                _validate(result, lora_model, validate, done)
            if last:
                break
    result.deltas = lora_deltas(lora_model)
    return result


def _validate(result: LoraResult, lora_model: torch.nn.Module, validate: Validator | None, steps_done: int) -> None:
    if validate is not None:
        result.val_curve.append((result.wall_time, steps_done, validate(lora_deltas(lora_model))))


@torch.no_grad()
def native_validation_losses(
    model: LabDiT,
    lora: dict[str, torch.Tensor] | None,
    val_set: list[dict],
    seed: int,
    sigmas: tuple[float, ...] = VAL_SIGMAS,
    draws: int = 1,
    rows_per_forward: int | None = None,
) -> torch.Tensor:
    """Per-item velocity MSE on the native grid, ``[crops, σ, draws]``: every crop of ``val_set``
    (its batches in order) at each fixed σ with ``draws`` noise draws of its own, with ΔW merged into
    the base weights (``lora=None``: the base model). Each (batch, σ, draw) noise comes from a private
    generator seeded by (``seed``, batch, σ index, draw), so a point of a validation curve is a pure
    function of the adapter, and the items' spread is the validation set's own sampling error.

    ``rows_per_forward``: the DiT runs a bucket's rows (crop × σ × draw) in chunks of this many (default:
    the whole bucket at once); on one CPU thread small chunks are faster (benchmarks/bench_quality.py)."""
    if draws < 1 or not sigmas or (rows_per_forward is not None and rows_per_forward < 1):
        raise ValueError(
            f"native validation needs draws >= 1, at least one σ and rows_per_forward >= 1 (got {draws}, {sigmas}, {rows_per_forward})"
        )
    weights = {}
    if lora:
        params = dict(model.named_parameters())
        weights = {f"{name}.weight": params[f"{name}.weight"] + delta for name, delta in lora.items()}
    text_encoder = LabTextEncoder(model.cfg)
    per_batch = []
    for i, batch in enumerate(val_set):
        x = batch["latents"]
        b, s, d = x.shape[0], len(sigmas), draws
        noise = torch.stack([
            torch.randn(x.shape, generator=torch.Generator().manual_seed(stream_seed(VALIDATION_STREAM, seed, i, j, k)))
            for j in range(s) for k in range(d)
        ], dim=1)  # [B, S·D, C, h, w]  # fmt: skip
        sigma = torch.tensor(sigmas, dtype=x.dtype).repeat_interleave(d)  # [S·D], σ index major as in noise
        clean = x[:, None].expand_as(noise)
        noisy = (1 - sigma[None, :, None, None, None]) * clean + sigma[None, :, None, None, None] * noise
        rows = b * s * d  # one forward for the whole bucket: every crop, σ and draw
        l_pooled, t5_out, txt_ids, _ = text_encoder.encode(batch["class_ids"].repeat_interleave(s * d))
        packed_h, packed_w = x.shape[2] // 2, x.shape[3] // 2
        kwargs = dict(
            img=flux_utils.pack_latents(noisy.reshape(rows, *x.shape[1:])), img_ids=flux_utils.prepare_img_ids(rows, packed_h, packed_w),
            txt=t5_out, txt_ids=txt_ids, y=l_pooled, timesteps=sigma.repeat(b),
        )  # fmt: skip
        chunk = rows_per_forward or rows
        pred = torch.cat([
            functional_call(model, weights, args=(), kwargs={k: v[i : i + chunk] for k, v in kwargs.items()})
            for i in range(0, rows, chunk)
        ])  # fmt: skip
        pred = flux_utils.unpack_latents(pred, packed_h, packed_w)
        target = (noise - clean).reshape(rows, *x.shape[1:])
        per_batch.append(((pred - target) ** 2).mean(dim=(1, 2, 3)).reshape(b, s, d))
    return torch.cat(per_batch)


def native_validation_loss(
    model: LabDiT,
    lora: dict[str, torch.Tensor] | None,
    val_set: list[dict],
    seed: int,
    sigmas: tuple[float, ...] = VAL_SIGMAS,
    draws: int = 1,
) -> float:
    """The mean of :func:`native_validation_losses`: every crop, σ and draw weighs the same."""
    return native_validation_losses(model, lora, val_set, seed, sigmas, draws).mean().item()
