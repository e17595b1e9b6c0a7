"""musubi-tuner's real Wan training as two CPU processes (``tests/musubi_e2e.py wan_ranks``; skipped unless ``MUSUBI_DIR``).

One run, shared by most tests here: musubi-tuner's real caching scripts, then ``wan_train_network.py`` launched by
accelerate's launcher as two gloo ranks (``E2E_PROCESSES=2``), each rank with its own ``--seed`` (as an unseeded
run draws one per process), ``--network_module downscale_plugin``, batch size 1 and gradient accumulation 2. The
dataset holds 128² and 256² clips, so on some steps the two ranks are on different buckets; the σ sampler is
``flux_shift`` (its shift depends on the bucket's size) made narrow with ``--sigmoid_scale``, so the two buckets'
route odds differ by much (``RANKS`` in ``musubi_e2e.py``). Each rank records every step's route decision, the
grid and timesteps its DiT ran, its own and the cross-rank counts, and its output; ``record.json`` has them per
rank. The doubles' two-rank tests are ``tests/test_musubi_ranks.py``.

The plugin's promise across ranks (README, "Ranks route together"): ranks on the same bucket run the same route
every step; ranks on different buckets share one uniform mapped through their own odds, so they disagree only as
often as those odds differ, and the end summary counts those steps.

Resume across process counts (the last tests): a state saved at step 3 by two ranks (one run, shared) resumes on one
process and on two, and a state one process saved resumes on two; each resumed run goes on at the saved forward per
process, with rank 0's seed, its counts on from the saved ones, and (two to two) the saved run's routes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ranks_checks import (
    LABELS,
    RANKS_SEED,
    counts_are_cross_rank_sums,
    disagreements_are_counted,
    same_bucket_steps_share_their_route,
    step_pairs,
)
from test_musubi_e2e import ran_at_its_grid

MUSUBI_DIR = os.environ.get("MUSUBI_DIR")
pytestmark = pytest.mark.skipif(not MUSUBI_DIR, reason="MUSUBI_DIR (a musubi-tuner checkout) is not set")

HERE = Path(__file__).parent
PROCESSES = 2
STEPS = 6  # optimizer steps per rank
ACCUMULATION = 2
FORWARDS = STEPS * ACCUMULATION  # train forwards per rank
SEED = RANKS_SEED  # rank r trains with --seed SEED + r
BUCKETS = [[16, 16], [32, 32]]  # 128² and 256² clips at the latent grid (one latent frame)
MIN_SHARED = 3  # forwards (absolute index, bucket) that the saved run and the run resumed on two ranks both ran


def _e2e(work: Path, name: str, processes: int, *argv: str) -> dict:
    """``musubi_e2e.py NAME WORK --gradient_accumulation_steps 2 ARGV...`` on ``processes`` processes; its record."""
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "COLUMNS": "1000",
        "E2E_STEPS": str(STEPS), "E2E_PROCESSES": str(processes),
    }  # fmt: skip
    python = os.environ.get("MUSUBI_PYTHON", sys.executable)
    command = [python, str(HERE / "musubi_e2e.py"), name, str(work), "--gradient_accumulation_steps", str(ACCUMULATION), *argv]
    work.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(command, cwd=work.parent, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "E2E OK" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-8000:]
    return json.loads((work / "record.json").read_text())


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    return _e2e(tmp_path_factory.mktemp("wan_ranks") / "work", "wan_ranks", PROCESSES)


def _category(sigma: float, windows: list) -> int:
    """The first route whose strict window holds σ (−1: native)."""
    for i, (lo, hi) in enumerate(windows):
        if sigma > lo and (hi is None or sigma < hi):
            return i
    return -1


def test_two_real_processes_on_gloo_share_rank_0s_seed(run):
    """accelerate's launcher started two processes that trained together on gloo (MULTI_CPU), each its full share of
    forwards; each rank trained with its own --seed, and the plugin routes every rank from rank 0's."""
    ranks = run["ranks"]
    assert run["processes"] == PROCESSES and [r["rank"] for r in ranks] == [0, 1]
    for rank in ranks:
        assert rank["world_size"] == PROCESSES and rank["backend"] == "gloo", rank["backend"]
        assert rank["distributed_type"].endswith("MULTI_CPU")
        assert rank["forwards"] == FORWARDS and len(rank["steps"]) == len(rank["dit_inputs"]) == FORWARDS
    assert [r["own_seed"] for r in ranks] == [SEED, SEED + 1]
    assert [r["seed"] for r in ranks] == [SEED, SEED] and run["metadata"]["ss_downscale_seed"] == str(SEED)


