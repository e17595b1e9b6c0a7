"""The token-count fit (mapping/scaling.py): it recovers the form that made the data, picks it, refuses what it
cannot fit, and its interval at an extrapolated token count covers the truth at its level."""

from __future__ import annotations

import math

import numpy as np
import pytest

from downscale_plugin.mapping.scaling import best_fit, fit_form

TOKENS = (324.0, 576.0, 1296.0)  # the small grids of route 0.75 at 576, 1024 and 2304 native tokens


def test_each_form_recovers_its_parameters_from_exact_points():
    inverse = fit_form("inverse", TOKENS, [0.02 + 30.0 / t for t in TOKENS], [0.01] * 3)
    assert inverse.params == pytest.approx((0.02, 30.0)) and inverse.chi2 == pytest.approx(0.0, abs=1e-18)
    power = fit_form("power", TOKENS, [5.0 * t**-0.7 for t in TOKENS], [0.01] * 3)
    assert power.params == pytest.approx((math.log(5.0), 0.7))
    assert power.predict(4096 * 0.5625)[0] == pytest.approx(5.0 * (4096 * 0.5625) ** -0.7)


def test_the_better_form_is_chosen_and_power_needs_positive_excess():
    noise = np.array([1e-4, -1e-4, 1e-4])
    assert best_fit(TOKENS, [0.01 + 40.0 / t + n for t, n in zip(TOKENS, noise, strict=True)], [1e-3] * 3).form == "inverse"
    assert best_fit(TOKENS, [3.0 * t**-0.5 + n for t, n in zip(TOKENS, noise, strict=True)], [1e-3] * 3).form == "power"
    assert fit_form("power", TOKENS, [0.1, -0.01, 0.02], [0.01] * 3) is None
    assert best_fit(TOKENS, [0.1, -0.01, 0.02], [0.01] * 3).form == "inverse"


def test_bad_input_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="two or more distinct token counts"):
        fit_form("inverse", (576.0, 576.0), (0.1, 0.2), (0.01, 0.01))
    with pytest.raises(ValueError, match="standard error must be positive"):
        fit_form("inverse", TOKENS, (0.1, 0.2, 0.3), (0.01, 0.0, 0.01))
    with pytest.raises(ValueError, match="allowed: inverse, power"):
        fit_form("log", TOKENS, (0.1, 0.2, 0.3), (0.01, 0.01, 0.01))


@pytest.mark.parametrize("points", [2, 3])
def test_the_extrapolated_interval_covers_the_true_mean_at_its_level(points):
    """Maps' excesses drawn around an inverse law with their standard errors; the 95 % interval at Flux's 1024 px
    small grid (2304 tokens at 0.75) covers the law's value in ≥ 93 % of 2000 synthetic studies. Without the
    lack-of-fit inflation and t quantile at three points it would still hold here (the model is right); the bound
    on the other side, that it is not vacuous, is the median width."""
    rng = np.random.default_rng(0)
    tokens = TOKENS[:points] if points == 3 else (TOKENS[0], TOKENS[2])
    se = np.array([0.03, 0.02, 0.012][:points])
    truth = lambda t: 0.01 + 40.0 / t  # noqa: E731
    target = 2304.0
    covered, widths = 0, []
    for _ in range(2000):
        excess = [truth(t) + rng.normal(0, s) for t, s in zip(tokens, se, strict=True)]
        mean, lo, hi = fit_form("inverse", tokens, excess, se).predict(target)
        covered += lo <= truth(target) <= hi
        widths.append(hi - lo)
    assert covered / 2000 >= 0.93
    assert np.median(widths) < 0.2


