"""Tiny stand-ins for the host's denoisers, one per architecture, under the host's class names
(the plugin picks the inner LoRA module from ``type(unet).__name__``).

Each is a per-token linear map with a timestep term, so a LoRA on ``proj`` trains, and each keeps
``calls``: what reached it (input shape, timesteps, positional ids) for the tests to inspect. Each
asserts the latent multiple its real counterpart needs (SDXL skip-concats %4, patchified DiTs %2).

Gradient checkpointing as the host's models do it, around the whole map (the host's blocks): SDXL's UNet
with ``torch.utils.checkpoint`` at ``use_reentrant=USE_REENTRANT`` (True, library/sdxl_original_unet.py), Anima's
blocks non-reentrant, or with ``--unsloth_offload_checkpointing`` through :class:`UnslothOffloadedGradientCheckpointer`
(library/anima_models.py): the block runs under ``no_grad`` and its backward calls ``torch.autograd.backward``.
"""

from types import SimpleNamespace

import torch
import torch.utils.checkpoint
from torch import nn

USE_REENTRANT = True  # library/sdxl_original_unet.py


def detach_variable(inputs):
    """library/anima_models.py: each tensor detached, keeping its ``requires_grad``."""
    out = []
    for inp in inputs:
        if not isinstance(inp, torch.Tensor):
            out.append(inp)
            continue
        x = inp.detach()
        x.requires_grad = inp.requires_grad
        out.append(x)
    return tuple(out)


class UnslothOffloadedGradientCheckpointer(torch.autograd.Function):
    """library/anima_models.py's: the activations kept on the CPU, the block run under ``no_grad``; its backward
    recomputes the block and calls ``torch.autograd.backward`` on it, so the block's parameters get their
    gradient in ``.grad`` from that inner backward, not through this function's outputs."""

    @staticmethod
    def forward(ctx, forward_function, hidden_states, *args):
        ctx.input_device = hidden_states.device
        saved_hidden_states = hidden_states.to("cpu", non_blocking=True)
        with torch.no_grad():
            output = forward_function(hidden_states, *args)
        ctx.save_for_backward(saved_hidden_states)
        ctx.forward_function = forward_function
        ctx.args = args
        return output

    @staticmethod
    def backward(ctx, *grads):
        (hidden_states,) = ctx.saved_tensors
        hidden_states = hidden_states.to(ctx.input_device, non_blocking=True).detach()
        hidden_states.requires_grad_(True)
        args = detach_variable(ctx.args)
        inputs = (hidden_states,) + args
        with torch.enable_grad():
            outputs = ctx.forward_function(*inputs)
        output_tensors, grad_tensors = [], []
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        for out, grad in zip(outputs, grads if isinstance(grads, tuple) else (grads,), strict=False):
            if isinstance(out, torch.Tensor) and out.requires_grad:
                output_tensors.append(out)
                grad_tensors.append(grad)
        torch.autograd.backward(output_tensors, grad_tensors)
        return (None,) + tuple(inp.grad if isinstance(inp, torch.Tensor) else None for inp in inputs)


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
    gradient_checkpointing = False

    def enable_gradient_checkpointing(self):
        self.gradient_checkpointing = True

    def forward(self, x, timesteps, context, y):
        self._record(x, timesteps, y=y.detach().clone())
        if self.training and self.gradient_checkpointing:
            return torch.utils.checkpoint.checkpoint(self._map, x, timesteps / 1000, context + y.mean(), use_reentrant=USE_REENTRANT)
        return self._map(x, timesteps / 1000, context + y.mean())


class MMDiT(_Tiny):
    multiple = 2

    def forward(self, x, t, context=None, y=None):
        self._record(x, t)
        return self._map(x, t / 1000, context)


