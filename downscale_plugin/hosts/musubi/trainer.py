"""The running musubi-tuner trainer, as the network module finds it, and what it must offer the hook.

musubi-tuner never hands the trainer to the network module: it is the ``self`` of
``NetworkTrainer._build_network`` in the caller frames, whose caller ``train`` holds the dataset
group (training/trainer_base.py). The plugin never imports a trainer module (a script's class lives in
``__main__``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from .facts import (
    BASE_TRAINER,
    PROCESS_BATCH,
    SAMPLER,
    SAMPLER_METHOD,
    SUPPORTED,
    HostError,
    MusubiArch,
)

BUILD_FRAME = "_build_network"


@dataclass(frozen=True)
class TrainerContext:
    """What ``_build_network``'s frame (and its caller ``train``'s) hold when the network module runs."""

    trainer: Any
    args: Any
    accelerator: Any
    weight_dtype: Any
    dit_dtype: Any
    dataset_group: Any


def _is_trainer(obj: Any) -> bool:
    return all(callable(getattr(obj, name, None)) for name in ("process_batch", SAMPLER_METHOD, "call_dit"))


def find_trainer() -> TrainerContext | None:
    """The nearest caller frame that is a musubi-tuner trainer's ``_build_network`` (duck-typed), else None."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            me = frame.f_locals.get("self") if frame.f_code.co_name == BUILD_FRAME else None
            if _is_trainer(me):
                loc = frame.f_locals
                outer = frame.f_back.f_locals if frame.f_back is not None else {}
                return TrainerContext(
                    me,
                    loc.get("args"),
                    loc.get("accelerator"),
                    loc.get("weight_dtype"),
                    outer.get("dit_dtype"),
                    outer.get("train_dataset_group"),
                )
            frame = frame.f_back
        return None
    finally:
        del frame


def _base_method(trainer: Any, name: str) -> Any:
    for cls in type(trainer).__mro__:
        if cls.__name__ == BASE_TRAINER:
            return vars(cls).get(name)
    return None


def check_methods(trainer: Any) -> None:
    """Refuse a trainer whose hook points differ from the revision the hook was written against: ``process_batch``
    (an extension point with no stability promise) must be ``NetworkTrainer``'s own, and both it and the sampler
    must take the parameters of facts.PROCESS_BATCH / facts.SAMPLER."""
    name = type(trainer).__name__
    base = _base_method(trainer, "process_batch")
    if base is None or type(trainer).process_batch is not base:
        raise HostError(
            f"{name} overrides process_batch: the plugin routes NetworkTrainer's own step (σ draw, call_dit, compute_loss) only; {SUPPORTED}"
        )
    for method, expected in (("process_batch", PROCESS_BATCH), (SAMPLER_METHOD, SAMPLER)):
        found = tuple(inspect.signature(getattr(trainer, method)).parameters)
        if found != expected:
            raise HostError(
                f"{name}.{method}({', '.join(found)}): expected ({', '.join(expected)}); "
                f"this musubi-tuner revision changed the hook point; {SUPPORTED}"
            )


def conditioning(ctx: TrainerContext) -> list[str]:
    """Why this run's batches carry spatial conditioning the plugin would have to resize with the latents (empty: none)."""
    trainer, found = ctx.trainer, []
    if getattr(trainer, "i2v_training", False):
        found.append("image-to-video training (latents_image)")
    if getattr(trainer, "control_training", False):
        found.append("control training (latents_control)")
    if getattr(trainer, "is_edit", False) or getattr(trainer, "is_layered", False):
        found.append("Qwen-Image Edit / Layered (latents_control_*)")
    datasets = getattr(ctx.dataset_group, "datasets", None) or []
    if any(getattr(d, "has_control", False) for d in datasets):
        found.append("a dataset with control images (latents_control_*)")
    return found


def check_run(ctx: TrainerContext, record: MusubiArch, gate: str) -> None:
    """Refuse, at start, runs whose steps the plugin would mis-train."""
    reasons = conditioning(ctx)
    if reasons:
        raise HostError(
            f"{record.arch}: {'; '.join(reasons)}: conditioning latents stay at the native grid while a routed step's latents shrink; "
            "the plugin supports text-to-image/video training only"
        )
    batch_sizes = {int(getattr(d, "batch_size", 1) or 1) for d in getattr(ctx.dataset_group, "datasets", None) or []}
    if getattr(ctx.trainer, "high_low_training", False) and gate == "coupled" and max(batch_sizes, default=1) > 1:
        raise HostError(
            f"{record.arch}: training both Wan 2.2 experts (--dit_high_noise) at batch size {max(batch_sizes)}: the host draws every "
            "sample of a batch on one expert's side of timestep_boundary, which the coupled gate's per-sample redraws do not keep; "
            'use batch size 1, gate = "strict", or train one expert (--min_timestep/--max_timestep)'
        )
