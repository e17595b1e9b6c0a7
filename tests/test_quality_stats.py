"""The quality study's statistics (quality.py, docs/fidelity/quality/PROTOCOL.md §3 and §5) on synthetic data."""

from __future__ import annotations

import numpy as np
import pytest

from downscale_plugin.quality import (
    Curves,
    arm_statistics,
    bootstrap_draws,
    decide,
    first_reach,
    first_reach_batch,
    isotonic_decreasing,
    monotone_fit,
    native_gain,
    paired_item_difference,
    strata_sigmas,
    stratum_weights,
)


def test_vectorised_fit_and_reach_equal_the_scalar_ones() -> None:
    rng = np.random.default_rng(1)
    y = -0.1 * rng.normal(size=(300, 17)).cumsum(-1) + rng.normal(size=(300, 17))
    fit = isotonic_decreasing(y)
    assert np.abs(fit - np.array([monotone_fit(r) for r in y])).max() < 1e-12
    xs = np.arange(17.0)
    for row in fit[:50]:
        for target in (row.mean(), row[0] + 1, row[-1] - 1):
            scalar = first_reach(list(xs), list(row), target)
            batch = first_reach_batch(xs, row, np.array(target))
            assert (scalar is None and np.isnan(batch)) or batch == pytest.approx(scalar)


def test_strata_rule_adds_the_midpoint_of_an_uncovered_band_only() -> None:
    fixed = (0.05, 0.15, 0.3, 0.45, 0.6, 0.75, 0.85, 0.925, 0.975)
    assert strata_sigmas(fixed, [(0.925, 1.0)]) == list(fixed)  # 0.975 lies in (0.925, 1]
    assert strata_sigmas(fixed, [(0.93, 0.97)]) == sorted([*fixed, 0.95])
    assert strata_sigmas(fixed, [(0.0, 1.0), (0.76, 0.84)]) == sorted([*fixed, 0.8])
    with pytest.raises(ValueError, match="routed band"):
        strata_sigmas(fixed, [(0.5, 0.4)])


def test_stratum_weights_split_the_law_at_midpoints() -> None:
    w = stratum_weights([0.1, 0.5, 0.9], lambda x: x)  # uniform σ law: cells (0, .3], (.3, .7], (.7, 1]
    assert w == pytest.approx([0.3, 0.4, 0.3]) and sum(w) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="increasing"):
        stratum_weights([0.5, 0.1], lambda x: x)


def test_bootstrap_draws_resample_seeds_and_items_independently() -> None:
    seed_idx, item_weight = bootstrap_draws(6, 5, reps=3000, seed=0)
    assert seed_idx.shape == (3001, 6) and item_weight.shape == (3001, 5)
    assert (seed_idx[0] == np.arange(6)).all() and np.allclose(item_weight[0], 0.2)
    assert np.allclose(item_weight.sum(axis=1), 1.0)
    # independent: a replicate's seed draw says nothing about its item draw
    first_seed_repeats = (seed_idx[1:] == seed_idx[1:, :1]).sum(axis=1)
    first_item_weight = item_weight[1:, 0]
    assert abs(np.corrcoef(first_seed_repeats, first_item_weight)[0, 1]) < 0.06


def _study(rng: np.random.Generator, seeds: int, crops: int, diff: float) -> tuple[Curves, Curves]:
    """Two points (base, one unit); the arm − native difference at the unit is ``diff`` + a crop effect
    shared by every seed (the validation set's own lottery, dominant here) + small seed and item noise."""
    crop = rng.normal(0, 0.05, crops)
    d = diff + crop + rng.normal(0, 0.01, (seeds, 1)) + rng.normal(0, 0.01, (seeds, crops))
    native = np.empty((seeds, 2, crops, 1))
    native[:, 0], native[:, 1] = 1.0, 0.5 + rng.normal(0, 0.01, (seeds, crops, 1))
    arm = native.copy()
    arm[:, 1, :, 0] += d
    flops = np.tile([0.0, 1.0], (seeds, 1))
    return Curves(native, flops, flops), Curves(arm, flops, flops)


@pytest.mark.parametrize("crops", [10, 40])
def test_two_way_bootstrap_covers_a_known_difference(crops: int) -> None:
    """Over 200 synthetic studies whose item (crop) variance dominates, the interval of the equal-compute
    difference covers the true one at ≥ 95 % within Monte-Carlo error (3 SE), at the protocol's 10 crops
    too; resampling seeds alone covers it about 4 times in 10, since every seed shares the validation crops,
    and the plain percentile interval covered 87–89 % at 10 crops (what ``_bootstrap_t`` corrects)."""
    rng = np.random.default_rng(0)
    covered, percentile = 0, 0
    for study in range(200):
        native, arm = _study(rng, seeds=16, crops=crops, diff=0.02)
        iv = arm_statistics(native, arm, [1.0], reps=400, seed=study)["equal_compute"]
        covered += iv["lo"] <= 0.02 <= iv["hi"]
        seed_idx, item_weight = bootstrap_draws(16, crops, 400, study)
        d = (arm.losses[:, 1, :, 0] - native.losses[:, 1, :, 0]) @ item_weight.T  # [seed, rep]
        reps = np.take_along_axis(d.T, seed_idx, axis=1).mean(axis=1)[1:]
        percentile += np.quantile(reps, 0.025) <= 0.02 <= np.quantile(reps, 0.975)
    assert covered / 200 > 0.95 - 3 * (0.95 * 0.05 / 200) ** 0.5
    assert covered / 200 < 0.995  # not vacuous
    if crops == 10:
        assert percentile < covered  # the correction matters where the crops are few


