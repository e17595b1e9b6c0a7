"""The in-run measurements' settings, one dataclass per key group: the certifier's (``certify_*``, ``mode = "auto"``,
mapping/certify.py), the map's (``map_*``, ``mode = "map"``; the certifier shares its routes, bins, ε and output
folder) and the provenance a windows file carries (``windows_*``).

Each field is one key: TOML key = the group's ``prefix`` + the field's name, spelled the same in
``[plugins.downscale]``, a plugin TOML and ``--network_args`` (``ds_certify_budget``). Its kind, allowed values and
help travel with it (``schema.setting``): ``config.load_config`` merges the sources and fills these groups, the
README's key table lists their help, and a group built directly checks itself, naming the key as written.
Which keys go with which ``mode`` is :func:`mode_problems`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from .arch import ARCH_NAMES
from .bins import DEFAULT_BINS
from .schema import check_fields, setting

VAE_ARM_KEYS = ("map_reenc", "map_pixel")  # the map's VAE arms (mapping/arms.py: reenc, pixel_<r>); the host must drive its VAE
DEFAULT_MAP_RATIOS = (0.875, 0.75, 0.5)
# The margin ε a safe bin's bound must stay below, by default: the largest the lab's time-to-quality study
# (docs/FIDELITY.md §10) found sooner than native, the only one of 0.05, 0.1, 0.2 whose windows were.
DEFAULT_MARGIN = 0.2
REUSE = ("on", "refresh", "off")  # certify_reuse: the windows cache of mode = "auto" (mapping/reuse.py)
CERTIFY_UNPAID = ("skip", "refuse", "buy")  # certify_unpaid: what an auto run does with evidence it cannot pay back
FOREIGN = ("error", "warn")


@dataclass(frozen=True)
class MapConfig:
    """The in-run gradient map's settings (``mode = "map"``, mapping/); TOML key = ``map_`` + field."""

    prefix: ClassVar[str] = "map_"

    ratios: tuple[float, ...] = setting(DEFAULT_MAP_RATIOS, "ratios", help="the map's linear ratios")
    bins: str = setting(DEFAULT_BINS, "bins", help="the map's σ bins")
    draws: int = setting(8, "int", (2, 4096), "noise draws per arm and bin (even)")
    images: int = setting(8, "int", (2, None), "probe samples from the run's first batches")
    margin: float = setting(DEFAULT_MARGIN, "float", (0.0, 1.0), "the margin ε a safe bin's upper bound must stay below")
    simultaneous: bool = setting(
        False, "bool", help="Bonferroni over every (route, bin) instead of chains from both ends (both family-wise)"
    )
    out: str | None = setting(None, "str", help="directory for the map's files")
    reenc: bool = setting(False, "bool", help="add the VAE re-encode control arm")
    pixel: bool = setting(False, "bool", help="add the pixel-downscale-then-encode arms")

    def __post_init__(self) -> None:
        check_fields(self, self.prefix)


@dataclass(frozen=True)
class CertifyConfig:
    """The in-run certifier's settings (``mode = "auto"``, mapping/certify.py); TOML key = ``certify_`` + field.
    Routes, bins, ε and the output directory are the map's keys (``map_ratios``, ``map_bins``, ``map_margin``, ``map_out``)."""

    prefix: ClassVar[str] = "certify_"

    budget: float = setting(
        0.1, "float_closed", (0.0, 0.5), "probe passes at most, as a fraction of the run's native compute (0: no probes, a plain run)"
    )
    draws: int = setting(4, "int", (2, 64), "paired noise draws per (probe, σ bin)")
    spot_checks: int = setting(
        0,
        "int",
        (0, 16),
        "pruned bins (between two of a route's bins that ended unsafe or futile) tested after the search: a one-hump check that spends budget "
        "and never opens a window",
    )
    resume: str | None = setting(
        None, "str", help="a certify.json of an earlier run on the same model: its evidence is continued, not redone"
    )
    reuse: str = setting(
        "on",
        "enum",
        REUSE,
        "the windows cache (mapping/reuse.py): on: reuse windows certified under the same key, else certify and store them; "
        "refresh: certify and replace the stored ones; off: neither read nor write it",
    )
    cache: str | None = setting(
        None,
        "str",
        help="the windows cache folder (default: $DOWNSCALE_PLUGIN_CACHE, else $XDG_CACHE_HOME or ~/.cache, /downscale_plugin/windows)",
    )
    unpaid: str = setting(
        "skip",
        "enum",
        CERTIFY_UNPAID,
        "evidence this run cannot pay back (docs/FIDELITY.md §9.4): skip (not bought; a run where no test can pay trains native), "
        "refuse (stop at start when no test can pay), buy (certify within the budget anyway: windows for later runs)",
    )

    def __post_init__(self) -> None:
        check_fields(self, self.prefix)


@dataclass(frozen=True)
class WindowsProvenance:
    """Where a windows file's verdicts were measured; ``map`` and ``certify`` write these keys into the
    windows TOML they emit (TOML key = ``windows_`` + field). A host that knows its model, arch and
    native tier refuses windows certified for another (:func:`foreign_windows`) unless
    ``windows_foreign = "warn"``: a window is evidence about one model at one grid, not a preset."""

    prefix: ClassVar[str] = "windows_"

    model: str | None = setting(
        None, "str", help="identity of the base model the windows were certified on (the host's model hash, or a file hash)"
    )
    arch: str | None = setting(None, "enum", ARCH_NAMES, "the architecture the windows were certified on")
    native: str | None = setting(None, "str", help='the probes\' native latent grid "HxW" (its tier)')
    margin: float | None = setting(None, "float", (0.0, 1.0), "the margin ε the windows were certified at")
    method: str | None = setting(None, "str", help="how they were certified: map or certify, with its settings")
    images: int | None = setting(None, "int", (1, None), "probe images behind the verdicts")
    version: str | None = setting(None, "str", help="the plugin version that wrote them")
    date: str | None = setting(None, "str", help="when they were written (UTC)")
    foreign: str = setting("error", "enum", FOREIGN, "windows certified for another model, arch or tier: error, or warn and use them")

    def __post_init__(self) -> None:
        check_fields(self, self.prefix)


def _latent_hw(text: str) -> tuple[int, int] | None:
    h, sep, w = text.lower().partition("x")
    return (int(h), int(w)) if sep and h.isdigit() and w.isdigit() else None


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


AUTO_UNUSED = ("map_draws", "map_images", "map_simultaneous", "after_map")  # the full map's own settings; auto's are certify_*


def mode_problems(merged: Mapping[str, Any], has_routes: bool, rejected: set[str]) -> list[str]:
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
    for key, plain in (("sigma_policy", "keep"), ("positions", "plain"), ("attention", "plain")):
        if merged.get(key, plain) != plain:
            problems.append(
                f'{key}: {merged[key]!r} is not allowed with mode = "{mode}" (allowed: {plain!r}): the in-run measurement covers the '
                "router's plain routes; compare σ policies, positions and attention with the lab map"
            )
    return problems
