"""The plugin's one configuration schema: typed, validated, merged from three sources.

Sources, highest precedence first:

1. ``--network_args`` strings. Plugin keys carry the prefix ``ds_`` (``ds_gate=strict``,
   ``ds_routes=1024:768@0.65-0.95``) so they can never collide with an inner module's own keys;
   ``inner=`` and ``downscale_config=`` are the two unprefixed plugin keys.
2. The ``[plugins.downscale]`` table of the sd-scripts training TOML (it reaches the trainer as the
   dict ``args.downscale``; a one-level ``[downscale]`` table would be flattened into ``args``).
3. A plugin TOML named by ``downscale_config=PATH``, with the same keys at its top level.

A higher source replaces a lower one key by key; ``routes`` is replaced as a whole list.
Every problem is collected and raised at once in :class:`ConfigError`, naming the key, the value
and what is allowed, before any model is loaded.
"""

from __future__ import annotations

import difflib
import math
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import toml

from .arch import ARCH_NAMES
from .bins import DEFAULT_BINS, parse_bins

GATES = ("coupled", "strict")
SIGMA_POLICIES = ("keep", "res_shift", "snr_match")  # σ a routed step runs at (fasterdit.policies)
POSITIONS = ("plain", "interpolate")  # position ids of a routed step (fasterdit.positions)
MODES = ("train", "map", "auto")  # map: the full gradient map in the run; auto: certify windows in the run and train with them (mapping/)
AFTER_MAP = ("stop", "train")
HOST_CHECKS = ("error", "warn")  # the drift self-check's findings (hosts/kohya/selfcheck.py): refuse, or log, record and train on
VAE_ARM_KEYS = ("map_reenc", "map_pixel")  # the map's VAE arms (mapping/arms.py: reenc, pixel_<r>); the host must drive its VAE
DEFAULT_MAP_RATIOS = (0.875, 0.75, 0.5)
SPAN_MODES = ("early", "late", "spread")
NETWORK_ARGS_PREFIX = "ds_"
UNPREFIXED_NETWORK_ARGS = ("inner", "downscale_config")
ROUTE_KEYS = ("route", "scale", "sigma_min", "sigma_max", "span", "name")


def require_gate(gate: str) -> None:
    """The one check of a gate name for code that takes it directly (the router, ``plan``)."""
    if gate not in GATES:
        raise ValueError(f"gate: {gate!r} is not allowed (allowed: {', '.join(GATES)})")


