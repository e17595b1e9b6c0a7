"""Double of ``anima_train_network.py``: squeeze old 5D caches, noise, the shared Flux-family
sampler, t/1000, a padding mask from the latent grid, 5D DiT call, target = noise − latents; and the
``process_batch`` override that applies caption dropout to cached text-encoder outputs first."""

import random

import torch
import train_network
from library import anima_train_utils, flux_train_utils, sd3_train_utils, tiny_models


class AnimaNetworkTrainer(train_network.NetworkTrainer):
    denoiser = tiny_models.Anima

    def text_conds(self, bsz, gen):
        return [
            torch.randn(bsz, 6, 8, generator=gen),
            torch.ones(bsz, 6),
            torch.zeros(bsz, 6, dtype=torch.long),
            torch.ones(bsz, 6),
            torch.zeros(bsz),  # caption_dropout_rates
        ]

    def train(self, args):
        if args.unsloth_offload_checkpointing:  # assert_extra_args
            args.gradient_checkpointing = True
        super().train(args)

    def prepare_unet_with_accelerator(self, args, accelerator, unet):
        if args.unsloth_offload_checkpointing and args.gradient_checkpointing:
            unet.enable_gradient_checkpointing(unsloth_offload=True)
        return super().prepare_unet_with_accelerator(args, accelerator, unet)

    def get_noise_scheduler(self, args, device):
        return sd3_train_utils.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=args.discrete_flow_shift)

    def shift_scale_latents(self, args, latents):
        return latents

    def get_noise_pred_and_target(
        self, args, accelerator, noise_scheduler, latents, batch, text_encoder_conds, unet, network, weight_dtype, train_unet, is_train=True
    ):
        if latents.ndim == 5:
            latents = latents.squeeze(2)
        noise = torch.randn_like(latents)
        noisy_model_input, timesteps, sigmas = flux_train_utils.get_noisy_model_input_and_timesteps(
            args, noise_scheduler, latents, noise, accelerator.device, weight_dtype
        )
        timesteps = timesteps / 1000.0
        if args.gradient_checkpointing:
            noisy_model_input.requires_grad_(True)
            for t in text_encoder_conds:
                if t is not None and t.dtype.is_floating_point:
                    t.requires_grad_(True)
        prompt_embeds, attn_mask, t5_input_ids, t5_attn_mask = text_encoder_conds
        bs, h_latent, w_latent = latents.shape[0], latents.shape[-2], latents.shape[-1]
        padding_mask = torch.zeros(bs, 1, h_latent, w_latent, dtype=weight_dtype, device=accelerator.device)
        with torch.set_grad_enabled(is_train), accelerator.autocast():
            model_pred = unet(
                noisy_model_input.unsqueeze(2),
                timesteps,
                prompt_embeds,
                padding_mask=padding_mask,
                target_input_ids=t5_input_ids,
                target_attention_mask=t5_attn_mask,
                source_attention_mask=attn_mask,
            )
        weighting = anima_train_utils.compute_loss_weighting_for_anima(weighting_scheme=args.weighting_scheme, sigmas=sigmas)
        return model_pred.squeeze(2), noise - latents, timesteps, weighting

    def process_batch(
        self,
        batch,
        text_encoders,
        unet,
        network,
        vae,
        noise_scheduler,
        vae_dtype,
        weight_dtype,
        accelerator,
        args,
        text_encoding_strategy,
        tokenize_strategy,
        is_train=True,
        train_text_encoder=True,
        train_unet=True,
    ):
        outputs = batch.get("text_encoder_outputs_list")
        if outputs is not None:
            *outputs, rates = outputs
            if not torch.all(rates == 0.0):
                outputs = [t.clone() for t in outputs]
                for i in range(outputs[0].shape[0]):
                    if random.random() < rates[i].item():
                        outputs[0][i] = 0
            batch = {**batch, "text_encoder_outputs_list": outputs}  # the host's collator makes a fresh dict per step
        return super().process_batch(
            batch,
            text_encoders,
            unet,
            network,
            vae,
            noise_scheduler,
            vae_dtype,
            weight_dtype,
            accelerator,
            args,
            text_encoding_strategy,
            tokenize_strategy,
            is_train,
            train_text_encoder,
            train_unet,
        )


def setup_parser():
    parser = train_network.setup_parser()
    parser.add_argument("--unsloth_offload_checkpointing", action="store_true")
    parser.set_defaults(timestep_sampling="sigmoid", discrete_flow_shift=1.0, sigmoid_scale=1.0)
    return parser


if __name__ == "__main__":
    AnimaNetworkTrainer().train(setup_parser().parse_args())