def test_ranks_on_the_same_bucket_take_the_same_route_every_step(run):
    """On every step where both ranks are on one bucket they run one route category, although their σ are their own
    and each bucket's odds are mixed (128²: native / r0 / r1 ≈ 0.50 / 0.43 / 0.07): ranks drawing their category from
    their own σ would split on about half of those steps."""
    same_bucket_steps_share_their_route(step_pairs(run, FORWARDS), FORWARDS)


def test_routed_steps_ran_the_dit_at_the_routes_small_grid_on_each_rank(run):
    """On each rank every forward's DiT input is its own step's grid: a routed step at the route's target for that
    rank's bucket (the main process's plan), a native one at the bucket; the latent frame is never resized."""
    plan = run["ranks"][0]["plan_buckets"]
    assert run["ranks"][1]["plan_buckets"] is None  # the banner's plan is built on the main process only
    targets = {tuple(b["latent_hw"]): b["targets"] for b in plan}
    assert sorted(map(list, targets)) == BUCKETS
    seen = set()
    for rank in run["ranks"]:
        assert sorted({tuple(s["native_hw"]) for s in rank["steps"]}) == sorted(map(tuple, BUCKETS))
        for step, shape in zip(rank["steps"], rank["dit_inputs"], strict=True):
            h, w = ran_at_its_grid(step, targets)
            assert shape == [1, 16, 1, h, w], (rank["rank"], step, shape)
            seen.add((tuple(step["native_hw"]), step["rule"] >= 0))
        assert any(s["rule"] >= 0 for s in rank["steps"]), rank["rank"]  # each rank ran routed steps
    assert {bucket for bucket, routed in seen if routed} == set(map(tuple, BUCKETS))  # on both buckets
    assert any(not routed for _, routed in seen)  # and native ones


