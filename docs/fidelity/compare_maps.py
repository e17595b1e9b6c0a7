"""Paired difference of two lab maps measured with the same seeds, probes and bins (e.g. before/after a filter change).

Per arm present in both and per bin: mean ± SE and the two-sided 95 % t interval of the per-image
difference of debiased excess, NEW − OLD (negative: NEW is closer to native). The maps' native arms
must agree (same probes and noise), which the script checks to 1e-5.

    python docs/fidelity/compare_maps.py docs/fidelity/lab_n64_d8_n16_pool/map.json docs/fidelity/lab_n64_d8_n16/map.json

Maps on different base models are not paired (their native floors differ); ``--side_by_side`` prints
each map's debiased excess per arm and bin next to the other's, as a markdown table, and their windows.

    python docs/fidelity/compare_maps.py --side_by_side docs/fidelity/lab_n64_d8_n16/map.json docs/fidelity/lab_n64_d8_n16_multires/map.json
"""

from __future__ import annotations

import json
import sys

from downscale_plugin.certify_config import DEFAULT_MARGIN
from downscale_plugin.mapping.estimator import Cell, MapResult, _mean_se, excess, interval
from downscale_plugin.mapping.windows import stack_windows


def load(path: str) -> tuple[dict, dict[tuple[int, int], Cell]]:
    blob = json.load(open(path))
    return blob, {(c["image"], c["bin"]): Cell(c["image"], c["bin"], c["half_cos"], c["cos"], c["norm"]) for c in blob["cells"]}


def main(old_path: str, new_path: str) -> None:
    (old_blob, old), (new_blob, new) = load(old_path), load(new_path)
    if old.keys() != new.keys():
        sys.exit("the maps have different (image, bin) cells: not paired")
    drift = max(abs(new[k].cos["native_a|native_b"] - old[k].cos["native_a|native_b"]) for k in new)
    if drift > 1e-5:
        sys.exit(f"native floors differ by {drift:.2g}: different probes or noise, not paired")
    edges = new_blob["bins"]["edges"]
    arms = [a["name"] for a in new_blob["arms"] if a["kind"] != "native" and a["name"] in {b["name"] for b in old_blob["arms"]}]
    print(f"NEW − OLD per image, mean ± SE [95% t interval]; native floors agree to {drift:.1g}")
    for arm in arms:
        print(arm)
        for b in sorted({k[1] for k in new}):
            mean, se, n, _ = _mean_se([excess(new[k], arm) - excess(old[k], arm) for k in new if k[1] == b])
            lo, hi = interval(mean, se, n, 0.05)
            label = f"({edges[b]:.3g}, {edges[b + 1]:.3g}]" if b < len(edges) - 1 else "σ = 1"
            print(f"  {label:16s} {mean:+.3f} ± {se:.3f} [{lo:+.3f}, {hi:+.3f}]  n={n}")


def side_by_side(old_path: str, new_path: str, margin: float = DEFAULT_MARGIN) -> None:
    """Both maps re-read by today's safe read at one margin (their stored verdicts may be at others)."""
    old_blob, new_blob = json.load(open(old_path)), json.load(open(new_path))
    same = lambda blob: {k: v for k, v in blob["settings"].items() if k != "margin"}  # noqa: E731
    if old_blob["bins"] != new_blob["bins"] or same(old_blob) != same(new_blob):
        sys.exit("the maps have different bins or settings: not comparable side by side")
    results = [MapResult.from_json(blob, margin=margin) for blob in (old_blob, new_blob)]
    edges = new_blob["bins"]["edges"]
    rows = [{(r.arm, r.bin): r for r in result.rows} for result in results]
    cell = lambda r: f"{r.excess:+.3f} ± {r.se:.3f} (ub {r.ub:.3f}{', safe' if r.safe else ''})"  # noqa: E731
    print(f"re-read at ε = {margin:g}\n\n| arm | σ bin | OLD excess ± SE (ub) | NEW excess ± SE (ub) |\n|---|---|---|---|")
    for arm, b in sorted(rows[0].keys() & rows[1].keys()):
        label = f"({edges[b]:.3g}, {edges[b + 1]:.3g}]" if b < len(edges) - 1 else "σ = 1"
        print(f"| {arm} | {label} | {cell(rows[0][arm, b])} | {cell(rows[1][arm, b])} |")
    for name, result in zip(("OLD", "NEW"), results, strict=True):
        windows = ", ".join(f"{w.arm} {w.text()}" for w in stack_windows(result).windows)
        print(f"{name} windows: {windows or 'none'}")


if __name__ == "__main__":
    if sys.argv[1] == "--side_by_side":
        side_by_side(sys.argv[2], sys.argv[3], *(float(m) for m in sys.argv[4:5]))
    else:
        main(*sys.argv[1:3])
