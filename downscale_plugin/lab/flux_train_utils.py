"""The Flux-family σ sampler and prediction-type helpers, reimplemented after sd-scripts'
``library/flux_train_utils.py`` (same signatures, same return contract, same RNG draws in the same
order on the same devices), so the lab trainer exercises the exact host contract the plugin hooks.

The lab trainer looks up :func:`get_noisy_model_input_and_timesteps` as a module attribute at call
time; the plugin replaces that attribute in a scoped way, exactly as it does in the host.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch


def time_shift(mu: float, sigma: float, t: torch.Tensor) -> torch.Tensor:
    """Flux's resolution-dependent shift: e^μ / (e^μ + (1/t − 1)^σ)."""
    e_mu = math.exp(mu)
    return e_mu / (e_mu + (1 / t - 1) ** sigma)


def get_lin_function(x1: float = 256, y1: float = 0.5, x2: float = 4096, y2: float = 1.15) -> Callable[[float], float]:
    """The line through (x1, y1) and (x2, y2); Flux maps packed token count to μ with it."""
    slope = (y2 - y1) / (x2 - x1)
    intercept = y1 - slope * x1
    return lambda x: slope * x + intercept


def get_sigmas(noise_scheduler, timesteps: torch.Tensor, device, n_dim: int = 4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """σ of the scheduler grid at the given (grid) timesteps, flattened, as the host returns it."""
    sigmas = noise_scheduler.sigmas.to(device=device, dtype=dtype)
    grid = noise_scheduler.timesteps.to(device)
    timesteps = timesteps.to(device)
    match = grid.unsqueeze(0) == timesteps.unsqueeze(1)
    if not bool(match.any(dim=1).all()):
        raise ValueError("timesteps are not on the scheduler grid")
    return sigmas[match.int().argmax(dim=1)].flatten()


def compute_density_for_timestep_sampling(
    weighting_scheme: str,
    batch_size: int,
    logit_mean: float | None = None,
    logit_std: float | None = None,
    mode_scale: float | None = None,
) -> torch.Tensor:
    """u ∈ (0, 1) for the scheduler-grid mode (SD3 paper §3.1); drawn on the CPU like the host."""
    if weighting_scheme == "logit_normal":
        return torch.sigmoid(torch.normal(mean=logit_mean, std=logit_std, size=(batch_size,), device="cpu"))
    u = torch.rand(size=(batch_size,), device="cpu")
    if weighting_scheme == "mode":
        u = 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def compute_loss_weighting_for_sd3(weighting_scheme: str, sigmas: torch.Tensor | None = None) -> torch.Tensor:
    """Post-hoc loss weight per σ (SD3): σ⁻² for ``sigma_sqrt``, 2/(π(1−2σ+2σ²)) for ``cosmap``."""
    if weighting_scheme == "sigma_sqrt":
        return (sigmas**-2.0).float()
    if weighting_scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2))
    return torch.ones_like(sigmas)


def _draw_sigmas(args: argparse.Namespace, noise_scheduler, bsz: int, h: int, w: int, device, dtype):
    """(σ [B], timesteps [B]) for every host mode; the draws match the host's one for one."""
    num_timesteps = noise_scheduler.config.num_train_timesteps
    mode = args.timestep_sampling
    if mode == "uniform":
        sigmas = torch.rand((bsz,), device=device)
    elif mode == "sigmoid":
        sigmas = torch.sigmoid(args.sigmoid_scale * torch.randn((bsz,), device=device))
    elif mode in ("shift", "flux_shift"):
        sigmas = (torch.randn(bsz, device=device) * args.sigmoid_scale).sigmoid()
        if mode == "shift":
            shift = args.discrete_flow_shift
            sigmas = (sigmas * shift) / (1 + (shift - 1) * sigmas)
        else:  # μ from the packed token count of the (pre-packing) latent
            mu = get_lin_function(y1=0.5, y2=1.15)((h // 2) * (w // 2))
            sigmas = time_shift(mu, 1.0, sigmas)
    else:  # "sigma": the scheduler grid, indexed by a weighting-scheme density
        u = compute_density_for_timestep_sampling(
            weighting_scheme=args.weighting_scheme,
            batch_size=bsz,
            logit_mean=args.logit_mean,
            logit_std=args.logit_std,
            mode_scale=args.mode_scale,
        )
        timesteps = noise_scheduler.timesteps[(u * num_timesteps).long()].to(device=device)
        return get_sigmas(noise_scheduler, timesteps, device, dtype=dtype), timesteps
    return sigmas, sigmas * num_timesteps


def get_noisy_model_input_and_timesteps(
    args: argparse.Namespace, noise_scheduler, latents: torch.Tensor, noise: torch.Tensor, device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw σ per sample and build x_σ = (1−σ)·x + σ·(noise [+ γ·ξ]).

    Returns ``(noisy_model_input.to(dtype), timesteps.to(dtype), sigmas)`` with σ broadcast to the
    latent's rank (``[B,1,1,1]`` or ``[B,1,1,1,1]``), like the host.
    """
    bsz, h, w = latents.shape[0], latents.shape[-2], latents.shape[-1]
    if bsz <= 0:
        raise ValueError("Batch size not large enough")
    sigmas, timesteps = _draw_sigmas(args, noise_scheduler, bsz, h, w, device, dtype)
    sigmas = sigmas.view(-1, 1, 1, 1) if latents.ndim == 4 else sigmas.view(-1, 1, 1, 1, 1)

    if args.ip_noise_gamma:
        xi = torch.randn_like(latents, device=latents.device, dtype=dtype)
        gamma = args.ip_noise_gamma
        if args.ip_noise_gamma_random_strength:
            gamma = torch.rand(1, device=latents.device, dtype=dtype) * gamma
        noise = noise + gamma * xi
    noisy_model_input = (1.0 - sigmas) * latents + sigmas * noise
    return noisy_model_input.to(dtype), timesteps.to(dtype), sigmas


def apply_model_prediction_type(
    args: argparse.Namespace, model_pred: torch.Tensor, noisy_model_input: torch.Tensor, sigmas: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Map the raw output to the velocity the loss compares; ``sigma_scaled`` also weights the loss."""
    weighting = None
    if args.model_prediction_type == "additive":
        model_pred = model_pred + noisy_model_input
    elif args.model_prediction_type == "sigma_scaled":
        model_pred = model_pred * (-sigmas) + noisy_model_input
        weighting = compute_loss_weighting_for_sd3(weighting_scheme=args.weighting_scheme, sigmas=sigmas)
    return model_pred, weighting
