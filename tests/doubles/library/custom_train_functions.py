"""Double of ``library.custom_train_functions``: the mask path of the loss."""

import torch
import torch.nn.functional as F


def apply_masked_loss(loss: torch.Tensor, batch: dict) -> torch.Tensor:
    """Weight the elementwise loss by the batch's alpha mask, area-resized to the loss grid."""
    masks = batch.get("alpha_masks")
    if masks is None:
        return loss
    mask = F.interpolate(masks.to(dtype=loss.dtype).unsqueeze(1), size=loss.shape[2:], mode="area")
    return loss * mask
