"""Certify once, reuse: certified windows in a user cache, keyed by what they depend on, and files to share.

A certification's verdicts are evidence about one base model (its file) and the text encoders and VAE the
host trains with (their files), one adapter type and rank, the run's buckets (the windows serve only the
measured tiers, ``certify.scope_text``), the σ law the run draws from (what a bin is worth and so what was
tested), the loss settings that shape the gradient, the host's functions the draws run through (their source),
the certifier's own code (its source, :func:`certifier_code`), at one question: the routes, the σ bins, ε and
α. :class:`WindowsKey` holds exactly these; a later run with the same key routes by the stored windows without
a probe pass, and one with another key is told which fields differ.

The cache is a folder of entry files, ``<key digest>.toml`` (:func:`cache_dir`). An entry is also the file users
export and import, so a community can share windows per base model: its ``key`` table, what the certification
cost, how it ended (:data:`OUTCOMES`) with the horizon and budget it had, and the windows TOML exactly as the
certifier wrote it (``certify.windows_toml``) with its sha256, validated on every read (:func:`read_entry`: each
problem names its key; the windows must lie inside the key's routes, bins and [0, 1] and match their digest).

A certification that ended with no safe window only because the run could not buy a verdict (its stake, its
budget, its horizon) is a provisional entry: reused only by a run that could not buy more either
(:meth:`Entry.recertify_reasons`). One run certifies a key at a time (:class:`KeyLock`).

The model's identity is the sha256 of its whole file (:func:`file_hash`), the digest model hubs publish: a
hash of a few chunks would take two fine-tunes that differ only in the unsampled tensors for one model. A
whole read of a 24 GB file is the price of soundness; it is paid once per file, the digest being remembered
per (path, size, modification time) in the cache folder.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from functools import cache
from typing import Any

import toml
import torch

from ..arch import get_arch
from ..bins import parse_bins
from ..config import ConfigError, RouteRule, load_config
from . import certify

try:
    import fcntl
except ImportError:  # not POSIX: no certification lock (KeyLock)
    fcntl = None  # type: ignore[assignment]

FORMAT = "downscale-plugin windows 2"
# Formats an older plugin wrote, and why their entries are not used (read as a miss that says so, never a crash).
OLD_FORMATS = {
    "downscale-plugin windows 1": "its key names the package version, not the certifier's code, the host's revision, "
    "the loss settings or the text encoders and VAE"
}
CACHE_ENV = "DOWNSCALE_PLUGIN_CACHE"
HASH_MEMO = ".file_hashes.json"  # path -> (size, mtime_ns, sha256) of model files already hashed
ENTRY_KEYS = ("format", "cost", "date", "origin", "version", "outcome", "horizon", "budget", "windows_digest", "windows", "key")

# How a certification ended (an entry's ``outcome``). The last three are provisional: the run could not buy a verdict,
# and a run that can buy more (a longer horizon, a larger budget) certifies again (Entry.recertify_reasons).
SAFE, NONE_SAFE, STAKE, BUDGET, HORIZON = "safe", "none_safe", "stake", "budget", "horizon"
OUTCOMES = {
    SAFE: "safe windows",
    NONE_SAFE: "no safe window, every test the plan could run read to its verdict",
    STAKE: "no safe window; a test was not started: it would have put more than the plan's stake at risk",
    BUDGET: "no safe window; a test's evidence did not fit the budget",
    HORIZON: "no safe window; a test's window could not have saved its evidence back over the run's later passes",
}
PROVISIONAL = (STAKE, BUDGET, HORIZON)
LOCK_WAIT_S = 600.0  # how long a run waits for another run certifying its key (KeyLock.wait) before certifying anew

# The code that decides a verdict or a window, whose source is the key's ``code`` (certifier_code): one place, with
# the reason; a host adds the modules its draws run through (hosts/kohya/auto.py AutoSession.code_modules).
CERTIFIER_MODULES = {
    "downscale_plugin.mapping.certify": "the plan, the search, the pay rules and every verdict",
    "downscale_plugin.mapping.sequential": "the looks, the bound and the verdict rules, the family's levels",
    "downscale_plugin.mapping.safe_read": "the safe read's calibrated constant",
    "downscale_plugin.mapping.estimator": "each draw's gradient (param_grads), the arms' keys",
    "downscale_plugin.mapping.paired": "the coupled noise of a route's draw",
    "downscale_plugin.mapping.arms": "a route's small latent",
    "downscale_plugin.mapping.windows": "windows from verdicts, tier rules",
    "downscale_plugin.mapping.in_run": "a run's settings: horizon, budget, pass costs",
    "downscale_plugin.bins": "the σ bins",
    "downscale_plugin.grid": "a route's small grid per bucket",
    "downscale_plugin.flops": "a pass's cost (the FLOP model): the plan's order and pay rule",
    "downscale_plugin.rng": "the forked, seeded generators of every draw",
}


class EntryError(ValueError):
    """A windows file that is not a valid cache entry; every problem names its key (and the file and entry key)."""

    def __init__(self, path: str, problems: Sequence[str], key: WindowsKey | None = None):
        self.path, self.problems = path, list(problems)
        self.where = f"{path} (key {key.digest()})" if key is not None else path
        super().__init__(f"{self.where}: not a valid downscale-plugin windows file:\n  - " + "\n  - ".join(self.problems))


class OldEntry(EntryError):
    """An entry an older plugin wrote (:data:`OLD_FORMATS`): never used, certified anew."""


@cache
def certifier_code(extra: tuple[str, ...] = ()) -> str:
    """The certifier's code identity: sha256 of the source files of :data:`CERTIFIER_MODULES` and the ``extra``
    modules (a host's), read from the installed files when the run starts (not the package version, which stays
    the same across changes to them)."""
    digest = hashlib.sha256()
    for name in (*CERTIFIER_MODULES, *extra):
        path = importlib.import_module(name).__file__ or ""
        with open(path, "rb") as fh:
            digest.update(name.encode() + b"\0" + fh.read() + b"\0")
    return "sha256:" + digest.hexdigest()[:16]


def source_digest(objects: Iterable[Any]) -> str:
    """A host's revision as the key records it: sha256 of the source of each function or class (a host fills the
    ones its steps and σ draws call), named by module and qualified name; one without source counts as its name."""
    parts = []
    for obj in objects:
        name = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
        try:
            text = inspect.getsource(inspect.unwrap(obj))
        except (OSError, TypeError):
            text = "<no source>"
        parts.append(f"{name}\0{text}")
    return "sha256:" + hashlib.sha256("\0\0".join(sorted(parts)).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class WindowsKey:
    """What certified windows depend on. The host fills ``model`` (:func:`file_hash` of the base model files),
    ``encoders`` (the text encoders' and VAE's files it trains with, hashed alike), ``arch``, ``network`` (the adapter's
    module), ``rank``, ``buckets`` (latent ``HxW``), ``sampler`` (:func:`sampler_fingerprint`), ``loss`` (its
    settings that change the gradient), ``host`` and ``host_revision`` (:func:`source_digest` of the host functions the
    plugin calls) and ``code`` (:func:`certifier_code`); the certification fills the rest."""

    model: str
    encoders: str
    arch: str
    network: str
    rank: int | None
    buckets: tuple[str, ...]
    sampler: str
    loss: str
    host: str
    host_revision: str
    code: str
    ratios: tuple[float, ...]
    bins: str
    margin: float
    alpha: float

    def __post_init__(self) -> None:  # one spelling per key: bucket and ratio order carry no meaning
        object.__setattr__(self, "buckets", tuple(sorted(set(self.buckets))))
        object.__setattr__(self, "ratios", tuple(sorted({float(r) for r in self.ratios}, reverse=True)))
        object.__setattr__(self, "margin", float(self.margin))
        object.__setattr__(self, "alpha", float(self.alpha))

    def digest(self) -> str:
        """16 hex digits of the sha256 of the key's canonical JSON: the entry's file name."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def differences(self, other: WindowsKey) -> list[str]:
        """Each field on which ``other`` (a cached entry's key) differs from this run's, with both values."""
        return [
            f"{f.name}: cached {getattr(other, f.name)!r}, this run {getattr(self, f.name)!r}"
            + (f" ({_CHANGED[f.name]})" if f.name in _CHANGED else "")
            for f in fields(self)
            if getattr(other, f.name) != getattr(self, f.name)
        ]

    def to_toml(self) -> dict[str, Any]:
        blob = asdict(self)
        if blob["rank"] is None:
            del blob["rank"]  # TOML has no null: an unknown rank is an absent key
        return {**blob, "buckets": list(self.buckets), "ratios": list(self.ratios)}


