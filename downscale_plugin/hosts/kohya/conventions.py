"""kohya trainers' configuration conventions, shared by the sd-scripts and musubi-tuner hosts.

Both read a training TOML with ``read_config_from_file``, which flattens every top-level table one
level into ``args`` (so ``[plugins.downscale]`` arrives as the dict ``args.downscale``), and both
hand ``--network_args`` to the network module as ``key=value`` strings. The plugin's keys among
them carry the prefix ``ds_`` (``config.NETWORK_ARGS_PREFIX``); ``inner=`` and ``downscale_config=``
are the two unprefixed ones.

Both also take the run's whole command line: :func:`config_from_command_line` reads a trainer's
arguments the way its parser and ``read_config_from_file`` do (for the options the plugin reads) and
validates what the network module will read, through the same functions. ``check --`` and the
startup check (``downscale_plugin_startup``, run by a ``.pth`` file at every interpreter start) use it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import toml

from ...config import (
    NETWORK_ARGS_PREFIX,
    UNPREFIXED_NETWORK_ARGS,
    ConfigError,
    DownscaleConfig,
    format_problems,
    load_config,
    measures,
    package_problems,
)

PLUGIN_MODULE = "downscale_plugin"  # the --network_module that names this plugin
DISABLE_STARTUP_CHECK = "DOWNSCALE_PLUGIN_NO_STARTUP_CHECK"  # =1: the .pth startup check does nothing


def split_network_args(kwargs: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """Split network kwargs into (plugin keys without prefix, everything else for the inner module)."""
    plugin: dict[str, str] = {}
    inner: dict[str, Any] = {}
    for key, value in kwargs.items():
        name = key.strip()  # sd-scripts splits "key=value" without stripping (train_network.py)
        if name.startswith(NETWORK_ARGS_PREFIX):
            plugin[name[len(NETWORK_ARGS_PREFIX) :]] = value
        elif name in UNPREFIXED_NETWORK_ARGS:
            plugin[name] = value
        else:
            inner[key] = value  # the inner module's keys exactly as the host passes them
    return plugin, inner


def flatten_training_toml(data: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten a training TOML the way the trainers' ``read_config_from_file`` does.

    Every top-level table is merged one level into a flat dict (section names dropped), so
    ``[plugins.downscale]`` arrives as the dict-valued key ``downscale``.
    """
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def _network_args_items(items: Sequence[str] | None) -> tuple[dict[str, str], list[str]]:
    """The ``key=value`` items of a ``network_args`` list (split at the first ``=``, like the trainers), and
    a problem for each item that has no ``=`` (the trainer would stop on it after loading the models)."""
    out: dict[str, str] = {}
    problems = []
    for item in items or []:
        key, sep, value = str(item).partition("=")
        if not sep:
            problems.append(f"network_args: {item!r} is not of the form key=value")
            continue
        out[key.strip()] = value.strip()
    return out, problems


def network_args_dict(items: Sequence[str] | None) -> dict[str, str]:
    """Parse a ``network_args`` list (``key=value`` strings), like the trainers do; ConfigError lists every bad item."""
    out, problems = _network_args_items(items)
    if problems:
        raise ConfigError(problems)
    return out


def training_toml_path(config_file: str) -> str:
    """The file ``read_config_from_file`` opens for ``--config_file`` (it appends ``.toml`` when missing)."""
    return config_file if config_file.endswith(".toml") else config_file + ".toml"


def _read_training_toml(path: str, problems: list[str]) -> dict[str, Any]:
    """A training TOML flattened as the trainers flatten it; its problems are appended."""
    if not os.path.isfile(path):
        problems.append(f"config_file: file not found: {path}")
        return {}
    try:
        data = toml.load(path)
    except toml.TomlDecodeError as err:
        problems.append(f"config_file: {path} is not valid TOML: {err}")
        return {}
    for name in ("downscale", "downscale_plugin"):
        if isinstance(data.get(name), dict):
            problems.append(
                f"[{name}]: a one-level table is flattened into the trainer's args and can override real "
                "options; put the plugin's keys under [plugins.downscale]"
            )
    flat = flatten_training_toml(data)
    if flat.get("downscale") is not None and not isinstance(flat["downscale"], dict):
        problems.append(f"plugins.downscale: must be a table, got {flat['downscale']!r}")
        flat.pop("downscale")
    return flat


def _run_config(args: Any, problems: list[str]) -> DownscaleConfig | None:
    """What the network module validates for a run with these merged args (``create_network`` → :func:`plugin_config`)."""
    items, bad = _network_args_items(getattr(args, "network_args", None))
    problems.extend(bad)
    plugin_keys, _ = split_network_args(items)
    try:
        return plugin_config(plugin_keys, args)
    except ConfigError as err:
        problems.extend(err.problems)
        return None


