"""``benchmarks/gpu_check.sh``: usage, where it finds the host, the environment it builds, and the whole check end to
end on CPU at small sizes (``--cpu-smoke``), so the GPU check is known to work before a device is lent: every part
exits 0 and writes its JSON with the figures the GPU run reports. The end-to-end case needs the sd-scripts checkout
(skipped unless ``SD_SCRIPTS_DIR`` is set; 4–7 min on one loaded core). ``gpu_rng_check.compare``, the RNG check's
verdict, is tested on made-up LoRA states (it imports torch only)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.sh"
SD_SCRIPTS_DIR = os.environ.get("SD_SCRIPTS_DIR")
sys.path.insert(0, str(SCRIPT.parent))
from gpu_rng_check import NOISE_FACTOR, compare  # noqa: E402


def _run(*args: str, env: dict[str, str] | None = None, script: Path = SCRIPT) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=env, timeout=1200)


def _no_host_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("SD_SCRIPTS_DIR", "PYTHON", "GPU_CHECK_VENV")}


def _layout(root: Path) -> Path:
    """A checkout at ROOT/repo holding only the script, and an sd-scripts snapshot at ROOT/shared/hosts beside it."""
    (root / "repo" / "benchmarks").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "repo" / "benchmarks")
    host = root / "shared" / "hosts" / "sd-scripts"
    host.mkdir(parents=True)
    (host / "flux_train_network.py").write_text("")
    (host / "requirements.txt").write_text("accelerate==1.6.0\nnumpy\n# a comment\n-e .\n")
    return root / "repo" / "benchmarks" / "gpu_check.sh"


def _logging_python(path: Path, log: Path) -> Path:
    """An executable standing in for python: it appends its arguments and SD_SCRIPTS_DIR to ``log`` and prints nothing
    (so the check stops at "cannot import torch"); ``-m venv DIR`` also makes DIR/bin/python, another such stand-in."""
    path.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$(basename "$0") $* | SD_SCRIPTS_DIR=$SD_SCRIPTS_DIR" >> {log}\n'
        'if [[ "$1 $2" == "-m venv" ]]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; fi\n'
        "cat > /dev/null\n"
    )
    path.chmod(0o755)
    return path


def test_bad_usage_is_refused_before_anything_runs(tmp_path):
    env = _no_host_env()
    assert _run(env=env).returncode == 2
    bad = _run(str(tmp_path), "--gpu", env={**env, "SD_SCRIPTS_DIR": "x"})
    assert bad.returncode == 2 and "unknown option --gpu (allowed: --cpu-smoke)" in bad.stderr
    missing = _run(str(tmp_path / "out"), "--cpu-smoke", env={**env, "SD_SCRIPTS_DIR": str(tmp_path / "nowhere")})
    assert missing.returncode == 2 and "no sd-scripts checkout at " in missing.stderr
    assert not any(tmp_path.iterdir())


def test_it_finds_the_host_beside_the_checkout_and_builds_its_environment_there(tmp_path):
    """Without SD_SCRIPTS_DIR the snapshot at ../shared/hosts/sd-scripts is the host; without PYTHON a venv is built
    in the checkout: a CUDA torch/torchvision pair, the host's requirements less its ``-e .`` (the snapshot is
    read-only), the project with its map extra. (The stand-in python imports nothing, so the check stops there.)"""
    script = _layout(tmp_path)
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    _logging_python(bin_dir / "python3", log)
    env = {**_no_host_env(), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    done = _run(str(tmp_path / "out"), env=env, script=script)
    assert done.returncode == 2 and "cannot import torch" in done.stderr, done.stderr
    host = (tmp_path / "shared" / "hosts" / "sd-scripts").resolve()
    venv = tmp_path / "repo" / ".venv-gpu-check"
    calls = [line.split(" | ") for line in log.read_text().splitlines()]
    assert all(where == f"SD_SCRIPTS_DIR={host}" for _, where in calls), calls
    pip = "python -m pip install --disable-pip-version-check -q"
    assert [call for call, _ in calls] == [
        f"python3 -m venv {venv}",
        f"{pip} torch==2.14.1 torchvision==0.29.1",
        f"{pip} -r {venv}/host-requirements.txt",
        f"{pip} -e {tmp_path / 'repo'}[map]",
        "python -",  # the probe of torch and the device
    ]
    assert (venv / "host-requirements.txt").read_text().splitlines() == ["accelerate==1.6.0", "numpy", "# a comment"]
    reused = _run(str(tmp_path / "again"), env=env, script=script)  # the venv built to its end: no pip
    assert reused.returncode == 2 and log.read_text().splitlines()[len(calls) :] == [f"python - | SD_SCRIPTS_DIR={host}"]
    given = _run(str(tmp_path / "given"), env={**env, "PYTHON": str(bin_dir / "python3")}, script=script)
    assert given.returncode == 2 and log.read_text().splitlines()[-1].startswith("python3 - |")  # a given python: no venv


def test_without_a_cuda_device_only_the_cpu_smoke_runs(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    script = _layout(tmp_path)  # the check stops before it reads the (empty) host
    done = _run(str(tmp_path / "out"), env={**_no_host_env(), "PYTHON": sys.executable}, script=script)
    assert done.returncode == 2 and "sees no CUDA device (on a CPU: --cpu-smoke)" in done.stderr, done.stderr


def _lora(value: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((3,), value), "b": torch.zeros(2)}


def test_the_rng_verdict_is_bitwise_only_where_native_repeats_itself():
    same = compare([_lora(1.0), _lora(1.0)], _lora(1.0), _lora(2.0))
    assert same["compared"] == "bitwise" and same["unrouted_ok"]
    off = compare([_lora(1.0), _lora(1.0)], _lora(1.0 + 1e-7), _lora(2.0))  # native repeats itself: one ulp is a change
    assert off["compared"] == "bitwise" and not off["unrouted_ok"] and not off["unrouted_bitwise"]
    noisy = [_lora(1.0), _lora(1.0 + 1e-4), _lora(1.0 - 1e-4)]  # spread 2e-4
    with pytest.raises(ValueError, match="three native runs"):
        compare(noisy[:2], _lora(1.0), _lora(2.0))
    inside = compare(noisy, _lora(1.0 + 1e-4 * NOISE_FACTOR), _lora(2.0))
    assert inside["compared"] == "within the native runs' spread" and inside["unrouted_ok"] and not inside["unrouted_bitwise"]
    assert inside["native_spread"] == pytest.approx(2e-4, rel=1e-3) and inside["tolerance"] == pytest.approx(2e-4 * NOISE_FACTOR, rel=1e-3)
    outside = compare(noisy, _lora(1.0 + 1e-4 + 2e-4 * NOISE_FACTOR * 1.1), _lora(2.0))
    assert not outside["unrouted_ok"]
    blind = compare(noisy, _lora(1.0), _lora(1.0 + 1e-4))  # the routed run inside the band: the check cannot tell
    assert not blind["routed_outside_tolerance"] and not blind["unrouted_ok"]


@pytest.mark.skipif(not SD_SCRIPTS_DIR, reason="set SD_SCRIPTS_DIR to an sd-scripts checkout (main 48d368fa)")
def test_the_gpu_check_runs_end_to_end_on_cpu_and_writes_every_json(tmp_path):
    out = tmp_path / "check"
    done = _run(str(out), "--cpu-smoke", env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    dtype, weight_dtype = ("bf16", "torch.bfloat16") if bf16 else ("fp32", "torch.float32")
    assert summary["mode"] == "--cpu-smoke" and summary["device"] == "cpu" and summary["dtype"] == dtype
    assert summary["python"] == sys.executable and summary["sd_scripts"] == str(Path(SD_SCRIPTS_DIR).resolve())
    assert {name: part["exit"] for name, part in summary["parts"].items()} == {"production": 0, "rng": 0, "certify_memory": 0}
    assert summary["checks_seconds"] == sum(part["seconds"] for part in summary["parts"].values())

    production = json.loads((out / "production.json").read_text())
    assert production["run"]["device"] == "cpu" and production["run"]["dtype"] == dtype
    assert [a["arch"] for a in production["archs"]] == ["sd3", "anima", "lumina", "flux"]  # every production architecture
    for arch in production["archs"]:
        assert set(arch["routes"]) == {"r0.875", "r0.75"} and isinstance(arch["realized_over_predicted"], float)
        assert arch["weight_dtype"] == weight_dtype  # the trainer frame the plugin reads holds the steps' dtype

    rng = json.loads((out / "rng.json").read_text())
    assert rng["arch"] == "flux" and rng["dtype"] == dtype and rng["weight_dtype"] == weight_dtype
    assert rng["native_repeatable"] and rng["compared"] == "bitwise" and rng["native_runs"] == 2  # the CPU repeats itself
    assert rng["ok"] and rng["unrouted_bitwise"] and rng["unrouted_generators_equal"] and rng["routed_max_abs_diff"] > 0
    assert {name: t["violations"] for name, t in rng["trap"].items()} == {"never": [], "r0.75": []}
    assert all(t["restores_checked"] > 0 for t in rng["trap"].values())  # the trap saw the hook's forks

    memory = json.loads((out / "certify_memory.json").read_text())
    rows = memory["rows"]
    assert sorted((r["probes"], r["bins"]) for r in rows) == [(8, 2), (8, 4), (16, 2), (16, 4)]
    # every bin of route 0.75 safe; 0.875 listed but not run there (the deeper route's windows leave it nothing to route)
    assert all(r["safe"] == r["bins"] and r["tests"] == 2 * r["bins"] and r["host_bytes_per_param"] > 0 for r in rows)
    lines = [line for line in (out / "certify_memory.log").read_text().splitlines() if "certify peak bytes/param = " in line]
    assert len(lines) == 4 and all(line.rsplit("= ", 1)[1].replace(".", "").isdigit() for line in lines)
