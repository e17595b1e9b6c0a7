"""The running sd-scripts trainer, as the network module finds it: its frame, record, σ family, handles.

The trainer instance is never passed to the network module; it is the ``self`` of
``NetworkTrainer.train`` in the caller frames (the class may live in ``__main__``, so the plugin
never imports ``train_network``).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from ...arch import get_arch
from ...attention import PROPORTIONAL
from ...config import DownscaleConfig
from .attention import attention_scope
from .attention import refuse_unsupported as refuse_attention
from .facts import LOSS_HANDLE, SUPPORTED, HostError, TrainerArch, trainer_arch
from .families import DDPMFamily, FlowFamily, HostSampler, SamplerFamily
from .hook import StepOptions


@dataclass(frozen=True)
class TrainerContext:
    """What ``NetworkTrainer.train``'s frame holds when it calls the network module (``train_network.py``, between building the datasets and ``prepare_network``).

    ``frame`` is that frame itself, read again at the first train step for the loop's position
    (``resume.py``); ``current_step`` is the loop's multiprocessing Value, set to ``global_step``
    every step; ``dataset_group`` is ``train_dataset_group`` (deleted from the frame later).
    """

    trainer: Any
    args: Any
    accelerator: Any
    weight_dtype: Any
    current_step: Any
    dataset_group: Any
    frame: Any = None


def find_trainer() -> TrainerContext | None:
    """The nearest caller frame that is a sd-scripts trainer's ``train`` (duck-typed), else None."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            me = frame.f_locals.get("self") if frame.f_code.co_name == "train" else None
            if callable(getattr(me, "process_batch", None)) and callable(getattr(me, "get_noise_pred_and_target", None)):
                loc = frame.f_locals
                return TrainerContext(
                    me,
                    loc.get("args"),
                    loc.get("accelerator"),
                    loc.get("weight_dtype"),
                    loc.get("current_step"),
                    loc.get("train_dataset_group"),
                    frame,
                )
            frame = frame.f_back
        return None
    finally:
        del frame


def detect_arch(trainer: Any, args: Any) -> TrainerArch:
    return trainer_arch(trainer, getattr(args, "model_type", None))


def make_family(record: TrainerArch) -> SamplerFamily:
    """The σ sampler family of an architecture, bound to the host's module (the one the trainer uses)."""
    module_name, contract = record.sampler
    try:
        module = importlib.import_module(module_name)
        return DDPMFamily(module) if contract == "ddpm" else FlowFamily(module, contract)
    except (ImportError, AttributeError) as err:
        raise HostError(f"{record.arch}: missing hook point: {err}; {SUPPORTED}") from err


def plan_sampler(ctx: TrainerContext, family: SamplerFamily) -> HostSampler:
    """The run's σ sampler as ``plan`` draws it (``sample(n, latent_hw, generator)``): the family on the trainer's own scheduler, on the CPU."""
    scheduler = ctx.trainer.get_noise_scheduler(ctx.args, torch.device("cpu"))
    return HostSampler(family, ctx.args, scheduler, ctx.weight_dtype or torch.float32)


def _handle_module(arch: str, name: str, attr: str) -> ModuleType:
    try:
        module = importlib.import_module(name)
    except ImportError as err:
        raise HostError(f"{arch}: missing hook point: {err}; {SUPPORTED}") from err
    if not callable(getattr(module, attr, None)):
        raise HostError(f"{arch}: missing hook point: {name}.{attr}; {SUPPORTED}")
    return module


def step_options(cfg: DownscaleConfig, record: TrainerArch) -> StepOptions:
    """The run's routed-step options bound to this host's handles (imported only when an option needs them)."""
    handles: dict[str, Any] = {}
    if cfg.fasterdit.direction_loss_weight:
        handles["loss_module"] = _handle_module(record.arch, *LOSS_HANDLE)
    if cfg.fasterdit.positions == "interpolate":
        handles["positions_arch"] = get_arch(record.arch)
        if record.positions_handle is not None:
            handles["positions_module"] = _handle_module(record.arch, *record.positions_handle)
    if cfg.fasterdit.attention == PROPORTIONAL:
        try:
            refuse_attention(record.arch)
            handles["attention_scope"] = attention_scope()
        except (ValueError, ImportError, AttributeError) as err:
            raise HostError(f"{err}; {SUPPORTED}") from err
    try:
        return StepOptions.from_config(cfg, **handles)
    except ValueError as err:
        raise HostError(str(err)) from err
