"""FasterDiT's direction loss, added to the host's elementwise loss through a scoped wrap.

FasterDiT (Yao et al. 2024, arXiv:2410.10356) supervises the direction of the predicted velocity as well as its
value: per token, 1 − cos(pred, target) over channels. The plugin adds λ times that term to the
host's loss without touching the host's reduction, so weighting, masks, ``loss_weights`` and
``post_process_loss`` apply to it exactly as they do to the elementwise loss.

Arithmetic. sd-scripts' ``process_batch`` computes ``l = conditional_loss(pred, target, loss_type,
"none", huber_c)`` of shape (B, C, *S), multiplies by ``weighting`` (B, 1, ...), applies the mask,
then takes the mean over every non-batch dim. The wrap returns ``l + λ·d`` with d = 1 − cos of shape
(B, 1, *S), broadcast to every channel. The mean over C·|S| elements of a term that is constant over
C is its mean over S, so the per-sample loss grows by exactly λ·mean_S(1 − cos): no 1/C factor. The
host's weighting and mask multiply that term like the rest (with ``weighting`` ≡ 1 and no mask, the
increase is exactly λ·mean_S(1 − cos)).

The host calls the function as a module attribute (``train_util.conditional_loss`` in
``NetworkTrainer.process_batch``), so replacing the attribute for the duration of one
``process_batch`` call changes that call and nothing else. λ = 0 replaces nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from ..scope import swap_attr

LOSS_ATTR = "conditional_loss"


def direction_term(model_pred: torch.Tensor, target: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Per position 1 − cos over channels (dim 1), kept as a size-1 channel dim: (B, 1, *S)."""
    return (1.0 - F.cosine_similarity(model_pred, target, dim=1, eps=eps)).unsqueeze(1)


def with_direction_term(
    loss_fn: Callable[..., torch.Tensor], weight: float, gate: Callable[[], bool] | None = None
) -> Callable[..., torch.Tensor]:
    """``loss_fn`` (elementwise, host signature ``(model_pred, target, ...)``) plus λ·(1 − cos).

    ``gate`` is read at every call (e.g. "this step was routed"); when it says no, the host's
    result is returned untouched.
    """

    def loss(model_pred: torch.Tensor, target: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = loss_fn(model_pred, target, *args, **kwargs)
        if gate is not None and not gate():
            return out
        if out.shape != model_pred.shape:
            raise ValueError(
                f"direction_loss_weight needs the elementwise loss (reduction 'none'), got shape {tuple(out.shape)} "
                f"for a prediction of shape {tuple(model_pred.shape)}"
            )
        return out + weight * direction_term(model_pred, target)

    return loss


def direction_loss_scope(
    module: Any, weight: float, *, gate: Callable[[], bool] | None = None, attr: str = LOSS_ATTR
) -> AbstractContextManager:
    """Context manager: ``module.<attr>`` adds λ·(1 − cos) inside the block; restored on exit.

    ``module`` is the host's ``library.train_util`` (or the lab trainer's module). ``weight = 0``
    returns a null context: nothing is wrapped and the loss is bitwise the host's.
    """
    if weight == 0:
        return nullcontext()
    if weight < 0:
        raise ValueError(f"direction_loss_weight: {weight} must be >= 0")
    return swap_attr(module, attr, with_direction_term(getattr(module, attr), weight, gate))
