"""Certification in the real Flux training script (skipped unless ``SD_SCRIPTS_DIR`` points at an
sd-scripts checkout; ``tests/sd_scripts_e2e.py`` runs the script): ``mode = "auto"`` certifies windows
on the run's first 16 samples, trains with them and saves their provenance; a windows file certified
on another model is refused at start, naming the mismatch, and ``windows_foreign = "warn"`` trains with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SD_SCRIPTS_DIR = os.environ.get("SD_SCRIPTS_DIR")
pytestmark = pytest.mark.skipif(not SD_SCRIPTS_DIR, reason="set SD_SCRIPTS_DIR to an sd-scripts checkout (main 48d368fa)")
HERE = Path(__file__).parent

FOREIGN = """
[plugins.downscale]
gate = "coupled"
windows_model = "00000000"        # certified on another model than this run's
windows_arch = "flux"
windows_native = "16x16"          # the run's 128 px images: 16x16 latents, the same tier
windows_margin = 0.05
windows_method = "certify"
{foreign}

[[plugins.downscale.routes]]
route = "128:96"
sigma_min = 0.6
"""


def run_e2e(work: Path, foreign: str, mode: str = "train", **env_extra: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([SD_SCRIPTS_DIR, str(HERE.parent)]),
        "COLUMNS": "1000",
        "E2E_ROUTES": FOREIGN.format(foreign=foreign),
        **env_extra,
    }
    return subprocess.run(
        [sys.executable, str(HERE / "sd_scripts_e2e.py"), "flux", str(work), mode],
        cwd=SD_SCRIPTS_DIR,
        env=env,
        capture_output=True,
        text=True,
    )


def test_windows_certified_on_another_model_are_refused_naming_the_mismatch(tmp_path):
    proc = run_e2e(tmp_path, "")
    log = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0, log[-3000:]
    assert "windows certified for another model, arch or tier" in log, log[-3000:]
    assert "windows_model: the windows were certified on model '00000000', this run's model is '" in log, log[-3000:]
    assert "windows_arch" not in log.split("windows certified for another model")[1][:400]  # only the mismatch is named
    assert not (tmp_path / "out" / "lora.safetensors").exists()


def test_windows_foreign_warn_trains_with_them(tmp_path):
    proc = run_e2e(tmp_path, 'windows_foreign = "warn"')
    log = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 0 and "E2E OK" in log, log[-3000:]
    assert 'windows_foreign = "warn": using the windows anyway' in log and "'00000000'" in log


def test_auto_certifies_on_the_runs_first_samples_and_trains_with_the_windows(tmp_path):
    proc = run_e2e(tmp_path, "", "auto", E2E_STEPS="40")
    log = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 0 and "E2E OK" in log, log[-3000:]
    assert "certified before train batch 16" in log and "certification: " in log and "net saving: FLOP" in log, log[-3000:]


AUTO_RESUME = """
[plugins.downscale]
mode = "auto"
map_out = "{out}"
map_ratios = [0.5]
map_bins = "0,0.5,1"
map_margin = 0.99
certify_draws = 2
certify_budget = 0.5
"""


def recorded(work: Path, out: Path, *argv: str) -> tuple[dict, str]:
    """The real Flux script through ``sd_scripts_e2e.py record`` in auto: 16 images, batch 1, accumulation 2, 24 steps."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([SD_SCRIPTS_DIR, str(HERE.parent)]),
        "COLUMNS": "1000",
        "E2E_ROUTES": AUTO_RESUME.format(out=out),
        "E2E_IMAGES": "16",
        "E2E_REPEATS": "1",
        "E2E_STEPS": "24",
    }
    proc = subprocess.run(
        [sys.executable, str(HERE / "sd_scripts_e2e.py"), "flux", str(work), "record", "--gradient_accumulation_steps", "2", *argv],
        cwd=SD_SCRIPTS_DIR,
        env=env,
        capture_output=True,
        text=True,
    )
    log = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 0 and "E2E OK" in log, log[-4000:]
    return json.loads((work / "record.json").read_text()), log


def test_a_resumed_auto_run_routes_by_its_certified_windows_without_certifying_again(tmp_path):
    """The probes are in at forward 16; the state at step 10 (forward 20) was saved after the certification. Resumed
    from it, the real loop routes by the state's certified windows from its first forward and certifies nothing again
    (this host does not restore the RNG here, "Could not load random states", so σ, not the routes, differ)."""
    first, log = recorded(tmp_path / "a", tmp_path / "certify_a", "--save_state", "--save_every_n_steps", "10")
    assert "certified before train batch 16" in log and len(first["steps"]) == 48
    windows = json.loads(first["metadata"]["ss_downscale_routes"])
    assert windows and any(s["rule"] >= 0 for s in first["steps"][16:])
    state = tmp_path / "a" / "out" / "lora-step00000010-state"
    second, log = recorded(tmp_path / "b", tmp_path / "certify_b", "--resume", str(state), "--skip_until_initial_step")
    assert "certified before train batch" not in log and "the resumed state was saved after the measurement" in log, log[-3000:]
    assert "certification: none in this run; the resumed state's windows" in log and not (tmp_path / "certify_b").exists()
    steps = second["steps"]
    assert second["offset"] == [20] and len(steps) >= 6 and any(s["rule"] >= 0 for s in steps)
    (window,) = windows
    assert all(window["sigma_min"] < sigma < window["sigma_max"] for s in steps if s["rule"] == 0 for sigma in s["sigmas"])
    assert json.loads(second["metadata"]["ss_downscale_routes"]) == windows
    assert json.loads(second["metadata"]["ss_downscale_counts"])["forwards"] == 20 + len(steps)
    assert json.loads(second["metadata"]["ss_downscale_map"])["method"] == "certify"
