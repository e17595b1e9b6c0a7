"""The σ axis: host-like σ samplers with their closed-form CDFs, and DDPM t ↔ flow σ.

These mirror sd-scripts' Flux-family ``--timestep_sampling`` modes (``uniform``, ``sigmoid``,
``shift``, ``flux_shift``) and its scheduler-grid mode (``sigma`` and the other density modes)
so that ``plan`` can predict route frequencies, the statistical tests have a reference, and the
lab trainer draws σ exactly like the host. In a real run the router always calls the host's own
sampler; nothing here replaces it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CLOSED_FORM_MODES = ("uniform", "sigmoid", "shift", "flux_shift")
DENSITY_SCHEMES = ("logit_normal", "mode", "uniform", "sigma_sqrt", "cosmap", "none")


def flux_mu(latent_hw: tuple[int, int]) -> float:
    """sd-scripts' ``flux_shift`` μ: linear in the packed token count, 0.5 at 256 to 1.15 at 4096."""
    h, w = latent_hw
    slope = (1.15 - 0.5) / (4096 - 256)
    return slope * ((h // 2) * (w // 2)) + 0.5 - slope * 256


def _logit(x: float) -> float:
    return math.log(x) - math.log1p(-x)


def _normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


@dataclass(frozen=True)
class SigmaSampler:
    """A host σ sampler for one native latent grid.

    ``mode`` is sd-scripts' ``--timestep_sampling``; any mode not in ``CLOSED_FORM_MODES`` is the
    host's scheduler-grid path (``u`` from ``weighting_scheme``'s density, σ read off a
    ``FlowMatchEulerDiscreteScheduler`` grid shifted by ``discrete_flow_shift``).
    """

    mode: str = "sigmoid"
    sigmoid_scale: float = 1.0
    discrete_flow_shift: float = 3.0
    weighting_scheme: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    num_train_timesteps: int = 1000

    @property
    def has_closed_form(self) -> bool:
        return self.mode in CLOSED_FORM_MODES

    def sample(self, n: int, latent_hw: tuple[int, int], generator: torch.Generator | None = None) -> torch.Tensor:
        """Draw n σ (float32, CPU) with the host's formulas."""
        if self.mode == "uniform":
            return torch.rand(n, generator=generator)
        if self.mode in ("sigmoid", "shift", "flux_shift"):
            s = torch.sigmoid(self.sigmoid_scale * torch.randn(n, generator=generator))
            if self.mode == "shift":
                k = self.discrete_flow_shift
                s = (s * k) / (1 + (k - 1) * s)
            elif self.mode == "flux_shift":
                mu = math.exp(flux_mu(latent_hw))
                s = mu / (mu + (1 / s - 1))
            return s
        u = self._density(n, generator)
        idx = (u * self.num_train_timesteps).long().clamp_(max=self.num_train_timesteps - 1)
        return self.scheduler_sigmas()[idx]

    def _density(self, n: int, generator: torch.Generator | None) -> torch.Tensor:
        if self.weighting_scheme == "logit_normal":
            return torch.sigmoid(torch.normal(self.logit_mean, self.logit_std, size=(n,), generator=generator))
        u = torch.rand(n, generator=generator)
        if self.weighting_scheme == "mode":
            u = 1 - u - self.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
        return u

    def scheduler_sigmas(self) -> torch.Tensor:
        """The σ grid of diffusers' FlowMatchEulerDiscreteScheduler(shift) indexed like the host."""
        n = self.num_train_timesteps
        t = torch.linspace(1, n, n, dtype=torch.float32).flip(0)
        s = t / n
        k = self.discrete_flow_shift
        return k * s / (1 + (k - 1) * s)

    def cdf(self, x: float, latent_hw: tuple[int, int]) -> float:
        """P(σ <= x) in closed form (``uniform``, ``sigmoid``, ``shift``, ``flux_shift``)."""
        if not self.has_closed_form:
            raise ValueError(f"timestep_sampling={self.mode!r} has no closed form; use Monte Carlo")
        if x <= 0.0:
            return 0.0
        if x >= 1.0:
            return 1.0
        if self.mode == "uniform":
            return x
        if self.mode == "shift":
            k = self.discrete_flow_shift
            x = x / (k - (k - 1) * x)
        elif self.mode == "flux_shift":
            x = 1.0 / (1.0 + math.exp(flux_mu(latent_hw)) * (1.0 / x - 1.0))
        return _normal_cdf(_logit(x) / self.sigmoid_scale)

    def mass(self, lo: float, hi: float | None, latent_hw: tuple[int, int]) -> float:
        """P(lo < σ < hi) (``hi=None``: P(σ > lo)); the CDFs are continuous so strictness is free."""
        top = 1.0 if hi is None else self.cdf(hi, latent_hw)
        return max(0.0, top - self.cdf(lo, latent_hw))


def ddpm_alphas_cumprod(num_train_timesteps: int = 1000, beta_start: float = 0.00085, beta_end: float = 0.012) -> torch.Tensor:
    """ᾱ_t of the ``scaled_linear`` DDPM schedule SD1.x/SDXL train with."""
    betas = torch.linspace(beta_start**0.5, beta_end**0.5, num_train_timesteps, dtype=torch.float64) ** 2
    return torch.cumprod(1.0 - betas, dim=0)


def ddpm_t_to_sigma(t: torch.Tensor, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """Flow-equivalent σ of a DDPM timestep by equal SNR: σ = √(1−ᾱ) / (√ᾱ + √(1−ᾱ))."""
    a = alphas_cumprod.to(torch.float64)[t.long().cpu()]
    s = torch.sqrt(1.0 - a)
    return (s / (torch.sqrt(a) + s)).to(torch.float32)


def sigma_to_ddpm_t(sigma: torch.Tensor, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`ddpm_t_to_sigma`: the timestep whose flow σ is nearest (exact on the grid)."""
    grid = ddpm_t_to_sigma(torch.arange(len(alphas_cumprod)), alphas_cumprod)
    sigma = sigma.to(torch.float32).cpu()
    right = torch.searchsorted(grid, sigma).clamp(1, len(grid) - 1)
    left = right - 1
    pick_left = (sigma - grid[left]).abs() <= (grid[right] - sigma).abs()
    return torch.where(pick_left, left, right)
