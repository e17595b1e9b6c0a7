"""musubi-tuner's real caching and training scripts end to end (``tests/musubi_e2e.py``; skipped unless ``MUSUBI_DIR`` is set).

Each architecture runs in a subprocess (``MUSUBI_PYTHON``, else this interpreter: an environment with
musubi-tuner's requirements and this package installed, e.g. ``/work/venv-musubi``): latent and
text-encoder caching, then ``--network_module downscale_plugin`` training on tiny models built by the real
loaders; the assertions read the run's ``record.json``. Measured routed share, per-route shares and token
saving are compared with ``downscale_plugin.plan``'s prediction for the buckets the run drew, within
4 standard deviations of the prediction's sampling spread (binomial / multinomial over the steps), and
with ``python -m downscale_plugin plan --host musubi`` run on the same training TOML and buckets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

MUSUBI_DIR = os.environ.get("MUSUBI_DIR")
pytestmark = pytest.mark.skipif(not MUSUBI_DIR, reason="MUSUBI_DIR (a musubi-tuner checkout) is not set")

HERE = Path(__file__).parent
STEPS = 160
FRAMES = {"wan": 2, "qwen_image": 1}  # latent frames: Wan's five-frame clips -> 2, Qwen-Image's images as B, C, 1, H, W
INNER = {"wan": "networks.lora_wan", "qwen_image": "networks.lora_qwen_image"}
BUCKETS = [[16, 16], [12, 20]]  # 128² and 160×96 at the latent grid


def _run(arch: str, work: Path) -> dict:
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "E2E_STEPS": str(STEPS), "COLUMNS": "1000",
    }  # fmt: skip
    python = os.environ.get("MUSUBI_PYTHON", sys.executable)
    proc = subprocess.run(
        [python, str(HERE / "musubi_e2e.py"), arch, str(work)], cwd=work.parent, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "E2E OK" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads((work / "record.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Callable[[str], dict]:
    """A setup's record, run once per module however many tests read it."""
    done: dict[str, dict] = {}

    def record_of(setup: str) -> dict:
        if setup not in done:
            done[setup] = _run(setup, tmp_path_factory.mktemp(setup) / "work")
        return done[setup]

    return record_of


@pytest.fixture(scope="module", params=["wan", "wan22", "qwen_image"])  # wan22: Wan 2.2's two experts (t2v-A14B)
def record(request, runs) -> dict:
    return runs(request.param)


