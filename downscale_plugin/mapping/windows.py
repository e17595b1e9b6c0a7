"""From per-bin verdicts to router windows, and the windows TOML the plugin reads as is.

Rules (docs/FIDELITY.md): a window is a maximal run of safe segmented bins, (lower edge of its first bin,
upper edge of its last). A run reaching σ = 1 stays open at the top only when the σ = 1 endpoint
bin is safe too (σ = 1 is its own estimand); otherwise the window stops at 1, exclusive. Routes
are stacked deepest (smallest ratio) first, each window strict. Two constraints of the config
schema shape the output: a window that an earlier (higher-priority) window already covers could
never fire and is dropped, and only the last rule may leave ``sigma_max`` out, so an open-top
window anywhere else is closed at 1 (σ = 1 exactly then falls to a later rule or native: conservative).

One TOML per measured (sigma_policy, positions, attention) setting: the plugin applies that setting to every
routed step, so a file's rules come from the latent arms measured under it, and a file for a
non-default setting sets sigma_policy and positions, and attention when it is proportional. Every other small-grid arm (other settings, pixel-then-encode,
which the plugin cannot run) is listed with its own windows in a comment (:func:`other_windows`).
"""

from __future__ import annotations

import datetime as _dt
import math
from dataclasses import dataclass

import toml

from ..arch import get_arch
from .arms import PLAIN, SETTING_KEYS, Arm, Setting, setting_text
from .estimator import BinResult, MapResult


@dataclass(frozen=True)
class Window:
    """One certified window of one route: ``sigma_min < σ < sigma_max`` (None: σ = 1 included)."""

    arm: str
    ratio: float
    sigma_min: float
    sigma_max: float | None
    first_bin: int
    last_bin: int

    def text(self) -> str:
        hi = "1]" if self.sigma_max is None else f"{self.sigma_max:g})"
        return f"({self.sigma_min:g}, {hi}"


def route_windows(rows: list[BinResult], n_segmented: int, ratio: float) -> list[Window]:
    """Maximal runs of safe segmented bins of one route; ``rows`` are that route's rows by bin."""
    by_bin = {r.bin: r for r in rows}
    endpoint = by_bin.get(n_segmented)
    windows: list[Window] = []
    start = None
    for b in range(n_segmented + 1):
        safe = b < n_segmented and by_bin[b].safe
        if safe and start is None:
            start = b
        elif not safe and start is not None:
            last = by_bin[b - 1]
            top_open = b == n_segmented and endpoint is not None and endpoint.safe
            windows.append(Window(last.arm, ratio, by_bin[start].lo, None if top_open else last.hi, start, b - 1))
            start = None
    return windows


def _covered(w: Window, earlier: list[Window]) -> bool:
    """Whether the union of earlier windows covers all of w (then w could never fire)."""
    reach = w.sigma_min
    for e in sorted(earlier, key=lambda e: e.sigma_min):
        if e.sigma_min <= reach and (e.sigma_max is None or e.sigma_max > reach):
            reach = math.inf if e.sigma_max is None else e.sigma_max
    w_top = math.inf if w.sigma_max is None else w.sigma_max
    return reach >= w_top


def arm_windows(result: MapResult, arm: Arm) -> list[Window]:
    """One arm's own windows (no stacking)."""
    rows = sorted((r for r in result.rows if r.arm == arm.name), key=lambda r: r.bin)
    return route_windows(rows, result.bins.n_segmented, arm.ratio)


def other_windows(result: MapResult, setting: Setting = PLAIN) -> dict[str, list[Window]]:
    """Every small-grid arm that is not a route of ``setting`` -> its own windows (none: an empty list)."""
    routes = result.routes(setting)
    return {a.name: arm_windows(result, a) for a in result.arms if a.ratio is not None and a not in routes}


@dataclass(frozen=True)
class Stack:
    """Router rules in priority order plus what was changed to make them a valid config, and why."""

    windows: tuple[Window, ...]
    notes: tuple[str, ...]


