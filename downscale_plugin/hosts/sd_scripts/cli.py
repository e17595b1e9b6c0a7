"""sd-scripts' part of the commands: its training TOML, σ samplers, buckets and latent caches.

``plan`` and ``snr`` reproduce what the trainer will draw: each knob comes from the flag, else the
training TOML, else the trainer's default for the architecture (:class:`~.facts.TrainerArch`).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ...arch import get_arch
from ...cli import HostArgs, HostPart, PlanInputs, register_host
from ...config import ConfigError
from ...fasterdit.cli import LatentSource, register_latent_source
from ...plan import Sampler
from ...sigma import CLOSED_FORM_MODES, DENSITY_SCHEMES, DdpmSampler, SigmaSampler
from ..kohya.conventions import config_from_command_line, config_from_training_toml
from ..kohya.selfcheck import warned
from .buckets import sd_scripts_buckets
from .facts import ARCHS, BY_ARCH
from .flop_args import run_flops
from .startup import command_line_drift, command_line_refusals

SAMPLER_KNOBS = (
    "timestep_sampling",
    "sigmoid_scale",
    "discrete_flow_shift",
    "weighting_scheme",
    "logit_mean",
    "logit_std",
    "mode_scale",
    "training_shift",
    "min_timestep",
    "max_timestep",
)


def _density(host: HostArgs) -> dict[str, Any]:
    """The scheduler-grid path's density knobs (``compute_density_for_timestep_sampling``)."""
    scheme = host.get("weighting_scheme", "uniform")
    if scheme not in DENSITY_SCHEMES:
        raise ConfigError([f"weighting_scheme: {scheme!r} is not allowed (allowed: {', '.join(DENSITY_SCHEMES)})"])
    return {
        "weighting_scheme": scheme,
        "logit_mean": host.get("logit_mean", 0.0, float),
        "logit_std": host.get("logit_std", 1.0, float),
        "mode_scale": host.get("mode_scale", 1.29, float),
    }


def host_sampler(arch: str, host: HostArgs) -> tuple[Sampler, str]:
    """The σ sampler the arch's sd-scripts trainer uses with these knobs, and a description."""
    record = BY_ARCH[arch]
    contract = record.sampler[1]
    if contract == "ddpm":
        lo, hi = host.get("min_timestep", 0, int), host.get("max_timestep", 1000, int)
        return DdpmSampler(lo, hi), f"DDPM t uniform on [{lo}, {hi}) as flow σ (equal SNR, exact)"
    if contract == "sd3":
        # SD3 draws u from the density, shifts it and floors to t/1000; the shifted scheduler grid
        # (σ from 1 − u) has the same law within one 1/1000 step for densities symmetric about ½.
        knobs = _density(host)
        shift = host.get("training_shift", 1.0, float)
        sampler = SigmaSampler(mode="sigma", discrete_flow_shift=shift, **knobs)
        return sampler, f"{knobs['weighting_scheme']} density, training_shift {shift:g} (Monte Carlo, 1000-step grid)"
    mode_default, shift_default = record.default_sampling
    mode = host.get("timestep_sampling", mode_default)
    if mode == "nextdit_shift":
        raise ConfigError(
            ["timestep_sampling: 'nextdit_shift' is not modelled by plan (modelled: uniform, sigmoid, shift, flux_shift, sigma)"]
        )
    if mode in CLOSED_FORM_MODES:
        scale = host.get("sigmoid_scale", 1.0, float) if mode != "uniform" else 1.0
        shift = host.get("discrete_flow_shift", shift_default, float) if mode == "shift" else shift_default
        text = {
            "uniform": "uniform",
            "sigmoid": f"sigmoid (scale {scale:g})",
            "shift": f"shift (scale {scale:g}, shift {shift:g})",
            "flux_shift": f"flux_shift (scale {scale:g}, μ from each bucket's tokens)",
        }[mode]
        return SigmaSampler(mode=mode, sigmoid_scale=scale, discrete_flow_shift=shift), text
    knobs = _density(host)
    shift = host.get("discrete_flow_shift", shift_default, float)
    text = f"{mode}: {knobs['weighting_scheme']} density on the shift-{shift:g} scheduler grid (Monte Carlo)"
    return SigmaSampler(mode=mode, discrete_flow_shift=shift, **knobs), text


