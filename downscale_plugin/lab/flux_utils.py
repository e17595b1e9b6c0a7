"""Flux latent packing and position ids, with the semantics of sd-scripts' ``library/flux_utils.py``.

The lab trainer calls these as module attributes (``flux_utils.prepare_img_ids``) so that a scoped
replacement of the attribute (e.g. interpolated positions) is seen, exactly as in the host.
"""

from __future__ import annotations

import torch


def pack_latents(x: torch.Tensor) -> torch.Tensor:
    """[b, c, 2h, 2w] -> [b, h*w, c*4]; channel order (c, ph, pw) as in the host."""
    b, c, hh, ww = x.shape
    h, w = hh // 2, ww // 2
    x = x.reshape(b, c, h, 2, w, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, h * w, c * 4)


def unpack_latents(x: torch.Tensor, packed_latent_height: int, packed_latent_width: int) -> torch.Tensor:
    """Inverse of :func:`pack_latents`: [b, h*w, c*4] -> [b, c, 2h, 2w]."""
    b, _, cpp = x.shape
    h, w, c = packed_latent_height, packed_latent_width, cpp // 4
    x = x.reshape(b, h, w, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h * 2, w * 2)


def prepare_img_ids(batch_size: int, packed_latent_height: int, packed_latent_width: int) -> torch.Tensor:
    """RoPE ids [b, h*w, 3]: channel 0 zero, channel 1 the row, channel 2 the column (float32)."""
    ids = torch.zeros(packed_latent_height, packed_latent_width, 3)
    ids[..., 1] = torch.arange(packed_latent_height, dtype=ids.dtype)[:, None]
    ids[..., 2] = torch.arange(packed_latent_width, dtype=ids.dtype)[None, :]
    return ids.reshape(1, -1, 3).repeat(batch_size, 1, 1)
