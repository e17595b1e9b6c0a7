"""A small DiT built from diffusers' real ``FluxTransformer2DModel``, called like sd-scripts' Flux.

The point of the lab is the image path: real double/single-stream blocks, real joint attention and
real 3-axis RoPE on ``img_ids``, at a size where a 1024-token step runs in ~0.1 s on 2 CPU cores and
attention is more than half of a block's FLOPs (so downscaling saves super-linearly, as on real
models). The "text" is a fixed random context per image class, standing in for cached T5/CLIP outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from diffusers import FluxTransformer2DModel
from torch import nn


@dataclass(frozen=True)
class LabModelConfig:
    """Shape of the lab DiT. Defaults: 2 double + 4 single blocks, width 128, 4 heads of 32."""

    hidden_size: int = 128
    num_heads: int = 4
    double_layers: int = 2
    single_layers: int = 4
    latent_channels: int = 16
    text_tokens: int = 16
    text_dim: int = 64
    pooled_dim: int = 32
    text_seed: int = 1234

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError("hidden_size / num_heads must be a multiple of 4 (three even RoPE axes)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def depth(self) -> int:
        """Blocks every token passes through (a double block runs each token through one stream)."""
        return self.double_layers + self.single_layers

    @property
    def mlp_ratio(self) -> float:
        """Fixed at 4 by diffusers' Flux blocks (not a constructor argument there)."""
        return 4.0

    @property
    def axes_dims_rope(self) -> tuple[int, int, int]:
        """(index axis, row axis, column axis), each even, summing to the head dim, Flux-like split."""
        spatial = self.head_dim * 3 // 8 // 2 * 2
        return (self.head_dim - 2 * spatial, spatial, spatial)


class FlopShape(NamedTuple):
    """What a per-step cost model a·N + b·N² needs (N = image tokens; text tokens add to N)."""

    hidden: int
    depth: int
    mlp_ratio: float
    text_tokens: int


def flop_shape(cfg: LabModelConfig) -> FlopShape:
    return FlopShape(cfg.hidden_size, cfg.depth, cfg.mlp_ratio, cfg.text_tokens)


def image_tokens(latent_height: int, latent_width: int) -> int:
    """Packed (2×2) image tokens of a latent grid."""
    return (latent_height // 2) * (latent_width // 2)


class LabDiT(nn.Module):
    """Wraps the diffusers transformer with sd-scripts' Flux call signature.

    ``pretrain_losses`` holds the pretraining loss curve when the weights came from
    :func:`downscale_plugin.lab.pretrain.load_or_pretrain` or :func:`downscale_plugin.lab.base.load_base`.
    """

    def __init__(self, cfg: LabModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=4 * cfg.latent_channels,
            num_layers=cfg.double_layers,
            num_single_layers=cfg.single_layers,
            attention_head_dim=cfg.head_dim,
            num_attention_heads=cfg.num_heads,
            joint_attention_dim=cfg.text_dim,
            pooled_projection_dim=cfg.pooled_dim,
            guidance_embeds=False,
            axes_dims_rope=cfg.axes_dims_rope,
        )
        self.pretrain_losses: list[float] = []

    def forward(
        self,
        img: torch.Tensor,
        img_ids: torch.Tensor,
        txt: torch.Tensor,
        txt_ids: torch.Tensor,
        y: torch.Tensor,
        timesteps: torch.Tensor,
        guidance: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packed velocity [B, N, 4C]. ``timesteps`` is σ ∈ [0, 1] (the host passes t/1000).

        ``guidance`` is accepted and ignored (no guidance embedding, like Flux schnell). Ids may be
        the host's per-sample ``[B, N, 3]``; diffusers wants one ``[N, 3]`` table shared by the batch.
        """
        del guidance
        if img_ids.ndim == 3:
            img_ids = img_ids[0]
        if txt_ids.ndim == 3:
            txt_ids = txt_ids[0]
        return self.transformer(
            hidden_states=img,
            encoder_hidden_states=txt,
            pooled_projections=y,
            timestep=timesteps,
            img_ids=img_ids,
            txt_ids=txt_ids,
            return_dict=False,
        )[0]


def build_model(cfg: LabModelConfig, seed: int) -> LabDiT:
    """A freshly initialised lab DiT; the global RNG is left untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LabDiT(cfg)


class LabTextEncoder:
    """Stand-in for cached text-encoder outputs: a fixed random context per image class.

    ``encode`` returns the host's Flux layout ``[l_pooled, t5_out, txt_ids, t5_attn_mask]``.
    """

    def __init__(self, cfg: LabModelConfig) -> None:
        self.cfg = cfg
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _embed(self, class_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        if class_id not in self._cache:
            gen = torch.Generator().manual_seed(self.cfg.text_seed * 100_003 + class_id)
            pooled = torch.randn(self.cfg.pooled_dim, generator=gen)
            tokens = torch.randn(self.cfg.text_tokens, self.cfg.text_dim, generator=gen)
            self._cache[class_id] = (pooled, tokens)
        return self._cache[class_id]

    def encode(self, class_ids: torch.Tensor, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        pooled, tokens = zip(*(self._embed(int(c)) for c in class_ids), strict=True)
        bsz, t = len(pooled), self.cfg.text_tokens
        return [
            torch.stack(pooled).to(device),
            torch.stack(tokens).to(device),
            torch.zeros(bsz, t, 3, device=device),
            torch.ones(bsz, t, dtype=torch.long, device=device),
        ]