def stack_windows(result: MapResult, setting: Setting = PLAIN) -> Stack:
    """The windows of the routes measured under ``setting``, deepest first, made valid for ``config.load_config``."""
    ordered: list[Window] = []
    notes: list[str] = []
    for arm in sorted(result.routes(setting), key=lambda a: a.ratio):
        found = arm_windows(result, arm)
        if result.bins.endpoint and result.row(arm.name, len(result.bins) - 1).safe and not (found and found[-1].sigma_max is None):
            notes.append(f"{arm.name}: σ = 1 alone is safe, but a single point is not a window; not used")
        for w in found:
            if _covered(w, ordered):
                notes.append(f"{arm.name} {w.text()}: covered by deeper routes' windows, could never fire; dropped")
            else:
                ordered.append(w)
    for i, w in enumerate(ordered[:-1]):
        if w.sigma_max is None:
            ordered[i] = Window(w.arm, w.ratio, w.sigma_min, 1.0, w.first_bin, w.last_bin)
            notes.append(f"{w.arm} {w.text()}: closed at 1 (only the last rule may be open); σ = 1 exactly falls to a later rule or native")
    return Stack(tuple(ordered), tuple(notes))


def route_entry(w: Window, native_edge: float) -> dict:
    """A ``[[routes]]`` table: tier edges when the target edge is a whole pixel count, else ``scale``."""
    target = native_edge * w.ratio
    entry: dict = {}
    if native_edge > 0 and abs(native_edge - round(native_edge)) < 1e-9 and abs(target - round(target)) < 1e-9:
        entry["route"] = f"{round(native_edge)}:{round(target)}"
    else:
        entry["scale"] = w.ratio
    entry["sigma_min"] = w.sigma_min
    if w.sigma_max is not None:
        entry["sigma_max"] = w.sigma_max
    return entry


def measured_tiers(backend: dict) -> list[tuple[tuple[int, int], float]]:
    """(latent grid, tier edge in px) of every grid the probes were measured on (``probe_grids``, else the one
    ``native_latent_hw``), one per tier edge rounded to a pixel; empty without an arch."""
    arch = backend.get("arch")
    grids = backend.get("probe_grids") or ([backend["native_latent_hw"]] if backend.get("native_latent_hw") else [])
    tiers: dict[int, tuple[tuple[int, int], float]] = {}
    for h, w in grids if arch else ():
        edge = math.sqrt(h * w) * get_arch(arch).vae_factor
        tiers.setdefault(round(edge), ((int(h), int(w)), edge))
    return sorted(tiers.values(), key=lambda t: t[1])


def tier_entries(w: Window, backend: dict) -> tuple[list[dict], list[str]]:
    """``[[routes]]`` tables of one window for the measured tiers only (``route = "E:T"``: buckets within the run's
    ``tier_tolerance`` of E, never every bucket as a ``scale`` rule would), and notes on what could not be scoped:
    E is the tier edge rounded to a pixel and T a whole pixel count whose ratio T/E gives the measured grid the
    route's own small grid (``grid.target_grid``)."""
    from ..grid import target_grid

    spec = get_arch(backend["arch"]) if backend.get("arch") else None
    entries, notes = [], []
    for hw, edge in measured_tiers(backend):
        native = round(edge)
        wanted = target_grid(hw, w.ratio, spec)
        target = next((t for t in sorted(range(1, native), key=lambda t: abs(t - native * w.ratio))[:3]
                       if target_grid(hw, t / native, spec) == wanted), None)  # fmt: skip
        if wanted is None or target is None:
            notes.append(
                f"{w.arm} {w.text()}: no whole-pixel tier rule gives the {hw[0]}x{hw[1]} grid its measured small grid; not routed there"
            )
            continue
        entry = {"route": f"{native}:{target}", "sigma_min": w.sigma_min}
        if w.sigma_max is not None:
            entry["sigma_max"] = w.sigma_max
        entries.append(entry)
    return entries, notes


def provenance_keys(backend: dict, margin: float, method: str, images: int | None, date: str) -> dict:
    """The ``windows_*`` keys (``certify_config.WindowsProvenance``) of a windows TOML: the base model, arch and
    native grid the verdicts were measured on, and how; what the backend does not know is left out."""
    hw = backend.get("native_latent_hw")
    keys = {
        "windows_model": backend.get("model_identity"),
        "windows_arch": backend.get("arch"),
        "windows_native": f"{hw[0]}x{hw[1]}" if hw else None,
        "windows_margin": margin,
        "windows_method": method,
        "windows_images": images,
        "windows_version": backend.get("plugin_version"),
        "windows_date": date,
    }
    return {key: value for key, value in keys.items() if value is not None}


