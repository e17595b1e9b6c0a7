"""The map backend for the built-in lab: pretrained lab DiT + a warm-trained peft LoRA + lab probes.

Every draw runs the lab trainer's own step (``LabTrainer.process_batch`` →
``get_noise_pred_and_target``: noise, noisy input, packing, ids, target, loss, all the host's way),
with the map's σ replayed through the host sampler slot by the plugin's own
``FlowFamily(lab.flux_train_utils, "flux")``, exactly as the training hook replays a routed σ.

Adapter choice: peft's standard LoRA init has B = 0, which gives A a zero gradient, so a fresh
adapter would measure only half its parameters. The anchor measured a *trained* adapter; here the
adapter is warm-trained natively for a few steps (``warm_steps``) so both factors carry gradient,
and the gradient is taken w.r.t. every adapter parameter, base model frozen.

The lab has no VAE (its "codec" is a fixed linear map), so only the native and latent-area arms
are available; ``reenc`` and ``pixel`` arms need a backend with a real VAE (see ``arms.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..grid import area_downsample, get_arch, target_grid
from ..hosts.families import FlowFamily
from .arms import Arm

PROBE_STREAM = 0x9B0BE  # probe crops come from their own data stream, never the warm-up batches


@dataclass(frozen=True)
class LabMapConfig:
    """What the lab map runs on. ``pretrained=False`` skips pretraining (tests only)."""

    model: Any = None  # LabModelConfig; None = the lab default
    quick: bool = False
    pretrained: bool = True
    native_hw: tuple[int, int] = (64, 64)
    rank: int = 4
    warm_steps: int = 30
    warm_lr: float = 2e-3
    warm_batch: int = 2
    seed: int = 0
    arch: str = "flux"
    data: Any = field(default=None, compare=False)  # a LabData to reuse; None = build the default


def select_probes(data: Any, n: int, native_hw: tuple[int, int], seed: int) -> list[dict]:
    """n probe crops of exactly ``native_hw`` latent cells, deterministic in ``seed``.

    Batches come from ``data.batch(step, 1, ...)`` on a dedicated stream; a latent at least that
    large is cropped at a seeded position (the lab codec is local, so a latent crop is the encoding
    of the image crop).
    """
    h, w = native_hw
    probes: list[dict] = []
    used: set[int] = set()
    for step in range(200 * n):
        batch = data.batch(step, 1, seed + PROBE_STREAM)
        lat, source = batch["latents"], int(batch["class_ids"][0])
        # Distinct source images first (a map over many crops of one photo says little); repeats
        # only once every source is in.
        if lat.shape[-2] < h or lat.shape[-1] < w or (source in used and len(used) < data.num_classes):
            continue
        used.add(source)
        rng = np.random.default_rng([seed, step, PROBE_STREAM])
        y = int(rng.integers(lat.shape[-2] - h + 1))
        x = int(rng.integers(lat.shape[-1] - w + 1))
        probes.append(
            {"latents": lat[..., y : y + h, x : x + w].contiguous(), "class_ids": batch["class_ids"], "caption": batch["captions"][0]}
        )
        if len(probes) == n:
            return probes
    raise ValueError(
        f"native size {h}x{w} latent: the lab data has no bucket that large (buckets: {data.cfg.buckets}, 4 px per latent cell)"
    )


def lab_problems(cfg: LabMapConfig, arms: list[Arm] | tuple[Arm, ...]) -> list[str]:
    """What makes this lab map impossible, found without building anything (empty = fine)."""
    arch = get_arch(cfg.arch)
    h, w = cfg.native_hw
    if h < arch.multiple or w < arch.multiple or h % arch.multiple or w % arch.multiple:
        return [f"native size: {h}x{w} latent cells must be positive multiples of {arch.multiple} ({arch.name})"]
    problems = []
    for arm in arms:
        if arm.kind in ("reenc", "pixel"):
            problems.append(f"arm {arm.name}: the lab has no VAE; re-encode and pixel-downscale arms need a backend with one")
        elif arm.kind == "latent" and target_grid(cfg.native_hw, arm.ratio, arch) is None:
            problems.append(f"ratio {arm.ratio:g}: no strictly smaller {arch.name} grid for a {h}x{w} latent (multiple {arch.multiple})")
    if cfg.warm_steps < 0 or cfg.rank < 1:
        problems.append(f"adapter: rank {cfg.rank} must be >= 1 and warm_steps {cfg.warm_steps} >= 0")
    return problems


class LabBackend:
    """:class:`~downscale_plugin.mapping.arms.MapBackend` on the lab DiT; see the module docstring."""

    rng_devices: tuple[int, ...] = ()

    def __init__(self, cfg: LabMapConfig, images: int, progress: bool = True) -> None:
        from ..lab import flux_train_utils
        from ..lab.data import LabData, LabDataConfig
        from ..lab.model import LabModelConfig, LabTextEncoder, build_model
        from ..lab.pretrain import load_or_pretrain
        from ..lab.trainer import LabAccelerator, LabTrainer, inject_lora, lab_args, make_noise_scheduler

        problems = lab_problems(cfg, ())
        if problems:
            raise ValueError("; ".join(problems))
        self.cfg = cfg
        self.arch = get_arch(cfg.arch)
        model_cfg = cfg.model or LabModelConfig()
        data = cfg.data or LabData(LabDataConfig(latent_channels=model_cfg.latent_channels))
        self.probes = select_probes(data, images, cfg.native_hw, cfg.seed)
        if cfg.pretrained:
            self.model = load_or_pretrain(model_cfg, quick=cfg.quick, progress=progress, data=data)
        else:
            self.model = build_model(model_cfg, cfg.seed).requires_grad_(False)
        self.model_cfg = model_cfg
        self.params = inject_lora(self.model, cfg.rank, float(cfg.rank), cfg.seed)
        self.args = lab_args(seed=cfg.seed, network_dim=cfg.rank, network_alpha=float(cfg.rank))
        self.trainer, self.accelerator = LabTrainer(), LabAccelerator()
        self.noise_scheduler = make_noise_scheduler(self.args)
        self.text_encoder = LabTextEncoder(model_cfg)
        self.warm_losses = self._warm_up(data) if cfg.warm_steps > 0 else []
        for probe in self.probes:
            probe["text_encoder_outputs_list"] = self.text_encoder.encode(probe["class_ids"])
        self._data_desc = f"lab corpus ({len(data.names)} sources: {', '.join(data.names)})"
        family = FlowFamily(flux_train_utils, "flux")
        self.sampler = family.bind(self.args, self.noise_scheduler, self.probes[0]["latents"], self.accelerator.device, torch.float32)
        with torch.random.fork_rng(devices=[]):
            self.sampler.first()  # records the host's output dtypes for the replay; RNG use is forked away

    def _warm_up(self, data: Any) -> list[float]:
        """A few native AdamW steps through the trainer's own ``process_batch`` (seeded, RNG forked)."""
        optimizer = torch.optim.AdamW(self.params, lr=self.cfg.warm_lr)
        losses = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            for step in range(self.cfg.warm_steps):
                batch = data.batch(step, self.cfg.warm_batch, self.cfg.seed)
                loss = self.trainer.process_batch(
                    batch, self.text_encoder, self.model, self.model, self.noise_scheduler, torch.float32, self.accelerator, self.args
                )
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
        return losses

    def describe(self) -> dict[str, Any]:
        m = self.model_cfg
        pre = "random init (not pretrained)" if not self.cfg.pretrained else ("quick pretrain" if self.cfg.quick else "default pretrain")
        warm = f"warm-trained {self.cfg.warm_steps} native steps (batch {self.cfg.warm_batch}, lr {self.cfg.warm_lr:g})"
        if self.warm_losses:
            warm += f", loss {self.warm_losses[0]:.4f} -> {np.mean(self.warm_losses[-5:]):.4f}"
        return {
            "model": f"lab DiT (diffusers FluxTransformer2DModel, hidden {m.hidden_size}, {m.double_layers}+{m.single_layers} blocks, {pre})",
            "adapter": f"peft LoRA r={self.cfg.rank} alpha={self.cfg.rank} on attention projections, {sum(p.numel() for p in self.params)} params, {warm}",
            "data": f"{self._data_desc}; probes: {', '.join(p['caption'] for p in self.probes)}",
            "arch": self.cfg.arch,
            "native_latent_hw": list(self.cfg.native_hw),
            "note": "lab latents are 4 px per cell; the tier edge uses the arch's VAE factor, as the router does",
        }

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return list(self.params)

    def num_images(self) -> int:
        return len(self.probes)

    def unsupported(self, arm: Arm) -> str | None:
        problems = lab_problems(self.cfg, (arm,))
        return problems[0] if problems else None

    def arm_input(self, image: int, arm: Arm) -> torch.Tensor:
        latents = self.probes[image]["latents"]
        if arm.kind == "native":
            return latents
        return area_downsample(latents, target_grid(self.cfg.native_hw, arm.ratio, self.arch))

    def loss(self, image: int, arm_input: torch.Tensor, sigma: float) -> torch.Tensor:
        """One draw of the trainer's loss at exactly ``sigma`` (timestep σ·1000, the host's continuous-mode value)."""
        key = float(sigma)
        self.sampler.drawn[key] = (key * self.noise_scheduler.config.num_train_timesteps, key)
        probe = self.probes[image]
        batch = {
            "latents": arm_input,
            "loss_weights": torch.ones(1),
            "class_ids": probe["class_ids"],
            "text_encoder_outputs_list": probe["text_encoder_outputs_list"],
        }
        with self.sampler.replay(torch.tensor([key], dtype=torch.float64)):
            return self.trainer.process_batch(
                batch, self.text_encoder, self.model, self.model, self.noise_scheduler, torch.float32, self.accelerator, self.args
            )


def describe_config(cfg: LabMapConfig) -> dict[str, Any]:
    """The lab map config as plain data (for the JSON provenance)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in ("data", "model")}