# Host options the in-run measurement (mode = "map", "auto") refuses, with the reason (docs/ARCHITECTURE.md,
# "The in-run measurement and the hosts' options", has every option). Both hosts spell --blocks_to_swap alike;
# --split_mode (sd-scripts' Flux) sets it, --deepspeed is sd-scripts' (musubi-tuner's DeepSpeed comes from
# accelerate's config: refused at start, hosts/kohya/probes.py).
MEASUREMENT_REFUSED = {
    "blocks_to_swap": "its offloader moves the blocks' weights between devices from forward and backward hooks, outside "
    "autograd, and the measurement's extra forward and backward passes are not tested with it",
    "split_mode": "it swaps blocks (flux_train_network.py sets --blocks_to_swap 18)",
    "deepspeed": "DeepSpeed's engine owns the backward pass and its gradient partitions; a measurement's backward would write into them",
}
# What to do instead where a run needs the option (Flux at 1024² on a 24 GB card swaps blocks): certify without it,
# then train with it; windows serve only the tier they were measured on (mapping/windows.py, ``tier_entries``).
SWAPPING_INSTEAD = (
    "certify where the model fits without swapping (the same resolution on a larger card, or a lower-resolution bucket, "
    "whose windows route only that tier's buckets), or take a windows file certified for this model and tier elsewhere; "
    'then train this run with mode = "train", downscale_config = that windows.toml and --{name}'
)
MEASUREMENT_INSTEAD = {"blocks_to_swap": SWAPPING_INSTEAD, "split_mode": SWAPPING_INSTEAD}
# How the training script parses them (library/train_util.py, flux_train_network.py, library/deepspeed_utils.py;
# musubi-tuner's training/parser_common.py), spelled out in full: an abbreviation is left to the script.
_REFUSED_KINDS = {"blocks_to_swap": int, "split_mode": bool, "deepspeed": bool}


def measurement_option_problems(cfg: DownscaleConfig, args: Any) -> list[str]:
    """The host options in ``args`` (the trainer's, or a command line's merged values) that a run measuring in-run refuses."""
    if not measures(cfg):
        return []
    problems = []
    for name, why in MEASUREMENT_REFUSED.items():
        value = getattr(args, name, None)
        if value in (None, False, 0):
            continue
        given = f"--{name}" if isinstance(value, bool) else f"--{name} {value}"
        instead = MEASUREMENT_INSTEAD.get(
            name, 'measure in a run without it (its windows then train any run of the model with mode = "train" and --{name})'
        )
        problems.append(f'{given}: mode = "{cfg.mode}" does not run with it: {why}; {instead.format(name=name)}')
    return problems


def _refused_options(arguments: Sequence[str]) -> dict[str, Any]:
    """The refused host options a command line gives (exact spellings; a bad value is the script's to report)."""
    parser = _QuietParser(add_help=False, exit_on_error=False, allow_abbrev=False)
    for name, kind in _REFUSED_KINDS.items():
        if kind is bool:
            parser.add_argument(f"--{name}", action="store_true", default=None)
        else:
            parser.add_argument(f"--{name}", type=kind, default=None)
    try:
        known, _ = parser.parse_known_args(list(arguments))
    except (_Refused, argparse.ArgumentError):
        return {}
    return {name: value for name, value in vars(known).items() if value is not None}


def config_from_training_toml(path: str) -> tuple[DownscaleConfig, dict[str, Any]]:
    """Read a training TOML: returns the plugin config and the flattened host args."""
    problems: list[str] = []
    flat = _read_training_toml(path, problems)
    cfg = _run_config(types.SimpleNamespace(**{**flat, "config_file": path}), problems) if flat or not problems else None
    if cfg is not None:
        problems += measurement_option_problems(cfg, types.SimpleNamespace(**flat))
    if problems:
        raise ConfigError(problems)
    return cfg, flat


# -- the run's command line ----------------------------------------------------------------------


class _Refused(Exception):
    pass


class _QuietParser(argparse.ArgumentParser):
    def error(self, message: str):  # never print usage or exit: the caller decides
        raise _Refused(message)


def _command_parser() -> argparse.ArgumentParser:
    """The trainer parser's options that the plugin reads (train_network.py, library/train_util.py), same spellings and
    nargs; every other argument is left alone (``parse_known_args``)."""
    parser = _QuietParser(add_help=False, exit_on_error=False)
    parser.add_argument("--config_file", type=str, default=None)
    parser.add_argument("--network_module", type=str, default=None)
    parser.add_argument("--network_args", type=str, default=None, nargs="*")
    parser.add_argument("--output_config", action="store_true")
    parser.add_argument("-h", "--help", action="store_true")
    return parser


@dataclass(frozen=True)
class CommandLine:
    """A trainer's arguments, read for the plugin: the command line's own values (None: not given)."""

    network_module: str | None
    config_file: str | None
    network_args: list[str] | None
    output_config: bool
    help: bool


