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
and what is allowed, before any model is loaded. Each key's kind, allowed values and help are its
field's (``schema.setting``); the in-run measurements' key groups (``map_*``, ``certify_*``,
``windows_*``) and which keys go with which ``mode`` are ``certify_config.py``'s.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import toml

from .arch import ARCH_NAMES
from .certify_config import VAE_ARM_KEYS, CertifyConfig, MapConfig, WindowsProvenance, mode_problems
from .schema import ConfigError, check_fields, check_scalar, is_number, setting, suggest

GATES = ("coupled", "strict")
SIGMA_POLICIES = ("keep", "res_shift", "snr_match")  # σ a routed step runs at (fasterdit.policies)
POSITIONS = ("plain", "interpolate")  # position ids of a routed step (fasterdit.positions)
ATTENTIONS = ("plain", "proportional")  # a routed step's joint attention (attention.py)
MODES = ("train", "map", "auto")  # map: the full gradient map in the run; auto: certify windows in the run and train with them (mapping/)
AFTER_MAP = ("stop", "train")
HOST_CHECKS = ("error", "warn")  # the drift self-check's findings (hosts/kohya/selfcheck.py): refuse, or log, record and train on
SPAN_MODES = ("early", "late", "spread")
NETWORK_ARGS_PREFIX = "ds_"
UNPREFIXED_NETWORK_ARGS = ("inner", "downscale_config")
ROUTE_KEYS = ("route", "scale", "sigma_min", "sigma_max", "span", "name")


def require_gate(gate: str) -> None:
    """The one check of a gate name for code that takes it directly (the router, ``plan``)."""
    if gate not in GATES:
        raise ValueError(f"gate: {gate!r} is not allowed (allowed: {', '.join(GATES)})")


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


@dataclass(frozen=True)
class FasterDitConfig:
    """The options of routed (and native) steps: FasterDiT's (fasterdit/) and proportional attention
    (attention.py); TOML key = field name."""

    direction_loss_weight: float = setting(0.0, "float_min", 0.0, "FasterDiT's direction-loss λ (0: off)")
    direction_loss_only_routed: bool = setting(False, "bool", help="add the direction term only on routed steps")
    sigma_policy: str = setting("keep", "enum", SIGMA_POLICIES, "σ a routed step runs at")
    positions: str = setting("plain", "enum", POSITIONS, "position ids of a routed step")
    attention: str = setting(
        "plain",
        "enum",
        ATTENTIONS,
        "a routed step's joint attention: proportional adds ln(native/small tokens) = ln(1/r²) to the logits of image keys "
        "(text keys 0), as if each small token stood for the native tokens it averages; plain: the host's",
    )

    def __post_init__(self) -> None:
        check_fields(self)


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


def _group(settings: type) -> Any:
    """A nested settings field whose keys stay flat in every source: the group's ``prefix`` + the field's name."""
    return field(default_factory=settings, metadata={"group": getattr(settings, "prefix", "")})


@dataclass(frozen=True)
class DownscaleConfig:
    """The plugin's settings; each field's metadata is its key's schema (kind, allowed values, help)."""

    enable: bool = setting(True, "bool", help="turn the plugin off without removing the config")
    gate: str = setting("coupled", "enum", GATES, "coupled: exact σ marginal at any batch size; strict: every σ in the window")
    routes: tuple[RouteRule, ...] = setting((), "routes", help="router rules in priority order")
    seed: int | None = setting(None, "int", (0, None), "seeds the coupled gate's per-step draws (default: the run's --seed)")
    max_tries: int = setting(8, "int", (1, 64), "rejection rounds of the coupled gate before the rest is drawn directly")
    tier_tolerance: float = setting(0.1, "float", (0.0, 0.5), "a bucket is in tier E when √(W·H) is within this fraction of E")
    arch: str | None = setting(None, "enum", ARCH_NAMES, "the architecture (default: detected from the trainer)")
    inner: str | None = setting(None, "str", help="inner network module (default: the trainer's own LoRA module)")
    host_check: str = setting(
        "error", "enum", HOST_CHECKS, "a host function the drift self-check finds changed or uncallable: error, or warn"
    )
    fasterdit: FasterDitConfig = _group(FasterDitConfig)
    mode: str = setting(
        "train",
        "enum",
        MODES,
        "map: measure the gradient map in this run and derive the windows; auto: certify windows in the run and train with them",
    )
    after_map: str = setting("stop", "enum", AFTER_MAP, "after the map: stop, or train on with the derived windows")
    map: MapConfig = _group(MapConfig)
    certify: CertifyConfig = _group(CertifyConfig)
    windows: WindowsProvenance = _group(WindowsProvenance)
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


def _unknown(where: str, key: str, choices: Sequence[str]) -> str:
    return f"{where}{key}: unknown key{suggest(key, choices)} (allowed: {', '.join(sorted(choices))})"


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
        if not is_number(scale) or not 0.0 < scale < 1.0:
            problems.append(f"{where}.scale: {scale!r} must be a number strictly between 0 and 1 (a linear downscale ratio)")
            scale = None
        else:
            scale = float(scale)
    lo = table.get("sigma_min")
    hi = table.get("sigma_max")
    if lo is None:
        problems.append(f"{where}.sigma_min: required (the window is strict, sigma_min < σ < sigma_max)")
    elif not is_number(lo) or not 0.0 <= lo < 1.0:
        problems.append(f"{where}.sigma_min: {lo!r} must be a number in [0, 1)")
        lo = None
    if hi is None:
        if not is_last:
            problems.append(
                f"{where}.sigma_max: required: a rule with lower-priority rules after it needs an explicit window, "
                "otherwise it shadows them on all of (sigma_min, 1]"
            )
    elif not is_number(hi) or not 0.0 < hi <= 1.0:
        problems.append(f"{where}.sigma_max: {hi!r} must be a number in (0, 1]")
        hi = None
    elif lo is not None and is_number(lo) and hi <= lo:
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
        checked = check_scalar(shown, kind, allowed, value, problems)
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
    problems += mode_problems(merged, bool(raw_routes), rejected)
    if problems:
        raise ConfigError(problems)
    return _build(merged, tuple(rules), tuple(sources))