class ConfigError(ValueError):
    """One or more configuration problems, each naming the offending key."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("downscale_plugin config:\n  - " + "\n  - ".join(self.problems))


@dataclass(frozen=True)
class Span:
    """When in training a rule may fire, counted in train forwards 1..T.

    ``early:f`` fires on forwards ``idx <= cut(f)``, ``late:f`` on ``idx > cut(1 - f)`` with the
    same rounding, so ``early:f`` and ``late:1-f`` partition ``[1, T]`` exactly. ``spread:p`` is a
    coin with probability p that is a pure function of (seed, idx, stream); the router gives each
    rule its own stream so two spread rules flip independent coins.
    """

    mode: str
    frac: float

    def active(self, idx: int, total: int, seed: int, stream: int = 0) -> bool:
        if self.mode == "spread":
            return random.Random((seed * 1_000_003 + idx) * 1_009 + stream).random() < self.frac
        if total <= 0:
            raise ValueError(f"span {self}: the total number of train forwards is not known (got {total})")
        if self.mode == "early":
            return idx <= _cut(self.frac, total)
        return idx > _cut(1.0 - self.frac, total)

    def __str__(self) -> str:
        return f"{self.mode}:{self.frac:g}"


def _cut(frac: float, total: int) -> int:
    # Rounding the fraction first makes cut(1 - (1 - f)) == cut(f) despite float error.
    return int(round(frac, 12) * total + 0.5)


@dataclass(frozen=True)
class RouteRule:
    """One router rule: a target grid, a strict σ window, an optional span.

    ``native``/``target`` are tier edges in pixels (``"1024:768"``: buckets of the 1024 tier run at
    linear ratio 0.75); a ``scale`` rule applies to every bucket. The window is ``lo < σ < hi``;
    ``sigma_max = None`` means no upper bound (σ = 1 included).
    """

    sigma_min: float
    sigma_max: float | None = None
    native: int | None = None
    target: int | None = None
    scale: float | None = None
    span: Span | None = None
    name: str = ""

    @property
    def ratio(self) -> float:
        return self.scale if self.scale is not None else self.target / self.native

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return f"{self.native}:{self.target}" if self.native else f"x{self.scale:g}"

    def in_window(self, sigma):
        """Strict window membership; works on floats and tensors."""
        above = sigma > self.sigma_min
        return above if self.sigma_max is None else above & (sigma < self.sigma_max)

    def window_text(self) -> str:
        hi = "1]" if self.sigma_max is None else f"{self.sigma_max:g})"
        return f"({self.sigma_min:g}, {hi}"


def _key(default: Any, kind: str, allowed: Any = None, help: str = "") -> Any:
    """A config field that carries its own schema: how a value is parsed and checked, and what it means."""
    return field(default=default, metadata={"kind": kind, "allowed": allowed, "help": help})


def _check_fields(obj: Any) -> None:
    """Check a directly built settings object against its fields' schema (``load_config`` checks
    every source the same way, collecting the problems); ``None`` is an unset optional key."""
    problems: list[str] = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        if "kind" in f.metadata and value is not None:
            _check_scalar(f.name, f.metadata["kind"], f.metadata["allowed"], value, problems)
    if problems:
        raise ConfigError(problems)


@dataclass(frozen=True)
class MapConfig:
    """The in-run gradient map's settings (``mode = "map"``, mapping/); TOML key = ``map_`` + field."""

    ratios: tuple[float, ...] = _key(DEFAULT_MAP_RATIOS, "ratios", help="the map's linear ratios")
    bins: str = _key(DEFAULT_BINS, "bins", help="the map's σ bins")
    draws: int = _key(8, "int", (2, 4096), "noise draws per arm and bin (even)")
    images: int = _key(8, "int", (2, None), "probe samples from the run's first batches")
    margin: float = _key(0.05, "float", (0.0, 1.0), "the margin ε a safe bin's upper bound must stay below")
    simultaneous: bool = _key(False, "bool", help="Bonferroni over every (route, bin) instead of chains from σ = 1 down (both family-wise)")
    out: str | None = _key(None, "str", help="directory for the map's files")
    reenc: bool = _key(False, "bool", help="add the VAE re-encode control arm")
    pixel: bool = _key(False, "bool", help="add the pixel-downscale-then-encode arms")

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class CertifyConfig:
    """The in-run certifier's settings (``mode = "auto"``, mapping/certify.py); TOML key = ``certify_`` + field.
    Routes, bins, ε and the output directory are the map's keys (``map_ratios``, ``map_bins``, ``map_margin``, ``map_out``)."""

    budget: float = _key(
        0.1, "float_closed", (0.0, 0.5), "probe passes at most, as a fraction of the run's native compute (0: no probes, a plain run)"
    )
    draws: int = _key(4, "int", (2, 64), "paired noise draws per (probe, σ bin)")
    spot_checks: int = _key(
        0,
        "int",
        (0, 16),
        "bins tested below each route's edge after the search: a σ-monotonicity check that spends budget and never opens a window",
    )
    resume: str | None = _key(None, "str", help="a certify.json of an earlier run on the same model: its evidence is continued, not redone")

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class FasterDitConfig:
    """FasterDiT's options on routed and native steps (fasterdit/); TOML key = field name."""

    direction_loss_weight: float = _key(0.0, "float_min", 0.0, "FasterDiT's direction-loss λ (0: off)")
    direction_loss_only_routed: bool = _key(False, "bool", help="add the direction term only on routed steps")
    sigma_policy: str = _key("keep", "enum", SIGMA_POLICIES, "σ a routed step runs at")
    positions: str = _key("plain", "enum", POSITIONS, "position ids of a routed step")

    def __post_init__(self) -> None:
        _check_fields(self)


FOREIGN = ("error", "warn")


