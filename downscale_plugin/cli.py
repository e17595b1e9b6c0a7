"""Command line of downscale-plugin: ``check`` and ``plan`` here; other modules register more commands.

A command is one :func:`register` call (name, help, add_arguments, run) made when its module is
imported; the front door (``downscale_plugin/__main__.py``) imports every such module before it calls
:func:`main`, so this core module names no feature or host. A host
package adds its parts to the commands here the same way: :func:`register_host` gives ``check``
its training-config reader and ``plan`` (and ``snr``) the host's σ samplers and buckets.

Hosts share flag names (``--timestep_sampling``, ``--discrete_flow_shift``, ...) with their own
meanings and choices, so a command's host options are per host: a command registered with
``host_arguments`` gets ``--host``, and :func:`main` reads ``--host`` from the command line first
and builds the parser with that host's options only (``plan --host NAME --help`` lists them).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .arch import ARCH_NAMES
from .config import ConfigError, DownscaleConfig, format_problems, load_config, package_problems, read_plugin_toml
from .plan import Sampler, format_plan, plan_table
from .text import ROUTE_HEADER, fasterdit_text, route_rows


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    host_arguments: Callable[[argparse.ArgumentParser, HostPart], None] | None = None  # the selected host's options


COMMANDS: dict[str, Command] = {}


def register(
    name: str,
    help: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    host_arguments: Callable[[argparse.ArgumentParser, HostPart], None] | None = None,
) -> None:
    """Add a subcommand; ``run`` returns the exit code. ``host_arguments(parser, part)``: the command
    takes ``--host`` and these options of the selected host (only that host's: hosts share flag names)."""
    if name in COMMANDS:
        raise ValueError(f"command {name!r} is already registered")
    COMMANDS[name] = Command(help, add_arguments, _needing_extras(name, run), host_arguments)


def _needing_extras(name: str, run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A missing optional dependency ends the command with what to install, not a traceback."""

    def guarded(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except ImportError as err:
            return fail([f"{name}: needs the package {err.name!r} ({err}); install the lab extra: pip install 'downscale-plugin[lab]'"])

    return guarded


def fail(problems: Sequence[str]) -> int:
    print(format_problems(problems), file=sys.stderr)
    return 2


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


@dataclass(frozen=True)
class PlanInputs:
    """What ``plan`` needs from a host for one run: the σ sampler, the buckets and the batch."""

    sampler: Sampler
    sampler_text: str
    buckets: list[tuple[int, int]]  # latent (h, w)
    weights: list[float]
    bucket_note: str
    batch_size: int
    total_forwards: int
    knobs: tuple[str, ...]  # the host knobs to echo (HostArgs.text)
    flop_model: Any = None  # the run's FLOP model (None: the architecture's preset)


@dataclass(frozen=True)
class HostPart:
    """A host's part of the commands.

    ``read_training_config(path)`` → (config, flattened host args): ``check``/``plan --config_file``;
    ``add_sampler_arguments``: its σ-sampler options (each overriding the training TOML; ``snr``);
    ``add_arguments``: those and its bucket and run-length options (``plan``);
    ``sampler(arch, host)`` → (sampler, description); ``plan_inputs(args, host, arch)``;
    ``latent_scale(arch)``: what the trainer multiplies cached latents by (``snr``);
    ``read_command_line(argv)`` → (config, merged host args): ``check -- TRAINER COMMAND`` (None: not offered);
    ``arch_hint(args)`` → the architecture the host's own options name (musubi-tuner's training script), or None.
    """

    name: str
    archs: tuple[str, ...]
    read_training_config: Callable[[str], tuple[DownscaleConfig, dict[str, Any]]]
    add_sampler_arguments: Callable[[argparse.ArgumentParser], None]
    add_arguments: Callable[[argparse.ArgumentParser], None]
    sampler: Callable[[str, HostArgs], tuple[Sampler, str]]
    plan_inputs: Callable[[argparse.Namespace, HostArgs, str], PlanInputs]
    latent_scale: Callable[[str], float]
    read_command_line: Callable[[Sequence[str]], tuple[DownscaleConfig, dict[str, Any]]] | None = None
    arch_hint: Callable[[argparse.Namespace], str | None] | None = None


HOSTS: dict[str, HostPart] = {}


def register_host(part: HostPart) -> None:
    if part.name in HOSTS:
        raise ValueError(f"host {part.name!r} is already registered")
    HOSTS[part.name] = part


def host_part(args: argparse.Namespace) -> HostPart:
    name = getattr(args, "host", None) or next(iter(HOSTS))
    return HOSTS[name]


def _add_host_argument(parser: argparse.ArgumentParser, selected: str) -> None:
    if len(HOSTS) > 1:
        default = next(iter(HOSTS))
        parser.add_argument(
            "--host",
            choices=list(HOSTS),
            default=default,
            help=f"the trainer (default {default}); the options below are {selected}'s: --host NAME --help lists another host's",
        )


def selected_host(argv: Sequence[str]) -> str:
    """The ``--host`` a command line names (before any ``--``; ``--host=NAME`` or an abbreviation too), else the default."""
    tokens = list(argv)
    tokens = tokens[: tokens.index("--")] if "--" in tokens else tokens
    found = None
    for i, token in enumerate(tokens):
        flag, eq, value = token.partition("=")
        if len(flag) > 3 and "--host".startswith(flag):
            found = value if eq else (tokens[i + 1] if i + 1 < len(tokens) else None)
    return found if found is not None else next(iter(HOSTS), "")


# -- config -------------------------------------------------------------------------------------


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--config_file", metavar="TRAIN_TOML", help="training TOML ([plugins.downscale] and/or network_args)")
    group.add_argument("--config", metavar="PLUGIN_TOML", help="plugin TOML, the plugin's keys at top level")


def load_cli_config(args: argparse.Namespace) -> tuple[DownscaleConfig, dict[str, Any], str]:
    """(config, flattened training TOML or {}, the path read)."""
    if args.config_file:
        cfg, host = host_part(args).read_training_config(args.config_file)
        return cfg, host, args.config_file
    data = read_plugin_toml(args.config)
    return load_config(plugin_toml=data, base_dir=os.path.dirname(os.path.abspath(args.config))), {}, args.config


def _routes_text(cfg: DownscaleConfig) -> list[str]:
    """The check's route table; a named route shows the edges it stands for."""
    edges = [(f"{r.native}:{r.target}" if r.native else f"x{r.scale:g}") if r.name else "" for r in cfg.routes]
    return [
        f"  {ROUTE_HEADER}edges".rstrip(),
        *(f"  {row}{edge}".rstrip() for row, edge in zip(route_rows(cfg.routes), edges, strict=True)),
    ]


def _add_check_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--config_file", metavar="TRAIN_TOML", help="training TOML ([plugins.downscale] and/or network_args)")
    group.add_argument("--config", metavar="PLUGIN_TOML", help="plugin TOML, the plugin's keys at top level")
    parser.add_argument(
        "trainer_command",
        nargs="*",
        metavar="-- TRAINER COMMAND",
        help="the training command line after '--', e.g. -- TRAINER.py --config_file train.toml "
        "--network_module downscale_plugin --network_args ds_gate=strict (a launcher in front is fine)",
    )


def _check_config(args: argparse.Namespace) -> tuple[DownscaleConfig, str]:
    if args.trainer_command:
        if args.config_file or args.config:
            raise ConfigError(["check: give --config_file, --config or -- TRAINER COMMAND, not both"])
        part = host_part(args)
        if part.read_command_line is None:
            raise ConfigError([f"check: {part.name} does not read a trainer's command line; use --config_file"])
        cfg, merged = part.read_command_line(args.trainer_command)
        config_file = merged.get("config_file")
        return cfg, f"the command line{f' with {config_file}' if config_file else ''}"
    if not (args.config_file or args.config):
        raise ConfigError(["check: give --config_file TRAIN_TOML, --config PLUGIN_TOML or -- TRAINER COMMAND"])
    cfg, _, path = load_cli_config(args)
    problems = package_problems(cfg)  # a trainer's command line is checked for them by its reader
    if problems:
        raise ConfigError(problems)
    return cfg, path


def _run_check(args: argparse.Namespace) -> int:
    try:
        cfg, path = _check_config(args)
    except ConfigError as err:
        return fail(err.problems)
    sources = ", ".join(cfg.sources) or "defaults"
    print(f"config OK: {path} (sources, highest first: {sources})")
    seed = cfg.seed if cfg.seed is not None else "the run's --seed"
    print(
        f"  enable {str(cfg.enable).lower()}, gate {cfg.gate}, seed {seed}, max_tries {cfg.max_tries}, "
        f"tier_tolerance {cfg.tier_tolerance:g}, arch {cfg.arch or 'auto'}, inner {cfg.inner or 'auto'}"
    )
    print(f"  {fasterdit_text(cfg.fasterdit)}")
    if cfg.mode == "map":
        print(
            f"  mode map: map_out {cfg.map.out}, after_map {cfg.after_map}, ratios {', '.join(f'{r:g}' for r in cfg.map.ratios)}, "
            f"bins {cfg.map.bins}, draws {cfg.map.draws}, images {cfg.map.images}, margin {cfg.map.margin:g}"
            f", false-safe ≤ 0.05 family-wise{' (Bonferroni)' if cfg.map.simultaneous else ''}; the routes come from the map"
        )
    elif cfg.mode == "auto":
        c = cfg.certify
        print(
            f"  mode auto: map_out {cfg.map.out}, ratios {', '.join(f'{r:g}' for r in cfg.map.ratios)}, bins {cfg.map.bins}, "
            f"margin {cfg.map.margin:g}, certify_budget {c.budget:g} of the run's native compute, draws {c.draws}, "
            f"spot_checks {c.spot_checks}, unpaid {c.unpaid}{f', resume {c.resume}' if c.resume else ''}, windows cache {c.reuse}"
            f"{f' ({c.cache})' if c.cache else ''}; the routes come from the certifier, or the cache when it holds this run's key"
            + ("" if c.budget > 0 else " (budget 0: none; the run trains native)")
        )
    else:
        print("\n".join(_routes_text(cfg)))
    if not cfg.enable:
        print("  routing is off (enable = false): every step runs native")
    return 0


# -- plan ---------------------------------------------------------------------------------------


def add_arch_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", choices=ARCH_NAMES, help="architecture (default: the config's arch)")


def resolve_arch(args: argparse.Namespace, cfg: DownscaleConfig, host: HostPart) -> str:
    """``--arch``, else the config's arch, else the one the host's options name; a disagreement is an error."""
    hint = host.arch_hint(args) if host.arch_hint is not None else None
    arch = args.arch or cfg.arch or hint
    if hint is not None and arch != hint:
        where = "--arch" if args.arch else "the config's arch"
        raise ConfigError([f"arch: {where} is {arch!r} but the host's options name {hint!r}; give one of them, or make them agree"])
    if arch is None:
        named = f", or name it with {host.name}'s options (--host {host.name} --help)" if host.arch_hint is not None else ""
        raise ConfigError(
            [f"arch: unknown; pass --arch or set arch in the config{named} (allowed for {host.name}: {', '.join(host.archs)})"]
        )
    if arch not in host.archs:
        raise ConfigError([f"arch: {arch!r} is not trained by {host.name} (allowed: {', '.join(host.archs)})"])
    return arch


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_arch_argument(parser)
    parser.add_argument("--mc_samples", type=int, default=200_000, help="Monte-Carlo draws per bucket for samplers without a closed form")


def _run_plan(args: argparse.Namespace) -> int:
    host = host_part(args)
    try:
        cfg, toml, path = load_cli_config(args)
        arch = resolve_arch(args, cfg, host)
        knobs = HostArgs(args, toml)
        inputs = host.plan_inputs(args, knobs, arch)
        if inputs.batch_size < 1 or args.mc_samples < 1:
            raise ConfigError([f"batch_size ({inputs.batch_size}) and --mc_samples ({args.mc_samples}) must be at least 1"])
    except ConfigError as err:
        return fail(err.problems)
    if not cfg.enable:
        print(f"{path}: routing is off (enable = false): every step runs native")
        return 0
    plan = plan_table(
        cfg, arch, inputs.sampler, inputs.buckets, inputs.batch_size, inputs.weights, flop_model=inputs.flop_model,
        total_forwards=inputs.total_forwards, mc_samples=args.mc_samples,
    )  # fmt: skip
    print(f"config: {path} (sources: {', '.join(cfg.sources)})")
    print(f"host: {knobs.text(inputs.knobs)}")
    print(f"buckets: {inputs.bucket_note}")
    if any(r.span is not None for r in cfg.routes):
        total = inputs.total_forwards
        print(f"spans over {total} train forwards" if total else "spans: as fractions of the run (max_train_steps not given)")
    m = plan.flop_model
    print(f"FLOP model: {arch}: {m.describe()}")
    print(format_plan(plan, inputs.sampler_text))
    return 0


register(
    "check",
    "validate a config, or a whole training command line after '--', and print its routes (exit 2 listing every problem)",
    _add_check_arguments,
    _run_check,
    host_arguments=lambda parser, part: None,  # only --host: which trainer reads the TOML / command line
)
register(
    "plan",
    "predict route frequencies and savings for the host's σ sampler and buckets",
    _add_plan_arguments,
    _run_plan,
    host_arguments=lambda parser, part: part.add_arguments(parser),
)


def build_parser(host: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; commands that take ``--host`` get the options of ``host`` (default: the first
    registered host; an unknown name adds none, and ``--host`` then refuses it with the choices)."""
    selected = host if host is not None else next(iter(HOSTS), "")
    parser = argparse.ArgumentParser(prog="python -m downscale_plugin", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.set_defaults(command_parsers={})
    for name, cmd in COMMANDS.items():
        command = sub.add_parser(name, help=cmd.help, description=cmd.help)
        parser.get_default("command_parsers")[name] = command
        cmd.add_arguments(command)
        if cmd.host_arguments is not None:
            _add_host_argument(command, selected)
            if selected in HOSTS:
                cmd.host_arguments(command, HOSTS[selected])
    return parser


def _parse(argv: Sequence[str], host: str) -> argparse.Namespace:
    """Parse with ``host``'s options; an option the command does not know is an error naming the host whose options were read."""
    parser = build_parser(host)
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = parser.get_default("command_parsers")[args.command]
        hosted = COMMANDS[args.command].host_arguments is not None and len(HOSTS) > 1
        where = f" (read with host {host}'s options; another trainer's: --host {'|'.join(HOSTS)})" if hosted else ""
        command.error(f"unrecognized arguments: {' '.join(extra)}{where}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    host = selected_host(argv)
    args = _parse(argv, host)
    if getattr(args, "host", host) != host:  # spelled in a way the scan missed: parse again with the host argparse chose
        args = _parse(argv, args.host)
    del args.command_parsers
    return COMMANDS[args.command].run(args)