def test_saved_counts_are_the_cross_rank_sums(run):
    """Every count the accounting keeps is summed over the ranks, identically on both; the saved LoRA's
    ``ss_downscale_counts`` are those sums: 2 ranks × 6 optimizer steps × accumulation 2 = 24 forwards, and the route
    shares and token saving of both ranks' recorded steps together."""
    tokens = lambda hw: (hw[0] // 2) * (hw[1] // 2)  # noqa: E731 (Wan's 2×2 patches, one latent frame)
    counts_are_cross_rank_sums(run, FORWARDS, PROCESSES, tokens)


def test_only_the_main_process_printed_and_saved(run):
    """The start banner and the end summary (with the cross-rank totals) come from the main process only, which alone
    builds the LoRA's metadata and saves it; the replicas stayed in step (rank 1's final weights are the saved ones)."""
    first, second = run["ranks"]
    assert len(first["banners"]) == 1 and f"seed {SEED}, {PROCESSES} process(es)" in first["banners"][0]
    assert len(first["summaries"]) == 1 and f"downscale: {PROCESSES * FORWARDS} train forwards" in first["summaries"][0]
    assert second["banners"] == [] and second["summaries"] == []
    assert first["metadata_calls"] >= 1 and second["metadata_calls"] == 0
    assert run["outputs"] == ["lora.safetensors"]
    assert set(run["saved_sums"]) == set(first["weights"]) == set(second["weights"])
    for name, saved in run["saved_sums"].items():
        assert first["weights"][name] == pytest.approx(saved, rel=1e-6, abs=1e-9), name
        assert second["weights"][name] == pytest.approx(saved, rel=1e-6, abs=1e-9), name
    lora = run["lora"]
    assert lora["merged"] == lora["trained"] > 0  # and it loads and merges in musubi-tuner's own networks.lora_wan


def test_steps_where_ranks_on_different_buckets_disagree_are_counted(run):
    """Where the two buckets' odds put the shared uniform in different categories the ranks run different routes;
    every step is compared once (12 forwards, not 24), and the disagreements are counted and reported."""
    pairs = step_pairs(run, FORWARDS)
    disagreements_are_counted(run, pairs, FORWARDS)


def test_each_rank_runs_its_own_sigma(run):
    """σ is per rank: the two ranks' σ differ at every step, also where both redrew on the same bucket and category
    (the redraws run on each rank's private stream); each rank's DiT ran at its own step's σ (t = 1000 σ + 1); and
    every σ lies in its step's category window (the coupled gate)."""
    windows = run["ranks"][0]["sigma_windows"]
    pairs = step_pairs(run, FORWARDS)
    for a, b in pairs:
        assert a["sigmas"] != b["sigmas"], (a, b)
    both_redrew = [(a, b) for a, b in pairs if a["resampled"] and b["resampled"] and a["native_hw"] == b["native_hw"]]
    assert both_redrew  # the case a shared redraw stream would make equal
    for rank in run["ranks"]:
        assert {s["resampled"] for s in rank["steps"]} == {0, 1}  # kept its own host draw on some steps, redrew on others
        assert len(rank["dit_timesteps"]) == FORWARDS
        for step, timesteps in zip(rank["steps"], rank["dit_timesteps"], strict=True):
            assert timesteps == pytest.approx([1000.0 * x + 1.0 for x in step["sigmas"]], abs=2e-3), (step, timesteps)
            assert step["fallback"] is None and all(_category(x, windows) == step["rule"] for x in step["sigmas"]), step


SAVE_AT = 3  # optimizer steps: the state every resume test starts from (--save_every_n_steps 3)
SAVED_FORWARDS = SAVE_AT * ACCUMULATION  # train forwards per process before the save
SLOTS = (0, 1, -1)  # the counts' route slots: the two routes, then native


def _save(work: Path, processes: int) -> tuple[dict, Path, dict]:
    """The run on ``processes`` processes, saving its state at step ``SAVE_AT``: its record, that state and the plugin's
    counts file in it."""
    from downscale_plugin.hosts.kohya.run import COUNTS_FILE

    record = _e2e(work, "wan_ranks", processes, "--save_state", "--save_every_n_steps", str(SAVE_AT))
    (state,) = (work / "out").glob(f"*-step{SAVE_AT:08d}-state")
    return record, state, json.loads((state / COUNTS_FILE).read_text())


def _slots(steps: list[dict]) -> list[int]:
    """Forwards per route slot (``Counts.steps``' layout) among ``steps``."""
    return [sum(s["rule"] == i for s in steps) for i in SLOTS]


def _rank_steps(record: dict) -> list[list[dict]]:
    """Each process's recorded steps (a one-process record holds them at its top level)."""
    return [rank["steps"] for rank in record["ranks"]] if "ranks" in record else [record["steps"]]


def _saved_counts_are_the_saving_runs_first_forwards(saved: dict, counts: dict, processes: int) -> list[int]:
    """The counts saved with the state are the saving run's forwards before the save on all its processes, per route
    slot, and say on how many processes they were summed; returns them per slot."""
    before = _slots([s for steps in _rank_steps(saved) for s in steps[:SAVED_FORWARDS]])
    assert counts["processes"] == processes and counts["counts"]["steps"] == before, (counts, before)
    assert sum(before) == processes * SAVED_FORWARDS
    return before


def _resumed_counts_go_on_from_the_saved(resumed: dict, before: list[int]) -> None:
    """On every rank of a two-process resumed run, the forward index goes on from the saved run's forwards per process,
    and the cross-rank counts are the saved ones plus both ranks' own, per route slot; so are the LoRA's."""
    ranks = resumed["ranks"]
    assert [rank["resume_offset"] for rank in ranks] == [SAVED_FORWARDS] * PROCESSES
    assert [rank["seed"] for rank in ranks] == [SEED, SEED]  # rank 0's --seed, as in the saved run
    new = [s for rank in ranks for s in rank["steps"]]
    assert len(new) == PROCESSES * FORWARDS
    total = [a + b for a, b in zip(before, _slots(new), strict=True)]
    for rank in ranks:
        assert rank["totals"]["steps"] == total, (rank["rank"], rank["totals"]["steps"], total)
        assert sum(rank["local"]["steps"]) == FORWARDS + (sum(before) if rank["rank"] == 0 else 0)  # restored on rank 0
    counts = json.loads(resumed["metadata"]["ss_downscale_counts"])
    assert counts["forwards"] == sum(total)
    assert counts["routes"] == pytest.approx({LABELS[i]: n / sum(total) for i, n in zip(SLOTS, total, strict=True)})


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory) -> tuple[dict, Path, dict]:
    return _save(tmp_path_factory.mktemp("saved_by_two") / "work", PROCESSES)