class Flux(_Tiny):
    """``joint_attention`` (off by default, a test opts in before the trainer builds the model): the packed image
    and the text also run one ``DoubleStreamBlock`` and one ``SingleStreamBlock`` of ``library.flux_models``
    (joint attention, text first, the T5 mask, the host's gradient checkpointing)."""

    multiple = 1  # packed tokens; packing itself needs even h, w
    joint_attention = False
    TEXT_DIM = 8  # the trainer double's T5 stand-in (flux_train_network.py text_conds)

    def __init__(self, channels: int = 4):
        super().__init__(features=channels * 4)
        if self.joint_attention:
            from library import flux_models

            hidden = channels * 4
            self.txt_in = nn.Linear(self.TEXT_DIM, hidden)
            self.double_block = flux_models.DoubleStreamBlock(hidden, 2)
            self.single_block = flux_models.SingleStreamBlock(hidden, 2)

    def enable_gradient_checkpointing(self, cpu_offload: bool = False):
        for block in (getattr(self, "double_block", None), getattr(self, "single_block", None)):
            if block is not None:
                block.enable_gradient_checkpointing(cpu_offload)

    def get_mod_vectors(self, timesteps, guidance, batch_size):
        return None

    def prepare_block_swap_before_forward(self):
        pass

    def _joint(self, img, img_ids, txt, txt_ids, timesteps, txt_attention_mask):
        """The image tokens after the two blocks; positions as one angle per token and channel pair."""
        ids = torch.cat((txt_ids, img_ids), dim=1).float()
        pairs = torch.arange(1, img.shape[-1] // 4 + 1, dtype=torch.float32) / 4  # heads of 8 channels: 4 pairs
        pe = (ids[..., 1:2] + 2.0 * ids[..., 2:3]) * pairs  # B, L, D/2
        pe = pe[:, None]
        vec = timesteps.float()[:, None].expand(-1, img.shape[-1]).to(img.dtype)
        img, txt = self.double_block(img, self.txt_in(txt), vec, pe, txt_attention_mask)
        x = self.single_block(torch.cat((txt, img), 1), vec, pe, txt_attention_mask)
        return x[:, txt.shape[1] :]

    def forward(self, img, img_ids, txt, txt_ids, y, timesteps, guidance=None, txt_attention_mask=None, mod_vectors=None):
        assert img_ids.shape[:2] == img.shape[:2], "img_ids must have one row per packed image token"
        self.calls.append({"shape": tuple(img.shape), "t": timesteps.detach().clone(), "img_ids": img_ids.detach().clone()})
        scale = 1.0 + timesteps.float().view(-1, 1, 1)
        if self.joint_attention:
            img = self._joint(img, img_ids, txt, txt_ids, timesteps, txt_attention_mask)
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
    gradient_checkpointing = cpu_offload_checkpointing = unsloth_offload_checkpointing = False

    def enable_gradient_checkpointing(self, cpu_offload: bool = False, unsloth_offload: bool = False):
        self.gradient_checkpointing = True
        self.cpu_offload_checkpointing = cpu_offload if not unsloth_offload else False
        self.unsloth_offload_checkpointing = unsloth_offload

    def forward(
        self, x, timesteps, context, padding_mask=None, target_input_ids=None, target_attention_mask=None, source_attention_mask=None
    ):
        assert x.ndim == 5 and padding_mask.shape[-2:] == x.shape[-2:], "Anima takes [B,C,1,H,W] and a padding mask of the same grid"
        self._record(x, timesteps, padding_mask=tuple(padding_mask.shape))
        if self.training and self.gradient_checkpointing:
            if self.unsloth_offload_checkpointing:
                return UnslothOffloadedGradientCheckpointer.apply(self._map, x, timesteps, context)
            return torch.utils.checkpoint.checkpoint(self._map, x, timesteps, context, use_reentrant=False)
        return self._map(x, timesteps, context)


class HYImageDiffusionTransformer(_Tiny):
    def forward(self, hidden_states, timestep, text_states, encoder_attention_mask, byt5_text_states, byt5_text_mask):
        self._record(hidden_states, timestep)
        return self._map(hidden_states, timestep / 1000, text_states + byt5_text_states.mean())
