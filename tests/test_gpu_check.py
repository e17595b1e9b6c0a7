"""``benchmarks/gpu_check.sh`` as a lent GPU machine runs it: no package registry, no ``../shared`` beside the
checkout, only what ``benchmarks/gpu_prepare.sh`` put in ``.gpu/``.

Without a host: usage, and the install from ``.gpu/`` (a wheel made here, ``pip --no-index``) with every registry
address and proxy pointing at a closed port and a poisoned ``../shared`` beside the checkout. With ``SD_SCRIPTS_DIR``:
``gpu_prepare.sh`` fills ``.gpu/`` of a copy of this checkout (it downloads the pinned wheels), and the check runs from
that copy on CPU (``--cpu-smoke``): the memory part with bounds no run meets must exit 1 and say so (1–2 min on the
loaded 2-core machine), and the whole check must pass (``long``: 3–7 min there). ``bench_production.targets`` and
``gpu_rng_check.compare``, the verdicts, are tested on made-up figures."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
SD_SCRIPTS_DIR = os.environ.get("SD_SCRIPTS_DIR")
sys.path.insert(0, str(SCRIPT.parent))
from bench_production import Bounds, targets  # noqa: E402
from gpu_rng_check import NOISE_FACTOR, compare  # noqa: E402

CLOSED = "http://127.0.0.1:9"  # the discard port: nothing answers there
POISON = 'raise SystemExit("the check reached ../shared beside the checkout")\n'


def _offline_env(**extra: str) -> dict[str, str]:
    """This environment with every registry and proxy a pip or an HTTP client would use pointing at a closed port, the
    host variables set to the poisoned ``../shared`` (the check must not use them), no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("PYTHONPATH", "GPU_CHECK_PARTS", "GPU_CHECK_MISS")}
    env.update(PIP_INDEX_URL=f"{CLOSED}/simple", PIP_EXTRA_INDEX_URL=f"{CLOSED}/simple", PIP_FIND_LINKS=CLOSED)
    env.update(http_proxy=CLOSED, https_proxy=CLOSED, HTTP_PROXY=CLOSED, HTTPS_PROXY=CLOSED, no_proxy="", NO_PROXY="")
    env.update(PYTHON=sys.executable, **extra)
    return env


def _run(script: Path, *args: str, env: dict[str, str], timeout: int = 1200) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=env, timeout=timeout)


def _poisoned_shared(root: Path) -> Path:
    """``root/shared/hosts/sd-scripts``: an sd-scripts tree every module of which stops the process."""
    host = root / "shared" / "hosts" / "sd-scripts"
    for name in ("flux_train_network.py", "train_network.py", "library/__init__.py", "networks/__init__.py"):
        (host / name).parent.mkdir(parents=True, exist_ok=True)
        (host / name).write_text(POISON)
    return host


def _wheel(folder: Path, name: str, version: str) -> Path:
    """A pure-python wheel of one module ``name`` that knows its version."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{name}/__init__.py", f"VERSION = {version!r}\n")
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")
    return path


def test_bad_usage_is_refused_before_anything_runs(tmp_path):
    env = _offline_env()
    assert _run(SCRIPT, env=env).returncode == 2
    bad = _run(SCRIPT, str(tmp_path), "--gpu", env=env)
    assert bad.returncode == 2 and "unknown option --gpu (allowed: --cpu-smoke)" in bad.stderr
    part = _run(SCRIPT, str(tmp_path / "out"), env={**env, "GPU_CHECK_PARTS": "production,speed"})
    assert part.returncode == 2 and "unknown part 'speed' (allowed: production rng certify_memory)" in part.stderr
    checkout = tmp_path / "checkout"
    (checkout / "benchmarks").mkdir(parents=True)
    shutil.copy(SCRIPT, checkout / "benchmarks")
    _poisoned_shared(tmp_path)  # a host beside the checkout is no substitute for .gpu/
    bare = _run(checkout / "benchmarks" / "gpu_check.sh", str(tmp_path / "out"), "--cpu-smoke", env=env)
    assert bare.returncode == 2 and "no prepared " in bare.stderr and "gpu_prepare.sh" in bare.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkout", "shared"]  # no OUT made


def test_it_installs_from_gpu_with_no_registry_and_finds_the_host_there(tmp_path):
    """A checkout holding the script and a prepared ``.gpu/`` (a wheel made here, a host), the poisoned ``../shared``
    beside it, every registry closed: the carried package installs from ``.gpu/wheels`` into a fresh folder outside
    OUT and imports from there, the host is ``.gpu/hosts/sd-scripts``; with no CUDA device the check then stops."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    checkout = tmp_path / "checkout"
    (checkout / "benchmarks").mkdir(parents=True)
    shutil.copy(SCRIPT, checkout / "benchmarks")
    gpu = checkout / ".gpu"
    (gpu / "wheels").mkdir(parents=True)
    _wheel(gpu / "wheels", "gpucheckprobe", "1.2")
    (gpu / "requirements.txt").write_text("gpucheckprobe==1.2\n")
    (gpu / "hosts" / "sd-scripts").mkdir(parents=True)
    (gpu / "hosts" / "sd-scripts" / "flux_train_network.py").write_text("")
    _poisoned_shared(tmp_path)
    out = tmp_path / "out"
    done = _run(
        checkout / "benchmarks" / "gpu_check.sh", str(out), env=_offline_env(SD_SCRIPTS_DIR=str(tmp_path / "shared/hosts/sd-scripts"))
    )
    assert done.returncode == 2 and "sees no CUDA device (on a CPU: --cpu-smoke)" in done.stderr, done.stderr
    summary = json.loads((out / "gpu_check.json").read_text())
    install = summary["parts"]["install"]
    assert install["exit"] == 0 and "--no-index" in install["command"] and "--isolated" in install["command"]
    assert "Successfully installed gpucheckprobe-1.2" in (out / "install.log").read_text()
    site = install["command"].split("--target ")[1].split()[0]
    assert not Path(site).is_relative_to(out) and not Path(site).exists()  # a fresh folder outside OUT, removed at the end
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "install.log"]
    assert summary["carried"] == {"gpucheckprobe": {"version": "1.2", "from_install": True}}
    assert summary["sd_scripts"] == str(gpu / "hosts" / "sd-scripts") and summary["python"] == sys.executable


