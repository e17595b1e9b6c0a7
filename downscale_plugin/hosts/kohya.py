"""kohya trainers' configuration conventions, shared by the sd-scripts and musubi-tuner hosts.

Both read a training TOML with ``read_config_from_file``, which flattens every top-level table one
level into ``args`` (so ``[plugins.downscale]`` arrives as the dict ``args.downscale``), and both
hand ``--network_args`` to the network module as ``key=value`` strings. The plugin's keys among
them carry the prefix ``ds_`` (``config.NETWORK_ARGS_PREFIX``); ``inner=`` and ``downscale_config=``
are the two unprefixed ones.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import toml

from ..config import NETWORK_ARGS_PREFIX, UNPREFIXED_NETWORK_ARGS, ConfigError, DownscaleConfig, load_config


def split_network_args(kwargs: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """Split network kwargs into (plugin keys without prefix, everything else for the inner module)."""
    plugin: dict[str, str] = {}
    inner: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key.startswith(NETWORK_ARGS_PREFIX):
            plugin[key[len(NETWORK_ARGS_PREFIX) :]] = value
        elif key in UNPREFIXED_NETWORK_ARGS:
            plugin[key] = value
        else:
            inner[key] = value
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


def network_args_dict(items: Sequence[str] | None) -> dict[str, str]:
    """Parse a ``network_args`` list (``key=value`` strings), like the trainers do."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError([f"network_args: {item!r} is not of the form key=value"])
        out[key.strip()] = value.strip()
    return out


def config_from_training_toml(path: str) -> tuple[DownscaleConfig, dict[str, Any]]:
    """Read a training TOML: returns the plugin config and the flattened host args."""
    if not os.path.isfile(path):
        raise ConfigError([f"config_file: file not found: {path}"])
    try:
        data = toml.load(path)
    except toml.TomlDecodeError as err:
        raise ConfigError([f"config_file: {path} is not valid TOML: {err}"]) from None
    problems = []
    for name in ("downscale", "downscale_plugin"):
        if isinstance(data.get(name), dict):
            problems.append(
                f"[{name}]: a one-level table is flattened into the trainer's args and can override real "
                "options; put the plugin's keys under [plugins.downscale]"
            )
    flat = flatten_training_toml(data)
    table = flat.get("downscale")
    if table is not None and not isinstance(table, dict):
        problems.append(f"plugins.downscale: must be a table, got {table!r}")
        table = None
    try:
        plugin_args, _ = split_network_args(network_args_dict(flat.get("network_args")))
    except ConfigError as err:
        problems.extend(err.problems)
        plugin_args = {}
    try:
        cfg = load_config(plugin_args, table, base_dir=os.path.dirname(os.path.abspath(path)))
    except ConfigError as err:
        problems.extend(err.problems)
        cfg = None
    if problems:
        raise ConfigError(problems)
    return cfg, flat


def plugin_config(plugin_keys: Mapping[str, str], args: Any) -> DownscaleConfig:
    """Merge and validate the three sources for a run; relative paths are relative to the training TOML."""
    config_file = getattr(args, "config_file", None)
    base_dir = os.path.dirname(os.path.abspath(config_file)) if config_file else "."
    return load_config(plugin_keys, getattr(args, "downscale", None), base_dir=base_dir)
