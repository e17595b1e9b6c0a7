"""The map's excess against native token count, fitted per route and σ bin and extrapolated to Flux at 1024 px.

Inputs are stored maps (``map.json``) of one task measured on the shipped multi-size lab base at several native sizes
with the same routes, bins and settings. For each route and bin: each map's paired excess with its 95 % t interval
over probe images, the two-parameter fit of excess against the smaller grid's token count (``mapping/scaling.py``:
``a + b / t`` or ``c · t^(−p)``, whichever fits better), and the fit's value with its interval at the smaller grid of
a native 4 096-token latent (Flux at 1024 px, latent 128 × 128: 3 136 tokens at 0.875, 2 304 at 0.75, 1 024 at 0.5).

Read against the default margin ε: a bin whose extrapolated interval lies below ε would pass at production by this
model, one whose interval reaches ε would not; the windows that reading gives (contiguous from σ = 1 down, as the
router stacks them) are set beside the windows each stored map certified. The extrapolation is a model, not a
certificate: it assumes each bin's excess follows one of the two forms across the measured sizes and beyond, with the
fit's residual spread; the report gives the χ² of every fit and its p-value, so a bin where neither form fits shows.

Variants (optional): a variants map's paired per-image difference from the plain arm of the same route, per bin.

    PYTHONPATH=. python docs/fidelity/token_scaling/build.py \\
        --maps corpus=docs/fidelity/token_scaling/corpus_t576/map.json,docs/fidelity/token_scaling/corpus_t1024/map.json \\
        --maps hatch=... --primary corpus --variants docs/fidelity/token_scaling/variants/map.json \\
        --out docs/fidelity/token_scaling
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from scipy import stats

from downscale_plugin.arch import get_arch
from downscale_plugin.certify_config import DEFAULT_MARGIN
from downscale_plugin.config import load_config
from downscale_plugin.grid import target_grid, tokens
from downscale_plugin.mapping.scaling import best_fit
from downscale_plugin.plan import plan_table
from downscale_plugin.provenance import code_revision
from downscale_plugin.sigma import SigmaSampler

PRODUCTION_HW = (128, 128)  # Flux's latent of a 1024² image: 4 096 tokens
PRODUCTION_ARCH = "flux"


def small_tokens(native_hw: tuple[int, int], ratio: float, arch: str) -> int:
    spec = get_arch(arch)
    grid = target_grid(native_hw, ratio, spec)
    if grid is None:
        raise ValueError(f"route {ratio} has no grid at latent {native_hw}")
    return tokens(grid, spec)


def load_map(path: Path) -> dict[str, Any]:
    blob = json.loads(path.read_text(encoding="utf-8"))
    backend = blob["provenance"]["backend"]
    blob["native_hw"] = tuple(backend["native_latent_hw"])
    blob["arch"] = backend.get("arch", PRODUCTION_ARCH)
    blob["native_tokens"] = tokens(blob["native_hw"], get_arch(blob["arch"]))
    blob["path"] = str(path)
    return blob


def _interval(row: dict[str, Any], alpha: float = 0.05) -> dict[str, float]:
    q = float(stats.t.ppf(1 - alpha / 2, max(row["n"] - 1, 1)))
    return {"mean": row["excess"], "lo": row["excess"] - q * row["se"], "hi": row["excess"] + q * row["se"], "se": row["se"], "n": row["n"]}


def _plain_rows(blob: dict[str, Any]) -> dict[tuple[float, int], dict[str, Any]]:
    """The plain latent arm's rows by (ratio, bin): ``latent_<ratio>`` with the keep policy and plain positions."""
    plain = {a["name"]: a["ratio"] for a in blob["arms"] if a["kind"] == "latent" and a["policy"] == "keep" and a["positions"] == "plain"}
    return {(plain[r["arm"]], r["bin"]): r for r in blob["rows"] if r["arm"] in plain}


def _check_same_grid(maps: list[dict[str, Any]]) -> None:
    first = maps[0]
    for other in maps[1:]:
        if other["bins"] != first["bins"]:
            raise ValueError(f"{other['path']}: its σ bins differ from {first['path']}'s; maps fitted together need the same bins")
        if sorted(_plain_rows(other)) != sorted(_plain_rows(first)):
            raise ValueError(f"{other['path']}: its routes differ from {first['path']}'s")
    counts = [m["native_tokens"] for m in maps]
    if len(set(counts)) != len(counts):
        raise ValueError(f"two maps share a native token count ({counts})")


def _top_window(bins: list[dict[str, Any]], safe: list[bool]) -> float | None:
    """σ_min of the window contiguous from the top bin down (None: the top bin is not safe). The σ = 1 point is
    left out of the walk: a single point is no window, and a window that stops short of it is closed at 1, as
    ``mapping/windows.py`` stacks them."""
    lo = None
    spans = [(b, ok) for b, ok in zip(bins, safe, strict=True) if b["sigma_lo"] < b["sigma_hi"]]
    for b, ok in sorted(spans, key=lambda p: -p[0]["sigma_hi"]):
        if not ok:
            break
        lo = b["sigma_lo"]
    return lo


