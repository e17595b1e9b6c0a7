"""``python -m downscale_plugin snr``: FasterDiT's log-SNR PDF for native and routed steps.

Routes and host knobs are read like ``plan`` reads them (``--config_file`` training TOML or
``--config`` plugin TOML; each knob: flag, else the training TOML, else sd-scripts' default for the
arch). Data stds are measured on real latents: a directory of cached sd-scripts ``.npz`` files
(``--latents``) or the lab corpus (``--lab``). Prints each route's std ratio, log-SNR offset and
effective shift, and writes a PNG.
"""

from __future__ import annotations

import argparse

from ..cli import HostArgs, add_config_arguments, add_host_sampler_arguments, fail, host_sampler, load_cli_config, register
from ..config import ARCH_NAMES, ConfigError
from ..grid import get_arch
from .latent_stds import HOST_LATENT_SCALE, lab_latents, measure_stds, npz_latents
from .policies import POLICIES
from .snr_report import build_report, format_report, plot_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    data = parser.add_mutually_exclusive_group(required=True)
    data.add_argument("--latents", metavar="DIR", help="directory of cached sd-scripts latents (*.npz, keys latents[_HxW])")
    data.add_argument("--lab", action="store_true", help="the lab corpus (downscale_plugin.lab.data)")
    parser.add_argument("--max_files", type=int, help="read at most this many .npz files (sorted by path)")
    parser.add_argument("--lab_per_bucket", type=int, default=16, help="lab crops per bucket (default 16)")
    parser.add_argument(
        "--latent_scale",
        type=float,
        help="factor the trainer applies to cached latents (default: the arch's shift_scale_latents factor, "
        + ", ".join(f"{k} {v:g}" for k, v in HOST_LATENT_SCALE.items())
        + ", else 1; the lab: 1)",
    )
    add_host_sampler_arguments(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--sigma_policy", choices=POLICIES, default="keep", help="σ policy of routed steps in the mixture curve")
    out.add_argument("--samples", type=int, default=200_000, help="Monte-Carlo σ draws (default 200000)")
    out.add_argument("--bins", type=int, default=160)
    out.add_argument("--seed", type=int, default=0)
    out.add_argument("--out", default="snr_pdf.png", help="PNG path (default snr_pdf.png)")


def run(args: argparse.Namespace) -> int:
    try:
        cfg, toml, path = load_cli_config(args)
        arch_name = args.arch or cfg.arch
        if arch_name is None:
            raise ConfigError([f"arch: unknown; pass --arch or set arch in the config (allowed: {', '.join(ARCH_NAMES)})"])
        sampler, sampler_text = host_sampler(arch_name, HostArgs(args, toml))
        arch = get_arch(arch_name)
        if args.lab:
            source, source_text = lab_latents(args.lab_per_bucket, args.seed), f"lab corpus, {args.lab_per_bucket} per bucket"
            default_scale = 1.0
        else:
            source, source_text = npz_latents(args.latents, args.max_files), args.latents
            default_scale = HOST_LATENT_SCALE.get(arch_name, 1.0)
        scale = default_scale if args.latent_scale is None else args.latent_scale
        stds = measure_stds(source, cfg.routes, arch, cfg.tier_tolerance, scale)
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


register("snr", "FasterDiT's log-SNR PDF (data std included) for native and routed steps; summary + PNG", add_arguments, run)
