"""The FLOP model of one sd-scripts run: the architecture's preset at the run's own text lengths,
LoRA rank and gradient checkpointing (``downscale_plugin/flops.py``).

The presets assume the trainers' default text lengths; a run with ``--t5xxl_max_token_length 32``
spends a different share of its step on text, and so saves a different share by routing. The
plan, the start banner and ``ss_downscale_counts`` all read :func:`run_flops`, so they agree.
"""

from __future__ import annotations

from typing import Any

from ...arch import get_arch
from ...flops import BUILDERS, FlopModel, StepFlops, arch_flops
from .facts import BY_ARCH

SCHNELL_T5_TOKENS = 256  # flux_train_network: t5xxl_max_token_length defaults to 256 for schnell, 512 otherwise
DEFAULT_RANK = 4  # the inner modules' network_dim when --network_dim is not given (networks/lora_flux.py and siblings)


def _length(args: Any, name: str, default: int) -> int:
    value = getattr(args, name, None)
    return int(value) if value is not None else default


def text_shape(arch: str, args: Any, trainer: Any = None) -> dict[str, int]:
    """The FLOP builder's text keywords for this run: each of the record's ``text_lengths`` from the
    trainer's own length argument, else its default (Flux schnell, which the Flux trainer marks
    ``is_schnell``, defaults its T5 length to 256)."""
    schnell = getattr(trainer, "is_schnell", False)
    return {
        keyword: _length(args, name, SCHNELL_T5_TOKENS if schnell and name == "t5xxl_max_token_length" else default)
        for keyword, name, default in BY_ARCH[arch].text_lengths
    }


def run_flops(arch: str, args: Any, trainer: Any = None, *, reduced: bool = False) -> FlopModel | StepFlops | None:
    """The run's FLOP model: the preset's builder at the run's text lengths, ``--network_dim`` and
    ``--gradient_checkpointing``; architectures without a builder keep their coarse preset."""
    if arch not in BUILDERS:
        return get_arch(arch).flops
    run = {"lora_rank": _length(args, "network_dim", DEFAULT_RANK), "checkpointing": bool(getattr(args, "gradient_checkpointing", False))}
    return arch_flops(arch, reduced=reduced, **text_shape(arch, args, trainer), **run)
