"""Double of ``library.flux_train_utils``: the σ sampler FLUX.1/Chroma, Anima and HunyuanImage share.

The lab module already follows the host's contract draw for draw; the double re-exports it so the
trainers below reach it as ``flux_train_utils.get_noisy_model_input_and_timesteps``, a module
attribute looked up at call time, as in the host.
"""

from downscale_plugin.lab.flux_train_utils import (
    apply_model_prediction_type,
    compute_density_for_timestep_sampling,
    compute_loss_weighting_for_sd3,
    get_lin_function,
    get_noisy_model_input_and_timesteps,
    get_sigmas,
    time_shift,
)

__all__ = [
    "apply_model_prediction_type",
    "compute_density_for_timestep_sampling",
    "compute_loss_weighting_for_sd3",
    "get_lin_function",
    "get_noisy_model_input_and_timesteps",
    "get_sigmas",
    "time_shift",
]
