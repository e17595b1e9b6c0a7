"""Double of ``library.flux_utils``: Flux 2x2 latent packing and image position ids."""

from downscale_plugin.lab.flux_utils import pack_latents, prepare_img_ids, unpack_latents

__all__ = ["pack_latents", "prepare_img_ids", "unpack_latents"]