def _resolution(value: Any) -> tuple[int, int]:
    """sd-scripts' ``resolution``: ``"W,H"`` or one edge."""
    parts = [p for p in str(value).replace(" ", "").split(",") if p] if not isinstance(value, (list, tuple)) else list(value)
    try:
        edges = [int(p) for p in parts]
    except ValueError:
        edges = []
    if len(edges) not in (1, 2) or min(edges) <= 0:
        raise ConfigError([f"resolution: {value!r} must be 'SIZE' or 'WIDTH,HEIGHT' in pixels"])
    return (edges[0], edges[-1])


def _bucket(text: str) -> tuple[int, int, float]:
    """``WxH[:WEIGHT]`` in pixels."""
    size, _, weight = text.partition(":")
    w, sep, h = size.lower().partition("x")
    try:
        out = (int(w), int(h), float(weight) if weight else 1.0)
    except ValueError:
        out = None
    if not sep or out is None or min(out[:2]) <= 0 or out[2] < 0:
        raise ConfigError([f"--bucket: {text!r} must be WIDTHxHEIGHT[:WEIGHT] in pixels, e.g. 1024x768 or 1024x768:3"])
    return out


def add_sampler_arguments(parser: argparse.ArgumentParser) -> None:
    """The trainer's σ-sampler options, each overriding the training TOML's value."""
    host = parser.add_argument_group("host σ sampler (default: the training TOML, else sd-scripts' default for the arch)")
    host.add_argument("--timestep_sampling", help=f"flow trainers' σ sampler ({', '.join(CLOSED_FORM_MODES)}, sigma, ...)")
    host.add_argument("--weighting_scheme", choices=DENSITY_SCHEMES, help="density of the scheduler-grid path / SD3")
    for name in ("sigmoid_scale", "discrete_flow_shift", "logit_mean", "logit_std", "mode_scale", "training_shift"):
        host.add_argument(f"--{name}", type=float)
    for name in ("min_timestep", "max_timestep"):
        host.add_argument(f"--{name}", type=int, help="SD1.x/SDXL timestep range")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``plan``'s host options: the σ sampler, batches, buckets and the run length."""
    add_sampler_arguments(parser)
    data = parser.add_argument_group("batches and buckets")
    data.add_argument("--batch_size", type=int, help="train_batch_size (default 1)")
    data.add_argument("--resolution", help="SIZE or WIDTH,HEIGHT in pixels (default 1024, sd1 512)")
    data.add_argument("--enable_bucket", action="store_true", default=None, help="aspect-ratio buckets as sd-scripts builds them")
    data.add_argument("--min_bucket_reso", type=int, help="default 256")
    data.add_argument("--max_bucket_reso", type=int, help="default 1024")
    data.add_argument("--bucket_reso_steps", type=int, help="default 64")
    data.add_argument(
        "--bucket", action="append", metavar="WxH[:WEIGHT]", help="bucket in pixels (repeatable); replaces the generated list"
    )
    steps = parser.add_argument_group("spans")
    steps.add_argument("--max_train_steps", type=int)
    steps.add_argument("--gradient_accumulation_steps", type=int)


