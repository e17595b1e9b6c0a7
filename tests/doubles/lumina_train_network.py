"""Double of ``lumina_train_network.py``: noise, ``lumina_train_util.get_noisy_model_input_and_timesteps``,
NextDiT call with t = 1 − timesteps/1000, prediction type, target = latents − noise."""

import torch
import train_network
from library import lumina_train_util, sd3_train_utils, tiny_models


class LuminaNetworkTrainer(train_network.NetworkTrainer):
    denoiser = tiny_models.NextDiT

    def text_conds(self, bsz, gen):
        return [torch.randn(bsz, 6, 8, generator=gen), torch.zeros(bsz, 6, dtype=torch.long), torch.ones(bsz, 6)]

    def get_noise_scheduler(self, args, device):
        return sd3_train_utils.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=args.discrete_flow_shift)

    def shift_scale_latents(self, args, latents):
        return latents

    def get_noise_pred_and_target(
        self, args, accelerator, noise_scheduler, latents, batch, text_encoder_conds, dit, network, weight_dtype, train_unet, is_train=True
    ):
        assert isinstance(noise_scheduler, sd3_train_utils.FlowMatchEulerDiscreteScheduler)
        noise = torch.randn_like(latents)
        noisy_model_input, timesteps, sigmas = lumina_train_util.get_noisy_model_input_and_timesteps(
            args, noise_scheduler, latents, noise, accelerator.device, weight_dtype
        )
        hidden_states, input_ids, attn_mask = text_encoder_conds
        with torch.set_grad_enabled(is_train), accelerator.autocast():
            model_pred = dit(x=noisy_model_input, t=1 - timesteps / 1000, cap_feats=hidden_states, cap_mask=attn_mask.to(dtype=torch.int32))
        model_pred, weighting = lumina_train_util.apply_model_prediction_type(args, model_pred, noisy_model_input, sigmas)
        return model_pred, latents - noise, timesteps, weighting


def setup_parser():
    parser = train_network.setup_parser()
    parser.set_defaults(timestep_sampling="shift", discrete_flow_shift=6.0, model_prediction_type="raw")
    return parser


if __name__ == "__main__":
    LuminaNetworkTrainer().train(setup_parser().parse_args())