_CHANGED = {"code": "the certifier's code changed since", "host_revision": "the host's functions changed since"}
_KEY_KINDS = {
    f.name: {"rank": int, "margin": float, "alpha": float, "buckets": list, "ratios": list}.get(f.name, str) for f in fields(WindowsKey)
}
_KIND_TEXT = {str: "a non-empty string", int: "an integer", float: "a number", list: "a non-empty array"}


def key_from_toml(table: Any) -> tuple[WindowsKey | None, list[str]]:
    """A ``key`` table as a :class:`WindowsKey`, or the problems, each naming ``key.<field>`` (``rank`` may be absent)."""
    if not isinstance(table, Mapping):
        return None, [f"key: must be a table with the keys {', '.join(_KEY_KINDS)}"]
    problems = [f"key.{name}: unknown key (allowed: {', '.join(_KEY_KINDS)})" for name in table if name not in _KEY_KINDS]
    for name, kind in _KEY_KINDS.items():
        value = table.get(name)
        if value is None:
            if name != "rank":
                problems.append(f"key.{name}: missing")
            continue
        ok = (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if kind is float
            else isinstance(value, kind) and not isinstance(value, bool) and bool(value)
        )
        if ok and name == "buckets":
            ok = all(isinstance(b, str) and _is_grid(b) for b in value)
        if ok and name == "ratios":
            ok = all(isinstance(r, (int, float)) and not isinstance(r, bool) and 0.0 < r < 1.0 for r in value)
        if ok and name == "bins":
            ok = _edges(value) is not None
        if ok and name == "arch":
            ok = _arch_known(value)
        if not ok:
            what = {
                "buckets": 'an array of latent grids "HxW"',
                "ratios": "an array of ratios strictly between 0 and 1",
                "bins": "σ bins as map_bins writes them ('0,0.1,4:0.1,1,8' or an edge list)",
                "arch": "a known architecture",
            }
            problems.append(f"key.{name}: {value!r} must be {what.get(name, _KIND_TEXT[kind])}")
    if problems:
        return None, problems
    return WindowsKey(**{name: table.get(name) for name in _KEY_KINDS}), []


