"""Doubles of musubi-tuner's architecture trainers (main 30c658c4) on ``musubi_trainer_base``.

Each keeps the host's class names (trainer and DiT), latent layout, ``scale_shift_latents`` and the
parts of ``call_dit`` the plugin depends on: Wan's seq_len from the latent shape and its 2.2
two-expert sampler override (``timestep_boundary``, ``next_model_is_high_noise``, the per-sample
rejection loop) and expert swap before the forward; Qwen-Image re-reading ``batch["latents"]`` and
packing 2×2 with ``img_shapes`` from the latent shape; FLUX.2's packed 1/16 latents; Z-Image's
shifted, scaled latents, reversed time input and target. Each tiny DiT records what reached it.
"""

from __future__ import annotations

import torch
from musubi_trainer_base import DiTOutput, NetworkTrainer
from torch import nn


class _TinyDiT(nn.Module):
    """Per-token linear map plus a time embedding; ``calls`` records every forward's token grid and time input."""

    def __init__(self, channels: int):
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.proj = nn.Linear(channels, channels)
        self.time = nn.Linear(1, channels)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        self.calls: list[dict] = []

    def run(self, tokens: torch.Tensor, t: torch.Tensor, **record) -> torch.Tensor:
        self.calls.append({"tokens": tuple(tokens.shape), "t": t.detach().double().clone(), **record})
        return self.proj(tokens) + self.time(t.float().view(-1, 1, 1))


class WanModel(_TinyDiT):
    def forward(self, x, t, context, clip_fea=None, seq_len=None, y=None):
        b, c, f, h, w = x.shape
        tokens = x.permute(0, 2, 3, 4, 1).reshape(b, f * h * w, c)
        out = self.run(tokens, t, seq_len=seq_len, grid=(f, h, w)).reshape(b, f, h, w, c).permute(0, 4, 1, 2, 3)
        return list(out)


class QwenImageTransformer2DModel(_TinyDiT):
    def forward(self, hidden_states, timestep, img_shapes, **kwargs):
        return self.run(hidden_states, timestep, img_shapes=img_shapes)


class Flux2(_TinyDiT):
    def forward(self, x, x_ids, timesteps, **kwargs):
        return self.run(x, timesteps, ids=tuple(x_ids.shape))


class ZImageTransformer2DModel(_TinyDiT):
    def forward(self, x, t, **kwargs):
        b, c, f, h, w = x.shape
        tokens = x.permute(0, 2, 3, 4, 1).reshape(b, f * h * w, c)
        return self.run(tokens, t).reshape(b, f, h, w, c).permute(0, 4, 1, 2, 3)


def _pack(x: torch.Tensor) -> torch.Tensor:
    """B,C,1,H,W → B,(H/2·W/2),4C (qwen_image_utils.pack_latents)."""
    b, c, _, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def _unpack(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    b, _, c4 = x.shape
    c = c4 // 4
    return x.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, 1, h, w)


