"""The grid rule: which smaller latent grid a route gives a bucket, and area downsampling to it.

A route's target is the bucket's latent size times the route's linear ratio, each axis rounded to
the architecture's latent multiple (Flux/Chroma/SD3/Lumina/Anima 2, HunyuanImage 1, SDXL 4, SD1 1),
so the aspect ratio is kept to the nearest multiple. A bucket whose target is not strictly smaller
(or would vanish) is ineligible for that route and always trains native.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .arch import ArchSpec
from .config import RouteRule


def tokens(latent_hw: tuple[int, int], arch: ArchSpec) -> int:
    """Image tokens a DiT runs for this latent grid (latent pixels for the UNets, patch 1)."""
    return (latent_hw[0] // arch.patch) * (latent_hw[1] // arch.patch)


def rule_ratio(rule: RouteRule, latent_hw: tuple[int, int], arch: ArchSpec, tier_tolerance: float) -> float | None:
    """The linear ratio a rule applies to this bucket, or None when the bucket is not in its tier.

    A bucket belongs to tier E when √(W·H) in image pixels is within ``tier_tolerance`` of E.
    """
    if rule.scale is not None:
        return rule.scale
    edge = math.sqrt(latent_hw[0] * latent_hw[1]) * arch.vae_factor
    if abs(edge / rule.native - 1.0) > tier_tolerance:
        return None
    return rule.target / rule.native


def target_grid(latent_hw: tuple[int, int], ratio: float, arch: ArchSpec) -> tuple[int, int] | None:
    """Target latent (h, w) for a linear ratio, or None if no valid strictly smaller grid exists."""
    m = arch.multiple
    h, w = latent_hw
    th = int(round(h * ratio / m)) * m
    tw = int(round(w * ratio / m)) * m
    if th < m or tw < m or th > h or tw > w or th * tw >= h * w:
        return None
    return th, tw


def area_weights(n_in: int, n_out: int, device: torch.device | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(n_out, n_in) exact box-filter weights: output cell i averages the input span [i·s, (i + 1)·s), s = n_in / n_out.

    Each input cell weighs by the length of its overlap with that span, so at a fractional ratio an
    output averages 1/ratio input cells, not the whole cells the span touches (torch's ``area`` mode,
    i.e. adaptive average pooling, averages 2 cells per output at ratios 0.75 and 0.875 alike and so
    removes as much detail as ratio 0.5). Rows sum to 1; every input cell weighs n_out/n_in in total,
    so the mean is kept at any ratio. At an integer ratio this is plain s×s average pooling.
    """
    s = n_in / n_out
    i = torch.arange(n_out, dtype=torch.float64, device=device)[:, None]
    j = torch.arange(n_in, dtype=torch.float64, device=device)[None, :]
    overlap = (torch.minimum((i + 1) * s, j + 1) - torch.maximum(i * s, j)).clamp(min=0)
    return (overlap / s).to(dtype)


def area_downsample(latents: torch.Tensor, target_hw: tuple[int, int]) -> torch.Tensor:
    """Exact area-average (box filter, :func:`area_weights`) of the last two dims to ``target_hw``.

    Computed in float64 (TF32 matmul settings cannot touch it; float32 on MPS, which has no float64)
    and cast back to the latents' dtype; 4D or 5D latents (5D: per frame).
    """
    h, w = latents.shape[-2:]
    compute = torch.float32 if latents.device.type == "mps" else torch.float64
    rows = area_weights(h, target_hw[0], latents.device, compute)
    cols = area_weights(w, target_hw[1], latents.device, compute)
    small = rows @ latents.to(compute) @ cols.T
    return small.to(latents.dtype)


@dataclass(frozen=True)
class Eligibility:
    """One (bucket, rule) cell of the startup table."""

    latent_hw: tuple[int, int]
    rule_index: int
    target_hw: tuple[int, int] | None
    reason: str  # "" when eligible

    @property
    def eligible(self) -> bool:
        return self.target_hw is not None


def eligibility(latent_hw: tuple[int, int], rule_index: int, rule: RouteRule, arch: ArchSpec, tier_tolerance: float) -> Eligibility:
    ratio = rule_ratio(rule, latent_hw, arch, tier_tolerance)
    if ratio is None:
        return Eligibility(latent_hw, rule_index, None, f"not in the {rule.native} px tier")
    target = target_grid(latent_hw, ratio, arch)
    if target is None:
        return Eligibility(latent_hw, rule_index, None, f"no strictly smaller grid that is a multiple of {arch.multiple}")
    return Eligibility(latent_hw, rule_index, target, "")


def eligibility_table(
    buckets: list[tuple[int, int]], rules: tuple[RouteRule, ...], arch: ArchSpec, tier_tolerance: float
) -> list[list[Eligibility]]:
    """Per bucket (latent h, w), one :class:`Eligibility` per rule, for the start banner and ``plan``."""
    return [[eligibility(b, i, r, arch, tier_tolerance) for i, r in enumerate(rules)] for b in buckets]