def _is_grid(text: str) -> bool:
    h, sep, w = text.partition("x")
    return bool(sep) and h.isdigit() and w.isdigit()


def _edges(spec: str) -> tuple[float, ...] | None:
    try:
        return parse_bins(spec).edges
    except ValueError:
        return None


def _arch_known(name: str) -> bool:
    try:
        get_arch(name)
    except ValueError:
        return False
    return True


def cache_dir(override: str | None = None) -> str:
    """The cache folder: ``override`` (the ``certify_cache`` key, the CLI's ``--cache``), else ``$DOWNSCALE_PLUGIN_CACHE``,
    else ``$XDG_CACHE_HOME/downscale_plugin/windows``, else ``~/.cache/downscale_plugin/windows``."""
    chosen = override or os.environ.get(CACHE_ENV)
    if not chosen:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        chosen = os.path.join(base, "downscale_plugin", "windows")
    return os.path.abspath(os.path.expanduser(chosen))


def file_hash(path: str, directory: str | None = None) -> str:
    """``sha256:<hex>`` of the whole file at ``path``, remembered in ``directory`` (the cache folder) per
    (real path, size, modification time): a file rewritten in place keeping both would keep its old digest."""
    real = os.path.realpath(path)
    stat = os.stat(real)
    memo_path = os.path.join(directory or cache_dir(), HASH_MEMO)
    try:
        with open(memo_path) as fh:
            memo = json.load(fh)
    except (OSError, ValueError):
        memo = {}
    known = memo.get(real)
    if isinstance(known, dict) and known.get("size") == stat.st_size and known.get("mtime_ns") == stat.st_mtime_ns:
        return known["sha256"]
    digest = hashlib.sha256()
    with open(real, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 23), b""):
            digest.update(chunk)
    value = f"sha256:{digest.hexdigest()}"
    memo[real] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": value}
    try:
        _write_atomic(memo_path, json.dumps(memo, indent=1))
    except OSError:
        pass  # an unwritable cache only costs the next run the read again
    return value