def test_a_state_two_real_ranks_saved_resumes_on_one_process_at_each_ranks_forward(saved_by_two, tmp_path):
    """musubi-tuner's resumed run starts its step count again at 0, so the plugin takes the resumed forward from the
    counts saved with the state: their cross-rank sum over the processes that saved it (``processes`` in the counts
    file). A state the two ranks saved at step 3 (2 ranks × 3 steps × accumulation 2 = 12 forwards) resumes on one
    process at absolute forward 6, each rank's own forward at the save (12 would skip a rank's worth of spans and
    step draws), and the resumed run's counts go on from the saved 12."""
    saved, state, counts = saved_by_two
    assert [rank["resume_offset"] for rank in saved["ranks"]] == [0, 0]
    before = _saved_counts_are_the_saving_runs_first_forwards(saved, counts, PROCESSES)
    resumed = _e2e(tmp_path / "one" / "work", "wan_ranks", 1, "--resume", str(state))  # the same dataset and routes
    assert resumed["resume_offset"] == SAVED_FORWARDS
    assert resumed["counts"]["forwards"] == PROCESSES * SAVED_FORWARDS + FORWARDS
    total = [a + b for a, b in zip(before, _slots(resumed["steps"]), strict=True)]
    assert resumed["counts"]["routes"] == pytest.approx({LABELS[i]: n / sum(total) for i, n in zip(SLOTS, total, strict=True)})


def test_a_state_two_real_ranks_saved_resumes_on_two_and_routes_on_as_the_saved_run(saved_by_two, tmp_path):
    """Resumed on two processes, each rank goes on at forward 6 with rank 0's seed, and the counts go on from the
    saved 12. The coupled gate's category at a forward is one uniform from (seed, absolute forward) through the
    bucket's odds, so wherever a resumed rank is at forward n on a bucket that a rank of the saved run (which trained on
    to forward 12) was on at forward n, both ran the same route: the resumed run continues the saved run's stream
    (restarting at forward 1, or at 12, would draw other uniforms)."""
    saved, state, counts = saved_by_two
    before = _saved_counts_are_the_saving_runs_first_forwards(saved, counts, PROCESSES)
    resumed = _e2e(tmp_path / "two" / "work", "wan_ranks", PROCESSES, "--resume", str(state))
    _resumed_counts_go_on_from_the_saved(resumed, before)
    routes: dict[tuple[int, tuple[int, int]], set[int]] = {}
    for record, offset in ((saved, 0), (resumed, SAVED_FORWARDS)):
        for steps in _rank_steps(record):
            for s in steps:
                routes.setdefault((offset + s["step"], tuple(s["native_hw"])), set()).add((offset, s["rule"]))
    shared = {key: seen for key, seen in routes.items() if {offset for offset, _ in seen} == {0, SAVED_FORWARDS}}
    assert len(shared) >= MIN_SHARED, sorted(routes.items())  # forwards both runs ran on one bucket
    assert all(len({rule for _, rule in seen}) == 1 for seen in shared.values()), sorted(shared.items())
    assert len({rule for seen in shared.values() for _, rule in seen}) >= 2  # not one route throughout


def test_a_state_one_real_process_saved_resumes_on_two_ranks_at_its_forward(tmp_path):
    """A state one process saved at step 3 (6 forwards, ``processes`` 1 in its counts) resumes on two ranks, each at
    absolute forward 6 (the saved forwards per process), with rank 0's seed; the cross-rank counts go on from the
    saved 6 per route, on both ranks and in the LoRA."""
    saved, state, counts = _save(tmp_path / "one" / "work", 1)
    assert saved["resume_offset"] == 0
    before = _saved_counts_are_the_saving_runs_first_forwards(saved, counts, 1)
    resumed = _e2e(tmp_path / "two" / "work", "wan_ranks", PROCESSES, "--resume", str(state))
    _resumed_counts_go_on_from_the_saved(resumed, before)
