"""FasterDiT's extended SNR and its probability density under a host σ sampler.

FasterDiT (Yao et al. 2024, arXiv:2410.10356) extends the SNR with the data std s: for flow matching
x_σ = (1 − σ)x + σε with std(x) = s, SNR = ((1 − σ)s/σ)², so

    λ(σ) = log SNR = 2·log s − 2·logit σ,        σ(λ) = sigmoid(log s − λ/2).

The same sampler therefore trains two latents with different stds at log-SNRs offset by
2·log(s_a/s_b): an area-downsampled latent (lower std) sees every σ at a lower SNR than the native
one. Its *effective shift* is k = s_native/s_small: a small step at σ has the log-SNR of a native
step at shift(σ, k) = kσ/(1 + (k − 1)σ).

Density. The four closed-form host modes all make logit σ a location family:
logit σ = m + Z with Z ~ Logistic(0, 1) (``uniform``) or N(0, sigmoid_scale²) (``sigmoid``,
``shift`` with m = log discrete_flow_shift, ``flux_shift`` with m = μ(h, w)), so λ = 2 log s − 2m − 2Z
and p(λ) = ½·p_Z((2 log s − 2m − λ)/2). The CDF is read from the sampler's own closed form,
P(Λ ≤ λ) = 1 − F_σ(σ(λ)). Other modes (the scheduler grid) have a discrete σ: use a histogram of
sampled values.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..sigma import SigmaSampler, flux_mu


def log_snr(sigma: torch.Tensor, data_std: float) -> torch.Tensor:
    """Extended log-SNR 2·log((1 − σ)·s/σ) (−∞ at σ = 1, +∞ at σ = 0)."""
    sigma = sigma.double()
    return 2.0 * (torch.log1p(-sigma) - torch.log(sigma) + math.log(data_std))


def sigma_at(lam: np.ndarray, data_std: float) -> np.ndarray:
    """Inverse of :func:`log_snr`: σ = sigmoid(log s − λ/2)."""
    return 1.0 / (1.0 + np.exp(np.asarray(lam, dtype=np.float64) / 2.0 - math.log(data_std)))


def _logit_location(sampler: SigmaSampler, latent_hw: tuple[int, int]) -> float:
    if sampler.mode == "shift":
        return math.log(sampler.discrete_flow_shift)
    if sampler.mode == "flux_shift":
        return flux_mu(latent_hw)
    return 0.0


def log_snr_pdf(lam: np.ndarray, sampler: SigmaSampler, latent_hw: tuple[int, int], data_std: float) -> np.ndarray:
    """Closed-form density of λ for the four closed-form modes (see the module docstring)."""
    if not sampler.has_closed_form:
        raise ValueError(f"timestep_sampling={sampler.mode!r} has no closed form; use log_snr_histogram")
    z = (2.0 * math.log(data_std) - 2.0 * _logit_location(sampler, latent_hw) - np.asarray(lam, dtype=np.float64)) / 2.0
    if sampler.mode == "uniform":
        e = np.exp(-np.abs(z))  # the logistic density is symmetric; |z| keeps exp from overflowing
        density = e / (1.0 + e) ** 2
    else:
        s = sampler.sigmoid_scale
        density = np.exp(-0.5 * (z / s) ** 2) / (s * math.sqrt(2.0 * math.pi))
    return 0.5 * density


def log_snr_cdf(lam: float, sampler: SigmaSampler, latent_hw: tuple[int, int], data_std: float) -> float:
    """P(Λ ≤ λ) = P(σ ≥ σ(λ)), from the sampler's closed-form CDF."""
    return 1.0 - sampler.cdf(float(sigma_at(lam, data_std)), latent_hw)


def log_snr_histogram(lam: np.ndarray, edges: np.ndarray, total: int | None = None) -> np.ndarray:
    """Density histogram of λ samples on ``edges``, normalised by ``total`` draws (default: len(λ)).

    Passing the number of draws including non-finite or out-of-range ones keeps the histogram a
    sub-density whose missing mass is exactly theirs.
    """
    counts, _ = np.histogram(lam, bins=edges)
    n = len(lam) if total is None else total
    return counts / (n * np.diff(edges))