def sampler_fingerprint(sampler: Any, grids: Sequence[tuple[int, int]], n: int = 8192) -> str:
    """The σ law a run draws from, as a key records it: the deciles (4 decimals) of ``n`` draws of ``sampler``
    (``plan.Sampler``) from a fixed generator at the smallest and the largest of ``grids`` (the law of a shifted
    sampler depends on the grid). Every host setting that moves the law moves these; the draws are the host's own."""
    by_size = sorted(set(grids), key=lambda hw: (hw[0] * hw[1], hw))
    parts = []
    for hw in dict.fromkeys([by_size[0], by_size[-1]]):
        sigmas = sampler.sample(n, hw, torch.Generator().manual_seed(0)).double()
        deciles = torch.quantile(sigmas, torch.linspace(0.1, 0.9, 9, dtype=torch.float64))
        parts.append(f"{hw[0]}x{hw[1]}: " + " ".join(f"{v:.4f}" for v in deciles.tolist()))
    return "σ deciles at " + "; ".join(parts)


def windows_digest(text: str) -> str:
    """``sha256:<hex>`` of a windows TOML text: an entry carries it, and a read whose windows do not match it is refused."""
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _passes(horizon: float) -> str:
    return "no pay rule" if math.isinf(horizon) else f"{horizon:g} later passes"


@dataclass(frozen=True)
class Entry:
    """One cached certification: its key, what it cost (native-step equivalents), when and by what command (and plugin
    version), how it ended (:data:`OUTCOMES`) with the horizon (the later passes its windows were to pay back over;
    inf: no pay rule) and budget (native-step equivalents) it had, and the windows TOML text the plugin reads
    (``downscale_config=``)."""

    key: WindowsKey
    cost: float
    date: str
    origin: str
    windows_text: str
    outcome: str
    horizon: float
    budget: float
    version: str = ""
    path: str = ""

    def windows(self) -> dict[str, Any]:
        return toml.loads(self.windows_text)

    def recertify_reasons(self, horizon: float, budget: float) -> list[str]:
        """Why a run with ``horizon`` later passes and ``budget`` could buy evidence this entry's certification could
        not: a provisional outcome (:data:`PROVISIONAL`) met by a longer horizon or a larger budget. Empty: reuse it."""
        if self.outcome not in PROVISIONAL:
            return []
        reasons = []
        if horizon > self.horizon * (1 + 1e-9):
            reasons.append(f"a longer horizon (this run {_passes(horizon)}, the cached certification {_passes(self.horizon)})")
        if budget > self.budget * (1 + 1e-9):
            reasons.append(f"a larger budget (this run {budget:.1f}, the cached certification {self.budget:.1f} native-step equivalents)")
        return reasons

    def ended(self) -> str:
        """How the certification ended, in words, with its horizon and budget."""
        return f"ended {self.outcome!r} ({OUTCOMES[self.outcome]}) with {_passes(self.horizon)} and budget {self.budget:.1f}"

    def render(self) -> str:
        """The entry file: the windows as a multi-line literal string, readable as the certifier wrote them (a
        quoted one-line string when that would not read back the same)."""
        head = toml.dumps(
            {
                "format": FORMAT,
                "cost": self.cost,
                "date": self.date,
                "origin": self.origin,
                "version": self.version,
                "outcome": self.outcome,
                "horizon": self.horizon,
                "budget": self.budget,
                "windows_digest": windows_digest(self.windows_text),
            }
        )
        key = "\n" + toml.dumps({"key": self.key.to_toml()})
        literal = head + f"windows = '''\n{self.windows_text}'''\n" + key
        try:
            if toml.loads(literal)["windows"] == self.windows_text:
                return literal
        except toml.TomlDecodeError:
            pass
        return head + toml.dumps({"windows": self.windows_text}) + key


