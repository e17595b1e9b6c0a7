"""The FLOP model behind every predicted saving (``plan``, the start banner, ``ss_downscale_counts``).

Savings are ratios of per-sample costs, so only the relative cost of a smaller grid matters; the
per-architecture shapes live with their :class:`~downscale_plugin.arch.ArchSpec` record.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class FlopModel:
    """Forward cost of one sample: a·N + b·N² in N = image + text tokens.

    a = 2·depth·hidden²·(4 + 2·mlp_ratio): q, k, v, o projections and the MLP, 2 flops per MAC;
    b = 4·depth·hidden: QKᵀ and AV. Norms, modulation and embedders are per-sample or O(N·hidden)
    and left out. Backward scales both terms alike, so savings (ratios) hold for the whole step.
    ``attention=False`` keeps only the linear term: the UNet presets, which count latent pixels.
    """

    hidden: int
    depth: int
    mlp_ratio: float = 4.0
    text_tokens: int = 0
    attention: bool = True

    @property
    def a(self) -> float:
        return 2.0 * self.depth * self.hidden**2 * (4.0 + 2.0 * self.mlp_ratio)

    @property
    def b(self) -> float:
        return 4.0 * self.depth * self.hidden if self.attention else 0.0

    def flops(self, n_image_tokens: float) -> float:
        n = n_image_tokens + self.text_tokens
        return self.a * n + self.b * n * n


def predicted_saving(hist: Mapping[int, float], native: Mapping[int, float], flop_model: FlopModel | None = None) -> float:
    """1 − Σ hist·F(N_run) / Σ native·F(N_native) over token histograms (tokens → samples or weight).

    Without a model F(N) = N: the token saving.
    """
    cost = flop_model.flops if flop_model is not None else float
    spent = sum(w * cost(n) for n, w in hist.items())
    full = sum(w * cost(n) for n, w in native.items())
    return 1.0 - spent / full if full > 0 else 0.0