@dataclass(frozen=True)
class WindowsProvenance:
    """Where a windows file's verdicts were measured; ``map`` and ``certify`` write these keys into the
    windows TOML they emit (TOML key = ``windows_`` + field). A host that knows its model, arch and
    native tier refuses windows certified for another (:func:`foreign_windows`) unless
    ``windows_foreign = "warn"``: a window is evidence about one model at one grid, not a preset."""

    model: str | None = _key(
        None, "str", help="identity of the base model the windows were certified on (the host's model hash, or a file hash)"
    )
    arch: str | None = _key(None, "enum", ARCH_NAMES, "the architecture the windows were certified on")
    native: str | None = _key(None, "str", help='the probes\' native latent grid "HxW" (its tier)')
    margin: float | None = _key(None, "float", (0.0, 1.0), "the margin ε the windows were certified at")
    method: str | None = _key(None, "str", help="how they were certified: map or certify, with its settings")
    images: int | None = _key(None, "int", (1, None), "probe images behind the verdicts")
    version: str | None = _key(None, "str", help="the plugin version that wrote them")
    date: str | None = _key(None, "str", help="when they were written (UTC)")
    foreign: str = _key("error", "enum", FOREIGN, "windows certified for another model, arch or tier: error, or warn and use them")

    def __post_init__(self) -> None:
        _check_fields(self)


def _latent_hw(text: str) -> tuple[int, int] | None:
    h, sep, w = text.lower().partition("x")
    return (int(h), int(w)) if sep and h.isdigit() and w.isdigit() else None


def vae_arm_problems(cfg: DownscaleConfig, arch: str, supported: Sequence[str]) -> list[str]:
    """A map's VAE arms on an architecture whose VAE the host does not drive (``supported``: those it does)."""
    if cfg.mode != "map" or arch in supported:
        return []
    allowed = ", ".join(supported) or "none on this host"
    return [
        f"{key}: the VAE arms are not supported for {arch} (supported: {allowed}); set {key} = false"
        for key in VAE_ARM_KEYS
        if getattr(cfg.map, key.removeprefix("map_"))
    ]


# Optional packages each in-run measurement imports (mapping/: sequential.py's and estimator.py's t quantiles,
# report.py's heatmap, the progress bar), all installed by the one extra.
MODE_PACKAGES = {"map": ("scipy", "matplotlib", "tqdm"), "auto": ("scipy", "tqdm")}
MODE_EXTRA = "map"


def measures(cfg: DownscaleConfig) -> bool:
    """Whether the run measures in-run (``map``, or ``auto`` with a budget): probes, forced draws, a backward per draw."""
    return cfg.enable and (cfg.mode == "map" or (cfg.mode == "auto" and cfg.certify.budget > 0))


def package_problems(cfg: DownscaleConfig) -> list[str]:
    """The packages ``cfg``'s mode imports that are not installed, naming the extra that installs them (a run
    checks this before its session imports any of them; the startup check and ``check`` before any model loads)."""
    import importlib.util

    if not measures(cfg):
        return []
    missing = [name for name in MODE_PACKAGES[cfg.mode] if importlib.util.find_spec(name) is None]
    if not missing:
        return []
    return [f'mode = "{cfg.mode}" needs {", ".join(missing)}, not installed: pip install "downscale-plugin[{MODE_EXTRA}]"']


def foreign_windows(
    windows: WindowsProvenance, model: str | None, arch: str, latent_buckets: Sequence[tuple[int, int]], tier_tolerance: float
) -> list[str]:
    """Each recorded provenance key this run differs on, naming both sides: ``windows_model`` (when
    the host can identify its model), ``windows_arch``, and ``windows_native`` (no bucket of the run is
    in the certified grid's tier: √(h·w) within ``tier_tolerance``)."""
    problems = []
    if windows.model is not None and model is not None and windows.model != model:
        problems.append(f"windows_model: the windows were certified on model {windows.model!r}, this run's model is {model!r}")
    if windows.arch is not None and windows.arch != arch:
        problems.append(f"windows_arch: the windows were certified on {windows.arch!r}, this run is {arch!r}")
    native = _latent_hw(windows.native) if windows.native else None
    if native is not None and latent_buckets:
        edge = math.sqrt(native[0] * native[1])
        if not any(abs(math.sqrt(h * w) / edge - 1.0) <= tier_tolerance for h, w in latent_buckets):
            grids = ", ".join(f"{h}x{w}" for h, w in sorted(set(latent_buckets)))
            problems.append(
                f"windows_native: the windows were certified at latent {windows.native}, no bucket of this run is in its tier ({grids})"
            )
    return problems


