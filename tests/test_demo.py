"""The README's main job, at CI size: ``python -m downscale_plugin demo --quick``."""

from __future__ import annotations

import re

from downscale_plugin.__main__ import main


def test_demo_quick_trains_both_adapters_and_reports(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DOWNSCALE_PLUGIN_CACHE", str(tmp_path / "cache"))  # pretraining included
    png = tmp_path / "demo.png"
    assert main(["demo", "--quick", "--steps", "12", "--out", str(png), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert png.is_file() and png.stat().st_size > 10_000
    realized = [float(x) for x in re.findall(r"(?:route r\d.*|native steps): realized / predicted\s+(?:100\.0 %\s+)?([\d.]+) % /", out)]
    assert len(realized) == 3 and abs(sum(realized) - 100.0) < 0.3  # two routes + native, all 12 steps
    assert realized[-1] < 100.0  # the plugin routed at least one step
    val = re.search(r"validation loss \(base ([\d.]+)\)\s+([\d.]+)\s+([\d.]+)", out)
    assert val and all(0.0 < float(v) < 10.0 for v in val.groups())
    cosine = float(re.search(r"cosine of ΔW to the native adapter\s+1\s+(-?[\d.]+)", out).group(1))
    assert -1.0 <= cosine < 1.0  # routed steps trained a different adapter
    assert "12 train forwards" in out and "token histogram" in out