def outcome_of(result: certify.CertifyResult, windows_text: str) -> str:
    """How a certification ended (:data:`OUTCOMES`): safe when its windows route; else by the searched tests' (not the
    spot checks') unfinished verdicts, the stake first, then the budget, then the horizon (``cost``)."""
    if toml.loads(windows_text).get("routes"):
        return SAFE
    ended = {t.verdict for t in result.tests if not t.spot}
    for verdict, outcome in ((certify.STAKE, STAKE), (certify.BUDGET, BUDGET), (certify.COST, HORIZON)):
        if verdict in ended:
            return outcome
    return NONE_SAFE


def entry_of(key: WindowsKey, result: certify.CertifyResult, windows_text: str, cost: float, date: str, origin: str = "") -> Entry:
    """The cache entry of a certification (``result``) whose windows TOML is ``windows_text``: its outcome, horizon
    (inf without a pay rule), budget and the plugin version its backend recorded, from the result."""
    s = result.settings
    horizon = math.inf if s.horizon is None else float(s.horizon)
    version = str(result.provenance.get("backend", {}).get("plugin_version") or "")
    return Entry(key, float(cost), date, origin, windows_text, outcome_of(result, windows_text), horizon, float(s.budget), version)


def windows_problems(text: Any, key: WindowsKey | None = None, outcome: str | None = None) -> list[str]:
    """What is wrong with a windows TOML text (``windows: …``), checked as the plugin would read it, and against
    ``key``: the windows' ``arch`` and ``windows_margin`` must be the key's and every route inside the key's routes,
    buckets' tiers, bins and [0, 1] (:func:`route_problems`); against ``outcome``: routes exactly when it is safe."""
    if not isinstance(text, str) or not text.strip():
        return ["windows: must be the windows TOML text (a string)"]
    try:
        doc = toml.loads(text)
    except toml.TomlDecodeError as err:
        return [f"windows: not valid TOML: {err}"]
    try:
        routes = load_config(plugin_toml=doc).routes
    except ConfigError as err:
        return [f"windows: {p}" for p in err.problems]
    problems = []
    if key is not None and doc.get("arch") != key.arch:
        problems.append(f"windows: arch {doc.get('arch')!r} is not the key's arch {key.arch!r}")
    if key is not None and doc.get("windows_margin") not in (None, key.margin):
        problems.append(f"windows: windows_margin {doc['windows_margin']!r} is not the key's margin {key.margin!r}")
    if key is not None:
        problems += route_problems(routes, key)
    if outcome == SAFE and not routes:
        problems.append("outcome: 'safe', but the windows open no route")
    if outcome in OUTCOMES and outcome != SAFE and routes:
        problems.append(f"outcome: {outcome!r} (no safe window), but the windows open {len(routes)} route(s)")
    return problems