def _group(prefix: str, settings: type) -> Any:
    """A nested settings field whose keys stay flat in every source: ``prefix`` + the field's name."""
    return field(default_factory=settings, metadata={"group": prefix})


@dataclass(frozen=True)
class DownscaleConfig:
    """The plugin's settings; each field's metadata is its key's schema (kind, allowed values, help)."""

    enable: bool = _key(True, "bool", help="turn the plugin off without removing the config")
    gate: str = _key("coupled", "enum", GATES, "coupled: exact σ marginal at any batch size; strict: every σ in the window")
    routes: tuple[RouteRule, ...] = _key((), "routes", help="router rules in priority order")
    seed: int | None = _key(None, "int", (0, None), "seeds the coupled gate's per-step draws (default: the run's --seed)")
    max_tries: int = _key(8, "int", (1, 64), "rejection rounds of the coupled gate before the rest is drawn directly")
    tier_tolerance: float = _key(0.1, "float", (0.0, 0.5), "a bucket is in tier E when √(W·H) is within this fraction of E")
    arch: str | None = _key(None, "enum", ARCH_NAMES, "the architecture (default: detected from the trainer)")
    inner: str | None = _key(None, "str", help="inner network module (default: the trainer's own LoRA module)")
    host_check: str = _key("error", "enum", HOST_CHECKS, "a host function the drift self-check finds changed or uncallable: error, or warn")
    fasterdit: FasterDitConfig = _group("", FasterDitConfig)
    mode: str = _key(
        "train",
        "enum",
        MODES,
        "map: measure the gradient map in this run and derive the windows; auto: certify windows in the run and train with them",
    )
    after_map: str = _key("stop", "enum", AFTER_MAP, "after the map: stop, or train on with the derived windows")
    map: MapConfig = _group("map_", MapConfig)
    certify: CertifyConfig = _group("certify_", CertifyConfig)
    windows: WindowsProvenance = _group("windows_", WindowsProvenance)
    sources: tuple[str, ...] = field(default=(), compare=False)

    def with_routes(self, routes: Sequence[RouteRule]) -> DownscaleConfig:
        return replace(self, routes=tuple(routes))


def _schema() -> dict[str, tuple[str | None, Any]]:
    """Every flat key → (the nested group it fills or None, its field), in the dataclasses' order."""
    keys: dict[str, tuple[str | None, Any]] = {}
    for top in fields(DownscaleConfig):
        if "group" in top.metadata:
            for sub in fields(top.default_factory):
                keys[top.metadata["group"] + sub.name] = (top.name, sub)
        elif "kind" in top.metadata:
            keys[top.name] = (None, top)
    return keys


_SCHEMA = _schema()
# The keys every source accepts, from the fields above, plus the one key that names a source.
_TOP_KEYS: dict[str, tuple[str, Any]] = {key: (f.metadata["kind"], f.metadata["allowed"]) for key, (_, f) in _SCHEMA.items()}
_TOP_KEYS["downscale_config"] = ("str", None)


def config_fields() -> dict[str, Any]:
    """Every flat config key → the dataclass field that holds its schema and default."""
    return {key: f for key, (_, f) in _SCHEMA.items()}


def config_keys() -> dict[str, str]:
    """Every config key and its help (the README's key table lists exactly these)."""
    keys = {key: f.metadata["help"] for key, f in config_fields().items()}
    return {**keys, "downscale_config": "a plugin TOML with the same keys at its top level"}


def _build(merged: Mapping[str, Any], routes: tuple[RouteRule, ...], sources: tuple[str, ...]) -> DownscaleConfig:
    """The config from checked flat keys: each key goes to its field or its nested group."""
    top: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for key, value in merged.items():
        group, f = _SCHEMA[key]
        (groups.setdefault(group, {}) if group else top)[f.name] = value
    for group, values in groups.items():
        top[group] = next(x.default_factory for x in fields(DownscaleConfig) if x.name == group)(**values)
    return DownscaleConfig(routes=routes, sources=sources, **top)


