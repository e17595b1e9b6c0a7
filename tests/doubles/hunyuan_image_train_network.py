"""Double of ``hunyuan_image_train_network.py``: noise, the shared Flux-family sampler with its
timesteps discarded and recomputed as int64(σ·1000), DiT call, prediction type, target = noise − latents."""

import torch
import train_network
from library import flux_train_utils, sd3_train_utils, tiny_models


class HunyuanImageNetworkTrainer(train_network.NetworkTrainer):
    denoiser = tiny_models.HYImageDiffusionTransformer
    vae_factor = 32

    def text_conds(self, bsz, gen):
        return [
            torch.randn(bsz, 6, 8, generator=gen),
            torch.ones(bsz, 6),
            torch.randn(bsz, 4, 8, generator=gen),
            torch.ones(bsz, 4),
            None,  # ocr_mask, inference only
        ]

    def get_noise_scheduler(self, args, device):
        return sd3_train_utils.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=args.discrete_flow_shift)

    def shift_scale_latents(self, args, latents):
        return latents * 0.75289

    def get_noise_pred_and_target(
        self, args, accelerator, noise_scheduler, latents, batch, text_encoder_conds, unet, network, weight_dtype, train_unet, is_train=True
    ):
        noise = torch.randn_like(latents)
        noisy_model_input, _, sigmas = flux_train_utils.get_noisy_model_input_and_timesteps(
            args, noise_scheduler, latents, noise, accelerator.device, weight_dtype
        )
        timesteps = (sigmas[:, 0, 0, 0] * 1000).to(torch.int64)
        vlm_embed, vlm_mask, byt5_embed, byt5_mask, _ = text_encoder_conds
        with torch.set_grad_enabled(is_train), accelerator.autocast():
            model_pred = unet(noisy_model_input, timesteps, vlm_embed, vlm_mask, byt5_embed, byt5_mask)
        model_pred, weighting = flux_train_utils.apply_model_prediction_type(args, model_pred, noisy_model_input, sigmas)
        return model_pred, noise - latents, timesteps, weighting


def setup_parser():
    parser = train_network.setup_parser()
    parser.set_defaults(timestep_sampling="sigma", discrete_flow_shift=5.0, model_prediction_type="raw")
    return parser


if __name__ == "__main__":
    HunyuanImageNetworkTrainer().train(setup_parser().parse_args())