def route_problems(routes: Sequence[RouteRule], key: WindowsKey) -> list[str]:
    """Each route the certification under ``key`` could not have written: a ratio not among the key's (a tier rule
    ``E:T`` is the whole pixel count next to E × a key ratio), a tier no bucket of the key is in, a σ edge not on the
    key's bins, or a window outside [0, 1]."""
    edges, problems = _edges(key.bins), []
    if edges is None or not _arch_known(key.arch):
        return []  # named by key_from_toml
    factor = get_arch(key.arch).vae_factor
    tiers = {round(math.sqrt(int(h) * int(w)) * factor) for h, _, w in (b.partition("x") for b in key.buckets)}
    for i, r in enumerate(routes, 1):
        where = f"windows: route {i} ({r.label} {r.window_text()})"
        if r.scale is not None:
            ratio_ok = any(abs(r.scale - k) < 1e-9 for k in key.ratios)
        else:
            ratio_ok = any(abs(r.target - r.native * k) <= 1.5 for k in key.ratios)
            if r.native not in tiers:
                problems.append(f"{where}: tier {r.native} px is not a tier of the key's buckets ({', '.join(map(str, sorted(tiers)))} px)")
        if not ratio_ok:
            problems.append(f"{where}: ratio {r.ratio:g} is not one of the key's ratios {list(key.ratios)}")
        for name, sigma in (("sigma_min", r.sigma_min), ("sigma_max", r.sigma_max)):
            if sigma is None:
                continue
            if not 0.0 <= sigma <= 1.0:
                problems.append(f"{where}: {name} {sigma:g} is outside [0, 1]")
            elif not any(abs(sigma - e) < 1e-9 for e in edges):
                problems.append(f"{where}: {name} {sigma:g} is not an edge of the key's bins {key.bins}")
    return problems


def _number(doc: Mapping[str, Any], name: str, low: float, what: str, infinite: bool = False) -> tuple[float | None, list[str]]:
    value = doc.get(name)
    if value is None:
        return None, [f"{name}: missing ({what})"]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or math.isnan(value) or (math.isinf(value) and not infinite) or value < low:
        return None, [f"{name}: {value!r} must be a number >= {low:g}{' (inf: none)' if infinite else ''} ({what})"]
    return float(value), []


def read_entry(path: str) -> Entry:
    """The entry in ``path``, validated; raises :class:`EntryError` naming every problem (:class:`OldEntry` for an
    older plugin's format)."""
    try:
        with open(path) as fh:
            doc = toml.load(fh)
    except OSError as err:
        raise EntryError(path, [f"cannot read: {err}"]) from None
    except toml.TomlDecodeError as err:
        raise EntryError(path, [f"not valid TOML: {err}"]) from None
    fmt = doc.get("format")
    if fmt in OLD_FORMATS:
        raise OldEntry(
            path, [f"format: {fmt!r} is an older plugin's entry ({OLD_FORMATS[fmt]}): not used; re-certify (a run of its key does)"]
        )
    problems = [f"{name}: unknown key (allowed: {', '.join(ENTRY_KEYS)})" for name in doc if name not in ENTRY_KEYS]
    if fmt != FORMAT:
        problems.append(f"format: {fmt!r} (allowed: {FORMAT!r})")
    cost, bad = _number(doc, "cost", 0.0, "the native-step equivalents the certification spent")
    problems += bad
    horizon, bad = _number(doc, "horizon", 0.0, "the later passes the windows were to pay back over", infinite=True)
    problems += bad
    budget, bad = _number(doc, "budget", 0.0, "the certification's budget, native-step equivalents")
    problems += bad
    outcome = doc.get("outcome")
    if outcome not in OUTCOMES:
        problems.append(f"outcome: {outcome!r} (allowed: {', '.join(OUTCOMES)})")
    for name in ("date", "origin", "version"):
        if not isinstance(doc.get(name, ""), str):
            problems.append(f"{name}: {doc[name]!r} must be a string")
    key, key_problems = key_from_toml(doc.get("key"))
    problems += key_problems + windows_problems(doc.get("windows"), key, outcome)
    text = doc.get("windows")
    if isinstance(text, str) and doc.get("windows_digest") != windows_digest(text):
        problems.append(
            "windows_digest: "
            + ("missing" if "windows_digest" not in doc else f"{doc['windows_digest']!r} is not the windows' {windows_digest(text)!r}")
            + ": the windows are not the ones the certifier wrote (edited?); an entry is used only as certified: re-certify, "
            "or export and import it again from where it was certified"
        )
    if problems:
        raise EntryError(path, problems, key)
    return Entry(key, cost, doc.get("date", ""), doc.get("origin", ""), text, outcome, horizon, budget, doc.get("version", ""), path)  # type: ignore[arg-type]


