"""Double of ``sdxl_train_network.py``: inherits SD's step; ``call_unet`` adds a size vector."""

import torch
import train_network
from library import tiny_models


class SdxlNetworkTrainer(train_network.NetworkTrainer):
    denoiser = tiny_models.SdxlUNet2DConditionModel

    def __init__(self):
        super().__init__()
        self.vae_scale_factor = 0.13025
        self.is_sdxl = True

    def text_conds(self, bsz, gen):
        return [torch.randn(bsz, 7, 8, generator=gen), torch.randn(bsz, 7, 8, generator=gen), torch.randn(bsz, 8, generator=gen)]

    def call_unet(self, args, accelerator, unet, noisy_latents, timesteps, text_conds, batch, weight_dtype, indices=None):
        noisy_latents = noisy_latents.to(weight_dtype)
        hidden1, hidden2, pool2 = text_conds
        sizes = batch["target_sizes_hw"].to(accelerator.device, weight_dtype) / 1024  # pixel sizes, not latent-shaped
        return unet(noisy_latents, timesteps, torch.cat([hidden1, hidden2], dim=2), torch.cat([pool2, sizes], dim=1))


def setup_parser():
    return train_network.setup_parser()


if __name__ == "__main__":
    SdxlNetworkTrainer().train(setup_parser().parse_args())