def probe_header(backend: dict) -> tuple[str | None, float, list[str]]:
    """(arch, the probes' native tier edge in px, the header lines naming model, adapter and data) of
    a windows TOML, from a backend's provenance: the map and the certifier write the same ones."""
    arch = backend.get("arch")
    h, w = backend.get("native_latent_hw", (0, 0))
    native_edge = math.sqrt(h * w) * get_arch(arch).vae_factor if arch else 0.0
    lines = [
        f"# model: {backend.get('model', '?')}",
        f"# adapter: {backend.get('adapter', '?')}",
        f"# data: {backend.get('data', '?')}; native latent {h}x{w} (tier edge {native_edge:g} px at {arch}'s VAE factor, as the router counts)",
    ]
    return arch, native_edge, lines


def utc_now() -> str:
    """The date a windows file records (UTC, to the second)."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def render_windows(
    backend: dict,
    stack: Stack,
    header: list[str],
    method: str,
    margin: float,
    images: int | None,
    date: str,
    extra: dict | None = None,
    routes: list[dict] | None = None,
) -> str:
    """A windows file: the header's comment lines, then the plugin TOML (arch, the ``windows_*`` provenance,
    ``extra`` keys, the stacked windows as routes (``routes``: these tables instead), or ``enable = false``
    without one). The map and the certifier write theirs through this, so the router reads both alike."""
    arch, native_edge, _ = probe_header(backend)
    doc: dict = {"arch": arch} if arch else {}
    doc.update(provenance_keys(backend, margin, method, images, date))
    doc.update(extra or {})
    if routes is None and stack.windows:
        routes = [route_entry(w, native_edge) for w in stack.windows]
    if routes:
        doc["routes"] = routes
    else:
        header = [*header, "# no route has a safe window at this margin: the plugin is disabled"]
        doc["enable"] = False
    return "\n".join(header) + "\n\n" + toml.dumps(doc)


def windows_toml(result: MapResult, command: str = "", date: str | None = None, setting: Setting = PLAIN) -> str:
    """A plugin TOML (``downscale_config=``) for one setting, with a provenance header; ``enable = false`` if no window."""
    backend = result.provenance.get("backend", {})
    stack = stack_windows(result, setting)
    _, _, described = probe_header(backend)
    s = result.settings
    date = date or utc_now()
    header = [
        "# downscale-plugin windows, written by the map tool (certifier).",
        *described,
        f"# D = {s.draws} draws per arm and bin, N = {s.images} images, seed {s.seed}",
        f"# bins: {result.bins.spec()}",
        f"# margin ε = {s.margin:g}; safe = mean + c·sd/√N of the paired debiased excess over the native redraw floor < ε, c "
        f"calibrated on heavy tails at each bin's level; false-safe ≤ {s.alpha:g} family-wise over every arm and bin "
        f"({'Bonferroni' if s.simultaneous else 'fallback chains per arm from σ = 1 down and from its lowest bin up'})",
        f"# date: {date}",
        f"# command: {command or '?'}",
        f"# routed steps run with {setting_text(setting)} (arms: {', '.join(a.name for a in result.routes(setting))})",
    ]
    header += [f"# note: {n}" for n in stack.notes]
    others = other_windows(result, setting)
    if others:
        header.append(
            "# other arms, not routes here (another setting has its own windows@<setting>.toml; the plugin cannot run pixel arms):"
        )
        header += [f"#   {name}: {', '.join(w.text() for w in ws) or 'no window'}" for name, ws in others.items()]
    method = f"map (N = {s.images}, D = {s.draws}, heavy-tail calibrated safe read, false-safe ≤ {s.alpha:g} family-wise)"
    # sigma_policy and positions always with a non-default setting (as before the attention axis); attention when not plain
    keys = dict(zip(SETTING_KEYS, setting, strict=True))
    extra = None if setting == PLAIN else {k: v for k, v in keys.items() if k != "attention" or v != PLAIN[2]}
    return render_windows(backend, stack, header, method, s.margin, s.images, date, extra)