def trainer_arguments(argv: Sequence[str]) -> list[str]:
    """The training script's arguments within a command line: ``argv`` may start with the script
    (``flux_train_network.py ...``), a launcher (``accelerate launch [opts] flux_train_network.py ...``,
    ``torchrun``, ``python``; ``sys.argv`` at startup has ``-m`` or ``-c`` in its place) or the arguments
    themselves (``--config_file ...``)."""
    argv = [str(a) for a in argv]
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-m", "-c", "-")):
        return argv
    if argv[0].endswith(".py"):
        return argv[1:]
    script = next((i for i, a in enumerate(argv[1:], 1) if a.endswith(".py") and not a.startswith("-")), None)
    return argv[script + 1 :] if script is not None else argv[1:]


def parse_command_line(arguments: Sequence[str]) -> CommandLine:
    """The plugin's options among a training script's arguments; ConfigError when they do not parse."""
    try:
        known, _ = _command_parser().parse_known_args(list(arguments))
    except (_Refused, argparse.ArgumentError) as err:
        raise ConfigError([f"command line: {err}"]) from None
    return CommandLine(known.network_module, known.config_file, known.network_args, known.output_config, known.help)


def config_from_command_line(argv: Sequence[str]) -> tuple[DownscaleConfig, dict[str, Any]]:
    """Validate a training command line as the run will see it: the training TOML flattened, the command
    line over it (``read_config_from_file``), then exactly what ``create_network`` reads: ``network_args``
    (``ds_`` keys, ``inner=``, ``downscale_config=``), ``args.downscale`` and the plugin TOML.

    Returns (config, the merged host args); ConfigError lists every problem, also when the command does
    not train ``--network_module downscale_plugin``.
    """
    arguments = trainer_arguments(argv)
    line = parse_command_line(arguments)
    problems: list[str] = []
    flat: dict[str, Any] = {}
    if line.config_file:
        flat = _read_training_toml(training_toml_path(line.config_file), problems)
        if problems and not flat:  # missing or not TOML: nothing else is worth reporting
            raise ConfigError(problems)
    given = {"config_file": line.config_file, "network_module": line.network_module, "network_args": line.network_args}
    merged = {**flat, **{key: value for key, value in given.items() if value is not None}, **_refused_options(arguments)}
    module = merged.get("network_module")
    if module != PLUGIN_MODULE and not problems:
        where = "--network_module" if line.network_module is not None else "the training TOML's network_module"
        shown = f"{where} is {module!r}" if module else "no --network_module (and none in the training TOML)"
        raise ConfigError([f"network_module: {shown}: this command does not train with {PLUGIN_MODULE}"])
    cfg = _run_config(types.SimpleNamespace(**merged), problems)
    if cfg is not None:
        problems += package_problems(cfg) + measurement_option_problems(cfg, types.SimpleNamespace(**merged))
    if problems:
        raise ConfigError(problems)
    return cfg, merged


def host_namespace(parser: argparse.ArgumentParser, arguments: Sequence[str]) -> argparse.Namespace | None:
    """The args a kohya training script will run with: its own ``parser`` (``setup_parser()``) on ``arguments``, over
    the flattened training TOML of ``--config_file`` as both trainers' ``read_config_from_file`` merges them. None
    when the command line does not parse or the TOML cannot be read: the script's own parser reports those."""

    def refuse(message: str) -> None:
        raise _Refused(message)

    parser.error = refuse  # type: ignore[method-assign]  # never print usage or exit
    try:
        args = parser.parse_args(list(arguments))
        if not getattr(args, "config_file", None):
            return args
        problems: list[str] = []
        flat = _read_training_toml(training_toml_path(args.config_file), problems)
        return None if problems and not flat else parser.parse_args(list(arguments), namespace=argparse.Namespace(**flat))
    except (_Refused, argparse.ArgumentError, SystemExit):
        return None


