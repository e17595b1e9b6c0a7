"""Double of ``sd3_train_network.py``: noise, then ``sd3_train_utils.get_noisy_model_input_and_timesteps``
(CPU u draw), MMDiT call, σ preconditioning, target = latents."""

import torch
import train_network
from library import sd3_train_utils, tiny_models


class Sd3NetworkTrainer(train_network.NetworkTrainer):
    denoiser = tiny_models.MMDiT

    def text_conds(self, bsz, gen):
        masks = [torch.ones(bsz, 5), torch.ones(bsz, 5), torch.ones(bsz, 6)]
        return [torch.randn(bsz, 5, 8, generator=gen), torch.randn(bsz, 6, 8, generator=gen), torch.randn(bsz, 8, generator=gen), *masks]

    def get_noise_scheduler(self, args, device):
        return sd3_train_utils.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=args.training_shift)

    def shift_scale_latents(self, args, latents):
        return (latents - 0.0609) * 1.5305

    def get_noise_pred_and_target(
        self, args, accelerator, noise_scheduler, latents, batch, text_encoder_conds, unet, network, weight_dtype, train_unet, is_train=True
    ):
        noise = torch.randn_like(latents)
        noisy_model_input, timesteps, sigmas = sd3_train_utils.get_noisy_model_input_and_timesteps(
            args, latents, noise, accelerator.device, weight_dtype
        )
        lg_out, t5_out, lg_pooled, l_attn_mask, g_attn_mask, t5_attn_mask = text_encoder_conds
        context = torch.cat([lg_out, t5_out], dim=1)
        with torch.set_grad_enabled(is_train), accelerator.autocast():
            model_pred = unet(noisy_model_input, timesteps, context=context, y=lg_pooled)
        model_pred = model_pred * (-sigmas) + noisy_model_input
        weighting = sd3_train_utils.compute_loss_weighting_for_sd3(weighting_scheme=args.weighting_scheme, sigmas=sigmas)
        return model_pred, latents, timesteps, weighting


def setup_parser():
    return train_network.setup_parser()


if __name__ == "__main__":
    Sd3NetworkTrainer().train(setup_parser().parse_args())
