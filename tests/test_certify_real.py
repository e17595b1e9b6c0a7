"""Certification in the real Flux training script (skipped unless ``SD_SCRIPTS_DIR`` points at an
sd-scripts checkout; ``tests/sd_scripts_e2e.py`` runs the script): ``mode = "auto"`` certifies windows
on the run's first 16 samples, trains with them and saves their provenance; a windows file certified
on another model is refused at start, naming the mismatch, and ``windows_foreign = "warn"`` trains with it.
A certification that opens nothing (ε ≈ 0) leaves the run bitwise the plain ``networks.lora_flux`` run's.

A safe verdict reads 16 distinct probes (16 images): 16 × ``certify_draws`` × (1 + the route pass's cost) = 16 × 2 × 1.25
= 40 native-step equivalents here, so every auto run gives the certifier a budget of at least 40 (a smaller one is
refused at start). The route pass costs its token fraction (``E2E_TOKEN_COSTS``): under the run's FLOP model the
16x16 latents are text-dominated, and no window of these short runs could pay its evidence back.
"""

from __future__ import annotations

import json
import os
import re
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
    proc = run_e2e(tmp_path, "", "auto", E2E_STEPS="80", E2E_IMAGES="16", E2E_REPEATS="1", E2E_TOKEN_COSTS="1")  # 0.5 × 80 = 40
    log = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 0 and "E2E OK" in log, log[-3000:]
    assert (
        "certified before train batch " in log
        and "certification: " in log
        and "net (native-step equivalents of the run's FLOP model): routed saving" in log
    ), log[-3000:]


AUTO_RESUME = """
[plugins.downscale]
mode = "auto"
map_out = "{out}"
map_ratios = [0.5]
map_bins = "0,0.5,1"
map_margin = 0.99
certify_draws = 2
certify_budget = 0.5              # of 50 steps × accumulation 2: 50, one safe verdict (40)
certify_unpaid = "buy"           # a run this short cannot pay a window back: certify all the same (the mechanics)
"""


def recorded(
    work: Path, out: Path, *argv: str, table: str = AUTO_RESUME, steps: int = 40, images: int = 16, arch: str = "flux"
) -> tuple[dict, str]:
    """The real ``arch`` script through ``sd_scripts_e2e.py record`` with ``table``: ``images`` images, batch 1,
    accumulation 2; route passes at their token fraction (``E2E_TOKEN_COSTS``)."""
    env = {
        **os.environ,
        "COLUMNS": "1000",
        "E2E_ROUTES": table.format(out=out),
        "E2E_IMAGES": str(images),
        "E2E_REPEATS": "1",
        "E2E_STEPS": str(steps),
        "E2E_TOKEN_COSTS": "1",
    }
    proc = subprocess.run(
        [sys.executable, str(HERE / "sd_scripts_e2e.py"), arch, str(work), "record", "--gradient_accumulation_steps", "2", *argv],
        cwd=SD_SCRIPTS_DIR,
        env=env,
        capture_output=True,
        text=True,
    )
    log = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 0 and "E2E OK" in log, log[-4000:]
    return json.loads((work / "record.json").read_text()), log


def test_a_resumed_auto_run_routes_by_its_certified_windows_without_certifying_again(tmp_path):
    """The 16 distinct probes are in by forward 40 (sd-scripts may serve an image twice before it has served all 16: a
    repeat is not a probe); the state at step 20 (forward 40) was saved after the certification. Resumed
    from it, the real loop routes by the state's certified windows from its first forward and certifies nothing again
    (this host does not restore the RNG here, "Could not load random states", so σ, not the routes, differ)."""
    first, log = recorded(tmp_path / "a", tmp_path / "certify_a", "--save_state", "--save_every_n_steps", "20", steps=50)
    certified_at = int(re.search(r"certified before train batch (\d+)", log).group(1))
    assert 16 <= certified_at <= 40 and len(first["steps"]) == 100
    windows = json.loads(first["metadata"]["ss_downscale_routes"])
    assert windows and any(s["rule"] >= 0 for s in first["steps"][16:])
    state = tmp_path / "a" / "out" / "lora-step00000020-state"
    second, log = recorded(tmp_path / "b", tmp_path / "certify_b", "--resume", str(state), "--skip_until_initial_step", steps=50)
    assert "certified before train batch" not in log and "the resumed state was saved after the measurement" in log, log[-3000:]
    assert "certification: none in this run; the resumed state's windows" in log and not (tmp_path / "certify_b").exists()
    steps = second["steps"]
    assert second["offset"] == [40] and len(steps) >= 6 and any(s["rule"] >= 0 for s in steps)
    (window,) = windows
    assert all(window["sigma_min"] < sigma < window["sigma_max"] for s in steps if s["rule"] == 0 for sigma in s["sigmas"])
    assert json.loads(second["metadata"]["ss_downscale_routes"]) == windows
    assert json.loads(second["metadata"]["ss_downscale_counts"])["forwards"] == 40 + len(steps)
    assert json.loads(second["metadata"]["ss_downscale_map"])["method"] == "certify"


