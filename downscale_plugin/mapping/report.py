"""Map outputs: the windows TOML, the raw table (CSV, JSON with per-image cells), a heatmap PNG and
a console table. Every file carries the run's provenance so a number can be traced to its command."""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, fields

from .arms import PLAIN, plain_sibling, setting_suffix, setting_text
from .estimator import BinResult, MapResult
from .windows import arm_windows, other_windows, stack_windows, windows_toml

OUTPUT_FILES = ("windows.toml", "map.csv", "map.json", "map.png")


def _fmt(x: float, signed: bool = True) -> str:
    if not math.isfinite(x):
        return "inf" if x == math.inf else "nan"
    return f"{x:+.3f}" if signed else f"{x:.3f}"


COLUMNS = 4  # arms per console block: a map with policy/positions variants stays readable


def _blocks(result: MapResult, arms: list, cell: Callable[[BinResult], str]) -> list[str]:
    """Bins down, at most :data:`COLUMNS` arms across per block, each cell from ``cell(row)``."""
    lines: list[str] = []
    for start in range(0, len(arms), COLUMNS):
        chunk = arms[start : start + COLUMNS]
        texts = [[cell(result.row(a.name, b)) for a in chunk] for b in range(len(result.bins))]
        width = 2 + max(29, *(len(a.name) for a in chunk), *(len(t) for row in texts for t in row))
        head = f"{'σ bin':<16}{'floor cos':>10}{'ĉ(A,B)':>8}  " + "".join(f"{a.name:>{width}}" for a in chunk)
        lines += [head, "-" * len(head)]
        for b in range(len(result.bins)):
            first = result.row(chunk[0].name, b)
            cells = "".join(t.rjust(width) for t in texts[b])
            row = f"{result.bins.label(b):<16}{_fmt(first.floor_cos, False):>10}{_fmt(first.floor_debiased, False):>8}  " + cells
            lines.append(row.rstrip())
    return lines


def _kept(n: int, r: BinResult) -> str:
    """`` n=7`` when images were trimmed, blank of the same width otherwise (columns stay aligned)."""
    images = r.n + r.trimmed
    return (f" n={n}" if n < images else "").ljust(len(f" n={images}"))


def _floor_cell(r: BinResult) -> str:
    return f"{_fmt(r.excess)} ± {_fmt(r.se, False)} ≤{_fmt(r.ub)}{'*' if r.safe else ' '}{_kept(r.n, r)}"


def _reenc_cell(r: BinResult) -> str:
    return f"{_fmt(r.over_reenc)} ± {_fmt(r.over_reenc_se, False)} ≤{_fmt(r.over_reenc_ub)} {_kept(r.over_reenc_n, r)}"


def _vs_plain_cell(r: BinResult) -> str:
    side = "<" if r.vs_plain_hi < 0 else ">" if r.vs_plain_lo > 0 else " "
    interval = f"[{_fmt(r.vs_plain_lo)}, {_fmt(r.vs_plain_hi)}]"
    return f"{_fmt(r.vs_plain)} ± {_fmt(r.vs_plain_se, False)} {interval}{side}{_kept(r.vs_plain_n, r)}"


def console_table(result: MapResult) -> str:
    """Bins down, arms across: ``mean ± SE  ≤UB`` with ``*`` on safe bins; the excess over the
    re-encode control when the map has one; each variant's paired difference from its plain latent
    arm when the map has variants; then the windows of each setting and of the pixel arms."""
    routes = result.routes()
    arms = routes + [a for a in result.arms if a.compared and a not in routes]
    s = result.settings
    lines = [
        f"paired debiased excess over the native redraw floor, mean ± SE ≤ UB (the heavy-tail calibrated safe read, false-safe "
        f"≤ {s.alpha:g} family-wise{', Bonferroni over every arm and bin' if s.simultaneous else ''}); * = safe at ε = {s.margin:g}; "
        "n = images kept after trimming"
        f"  (N={s.images}, D={s.draws})",
        *_blocks(result, arms, _floor_cell),
    ]
    vs_reenc = [a for a in arms if a.kind != "reenc"]
    if len(vs_reenc) < len(arms):
        lines += ["", "paired excess over the re-encode control (arm − reenc per image; not used for verdicts)"]
        lines += _blocks(result, vs_reenc, _reenc_cell)
    variants = [a for a in arms if plain_sibling(a, result.arms)]
    if variants:
        lines += [
            "",
            "paired difference vs the plain latent arm (negative = closer to native): arm − latent_<ratio> per image,"
            f" mean ± SE [{100 * (1 - s.alpha):g}% t interval];"
            " < / > = interval below / above 0",
        ]
        lines += _blocks(result, variants, _vs_plain_cell)
    lines.append("")
    for setting in result.route_settings():
        stack = stack_windows(result, setting)
        label = f"windows{setting_suffix(setting)}.toml ({setting_text(setting)}; priority order): "
        lines.append(label + (", ".join(f"{w.arm} {w.text()}" for w in stack.windows) or "none"))
        lines += [f"  note: {n}" for n in stack.notes]
    pixel = [a for a in result.arms if a.kind == "pixel"]
    if pixel:
        lines.append("pixel-then-encode arms (a comparison, not routes: the plugin downsamples latents):")
        lines += [f"  {a.name}: {', '.join(w.text() for w in arm_windows(result, a)) or 'no window'}" for a in pixel]
    return "\n".join(lines)