def _buckets(args: argparse.Namespace, host: HostArgs, arch: str) -> tuple[list[tuple[int, int]], list[float], str]:
    """Latent (h, w) buckets, their weights, and a line saying where they came from."""
    spec = get_arch(arch)
    if args.bucket:
        parsed = [_bucket(b) for b in args.bucket]
        note = f"{len(parsed)} bucket(s) from --bucket"
    else:
        res = _resolution(host.get("resolution", 512 if arch == "sd1" else 1024))
        if host.get("enable_bucket", False, bool):
            lo, hi = host.get("min_bucket_reso", 256, int), host.get("max_bucket_reso", 1024, int)
            step = host.get("bucket_reso_steps", 64, int)
            if lo <= 0 or step <= 0 or hi < lo:
                raise ConfigError(
                    [f"buckets: need 0 < min_bucket_reso ({lo}) <= max_bucket_reso ({hi}) and bucket_reso_steps ({step}) > 0"]
                )
            parsed = [(w, h, 1.0) for w, h in sd_scripts_buckets(res, lo, hi, step)]
            note = f"{len(parsed)} sd-scripts buckets for {res[0]}x{res[1]} (min {lo}, max {hi}, steps {step}), equal weights"
        else:
            parsed = [(res[0], res[1], 1.0)]
            note = f"one bucket {res[0]}x{res[1]} (enable_bucket is off)"
    bad = [f"{w}x{h}" for w, h, _ in parsed if w % spec.vae_factor or h % spec.vae_factor]
    if bad:
        raise ConfigError([f"buckets {', '.join(bad)}: sides must be multiples of {arch}'s VAE factor {spec.vae_factor}"])
    return [(h // spec.vae_factor, w // spec.vae_factor) for w, h, _ in parsed], [wt for *_, wt in parsed], note


def plan_inputs(args: argparse.Namespace, host: HostArgs, arch: str) -> PlanInputs:
    sampler, sampler_text = host_sampler(arch, host)
    batch_size = host.get("batch_size", 1, int, toml_key="train_batch_size")
    buckets, weights, note = _buckets(args, host, arch)
    total = host.get("max_train_steps", 0, int) * host.get("gradient_accumulation_steps", 1, int)
    flops = run_flops(arch, argparse.Namespace(**host.toml))  # the training TOML's text lengths, network_dim, checkpointing
    return PlanInputs(sampler, sampler_text, buckets, weights, note, batch_size, total, (*SAMPLER_KNOBS, "batch_size"), flops)


# The trainer's latent cache keys: "latents", or "latents_{H}x{W}" for multi-resolution caches. The
# "latents_flipped*" arrays are mirror images of the same latents (same std) and are skipped.
_LATENT_KEY = re.compile(r"latents(_\d+x\d+)?")


def npz_latents(directory: str, limit: int | None = None) -> Iterator[torch.Tensor]:
    """Every cached latent (C, H, W) or (C, T, H, W) under ``directory`` (recursive), file order sorted."""
    paths = sorted(os.path.join(root, name) for root, _, names in os.walk(directory) for name in names if name.endswith(".npz"))
    if not paths:
        raise FileNotFoundError(f"--latents: no .npz files under {directory}")
    for path in paths[:limit]:
        with np.load(path) as npz:
            for key in npz.files:
                if _LATENT_KEY.fullmatch(key):
                    yield torch.from_numpy(np.asarray(npz[key], dtype=np.float32))


def _add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max_files", type=int, help="read at most this many .npz files (sorted by path)")


register_latent_source(
    LatentSource(
        flag="latents",
        help="directory of cached sd-scripts latents (*.npz, keys latents[_HxW]); scaled by the trainer's shift_scale_latents factor",
        metavar="DIR",
        add_arguments=_add_cache_arguments,
        read=lambda args, host, arch: (npz_latents(args.latents, args.max_files), args.latents, host.latent_scale(arch)),
    )
)


def read_command_line(argv: list[str]) -> tuple[Any, dict[str, Any]]:
    """``check -- SCRIPT ...``: the command line's config (:func:`config_from_command_line`), what the script's
    architecture refuses of it (``startup.command_line_refusals``), then the drift
    self-check of the sd-scripts checkout it runs, where importable (``selfcheck.py``; ``host_check = "warn"`` logs its
    findings instead); ConfigError lists every problem."""
    cfg, merged = config_from_command_line(argv)
    problems = command_line_refusals(argv, cfg, merged) + warned(command_line_drift(argv), cfg.host_check)
    if problems:
        raise ConfigError(problems)
    return cfg, merged


register_host(
    HostPart(
        name="sd_scripts",
        archs=ARCHS,
        read_training_config=config_from_training_toml,
        add_sampler_arguments=add_sampler_arguments,
        add_arguments=add_arguments,
        sampler=host_sampler,
        plan_inputs=plan_inputs,
        latent_scale=lambda arch: BY_ARCH[arch].latent_scale,
        read_command_line=read_command_line,
    )
)