def _curves(gain_at: list[float], points: int = 9, seeds: int = 4, items: int = 3, strata: int = 2, cost: float = 1.0) -> Curves:
    """Loss 1 − 0.1·min(t / τ, 1) per seed (τ in native-FLOP units), every item and stratum alike."""
    t = np.linspace(0.0, 1.0, points)
    per_seed = np.array([1.0 - 0.1 * np.minimum(t / tau, 1.0) for tau in gain_at[:seeds]])
    losses = np.broadcast_to(per_seed[:, :, None, None], (seeds, points, items, strata)).copy()
    flops = np.tile(t, (seeds, 1))
    return Curves(losses, flops, cost * flops)


def test_time_to_quality_and_equal_compute_on_known_curves() -> None:
    """Native reaches 90 % of its improvement (0.1) at 0.9 τ; an arm learning per FLOP twice as fast
    reaches it at half (ratio 0.5); one that plateaus at half the improvement never does and enters at
    its budget (ratio 1 ÷ 0.9 τ), 0.05 worse at one unit."""
    taus = [0.5, 0.75, 0.25, 1.0]  # kinks on the grid of 1/8: linear interpolation is exact
    native = _curves(taus)
    facts = native_gain(native, [0.5, 0.5])
    assert facts["gain"] == pytest.approx([0.1] * 4) and facts["last_quarter_fraction"] == pytest.approx([0.0, 0.0, 0.0, 0.25])
    fast = arm_statistics(native, _curves([t / 2 for t in taus], cost=0.5), [0.5, 0.5], reps=200)
    assert fast["time_to_quality"]["flops"]["ratio"] == pytest.approx(0.5)
    assert fast["time_to_quality"]["cpu"]["ratio"] == pytest.approx(0.25)  # half the CPU seconds per FLOP too
    assert fast["equal_compute"]["diff"] == pytest.approx(0.0)
    half = _curves(taus)
    half = Curves(1.0 - (1.0 - half.losses) / 2, half.flops, half.cpu)
    control = arm_statistics(native, half, [0.5, 0.5], reps=200)
    assert control["time_to_quality"]["flops"]["reached"] == 0
    assert control["time_to_quality"]["flops"]["ratio"] == pytest.approx(np.exp(np.mean(np.log([1 / (0.9 * t) for t in taus]))))
    assert control["equal_compute"]["diff"] == pytest.approx(0.05) and control["equal_compute_by_stratum"]["diff"] == pytest.approx(
        [0.05] * 2
    )


def test_paired_item_difference_is_the_mean_arm_minus_native() -> None:
    rng = np.random.default_rng(3)
    native = rng.normal(size=(8, 8))
    iv = paired_item_difference(native, native + 0.3, reps=300)
    assert iv["diff"] == pytest.approx(0.3) and iv["lo"] == pytest.approx(0.3) and iv["hi"] == pytest.approx(0.3)
    noisy = paired_item_difference(native, native + 0.3 + rng.normal(0, 0.1, (8, 8)), reps=300)
    assert noisy["lo"] < noisy["diff"] < noisy["hi"]


def test_decision_rule() -> None:
    iv = lambda lo, hi: {"diff": (lo + hi) / 2, "lo": lo, "hi": hi}  # noqa: E731
    strata = lambda *pairs: {"diff": [0.0] * len(pairs), "lo": [p[0] for p in pairs], "hi": [p[1] for p in pairs]}  # noqa: E731
    delta = 0.05
    assert decide(iv(-0.01, 0.02), strata((-0.01, 0.02), (0.06, 0.09)), [False, False], delta) == "fails"  # a stratum wholly above δ
    assert decide(iv(0.06, 0.07), strata((0.0, 0.01), (0.0, 0.01)), [True, True], delta) == "fails"
    assert decide(iv(-0.01, 0.02), strata((-0.01, 0.02), (0.01, 0.08)), [True, False], delta) == "non-inferior"  # unrouted wide
    assert decide(iv(-0.01, 0.02), strata((-0.01, 0.02), (0.01, 0.08)), [True, True], delta) == "inconclusive"
    assert decide(iv(-0.01, 0.06), strata((-0.01, 0.02), (0.0, 0.01)), [True, True], delta) == "inconclusive"


def test_one_seed_gives_the_estimate_and_no_interval() -> None:
    """A study of one seed has no spread over seeds to read: the estimate stands, its interval is undefined (NaN), and
    no error stops the summary."""
    native, arm = _study(np.random.default_rng(0), seeds=1, crops=10, diff=0.02)
    iv = arm_statistics(native, arm, [1.0], reps=50)["equal_compute"]
    assert np.isfinite(iv["diff"]) and np.isnan(iv["lo"]) and np.isnan(iv["hi"])
