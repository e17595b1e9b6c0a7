"""Double of ``library.lumina_train_util``: Lumina's σ sampler (adds ``nextdit_shift``; σ always
viewed 4D) and its prediction-type helper."""

import torch

from downscale_plugin.lab.flux_train_utils import (
    compute_density_for_timestep_sampling,
    compute_loss_weighting_for_sd3,
    get_lin_function,
    get_sigmas,
    time_shift,
)


def _draw(args, noise_scheduler, bsz, h, w, device, dtype, ndim):
    num_timesteps = noise_scheduler.config.num_train_timesteps
    mode = args.timestep_sampling
    if mode == "uniform":
        sigmas = torch.rand((bsz,), device=device)
    elif mode == "sigmoid":
        sigmas = torch.sigmoid(args.sigmoid_scale * torch.randn((bsz,), device=device))
    elif mode == "shift":
        sigmas = (torch.randn(bsz, device=device) * args.sigmoid_scale).sigmoid()
        sigmas = (sigmas * args.discrete_flow_shift) / (1 + (args.discrete_flow_shift - 1) * sigmas)
    elif mode == "nextdit_shift":
        sigmas = torch.clamp(torch.rand((bsz,), device=device), min=1e-7)
        sigmas = time_shift(get_lin_function(y1=0.5, y2=1.15)((h // 2) * (w // 2)), 1.0, sigmas)
    elif mode == "flux_shift":
        sigmas = torch.clamp((torch.randn(bsz, device=device) * args.sigmoid_scale).sigmoid(), min=1e-7)
        sigmas = time_shift(get_lin_function(y1=0.5, y2=1.15)((h // 2) * (w // 2)), 1.0, sigmas)
    else:
        u = compute_density_for_timestep_sampling(
            weighting_scheme=args.weighting_scheme,
            batch_size=bsz,
            logit_mean=args.logit_mean,
            logit_std=args.logit_std,
            mode_scale=args.mode_scale,
        )
        timesteps = noise_scheduler.timesteps[(u * num_timesteps).long()].to(device=device)
        return get_sigmas(noise_scheduler, timesteps, device, n_dim=ndim, dtype=dtype), timesteps
    return sigmas, sigmas * num_timesteps


def get_noisy_model_input_and_timesteps(args, noise_scheduler, latents, noise, device, dtype):
    bsz, _, h, w = latents.shape
    assert bsz > 0, "Batch size not large enough"
    sigmas, timesteps = _draw(args, noise_scheduler, bsz, h, w, device, dtype, latents.ndim)
    sigmas = sigmas.view(-1, 1, 1, 1)
    if args.ip_noise_gamma:
        xi = torch.randn_like(latents, device=latents.device, dtype=dtype)
        gamma = args.ip_noise_gamma
        if args.ip_noise_gamma_random_strength:
            gamma = torch.rand(1, device=latents.device, dtype=dtype) * args.ip_noise_gamma
        noise = noise + gamma * xi
    noisy_model_input = (1.0 - sigmas) * latents + sigmas * noise
    return noisy_model_input.to(dtype), timesteps.to(dtype), sigmas


def apply_model_prediction_type(args, model_pred, noisy_model_input, sigmas):
    weighting = None
    if args.model_prediction_type == "additive":
        model_pred = model_pred + noisy_model_input
    elif args.model_prediction_type == "sigma_scaled":
        model_pred = model_pred * (-sigmas) + noisy_model_input
        weighting = compute_loss_weighting_for_sd3(weighting_scheme=args.weighting_scheme, sigmas=sigmas)
    return model_pred, weighting