def startup_report(
    argv: Sequence[str],
    drift: Callable[[Sequence[str]], list[str]] | None = None,
    refusals: Callable[[Sequence[str], DownscaleConfig, dict[str, Any]], list[str]] | None = None,
) -> str | None:
    """The startup check: the report to print before exiting 2, or None (the command does not train with
    the plugin, asks for help, writes a config, or its plugin config is valid, ``refusals(argv, cfg, host_args)``,
    what the host refuses of the config for the script's architecture, finds nothing, and ``drift(argv)``, the host's
    self-check of the checkout the command runs (``hosts/kohya/selfcheck.py``), finds nothing or only what
    ``host_check = "warn"`` logs and lets through)."""
    try:
        line = parse_command_line(trainer_arguments(argv))
    except ConfigError:  # the trainer's own parser will say what is wrong with it
        return None
    if line.help or line.output_config:
        return None
    module = line.network_module
    if module is None and line.config_file:
        try:
            module = flatten_training_toml(toml.load(training_toml_path(line.config_file))).get("network_module")
        except (OSError, ValueError, TypeError):  # the trainer reports an unreadable TOML itself
            return None
    if module != PLUGIN_MODULE:
        return None
    try:
        cfg, host_args = config_from_command_line(argv)
        refused = refusals(argv, cfg, host_args) if refusals is not None else []
        problems = drift(argv) if drift is not None else []
        if problems:
            from .selfcheck import warned  # torch is imported already: the self-check ran

            problems = warned(problems, cfg.host_check)
        problems = refused + problems
        if problems:
            raise ConfigError(problems)
    except ConfigError as err:
        return (
            f"{format_problems(err.problems)}\n"
            f"{PLUGIN_MODULE}: stopped before the trainer loads any model (startup check of --network_module {PLUGIN_MODULE}; "
            f"the same check: python -m {PLUGIN_MODULE} check -- SCRIPT ARGS...; {DISABLE_STARTUP_CHECK}=1 skips it)"
        )
    return None


def plugin_config(plugin_keys: Mapping[str, str], args: Any) -> DownscaleConfig:
    """Merge and validate the three sources for a run; relative paths are relative to the training TOML."""
    config_file = getattr(args, "config_file", None)
    base_dir = os.path.dirname(os.path.abspath(config_file)) if config_file else "."
    return load_config(plugin_keys, getattr(args, "downscale", None), base_dir=base_dir)


def model_identity(args: Any) -> str | None:
    """The base model's identity for windows provenance: :func:`file_identity` of ``pretrained_model_name_or_path``."""
    return file_identity(getattr(args, "pretrained_model_name_or_path", None))


def file_identity(path: str | None) -> str | None:
    """The webui model hash sd-scripts writes as ``ss_sd_model_hash`` (sha256 of the 64 KiB at 1 MiB, 8 hex
    digits) of a model file; None when ``path`` is no readable file (a hub name or a diffusers folder: the
    model is then not compared)."""
    import hashlib

    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as fh:
            fh.seek(0x100000)
            return hashlib.sha256(fh.read(0x10000)).hexdigest()[:8]
    except OSError:
        return None


def inner_name(plugin_keys: Mapping[str, str], args: Any) -> str | None:
    """The requested inner module: in a run (``args``: the trainer's) from any config source,
    validating it, else the ``inner=`` network arg."""
    return plugin_config(plugin_keys, args).inner if args is not None else plugin_keys.get("inner")


def import_inner(
    name: str | None,
    denoiser: Any,
    by_denoiser: Mapping[str, str],
    known: Sequence[str],
    entries: Sequence[Sequence[str]],
    error: type[Exception],
) -> tuple[str, ModuleType]:
    """Import the inner network module: ``name``, else the host's module for this denoiser class.

    ``entries``: groups of entry-point names; the module must have a callable of every group (the
    names the host trainer calls). ``error`` is the host's own error type."""
    choices = ", ".join(known)
    if name is None:
        name = by_denoiser.get(type(denoiser).__name__)
        if name is None:
            raise error(
                f"inner: cannot tell the inner network module from the denoiser class {type(denoiser).__name__!r} "
                f"(known: {', '.join(by_denoiser)}); set inner=MODULE in --network_args (choices: {choices})"
            )
    if name.split(".")[0] == __name__.split(".")[0]:
        raise error(f"inner: {name!r} is this plugin itself; choose a LoRA module (choices: {choices})")
    try:
        module = importlib.import_module(name)
    except ImportError as err:
        raise error(f"inner: cannot import {name!r} ({err}); choices: {choices}") from err
    missing = [" or ".join(group) for group in entries if not any(callable(getattr(module, f, None)) for f in group)]
    if missing:
        raise error(f"inner: {name!r} has no {' or '.join(missing)}: not a network module; choices: {choices}")
    return name, module


@contextmanager
def host_imports(root: str | None, packages: Sequence[str]) -> Iterator[None]:
    """Import the host from ``root`` (its checkout; None: as installed) for a check that runs before the
    trainer, and leave nothing of it behind: ``root`` comes off ``sys.path``, the modules of ``packages``
    imported inside are forgotten (the trainer imports its own) and the root logger gets its handlers and
    level back (kohya's modules set up logging when imported)."""
    before = set(sys.modules)
    root_logger = logging.root
    handlers, level = list(root_logger.handlers), root_logger.level
    added = root is not None and root not in sys.path
    if added:
        sys.path.insert(0, root)
    try:
        yield
    finally:
        if added:
            sys.path.remove(root)
        for name in [m for m in sys.modules if m not in before and m.split(".")[0] in packages]:
            del sys.modules[name]
        root_logger.handlers[:] = handlers
        root_logger.setLevel(level)
