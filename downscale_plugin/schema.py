"""How a config key carries its own schema: its kind, allowed values and help text travel with its dataclass field.

Every settings dataclass (``config.DownscaleConfig``, the measurements' groups in ``certify_config.py``) declares
its keys with :func:`setting`; ``config.load_config`` checks every source against these fields, and a settings
object built directly checks itself (:func:`check_fields`), each problem naming the key as users write it and
what is allowed.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import field, fields
from typing import Any

from .bins import DEFAULT_BINS, parse_bins


class ConfigError(ValueError):
    """One or more configuration problems, each naming the offending key."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("downscale_plugin config:\n  - " + "\n  - ".join(self.problems))


def setting(default: Any, kind: str, allowed: Any = None, help: str = "") -> Any:
    """A config field that carries its own schema: how a value is parsed and checked, and what it means."""
    return field(default=default, metadata={"kind": kind, "allowed": allowed, "help": help})


def check_fields(obj: Any, prefix: str = "") -> None:
    """Check a directly built settings object against its fields' schema, naming each key as written
    (``prefix`` + field: ``certify_budget``); ``load_config`` checks every source the same way, collecting
    the problems. ``None`` is an unset optional key."""
    problems: list[str] = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        if "kind" in f.metadata and value is not None:
            check_scalar(prefix + f.name, f.metadata["kind"], f.metadata["allowed"], value, problems)
    if problems:
        raise ConfigError(problems)


def suggest(key: str, choices: Sequence[str]) -> str:
    """``; did you mean 'x'?`` for the closest of ``choices``, or nothing."""
    close = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_scalar(key: str, kind: str, allowed: Any, value: Any, problems: list[str]) -> Any:
    """``value`` of ``key`` checked against its kind and allowed values: the value as the config holds it, or
    None with the problem appended to ``problems``."""
    if kind == "bool":
        if not isinstance(value, bool):
            problems.append(f"{key}: {value!r} must be a boolean (true or false)")
            return None
        return value
    if kind == "enum":
        if value not in allowed:
            problems.append(f"{key}: {value!r} is not allowed (allowed: {', '.join(allowed)}){suggest(str(value), allowed)}")
            return None
        return value
    if kind == "str":
        if not isinstance(value, str) or not value:
            problems.append(f"{key}: {value!r} must be a non-empty string")
            return None
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{key}: {value!r} must be an integer")
            return None
        lo, hi = allowed
        if value < lo or (hi is not None and value > hi):
            problems.append(f"{key}: {value} is out of range (allowed: {lo} to {hi if hi is not None else 'any'})")
            return None
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{key}: {value!r} must be a number")
            return None
        lo, hi = allowed
        if not lo < value < hi:
            problems.append(f"{key}: {value} is out of range (allowed: strictly between {lo} and {hi})")
            return None
        return float(value)
    if kind == "float_closed":
        lo, hi = allowed
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
            problems.append(f"{key}: {value!r} is out of range (allowed: {lo:g} to {hi:g})")
            return None
        return float(value)
    if kind == "float_min":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < allowed:
            problems.append(f"{key}: {value!r} must be a finite number >= {allowed:g}")
            return None
        return float(value)
    if kind == "ratios":
        if not isinstance(value, (list, tuple)) or not value or not all(is_number(r) and 0.0 < r < 1.0 for r in value):
            problems.append(f"{key}: {value!r} must be a non-empty list of linear ratios strictly between 0 and 1, e.g. [0.75, 0.5]")
            return None
        if len(set(value)) != len(value):
            problems.append(f"{key}: {list(value)} has duplicates")
            return None
        return tuple(float(r) for r in value)
    if kind == "bins":
        if not isinstance(value, str):
            problems.append(f"{key}: {value!r} must be a string, e.g. {DEFAULT_BINS!r}")
            return None
        try:
            parse_bins(value)
        except ValueError as err:
            problems.append(f"{key}: {str(err).removeprefix('bins: ')}")
            return None
        return value
    raise AssertionError(kind)
