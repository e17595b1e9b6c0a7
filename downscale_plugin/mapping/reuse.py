"""Certify once, reuse: certified windows in a user cache, keyed by what they depend on, and files to share.

A certification's verdicts are evidence about one base model (its file), one adapter type and rank, the
run's buckets (the windows serve only the measured tiers, ``certify.scope_text``), the σ law the run draws
from (what a bin is worth and so what was tested), the host and the plugin's code, at one question: the
routes, the σ bins, ε and α. :class:`WindowsKey` holds exactly these; a later run with the same key routes by
the stored windows without a probe pass, and one with another key is told which fields differ.

The cache is a folder of entry files, ``<key digest>.toml`` (:func:`cache_dir`). An entry is also the file users
export and import, so a community can share windows per base model: its ``key`` table, what the certification
cost, and the windows TOML exactly as the certifier wrote it (``certify.windows_toml``), validated on every read
(:func:`read_entry`: each problem names its key).

The model's identity is the sha256 of its whole file (:func:`file_hash`), the digest model hubs publish: a
hash of a few chunks would take two fine-tunes that differ only in the unsampled tensors for one model. A
whole read of a 24 GB file is the price of soundness; it is paid once per file, the digest being remembered
per (path, size, modification time) in the cache folder.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import toml
import torch

from ..config import ConfigError, load_config

FORMAT = "downscale-plugin windows 1"
CACHE_ENV = "DOWNSCALE_PLUGIN_CACHE"
HASH_MEMO = ".file_hashes.json"  # path -> (size, mtime_ns, sha256) of model files already hashed
ENTRY_KEYS = ("format", "cost", "date", "origin", "windows", "key")


class EntryError(ValueError):
    """A windows file that is not a valid cache entry; every problem names its key."""

    def __init__(self, path: str, problems: Sequence[str]):
        self.path, self.problems = path, list(problems)
        super().__init__(f"{path}: not a valid downscale-plugin windows file:\n  - " + "\n  - ".join(self.problems))


@dataclass(frozen=True)
class WindowsKey:
    """What certified windows depend on. The host fills ``model`` (:func:`file_hash` of the base model file),
    ``arch``, ``network`` (the adapter's module), ``rank``, ``buckets`` (latent ``HxW``), ``sampler``
    (:func:`sampler_fingerprint`) and ``host``; the certification fills the rest."""

    model: str
    arch: str
    network: str
    rank: int | None
    buckets: tuple[str, ...]
    sampler: str
    host: str
    version: str
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
            for f in fields(self)
            if getattr(other, f.name) != getattr(self, f.name)
        ]

    def to_toml(self) -> dict[str, Any]:
        blob = asdict(self)
        if blob["rank"] is None:
            del blob["rank"]  # TOML has no null: an unknown rank is an absent key
        return {**blob, "buckets": list(self.buckets), "ratios": list(self.ratios)}


_KEY_KINDS = {
    "model": str,
    "arch": str,
    "network": str,
    "rank": int,
    "buckets": list,
    "sampler": str,
    "host": str,
    "version": str,
    "ratios": list,
    "bins": str,
    "margin": float,
    "alpha": float,
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
        if not ok:
            what = {"buckets": 'an array of latent grids "HxW"', "ratios": "an array of ratios strictly between 0 and 1"}
            problems.append(f"key.{name}: {value!r} must be {what.get(name, _KIND_TEXT[kind])}")
    if problems:
        return None, problems
    return WindowsKey(**{name: table.get(name) for name in _KEY_KINDS}), []


def _is_grid(text: str) -> bool:
    h, sep, w = text.partition("x")
    return bool(sep) and h.isdigit() and w.isdigit()


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


@dataclass(frozen=True)
class Entry:
    """One cached certification: its key, what it cost (native-step equivalents), when and by what command,
    and the windows TOML text the plugin reads (``downscale_config=``)."""

    key: WindowsKey
    cost: float
    date: str
    origin: str
    windows_text: str
    path: str = ""

    def windows(self) -> dict[str, Any]:
        return toml.loads(self.windows_text)

    def render(self) -> str:
        """The entry file: the windows as a multi-line literal string, readable as the certifier wrote them (a
        quoted one-line string when that would not read back the same)."""
        head = toml.dumps({"format": FORMAT, "cost": self.cost, "date": self.date, "origin": self.origin})
        key = "\n" + toml.dumps({"key": self.key.to_toml()})
        literal = head + f"windows = '''\n{self.windows_text}'''\n" + key
        try:
            if toml.loads(literal)["windows"] == self.windows_text:
                return literal
        except toml.TomlDecodeError:
            pass
        return head + toml.dumps({"windows": self.windows_text}) + key


def windows_problems(text: Any, key: WindowsKey | None = None) -> list[str]:
    """What is wrong with a windows TOML text (``windows: …``), checked as the plugin would read it, and against
    ``key``: the windows' ``arch`` and ``windows_margin`` must be the key's."""
    if not isinstance(text, str) or not text.strip():
        return ["windows: must be the windows TOML text (a string)"]
    try:
        doc = toml.loads(text)
    except toml.TomlDecodeError as err:
        return [f"windows: not valid TOML: {err}"]
    try:
        load_config(plugin_toml=doc)
    except ConfigError as err:
        return [f"windows: {p}" for p in err.problems]
    problems = []
    if key is not None and doc.get("arch") != key.arch:
        problems.append(f"windows: arch {doc.get('arch')!r} is not the key's arch {key.arch!r}")
    if key is not None and doc.get("windows_margin") not in (None, key.margin):
        problems.append(f"windows: windows_margin {doc['windows_margin']!r} is not the key's margin {key.margin!r}")
    return problems


def read_entry(path: str) -> Entry:
    """The entry in ``path``, validated; raises :class:`EntryError` naming every problem."""
    try:
        with open(path) as fh:
            doc = toml.load(fh)
    except OSError as err:
        raise EntryError(path, [f"cannot read: {err}"]) from None
    except toml.TomlDecodeError as err:
        raise EntryError(path, [f"not valid TOML: {err}"]) from None
    problems = [f"{name}: unknown key (allowed: {', '.join(ENTRY_KEYS)})" for name in doc if name not in ENTRY_KEYS]
    if doc.get("format") != FORMAT:
        problems.append(f"format: {doc.get('format')!r} (allowed: {FORMAT!r})")
    cost = doc.get("cost")
    if cost is None:
        problems.append("cost: missing (the native-step equivalents the certification spent)")
    elif isinstance(cost, bool) or not isinstance(cost, (int, float)) or not math.isfinite(cost) or cost < 0:
        problems.append(f"cost: {cost!r} must be a number >= 0 (native-step equivalents)")
    for name in ("date", "origin"):
        if not isinstance(doc.get(name, ""), str):
            problems.append(f"{name}: {doc[name]!r} must be a string")
    key, key_problems = key_from_toml(doc.get("key"))
    problems += key_problems + windows_problems(doc.get("windows"), key)
    if problems:
        raise EntryError(path, problems)
    return Entry(key, float(cost), doc.get("date", ""), doc.get("origin", ""), doc["windows"], path)


def _write_atomic(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def entry_path(key: WindowsKey, directory: str | None = None) -> str:
    return os.path.join(directory or cache_dir(), f"{key.digest()}.toml")


def store(key: WindowsKey, windows_text: str, cost: float, date: str, origin: str = "", directory: str | None = None) -> str:
    """Cache a certification's windows under ``key`` (replacing an entry of the same key); returns the file."""
    entry = Entry(key, float(cost), date, origin, windows_text)
    problems = windows_problems(windows_text, key)
    if problems:
        raise EntryError("windows to cache", problems)
    path = entry_path(key, directory)
    _write_atomic(path, entry.render())
    return path


def entries(directory: str | None = None) -> tuple[list[Entry], list[str]]:
    """Every valid entry in the cache, and a line for each file that is not one."""
    folder = directory or cache_dir()
    found, bad = [], []
    names = sorted(n for n in os.listdir(folder) if n.endswith(".toml")) if os.path.isdir(folder) else []
    for name in names:
        try:
            found.append(read_entry(os.path.join(folder, name)))
        except EntryError as err:
            bad.append(str(err))
    return found, bad


@dataclass(frozen=True)
class Lookup:
    """A cache answer: the entry to reuse (None: certify), and why, for the banner."""

    entry: Entry | None
    reason: str


def lookup(key: WindowsKey, directory: str | None = None) -> Lookup:
    """The cached entry of ``key``, or why there is none: the nearest entry (fewest differing fields, same model
    first) and each field it differs on."""
    folder = directory or cache_dir()
    path = entry_path(key, folder)
    if os.path.isfile(path):
        try:
            entry = read_entry(path)
        except EntryError as err:
            return Lookup(None, f"the cached entry is invalid, certifying anew: {err}")
        if entry.key == key:
            return Lookup(entry, f"cached windows {path} (key {key.digest()}, certified {entry.date or '?'} for {entry.cost:.1f})")
    cached, _ = entries(folder)
    if not cached:
        return Lookup(None, f"no cached windows in {folder}")
    nearest = min(cached, key=lambda e: (e.key.model != key.model, len(key.differences(e.key))))
    differs = key.differences(nearest.key)
    return Lookup(
        None,
        f"no cached windows for key {key.digest()} in {folder}; the nearest of its {len(cached)} entries, "
        f"{os.path.basename(nearest.path)}, differs in:\n    - " + "\n    - ".join(differs),
    )


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


def import_entry(path: str, directory: str | None = None, replace: bool = False) -> str:
    """Validate the windows file at ``path`` and add it to the cache; an entry of the same key with other
    windows is kept unless ``replace``. Returns the cached file."""
    entry = read_entry(path)
    dest = entry_path(entry.key, directory)
    if os.path.isfile(dest) and not replace:
        try:
            same = read_entry(dest).windows_text == entry.windows_text
        except EntryError:
            same = False
        if not same:
            raise ValueError(f"{dest}: the cache already holds other windows for this key; --replace replaces them")
    _write_atomic(dest, Entry(entry.key, entry.cost, entry.date, entry.origin, entry.windows_text).render())
    return dest