def _write_atomic(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def entry_path(key: WindowsKey, directory: str | None = None) -> str:
    return os.path.join(directory or cache_dir(), f"{key.digest()}.toml")


def store(entry: Entry, directory: str | None = None) -> str:
    """Cache ``entry`` under its key (replacing an entry of the same key); returns the file."""
    problems = windows_problems(entry.windows_text, entry.key, entry.outcome)
    if problems:
        raise EntryError("windows to cache", problems, entry.key)
    path = entry_path(entry.key, directory)
    _write_atomic(path, entry.render())
    return path


def entries(directory: str | None = None) -> tuple[list[Entry], list[EntryError]]:
    """Every valid entry in the cache, and the error of each file that is not one."""
    folder = directory or cache_dir()
    found, bad = [], []
    names = sorted(n for n in os.listdir(folder) if n.endswith(".toml")) if os.path.isdir(folder) else []
    for name in names:
        try:
            found.append(read_entry(os.path.join(folder, name)))
        except EntryError as err:
            bad.append(err)
    return found, bad


@dataclass(frozen=True)
class Lookup:
    """A cache answer: the entry to reuse (None: certify), and why, for the banner."""

    entry: Entry | None
    reason: str


def lookup(key: WindowsKey, directory: str | None = None, horizon: float = math.inf, budget: float = math.inf) -> Lookup:
    """The cached entry of ``key`` for a run with ``horizon`` later passes and ``budget`` (native-step equivalents), or
    why there is none: a refused entry, a provisional one this run can buy more than (:meth:`Entry.recertify_reasons`),
    or the nearest entry (fewest differing fields, same model first) and each field it differs on."""
    folder = directory or cache_dir()
    path = entry_path(key, folder)
    if os.path.isfile(path):
        try:
            entry = read_entry(path)
        except OldEntry:
            entry = None  # counted with the other old entries below
        except EntryError as err:
            return Lookup(None, f"the cached entry is refused, certifying anew: {err}")
        if entry is not None and entry.key == key:
            reasons = entry.recertify_reasons(horizon, budget)
            if reasons:
                return Lookup(
                    None,
                    f"the cached certification {path} (key {key.digest()}) {entry.ended()}; this run can buy more evidence: "
                    f"{' and '.join(reasons)}: certifying anew (continuing nothing)",
                )
            what = "windows" if entry.outcome == SAFE else f"verdict ({entry.ended()}; this run could buy no more)"
            return Lookup(entry, f"cached {what} {path} (key {key.digest()}, certified {entry.date or '?'} for {entry.cost:.1f})")
    cached, bad = entries(folder)
    old = [err for err in bad if isinstance(err, OldEntry)]
    stale = (
        f"; {len(old)} entr{'y' if len(old) == 1 else 'ies'} of an older plugin's format not read (re-certified as their runs come)"
        if old
        else ""
    )
    if not cached:
        return Lookup(None, f"no cached windows in {folder}{stale}")
    nearest = min(cached, key=lambda e: (e.key.model != key.model, len(key.differences(e.key))))
    differs = key.differences(nearest.key)
    return Lookup(
        None,
        f"no cached windows for key {key.digest()} in {folder}{stale}; the nearest of its {len(cached)} entries, "
        f"{os.path.basename(nearest.path)}, differs in:\n    - " + "\n    - ".join(differs),
    )


class KeyLock:
    """One certification of a key at a time: ``<key digest>.lock`` in the cache folder, held (``fcntl.flock``) from a
    certifying run's start until its entry is written or the run ends. The kernel releases it when the process dies,
    so a crashed run never blocks a later one. Where no lock can be taken (not POSIX, an unwritable folder) a run
    certifies as if it held it."""

    def __init__(self, key: WindowsKey, directory: str | None = None):
        self.path = os.path.join(directory or cache_dir(), f"{key.digest()}.lock")
        self._fh: Any = None

    def acquire(self) -> bool:
        """Take the lock if it is free; True when this run holds it (or none can be taken here), False when another has it."""
        if self._fh is not None or fcntl is None:
            return True
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fh = open(self.path, "a")  # noqa: SIM115  # held open while locked
        except OSError:
            return True
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.close()
            return False
        self._fh = fh
        return True

    def wait(self, seconds: float, poll: float = 0.5) -> bool:
        """Take the lock, waiting up to ``seconds`` for the run that holds it; False when it still does."""
        deadline = time.monotonic() + seconds
        while not self.acquire():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(poll, left))
        return True

    def release(self) -> None:
        """Let the next run of the key certify; idempotent."""
        if self._fh is not None:
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None


