"""Double of ``library/flux_models.py``'s joint attention path (sd-scripts 48d368fa), reimplemented small.

- ``attention(q, k, v, pe, attn_mask=None)``: q, k, v are B H L D; the positions ``pe`` rotate q and k, then
  ``scaled_dot_product_attention`` with ``attn_mask``, heads merged back (B L H·D). Looked up at call time by
- ``DoubleStreamBlock`` (text tokens then image tokens concatenated into one sequence) and ``SingleStreamBlock``
  (the joint sequence, text first), each turning ``txt_attention_mask`` (B, text) into the host's boolean key
  mask (B, H, L, L: the text mask, then True for every image key), and checkpointing as the host's blocks do:
  ``checkpoint(self._forward, ..., use_reentrant=False)`` with the name imported from ``torch.utils.checkpoint``,
  and with ``cpu_offload_checkpointing`` through ``torch.utils.checkpoint.checkpoint``.

The stand-in's ``pe`` is one rotation angle per token and channel pair (B, 1, L, D/2), not the host's 2×2 matrices,
and the blocks have no modulation or MLP: what the plugin touches is the function, its arguments and the order.
"""

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.checkpoint import checkpoint


def apply_rope(q, k, pe):
    """Rotate each channel pair of q and k by its token's angle."""

    def rotate(x):
        pairs = x.float().reshape(*x.shape[:-1], -1, 2)
        cos, sin = pe.cos(), pe.sin()
        out = torch.stack((pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 0] * sin + pairs[..., 1] * cos), -1)
        return out.reshape(x.shape).type_as(x)

    return rotate(q), rotate(k)


def attention(q, k, v, pe, attn_mask=None):
    q, k = apply_rope(q, k, pe)
    x = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    return x.transpose(1, 2).flatten(2)


def key_mask(txt_attention_mask, n_keys: int, heads: int):
    """The blocks' boolean mask: the text keys' mask, every image key kept, broadcast to every head and query."""
    mask = txt_attention_mask.to(torch.bool)
    mask = torch.cat((mask, torch.ones(mask.shape[0], n_keys - mask.shape[1], device=mask.device, dtype=torch.bool)), dim=1)
    return mask[:, None, None, :].expand(-1, heads, n_keys, -1)


def heads_of(x, heads: int):
    """(B, L, 3·H·D) → q, k, v, each B H L D."""
    return x.unflatten(-1, (3, heads, -1)).permute(2, 0, 3, 1, 4)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.gradient_checkpointing = False
        self.cpu_offload_checkpointing = False

    def enable_gradient_checkpointing(self, cpu_offload: bool = False):
        self.gradient_checkpointing = True
        self.cpu_offload_checkpointing = cpu_offload

    def forward(self, *args):
        if self.training and self.gradient_checkpointing:
            if not self.cpu_offload_checkpointing:
                return checkpoint(self._forward, *args, use_reentrant=False)
            return torch.utils.checkpoint.checkpoint(self._forward, *args, use_reentrant=False)
        return self._forward(*args)


class DoubleStreamBlock(_Block):
    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.img_qkv, self.txt_qkv = nn.Linear(hidden_size, 3 * hidden_size), nn.Linear(hidden_size, 3 * hidden_size)
        self.img_proj, self.txt_proj = nn.Linear(hidden_size, hidden_size), nn.Linear(hidden_size, hidden_size)

    def _forward(self, img, txt, vec, pe, txt_attention_mask=None):
        img_q, img_k, img_v = heads_of(self.img_qkv(img + vec[:, None]), self.num_heads)
        txt_q, txt_k, txt_v = heads_of(self.txt_qkv(txt + vec[:, None]), self.num_heads)
        q, k, v = torch.cat((txt_q, img_q), dim=2), torch.cat((txt_k, img_k), dim=2), torch.cat((txt_v, img_v), dim=2)
        attn_mask = None if txt_attention_mask is None else key_mask(txt_attention_mask, q.shape[2], self.num_heads)
        attn = attention(q, k, v, pe=pe, attn_mask=attn_mask)
        txt_attn, img_attn = attn[:, : txt.shape[1]], attn[:, txt.shape[1] :]
        return img + self.img_proj(img_attn), txt + self.txt_proj(txt_attn)


class SingleStreamBlock(_Block):
    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv, self.proj = nn.Linear(hidden_size, 3 * hidden_size), nn.Linear(hidden_size, hidden_size)

    def _forward(self, x, vec, pe, txt_attention_mask=None):
        q, k, v = heads_of(self.qkv(x + vec[:, None]), self.num_heads)
        attn_mask = None if txt_attention_mask is None else key_mask(txt_attention_mask, x.shape[1], self.num_heads)
        return x + self.proj(attention(q, k, v, pe=pe, attn_mask=attn_mask))
