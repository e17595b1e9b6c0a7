"""σ policies for routed steps: the σ a small-grid step runs at, as a function of the drawn σ.

The router's window gate always reads the drawn σ; a policy only changes the σ the routed step is
replayed at. Every policy here is an SD3-style shift σ' = kσ / (1 + (k − 1)σ), i.e. a constant
offset log k on logit σ: monotone increasing in σ, fixing 0 and 1, and the identity at k = 1.

- ``keep``: k = 1.
- ``res_shift``: SD3's resolution shift (Esser et al. 2024, "resolution-dependent shifting of
  timestep schedules"). For a constant image observed through n noisy tokens,
  z = (1 − σ)c + σε, the uncertainty about c is σ / ((1 − σ)√n). Equal uncertainty at m tokens
  needs σ_m/(1 − σ_m) = √(m/n)·σ_n/(1 − σ_n), so k = √(m/n) with m the small grid's tokens and n
  the native ones: fewer tokens → k < 1 → a *lower* σ (SD3 applies it the other way, to a higher
  σ, going up from 256² to 1024²).
- ``snr_match``: FasterDiT's extended SNR, ((1 − σ)·s/σ)² with s the data std. Equal log-SNR for the
  small latent (std s_small) and the native one (std s_native) needs (1 − σ')s_small/σ' =
  (1 − σ)s_native/σ, so k = s_small/s_native. Area-averaging lowers the std (s_small ≤ s_native),
  so again k ≤ 1. For spatially white latents at an integer ratio s_small/s_native = √(m/n) and the
  two policies agree; for natural (spatially correlated) latents s_small ≈ s_native and
  ``snr_match`` stays near ``keep``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..arch import ArchSpec
from ..config import SIGMA_POLICIES as POLICIES
from ..grid import tokens
from .stats import Moments


def shift_sigma(sigma: torch.Tensor | float, k: float) -> torch.Tensor | float:
    """σ' = kσ / (1 + (k − 1)σ): logit σ' = logit σ + log k."""
    if k <= 0:
        raise ValueError(f"shift factor {k} must be positive")
    return k * sigma / (1.0 + (k - 1.0) * sigma)


def keep(sigma: torch.Tensor | float) -> torch.Tensor | float:
    return sigma


def res_shift(sigma: torch.Tensor | float, native_tokens: int, small_tokens: int) -> torch.Tensor | float:
    """SD3's shift to the small grid's token count: k = √(small_tokens / native_tokens)."""
    return shift_sigma(sigma, math.sqrt(small_tokens / native_tokens))


def snr_match(sigma: torch.Tensor | float, native_std: float, small_std: float) -> torch.Tensor | float:
    """Keep the extended log-SNR: k = small_std / native_std."""
    return shift_sigma(sigma, small_std / native_std)


def policy_factor(
    name: str, native_tokens: int, small_tokens: int, native_std: float | None = None, small_std: float | None = None
) -> float:
    """The shift factor k of a policy for one (native grid, small grid) pair."""
    if name == "keep":
        return 1.0
    if name == "res_shift":
        return math.sqrt(small_tokens / native_tokens)
    if name == "snr_match":
        if native_std is None or small_std is None or native_std <= 0 or small_std <= 0:
            raise ValueError("sigma_policy snr_match needs the measured data stds of the native and the small latents")
        return small_std / native_std
    raise ValueError(f"sigma_policy: {name!r} is not allowed (allowed: {', '.join(POLICIES)})")


def make_policy(
    name: str, native_tokens: int, small_tokens: int, native_std: float | None = None, small_std: float | None = None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """σ → σ' for one routed step (``keep`` returns its input object unchanged)."""
    k = policy_factor(name, native_tokens, small_tokens, native_std, small_std)
    if k == 1.0:
        return keep
    return lambda sigma: shift_sigma(sigma, k)


class RunningStd:
    """Cumulative data std of native latents and of their area-downsampled copies, per grid pair.

    ``snr_match`` inside a training run: the hook has both tensors at every routed step, so the
    stds are measured on the run's own data as it streams (pooled over every element seen so far).
    """

    def __init__(self) -> None:
        self._seen: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[Moments, Moments]] = {}

    def update(self, native: torch.Tensor, small: torch.Tensor) -> tuple[float, float]:
        """Add one batch; return the pooled (native std, small std) for this pair of grids."""
        key = (tuple(native.shape[-2:]), tuple(small.shape[-2:]))
        big, little = self._seen.setdefault(key, (Moments(), Moments()))
        return big.add(native).std, little.add(small).std


class RoutedSigmas:
    """The σ a routed training step runs at under one policy, for a host's step hook: the policy at the step's
    own token counts; ``snr_match`` with the stds of the step's native latents and their small copies,
    pooled over the run's routed steps so far (:class:`RunningStd`, per rank)."""

    def __init__(self, name: str):
        self.name = name
        self.stds = RunningStd() if name == "snr_match" else None

    def __call__(self, sigmas: torch.Tensor, native: torch.Tensor, small: torch.Tensor, arch: ArchSpec) -> torch.Tensor:
        """σ' for a step routed from ``native`` to ``small`` latents; ``sigmas`` itself (the same object) when kept."""
        if self.name == "keep":
            return sigmas
        stds = self.stds.update(native, small) if self.stds is not None else (None, None)
        policy = make_policy(self.name, tokens(tuple(native.shape[-2:]), arch), tokens(tuple(small.shape[-2:]), arch), *stds)
        return policy(sigmas)
