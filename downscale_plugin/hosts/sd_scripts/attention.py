"""``attention = "proportional"`` on sd-scripts (``downscale_plugin/attention.py``): FLUX.1's joint attention.

``library/flux_models.py`` runs every joint attention through its module function ``attention(q, k, v, pe,
attn_mask)`` (q, k, v: B H L D), looked up at call time by ``DoubleStreamBlock`` (text then image tokens
concatenated) and ``SingleStreamBlock`` (the joint sequence, text first); with ``--apply_t5_attn_mask`` the
blocks pass a boolean mask over the keys (T5 padding). For a routed forward the function is replaced by one
that passes the mask's float form plus ln s on the last N_small keys, the image tokens; the blocks'
``checkpoint`` (``from torch.utils.checkpoint import checkpoint``) and ``--cpu_offload_checkpointing``'s
``torch.utils.checkpoint.checkpoint`` recompute under the same replacement.

Only FLUX.1 (``flux``): Chroma's blocks put the image tokens first and trim each sample's text, SD3's MMDiT,
Lumina, Anima and HunyuanImage run their own attention code, and the UNets have no joint sequence.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ...attention import biased_mask, require_proportional, routed_attention_scope

ATTENTION_MODULE = "library.flux_models"  # its module function ``attention``
SUPPORTED_ARCHS = ("flux",)
HOST = "sd-scripts"


def refuse_unsupported(arch: str) -> None:
    """Raise ValueError naming the key, the value, ``arch`` and the supported ones, unless ``arch`` can take the bias."""
    require_proportional(HOST, arch, SUPPORTED_ARCHS, "the lab DiT takes it too")


def _biased(n_image: int, bias: float) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def biased(original: Callable[..., Any]) -> Callable[..., Any]:
        def attention(q, k, v, pe, attn_mask=None):
            return original(q, k, v, pe=pe, attn_mask=biased_mask(attn_mask, k.shape[2], n_image, bias, q.dtype, q.device))

        return attention

    return biased


def attention_scope(module: Any = None) -> Callable[[int, float], AbstractContextManager]:
    """``StepOptions.attention_scope`` for FLUX.1: ``(image tokens, ln s)`` → the scope over ``module``'s
    ``attention`` (default: the host's ``library.flux_models``)."""
    module = module if module is not None else importlib.import_module(ATTENTION_MODULE)
    if not callable(getattr(module, "attention", None)):
        raise AttributeError(f"{module.__name__}.attention is missing: this host revision has no joint attention function to bias")

    owners = (module,) if callable(getattr(module, "checkpoint", None)) else ()

    def scope(n_image: int, bias: float) -> AbstractContextManager:
        return routed_attention_scope(module, "attention", _biased(n_image, bias), checkpoint_owners=owners)

    return scope