def _build():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "docs" / "fidelity" / "token_scaling" / "build.py"
    spec = importlib.util.spec_from_file_location("token_scaling_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path.parent.parent


def test_the_summary_holds_the_output_contract_from_two_stored_maps(tmp_path):
    """The stored single-size maps at 256 and 1024 native tokens: every route and bin gets its excess at both,
    a fit, and an extrapolation to Flux at 1024 px whose small grids are the router's."""
    import json

    build, fidelity = _build()
    maps = f"{fidelity / 'lab_n32_d8_n16' / 'map.json'},{fidelity / 'lab_n64_d8_n16' / 'map.json'}"
    variants = fidelity / "lab_n64_variants075_d8_n8" / "map.json"
    assert build.main(["--maps", f"corpus={maps}", "--variants", str(variants), "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["token_counts"] == [256, 1024] and summary["code_revision"]
    assert sorted(summary["routes"]) == ["0.75", "0.875"]
    for ratio, route in summary["routes"].items():
        assert len(route["bins"]) == len(summary["extrapolated"]["4096"][ratio]) == 15
        for b in route["bins"]:
            assert [e["native_tokens"] for e in b["excess"]] == [256, 1024]
            assert all(e["lo"] < e["mean"] < e["hi"] for e in b["excess"]) and b["fit"]["form"] in ("inverse", "power")
        for p in summary["extrapolated"]["4096"][ratio]:
            assert p["lo"] <= p["mean"] <= p["hi"]
    assert build.small_tokens((128, 128), 0.75, "flux") == 2304 and build.small_tokens((64, 64), 0.875, "flux") == 784
    for route in summary["routes"].values():
        assert set(route["window"]["measured_sigma_min"]) == set(route["window"]["certified_sigma_min"]) == {"256", "1024"}
        for b in route["bins"]:
            assert b["fit"]["dof"] == 0 and b["fit"]["p"] is None  # two points, two parameters: nothing to test the fit by
    assert set(summary["economics"]) == {"extrapolated", "256", "1024"}
    assert all(0.0 <= m["flops_saved"] <= m["routed"] <= 1.0 for m in summary["economics"].values())
    assert {"latent_0.75@snr_match+interp", "latent_0.75+interp"} <= set(summary["variants"])
    assert all({"mean", "lo", "hi"} <= set(b["vs_plain"]) for v in summary["variants"].values() for b in v["bins"])


def test_maps_with_different_bins_or_the_same_size_are_refused():
    import json

    build, fidelity = _build()
    n64 = build.load_map(fidelity / "lab_n64_d8_n16" / "map.json")
    variants = build.load_map(fidelity / "lab_n64_variants075_d8_n8" / "map.json")
    with pytest.raises(ValueError, match="σ bins differ"):
        build.task_scaling([build.load_map(fidelity / "lab_n32_d8_n16" / "map.json"), variants], 0.2)
    with pytest.raises(ValueError, match="share a native token count"):
        build.task_scaling([n64, json.loads(json.dumps(n64))], 0.2)


def test_stacked_windows_route_as_the_router_stacks_them():
    """Deepest route first; a shallower route whose window a deeper one covers never fires, so it changes nothing;
    no window routes nothing; a window from σ = 0 routes every step."""
    build, _ = _build()
    assert build.stacked_economics({0.5: None, 0.75: None}) == {"routed": 0.0, "flops_saved": 0.0}
    all_075 = build.stacked_economics({0.75: 0.0})
    assert all_075["routed"] == pytest.approx(1.0)
    assert build.stacked_economics({0.75: 0.0, 0.875: 0.5}) == pytest.approx(all_075)
    top_05 = build.stacked_economics({0.5: 0.9})
    both = build.stacked_economics({0.5: 0.9, 0.75: 0.0})
    assert both["routed"] == pytest.approx(1.0) and both["flops_saved"] > all_075["flops_saved"]
    assert 0.0 < top_05["routed"] < 1.0 and top_05["flops_saved"] < both["flops_saved"]


def test_a_fit_that_misses_its_points_reports_a_small_p_value():
    build, _ = _build()
    good = build._fit_entry(best_fit(TOKENS, [0.05, 0.04, 0.03], [0.01, 0.01, 0.01]))
    bad = build._fit_entry(best_fit(TOKENS, [0.03, 0.09, 0.01], [0.005, 0.005, 0.005]))
    assert good["dof"] == bad["dof"] == 1
    assert good["p"] > 0.05 > bad["p"]


def test_the_top_window_walks_the_bins_down_from_sigma_one_and_skips_the_endpoint():
    """The σ = 1 point alone opens no window (a single point is none), and an unsafe σ = 1 point does not close
    a window the bins below it open."""
    build, _ = _build()
    bins = [{"sigma_lo": lo, "sigma_hi": hi} for lo, hi in ((0.0, 0.5), (0.5, 0.9), (0.9, 1.0), (1.0, 1.0))]
    assert build._top_window(bins, [False, False, False, True]) is None
    assert build._top_window(bins, [False, True, True, False]) == 0.5
    assert build._top_window(bins, [True, False, True, True]) == 0.9
    assert build._top_window(bins, [True, True, True, True]) == 0.0


def test_the_stored_summary_is_what_the_build_gives_from_the_stored_maps(tmp_path):
    """docs/fidelity/token_scaling/summary.json holds the output contract at three native token counts spanning
    4 ×, on the corpus and on the posters, and rebuilding it from the stored maps gives the same numbers: the
    figures the docs quote cannot drift from the maps they come from."""
    import json

    build, fidelity = _build()
    stored = json.loads((fidelity / "token_scaling" / "summary.json").read_text())
    assert stored["token_counts"] == [576, 1024, 2304] and set(stored["tasks"]) == {"corpus", "hatch"}
    args = []
    for task, body in stored["tasks"].items():
        args += ["--maps", f"{task}=" + ",".join(str(fidelity.parent.parent / m["path"]) for m in body["maps"])]
    variants = fidelity / "multires" / "variants_t1024" / "map.json"
    assert build.main([*args, "--variants", str(variants), "--out", str(tmp_path)]) == 0
    rebuilt = json.loads((tmp_path / "summary.json").read_text())
    for task in stored["tasks"]:
        for key in ("token_counts", "routes", "extrapolated", "economics"):
            _assert_same(rebuilt["tasks"][task][key], stored["tasks"][task][key], f"{task}.{key}")
    _assert_same(rebuilt["variants"], stored["variants"], "variants")
    for ratio in ("0.875", "0.75", "0.5"):
        assert all({"mean", "lo", "hi"} <= set(p) for p in stored["extrapolated"]["4096"][ratio])


def _assert_same(got, want, where="summary"):
    """Equal structure and strings, numbers equal to float rounding (the fits' linear algebra may differ in the
    last bits between machines)."""
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(got, bool):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), where
    else:
        assert got == want, where