def test_routed_steps_ran_the_dit_at_the_routes_small_grid(record):
    """Every forward's DiT input is its step's grid: a routed step at the plan's target for its bucket and rule,
    a native one at the bucket; Wan's latent frames are never resized."""
    arch, steps = record["arch"], record["steps"]
    targets = {tuple(b["latent_hw"]): b["targets"] for b in record["plan"]["buckets"]}
    assert len(steps) == STEPS and len(record["dit_inputs"]) == STEPS
    assert sorted({tuple(s["native_hw"]) for s in steps}) == sorted(map(tuple, BUCKETS))
    assert {s["rule"] for s in steps} == {0, 1, -1}
    for step, shape in zip(steps, record["dit_inputs"], strict=True):
        h, w = ran_at_its_grid(step, targets)
        expected = [1, 16, FRAMES[arch], h, w] if arch == "wan" else [1, (h // 2) * (w // 2), 64]
        assert shape == expected, (step, shape)


def ran_at_its_grid(step: dict, targets: dict) -> tuple[int, int]:
    """Assert a recorded step ran at its grid (a routed one at the plan's strictly smaller target for its bucket and
    rule, a native one at the bucket); return that grid."""
    h, w = step["run_hw"]
    if step["rule"] >= 0:
        assert step["run_hw"] == targets[tuple(step["native_hw"])][str(step["rule"])], step
        assert h < step["native_hw"][0] and w < step["native_hw"][1], step
    else:
        assert step["run_hw"] == step["native_hw"], step
    return h, w


def test_routed_share_and_token_saving_are_plans(record):
    """The measured shares and token saving agree with plan's prediction (the banner's plan through the host's own
    sampler, and an exact-law plan_table), and the accounting's token saving is the recorded grids'."""
    measured, plan, exact = record["measured"], record["plan"]["given_buckets"], record["plan_exact"]["given_buckets"]
    print(
        f"{record['setup']}: routed {measured['routed']:.4f} vs plan {plan['routed']:.4f} ± {plan['routed_sd']:.4f} "
        f"(exact law {exact['routed']:.4f}); token saving {measured['token_saving']:.4f} vs plan {plan['token_saving']:.4f} "
        f"± {plan['token_saving_sd']:.4f} (exact law {exact['token_saving']:.4f})"
    )
    assert abs(measured["routed"] - plan["routed"]) < 4 * plan["routed_sd"]
    assert abs(measured["token_saving"] - plan["token_saving"]) < 4 * plan["token_saving_sd"]
    for rule, share in measured["probs"].items():
        assert abs(share - plan["probs"][rule]) < 4 * plan["probs_sd"][rule], (rule, share, plan["probs"][rule])
    # the banner's Monte Carlo (8192 draws per bucket) against the exact law
    assert abs(plan["routed"] - exact["routed"]) < 0.03 and abs(plan["token_saving"] - exact["token_saving"]) < 0.02
    assert measured["token_saving"] == pytest.approx(measured["totals_token_saving"], abs=1e-12)


def test_the_saved_lora_carries_the_counts_and_loads_in_musubi_tuner(record):
    meta = record["metadata"]
    counts = json.loads(meta["ss_downscale_counts"])
    assert meta["ss_downscale_arch"] == record["arch"]
    assert meta["ss_downscale_inner"] == INNER[record["arch"]]
    assert counts["forwards"] == STEPS and counts["token_saving"] == pytest.approx(record["measured"]["token_saving"])
    shares = dict(zip(["r0 x0.5", "r1 x0.75", "native"], [record["measured"]["probs"][k] for k in ("0", "1", "-1")], strict=True))
    assert counts["routes"] == pytest.approx(shares)
    lora = record["lora"]
    assert lora["merged"] == lora["trained"] > 0 and lora["modules"] >= lora["trained"]


def test_wan22_each_forward_ran_the_expert_its_sigma_names(runs):
    """Wan 2.2's two experts: the trainer swaps the experts' weights by the step's σ against timestep_boundary; a
    routed step too runs on the expert of its own (replayed) σ, so the high-σ route always trains the high-noise one."""
    record = runs("wan22")
    steps, boundary = record["steps"], record["experts"]["boundary"]
    assert {s["expert"] for s in steps} == {"low", "high"}
    for step in steps:
        t = step["sigmas"][0] + 0.001  # the host's timestep / 1000
        if abs(t - boundary) > 1e-4:
            assert step["expert"] == ("high" if t >= boundary else "low"), step
    assert all(s["expert"] == "high" for s in steps if s["rule"] == 0)  # r0 x0.5 fires in 0.9 < σ < 1
    assert all(s["expert"] == "low" for s in steps if s["rule"] == 1)  # r1 x0.75 in 0.5 < σ < 0.8


def test_plan_host_musubi_on_the_runs_training_toml_predicts_what_it_measured(record):
    """``python -m downscale_plugin plan --host musubi --config_file train.toml --bucket ...`` (the run's own TOML and
    buckets): the banner's prediction, and so the measured figures within their spread."""
    cli, plan, measured = record["plan_cli"], record["plan"]["given_buckets"], record["measured"]
    if "No module named 'downscale_plugin.hosts.musubi.cli'" in cli.get("error", ""):
        pytest.skip("plan --host musubi is not in this checkout")
    assert "error" not in cli, cli
    print(f"{record['setup']}: plan --host musubi routed {cli['routed']:.3f}, token saving {cli['token_saving']:.3f}")
    assert abs(cli["routed"] - plan["routed"]) < 0.03 and abs(cli["token_saving"] - plan["token_saving"]) < 0.02
    assert abs(measured["routed"] - cli["routed"]) < 4 * plan["routed_sd"]
    assert abs(measured["token_saving"] - cli["token_saving"]) < 4 * plan["token_saving_sd"]
