"""Double of ``library.anima_train_utils``: Anima's loss weighting (the SD3 schemes)."""

from downscale_plugin.lab.flux_train_utils import compute_loss_weighting_for_sd3 as compute_loss_weighting_for_anima

__all__ = ["compute_loss_weighting_for_anima"]
