"""Double of ``library.sd3_train_utils``: SD3's σ sampler (no noise_scheduler argument) and the
flow scheduler every flow trainer builds."""

from types import SimpleNamespace

import torch

from downscale_plugin.lab.flux_train_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3
from downscale_plugin.sigma import SigmaSampler

__all__ = [
    "FlowMatchEulerDiscreteScheduler",
    "compute_density_for_timestep_sampling",
    "compute_loss_weighting_for_sd3",
    "get_noisy_model_input_and_timesteps",
]


class FlowMatchEulerDiscreteScheduler:
    """The training-time surface of diffusers' scheduler: ``config``, ``timesteps``, ``sigmas``."""

    def __init__(self, num_train_timesteps: int = 1000, shift: float = 1.0):
        self.config = SimpleNamespace(num_train_timesteps=num_train_timesteps, shift=shift)
        grid = SigmaSampler(discrete_flow_shift=shift, num_train_timesteps=num_train_timesteps).scheduler_sigmas()
        self.timesteps = grid * num_train_timesteps
        self.sigmas = torch.cat([grid, grid.new_zeros(1)])


def get_noisy_model_input_and_timesteps(args, latents, noise, device, dtype):
    """u from the weighting density (CPU RNG), SD3 shift, integer t in [t_min, t_max), σ = t/1000."""
    u = compute_density_for_timestep_sampling(
        weighting_scheme=args.weighting_scheme,
        batch_size=latents.shape[0],
        logit_mean=args.logit_mean,
        logit_std=args.logit_std,
        mode_scale=args.mode_scale,
    )
    t_min = args.min_timestep if args.min_timestep is not None else 0
    t_max = args.max_timestep if args.max_timestep is not None else 1000
    shift = args.training_shift
    u = (u * shift) / (1 + (shift - 1) * u)
    timesteps = (u * (t_max - t_min) + t_min).long().to(device=device, dtype=dtype)
    sigmas = (timesteps / 1000).view(-1, 1, 1, 1)
    return sigmas * noise + (1.0 - sigmas) * latents, timesteps, sigmas
