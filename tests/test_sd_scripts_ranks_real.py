"""sd-scripts' real Flux LoRA training as two CPU processes (``tests/sd_scripts_e2e.py flux WORK ranks``; skipped unless
``SD_SCRIPTS_DIR``).

One run, shared by every test here: ``flux_train_network.py`` (tiny models from sd-scripts' own classes, latents and
text-encoder outputs cached by the script itself) launched by accelerate's launcher as two gloo ranks
(``E2E_PROCESSES=2``), each rank with its own ``--seed`` (as an unseeded run draws one per process),
``--network_module downscale_plugin``, batch size 1 and gradient accumulation 2. The dataset holds 128² and 256²
images (one dataset each), so on some steps the two ranks are on different buckets; the σ sampler is ``flux_shift``
(its shift depends on the bucket's size) made narrow with ``sigmoid_scale``, so the two buckets' route odds differ by
much (``RANKS`` in ``sd_scripts_e2e.py``). Each rank records every step's route decision, the grid and time input
its Flux ran, its saves, its own and the cross-rank counts, and its output; ``record.json`` has them per rank. The
doubles' two-rank tests are in ``tests/test_hosts_doubles.py``; musubi-tuner's real two-process run is
``tests/test_musubi_ranks_real.py``.

The plugin's promise across ranks (README, "Ranks route together"): ranks on the same bucket run the same route
every step; ranks on different buckets share one uniform mapped through their own odds, so they disagree only as
often as those odds differ, and the end summary counts those steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ranks_checks import RANKS_SEED, counts_are_cross_rank_sums, disagreements_are_counted, same_bucket_steps_share_their_route, step_pairs

SD_SCRIPTS_DIR = os.environ.get("SD_SCRIPTS_DIR")
pytestmark = pytest.mark.skipif(not SD_SCRIPTS_DIR, reason="set SD_SCRIPTS_DIR to an sd-scripts checkout (main 48d368fa)")

HERE = Path(__file__).parent
PROCESSES = 2
STEPS = 6  # optimizer steps per rank
ACCUMULATION = 2
FORWARDS = STEPS * ACCUMULATION  # train forwards per rank
SEED = RANKS_SEED  # rank r trains with --seed SEED + r
BUCKETS = [[16, 16], [32, 32]]  # 128² and 256² images at Flux's latent grid


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("sd_scripts_ranks") / "work"
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "COLUMNS": "1000",
        "E2E_STEPS": str(STEPS), "E2E_PROCESSES": str(PROCESSES),
    }  # fmt: skip
    argv = [sys.executable, str(HERE / "sd_scripts_e2e.py"), "flux", str(work), "ranks", "--gradient_accumulation_steps", str(ACCUMULATION)]
    proc = subprocess.run(argv, cwd=SD_SCRIPTS_DIR, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "E2E OK" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-8000:]
    return json.loads((work / "record.json").read_text())


def _category(sigma: float, windows: list) -> int:
    """The first route whose strict window holds σ (−1: native)."""
    for i, (lo, hi) in enumerate(windows):
        if sigma > lo and (hi is None or sigma < hi):
            return i
    return -1


def test_two_real_processes_on_gloo_each_with_its_own_seed(run):
    """accelerate's launcher started two processes that trained together on gloo (MULTI_CPU), each its full share of
    forwards under accumulation 2; each rank trained with its own --seed, and the plugin routes every rank from rank
    0's. DDP wraps the LoRA network; only the frozen Flux is left unwrapped (the harness's one shim)."""
    ranks = run["ranks"]
    assert run["processes"] == PROCESSES and [r["rank"] for r in ranks] == [0, 1]
    for rank in ranks:
        assert rank["world_size"] == PROCESSES and rank["backend"] == "gloo", rank["backend"]
        assert rank["distributed_type"].endswith("MULTI_CPU")
        assert rank["accumulation"] == ACCUMULATION and rank["forwards"] == FORWARDS
        assert len(rank["steps"]) == len(rank["dit"]) == FORWARDS
        assert rank["prepared"] == [["Flux", "Flux"], ["LoRANetwork", "DistributedDataParallel"]], rank["prepared"]
    assert [r["own_seed"] for r in ranks] == [SEED, SEED + 1]
    assert [r["seed"] for r in ranks] == [SEED, SEED] and run["metadata"]["ss_downscale_seed"] == str(SEED)


def test_ranks_on_the_same_bucket_take_the_same_route_every_step(run):
    """On every step where both ranks are on one bucket they run one route category, although their σ are their own
    and each bucket's odds are mixed (128²: native / r0 / r1 ≈ 0.50 / 0.43 / 0.07): ranks drawing their category from
    their own σ would split on about half of those steps, and did here wherever one rank kept its own σ and the
    other had to redraw it."""
    together = same_bucket_steps_share_their_route(step_pairs(run, FORWARDS), FORWARDS)
    # one rank's own host σ lay in the step's category, the other's did not: their own draws named different routes
    assert any(a["resampled"] != b["resampled"] for a, b in together), together


def test_routed_steps_ran_flux_at_the_routes_small_grid_on_each_rank(run):
    """On each rank every forward's Flux input is its own step's grid: a routed step at the route's target for that
    rank's bucket (the main process's plan), strictly smaller, a native one at the bucket."""
    plan = run["ranks"][0]["plan_buckets"]
    assert run["ranks"][1]["plan_buckets"] is None  # the banner's plan is built on the main process only
    targets = {tuple(b["latent_hw"]): b["targets"] for b in plan}
    assert sorted(map(list, targets)) == BUCKETS
    assert targets[(16, 16)] == {"0": [12, 12], "1": [8, 8]} and targets[(32, 32)] == {"0": [24, 24], "1": [16, 16]}
    seen = set()
    for rank in run["ranks"]:
        assert sorted({tuple(s["native_hw"]) for s in rank["steps"]}) == sorted(map(tuple, BUCKETS))
        for step, dit in zip(rank["steps"], rank["dit"], strict=True):
            if step["rule"] >= 0:
                assert step["run_hw"] == targets[tuple(step["native_hw"])][str(step["rule"])], step
                assert step["run_hw"][0] < step["native_hw"][0] and step["run_hw"][1] < step["native_hw"][1], step
            else:
                assert step["run_hw"] == step["native_hw"], step
            assert dit["batch"] == 1 and dit["latent_hw"] == step["run_hw"], (rank["rank"], step, dit)
            seen.add((tuple(step["native_hw"]), step["rule"] >= 0))
        assert any(s["rule"] >= 0 for s in rank["steps"]), rank["rank"]  # each rank ran routed steps
    assert {bucket for bucket, routed in seen if routed} == set(map(tuple, BUCKETS))  # on both buckets
    assert any(not routed for _, routed in seen)  # and native ones


def test_saved_counts_are_the_cross_rank_sums(run):
    """Every count the accounting keeps is summed over the ranks, identically on both; the saved LoRA's
    ``ss_downscale_counts`` are those sums: 2 ranks × 6 optimizer steps × accumulation 2 = 24 forwards, and the route
    shares and token saving of both ranks' recorded steps together."""
    tokens = lambda hw: (hw[0] // 2) * (hw[1] // 2)  # noqa: E731 (Flux's 2×2 patches)
    counts_are_cross_rank_sums(run, FORWARDS, PROCESSES, tokens)
    # the host logs after every forward (train_network.py), on the main process only: each time both ranks' sum so far
    assert run["scalars"]["downscale/steps"] == [PROCESSES * n for n in range(1, FORWARDS + 1)]


def test_only_the_main_process_printed_logged_and_saved(run):
    """The start banner and the end summary (with the cross-rank totals) come from the main process only, which alone
    logs to the trackers, builds the LoRA's metadata and saves it; the replicas stayed in step (rank 1's final weights
    are the saved ones) and trained (the zero-initialised lora_up moved); the LoRA loads with the inner module."""
    first, second = run["ranks"]
    assert len(first["banners"]) == 1 and f"seed {SEED}, {PROCESSES} process(es)" in first["banners"][0]
    assert len(first["summaries"]) == 1 and f"downscale: {PROCESSES * FORWARDS} train forwards" in first["summaries"][0]
    assert second["banners"] == [] and second["summaries"] == []
    assert first["saves"] == ["lora.safetensors"] and second["saves"] == []
    assert first["metadata_calls"] == 1 and second["metadata_calls"] == 0
    assert run["outputs"] == ["lora.safetensors"] and run["event_files"] == 1
    assert set(run["saved_sums"]) == set(first["weights"]) == set(second["weights"])
    for name, saved in run["saved_sums"].items():
        assert first["weights"][name] == pytest.approx(saved, rel=1e-6, abs=1e-9), name
        assert second["weights"][name] == pytest.approx(saved, rel=1e-6, abs=1e-9), name
    assert any(v != 0.0 for k, v in run["saved_sums"].items() if k.endswith("lora_up.weight"))
    assert run["loaded_tensors"] == len(run["saved_sums"])


def test_steps_where_ranks_on_different_buckets_disagree_are_counted(run):
    """Where the two buckets' odds put the shared uniform in different categories the ranks run different routes;
    every step is compared once (12 forwards, not 24), and the disagreements are counted, reported in the end
    summary and logged (the main process's running share, after every forward)."""
    pairs = step_pairs(run, FORWARDS)
    disagreements_are_counted(run, pairs, FORWARDS)
    running = [sum(a["rule"] != b["rule"] for a, b in pairs[:n]) / n for n in range(1, FORWARDS + 1)]
    assert run["scalars"]["downscale/rank_disagree_frac"] == pytest.approx(running, rel=1e-6)


def test_each_rank_runs_its_own_sigma(run):
    """σ is per rank: the two ranks' σ differ at every step, also where both redrew on the same bucket and category
    (the redraws run on each rank's private stream); each rank's Flux ran at its own step's σ (the host passes
    t = 1000 σ, divided by 1000); and every σ lies in its step's category window (the coupled gate)."""
    windows = run["ranks"][0]["sigma_windows"]
    pairs = step_pairs(run, FORWARDS)
    for a, b in pairs:
        assert a["sigmas"] != b["sigmas"], (a, b)
    both_redrew = [(a, b) for a, b in pairs if a["resampled"] and b["resampled"] and a["native_hw"] == b["native_hw"]]
    assert both_redrew  # the case a shared redraw stream would make equal
    for rank in run["ranks"]:
        assert {s["resampled"] for s in rank["steps"]} == {0, 1}  # kept its own host draw on some steps, redrew on others
        for step, dit in zip(rank["steps"], rank["dit"], strict=True):
            assert dit["timesteps"] == pytest.approx(step["sigmas"], abs=1e-6), (step, dit)
            assert step["fallback"] is None and all(_category(x, windows) == step["rule"] for x in step["sigmas"]), step
