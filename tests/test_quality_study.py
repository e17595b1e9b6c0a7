"""benchmarks/bench_quality.py as docs/fidelity/quality/PROTOCOL.md (version 4) fixes it: the other
margin, the strata and their training-law weights, the sensitivity's concept, the protocol-descent refusal,
the summary's keys and protocol revision, and one tiny run end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CONCEPT_MAP = ROOT / "docs" / "fidelity" / "lab_concept_n64_d8_n16" / "map.json"
VARIANTS_MAP = ROOT / "docs" / "fidelity" / "multires" / "variants_t1024" / "map.json"  # has latent_0.75+interp


def _bench():
    spec = importlib.util.spec_from_file_location("bench_quality", ROOT / "benchmarks" / "bench_quality.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_quality"] = module
    spec.loader.exec_module(module)
    return module


def test_other_margin_rule() -> None:
    bench = _bench()
    shares = {0.2: 0.1, 0.3: 0.1, 0.4: 0.15, 0.5: 0.2, 0.1: 0.05, 0.05: 0.0}
    assert bench.other_margin(shares) == 0.4  # the first wider margin that routes another share
    assert bench.other_margin({**shares, 0.4: 0.1, 0.5: 0.1}) == 0.1  # none wider: the first narrower
    assert bench.other_margin({**shares, 0.4: 0.1, 0.5: 0.1, 0.1: 0.1}) == 0.05
    assert bench.other_margin(dict.fromkeys(shares, 0.1)) is None  # none: the arm is not run


def test_routed_share_is_the_law_mass_of_the_union_of_bands() -> None:
    bench = _bench()
    law = bench.training_law()
    table = {"routes": [{"route": "256:192", "sigma_min": 0.65, "sigma_max": 0.95}, {"route": "256:224", "sigma_min": 0.5}]}
    assert bench.bands(table) == [(0.65, 0.95), (0.5, 1.0)]
    assert bench.routed_share(table) == pytest.approx(law.mass(0.5, 1.0, bench.NATIVE_LATENT))
    assert bench.routed_share({"enable": False}) == 0 and bench.routed_share(None) == 0


def test_concept_strata_add_the_midpoint_of_an_uncovered_routed_band() -> None:
    bench = _bench()
    arms = {"native": None, "default": {"routes": [{"route": "512:384", "sigma_min": 0.93, "sigma_max": 0.97}]},
            "all0.5": {"routes": bench.ALL_HALF}}  # fmt: skip
    assert bench.concept_sigmas(arms) == sorted([*bench.FIXED_SIGMAS, 0.95])
    assert bench.concept_sigmas({"native": None, "seed_recipe": {"routes": bench.SEED_RECIPE}}) == list(bench.FIXED_SIGMAS)


def test_training_law_weights_sum_to_one_and_match_the_trainers_sampler() -> None:
    """The weights are the lab trainer's σ law's mass per cell: σ drawn by the trainer's own sampler
    (``flux_train_utils``, the trainer's args) fall in each cell at that rate, within 4 standard errors."""
    from downscale_plugin.lab import flux_train_utils
    from downscale_plugin.lab.trainer import lab_args, make_noise_scheduler

    bench = _bench()
    sigmas = list(bench.FIXED_SIGMAS)
    weights = np.array(bench.training_law_weights(sigmas))
    assert weights.sum() == pytest.approx(1.0) and (weights >= 0).all()
    args = lab_args()
    n = 200_000
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        drawn, _ = flux_train_utils._draw_sigmas(args, make_noise_scheduler(args), n, 64, 64, "cpu", torch.float32)
    edges = [0.0, *((a + b) / 2 for a, b in zip(sigmas, sigmas[1:], strict=False)), 1.0]
    observed = np.histogram(drawn.double().numpy(), bins=edges)[0] / n
    assert np.all(np.abs(observed - weights) < 4 * np.sqrt(weights * (1 - weights) / n) + 1e-9)
    assert weights.argmax() == sigmas.index(0.75)  # the shift puts the law's bulk high


def test_a_code_revision_that_does_not_descend_from_the_protocol_is_refused(monkeypatch, capsys, tmp_path) -> None:
    bench = _bench()
    head = bench.code_state()["revision"]
    assert bench.descends_from_protocol(head)
    before = bench._git("rev-parse", f"{bench.protocol_revision()}~1").strip()
    assert not bench.descends_from_protocol(before)
    monkeypatch.setattr(bench, "code_state", lambda: {"revision": before, "uncommitted": ""})
    args = bench.parse_args(["study", "--out", str(tmp_path)])
    assert bench.launch(args, []) == 2
    assert "does not descend from the protocol's" in capsys.readouterr().err
    run = {"code": {"revision": before, "uncommitted": ""}}
    assert "does not descend" in bench.stale_reason(run, {"revision": head, "uncommitted": ""})


def _run(arm: str, seed: int, gain: float, lag: float, routed: bool) -> dict:
    """A synthetic stored run: 5 points over one unit, 10 crops × 2 strata × 1 draw, L̄ falling by ``gain``."""
    t = np.linspace(0, 1, 5)
    rng = np.random.default_rng([seed, len(arm)])
    items = [(1.0 - gain * min(x / (0.6 * lag), 1.0) + rng.normal(0, 0.002, (10, 2, 1))).flatten().round(7).tolist() for x in t]
    curve = [{"step": int(8 * x), "flops": 8.0 * x, "cpu_s": 4.0 * x, "lbar": 0.0, "strata": [0.0, 0.0]} for x in t]
    return {"arm": arm, "seed": seed, "settings": {"sigmas": [0.3, 0.9], "steps": 8, "val_per_bucket": 2, "val_seed": 0, "points": 4},
            "weights": [0.4, 0.6], "items_shape": [10, 2, 1], "items": items, "curve": curve, "native_flops": 8.0,
            "tokens_run": [4] * (16 if routed else 8), "routed": [0] * 16 if routed else [],
            "code": {"revision": "abc", "uncommitted": ""}, "protocol_revision": "p", "samples": {"spectrum_distance": list(rng.normal(1, 0.01, 8) + (0.2 * routed))}}  # fmt: skip


def test_summary_keys_and_decisions_on_synthetic_runs() -> None:
    bench = _bench()
    runs = {}
    for seed in range(4):
        runs["native", seed] = _run("native", seed, 0.1, 1.0, False)
        runs["default", seed] = _run("default", seed, 0.1, 0.8, True)
        runs["all0.5", seed] = _run("all0.5", seed, 0.05, 1.0, True)
    tables = {"native": None, "default": {"routes": [{"route": "512:384", "sigma_min": 0.5}]}, "eps0.05": {"enable": False},
              "all0.5": {"routes": bench.ALL_HALF}}  # fmt: skip
    block = bench.summarize_concept("hatch", runs, tables)
    assert block["task"] == {"name": "hatch", "kind": "fine_detail", "pretraining_overlap": False}
    for key in ("native_gain_fraction", "native_last_quarter_fraction", "validation", "arms", "delta"):
        assert key in block
    assert block["validation"]["sigmas"] == [0.3, 0.9] and block["validation"]["items"]["crops"] == 10
    assert block["arms"]["eps0.05"]["windowless"]
    default = block["arms"]["default"]
    for key in ("seeds", "protocol_revision", "code_revision", "steps_routed", "flops_saved_per_step", "time_to_quality", "equal_compute",
                "equal_compute_by_sigma", "sample_metric", "decision", "sooner"):  # fmt: skip
        assert key in default, key
    assert set(default["time_to_quality"]) == {"flops", "cpu"}
    assert set(default["time_to_quality"]["flops"]) == {"ratio", "lo", "hi", "reached", "seeds"}
    assert [s["sigma"] for s in default["equal_compute_by_sigma"]] == [0.3, 0.9]
    assert default["steps_routed"] == 1.0 and default["flops_saved_per_step"] == pytest.approx(0.5)
    assert 0.6 < default["time_to_quality"]["flops"]["ratio"] < 0.9 and default["decision"] == "non-inferior"  # 0.8 off a 5-point grid
    control = block["arms"]["all0.5"]
    assert control["decision"] == "fails" and control["sample_metric"]["lo"] > 0
    assert block["control_shows_loss"] == {"loss": True, "sample_metric": True} and bench.control_reading(block) == ""
    assert block["delta"] == pytest.approx(0.01, rel=0.1)
    summary = {"protocol_revision": "p", "default_margin": None, "default_margin_why": "x", "default_positions": None,
               "default_positions_why": "x", "schedule": "flops", "code_revision": "c", "command": "c", "concepts": {"hatch": block}}  # fmt: skip
    assert "| hatch | default |" in bench.report(summary)
    table = [row for row in bench.readme_table({**summary, "default_margin": 0.2}).splitlines() if row.startswith("|")]
    assert [row.split(" | ")[1] for row in table[2:]] == ["windows at ε = 0.2 (default margin)", "windows at ε = 0.05",
                                                          "every step at 0.5 (the control)"]  # fmt: skip
    assert table[2].startswith("| hatch (fine detail at the grid's Nyquist) |") and table[3].startswith("|  |")
    assert "0 % (no window certified: the native run)" in table[3]
    worst = max(control["equal_compute_by_sigma"], key=lambda s: s["diff"])
    assert f"σ {worst['sigma']:g}: **+" in table[4] and worst["lo"] > block["delta"]  # beyond the margin: bold
    assert table[4].split(" | ")[3].startswith("≥ ") == (control["time_to_quality"]["flops"]["reached"] < 4)
    assert "**" not in table[2] and "(default margin)" not in bench.readme_table(summary)
    assert bench.default_margin({"hatch": block}, ["hatch", "subject"])["value"] is None  # a concept missing


def test_the_readme_states_the_default_margin_rule_and_which_margins_are_sooner() -> None:
    """PROTOCOL §6's first-screen words come with the table: the rule's reason in bold where no margin was shown
    non-inferior on every concept (naming what kept each), and in bold that no margin is sooner where none is."""
    bench = _bench()
    sooner = {"decision": "non-inferior", "sooner": {"flops": True, "cpu": False}}
    late = {"decision": "inconclusive", "sooner": {"flops": False, "cpu": False}}
    concepts = {"subject": {"arms": {"native": {}, "default": sooner, "eps0.3": late}},
                "style": {"arms": {"native": {}, "default": late, "eps0.3": sooner, "seed_recipe": sooner}}}  # fmt: skip
    summary = {"default_margin": 0.2, "default_margin_why": "the widest margin non-inferior on every concept", "concepts": concepts}
    verdict = bench.readme_verdict(summary)
    assert verdict.startswith("\nDefault margin (PROTOCOL §6): ε = 0.2. The widest margin non-inferior on every concept.")
    assert "windows at ε = 0.2 (default margin) on subject; windows at ε = 0.3 on style." in verdict and "seed" not in verdict
    short = "no margin run is non-inferior on every concept (0.2 on style (inconclusive: σ 0.05)): the narrowest that fails on none"
    verdict = bench.readme_verdict({**summary, "default_margin": 0.1, "default_margin_why": short})
    assert "ε = 0.1. **No margin run is non-inferior on every concept (0.2 on style (inconclusive: σ 0.05))" in verdict
    for block in concepts.values():
        block["arms"]["default"] = block["arms"]["eps0.3"] = late
    verdict = bench.readme_verdict({**summary, "default_margin": None, "default_margin_why": "every margin run fails on some concept (…)"})
    assert "Default margin (PROTOCOL §6): none. **Every margin run fails" in verdict
    assert verdict.rstrip().endswith("**No margin is sooner in FLOPs on any concept.**")
    empty = {**summary, "concepts": {}}
    assert bench.readme_verdict(empty) in bench.readme_table(empty)


def test_report_readme_replaces_only_the_marked_table(capsys) -> None:
    """The README's table is written from the summary between its markers; the text around it stays as it was, a
    second splice changes nothing, and a README without the markers is refused rather than appended to."""
    bench = _bench()
    begin, end = bench.README_TABLE
    text = f"intro\n\n{begin}\n| old | table |\n{end}\n\nafter\n"
    once = bench.splice_readme(text, "| new |\n\nmap line\n")
    assert once == f"intro\n\n{begin}\n| new |\n\nmap line\n{end}\n\nafter\n"
    assert bench.splice_readme(once, "| new |\n\nmap line\n") == once
    for broken in ("intro\n", f"{begin}\n| old |\n", f"| old |\n{end}\n"):
        with pytest.raises(ValueError, match="quality-table markers"):
            bench.splice_readme(broken, "| new |")
    readme = bench.README.read_text()
    assert readme.count(begin) == 1 and readme.count(end) == 1 and readme.index(begin) < readme.index(end)
    for argv in (["study", "--readme"], ["report", "--readme", "--narrow"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
    assert "--readme: only with report" in capsys.readouterr().err
    assert bench.parse_args(["report", "--readme"]).readme


def test_the_report_names_the_reading_on_which_the_control_shows_no_loss() -> None:
    bench = _bench()
    posters = {"control_shows_loss": {"loss": True, "sample_metric": False}}
    assert bench.control_reading(posters) == "; **the control shows no loss on the sample metric: uninformative on it**"
    neither = {"control_shows_loss": {"loss": False, "sample_metric": False}}
    assert "L̄ and its strata or the sample metric: uninformative on them" in bench.control_reading(neither)
    assert bench.control_reading({}) == ""  # no control arm run: nothing to read


def _with_stratum(run: dict, sigma: float = 0.975) -> dict:
    """``run`` validated at one more stratum, appended at the end (its items a copy of the last stratum's)."""
    shape = run["items_shape"]
    items = [np.concatenate([np.reshape(i, shape), np.reshape(i, shape)[:, -1:]], axis=1).flatten().tolist() for i in run["items"]]
    settings = {**run["settings"], "sigmas": [*run["settings"]["sigmas"], sigma]}
    return {**run, "settings": settings, "weights": [0.4, 0.4, 0.2], "items_shape": [shape[0], shape[1] + 1, shape[2]], "items": items}


def test_the_narrow_comparison_joins_the_concepts_arms_with_its_own_strata_and_twins(monkeypatch) -> None:
    """PROTOCOL §4 (version 4): the ε = 0.1 arm is compared with its own native twins on its own strata, which must
    equal the primary study's natives where both validate; it joins the arms only once it has run somewhere."""
    bench = _bench()
    primary = {("native", s): _run("native", s, 0.1, 1.0, False) for s in range(4)}
    comparison = {}
    for s in range(4):
        comparison["native", s] = _with_stratum(primary["native", s])
        comparison[bench.NARROW, s] = _with_stratum(_run(bench.NARROW, s, 0.1, 0.8, True))
    tables = {"native": None, bench.NARROW: {"routes": [{"route": "512:384", "sigma_min": 0.95}]}}
    monkeypatch.setattr(bench, "part_arms", lambda concept, part, out=None: (tables, [0.3, 0.9, 0.975]))
    entry = bench.narrow_entry("hatch", primary, comparison, Path("unused"))
    assert entry["decision"] == "non-inferior" and [s["sigma"] for s in entry["equal_compute_by_sigma"]] == [0.3, 0.9, 0.975]
    assert entry["comparison"]["validation"]["sigmas"] == [0.3, 0.9, 0.975]
    assert entry["comparison"]["natives_match"] == {"seeds": [0, 1, 2, 3], "max_abs_diff": 0.0}
    block = bench.summarize_concept("hatch", primary, {"native": None})
    concepts = {"hatch": block, "subject": {"arms": {}}}
    bench.join_narrow(concepts, {"hatch": None, "subject": bench.windowless_entry()})
    assert bench.NARROW not in concepts["subject"]["arms"]  # nowhere run yet: a windowless arm is not listed
    bench.join_narrow(concepts, {"hatch": entry, "subject": bench.windowless_entry()})
    assert concepts["hatch"]["arms"][bench.NARROW] is entry and concepts["subject"]["arms"][bench.NARROW]["windowless"]
    summary = {"protocol_revision": "p", "default_margin": None, "default_margin_why": "x", "default_positions": None,
               "default_positions_why": "x", "schedule": "flops", "code_revision": "c", "command": "c", "concepts": {"hatch": block}}  # fmt: skip
    text = bench.report(summary)
    assert "The ε = 0.1 comparison, against its own native twins" in text and "| 0.975 | 0.200 |" in text
    comparison["native", 2]["items"][3][0] += 1e-3  # another twin: refused, not summarised
    with pytest.raises(ValueError, match="not the same twins"):
        bench.narrow_entry("hatch", primary, comparison, Path("unused"))


def test_the_narrow_comparison_plans_its_own_runs_and_leaves_the_primary_as_it_was(capsys) -> None:
    """On the shipped windows: the primary study keeps its 232 runs and strata; the ε = 0.1 comparison runs native and
    eps0.1 on subject and style (hatch's windows at 0.1 are empty), 16 seeds each, validated at (0.975, 1]'s midpoint
    as well, in a folder of its own."""
    bench = _bench()
    primary = bench.planned_runs(bench.parse_args(["study"]))
    assert len(primary) == 232 and {tuple(j["settings"]["sigmas"]) for j in primary if j["concept"] == "style"} == {bench.FIXED_SIGMAS}
    narrow = bench.planned_runs(bench.parse_args(["study", "--narrow"]))
    assert len(narrow) == 64 and {(j["concept"], j["arm"]) for j in narrow} == {
        (c, a) for c in ("subject", "style") for a in ("native", bench.NARROW)}  # fmt: skip
    assert {tuple(j["settings"]["sigmas"]) for j in narrow} == {(*bench.FIXED_SIGMAS, 0.9875)}
    assert bench.run_path(bench.OUT, "style", "native", 3, narrow[0]["part"]) == bench.OUT / "runs" / "style_eps0.1" / "native_s3.json"
    with pytest.raises(SystemExit):
        bench.parse_args(["study", "--narrow", "--concepts", "style", "--schedule", "steps"])
    assert "--narrow is the ε = 0.1 comparison under the primary schedule" in capsys.readouterr().err


def test_the_narrow_comparison_starts_only_when_protocol_section_6_calls_for_it(monkeypatch, capsys) -> None:
    """PROTOCOL §4, §6: `study --narrow` is refused, before any run, unless every other arm has all its seeds and no
    margin run is non-inferior on every concept; the rule reads the primary arms alone, so a comparison under way
    resumes."""
    bench = _bench()
    seen = []

    def rule(why):
        def decide(concepts, expected):
            seen.append(sorted({a for c in concepts.values() for a in c["arms"]}))
            return {"value": None if "next" in why else 0.2, "why": why}

        return decide

    args = bench.parse_args(["study", "--narrow"])
    monkeypatch.setattr(bench, "descends_from_protocol", lambda revision: True)  # a shallow clone has no history to check

    def no_run(args):
        raise AssertionError("the ε = 0.1 comparison was planned: a refused command must start no run")

    monkeypatch.setattr(bench, "planned_runs", no_run)
    monkeypatch.setattr(bench, "default_margin", rule("the widest margin non-inferior on every concept"))
    assert bench.launch(args, ["study", "--narrow"]) == 2
    assert "--narrow: PROTOCOL §6 does not call for the ε = 0.1 comparison: default margin 0.2" in capsys.readouterr().err
    monkeypatch.setattr(bench, "default_margin", rule("no margin run is … (…): the ε = 0.1 comparison runs next (PROTOCOL §4, §6)"))
    assert bench.narrow_refusal(args) is None
    assert all(bench.NARROW not in arms for arms in seen) and len(seen) == 2


@pytest.mark.long
def test_a_tiny_study_end_to_end(tmp_path, monkeypatch) -> None:
    """Windows from the stored concept map, two arms of one seed at tiny settings on the shipped base
    (``concept``: the hatch's data until the concepts are renamed), summary and report."""
    bench = _bench()
    monkeypatch.setattr(bench, "CONCEPTS", {"concept": "fine_detail"})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        choice = bench.derive_windows("concept", CONCEPT_MAP, tmp_path)
        assert choice["other"] is not None and (tmp_path / "windows" / "concept_eps0.2.toml").is_file()
        bench.derive_interp_windows("concept", VARIANTS_MAP, tmp_path)
        argv = ["study", "--concepts", "concept", "--out", str(tmp_path), "--windows", str(tmp_path), "--steps", "2", "--points", "1",
                "--val_per_bucket", "1", "--val_draws", "1", "--samples", "1", "--arms", "native,all0.5", "--seeds", "0"]  # fmt: skip
        args = bench.parse_args(argv)
        bench.work(args)
        # This map certifies nothing at 0.1: its 0.2 windows stand in, so the comparison has an arm to run.
        eps = tmp_path / "windows"
        (eps / "concept_eps0.1.toml").write_text((eps / "concept_eps0.2.toml").read_text())
        narrow = [*argv[: argv.index("--arms")], "--arms", f"native,{bench.NARROW}", "--seeds", "0", "--narrow"]
        bench.work(bench.parse_args(narrow))  # the ε = 0.1 comparison: its own native twin, maybe one more stratum
    finally:
        torch.set_num_threads(threads)
    run = json.loads((tmp_path / "runs" / "concept" / "all0.5_s0.json").read_text())
    assert run["protocol_revision"] == bench.protocol_revision() and run["code"]["revision"]
    assert len(run["items"][0]) == 5 * len(bench.FIXED_SIGMAS) and len(run["samples"]["spectrum_distance"]) == 1
    summary = bench.summarize(args, argv)
    assert summary["protocol_revision"] and summary["default_margin"] is None
    assert "all0.5" in summary["concepts"]["concept"]["arms"] and bench.refusals(args, bench.planned_runs(args)) == []
    narrow_arm = summary["concepts"]["concept"]["arms"][bench.NARROW]  # joined: the real twins equal on shared strata
    assert narrow_arm["comparison"]["natives_match"]["seeds"] == [0] and narrow_arm["comparison"]["natives_match"]["max_abs_diff"] <= 1e-6
    # the exploratory band reading retrains without validating: the same twins as the stored runs, sample for sample
    (path,) = bench.diagnose_bands(bench.parse_args(["bands", *argv[1:]]))
    readings = json.loads(path.read_text())["readings"]
    assert set(readings) == {"base", "native_s0", "all0.5_s0"}
    assert readings["native_s0"]["stored_distance_matches"] and readings["all0.5_s0"]["stored_distance_matches"]
    assert readings["all0.5_s0"]["distance"] == pytest.approx(run["samples"]["spectrum_distance"][0])


def test_a_launch_frees_a_stopped_workers_claims_and_keeps_a_live_ones(tmp_path) -> None:
    """Two launches on one folder (a pilot and a study queued side by side): the second must not free the runs the
    first's live workers hold, or both would train the same run and the first would lose its claim."""
    import subprocess

    stopped = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    runs = tmp_path / "runs" / "hatch"
    runs.mkdir(parents=True)
    (runs / "native_s0.claim").write_text(str(os.getpid()))  # this process: alive
    (runs / "native_s1.claim").write_text(stopped.stdout.strip())  # a worker that has ended
    (runs / "native_s2.claim").write_text("")  # a claim from before claims named their worker
    _bench().clear_stopped_claims(tmp_path)
    assert sorted(p.name for p in runs.iterdir()) == ["native_s0.claim"]


def test_the_interp_arm_reads_the_maps_interpolated_arms_at_the_default_margin(tmp_path) -> None:
    """PROTOCOL version 2: ``interp`` runs the windows that the map's interpolated-positions arms certify at ε = 0.2, with
    ``positions = "interpolate"``; a concept has no study until its interp windows exist, and a map without such arms
    cannot give them."""
    from downscale_plugin.config import load_config, read_plugin_toml

    bench = _bench()
    path = bench.derive_interp_windows("hatch", VARIANTS_MAP, tmp_path)
    config = load_config(plugin_toml=read_plugin_toml(str(path)))
    assert config.fasterdit.positions == "interpolate" and config.fasterdit.sigma_policy == "keep"
    assert [(r.label, r.sigma_min, r.sigma_max) for r in config.routes] == [("512:384", 0.8, None)]  # plain's is (0.9, 1]
    with pytest.raises(ValueError, match="no latent arms with interpolated positions"):
        bench.derive_interp_windows("hatch", CONCEPT_MAP, tmp_path)

    bench.derive_windows("hatch", CONCEPT_MAP, tmp_path)
    (tmp_path / "windows" / "hatch_interp_eps0.2.toml").rename(tmp_path / "aside.toml")
    with pytest.raises(FileNotFoundError, match="--positions interpolate"):
        bench.concept_arms("hatch", tmp_path)
    (tmp_path / "aside.toml").rename(tmp_path / "windows" / "hatch_interp_eps0.2.toml")
    arms = bench.concept_arms("hatch", tmp_path)
    assert list(arms) == ["native", "default", "eps0.3", "interp", "seed_recipe", "all0.5"]


def _choices(folder: Path, shares: dict[str, float]) -> Path:
    (folder / "windows").mkdir(parents=True, exist_ok=True)
    for concept, share in shares.items():
        (folder / "windows" / f"{concept}.json").write_text(json.dumps({"routed_share": {"0.2": share, "0.3": 1.0}}))
    return folder


def test_the_sensitivity_runs_on_the_concept_whose_default_windows_route_most(tmp_path, capsys) -> None:
    """PROTOCOL §1 (version 3): on the shipped windows the posters' default arm is windowless (the native run), so the
    sensitivity goes to the concept whose default routes the largest share, style; a tie keeps the protocol's order,
    and ``--schedule steps`` on another concept is refused with the one it must be."""
    bench = _bench()
    assert bench.sensitivity_concept() == "style"
    assert bench.sensitivity_concept(_choices(tmp_path / "a", {"hatch": 0.5, "subject": 0.2, "style": 0.4})) == "hatch"
    assert bench.sensitivity_concept(_choices(tmp_path / "b", {"hatch": 0.1, "subject": 0.4, "style": 0.4})) == "subject"
    assert bench.parse_args(["study", "--concepts", "style", "--schedule", "steps"]).schedule == "steps"
    with pytest.raises(SystemExit):
        bench.parse_args(["study", "--concepts", "hatch", "--schedule", "steps"])
    assert "--concepts style only (PROTOCOL §1)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["study", "--concepts", "style", "--schedule", "steps", "--windows", str(tmp_path / "none")])
    assert "the sensitivity concept is read from the windows' choices" in capsys.readouterr().err


def test_the_summary_records_the_protocol_its_runs_ran_under() -> None:
    """A later protocol version (a new sensitivity concept, say) changes what later runs do, not what stored runs did:
    the summary carries their revision, and runs under two revisions are refused rather than summarised as one."""
    bench = _bench()
    assert bench.arm_protocol([{"protocol_revision": "v2"}, {"protocol_revision": "v2"}]) == "v2"
    with pytest.raises(ValueError, match="several protocol revisions"):
        bench.arm_protocol([{"protocol_revision": "v2"}, {"protocol_revision": "v3"}])
    # Arms under two versions (version 4's ε = 0.1 comparison beside version 2's arms): the newer names the summary.
    versions = bench._git("log", "--format=%H", "--", bench.PROTOCOL).split()  # newest first
    assert bench.runs_protocol({versions[1], versions[0]}) == versions[0]
    assert bench.runs_protocol(set()) == bench.protocol_revision()
    with pytest.raises(ValueError, match="no one of which descends"):
        bench.runs_protocol({versions[0], "f" * 40})  # a revision this checkout lacks descends from nothing here


def _decided(decision: str, ratio: float = 0.9, seeds: int = 16) -> dict:
    return {"decision": decision, "seeds": list(range(seeds)), "time_to_quality": {"flops": {"ratio": ratio}}}


def _concept(default: dict, eps: dict, interp: dict, differ: bool = True) -> dict:
    arms = {"native": {}, "default": default, "eps0.3": eps, "interp": interp, "seed_recipe": _decided("fails"),
            "all0.5": _decided("fails", seeds=8)}  # fmt: skip
    return {"arms": arms, "interp_windows_differ": differ}


def test_default_margin_and_positions_follow_protocol_section_6() -> None:
    """The widest margin non-inferior on every concept, a windowless arm (the native run) counting as non-inferior;
    nothing until every arm has every seed; positions interpolate only if interp is non-inferior everywhere and sooner
    in FLOPs wherever its windows differ from the default arm's."""
    bench = _bench()
    windowless = {"windowless": True}
    ok, wider = _decided("non-inferior", 0.8), _decided("non-inferior", 0.7)
    concepts = {"hatch": _concept(windowless, wider, windowless, differ=False),
                "subject": _concept(ok, wider, _decided("non-inferior", 0.75)),
                "style": _concept(ok, _decided("inconclusive"), _decided("non-inferior", 0.7))}  # fmt: skip
    expected = ["hatch", "subject", "style"]
    assert bench.default_margin(concepts, expected) == {"value": 0.2, "why": "the widest margin non-inferior on every concept"}
    assert bench.default_positions(concepts, expected)["value"] == "interpolate"
    concepts["style"]["arms"]["eps0.3"] = _decided("non-inferior")
    assert bench.default_margin(concepts, expected)["value"] == 0.3
    concepts["subject"]["arms"]["interp"] = _decided("non-inferior", 0.85)  # windows differ, later than default's 0.8
    assert bench.default_positions(concepts, expected) == {
        "value": "plain", "why": "on subject the interp arm is not sooner in FLOPs than the default arm (0.850 vs 0.800)"}  # fmt: skip
    concepts["subject"]["interp_windows_differ"] = False  # the same windows: the estimate is not compared
    assert bench.default_positions(concepts, expected)["value"] == "interpolate"
    concepts["style"]["arms"]["interp"] = _decided("inconclusive", 0.5)
    assert bench.default_positions(concepts, expected) == {"value": "plain", "why": "the interp arm is inconclusive on style"}
    concepts["hatch"]["arms"]["eps0.3"] = _decided("non-inferior", seeds=15)  # a seed missing: no decision yet
    assert bench.default_margin(concepts, expected)["value"] is None
    assert bench.default_positions(concepts, expected)["why"] == "not every concept has complete arms"
    concepts["hatch"]["arms"]["eps0.3"] = _decided("fails")
    concepts["subject"]["arms"]["default"] = {**_decided("inconclusive"), "short_of_non_inferior": [{"sigma": 0.05}]}
    assert bench.default_margin(concepts, expected) == {  # 0.2 inconclusive on subject, 0.3 fails on hatch
        "value": None, "why": "no margin run is non-inferior on every concept (0.2 on subject (inconclusive: σ 0.05); "
                              "0.3 on hatch (fails: )): the ε = 0.1 comparison runs next (PROTOCOL §4, §6)"}  # fmt: skip
    # Version 4: the ε = 0.1 comparison decides; failing it, the narrowest margin run that fails on no concept.
    for c, entry in (("hatch", windowless), ("subject", ok), ("style", ok)):
        concepts[c]["arms"]["eps0.1"] = entry
    assert bench.default_margin(concepts, expected) == {"value": 0.1, "why": "the widest margin non-inferior on every concept"}
    concepts["style"]["arms"]["eps0.1"] = _decided("inconclusive")
    assert bench.default_margin(concepts, expected)["value"] == 0.1  # 0.1 and 0.2 fail nowhere: the narrower
    assert "the narrowest that fails on none" in bench.default_margin(concepts, expected)["why"]
    concepts["style"]["arms"]["eps0.1"] = _decided("fails")
    assert bench.default_margin(concepts, expected)["value"] == 0.2
    concepts["subject"]["arms"]["default"] = _decided("fails")
    assert bench.default_margin(concepts, expected)["why"].startswith("every margin run fails on some concept")
    assert bench.default_margin(concepts, expected)["value"] is None


def test_the_concept_maps_cost_is_reported_beside_the_table() -> None:
    """PROTOCOL §4: the map a user runs for the windows is not counted in an arm's time, so the README's table says
    what it cost, from the map's own provenance, against a native run's training CPU."""
    bench = _bench()
    cost = bench.map_cost("style")
    assert cost["map"] == "docs/fidelity/multires/style_t1024/map.json" and cost["wall_s"] == pytest.approx(2806.83)
    # 16 probes × 15 σ bins (14 and σ = 1) × 8 draws × (2 native passes + 0.25 + 0.5625 + 0.765625 for the routes)
    assert cost["native_step_equivalents"] == pytest.approx(16 * 15 * 8 * 3.578125)
    summary = {"concepts": {"style": {"map_cost": cost, "native_train_cpu_s": 158.3, "steps": 400, "arms": {}},
                            "hatch": {"map_cost": {**cost, "wall_s": 3812.8}, "native_train_cpu_s": 150.0, "steps": 400, "arms": {}}}}  # fmt: skip
    assert bench.map_cost_line(summary) == (
        "\nThe windows come from one `map` per concept, not counted in the times above: 6,870 native-step equivalents each, "
        "17 × the native run's 400 steps (2,807–3,813 s at one torch thread, 18–25 × its training CPU).\n")  # fmt: skip
    assert bench.map_cost_line({"concepts": {}}) == ""


def test_the_interp_windows_differ_only_where_the_routes_do() -> None:
    bench = _bench()
    tables = bench.concept_arms("hatch")
    assert bench.route_windows(tables["default"]) == [] == bench.route_windows(tables["interp"])  # both windowless
    subject, style = bench.concept_arms("subject"), bench.concept_arms("style")
    assert bench.route_windows(subject["default"]) != bench.route_windows(subject["interp"])  # 0.5 above 0.95 vs 0.925
    assert ("512:384", 0.0, 0.366666666667) in bench.route_windows(subject["interp"])
    assert bench.route_windows(style["default"]) != bench.route_windows(style["interp"])


def test_the_band_reading_splits_the_sample_metric_by_octave() -> None:
    """The octaves tile rings 1 … H/2 and their squared parts sum to the §5 metric squared, per sample averaged."""
    from downscale_plugin.lab.generate import radial_log_spectrum

    bench = _bench()
    assert bench.octave_bands(128) == [(1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, 128)]
    assert bench.octave_bands(5) == [(1, 1), (2, 3), (4, 5)]
    pixels = torch.rand(3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    spectra, reference = radial_log_spectrum(pixels), radial_log_spectrum(pixels.roll(1, dims=0)).mean(dim=0) + 0.1
    bands = bench.band_reading(spectra, reference)
    assert sum(b["squared"] for b in bands) == pytest.approx(float(((spectra - reference) ** 2).sum(-1).mean()))
    assert bands[-1]["period_px"] == [2.0, 4.0] and bands[0]["period_px"] == [64.0, 64.0]
    lifted = bench.band_reading(spectra + 1.0, reference)  # one log10 unit more power everywhere
    assert all(b["offset"] - a["offset"] == pytest.approx(1.0) for a, b in zip(bands, lifted, strict=True))
