"""Tiny stand-ins for the host's denoisers, one per architecture, under the host's class names
(the plugin picks the inner LoRA module from ``type(unet).__name__``).

Each is a per-token linear map with a timestep term, so a LoRA on ``proj`` trains, and each keeps
``calls``: what reached it (input shape, timesteps, positional ids) for the tests to inspect. Each
asserts the latent multiple its real counterpart needs (SDXL skip-concats %4, patchified DiTs %2).
"""

from types import SimpleNamespace

import torch
from torch import nn


class _Tiny(nn.Module):
    multiple = 1

    def __init__(self, channels: int = 4, features: int | None = None):
        super().__init__()
        self.proj = nn.Linear(features or channels, features or channels)
        self.calls: list[dict] = []

    def _record(self, x: torch.Tensor, t: torch.Tensor, **extra) -> None:
        h, w = x.shape[-2:]
        assert h % self.multiple == 0 and w % self.multiple == 0, f"{type(self).__name__} needs latents %{self.multiple}, got {h}x{w}"
        self.calls.append({"shape": tuple(x.shape), "t": t.detach().clone(), **extra})

    def _map(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Channel-first x: per-position linear map, scaled by t, shifted by the conditioning."""
        scale = (1.0 + t.float().reshape(-1, *([1] * (x.ndim - 1)))).to(x.dtype)
        return self.proj(x.movedim(1, -1)).movedim(-1, 1) * scale + cond.float().mean().to(x.dtype)


class UNet2DConditionModel(_Tiny):
    def forward(self, sample, timestep, encoder_hidden_states):
        self._record(sample, timestep)
        return SimpleNamespace(sample=self._map(sample, timestep / 1000, encoder_hidden_states))


class SdxlUNet2DConditionModel(_Tiny):
    multiple = 4

    def forward(self, x, timesteps, context, y):
        self._record(x, timesteps)
        return self._map(x, timesteps / 1000, context + y.mean())


class MMDiT(_Tiny):
    multiple = 2

    def forward(self, x, t, context=None, y=None):
        self._record(x, t)
        return self._map(x, t / 1000, context)


class Flux(_Tiny):
    multiple = 1  # packed tokens; packing itself needs even h, w

    def __init__(self, channels: int = 4):
        super().__init__(features=channels * 4)

    def get_mod_vectors(self, timesteps, guidance, batch_size):
        return None

    def prepare_block_swap_before_forward(self):
        pass

    def forward(self, img, img_ids, txt, txt_ids, y, timesteps, guidance=None, txt_attention_mask=None, mod_vectors=None):
        assert img_ids.shape[:2] == img.shape[:2], "img_ids must have one row per packed image token"
        self.calls.append({"shape": tuple(img.shape), "t": timesteps.detach().clone(), "img_ids": img_ids.detach().clone()})
        scale = 1.0 + timesteps.float().view(-1, 1, 1)
        return self.proj(img) * scale + txt.mean() + y.mean()


class Chroma(Flux):
    def get_mod_vectors(self, timesteps, guidance, batch_size):
        return torch.stack([timesteps, guidance], dim=1).reshape(batch_size, -1)


class NextDiT(_Tiny):
    multiple = 2

    def forward(self, x, t, cap_feats, cap_mask):
        self._record(x, t)
        return self._map(x, t, cap_feats)


class Anima(_Tiny):
    multiple = 2

    def forward(
        self, x, timesteps, context, padding_mask=None, target_input_ids=None, target_attention_mask=None, source_attention_mask=None
    ):
        assert x.ndim == 5 and padding_mask.shape[-2:] == x.shape[-2:], "Anima takes [B,C,1,H,W] and a padding mask of the same grid"
        self._record(x, timesteps, padding_mask=tuple(padding_mask.shape))
        return self._map(x, timesteps, context)


class HYImageDiffusionTransformer(_Tiny):
    def forward(self, hidden_states, timestep, text_states, encoder_attention_mask, byt5_text_states, byt5_text_mask):
        self._record(hidden_states, timestep)
        return self._map(hidden_states, timestep / 1000, text_states + byt5_text_states.mean())
