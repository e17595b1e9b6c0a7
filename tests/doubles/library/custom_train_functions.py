"""Double of ``library.custom_train_functions``: the mask path of the loss and the SD/SDXL noise options.

``apply_noise_offset`` and ``pyramid_noise_like`` follow the host's signatures, arithmetic and RNG
order (cf:458-484): the offset draws one CPU-device normal per (sample, channel) after an optional
adaptive term from the latents' per-channel |mean|; the multires pyramid draws, per level, one
``random.random()`` (Python's global generator) for the level's ratio and then a ``torch.randn`` on
the CPU, stopping after the first 1-pixel level, and rescales the sum to unit std in place.
"""

import random

import torch
import torch.nn.functional as F


def pyramid_noise_like(noise, device, iterations=6, discount=0.4):
    b, c, rows, cols = noise.shape
    upsample = torch.nn.Upsample(size=(rows, cols), mode="bilinear").to(device)
    for level in range(iterations):
        ratio = random.random() * 2 + 2  # in [2, 4): Python's global generator, as the host draws it
        level_rows, level_cols = max(1, int(rows / (ratio**level))), max(1, int(cols / (ratio**level)))
        noise += upsample(torch.randn(b, c, level_rows, level_cols).to(device)) * discount**level
        if level_rows == 1 or level_cols == 1:
            break
    return noise / noise.std()


def apply_noise_offset(latents, noise, noise_offset, adaptive_noise_scale):
    if noise_offset is None:
        return noise
    if adaptive_noise_scale is not None:  # per (sample, channel): offset + scale·|mean latent|, floored at 0
        noise_offset = torch.clamp(noise_offset + adaptive_noise_scale * torch.abs(latents.mean(dim=(2, 3), keepdim=True)), 0.0, None)
    return noise + noise_offset * torch.randn((latents.shape[0], latents.shape[1], 1, 1), device=latents.device)


def apply_masked_loss(loss: torch.Tensor, batch: dict) -> torch.Tensor:
    """Weight the elementwise loss by the batch's alpha mask, area-resized to the loss grid."""
    masks = batch.get("alpha_masks")
    if masks is None:
        return loss
    mask = F.interpolate(masks.to(dtype=loss.dtype).unsqueeze(1), size=loss.shape[2:], mode="area")
    return loss * mask
