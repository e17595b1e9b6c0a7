"""The lab's part of the commands: ``demo``, ``lab pretrain``, the ``map --lab`` backend and the ``snr --lab`` corpus.

Nothing here imports the lab's dependencies (diffusers, peft): they load when a command runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ...cli import register
from ...fasterdit.cli import LatentSource, register_latent_source
from ...mapping.arms import Arm
from ...mapping.cli import MapSource, register_source
from . import base_cmd, demo


def _add_map_arguments(group: argparse.ArgumentParser) -> None:
    group.add_argument("--quick", action="store_true", help="use the quick (seconds) lab pretrain instead of the default (minutes, cached)")
    group.add_argument(
        "--lab_base",
        default=None,
        help="measure on a shipped lab base (lab/base.py: multires, pretrained over 96-384 px) instead of the single-size pretrain",
    )
    group.add_argument("--native_size", default="64x64", help="probe latent HxW in lab cells, 4 px each (default 64x64: 1024 tokens)")
    group.add_argument("--rank", type=int, default=4, help="LoRA rank (default 4)")
    group.add_argument("--warm_steps", type=int, default=30, help="native warm-up steps of the adapter (default 30; 0: peft init, B = 0)")
    group.add_argument(
        "--task",
        default="corpus",
        help="what the probes and the adapter's warm-up see: corpus (the pretraining corpus, default) or a concept new to "
        "the base model (lab/concept.py): hatch (hatched posters, detail at the native grid's Nyquist period; "
        "concept is its old name), subject (photographs of one motorcycle), style (photographs under one colour grade "
        "and a 24 px halftone screen)",
    )


def _native_size(text: str) -> tuple[int, int]:
    h, sep, w = text.lower().partition("x")
    if not sep or not h.isdigit() or not w.isdigit():
        raise ValueError(f"native_size: {text!r} must be HxW in latent cells, e.g. 64x64")
    return int(h), int(w)


def _prepare_map(args: argparse.Namespace, arms: Sequence[Arm]) -> tuple[list[str], Any, dict[str, Any], list[str]]:
    from .map_backend import LabBackend, LabMapConfig, describe_config, lab_problems

    try:
        cfg = LabMapConfig(
            quick=args.quick,
            base=args.lab_base,
            native_hw=_native_size(args.native_size),
            rank=args.rank,
            warm_steps=args.warm_steps,
            seed=args.seed,
            task=args.task,
        )
    except ValueError as err:
        return [str(err)], None, {}, []
    words = [
        *(["--quick"] if args.quick else []),
        *([f"--lab_base {args.lab_base}"] if args.lab_base else []),
        f"--native_size {args.native_size}",
        f"--rank {args.rank}",
        f"--warm_steps {args.warm_steps}",
        f"--task {args.task}",
    ]
    build = lambda: LabBackend(cfg, images=args.images, progress=not args.no_progress)  # noqa: E731
    return lab_problems(cfg, arms), build, {"lab": describe_config(cfg)}, words


def lab_latents(per_bucket: int, seed: int = 0) -> Iterator[torch.Tensor]:
    """The lab corpus' held-out crops, ``per_bucket`` per bucket."""
    from ...lab.data import LabData

    for batch in LabData().validation_set(per_bucket=per_bucket, seed=seed):
        yield from batch["latents"]


def _add_corpus_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lab_per_bucket", type=int, default=16, help="lab crops per bucket (default 16)")


register("demo", "train a LoRA on the built-in tiny DiT natively and with the plugin; print the comparison", demo.add_arguments, demo.run)
register("lab", "the built-in lab: pretrain (rerun a shipped base bit for bit, or --check it)", base_cmd.add_arguments, base_cmd.run)
register_source(
    MapSource(
        flag="lab",
        help="measure on the built-in lab DiT",
        add_arguments=_add_map_arguments,
        options=("quick", "lab_base", "native_size", "rank", "warm_steps", "task"),
        prepare=_prepare_map,
    )
)
register_latent_source(
    LatentSource(
        flag="lab",
        help="the lab corpus (downscale_plugin.lab.data), in training scale",
        metavar=None,
        add_arguments=_add_corpus_arguments,
        read=lambda args, host, arch: (lab_latents(args.lab_per_bucket, args.seed), f"lab corpus, {args.lab_per_bucket} per bucket", 1.0),
    )
)
