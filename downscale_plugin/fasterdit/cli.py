"""``python -m downscale_plugin snr``: FasterDiT's log-SNR PDF for native and routed steps.

Routes and host knobs are read like ``plan`` reads them (``--config_file`` training TOML or
``--config`` plugin TOML; each knob: flag, else the training TOML, else the trainer's default for
the arch). Data stds are measured on real latents from a source a host package registers
(:func:`register_latent_source`: a trainer's latent cache, the lab corpus). Prints each route's std
ratio, log-SNR offset and effective shift, and writes a PNG.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..arch import get_arch
from ..cli import (
    HostArgs,
    HostPart,
    add_arch_argument,
    add_config_arguments,
    fail,
    host_part,
    load_cli_config,
    register,
    resolve_arch,
)
from ..config import ConfigError
from .policies import POLICIES


@dataclass(frozen=True)
class LatentSource:
    """Where ``snr`` reads latents: ``--<flag>`` in the command's source group plus its own options.

    ``read(args, host, arch)`` → (latents, a description, the scale the trainer applies to them).
    """

    flag: str
    help: str
    metavar: str | None
    add_arguments: Callable[[argparse.ArgumentParser], None]
    read: Callable[[argparse.Namespace, HostPart, str], tuple[Iterable[torch.Tensor], str, float]]


LATENT_SOURCES: dict[str, LatentSource] = {}


def register_latent_source(source: LatentSource) -> None:
    if source.flag in LATENT_SOURCES:
        raise ValueError(f"latent source --{source.flag} is already registered")
    LATENT_SOURCES[source.flag] = source


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_arch_argument(parser)
    data = parser.add_mutually_exclusive_group(required=True)
    for source in LATENT_SOURCES.values():
        if source.metavar is None:
            data.add_argument(f"--{source.flag}", action="store_true", help=source.help)
        else:
            data.add_argument(f"--{source.flag}", metavar=source.metavar, help=source.help)
        source.add_arguments(parser)
    parser.add_argument("--latent_scale", type=float, help="factor the trainer applies to cached latents (default: the source's)")
    out = parser.add_argument_group("output")
    out.add_argument("--sigma_policy", choices=POLICIES, default="keep", help="σ policy of routed steps in the mixture curve")
    out.add_argument("--samples", type=int, default=200_000, help="Monte-Carlo σ draws (default 200000)")
    out.add_argument("--bins", type=int, default=160)
    out.add_argument("--seed", type=int, default=0)
    out.add_argument("--out", default="snr_pdf.png", help="PNG path (default snr_pdf.png)")


def run(args: argparse.Namespace) -> int:
    from .latent_stds import measure_stds
    from .snr_report import build_report, format_report, plot_report

    host = host_part(args)
    try:
        cfg, toml, path = load_cli_config(args)
        arch_name = resolve_arch(args, cfg, host)
        sampler, sampler_text = host.sampler(arch_name, HostArgs(args, toml))
        arch = get_arch(arch_name)
        source = next(s for s in LATENT_SOURCES.values() if getattr(args, s.flag))
        latents, source_text, default_scale = source.read(args, host, arch_name)
        scale = default_scale if args.latent_scale is None else args.latent_scale
        stds = measure_stds(latents, cfg.routes, arch, cfg.tier_tolerance, scale)
        report = build_report(stds, sampler, arch, args.sigma_policy, args.samples, args.bins, args.seed)
    except ConfigError as err:
        return fail(err.problems)
    except (OSError, ValueError) as err:
        return fail([str(err)])
    print(f"config: {path}")
    print(format_report(report, stds, sampler_text, f"{source_text} (× {scale:g})"))
    plot_report(report, args.out)
    print(f"wrote {args.out}")
    return 0


register(
    "snr",
    "FasterDiT's log-SNR PDF (data std included) for native and routed steps; summary + PNG",
    add_arguments,
    run,
    host_arguments=lambda parser, part: part.add_sampler_arguments(parser),  # the selected host's σ-sampler options
)
