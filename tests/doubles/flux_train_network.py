"""Double of ``flux_train_network.py`` (FLUX.1 and, with ``--model_type chroma``, Chroma): noise,
the shared Flux-family sampler, pack, ``flux_utils.prepare_img_ids`` from the noisy input's shape,
DiT call with t/1000, unpack, prediction type, target = noise − latents."""

import torch
import train_network
from library import flux_train_utils, flux_utils, sd3_train_utils, tiny_models


class FluxNetworkTrainer(train_network.NetworkTrainer):
    def __init__(self):
        super().__init__()
        self.model_type = None

    def load_target_model(self, args, weight_dtype, accelerator):
        self.model_type = args.model_type
        self.denoiser = tiny_models.Chroma if args.model_type == "chroma" else tiny_models.Flux
        return super().load_target_model(args, weight_dtype, accelerator)

    def text_conds(self, bsz, gen):
        return [torch.randn(bsz, 8, generator=gen), torch.randn(bsz, 6, 8, generator=gen), torch.zeros(bsz, 6, 3), torch.ones(bsz, 6)]

    def get_noise_scheduler(self, args, device):
        return sd3_train_utils.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=args.discrete_flow_shift)

    def shift_scale_latents(self, args, latents):
        return latents

    def get_noise_pred_and_target(
        self, args, accelerator, noise_scheduler, latents, batch, text_encoder_conds, unet, network, weight_dtype, train_unet, is_train=True
    ):
        noise = torch.randn_like(latents)
        bsz = latents.shape[0]
        noisy_model_input, timesteps, sigmas = flux_train_utils.get_noisy_model_input_and_timesteps(
            args, noise_scheduler, latents, noise, accelerator.device, weight_dtype
        )
        packed = flux_utils.pack_latents(noisy_model_input)
        packed_h, packed_w = noisy_model_input.shape[2] // 2, noisy_model_input.shape[3] // 2
        img_ids = flux_utils.prepare_img_ids(bsz, packed_h, packed_w).to(device=accelerator.device)
        guidance_vec = torch.full((bsz,), float(args.guidance_scale), device=accelerator.device)
        with accelerator.autocast(), torch.no_grad():
            mod_vectors = unet.get_mod_vectors(timesteps=timesteps / 1000, guidance=guidance_vec, batch_size=bsz)
        l_pooled, t5_out, txt_ids, t5_attn_mask = text_encoder_conds
        if not args.apply_t5_attn_mask:
            t5_attn_mask = None
        with torch.set_grad_enabled(is_train), accelerator.autocast():
            model_pred = unet(
                img=packed,
                img_ids=img_ids,
                txt=t5_out,
                txt_ids=txt_ids,
                y=l_pooled,
                timesteps=timesteps / 1000,
                guidance=guidance_vec,
                txt_attention_mask=t5_attn_mask,
                mod_vectors=mod_vectors,
            )
        model_pred = flux_utils.unpack_latents(model_pred, packed_h, packed_w)
        model_pred, weighting = flux_train_utils.apply_model_prediction_type(args, model_pred, noisy_model_input, sigmas)
        return model_pred, noise - latents, timesteps, weighting


def setup_parser():
    return train_network.setup_parser()


if __name__ == "__main__":
    FluxNetworkTrainer().train(setup_parser().parse_args())
