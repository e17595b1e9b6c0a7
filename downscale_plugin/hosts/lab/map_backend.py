"""The map backend for the built-in lab: pretrained lab DiT + a warm-trained peft LoRA + lab probes.

Every draw runs the lab trainer's own step (``LabTrainer.process_batch`` →
``get_noise_pred_and_target``: noise, noisy input, packing, ids, target, loss, all the host's way),
with the map's σ replayed through the host sampler slot by the plugin's own
``FlowFamily(lab.flux_train_utils, "flux")``, exactly as the training hook replays a routed σ.

Adapter choice: peft's standard LoRA init has B = 0, which gives A a zero gradient, so a fresh
adapter would measure only half its parameters. The anchor measured a *trained* adapter; here the
adapter is warm-trained natively for a few steps (``warm_steps``) so both factors carry gradient,
and the gradient is taken w.r.t. every adapter parameter, base model frozen.

VAE arms on the lab codec (``lab.data.LatentCodec``: pixel-unshuffle by 4, orthonormal 48→C rows,
per-channel norm; lossy, C of 48 directions kept):

- ``pixel_<r>`` = encode(area-downsample(the probe crop's *true* pixels) to the target grid × 4 px):
  the seed paper's "downscale the PNG, then encode" (it used LANCZOS; area here, the latent arm's
  filter family, so pixel vs latent isolates where the averaging happens). Not the decoded latent:
  decode(z) is the patch-wise projection of the pixels, the discarded 48 − C directions are zero
  there, and after a pixel downsample they would have mixed into the kept ones.
- ``reenc`` = encode(decode(latent)) at native size. Encoding the true pixels again would be the
  native latent by construction, so the round trip must go through decode; with orthonormal rows
  it is the identity up to float rounding (~4e-6), so on the lab this control is a third,
  independent native draw set: the null witness (≈ 0) against which the map also reports every
  arm's paired excess. It prices no codec loss, unlike a real VAE's round trip. (Clamping the decoded
  image to [0, 1] would be no fix: the decoded pixels are far outside it, ~25 % of values, and the
  clamp moves the latent by 30–50 %.)

Policies and positions (fasterdit/policies.py, fasterdit/positions.py): a small-grid arm's step runs at ``shift_sigma(σ, k)`` with the
policy's factor k (``res_shift`` from the token counts, ``snr_match`` from the data stds of the
native probe latents and of this arm's small inputs, pooled over every probe), replayed through the
host sampler slot; with ``interpolate`` the forward runs inside ``positions_scope`` (Flux ids from
``lab.flux_utils.prepare_img_ids``), so the small grid's ids span the native extent; with ``attention = proportional``
inside the lab's attention scope (``hosts/lab/attention.py``: ln(N_native / N_small) on the image keys), as a routed
training step runs.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ... import __version__
from ...arch import get_arch
from ...attention import PROPORTIONAL, log_size
from ...fasterdit.policies import policy_factor, shift_sigma
from ...fasterdit.positions import positions_scope
from ...fasterdit.stats import Moments
from ...grid import area_downsample, target_grid, tokens
from ...lab.concept import task_problem
from ...lab.data import FACTOR
from ...mapping.arms import SMALL_KINDS, Arm
from ...rng import forked, seed_forked
from ..sd_scripts.families import FlowFamily
from .attention import attention_scope

PROBE_STREAM = 0x9B0BE  # probe crops come from their own data stream, never the warm-up batches


@dataclass(frozen=True)
class LabMapConfig:
    """What the lab map runs on. ``pretrained=False`` skips pretraining (tests only); ``base`` names a
    shipped base (``lab/base.py``: loaded, never trained) instead of the single-size pretrain."""

    model: Any = None  # LabModelConfig; None = the lab default (a shipped base: its own)
    quick: bool = False
    base: str | None = None
    pretrained: bool = True
    native_hw: tuple[int, int] = (64, 64)
    rank: int = 4
    warm_steps: int = 30
    warm_lr: float = 2e-3
    warm_batch: int = 2
    seed: int = 0
    arch: str = "flux"
    task: str = "corpus"  # lab.concept.TASKS: the probes and warm-up come from the pretraining corpus or a concept
    data: Any = field(default=None, compare=False)  # the pretraining LabData to reuse; None = build the default


@dataclass(frozen=True)
class ArmInput:
    """One arm's data for one probe: its latent, the σ policy factor k its step runs at
    (``shift_sigma(σ, k)``; 1 = keep), whether its position ids are interpolated to the native span and whether its
    attention is proportional."""

    latents: torch.Tensor
    shift: float = 1.0
    interpolate: bool = False
    proportional: bool = False


def select_probes(data: Any, n: int, native_hw: tuple[int, int], seed: int) -> list[dict]:
    """n probe crops of exactly ``native_hw`` latent cells, deterministic in ``seed``.

    Batches come from ``data.batch(step, 1, ...)`` on a dedicated stream; a latent at least that
    large is cropped at a seeded position (the lab codec is local, so a latent crop is the encoding
    of the image crop, kept as ``pixels`` for the pixel arms).
    """
    h, w = native_hw
    probes: list[dict] = []
    used: set[int] = set()
    for step in range(200 * n):
        batch = data.batch(step, 1, seed + PROBE_STREAM, pixels=True)
        lat, source = batch["latents"], int(batch["sources"][0])
        # Distinct source images first (a map over many crops of one photo says little); repeats
        # only once every source is in.
        if lat.shape[-2] < h or lat.shape[-1] < w or (source in used and len(used) < data.num_sources):
            continue
        used.add(source)
        rng = np.random.default_rng([seed, step, PROBE_STREAM])
        y = int(rng.integers(lat.shape[-2] - h + 1))
        x = int(rng.integers(lat.shape[-1] - w + 1))
        pixels = batch["pixels"][..., FACTOR * y : FACTOR * (y + h), FACTOR * x : FACTOR * (x + w)].contiguous()
        latents = lat[..., y : y + h, x : x + w].contiguous()
        probes.append({"latents": latents, "pixels": pixels, "class_ids": batch["class_ids"], "caption": batch["captions"][0]})
        if len(probes) == n:
            return probes
    raise ValueError(
        f"native size {h}x{w} latent: the lab data has no bucket that large (buckets: {data.cfg.buckets}, 4 px per latent cell)"
    )


def data_holding(cfg: Any, crop_px: tuple[int, int]) -> Any:
    """``cfg`` (a ``LabDataConfig``) when one of its buckets holds a ``crop_px`` crop; else one square bucket that does.

    The square bucket's side is the crop's longer side rounded up to 32 px, so the sources are resized to it (times
    ``scales``) as for the defaults' largest side: a native size past every default bucket (the 2 304-token map at
    384 px) sees the whole picture at that size, as the default square bucket does at 256 px.
    """
    if any(h >= crop_px[0] and w >= crop_px[1] for h, w in cfg.buckets):
        return cfg
    side = -(-max(crop_px) // 32) * 32
    return dataclasses.replace(cfg, buckets=((side, side),))


def lab_problems(cfg: LabMapConfig, arms: list[Arm] | tuple[Arm, ...]) -> list[str]:
    """What makes this lab map impossible, found without building anything (empty = fine)."""
    arch = get_arch(cfg.arch)
    h, w = cfg.native_hw
    if h < arch.multiple or w < arch.multiple or h % arch.multiple or w % arch.multiple:
        return [f"native size: {h}x{w} latent cells must be positive multiples of {arch.multiple} ({arch.name})"]
    problems = [p for p in [task_problem(cfg.task)] if p]
    if cfg.base is not None:
        from ...lab.base import BASES

        if cfg.base not in BASES:
            problems.append(f"lab_base: {cfg.base!r} is not a shipped lab base (allowed: {', '.join(BASES)})")
        if cfg.quick or cfg.model is not None or not cfg.pretrained:
            problems.append("lab_base: a shipped base has its own model and weights; not with quick, model or pretrained=False")
    for arm in arms:
        if arm.kind in SMALL_KINDS and target_grid(cfg.native_hw, arm.ratio, arch) is None:
            problems.append(
                f"arm {arm.name}: ratio {arm.ratio:g}: no strictly smaller {arch.name} grid for a {h}x{w} latent (multiple {arch.multiple})"
            )
        if arm.positions == "interpolate" and arch.name not in ("flux", "chroma"):
            problems.append(f"arm {arm.name}: positions 'interpolate' on the lab needs arch flux or chroma (its ids), not {arch.name}")
    if cfg.warm_steps < 0 or cfg.rank < 1:
        problems.append(f"adapter: rank {cfg.rank} must be >= 1 and warm_steps {cfg.warm_steps} >= 0")
    return problems


class LabBackend:
    """:class:`~downscale_plugin.mapping.arms.MapBackend` on the lab DiT; see the module docstring."""

    rng_devices: tuple[int, ...] = ()

    def __init__(self, cfg: LabMapConfig, images: int, progress: bool = True) -> None:
        from ...lab import flux_train_utils, flux_utils
        from ...lab.base import get_base, load_base, shipped_record
        from ...lab.concept import task_data
        from ...lab.data import LabData, LabDataConfig
        from ...lab.model import LabModelConfig, LabTextEncoder, build_model
        from ...lab.pretrain import DEFAULT, QUICK, cache_key, load_or_pretrain
        from ...lab.trainer import LabAccelerator, LabTrainer, inject_lora, lab_args, make_noise_scheduler

        problems = lab_problems(cfg, ())
        if problems:
            raise ValueError("; ".join(problems))
        self.cfg = cfg
        self.arch = get_arch(cfg.arch)
        self.flux_utils = flux_utils  # the module whose ``prepare_img_ids`` the trainer calls (positions scope)
        self.attention_scope = attention_scope()  # the lab DiT's joint attention (proportional arms)
        model_cfg = get_base(cfg.base).model if cfg.base else cfg.model or LabModelConfig()
        native_px = (cfg.native_hw[0] * FACTOR, cfg.native_hw[1] * FACTOR)
        base = cfg.data or LabData(data_holding(LabDataConfig(latent_channels=model_cfg.latent_channels), native_px))
        data = task_data(cfg.task, base)
        self.probes = select_probes(data, images, cfg.native_hw, cfg.seed)
        if cfg.base:
            self.model = load_base(cfg.base)
            self.identity = f"lab:base:{cfg.base}:{shipped_record(get_base(cfg.base))['sha256'][:16]}"  # the shipped weights' digest
        elif cfg.pretrained:
            self.model = load_or_pretrain(model_cfg, quick=cfg.quick, progress=progress, data=base)
            self.identity = f"lab:{cache_key(model_cfg, QUICK if cfg.quick else DEFAULT, base)}"  # the cached weights' key
        else:
            self.model = build_model(model_cfg, cfg.seed).requires_grad_(False)
            self.identity = f"lab:random-init:{cfg.seed}"
        self.model_cfg = model_cfg
        self.codec = data.codec
        self.stds: dict[tuple[str, float], tuple[float, float]] = {}  # (kind, ratio) -> (native std, small std), for snr_match
        self.shifts: dict[str, float] = {}  # arm name -> policy factor k, as used (provenance)
        self.params = inject_lora(self.model, cfg.rank, float(cfg.rank), cfg.seed)
        self.args = lab_args(seed=cfg.seed, network_dim=cfg.rank, network_alpha=float(cfg.rank))
        self.trainer, self.accelerator = LabTrainer(), LabAccelerator()
        self.noise_scheduler = make_noise_scheduler(self.args)
        self.text_encoder = LabTextEncoder(model_cfg)
        self.warm_losses = self._warm_up(data) if cfg.warm_steps > 0 else []
        for probe in self.probes:
            probe["text_encoder_outputs_list"] = self.text_encoder.encode(probe["class_ids"])
        corpus = "lab corpus" if data is base else f"lab concept '{cfg.task}', new to the base model"
        self._data_desc = f"{corpus} ({len(data.names)} sources: {', '.join(data.names)}; buckets {list(base.cfg.buckets)} px)"
        family = FlowFamily(flux_train_utils, "flux")
        self.sampler = family.bind(self.args, self.noise_scheduler, self.probes[0]["latents"], self.accelerator.device, torch.float32)
        with forked():
            self.sampler.first()  # records the host's output dtypes for the replay; RNG use is forked away

    def _warm_up(self, data: Any) -> list[float]:
        """A few native AdamW steps through the trainer's own ``process_batch`` (seeded, RNG forked)."""
        optimizer = torch.optim.AdamW(self.params, lr=self.cfg.warm_lr)
        losses = []
        with forked():
            seed_forked(self.cfg.seed)
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
        if self.cfg.base:
            pre = f"shipped multi-size base {self.cfg.base!r} (lab/base.py)"
        warm = f"warm-trained {self.cfg.warm_steps} native steps (batch {self.cfg.warm_batch}, lr {self.cfg.warm_lr:g})"
        if self.warm_losses:
            warm += f", loss {self.warm_losses[0]:.4f} -> {np.mean(self.warm_losses[-5:]):.4f}"
        return {
            "model": f"lab DiT (diffusers FluxTransformer2DModel, hidden {m.hidden_size}, {m.double_layers}+{m.single_layers} blocks, {pre})",
            "adapter": f"peft LoRA r={self.cfg.rank} alpha={self.cfg.rank} on attention projections, {sum(p.numel() for p in self.params)} params, {warm}",
            "data": f"{self._data_desc}; probes: {', '.join(p['caption'] for p in self.probes)}",
            "arch": self.cfg.arch,
            "model_identity": self.identity,
            "plugin_version": __version__,
            "native_latent_hw": list(self.cfg.native_hw),
            "note": "lab latents are 4 px per cell; the tier edge uses the arch's VAE factor, as the router does",
            "codec": f"lab LatentCodec (pixel-unshuffle 4, orthonormal 48->{self.codec.projection.shape[0]}, per-channel norm); "
            "pixel arms: area-downsampled true crop pixels, encoded; reenc: encode(decode(latent)), exact up to float rounding",
            "sigma_policy_factors": dict(self.shifts),
            "data_stds": {f"{kind}_{ratio:g}": list(v) for (kind, ratio), v in self.stds.items()},
        }

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return list(self.params)

    def num_images(self) -> int:
        return len(self.probes)

    def unsupported(self, arm: Arm) -> str | None:
        problems = lab_problems(self.cfg, (arm,))
        return problems[0] if problems else None

    def _latents(self, image: int, kind: str, ratio: float | None) -> torch.Tensor:
        """The latent an arm of ``kind`` trains on for one probe (see the module docstring)."""
        probe = self.probes[image]
        if kind == "native":
            return probe["latents"]
        if kind == "reenc":
            return self.codec.encode(self.codec.decode(probe["latents"]))
        small_hw = target_grid(self.cfg.native_hw, ratio, self.arch)
        if kind == "latent":
            return area_downsample(probe["latents"], small_hw)
        return self.codec.encode(area_downsample(probe["pixels"], (FACTOR * small_hw[0], FACTOR * small_hw[1])))

    def _shift(self, arm: Arm) -> float:
        """The arm's σ policy factor k; ``snr_match`` stds pooled over every probe, once per (kind, ratio)."""
        if arm.policy == "keep":
            return 1.0
        small_hw = target_grid(self.cfg.native_hw, arm.ratio, self.arch)
        stds: tuple[float, ...] = ()
        if arm.policy == "snr_match":
            key = (arm.kind, arm.ratio)
            if key not in self.stds:
                native, small = Moments(), Moments()
                for i in range(len(self.probes)):
                    native.add(self.probes[i]["latents"])
                    small.add(self._latents(i, arm.kind, arm.ratio))
                self.stds[key] = (native.std, small.std)
            stds = self.stds[key]
        k = policy_factor(arm.policy, tokens(self.cfg.native_hw, self.arch), tokens(small_hw, self.arch), *stds)
        self.shifts[arm.name] = k
        return k

    def arm_input(self, image: int, arm: Arm) -> ArmInput:
        return ArmInput(
            self._latents(image, arm.kind, arm.ratio), self._shift(arm), arm.positions == "interpolate", arm.attention == PROPORTIONAL
        )

    def loss(self, image: int, arm_input: ArmInput, sigma: float) -> torch.Tensor:
        """One draw of the trainer's loss; the step runs at the arm's policy σ (timestep σ·1000, the
        host's continuous-mode value), inside the positions scope for an interpolating arm and the attention scope
        for a proportional one."""
        key = float(shift_sigma(sigma, arm_input.shift)) if arm_input.shift != 1.0 else float(sigma)
        sigma_key = torch.tensor([key], dtype=torch.float64)
        position = self.sampler.pool.add(sigma_key * self.noise_scheduler.config.num_train_timesteps, sigma_key)
        probe = self.probes[image]
        batch = {
            "latents": arm_input.latents,
            "loss_weights": torch.ones(1),
            "class_ids": probe["class_ids"],
            "text_encoder_outputs_list": probe["text_encoder_outputs_list"],
        }
        small_hw = tuple(arm_input.latents.shape[-2:])
        scope = positions_scope(self.arch, self.cfg.native_hw, small_hw, module=self.flux_utils) if arm_input.interpolate else nullcontext()
        small = tokens(small_hw, self.arch)
        attention = (
            self.attention_scope(small, log_size(tokens(self.cfg.native_hw, self.arch), small)) if arm_input.proportional else nullcontext()
        )
        with self.sampler.replay(position), scope, attention:
            return self.trainer.process_batch(
                batch, self.text_encoder, self.model, self.model, self.noise_scheduler, torch.float32, self.accelerator, self.args
            )


def describe_config(cfg: LabMapConfig) -> dict[str, Any]:
    """The lab map config as plain data (for the JSON provenance)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in ("data", "model")}
