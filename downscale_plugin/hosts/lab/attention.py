"""``attention = "proportional"`` on the lab DiT (``downscale_plugin/attention.py``): diffusers' Flux attention.

The lab DiT is diffusers' ``FluxTransformer2DModel``; its ``FluxAttnProcessor`` (diffusers 0.42) runs every joint
attention through the module function ``transformer_flux.dispatch_attention_fn(query, key, value, attn_mask=...,
backend=..., parallel_config=...)`` (q, k, v: B L H D), looked up at call time, with the text tokens first in both
the double-stream blocks (``encoder_hidden_states`` then ``hidden_states``) and the single-stream blocks (the joint
sequence). For a routed forward the function is replaced by one that passes ln s on the last N_small keys, the
image tokens, added to the mask the processor passed (the lab passes none); with ``--gradient_checkpointing``
diffusers' blocks recompute through ``torch.utils.checkpoint.checkpoint`` under the same replacement.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ...attention import biased_mask, routed_attention_scope

ATTENTION_MODULE = "diffusers.models.transformers.transformer_flux"  # its module function ``dispatch_attention_fn``
ATTENTION_FUNCTION = "dispatch_attention_fn"


def _biased(n_image: int, bias: float) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def biased(original: Callable[..., Any]) -> Callable[..., Any]:
        def dispatch_attention_fn(query, key, value, attn_mask=None, *args, **kwargs):
            mask = biased_mask(attn_mask, key.shape[1], n_image, bias, query.dtype, query.device)
            return original(query, key, value, mask, *args, **kwargs)

        return dispatch_attention_fn

    return biased


def attention_scope(module: Any = None) -> Callable[[int, float], AbstractContextManager]:
    """``StepOptions.attention_scope`` for the lab DiT: ``(image tokens, ln s)`` → the scope over ``module``'s
    ``dispatch_attention_fn`` (default: the installed diffusers' ``transformer_flux``)."""
    module = module if module is not None else importlib.import_module(ATTENTION_MODULE)
    if not callable(getattr(module, ATTENTION_FUNCTION, None)):
        raise AttributeError(
            f"{module.__name__}.{ATTENTION_FUNCTION} is missing: this diffusers version's Flux attention has no function "
            "the lab can bias (attention = 'proportional' needs the dispatch_attention_fn diffusers 0.42 calls)"
        )

    def scope(n_image: int, bias: float) -> AbstractContextManager:
        return routed_attention_scope(module, ATTENTION_FUNCTION, _biased(n_image, bias))

    return scope
