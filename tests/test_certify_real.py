"""Certification in the real Flux training script (skipped unless ``SD_SCRIPTS_DIR`` points at an
sd-scripts checkout; ``tests/sd_scripts_e2e.py`` runs the script): ``mode = "auto"`` certifies windows
on the run's first 16 samples, trains with them and saves their provenance; a windows file certified
on another model is refused at start, naming the mismatch, and ``windows_foreign = "warn"`` trains with it."""

from __future__ import annotations

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
