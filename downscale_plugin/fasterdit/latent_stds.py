"""Measured data stds: native latents and, per route, their area-downsampled copies.

The small latent's std is what sets its extended SNR (``snr``) and the ``snr_match`` shift, and it
depends on the data's spatial correlation, so it is measured by running the router's own grid rule
and ``grid.area_downsample`` on real latents, from whatever source a host registers with ``snr``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..arch import ArchSpec
from ..config import RouteRule
from ..grid import area_downsample, eligibility
from .stats import Moments


@dataclass
class RouteStds:
    """One rule's eligible latents at native size and at the rule's grid for each."""

    index: int
    rule: RouteRule
    native: Moments = field(default_factory=Moments)
    small: Moments = field(default_factory=Moments)
    grids: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)  # native (h, w) -> small (h, w)
    counts: Counter = field(default_factory=Counter)  # native (h, w) -> latents

    @property
    def ratio(self) -> float:
        """s_small / s_native: the ``snr_match`` shift factor."""
        return self.small.std / self.native.std

    @property
    def log_snr_offset(self) -> float:
        """2·log(s_small/s_native): the small latent's log-SNR minus the native one's, at every σ."""
        return 2.0 * math.log(self.ratio)

    @property
    def effective_shift(self) -> float:
        """k = s_native/s_small: a small step at σ has the log-SNR of a native step at shift(σ, k)."""
        return 1.0 / self.ratio


@dataclass
class LatentStds:
    native: Moments
    buckets: Counter  # latent (h, w) -> count
    routes: list[RouteStds]


def measure_stds(
    latents: Iterable[torch.Tensor], rules: Sequence[RouteRule], arch: ArchSpec, tier_tolerance: float, scale: float = 1.0
) -> LatentStds:
    """Pool stds over ``latents`` (scaled by ``scale``), and per rule over the latents it can route."""
    out = LatentStds(Moments(), Counter(), [RouteStds(i, r) for i, r in enumerate(rules)])
    for latent in latents:
        latent = latent.float() * scale
        hw = tuple(latent.shape[-2:])
        out.native.add(latent)
        out.buckets[hw] += 1
        for route in out.routes:
            cell = eligibility(hw, route.index, route.rule, arch, tier_tolerance)
            if cell.eligible:
                route.native.add(latent)
                route.small.add(area_downsample(latent, cell.target_hw))
                route.grids[hw] = cell.target_hw
                route.counts[hw] += 1
    if out.native.n == 0:
        raise ValueError("no latents to measure")
    return out
