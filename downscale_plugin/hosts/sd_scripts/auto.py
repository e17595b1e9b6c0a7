"""``mode = "auto"`` on sd-scripts: the kohya session (``hosts/kohya/auto.py``: timeline, budget,
refusals at start, the certify-and-write, the switch to the certified windows) with sd-scripts'
probes (``map.SdScriptsProbes``) and its σ sampler as ``plan`` draws it (``trainer.plan_sampler``).

What the windows cache keys of an sd-scripts run (``mapping/reuse.py``), as sd-scripts 48d368fa's parsers name it:
the files of the text encoders and the VAE each trainer loads (:data:`ENCODER_ARGS`; absent ones come from the model
file), the args that change the gradient a step takes (:data:`LOSS_ARGS`; the σ law's own are the key's sampler), and
the source of the functions the plugin calls or draws through (:data:`HOST_FUNCTIONS`, the trainer's methods in
:data:`TRAINER_METHODS`, the σ family's sampler)."""

from __future__ import annotations

import sys
from typing import Any

from ..kohya.auto import AutoSession
from .map import SdScriptsProbes
from .trainer import plan_sampler

# Per arch, the args naming the text encoders' and VAE's files the trainer loads (flux_train_utils, sd3_train_utils,
# lumina_train_util, anima_train_utils, hunyuan_image_train_network, train_util's --vae); Chroma loads no CLIP-L.
ENCODER_ARGS = {
    "flux": ("clip_l", "t5xxl", "ae"),
    "chroma": ("t5xxl", "ae"),
    "sd3": ("clip_l", "clip_g", "t5xxl", "vae"),
    "lumina": ("gemma2", "ae"),
    "anima": ("qwen3", "llm_adapter_path", "vae"),
    "hunyuan_image": ("text_encoder", "byt5", "vae"),
    "sdxl": ("vae",),
    "sd1": ("vae",),
}
# The args that change a step's gradient: the loss and its weighting (train_util, custom_train_functions), the noise
# (offset, multires, ip noise), the prediction and guidance (flux/lumina/hunyuan_image), the text conditioning
# (token lengths, masks, dropouts, clip_skip, Lumina's system prompt).
LOSS_ARGS = (
    "loss_type", "huber_c", "huber_schedule", "huber_scale", "min_snr_gamma", "scale_v_pred_loss_like_noise_pred",
    "v_pred_like_loss", "debiased_estimation_loss", "v_parameterization", "zero_terminal_snr", "noise_offset",
    "noise_offset_random_strength", "adaptive_noise_scale", "multires_noise_iterations", "multires_noise_discount",
    "ip_noise_gamma", "ip_noise_gamma_random_strength", "masked_loss", "prior_loss_weight", "weighting_scheme",
    "logit_mean", "logit_std", "mode_scale", "guidance_scale", "model_prediction_type", "clip_skip", "max_token_length",
    "weighted_captions", "t5xxl_max_token_length", "apply_t5_attn_mask", "apply_lg_attn_mask", "clip_l_dropout_rate",
    "clip_g_dropout_rate", "t5_dropout_rate", "pos_emb_random_crop_rate", "enable_scaled_pos_embed",
    "gemma2_max_token_length", "system_prompt", "qwen3_max_token_length", "t5_max_token_length",
)  # fmt: skip
# Module functions a step or the σ draw goes through (those of the modules the run has loaded; docs/ARCHITECTURE.md §3).
HOST_FUNCTIONS = {
    "library.train_util": ("conditional_loss", "get_huber_threshold_if_needed", "get_noise_noisy_latents_and_timesteps", "get_timesteps"),
    "library.custom_train_functions": (
        "apply_snr_weight", "scale_v_prediction_loss_like_noise_prediction", "add_v_prediction_like_loss",
        "apply_debiased_estimation", "apply_masked_loss", "apply_noise_offset", "pyramid_noise_like",
    ),
    "library.flux_train_utils": ("get_noisy_model_input_and_timesteps", "apply_model_prediction_type", "get_sigmas"),
    "library.sd3_train_utils": ("get_noisy_model_input_and_timesteps", "compute_loss_weighting_for_sd3", "get_sigmas"),
    "library.lumina_train_util": ("get_noisy_model_input_and_timesteps", "apply_model_prediction_type"),
    "library.sdxl_train_util": ("get_size_embeddings",),
}  # fmt: skip
TRAINER_METHODS = ("process_batch", "get_noise_pred_and_target", "call_unet", "shift_scale_latents", "get_noise_scheduler")


class SdScriptsAutoSession(SdScriptsProbes, AutoSession):
    """One sd-scripts ``auto`` run."""

    host = "sd-scripts"
    code_modules = (
        *AutoSession.code_modules,
        "downscale_plugin.hosts.sd_scripts.map",  # the probes and their step
        "downscale_plugin.hosts.sd_scripts.hook",  # the forced step a draw takes
        "downscale_plugin.hosts.sd_scripts.families",  # the σ a draw is replayed at
    )
    loss_args = LOSS_ARGS
    no_encoders = "none given (the model file's own)"

    def host_sampler(self) -> Any:
        """The host's σ sampler as ``plan`` draws it (``sample(n, latent_hw, generator)``)."""
        return plan_sampler(self.ctx, self.family)

    def encoder_files(self) -> list[tuple[str, str]]:
        args = self.ctx.args
        return [(name, str(getattr(args, name))) for name in ENCODER_ARGS.get(self.run.arch, ()) if getattr(args, name, None)]

    def host_functions(self) -> list[Any]:
        trainer = type(self.ctx.trainer)
        found = [getattr(self.family.module, self.family.fn_name)]
        found += [getattr(trainer, name) for name in TRAINER_METHODS if hasattr(trainer, name)]
        for module_name, names in HOST_FUNCTIONS.items():
            module = sys.modules.get(module_name)
            found += [getattr(module, name) for name in names if module is not None and hasattr(module, name)]
        return found
