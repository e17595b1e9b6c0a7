"""``benchmarks/gpu_check.sh`` end to end on CPU at small sizes (``--cpu-smoke``), so the GPU check is
known to work before a device is lent: every part exits 0 and writes its JSON with the figures the
GPU run reports. Needs the sd-scripts checkout (skipped unless ``SD_SCRIPTS_DIR`` is set; about 2 min
on one core)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.sh"
SD_SCRIPTS_DIR = os.environ.get("SD_SCRIPTS_DIR")


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=1200)


def test_bad_usage_is_refused_before_anything_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SD_SCRIPTS_DIR"}
    assert _run(env=env).returncode == 2
    bad = _run(str(tmp_path), "--gpu", env={**env, "SD_SCRIPTS_DIR": "x"})
    assert bad.returncode == 2 and "unknown option --gpu (allowed: --cpu-smoke)" in bad.stderr
    missing = _run(str(tmp_path), "--cpu-smoke", env=env)
    assert missing.returncode == 2 and "SD_SCRIPTS_DIR" in missing.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(not SD_SCRIPTS_DIR, reason="set SD_SCRIPTS_DIR to an sd-scripts checkout (main 48d368fa)")
def test_the_gpu_check_runs_end_to_end_on_cpu_and_writes_every_json(tmp_path):
    out = tmp_path / "check"
    done = _run(str(out), "--cpu-smoke", env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["mode"] == "--cpu-smoke"
    assert {name: part["exit"] for name, part in summary["parts"].items()} == {"production": 0, "rng": 0, "certify_memory": 0}

    production = json.loads((out / "production.json").read_text())
    assert production["run"]["device"] == "cpu" and [a["arch"] for a in production["archs"]] == ["anima"]
    arch = production["archs"][0]
    assert set(arch["routes"]) == {"r0.875", "r0.75"} and isinstance(arch["realized_over_predicted"], float)

    rng = json.loads((out / "rng.json").read_text())
    assert rng["ok"] and rng["native_repeatable"] and rng["unrouted_bitwise"] and rng["unrouted_generators_equal"]
    assert {name: t["violations"] for name, t in rng["trap"].items()} == {"never": [], "r0.75": []}
    assert all(t["restores_checked"] > 0 for t in rng["trap"].values())  # the trap saw the hook's forks

    memory = json.loads((out / "certify_memory.json").read_text())
    rows = memory["rows"]
    assert sorted((r["probes"], r["bins"]) for r in rows) == [(8, 2), (8, 4), (16, 2), (16, 4)]
    assert all(r["safe"] == r["tests"] == 2 * r["bins"] and r["host_bytes_per_param"] > 0 for r in rows)  # every bin of both routes safe
    lines = [line for line in (out / "certify_memory.log").read_text().splitlines() if "certify peak bytes/param = " in line]
    assert len(lines) == 4 and all(line.rsplit("= ", 1)[1].replace(".", "").isdigit() for line in lines)