class WanNetworkTrainer(NetworkTrainer):
    channels = 4
    boundaries = {"t2v-14B": None, "t2v-A14B": 0.875}

    def handle_model_specific_args(self, args):
        self._i2v_training = "i2v" in args.task or "flf2v" in args.task
        self._control_training = False
        self.high_low_training = args.dit_high_noise is not None
        self.timestep_boundary = args.timestep_boundary if args.timestep_boundary is not None else self.boundaries.get(args.task)
        if self.timestep_boundary is not None and self.timestep_boundary > 1:
            self.timestep_boundary /= 1000.0
        self.experts: list[bool] = []  # the expert each forward ran (not in the host)

    def load_transformer(self, accelerator, args, dit_path, attn_mode, split_attn, loading_device, dit_weight_dtype):
        self.current_model_is_high_noise = False
        self.next_model_is_high_noise = False
        return WanModel(self.channels)

    def make_latents(self, frames, h, w, generator):
        return torch.randn(self.channels, ((frames or 1) - 1) // 4 + 1, h, w, generator=generator)

    def get_noisy_model_input_and_timesteps(self, args, noise, latents, timesteps, noise_scheduler, device, dtype):
        if not self.high_low_training:
            return super().get_noisy_model_input_and_timesteps(args, noise, latents, timesteps, noise_scheduler, device, dtype)
        _, sample_timesteps = super().get_noisy_model_input_and_timesteps(
            args, noise[0:1], latents[0:1], timesteps[0:1] if timesteps is not None else None, noise_scheduler, device, dtype
        )
        high_noise = sample_timesteps[0] / 1000.0 >= self.timestep_boundary
        self.next_model_is_high_noise = high_noise
        inputs, steps = [], []
        for i in range(latents.shape[0]):
            for _ in range(100):
                ts_i = [self.get_bucketed_timestep()] if self.num_timestep_buckets is not None else None
                noisy, ts_i = super().get_noisy_model_input_and_timesteps(
                    args, noise[i : i + 1], latents[i : i + 1], ts_i, noise_scheduler, device, dtype
                )
                if (high_noise and ts_i[0] / 1000.0 >= self.timestep_boundary) or (
                    not high_noise and ts_i[0] / 1000.0 < self.timestep_boundary
                ):
                    inputs.append(noisy)
                    steps.append(ts_i)
                    break
        if len(inputs) < latents.shape[0]:
            return super().get_noisy_model_input_and_timesteps(args, noise, latents, timesteps, noise_scheduler, device, dtype)
        return torch.cat(inputs, dim=0), torch.cat(steps, dim=0)

    def call_dit(self, args, accelerator, transformer, latents, batch, noise, noisy_model_input, timesteps, network_dtype, **kwargs):
        if self.high_low_training:
            self.current_model_is_high_noise = self.next_model_is_high_noise  # swap_high_low_weights
            self.experts.append(bool(self.current_model_is_high_noise))
        lat_f, lat_h, lat_w = latents.shape[2:5]
        seq_len = lat_f * lat_h * lat_w // (1 * 2 * 2)
        model_pred = torch.stack(
            transformer(noisy_model_input.to(network_dtype), t=timesteps, context=batch["text"], seq_len=seq_len), dim=0
        )
        return DiTOutput(pred=model_pred, target=noise - latents)


class QwenImageNetworkTrainer(NetworkTrainer):
    channels = 4

    def handle_model_specific_args(self, args):
        super().handle_model_specific_args(args)
        self.is_edit = False
        self.is_layered = False

    def load_transformer(self, accelerator, args, dit_path, attn_mode, split_attn, loading_device, dit_weight_dtype):
        return QwenImageTransformer2DModel(self.channels * 4)

    def make_latents(self, frames, h, w, generator):
        return torch.randn(self.channels, 1, h, w, generator=generator)

    def call_dit(self, args, accelerator, transformer, latents, batch, noise, noisy_model_input, timesteps, network_dtype, **kwargs):
        latents = batch["latents"]  # B, C, 1, H, W: re-read from the batch, as the host does
        lat_h, lat_w = latents.shape[3], latents.shape[4]
        img_shapes = [[(1, lat_h // 2, lat_w // 2)]]
        pred = transformer(hidden_states=_pack(noisy_model_input), timestep=timesteps / 1000.0, img_shapes=img_shapes)
        return DiTOutput(pred=_unpack(pred, lat_h, lat_w), target=noise - latents)


class Flux2NetworkTrainer(NetworkTrainer):
    channels = 8
    vae_factor = 16

    def load_transformer(self, accelerator, args, dit_path, attn_mode, split_attn, loading_device, dit_weight_dtype):
        return Flux2(self.channels)

    def make_latents(self, frames, h, w, generator):
        return torch.randn(self.channels, h, w, generator=generator)

    def call_dit(self, args, accelerator, transformer, latents, batch, noise, noisy_model_input, timesteps, network_dtype, **kwargs):
        b, c, h, w = noisy_model_input.shape
        tokens = noisy_model_input.permute(0, 2, 3, 1).reshape(b, h * w, c)
        ids = torch.zeros(b, h * w, 4)
        pred = transformer(x=tokens, x_ids=ids, timesteps=timesteps / 1000.0)
        return DiTOutput(pred=pred.reshape(b, h, w, c).permute(0, 3, 1, 2), target=noise - latents)


class ZImageNetworkTrainer(NetworkTrainer):
    channels = 4

    def load_transformer(self, accelerator, args, dit_path, attn_mode, split_attn, loading_device, dit_weight_dtype):
        return ZImageTransformer2DModel(self.channels)

    def make_latents(self, frames, h, w, generator):
        return torch.randn(self.channels, h, w, generator=generator)

    def scale_shift_latents(self, latents):
        return (latents - 0.1159) * 0.3611

    def call_dit(self, args, accelerator, transformer, latents, batch, noise, noisy_model_input, timesteps, network_dtype, **kwargs):
        t_input = (1000.0 - timesteps) / 1000.0
        pred = transformer(x=noisy_model_input.unsqueeze(2), t=t_input).squeeze(2)
        return DiTOutput(pred=pred, target=latents - noise)


class HYVideoDiffusionTransformer(WanModel):
    pass


class HunyuanVideo_1_5_DiffusionTransformer(_TinyDiT):  # noqa: N801 (the host's class name)
    def forward(self, x, t, **kwargs):
        b, c, f, h, w = x.shape
        tokens = x.permute(0, 2, 3, 4, 1).reshape(b, f * h * w, c)
        return self.run(tokens, t, grid=(f, h, w)).reshape(b, f, h, w, c).permute(0, 4, 1, 2, 3)[:, : c // 2]


class HunyuanVideoNetworkTrainer(NetworkTrainer):
    """RoPE cached per latent shape (``pos_embed_cache``), as the host's call_dit does."""

    channels = 4

    def load_transformer(self, accelerator, args, dit_path, attn_mode, split_attn, loading_device, dit_weight_dtype):
        self.pos_embed_cache = {}
        return HYVideoDiffusionTransformer(self.channels)

    def make_latents(self, frames, h, w, generator):
        return torch.randn(self.channels, ((frames or 1) - 1) // 4 + 1, h, w, generator=generator)

    def scale_shift_latents(self, latents):
        return latents * 0.476986

    def call_dit(self, args, accelerator, transformer, latents, batch, noise, noisy_model_input, timesteps, network_dtype, **kwargs):
        self.pos_embed_cache.setdefault(latents.shape[1:], tuple(latents.shape[2:]))
        pred = torch.stack(transformer(noisy_model_input, t=timesteps, context=batch["text"]), dim=0)
        return DiTOutput(pred=pred, target=noise - latents)


class HunyuanVideo15NetworkTrainer(NetworkTrainer):
    """Concatenates ``batch["latents_image"]`` when the batch has it, else zeros of the latents' shape."""

    channels = 4
    vae_factor = 16
    image_latents = False  # cache latents_image too (the host's --i2v cache)

    def load_transformer(self, accelerator, args, dit_path, attn_mode, split_attn, loading_device, dit_weight_dtype):
        return HunyuanVideo_1_5_DiffusionTransformer(2 * self.channels)

    def make_latents(self, frames, h, w, generator):
        return torch.randn(self.channels, ((frames or 1) - 1) // 4 + 1, h, w, generator=generator)

    def extra_items(self, latents):
        return {"latents_image": torch.zeros_like(latents)} if self.image_latents else {}

    def call_dit(self, args, accelerator, transformer, latents, batch, noise, noisy_model_input, timesteps, network_dtype, **kwargs):
        cond = batch.get("latents_image", torch.zeros_like(latents))
        pred = transformer(torch.cat([noisy_model_input, cond], dim=1), t=timesteps)
        return DiTOutput(pred=pred, target=noise - latents)


class FramePackNetworkTrainer(QwenImageNetworkTrainer):
    """Stands for the refused trainers: only its name matters to the plugin."""
