"""Command line of downscale-plugin: check and plan here; other modules register more commands.

A command is one :func:`register` call (name, help, add_arguments, run) made when its module is
imported; list that module in :data:`EXTENSIONS` and ``main`` imports it before parsing.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .config import ARCH_NAMES, ConfigError, DownscaleConfig, config_from_training_toml, load_config, read_plugin_toml
from .grid import get_arch, sd_scripts_buckets
from .plan import DdpmSampler, Sampler, format_plan, plan_table
from .sigma import CLOSED_FORM_MODES, DENSITY_SCHEMES, SigmaSampler


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}

# Command name → the module whose import registers it. These need the ``lab`` extra; when it is not
# installed (a bare sd-scripts environment) the command stays listed and says what to install.
EXTENSIONS: dict[str, str] = {
    "demo": "downscale_plugin.lab.demo",
    "snr": "downscale_plugin.fasterdit.cli",
    "map": "downscale_plugin.mapping.cli",
}


def register(
    name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None], run: Callable[[argparse.Namespace], int]
) -> None:
    """Add a subcommand; ``run`` returns the exit code."""
    if name in COMMANDS:
        raise ValueError(f"command {name!r} is already registered")
    COMMANDS[name] = Command(help, add_arguments, run)


def fail(problems: Sequence[str]) -> int:
    print(f"downscale_plugin: {len(problems)} problem(s):", file=sys.stderr)
    for p in problems:
        print(f"  - {p}", file=sys.stderr)
    return 2


# -- config -------------------------------------------------------------------------------------


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--config_file", metavar="TRAIN_TOML", help="sd-scripts training TOML ([plugins.downscale] and/or network_args)")
    group.add_argument("--config", metavar="PLUGIN_TOML", help="plugin TOML, the plugin's keys at top level")


def load_cli_config(args: argparse.Namespace) -> tuple[DownscaleConfig, dict[str, Any], str]:
    """(config, flattened training TOML or {}, the path read)."""
    if args.config_file:
        cfg, host = config_from_training_toml(args.config_file)
        return cfg, host, args.config_file
    data = read_plugin_toml(args.config)
    return load_config(plugin_toml=data, base_dir=os.path.dirname(os.path.abspath(args.config))), {}, args.config


def _routes_text(cfg: DownscaleConfig) -> list[str]:
    lines = [f"  {'#':<4}{'route':<14}{'window':<16}{'span':<12}name"]
    for i, r in enumerate(cfg.routes):
        route = f"{r.native}:{r.target}" if r.native else f"x{r.scale:g}"
        lines.append(f"  r{i:<3}{route:<14}{r.window_text():<16}{str(r.span or '-'):<12}{r.name}".rstrip())
    return lines


def _run_check(args: argparse.Namespace) -> int:
    try:
        cfg, _, path = load_cli_config(args)
    except ConfigError as err:
        return fail(err.problems)
    sources = ", ".join(cfg.sources) or "defaults"
    print(f"config OK: {path} (sources, highest first: {sources})")
    seed = cfg.seed if cfg.seed is not None else "the run's --seed"
    print(
        f"  enable {str(cfg.enable).lower()}, gate {cfg.gate}, seed {seed}, max_tries {cfg.max_tries}, "
        f"tier_tolerance {cfg.tier_tolerance:g}, arch {cfg.arch or 'auto'}, inner {cfg.inner or 'auto'}"
    )
    print(
        f"  direction_loss_weight {cfg.direction_loss_weight:g}, direction_loss_only_routed {str(cfg.direction_loss_only_routed).lower()}, "
        f"sigma_policy {cfg.sigma_policy}, positions {cfg.positions}"
    )
    if cfg.mode == "map":
        print(
            f"  mode map: map_out {cfg.map_out}, after_map {cfg.after_map}, ratios {', '.join(f'{r:g}' for r in cfg.map_ratios)}, "
            f"bins {cfg.map_bins}, draws {cfg.map_draws}, images {cfg.map_images}, margin {cfg.map_margin:g}"
            f"{', Bonferroni' if cfg.map_simultaneous else ''}; the routes come from the map"
        )
    else:
        print("\n".join(_routes_text(cfg)))
    if not cfg.enable:
        print("  routing is off (enable = false): every step runs native")
    return 0


# -- plan ---------------------------------------------------------------------------------------

# sd-scripts' per-trainer defaults: (timestep_sampling, discrete_flow_shift).
_FLOW_DEFAULTS = {
    "flux": ("sigma", 3.0),
    "chroma": ("sigma", 3.0),
    "lumina": ("shift", 6.0),
    "anima": ("sigmoid", 1.0),
    "hunyuan_image": ("sigma", 5.0),
}
_SAMPLER_KNOBS = (
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


class HostArgs:
    """Host knobs: flag, else training TOML, else the default; remembers each value and its origin."""

    def __init__(self, args: argparse.Namespace, toml: Mapping[str, Any]):
        self.args = args
        self.toml = toml
        self.used: dict[str, tuple[Any, str]] = {}

    def get(self, name: str, default: Any, kind: type = str, toml_key: str | None = None) -> Any:
        key = toml_key or name
        value, origin = getattr(self.args, name, None), "flag"
        if value is None and self.toml.get(key) is not None:
            value, origin = self.toml[key], "toml"
            ok = isinstance(value, bool) if kind is bool else not isinstance(value, bool)
            try:
                value = kind(value) if ok else None
            except (TypeError, ValueError):
                value = None
            if value is None:
                raise ConfigError([f"{key}: {self.toml[key]!r} in the training TOML is not a {kind.__name__}"])
        if value is None:
            value, origin = default, "default"
        self.used[name] = (value, origin)
        return value

    def text(self, names: Sequence[str]) -> str:
        return ", ".join(f"{n} {self.used[n][0]} ({self.used[n][1]})" for n in names if n in self.used)


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
    if arch in ("sdxl", "sd1"):
        lo, hi = host.get("min_timestep", 0, int), host.get("max_timestep", 1000, int)
        return DdpmSampler(lo, hi), f"DDPM t uniform on [{lo}, {hi}) as flow σ (equal SNR, exact)"
    if arch == "sd3":
        # SD3 draws u from the density, shifts it and floors to t/1000; the shifted scheduler grid
        # (σ from 1 − u) has the same law within one 1/1000 step for densities symmetric about ½.
        knobs = _density(host)
        shift = host.get("training_shift", 1.0, float)
        sampler = SigmaSampler(mode="sigma", discrete_flow_shift=shift, **knobs)
        return sampler, f"{knobs['weighting_scheme']} density, training_shift {shift:g} (Monte Carlo, 1000-step grid)"
    mode_default, shift_default = _FLOW_DEFAULTS[arch]
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


def add_host_sampler_arguments(parser: argparse.ArgumentParser) -> None:
    """``--arch`` and the host's σ-sampler options, each overriding the training TOML's value."""
    host = parser.add_argument_group("host (default: the training TOML, else sd-scripts' default for the arch)")
    host.add_argument("--arch", choices=ARCH_NAMES, help="architecture (default: the config's arch)")
    host.add_argument("--timestep_sampling", help=f"flow trainers' σ sampler ({', '.join(CLOSED_FORM_MODES)}, sigma, ...)")
    host.add_argument("--weighting_scheme", choices=DENSITY_SCHEMES, help="density of the scheduler-grid path / SD3")
    for name in ("sigmoid_scale", "discrete_flow_shift", "logit_mean", "logit_std", "mode_scale", "training_shift"):
        host.add_argument(f"--{name}", type=float)
    for name in ("min_timestep", "max_timestep"):
        host.add_argument(f"--{name}", type=int, help="SD1.x/SDXL timestep range")


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_host_sampler_arguments(parser)
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
    parser.add_argument("--mc_samples", type=int, default=200_000, help="Monte-Carlo draws per bucket for samplers without a closed form")


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


def _run_plan(args: argparse.Namespace) -> int:
    try:
        cfg, toml, path = load_cli_config(args)
        arch = args.arch or cfg.arch
        if arch is None:
            raise ConfigError([f"arch: unknown; pass --arch or set arch in the config (allowed: {', '.join(ARCH_NAMES)})"])
        host = HostArgs(args, toml)
        sampler, sampler_text = host_sampler(arch, host)
        batch_size = host.get("batch_size", 1, int, toml_key="train_batch_size")
        buckets, weights, bucket_note = _buckets(args, host, arch)
        steps = host.get("max_train_steps", 0, int)
        total = steps * host.get("gradient_accumulation_steps", 1, int)
        if batch_size < 1 or args.mc_samples < 1:
            raise ConfigError([f"batch_size ({batch_size}) and --mc_samples ({args.mc_samples}) must be at least 1"])
    except ConfigError as err:
        return fail(err.problems)
    if not cfg.enable:
        print(f"{path}: routing is off (enable = false): every step runs native")
        return 0
    plan = plan_table(cfg, arch, sampler, buckets, batch_size, weights, total_forwards=total, mc_samples=args.mc_samples)
    print(f"config: {path} (sources: {', '.join(cfg.sources)})")
    print(f"host: {host.text((*_SAMPLER_KNOBS, 'batch_size'))}")
    print(f"buckets: {bucket_note}")
    if any(r.span is not None for r in cfg.routes):
        print(f"spans over {total} train forwards" if total else "spans: as fractions of the run (max_train_steps not given)")
    m = plan.flop_model
    print(
        f"FLOP model: {arch}: hidden {m.hidden}, depth {m.depth}, mlp {m.mlp_ratio:g}, text tokens {m.text_tokens}"
        + ("" if m.attention else ", linear only")
    )
    print(format_plan(plan, sampler_text))
    return 0


register("check", "validate a config and print its routes (exit 2 listing every problem)", add_config_arguments, _run_check)
register("plan", "predict route frequencies and savings for the host's σ sampler and buckets", _add_plan_arguments, _run_plan)


def _missing_extra(name: str, err: ImportError) -> Callable[[argparse.Namespace], int]:
    return lambda args: fail(
        [f"{name}: needs the package {err.name!r} ({err}); install the lab extra: pip install 'downscale-plugin[lab]'"]
    )


def build_parser() -> argparse.ArgumentParser:
    for name, module in EXTENSIONS.items():
        if name in COMMANDS:
            continue
        try:
            importlib.import_module(module)
        except ImportError as err:
            register(name, f"(unavailable: needs {err.name})", lambda parser: None, _missing_extra(name, err))
    parser = argparse.ArgumentParser(prog="python -m downscale_plugin", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        cmd.add_arguments(sub.add_parser(name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command].run(args)