def stacked_economics(sigma_min: dict[float, float | None]) -> dict[str, float]:
    """The share of steps routed and of FLOPs saved per step at Flux 1024² (``flux_shift`` σ law, batch 1) by one
    window σ > σ_min per route, stacked deepest first as the router does (a route whose window a deeper one covers
    never fires)."""
    rules: list[dict[str, Any]] = []
    for ratio in sorted(sigma_min):
        lo = sigma_min[ratio]
        if lo is not None and (not rules or lo < rules[-1]["sigma_min"]):
            rules.append({"scale": ratio, "sigma_min": lo, "sigma_max": 1.0})
    if not rules:
        return {"routed": 0.0, "flops_saved": 0.0}
    del rules[-1]["sigma_max"]  # only the last rule may be open at σ = 1
    plan = plan_table(
        load_config(plugin_toml={"arch": PRODUCTION_ARCH, "routes": rules}), PRODUCTION_ARCH, SigmaSampler("flux_shift"), [PRODUCTION_HW]
    )
    return {"routed": 1.0 - plan.probs[-1], "flops_saved": plan.flop_saving}


def _fit_entry(fit: Any) -> dict[str, Any]:
    """The fit with the p-value of its χ² (None with as many points as parameters: the fit passes through them)."""
    entry = fit.as_dict()
    entry["p"] = float(stats.chi2.sf(fit.chi2, fit.dof)) if fit.dof > 0 else None
    return entry


def task_scaling(maps: list[dict[str, Any]], margin: float) -> dict[str, Any]:
    """Per route and bin: the excess at each native size, the fit, and its extrapolation to Flux at 1024 px."""
    maps = sorted(maps, key=lambda m: m["native_tokens"])
    _check_same_grid(maps)
    rows = [_plain_rows(m) for m in maps]
    routes: dict[str, Any] = {}
    extrapolated: dict[str, Any] = {}
    for ratio in sorted({r for r, _ in rows[0]}, reverse=True):
        bins, predicted = [], []
        for b in sorted(k for r, k in rows[0] if r == ratio):
            at = [rs[ratio, b] for rs in rows]
            ts = [small_tokens(m["native_hw"], ratio, m["arch"]) for m in maps]
            fit = best_fit(ts, [r["excess"] for r in at], [r["se"] for r in at])
            mean, lo, hi = fit.predict(small_tokens(PRODUCTION_HW, ratio, PRODUCTION_ARCH))
            entry = {
                "sigma_lo": at[0]["lo"],
                "sigma_hi": at[0]["hi"],
                "endpoint": at[0]["endpoint"],
                "small_tokens": ts,
                "excess": [{"native_tokens": m["native_tokens"], **_interval(r)} for m, r in zip(maps, at, strict=True)],
                "certified": [bool(r["safe"]) for r in at],
                "fit": _fit_entry(fit),
            }
            bins.append(entry)
            predicted.append({"sigma_lo": entry["sigma_lo"], "sigma_hi": entry["sigma_hi"], "mean": mean, "lo": lo, "hi": hi})
        key = f"{ratio:g}"
        routes[key] = {"bins": bins}
        extrapolated[key] = predicted
        routes[key]["window"] = {
            "extrapolated_sigma_min": _top_window(predicted, [p["hi"] < margin for p in predicted]),
            "measured_sigma_min": {
                str(m["native_tokens"]): _top_window(bins, [b["excess"][i]["hi"] < margin for b in bins]) for i, m in enumerate(maps)
            },
            "certified_sigma_min": {
                str(m["native_tokens"]): _top_window(bins, [b["certified"][i] for b in bins]) for i, m in enumerate(maps)
            },
        }
    windows = {float(k): r["window"] for k, r in routes.items()}
    economics = {
        "extrapolated": stacked_economics({k: w["extrapolated_sigma_min"] for k, w in windows.items()}),
        **{
            str(m["native_tokens"]): stacked_economics({k: w["measured_sigma_min"][str(m["native_tokens"])] for k, w in windows.items()})
            for m in maps
        },
    }
    return {
        "token_counts": [m["native_tokens"] for m in maps],
        "maps": [
            {
                "path": m["path"],
                "native_tokens": m["native_tokens"],
                "code_revision": m["provenance"].get("code_revision"),
                "command": m["provenance"].get("command"),
            }
            for m in maps
        ],
        "routes": routes,
        "extrapolated": {"4096": extrapolated},
        "economics": economics,
    }


def variants(blob: dict[str, Any]) -> dict[str, Any]:
    """Each non-plain latent arm's paired difference from its plain sibling, per bin (``vs_plain``)."""
    out: dict[str, Any] = {}
    for row in blob["rows"]:
        if row.get("vs_plain_n", 0) and not math.isnan(row.get("vs_plain", math.nan)):
            out.setdefault(row["arm"], {"bins": []})["bins"].append(
                {
                    "sigma_lo": row["lo"],
                    "sigma_hi": row["hi"],
                    "vs_plain": {"mean": row["vs_plain"], "lo": row["vs_plain_lo"], "hi": row["vs_plain_hi"]},
                    "n": row["vs_plain_n"],
                    "excess": row["excess"],
                    "safe": bool(row["safe"]),
                }
            )
    return out