def test_a_missed_target_is_named_and_fails_the_production_part():
    s = {
        "routes": {"r0.875": {"realized_over_predicted": 0.97, "error": -0.01}, "r0.75": {"realized_over_predicted": 0.9, "error": 0.04}},
        "overhead": 0.002,
        "hook_share": math.nan,  # a figure that could not be measured misses
    }
    rows = targets(s, Bounds())
    assert [r["target"] for r in rows if not r["met"]] == ["r0.75 realized/predicted", "r0.75 |error|", "hook_share"]
    assert all(r["met"] for r in targets({**s, "hook_share": 0.0}, Bounds(min_realized=0.5, max_error=0.05)))


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


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A copy of this checkout (what git tracks or would, as the device tool sends it) at ROOT/checkout, the poisoned
    ``../shared`` beside it, and ``.gpu/`` filled by ``gpu_prepare.sh`` from the host at ``SD_SCRIPTS_DIR``."""
    root = tmp_path_factory.mktemp("lent")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (REPO / name).is_file():
            (root / "checkout" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / "checkout" / name)
    _poisoned_shared(root)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        ["bash", str(root / "checkout" / "benchmarks" / "gpu_prepare.sh")], capture_output=True, text=True, timeout=900,
        env={**env, "PYTHON": sys.executable, "SD_SCRIPTS_DIR": SD_SCRIPTS_DIR},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(limit 64.0 MiB)" in done.stdout
    return root / "checkout"


real_host = pytest.mark.skipif(not SD_SCRIPTS_DIR, reason="set SD_SCRIPTS_DIR to an sd-scripts checkout (main 48d368fa)")


@real_host
def test_gpu_prepare_carries_only_wheels_and_the_hosts_python_code(prepared):
    gpu = prepared / ".gpu"
    pins = (gpu / "requirements.txt").read_text().split()
    assert {pin.split("==")[0] for pin in pins} >= {"diffusers", "toml", "transformers"}  # what the image lacks or has too new
    wheels = [p.name for p in (gpu / "wheels").iterdir()]
    assert all(name.endswith(".whl") for name in wheels) and len(wheels) >= len(pins)
    host = [p for p in (gpu / "hosts" / "sd-scripts").rglob("*") if p.is_file()]
    assert host and all(p.suffix == ".py" for p in host)  # no git history, no images
    assert (prepared / "library").exists() is False  # nothing of the host lands outside .gpu/
    size = sum(p.stat().st_size for p in gpu.rglob("*") if p.is_file())
    assert size < 64 * 2**20
    ignored = subprocess.run(["git", "check-ignore", "-q", ".gpu/requirements.txt"], cwd=REPO)
    assert ignored.returncode == 0  # never committed


@real_host
def test_a_missed_target_exits_non_zero_and_says_which(prepared, tmp_path):
    """The memory part with a bound no run meets (GPU_CHECK_MISS=1), run alone (GPU_CHECK_PARTS), offline."""
    out = tmp_path / "check"
    env = _offline_env(
        GPU_CHECK_PARTS="certify_memory", GPU_CHECK_MISS="1", SD_SCRIPTS_DIR=str(prepared.parent / "shared/hosts/sd-scripts")
    )
    done = _run(prepared / "benchmarks" / "gpu_check.sh", str(out), "--cpu-smoke", env=env)
    assert done.returncode == 1, done.stderr[-4000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["sd_scripts"] == str(prepared / ".gpu" / "hosts" / "sd-scripts")
    assert all(c["from_install"] for c in summary["carried"].values()) and summary["carried"]["transformers"]["version"] == "4.54.1"
    assert list(summary["parts"]) == ["install", "certify_memory"] and summary["parts"]["certify_memory"]["exit"] == 1
    assert not summary["ok"] and len(summary["missed"]) == 4 and all(m.startswith("certify_memory: ") for m in summary["missed"])
    memory = json.loads((out / "certify_memory.json").read_text())
    assert not memory["ok"] and memory["max_bytes_per_param"] == 0 and not any(r["met"] for r in memory["rows"])


@real_host
@pytest.mark.long
def test_the_gpu_check_runs_end_to_end_on_cpu_and_writes_every_json(prepared, tmp_path):
    out = tmp_path / "check"
    done = _run(prepared / "benchmarks" / "gpu_check.sh", str(out), "--cpu-smoke", env=_offline_env())
    assert done.returncode == 0, done.stderr[-4000:]
    parts = [f"{name}.{ext}" for name in ("production", "rng", "certify_memory") for ext in ("json", "log")]
    assert sorted(p.name for p in out.iterdir()) == sorted([*parts, "gpu_check.json", "install.log"])  # 8: what the device tool brings back
    summary = json.loads((out / "gpu_check.json").read_text())
    bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    dtype, weight_dtype = ("bf16", "torch.bfloat16") if bf16 else ("fp32", "torch.float32")
    assert summary["mode"] == "--cpu-smoke" and summary["device"] == "cpu" and summary["dtype"] == dtype
    assert summary["python"] == sys.executable and summary["sd_scripts"] == str(prepared / ".gpu" / "hosts" / "sd-scripts")
    assert all(c["from_install"] for c in summary["carried"].values())
    assert {name: (part["exit"], part["missed"]) for name, part in summary["parts"].items()} == {
        name: (0, []) for name in ("install", "production", "rng", "certify_memory")
    }
    assert summary["ok"] and summary["checks_seconds"] == sum(p["seconds"] for n, p in summary["parts"].items() if n != "install")

    production = json.loads((out / "production.json").read_text())
    assert production["run"]["device"] == "cpu" and production["run"]["dtype"] == dtype and production["ok"]
    assert [a["arch"] for a in production["archs"]] == ["sd3", "anima", "lumina", "flux"]  # every production architecture
    for arch in production["archs"]:
        assert set(arch["routes"]) == {"r0.875", "r0.75"} and isinstance(arch["realized_over_predicted"], float)
        assert arch["weight_dtype"] == weight_dtype  # the trainer frame the plugin reads holds the steps' dtype
        assert arch["gradient_checkpointing"] == (arch["arch"] == "flux")  # as on the GPU
        assert len(arch["targets"]) == 6 and arch["missed"] == []

    rng = json.loads((out / "rng.json").read_text())
    assert rng["arch"] == "flux" and rng["dtype"] == dtype and rng["weight_dtype"] == weight_dtype
    assert rng["native_repeatable"] and rng["compared"] == "bitwise" and rng["native_runs"] == 2  # the CPU repeats itself
    assert (
        rng["ok"]
        and rng["missed"] == []
        and rng["unrouted_bitwise"]
        and rng["unrouted_generators_equal"]
        and rng["routed_max_abs_diff"] > 0
    )
    assert {name: t["violations"] for name, t in rng["trap"].items()} == {"never": [], "r0.75": []}
    assert all(t["restores_checked"] > 0 for t in rng["trap"].values())  # the trap saw the hook's forks

    memory = json.loads((out / "certify_memory.json").read_text())
    rows = memory["rows"]
    assert memory["ok"] and sorted((r["probes"], r["bins"]) for r in rows) == [(8, 2), (8, 4), (16, 2), (16, 4)]
    # every bin of route 0.75 safe; 0.875 listed but not run there (the deeper route's windows leave it nothing to route)
    assert all(r["safe"] == r["bins"] and r["tests"] == 2 * r["bins"] and r["host_bytes_per_param"] > 0 for r in rows)
    lines = [line for line in (out / "certify_memory.log").read_text().splitlines() if "certify peak bytes/param = " in line]
    assert len(lines) == 4 and all(line.split("bytes/param = ")[1].split()[0].replace(".", "").isdigit() for line in lines)
