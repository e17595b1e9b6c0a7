"""``attention = "proportional"``: a routed step's joint attention weighs each image key by the native tokens it stands for.

With fewer image tokens after a route area-downsamples the latent (linear ratio r), the text keys take a
larger share of every query's softmax than at the native grid. Token merging's proportional attention
(ToMe, Bolya et al. 2023: ``attn + size.log()``) corrects that: each small image token averages
s = N_native / N_small native tokens' area (``grid.area_downsample``), so its key gets ln s added to every
logit, as if s copies of it were attended to; text keys get 0 and queries are unchanged. s is the ratio
of the token counts of the two grids the step runs (ln s = ln(1/r²) = −2 ln r where the route's grid is
exactly r times the native one on both axes; the grid rule's rounding makes it the grids' own ratio).

The bias is additive on the logits, so it composes with a host's attention mask as that mask's float form
(a boolean mask: 0 where kept, −inf where masked) plus the bias (:func:`biased_mask`). A host replaces its
attention function for the routed forward only (:func:`routed_attention_scope`); a non-reentrant gradient
checkpoint started inside that forward recomputes its blocks in the backward, after the forward's scope has
closed, so the scope also hands every checkpoint a recompute context that applies the same bias again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch
import torch.utils.checkpoint

from .config import ATTENTIONS
from .scope import swap_attr

PROPORTIONAL = "proportional"


def log_size(native_tokens: int, small_tokens: int) -> float:
    """ln s, s = N_native / N_small: the logit bias of a small grid's image keys (0 at the native grid)."""
    if not 0 < small_tokens <= native_tokens:
        raise ValueError(f"log_size: need 0 < small tokens ({small_tokens}) <= native tokens ({native_tokens})")
    return math.log(native_tokens / small_tokens)


def biased_mask(
    attn_mask: torch.Tensor | None, n_keys: int, n_image: int, bias: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The additive mask for ``scaled_dot_product_attention``: ``attn_mask``'s float form plus ``bias`` on the
    last ``n_image`` keys (a joint sequence's image tokens follow its text tokens). Without a mask it is
    (1, 1, 1, n_keys), broadcasting over batch, heads and queries."""
    if not 0 < n_image <= n_keys:
        raise ValueError(f"attention: {n_image} image tokens do not fit a joint sequence of {n_keys} keys")
    key_bias = torch.zeros(n_keys, dtype=dtype, device=device)
    key_bias[n_keys - n_image :] = bias
    if attn_mask is None:
        return key_bias.view(1, 1, 1, n_keys)
    if attn_mask.dtype == torch.bool:
        base = torch.zeros(attn_mask.shape, dtype=dtype, device=device).masked_fill(~attn_mask, float("-inf"))
    else:
        base = attn_mask.to(dtype)
    return base + key_bias


@contextmanager
def _both(first: AbstractContextManager, second: AbstractContextManager) -> Iterator[None]:
    with first, second:
        yield


def recomputing_checkpoint(original: Callable[..., Any], scope: Callable[[], AbstractContextManager]) -> Callable[..., Any]:
    """``torch.utils.checkpoint.checkpoint`` whose recompute also runs inside ``scope()`` (non-reentrant only:
    a reentrant checkpoint takes no recompute context, and would recompute without the bias)."""

    def checkpoint(function: Callable[..., Any], *args: Any, use_reentrant: bool | None = None, context_fn: Any = None, **kwargs: Any):
        if use_reentrant is not False:
            raise RuntimeError(
                f"attention: {PROPORTIONAL!r} needs non-reentrant gradient checkpointing (use_reentrant=False) inside a routed "
                "forward: a reentrant checkpoint recomputes its blocks in the backward without the routed step's attention bias"
            )

        def contexts() -> tuple[AbstractContextManager, AbstractContextManager]:
            forward, recompute = context_fn() if context_fn is not None else (nullcontext(), nullcontext())
            return forward, _both(recompute, scope())

        return original(function, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    return checkpoint


@contextmanager
def routed_attention_scope(
    owner: Any, name: str, biased: Callable[[Callable[..., Any]], Callable[..., Any]], checkpoint_owners: Sequence[Any] = ()
) -> Iterator[None]:
    """For one routed forward: ``owner.name`` (the host's attention function, looked up at call time) replaced by
    ``biased(original)``, and ``checkpoint`` on ``torch.utils.checkpoint`` and on each of ``checkpoint_owners`` (a
    host module that imported the function by name) replaced by :func:`recomputing_checkpoint`, so blocks a
    checkpoint recomputes in the backward get the same bias. Everything is restored on exit, also on an exception."""
    original = getattr(owner, name)

    def scope() -> AbstractContextManager:
        return swap_attr(owner, name, biased(original))

    with ExitStack() as stack:
        for handle in (torch.utils.checkpoint, *checkpoint_owners):
            stack.enter_context(swap_attr(handle, "checkpoint", recomputing_checkpoint(handle.checkpoint, scope)))
        stack.enter_context(scope())
        yield


def require_proportional(host: str, family: str, supported: Sequence[str], elsewhere: str = "") -> None:
    """Raise ValueError unless ``family`` (an architecture on ``host``) has a joint attention the bias can be added to;
    the message names the key, the value, the family, the families that take it (``supported``) and ``elsewhere``."""
    if family not in supported:
        where = f"; {elsewhere}" if elsewhere else ""
        raise ValueError(
            f"attention: {PROPORTIONAL!r} is not available for {family} on {host} (supported: {', '.join(supported) or 'none'}{where}); "
            f"use attention = {ATTENTIONS[0]!r}"
        )