def _suggest(key: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _unknown(where: str, key: str, choices: Sequence[str]) -> str:
    return f"{where}{key}: unknown key{_suggest(key, choices)} (allowed: {', '.join(sorted(choices))})"


def _number_text(text: str, what: str = "") -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError(f"{what + ' ' if what else ''}{text.strip()!r} is not a number") from None


def _from_string(kind: str, text: str) -> Any:
    """Convert a network_args string to the schema type, strictly (no silent coercion); a ValueError
    says what the text is not and the form allowed."""
    if kind == "bool":
        low = text.strip().lower()
        if low in ("true", "false"):
            return low == "true"
        raise ValueError(f"{text!r} is not a boolean (allowed: true, false)")
    if kind == "int":
        try:
            return int(text.strip())
        except ValueError:
            raise ValueError(f"{text.strip()!r} is not an integer") from None
    if kind in ("float", "float_min", "float_closed"):
        return _number_text(text)
    if kind == "ratios":
        bad = [x.strip() for x in text.split(",") if x.strip() and not _is_number_text(x)]
        if bad:
            raise ValueError(
                f"{', '.join(map(repr, bad))} {'is' if len(bad) == 1 else 'are'} not a number "
                "(form: comma-separated linear ratios, e.g. 0.875,0.75,0.5)"
            )
        return [float(x) for x in text.split(",") if x.strip()]
    return text.strip()


def _is_number_text(text: str) -> bool:
    try:
        float(text.strip())
    except ValueError:
        return False
    return True


def _check_scalar(key: str, kind: str, allowed: Any, value: Any, problems: list[str]) -> Any:
    if kind == "bool":
        if not isinstance(value, bool):
            problems.append(f"{key}: {value!r} must be a boolean (true or false)")
            return None
        return value
    if kind == "enum":
        if value not in allowed:
            problems.append(f"{key}: {value!r} is not allowed (allowed: {', '.join(allowed)}){_suggest(str(value), allowed)}")
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
        if not isinstance(value, (list, tuple)) or not value or not all(_number(r) and 0.0 < r < 1.0 for r in value):
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


def parse_span(text: str) -> Span:
    """Parse ``early[:f]`` | ``late[:f]`` | ``spread[:p]`` (f, p strictly inside (0, 1), default 0.5)."""
    mode, _, frac_text = text.strip().partition(":")
    if mode not in SPAN_MODES:
        raise ValueError(f"{text!r}: mode must be one of {', '.join(SPAN_MODES)} (form MODE[:FRACTION])")
    frac = 0.5
    if frac_text:
        try:
            frac = float(frac_text)
        except ValueError:
            raise ValueError(f"{text!r}: fraction {frac_text!r} is not a number") from None
    if not 0.0 < frac < 1.0:
        raise ValueError(f"{text!r}: fraction must be strictly between 0 and 1")
    return Span(mode, frac)


def parse_route_edges(text: str) -> tuple[int, int]:
    """Parse ``"NATIVE:TARGET"`` tier edges in pixels; TARGET must be smaller than NATIVE."""
    parts = text.strip().split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"{text!r} must be two positive integers 'NATIVE:TARGET', e.g. '1024:768'")
    native, target = (int(p) for p in parts)
    if not 0 < target < native:
        raise ValueError(f"{text!r}: TARGET must be positive and smaller than NATIVE (ratio < 1)")
    return native, target


ROUTES_STRING_FORM = (
    "ROUTE@LO-HI[@SPAN] entries, comma-separated: ROUTE is NATIVE:TARGET (tier edges in px) or xSCALE, "
    "LO- leaves the window open at the top, SPAN is early[:f], late[:f] or spread[:p]; "
    "e.g. 1024:768@0.65-0.95,1024:896@0.5-@late:0.75"
)


def _route_entry(entry: str) -> dict[str, Any]:
    """One ``ROUTE@LO-HI[@SPAN]`` entry as a route table; a ValueError says what is wrong with it."""
    fields = entry.split("@")
    if len(fields) not in (2, 3):
        raise ValueError(f"has {len(fields) - 1} '@'; it must be 'ROUTE@LO-HI' or 'ROUTE@LO-HI@SPAN'")
    route, window = fields[0].strip(), fields[1].strip()
    table: dict[str, Any] = {}
    if route.startswith("x"):
        table["scale"] = _number_text(route[1:], "scale")
    else:
        table["route"] = route
    lo, sep, hi = window.partition("-")
    if not sep:
        raise ValueError(f"window {window!r} must be 'LO-HI' or 'LO-'")
    table["sigma_min"] = _number_text(lo, "sigma_min")
    if hi.strip():
        table["sigma_max"] = _number_text(hi, "sigma_max")
    if len(fields) == 3:
        table["span"] = fields[2]
    return table