def test_a_second_real_run_on_the_same_model_reuses_the_cached_windows(tmp_path, windows_cache):
    """Two processes on the same (seeded, byte-identical) tiny Flux file, in two folders: the first certifies and caches,
    the second keys itself to the same entry (the model's sha256 and the real sampler's σ deciles are the same in a new
    process) and routes by the cached windows from its first forward, with no probe pass."""
    first, log = recorded(tmp_path / "a", tmp_path / "certify_a", steps=50)
    assert "certified before train batch" in log and "windows cache: no cached windows" in log, log[-3000:]
    (entry,) = windows_cache.glob("*.toml")
    second, log = recorded(tmp_path / "b", tmp_path / "certify_b", steps=50)
    assert "certified before train batch" not in log and f"reusing the cached windows {entry}" in log, log[-3000:]
    assert "certification: none in this run (0 native-step equivalents" in log and not (tmp_path / "certify_b").exists()
    windows = json.loads(first["metadata"]["ss_downscale_routes"])
    assert json.loads(second["metadata"]["ss_downscale_routes"]) == windows and any(s["rule"] >= 0 for s in second["steps"][:16])
    assert json.loads(second["metadata"]["ss_downscale_map"])["method"] == "reused"


OPENS_NOTHING = """
[plugins.downscale]
mode = "auto"
map_out = "{out}"
map_ratios = [0.5]
map_bins = "0,0.5,1"
map_margin = 1e-9                 # ε ≈ 0: no bin can be certified; the certifier spends its looks and opens nothing
certify_draws = 2                 # a look: 4 probes × 2 draws × (1 + 0.25) = 10 native-step equivalents
certify_budget = 0.5              # of 40 steps × accumulation 2: 40, one safe verdict (the least a run may give)
certify_unpaid = "buy"           # a run this short cannot pay a window back: certify all the same (the mechanics)
"""


@pytest.mark.parametrize(
    "console",
    [
        pytest.param(("--console_log_simple",), id="simple-console"),
        pytest.param((), id="rich-console"),
    ],
)
def test_a_certification_that_opens_nothing_leaves_the_real_flux_run_bitwise_the_hosts(console, tmp_path):
    """The real Flux script with ``networks.lora_flux`` and with the plugin in auto at ε ≈ 0, from the same TOML, with
    accumulation 2, ``--gradient_checkpointing`` and ``--flip_aug``: the certifier runs once 16 distinct probes are in, in the
    first epoch and usually between two micro-batches of an update (its probe passes draw noise and σ and run forward and backward through the model and
    the LoRA), opens nothing and must leave the rest bitwise the host's. 32 distinct images make the epoch 32 batches,
    so batches 17-32 draw their flips from Python's ``random`` as the certifier left it (sd-scripts reseeds it only at an
    epoch's start, ``shuffle_buckets``) and their σ, noise and the next epoch's shuffle from torch's generator; the
    micro-batch before the certification has its gradient in ``.grad`` and the optimizer steps after it. So the saved LoRA
    must equal the plain run's tensor for tensor: a deliberate ``torch.rand(1)`` or ``random.random()`` after the
    certifier changes all 26 of its LoRA weights. Also on sd-scripts' default rich console, whose handler draws Python's
    ``random`` for every record it renders: the plugin's records (the first step's resume line, the certification's
    lines) are logged through ``rng.plugin_logger``, which puts ``random`` back, or the flips after them would move."""
    import torch
    from safetensors.torch import load_file

    argv = ("--gradient_checkpointing", "--flip_aug", *console)
    lora_flux = ("--network_module", "networks.lora_flux")
    plain, _ = recorded(tmp_path / "plain", tmp_path / "certify_plain", *lora_flux, *argv, table=OPENS_NOTHING, steps=40, images=32)
    mine, log = recorded(tmp_path / "plugin", tmp_path / "certify", *argv, table=OPENS_NOTHING, steps=40, images=32)
    assert "certified before train batch " in log and "no route has a certified window at margin 1e-09" in log, log[-3000:]
    assert not (tmp_path / "certify_plain").exists() and not plain["steps"]  # the plain run never loaded the plugin
    blob = json.loads((tmp_path / "certify" / "certify.json").read_text())
    assert blob["cost"]["native_step_equivalents"] > 0 and not any(b["safe"] for b in blob["bins"]), blob["cost"]
    assert any(b["evidence"]["images"] for b in blob["bins"]), blob["bins"]  # a look was read
    certified = json.loads(mine["metadata"]["ss_downscale_map"])
    assert certified["safe_bins"] == [] and certified["windows"] == [] and json.loads(mine["metadata"]["ss_downscale_routes"]) == []
    assert len(mine["steps"]) == 80 and all(s["rule"] < 0 for s in mine["steps"])  # 40 updates × 2 micro-batches, all native
    assert json.loads(mine["metadata"]["ss_downscale_counts"])["forwards"] == 80
    for key in ("ss_steps", "ss_epoch", "ss_num_batches_per_epoch", "ss_gradient_checkpointing", "ss_datasets"):
        assert mine["metadata"][key] == plain["metadata"][key], key
    assert plain["metadata"]["ss_steps"] == "40" and plain["metadata"]["ss_num_batches_per_epoch"] == "32"
    assert plain["metadata"]["ss_gradient_checkpointing"] == "True"
    assert json.loads(plain["metadata"]["ss_datasets"])[0]["subsets"][0]["flip_aug"] is True
    theirs = load_file(str(tmp_path / "plain" / "out" / "lora.safetensors"))
    weights = load_file(str(tmp_path / "plugin" / "out" / "lora.safetensors"))
    assert weights.keys() == theirs.keys() and len(theirs) == 39  # 13 LoRA modules: down, up, alpha
    differ = [k for k in theirs if not torch.equal(weights[k], theirs[k])]
    assert not differ, f"{len(differ)} of {len(theirs)} tensors differ: {differ[:4]}"