def write_csv(result: MapResult, path: str) -> None:
    names = [f.name for f in fields(BinResult)]
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=names)
        writer.writeheader()
        for row in result.rows:
            writer.writerow(asdict(row))


def write_json(result: MapResult, path: str) -> None:
    blob = result.to_json()
    stack = stack_windows(result)
    blob["windows"] = [asdict(w) for w in stack.windows]
    blob["window_notes"] = list(stack.notes)
    blob["other_windows"] = {name: [asdict(w) for w in ws] for name, ws in other_windows(result).items()}
    with open(path, "w") as fh:
        json.dump(_finite(blob), fh, indent=1, allow_nan=False)


def _finite(x: object) -> object:
    """Strict JSON: non-finite floats (an untrimmable bin, an infinite bound) become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_png(result: MapResult, path: str) -> None:
    """Top: heatmap routes × σ bins (colour = mean excess, text = mean and UB, safe bins boxed).
    Bottom: excess vs σ with SE bars and the UB, against the margin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    arms = [a for a in result.arms if a.compared]
    nb = len(result.bins)
    grid = [[result.row(a.name, b).excess for b in range(nb)] for a in arms]
    finite = [abs(v) for row in grid for v in row if math.isfinite(v)]
    vmax = max(finite + [result.settings.margin * 2])
    fig, (ax, ax2) = plt.subplots(
        2, 1, figsize=(max(8.0, 0.75 * nb + 2), 2.0 + 0.7 * len(arms) + 3.5), height_ratios=[0.7 * len(arms) + 0.8, 3.2]
    )
    im = ax.imshow(grid, cmap="RdBu_r", vmin=-vmax, vmax=vmax, aspect="auto")
    ax.set_yticks(range(len(arms)), [a.name for a in arms])
    ax.set_xticks(
        range(nb), [f"{result.bins.center(b):.3g}" if not result.bins.is_endpoint(b) else "1 (end)" for b in range(nb)], rotation=60
    )
    for i, a in enumerate(arms):
        for b in range(nb):
            r = result.row(a.name, b)
            ax.text(b, i, f"{_fmt(r.excess)}\n≤{_fmt(r.ub)}", ha="center", va="center", fontsize=6)
            if r.safe:
                ax.add_patch(Rectangle((b - 0.5, i - 0.5), 1, 1, fill=False, lw=2.0, ec="black"))
    fig.colorbar(im, ax=ax, label="excess over floor")
    s = result.settings
    ax.set_title(f"gradient map: debiased paired excess (boxed = safe at ε={s.margin:g}; N={s.images}, D={s.draws})", fontsize=9)
    for a in arms:
        rows = sorted((r for r in result.rows if r.arm == a.name and not r.endpoint), key=lambda r: r.bin)
        x = [r.center for r in rows]
        line = ax2.errorbar(
            x, [r.excess for r in rows], yerr=[r.se if math.isfinite(r.se) else 0 for r in rows], marker="o", ms=3, capsize=2, label=a.name
        )
        ax2.plot(x, [r.ub for r in rows], ls=":", color=line[0].get_color())
        end = [r for r in result.rows if r.arm == a.name and r.endpoint]
        if end:
            ax2.errorbar(
                [1.0],
                [end[0].excess],
                yerr=[end[0].se if math.isfinite(end[0].se) else 0],
                marker="s",
                color=line[0].get_color(),
                capsize=2,
            )
    ax2.axhline(s.margin, color="k", lw=1, ls="--", label=f"ε = {s.margin:g}")
    ax2.axhline(0.0, color="grey", lw=0.5)
    ax2.set_xlabel("σ (bin centre; square = σ = 1 endpoint bin; dotted = upper bound)")
    ax2.set_ylabel("excess over floor")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: MapResult, out_dir: str, command: str = "") -> dict[str, str]:
    """Write every output file into ``out_dir``; returns {kind: path}, ``toml`` for the default
    setting's windows and ``toml@res_shift+interp`` etc. for each other measured setting."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {name.rsplit(".", 1)[1]: os.path.join(out_dir, name) for name in OUTPUT_FILES}
    for setting in result.route_settings() or [PLAIN]:
        suffix = setting_suffix(setting)
        paths[f"toml{suffix}"] = os.path.join(out_dir, f"windows{suffix}.toml")
        with open(paths[f"toml{suffix}"], "w") as fh:
            fh.write(windows_toml(result, command, setting=setting))
    write_csv(result, paths["csv"])
    write_json(result, paths["json"])
    write_png(result, paths["png"])
    return paths