def _window_text(lo: float | None) -> str:
    return "none" if lo is None else f"σ > {lo:.3g}"


def report(summary: dict[str, Any]) -> str:
    lines = [f"# Excess against native token count (code {summary['code_revision']}, ε = {summary['margin']})", ""]
    for task, body in summary["tasks"].items():
        counts = body["token_counts"]
        lines += [f"## {task}: native tokens {', '.join(map(str, counts))}", ""]
        lines += [
            "| route | σ bin | " + " | ".join(f"excess at {c}" for c in counts) + " | fit | χ² (p) | at 4096 (Flux 1024 px) |",
            "|---|---|" + "---|" * len(counts) + "---|---|---|",
        ]
        for ratio, route in body["routes"].items():
            for b, p in zip(route["bins"], body["extrapolated"]["4096"][ratio], strict=True):
                cells = [f"{e['mean']:+.3f} [{e['lo']:+.3f}, {e['hi']:+.3f}]" for e in b["excess"]]
                fit = b["fit"]
                form = ", ".join(f"{k} {v:.3g}" for k, v in fit["params"].items())
                chi2 = f"{fit['chi2']:.2f}" + ("" if fit.get("p") is None else f" ({fit['p']:.2g})")
                lines.append(
                    f"| {ratio} | ({b['sigma_lo']:.3g}, {b['sigma_hi']:.3g}] | "
                    + " | ".join(cells)
                    + f" | {fit['form']}: {form} | {chi2} | {p['mean']:+.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}] |"
                )
        rejected = sum(1 for r in body["routes"].values() for b in r["bins"] if b["fit"].get("p") is not None and b["fit"]["p"] < 0.05)
        total = sum(len(r["bins"]) for r in body["routes"].values())
        lines += [
            "",
            f"Fits rejected at 5 % (χ² beyond its 95 % quantile): {rejected} of {total} bins; their intervals are inflated by χ² / dof.",
            "",
        ]
        lines += [
            "Windows (contiguous from σ = 1). *Certified*: the map's own windows at its margin (the certifier's "
            "family-wise, heavy-tail calibrated read). *Measured* and *extrapolated*: where the 95 % interval of the mean "
            "excess lies below ε, at each measured size and at 4096 by the fit: one reading, so the two compare directly. "
            "Routed and FLOPs saved: those windows stacked at Flux 1024² (flux_shift, batch 1).",
            "",
        ]
        money = body["economics"]
        for ratio, route in body["routes"].items():
            window = route["window"]
            certified = ", ".join(f"{c}: {_window_text(lo)}" for c, lo in window["certified_sigma_min"].items())
            measured = ", ".join(f"{c}: {_window_text(lo)}" for c, lo in window["measured_sigma_min"].items())
            lines.append(
                f"- {ratio}: certified {certified}; measured {measured}; extrapolated to 4096: {_window_text(window['extrapolated_sigma_min'])}"
            )
        lines.append(
            "- stacked: "
            + ", ".join(
                f"{'extrapolated to 4096' if k == 'extrapolated' else f'measured at {k}'} routes {100 * m['routed']:.1f} % "
                f"of steps, saves {100 * m['flops_saved']:.1f} % of FLOPs"
                for k, m in money.items()
            )
        )
        lines.append("")
    if summary.get("variants"):
        lines += ["## Variants: paired difference from the plain arm (negative = closer to native)", ""]
        for name, body in summary["variants"].items():
            cells = ", ".join(
                f"({b['sigma_lo']:.3g}, {b['sigma_hi']:.3g}] {b['vs_plain']['mean']:+.4f} [{b['vs_plain']['lo']:+.4f}, {b['vs_plain']['hi']:+.4f}]"
                for b in body["bins"]
            )
            lines.append(f"- {name}: {cells}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--maps", action="append", required=True, help="TASK=map.json,map.json,... (repeat per task)")
    parser.add_argument("--primary", default="corpus", help="the task whose routes and extrapolation stand at the top level")
    parser.add_argument("--variants", help="a variants map.json (arms paired with their plain sibling)")
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    tasks: dict[str, Any] = {}
    for spec in args.maps:
        task, _, paths = spec.partition("=")
        if not paths:
            parser.error(f"--maps {spec!r}: expected TASK=map.json,map.json")
        tasks[task] = task_scaling([load_map(Path(p)) for p in paths.split(",")], args.margin)
    if args.primary not in tasks:
        parser.error(f"--primary {args.primary!r} is not one of the tasks given ({', '.join(tasks)})")
    summary = {
        "code_revision": code_revision(),
        "margin": args.margin,
        "primary": args.primary,
        **{k: tasks[args.primary][k] for k in ("token_counts", "routes", "extrapolated", "economics")},
        "tasks": tasks,
        "variants": variants(load_map(Path(args.variants))) if args.variants else {},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    (out / "report.md").write_text(report(summary), encoding="utf-8")
    print(report(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
