"""The README's main job, at CI size: ``python -m downscale_plugin demo --quick``."""

from __future__ import annotations

import re

from downscale_plugin.__main__ import main


def test_demo_quick_trains_both_adapters_and_reports(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DOWNSCALE_PLUGIN_CACHE", str(tmp_path / "cache"))  # an empty cache: the shipped base needs none
    png = tmp_path / "demo.png"
    assert main(["demo", "--quick", "--steps", "12", "--seed_recipe", "--out", str(png), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert png.is_file() and png.stat().st_size > 10_000
    realized = [float(x) for x in re.findall(r"(?:route r\d.*|native steps): realized / predicted\s+(?:100\.0 %\s+)?([\d.]+) % /", out)]
    assert len(realized) == 3 and abs(sum(realized) - 100.0) < 0.3  # two routes + native, every routed-run step
    assert realized[-1] < 100.0  # the plugin routed at least one step
    native_steps, routed_steps = map(int, re.search(r"steps \(batch size\)\s+(\d+) \(1\)\s+(\d+) \(1\)", out).groups())
    assert native_steps == 12 and routed_steps > 12 and f"{routed_steps} train forwards" in out  # cheaper steps, same FLOPs
    flops = float(re.search(r"training FLOPs \(the native run's = 1\)\s+1\.00\s+([\d.]+)", out).group(1))
    assert 1.0 <= flops < 1.0 + 1 / native_steps  # both twins stop at native's FLOPs (the cosine lr is zero there)
    val = re.search(r"held-out validation loss at the native run's FLOPs \(base ([\d.]+)\)\s+([\d.]+)\s+([\d.]+)", out)
    assert val and all(0.0 < float(v) < 10.0 for v in val.groups()) and val.group(2) != val.group(3)
    reach = re.search(r"time to 90 % of native's improvement \([\d.]+\): FLOPs \(native run = 1\)\s+([\d.]+)\s+(\S+)", out)
    assert reach and 0.0 < float(reach.group(1)) <= 1.0  # native reaches its own target within its run
    assert "token histogram" in out
    assert out.startswith("concept: style") and "shipped lab base 'multires'" in out  # the demo says what it runs and why


def test_demo_refuses_two_routers_before_any_model(capsys):
    assert main(["demo", "--quick", "--seed_recipe", "--config", "missing.toml"]) != 0
    assert "--config and --seed_recipe" in capsys.readouterr().err


def test_validation_points_leave_the_run_and_the_global_generators_as_they_were():
    """The demo's picture: native-grid validation loss against training seconds. Validating between
    steps must change nothing the table reports but time: the same losses, the same adapter, the same
    global RNG afterwards, and no validation call may move a global generator."""
    import torch
    from rng_trap import rng_states

    from downscale_plugin.lab.data import LabData, LabDataConfig
    from downscale_plugin.lab.model import LabModelConfig, build_model
    from downscale_plugin.lab.trainer import native_validation_loss, train_lora

    cfg = LabModelConfig(
        hidden_size=32, num_heads=2, double_layers=1, single_layers=1, latent_channels=4, text_tokens=4, text_dim=16, pooled_dim=8
    )
    data = LabData(LabDataConfig(buckets=((64, 64), (64, 96)), latent_channels=cfg.latent_channels))
    model = build_model(cfg, seed=0)
    val_set = data.validation_set(per_bucket=1, seed=0)
    moved = []

    def validate(deltas):
        before = rng_states()
        loss = native_validation_loss(model, deltas, val_set, 0)
        moved.append(not all(_same(a, b) for a, b in zip(before, rng_states(), strict=True)))
        return loss

    runs = []
    for kwargs in ({}, {"validate": validate, "validate_every": 2}):
        result = train_lora(model, data, steps=5, lr=1e-2, rank=2, seed=3, **kwargs)
        runs.append((result, rng_states()))
    (plain, plain_rng), (validated, validated_rng) = runs
    assert plain.losses == validated.losses and plain.val_curve == []
    assert all(torch.equal(plain.deltas[k], validated.deltas[k]) for k in plain.deltas)
    assert all(_same(a, b) for a, b in zip(plain_rng, validated_rng, strict=True)) and not any(moved)
    assert [steps for _, steps, _ in validated.val_curve] == [0, 2, 4, 5]
    seconds = [s for s, _, _ in validated.val_curve]
    assert seconds[0] == 0.0 and seconds == sorted(seconds) and seconds[-1] == validated.wall_time
    assert validated.val_curve[-1][2] == native_validation_loss(model, validated.deltas, val_set, 0)
    assert validated.val_curve[0][2] == native_validation_loss(model, None, val_set, 0)  # ΔW = 0 before the first step


def _same(a, b) -> bool:
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple) and len(a) > 1 and isinstance(a[1], np.ndarray):  # NumPy's (name, keys, pos, …)
        return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b, strict=True))
    return a == b


def test_the_demos_windows_are_the_style_maps_at_the_default_margin():
    """The embedded default is the stored windows file the quality study's default arm reads, route for route."""
    from pathlib import Path

    from downscale_plugin.certify_config import DEFAULT_MARGIN
    from downscale_plugin.config import read_plugin_toml
    from downscale_plugin.hosts.lab.demo import DEMO_WINDOWS

    stored = read_plugin_toml(str(Path(__file__).parent.parent / "docs/fidelity/quality/windows" / f"style_eps{DEFAULT_MARGIN:g}.toml"))
    assert stored["windows_margin"] == DEFAULT_MARGIN and stored["arch"] == DEMO_WINDOWS["arch"]
    assert stored["routes"] == DEMO_WINDOWS["routes"]