def parse_routes_string(text: str) -> list[dict[str, Any]]:
    """Parse the network_args form ``ROUTE@LO-HI[@SPAN],...`` into route tables.

    ROUTE is ``NATIVE:TARGET`` or ``xSCALE``; ``LO-`` leaves the window open at the top.
    Example: ``1024:768@0.65-0.95,1024:896@0.5-@late:0.75``. A ValueError names every malformed
    entry, what is wrong with it and the form allowed.
    """
    tables, bad = [], []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        try:
            tables.append(_route_entry(entry))
        except ValueError as err:
            bad.append(f"entry {entry!r}: {err}")
    if bad:
        raise ValueError("; ".join(bad) + f" (form: {ROUTES_STRING_FORM})")
    return tables


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _parse_route(index: int, table: Any, is_last: bool, problems: list[str]) -> RouteRule | None:
    where = f"routes[{index}]"
    if not isinstance(table, Mapping):
        problems.append(f"{where}: must be a table with keys {', '.join(ROUTE_KEYS)}, got {table!r}")
        return None
    n_before = len(problems)
    for key in table:
        if key not in ROUTE_KEYS:
            problems.append(_unknown(f"{where}.", key, ROUTE_KEYS))
    native = target = scale = None
    if ("route" in table) == ("scale" in table):
        problems.append(
            f"{where}: give exactly one of 'route' (\"NATIVE:TARGET\", e.g. \"1024:768\") or 'scale' (a linear ratio in (0, 1))"
        )
    elif "route" in table:
        if not isinstance(table["route"], str):
            problems.append(f"{where}.route: {table['route']!r} must be a string 'NATIVE:TARGET', e.g. \"1024:768\"")
        else:
            try:
                native, target = parse_route_edges(table["route"])
            except ValueError as err:
                problems.append(f"{where}.route: {err}")
    else:
        scale = table["scale"]
        if not _number(scale) or not 0.0 < scale < 1.0:
            problems.append(f"{where}.scale: {scale!r} must be a number strictly between 0 and 1 (a linear downscale ratio)")
            scale = None
        else:
            scale = float(scale)
    lo = table.get("sigma_min")
    hi = table.get("sigma_max")
    if lo is None:
        problems.append(f"{where}.sigma_min: required (the window is strict, sigma_min < σ < sigma_max)")
    elif not _number(lo) or not 0.0 <= lo < 1.0:
        problems.append(f"{where}.sigma_min: {lo!r} must be a number in [0, 1)")
        lo = None
    if hi is None:
        if not is_last:
            problems.append(
                f"{where}.sigma_max: required: a rule with lower-priority rules after it needs an explicit window, "
                "otherwise it shadows them on all of (sigma_min, 1]"
            )
    elif not _number(hi) or not 0.0 < hi <= 1.0:
        problems.append(f"{where}.sigma_max: {hi!r} must be a number in (0, 1]")
        hi = None
    elif lo is not None and _number(lo) and hi <= lo:
        problems.append(f"{where}.sigma_max: {hi} must be greater than sigma_min ({lo}): the window ({lo}, {hi}) is empty or inverted")
    span = None
    if "span" in table:
        if not isinstance(table["span"], str):
            problems.append(f"{where}.span: {table['span']!r} must be a string MODE[:FRACTION] with MODE in {', '.join(SPAN_MODES)}")
        else:
            try:
                span = parse_span(table["span"])
            except ValueError as err:
                problems.append(f"{where}.span: {err}")
    name = table.get("name", "")
    if not isinstance(name, str):
        problems.append(f"{where}.name: {name!r} must be a string")
    if len(problems) > n_before:
        return None
    return RouteRule(
        sigma_min=float(lo),
        sigma_max=None if hi is None else float(hi),
        native=native,
        target=target,
        scale=scale,
        span=span,
        name=name,
    )


