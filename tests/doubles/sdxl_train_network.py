"""Double of ``sdxl_train_network.py``: inherits SD's step; ``call_unet`` adds the batch's size conditioning to the vector."""

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
        # sdxl_train_util.get_size_embeddings embeds the three (B, 2) pixel sizes; the double passes them as they are
        keys = ("original_sizes_hw", "crop_top_lefts", "target_sizes_hw")
        sizes = torch.cat([batch[key] for key in keys], dim=1).to(accelerator.device, weight_dtype) / 1024
        return unet(noisy_latents, timesteps, torch.cat([hidden1, hidden2], dim=2), torch.cat([pool2, sizes], dim=1))


def setup_parser():
    return train_network.setup_parser()


if __name__ == "__main__":
    SdxlNetworkTrainer().train(setup_parser().parse_args())