def find_entry(ref: str, directory: str | None = None) -> Entry:
    """An entry by file path or by a prefix of its key digest; a ValueError says what matched."""
    if os.path.isfile(ref):
        return read_entry(ref)
    cached, _ = entries(directory)
    matches = [e for e in cached if os.path.basename(e.path).startswith(ref)]
    if len(matches) != 1:
        names = ", ".join(os.path.basename(e.path) for e in matches) or "none"
        raise ValueError(f"{ref!r}: {len(matches)} cached entries match ({names}); give a longer digest prefix or a file path")
    return matches[0]


def provenance(entry: Entry) -> list[str]:
    """What an entry is, for ``windows import`` to show before it stores it: its key, how and when it was certified,
    what it cost and what it routes."""
    k = entry.key
    routes = load_config(plugin_toml=entry.windows()).routes
    return [
        f"key {k.digest()}: {k.arch} on {k.host} (host revision {k.host_revision}), model {k.model}, encoders {k.encoders}, "
        f"{k.network} rank {k.rank if k.rank is not None else '?'}, buckets {', '.join(k.buckets)}, {k.sampler}, loss {k.loss}, "
        f"certifier code {k.code}; ratios {list(k.ratios)}, bins {k.bins}, ε {k.margin:g}, α {k.alpha:g}",
        f"certified {entry.date or '?'} by {entry.origin or '?'} (plugin {entry.version or '?'}) for {entry.cost:.1f} native-step "
        f"equivalents; {entry.ended()}",
        "windows: " + ("; ".join(f"{r.label} {r.window_text()}" for r in routes) or "none (the run trains native)"),
    ]


def import_entry(entry: Entry, directory: str | None = None, replace: bool = False) -> str:
    """Add a validated entry (:func:`read_entry`) to the cache; an entry of the same key with other windows is kept
    unless ``replace``. Returns the cached file."""
    dest = entry_path(entry.key, directory)
    if os.path.isfile(dest) and not replace:
        try:
            same = read_entry(dest).windows_text == entry.windows_text
        except EntryError:
            same = False
        if not same:
            raise ValueError(f"{dest}: the cache already holds other windows for this key; --replace replaces them")
    _write_atomic(dest, entry.render())
    return dest