def _same_buckets(a: RouteRule, b: RouteRule) -> bool:
    """Whether rule a applies to every bucket rule b applies to."""
    return a.scale is not None or (a.native is not None and a.native == b.native)


def _covers(a: RouteRule, b: RouteRule) -> bool:
    a_hi = 1.0 if a.sigma_max is None else a.sigma_max
    b_hi = 1.0 if b.sigma_max is None else b.sigma_max
    top_ok = a.sigma_max is None or (b.sigma_max is not None and b_hi <= a_hi)
    return a.sigma_min <= b.sigma_min and top_ok


def _check_routes(rules: list[RouteRule], problems: list[str]) -> None:
    """Reject rules a higher-priority rule shadows completely: they could never fire."""
    for j, low in enumerate(rules):
        for i in range(j):
            high = rules[i]
            if high.span is None and _same_buckets(high, low) and _covers(high, low):
                problems.append(
                    f"routes[{j}]: can never fire: routes[{i}] ({high.label}, window {high.window_text()}) has priority "
                    f"and covers its whole window {low.window_text()} for the same buckets; narrow routes[{i}] or reorder"
                )
                break


def _normalize_source(raw: Mapping[str, Any], source: str, problems: list[str], strings: bool) -> dict[str, Any]:
    """Check one source's keys and types; network_args strings are converted first."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        # network_args problems name the key as the user typed it (ds_gate, not gate)
        shown = network_arg_name(key) if strings else key
        if key not in _TOP_KEYS:
            choices = [network_arg_name(k) for k in _TOP_KEYS] if strings else list(_TOP_KEYS)
            problems.append(f"[{source}] " + _unknown("", shown, choices))
            continue
        kind, allowed = _TOP_KEYS[key]
        if strings:
            try:
                value = parse_routes_string(value) if kind == "routes" else _from_string(kind, value)
            except ValueError as err:
                problems.append(f"[{source}] {shown}: {err}")
                continue
        if kind == "routes":
            if not isinstance(value, list):
                problems.append(f"[{source}] routes: must be an array of tables ([[routes]]), got {type(value).__name__}")
                continue
            out[key] = value
            continue
        n_before = len(problems)
        checked = _check_scalar(shown, kind, allowed, value, problems)
        if len(problems) > n_before:
            problems[-1] = f"[{source}] {problems[-1]}"
            continue
        out[key] = checked
    return out


def network_arg_name(key: str) -> str:
    """A plugin key as it is spelled in ``--network_args`` (``gate`` → ``ds_gate``; ``inner`` stays)."""
    return key if key in UNPREFIXED_NETWORK_ARGS else NETWORK_ARGS_PREFIX + key


def format_problems(problems: Sequence[str]) -> str:
    """The report every front end prints for a :class:`ConfigError` (``check``, the startup check)."""
    return "\n".join([f"downscale_plugin: {len(problems)} problem(s):", *(f"  - {p}" for p in problems)])


def read_plugin_toml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError([f"downscale_config: file not found: {path}"])
    try:
        return toml.load(path)
    except toml.TomlDecodeError as err:
        raise ConfigError([f"downscale_config: {path} is not valid TOML: {err}"]) from None


AUTO_UNUSED = ("map_draws", "map_images", "map_simultaneous", "after_map")  # the full map's own settings; auto's are certify_*


def _mode_problems(merged: Mapping[str, Any], has_routes: bool, rejected: set[str]) -> list[str]:
    """Keys that only make sense with one ``mode`` (the map's with ``map``, the certifier's with
    ``auto``, both measure the windows themselves); ``rejected`` keys are already reported."""
    problems = []
    mode = merged.get("mode", "train")
    if merged.get("map_draws", 0) % 2:
        problems.append(f"map_draws: {merged['map_draws']} must be even (the self-floor splits the D draws into two equal halves)")
    if mode != "map":
        problems += [f'{key}: true is only allowed with mode = "map" (a VAE arm of the map)' for key in VAE_ARM_KEYS if merged.get(key)]
    if mode != "auto":
        problems += [
            f'{key}: only used with mode = "auto" (the in-run certifier); remove it or set mode = "auto"'
            for key in merged
            if key.startswith("certify_")
        ]
    if mode == "train":
        return problems
    if mode == "auto":
        problems += [
            f'{key}: not used with mode = "auto" (the certifier draws certify_draws per probe, reads its bounds at 4, 8 and 16 probes '
            "and always trains on with what it certified); remove it"
            for key in AUTO_UNUSED
            if key in merged
        ]
    outputs = "windows.toml, certify.json" if mode == "auto" else "windows.toml, map.csv, map.json, map.png"
    if not merged.get("map_out") and "map_out" not in rejected:
        problems.append(f'map_out: required when mode = "{mode}" (the directory it writes {outputs} into)')
    if has_routes:
        problems.append(f'routes: not used when mode = "{mode}": the run derives the windows itself; remove routes or set mode = "train"')
    for key, plain in (("sigma_policy", "keep"), ("positions", "plain")):
        if merged.get(key, plain) != plain:
            problems.append(
                f'{key}: {merged[key]!r} is not allowed with mode = "{mode}" (allowed: {plain!r}): the in-run measurement covers the '
                "router's plain routes; compare σ policies and positions with the lab map"
            )
    return problems


def load_config(
    network_args: Mapping[str, str] | None = None,
    table: Mapping[str, Any] | None = None,
    plugin_toml: Mapping[str, Any] | None = None,
    base_dir: str = ".",
) -> DownscaleConfig:
    """Merge and validate the three sources; raise :class:`ConfigError` listing every problem.

    ``network_args`` holds the plugin's keys with the ``ds_`` prefix already stripped (see
    :func:`split_network_args`). A ``downscale_config`` path found in ``network_args`` or ``table``
    is read here (relative to ``base_dir``) unless ``plugin_toml`` is given directly.
    """
    problems: list[str] = []
    args_src = _normalize_source(network_args or {}, "network_args", problems, strings=True)
    table_src = _normalize_source(table or {}, "plugins.downscale", problems, strings=False)
    # Pop from both sources: the higher one wins, and neither may leak into the merged keys.
    args_path = args_src.pop("downscale_config", None)
    table_path = table_src.pop("downscale_config", None)
    path = args_path or table_path
    sources = [name for name, src in (("network_args", network_args), ("plugins.downscale", table)) if src]
    file_src: dict[str, Any] = {}
    if plugin_toml is None and path:
        full = path if os.path.isabs(path) else os.path.join(base_dir, path)
        try:
            plugin_toml = read_plugin_toml(full)
        except ConfigError as err:
            problems.extend(err.problems)
        sources.append(full)
    if plugin_toml is not None:
        file_src = _normalize_source(plugin_toml, "downscale_config", problems, strings=False)
        if "downscale_config" in file_src:
            problems.append("[downscale_config] downscale_config: a plugin TOML cannot name another plugin TOML")
            file_src.pop("downscale_config")
        if not path:
            sources.append("downscale_config")
    merged: dict[str, Any] = {**file_src, **table_src, **args_src}
    rules: list[RouteRule] = []
    raw_routes = merged.pop("routes", [])
    for i, route_table in enumerate(raw_routes):
        rule = _parse_route(i, route_table, i == len(raw_routes) - 1, problems)
        if rule is not None:
            rules.append(rule)
    if len(rules) == len(raw_routes):
        _check_routes(rules, problems)
    # A value that was itself rejected is already reported; "no routes" or "map_out required" would mislead.
    rejected = {
        key for raw, src in ((network_args, args_src), (table, table_src), (plugin_toml, file_src)) for key in raw or {} if key not in src
    }
    routes_rejected = "routes" in rejected or "mode" in rejected
    # Without routes the plugin can still add the direction loss (FasterDiT's term on its own); a map derives them.
    mapping = merged.get("mode") in ("map", "auto")
    if merged.get("enable", True) and not raw_routes and not routes_rejected and not merged.get("direction_loss_weight") and not mapping:
        problems.append(
            'routes: at least one route is required while enable = true, mode = "train" and direction_loss_weight = 0 '
            '(e.g. route = "1024:768", sigma_min = 0.65, sigma_max = 0.95)'
        )
    problems += _mode_problems(merged, bool(raw_routes), rejected)
    if problems:
        raise ConfigError(problems)
    return _build(merged, tuple(rules), tuple(sources))
