"""What a real two-process run must show, whichever host ran it (``tests/test_sd_scripts_ranks_real.py``,
``tests/test_musubi_ranks_real.py``): a record with, per rank, every step's route decision (``rule``, ``native_hw``,
``run_hw``), its own counts (``local``) and the cross-rank ones (``totals``), its banner and summary; and the saved
LoRA's metadata. The hosts' records differ in what their DiT saw; those checks stay in each file."""

from __future__ import annotations

import json

import pytest

# The two-process runs' router (each harness's ``RANKS``): under flux_shift with a narrow sigmoid_scale the buckets'
# median σ differ, and the routes split the σ axis between them, so each bucket's odds are mixed and differ.
RANKS_ROUTES = """
[plugins.downscale]
gate = "coupled"

[[plugins.downscale.routes]]
scale = 0.75                      # between the two buckets' median σ ...
sigma_min = 0.6148
sigma_max = 0.6225

[[plugins.downscale.routes]]
scale = 0.5                       # ... and above the larger bucket's (the rest runs native)
sigma_min = 0.6225
"""
RANKS_SEED = 100  # rank r trains with --seed RANKS_SEED + r, as an unseeded run draws one per process (reproducibly here)
LABELS = {0: "r0 x0.75", 1: "r1 x0.5", -1: "native"}  # RANKS_ROUTES, as ss_downscale_counts names them


def step_pairs(run: dict, forwards: int) -> list[tuple[dict, dict]]:
    """Step n of rank 0 beside step n of rank 1 (the same forward of the run: ranks step in lockstep)."""
    first, second = (rank["steps"] for rank in run["ranks"])
    assert [s["step"] for s in first] == [s["step"] for s in second] == list(range(1, forwards + 1))
    return list(zip(first, second, strict=True))


def same_bucket_steps_share_their_route(pairs: list[tuple[dict, dict]], forwards: int) -> list[tuple[dict, dict]]:
    """Assert both ranks ran one route on every step they shared a bucket, with more than one route among those
    steps (the agreement is not trivial), and that the run also had steps on two buckets; return the shared steps."""
    same = [a["native_hw"] == b["native_hw"] for a, b in pairs]
    assert 0 < sum(same) < forwards, same
    together = [(a, b) for (a, b), s in zip(pairs, same, strict=True) if s]
    assert all(a["rule"] == b["rule"] for a, b in together), [(a["rule"], b["rule"]) for a, b in together]
    assert len({a["rule"] for a, _ in together}) >= 2, together
    return together


def counts_are_cross_rank_sums(run: dict, forwards: int, processes: int, tokens) -> None:
    """Assert every count the accounting keeps is the two ranks' sum, identically on both, and the saved LoRA's
    ``ss_downscale_counts`` are those sums (forwards, route shares and ``tokens``' token saving of both ranks' steps)."""
    first, second = run["ranks"]
    for rank in run["ranks"]:
        assert sum(rank["local"]["steps"]) == forwards and sum(rank["local"]["samples"]) == forwards
    summed = [{k: v for k, v in rank["totals"].items() if k != "summary"} for rank in run["ranks"]]
    assert summed[0] == summed[1]
    for name, mine in first["local"].items():
        theirs, total = second["local"][name], first["totals"][name]
        if isinstance(mine, list):
            assert total == pytest.approx([a + b for a, b in zip(mine, theirs, strict=True)]), name
        elif isinstance(mine, dict):
            keys = set(mine) | set(theirs)
            assert total == pytest.approx({k: mine.get(k, 0.0) + theirs.get(k, 0.0) for k in keys}), name
        else:
            assert total == pytest.approx(mine + theirs), name
    counts = json.loads(run["metadata"]["ss_downscale_counts"])
    steps = [s for rank in run["ranks"] for s in rank["steps"]]
    assert counts["forwards"] == processes * forwards == len(steps)
    assert counts["routes"] == pytest.approx({LABELS[i]: sum(s["rule"] == i for s in steps) / len(steps) for i in LABELS})
    saving = 1.0 - sum(tokens(s["run_hw"]) for s in steps) / sum(tokens(s["native_hw"]) for s in steps)
    assert counts["token_saving"] == pytest.approx(saving)
    assert counts["fallbacks"] == {"law_fill": 0.0, "lead_fill": 0.0, "other": 0.0}


def disagreements_are_counted(run: dict, pairs: list[tuple[dict, dict]], forwards: int) -> None:
    """Assert the steps whose routes differ (only where the buckets differ) are counted on both ranks, every step
    compared once, and reported in the main process's end summary."""
    differ = sum(a["rule"] != b["rule"] for a, b in pairs)
    apart = sum(a["native_hw"] != b["native_hw"] for a, b in pairs)
    assert 0 < differ <= apart
    for rank in run["ranks"]:
        assert (rank["totals"]["compared"], rank["totals"]["disagreed"]) == (forwards, differ)
    summary = run["ranks"][0]["summaries"][0]
    assert f"ranks ran different routes on {differ} of {forwards} steps" in summary, summary
