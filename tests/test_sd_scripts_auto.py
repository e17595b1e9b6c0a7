"""``mode = "auto"`` inside the sd-scripts trainers, on the host doubles (CI; no sd-scripts).

The certifier runs once, before the batch that completes its 16 probes, every draw through the
trainer's own ``process_batch``; it spends at most ``certify_budget`` of the run's native compute,
writes ``windows.toml`` and ``certify.json`` to ``map_out``, and the run trains on with what it
certified. Budget 0 is the plain run; a certification that opens nothing leaves the run bitwise the
host's (RNG, accumulated gradients, optimizer untouched).
"""

from __future__ import annotations

import json
import logging
import random

import pytest
import toml
import torch
from host_modules import ARCHS, run_double, trainer_class
from safetensors import safe_open
from test_sd_scripts_map import RES, steps  # noqa: F401  # the fixture recording each host step's latents

from downscale_plugin.config import ConfigError, load_config
from downscale_plugin.hosts.kohya.auto import AutoSession
from downscale_plugin.hosts.sd_scripts.facts import HostError

pytestmark = pytest.mark.usefixtures("host_doubles", "cheap_plan", "token_costs")

# One route (ratio 0.5: latent 16x16 → 8x8) over two σ bins; D = 2 paired draws: a look at one bin
# is 4 probes × 2 draws × (1 + 0.25) = 10 native-step equivalents, a safe verdict (read on all 16) 40.
# a 192-pass run cannot pay back a window's evidence: "buy" certifies all the same (these tests are the mechanics)
QUICK = {"map_ratios": [0.5], "map_bins": "0,0.5,1", "certify_draws": 2, "certify_unpaid": "buy"}
# 48 steps of 4 samples: 192 single-sample passes; the 16 probes (16 distinct images) are in at batch 4.
ARGV = ("--resolution", RES, "--train_batch_size", "4", "--max_train_steps", "48", "--dataset_size", "16", "--seed", "3")
FLOP_FRACTION = AutoSession.pass_fraction


def auto_config(tmp_path, **extra) -> dict:
    return {"mode": "auto", "map_out": str(tmp_path / "auto"), "certify_budget": 0.5, **QUICK, **extra}


def test_budget_zero_is_the_plain_run_bitwise(tmp_path):
    plain = run_double("flux", *ARGV, network_module=ARCHS["flux"][2]).last_run
    run = run_double("flux", *ARGV, downscale=auto_config(tmp_path, certify_budget=0.0)).last_run
    assert run.losses == plain.losses and len(run.losses) == 48
    theirs = plain.network.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in run.network.state_dict().items())
    assert not (tmp_path / "auto").exists()


@pytest.mark.parametrize(
    ("arch", "options"),
    [
        ("flux", ()),
        ("sd1", ()),  # SD1/SDXL: DDPM timesteps, the noise path replayed in the plugin's step
        ("sdxl", ()),
        ("anima", ()),
        pytest.param("anima", ("--unsloth_offload_checkpointing",), id="anima-unsloth-checkpointing"),
    ],
)
def test_a_certification_that_opens_nothing_leaves_training_bitwise_the_hosts(arch, options, tmp_path, monkeypatch):
    """ε ≈ 0: nothing is certified. With gradient accumulation the certifier runs between two
    micro-batches of an update (probe 16 arrives with the 8th batch of 2), so accumulated .grad, the RNG
    and the optimizer must survive it; Anima's caption dropout draws from Python's RNG in every step.
    Anima's unsloth checkpointer runs its own ``torch.autograd.backward`` into ``.grad``: the measurement's backward
    runs it for every draw, and ``.grad`` must come back as the micro-batch before left it."""
    if arch == "anima":
        cls = trainer_class("anima")
        conds = cls.text_conds
        monkeypatch.setattr(cls, "text_conds", lambda self, bsz, gen: [*conds(self, bsz, gen)[:-1], torch.full((bsz,), 0.5)])
    argv = ("--resolution", RES, "--train_batch_size", "2", "--max_train_steps", "40", "--gradient_accumulation_steps", "2",
            "--dataset_size", "16", "--seed", "4")  # fmt: skip
    argv += options
    random.seed(0)
    plain = run_double(arch, *argv, network_module=ARCHS[arch][2]).last_run
    random.seed(0)
    run = run_double(arch, *argv, downscale=auto_config(tmp_path, map_margin=1e-9)).last_run
    assert run.losses == plain.losses and len(run.losses) == 80
    theirs = plain.network.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in run.network.state_dict().items())
    state = run.network.downscale_run
    assert state.cfg.routes == () and state.accounting.total_steps == 80
    blob = json.loads((tmp_path / "auto" / "certify.json").read_text())
    assert blob["cost"]["native_step_equivalents"] > 0 and not any(row["safe"] for row in blob["bins"])


@pytest.mark.parametrize(
    ("arch", "options"),
    [
        pytest.param("sdxl", ("--gradient_checkpointing",), id="sdxl-reentrant"),
        pytest.param("anima", ("--gradient_checkpointing",), id="anima-non-reentrant"),
        pytest.param("anima", ("--unsloth_offload_checkpointing",), id="anima-unsloth"),
    ],
)
def test_checkpointing_changes_nothing_the_certifier_measures(arch, options, tmp_path):
    """The same auto run with and without the host's gradient checkpointing: every per-image estimate the
    certifier read, the windows, the losses and the trained LoRA are the same. A measurement by ``autograd.grad``
    saw zeros for every adapter inside SDXL's reentrant checkpoint (and, where the path to another adapter crosses
    one, as in the real UNet, it raises) and inside Anima's unsloth checkpointer (its block runs under ``no_grad``;
    its backward writes ``.grad`` itself)."""
    argv = (*ARGV, "--gradient_accumulation_steps", "2")
    runs = {}
    for name, extra in (("plain", ()), ("checkpointed", options)):
        config = auto_config(tmp_path / name, map_margin=0.2)
        runs[name] = run_double(arch, *argv, *extra, downscale=config).last_run
        runs[name].certified = json.loads((tmp_path / name / "auto" / "certify.json").read_text())
    plain, checkpointed = runs["plain"], runs["checkpointed"]
    assert checkpointed.unet.gradient_checkpointing and checkpointed.unet.training
    evidence = [(b["route"], b["bin"], b["verdict"], b["evidence"]) for b in plain.certified["bins"]]
    assert any(e["images"] for *_, e in evidence)
    assert [(b["route"], b["bin"], b["verdict"], b["evidence"]) for b in checkpointed.certified["bins"]] == evidence
    assert checkpointed.losses == plain.losses
    theirs = plain.network.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in checkpointed.network.state_dict().items())


@pytest.mark.usefixtures("range_clipped_read")
def test_auto_certifies_then_trains_with_the_windows_and_records_them(tmp_path, steps, caplog):  # noqa: F811
    calls = steps("flux")
    argv = (*ARGV, "--output_dir", str(tmp_path / "out"))
    with caplog.at_level(logging.INFO):
        run = run_double("flux", *argv, downscale=auto_config(tmp_path, map_margin=0.99)).last_run
    state = run.network.downscale_run
    windows = toml.load(tmp_path / "auto" / "windows.toml")
    derived = load_config(plugin_toml=windows)
    assert derived.routes and state.cfg.routes == derived.routes and all(r.ratio == 0.5 for r in derived.routes)
    assert windows["windows_arch"] == "flux" and windows["windows_native"] == "16x16" and windows["windows_method"].startswith("certify")
    assert windows["windows_margin"] == 0.99 and "windows_model" not in windows  # the doubles load no model file to hash
    blob = json.loads((tmp_path / "auto" / "certify.json").read_text())
    spent = blob["cost"]["native_step_equivalents"]
    assert 0 < spent <= 0.5 * 192 and blob["cost"]["budget"] == pytest.approx(96.0)
    # The paired noise went to the host's own draw at the small grid (8x8 of 16x16), not to the hook's dry run of it.
    assert blob["cost"]["route_pass_cost"] == {"latent_0.5": 0.25}
    assert any(row["safe"] for row in blob["bins"])
    train = [shape for shape, _ in calls if shape[0] == 4]  # the certifier's draws run one probe at a time; batch 4 is routed
    assert len(train) == 48 and set(train[:3]) == {(4, 4, 16, 16)} and (4, 4, 8, 8) in train[3:]
    probes = [shape for shape, _ in calls if shape[0] == 1]
    assert probes and set(probes) <= {(1, 4, 16, 16), (1, 4, 8, 8)}
    assert state.accounting.total_steps == 48 and state.accounting.routed_samples > 0
    with safe_open(str(tmp_path / "out" / "last.safetensors"), "pt") as f:
        meta = f.metadata()
    recorded = json.loads(meta["ss_downscale_map"])
    assert recorded["method"] == "certify" and recorded["before_train_batch"] == 4 and recorded["probes"] == 16
    assert recorded["native_step_equivalents"] == pytest.approx(spent, abs=1e-3) and recorded["windows"]
    assert json.loads(meta["ss_downscale_routes"]) == windows["routes"]
    assert (
        "certification: " in caplog.text and f"{spent:.1f} native-step equivalents (" in caplog.text and "spot checks: none" in caplog.text
    )
    assert "net (native-step equivalents of the run's FLOP model): routed saving " in caplog.text
    logged = run.accelerator.trackers[0].records[-1][1]  # the trackers get the same three figures, and as % of the run
    assert logged["downscale/certify/cost"] == pytest.approx(spent) and logged["downscale/certify/cost_pct"] == pytest.approx(
        100 * spent / 192
    )
    assert (
        logged["downscale/certify/net"] == pytest.approx(logged["downscale/certify/saving"] - spent)
        and logged["downscale/certify/saving"] > 0
    )


def test_a_later_run_continues_the_evidence(tmp_path):
    """A budget that pays for the first bin's safe verdict (40) but not the next bin's (it ends 'budget' after the
    images the rest of the budget buys); the second run continues the saved tests and adds to them."""
    first = auto_config(tmp_path, map_margin=0.99, certify_budget=0.25)  # 48
    run_double("flux", *ARGV, downscale=first)
    saved = json.loads((tmp_path / "auto" / "certify.json").read_text())
    before = {(r["route"], r["bin"]): len(r["evidence"]["images"]) for r in saved["bins"] if r["verdict"] != "untested"}
    assert any(r["verdict"] == "budget" for r in saved["bins"])
    (tmp_path / "first.json").write_text(json.dumps(saved))
    second = {**first, "certify_budget": 0.5, "certify_resume": str(tmp_path / "first.json")}
    run_double("flux", *ARGV, downscale=second)
    blob = json.loads((tmp_path / "auto" / "certify.json").read_text())
    after = {(r["route"], r["bin"]): len(r["evidence"]["images"]) for r in blob["bins"] if r["verdict"] != "untested"}
    assert blob["provenance"]["resumed_from"]["native_step_equivalents"] == saved["cost"]["native_step_equivalents"]
    assert blob["cost"]["native_step_equivalents"] > saved["cost"]["native_step_equivalents"]
    assert all(after[key] >= n for key, n in before.items()) and sum(after.values()) > sum(before.values())


@pytest.mark.parametrize(
    ("config", "argv", "message"),
    [
        ({"certify_budget": 0.04}, (), r"costs 40.0 native-step equivalents; certify_budget 0.04 of the run's 192 passes is 7.7"),
        # a budget for the first look (5: 2 images) but not for one safe verdict (40): it could only be spent
        ({"certify_budget": 0.15}, (), r"costs 40.0 .* is 28.8. What would pay: certify_budget >= 0.208"),
        ({}, ("--dataset_size", "8"), "probes: the dataset has 8 distinct images; 16 probes must be 16 distinct images"),
        ({}, ("--max_train_steps", "3"), "probes: 16 probes need 4 train batches of 4, but the run has 3"),
        ({"map_ratios": [0.95]}, (), "map_ratios: 0.95 give no strictly smaller flux grid"),
        ({"certify_resume": "/no/such/certify.json"}, (), "certify_resume: cannot read /no/such/certify.json"),
    ],
)
def test_a_certification_the_run_cannot_do_fails_at_prepare_network(tmp_path, steps, config, argv, message):  # noqa: F811
    calls = steps("flux")
    with pytest.raises(HostError, match=message):
        run_double("flux", *ARGV, *argv, downscale=auto_config(tmp_path, **config))
    assert calls == [] and not (tmp_path / "auto").exists()


def test_evidence_for_other_settings_is_refused_at_prepare_network(tmp_path, steps):  # noqa: F811
    run_double("flux", *ARGV, downscale=auto_config(tmp_path, map_margin=0.99))
    saved = tmp_path / "saved.json"
    saved.write_text((tmp_path / "auto" / "certify.json").read_text())
    calls = steps("flux")
    with pytest.raises(HostError, match=r"certify_resume: margin is 0.99 in the saved result, 0.5 now"):
        run_double("flux", *ARGV, downscale=auto_config(tmp_path, map_margin=0.5, certify_resume=str(saved)))
    assert calls == []


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"mode": "auto"}, 'map_out: required when mode = "auto"'),
        ({"mode": "auto", "map_out": "m", "map_images": 8}, 'map_images: not used with mode = "auto"'),
        ({"mode": "auto", "map_out": "m", "after_map": "train"}, 'after_map: not used with mode = "auto"'),
        ({"routes": [{"scale": 0.5, "sigma_min": 0.6}], "certify_budget": 0.2}, 'certify_budget: only used with mode = "auto"'),
        ({"mode": "auto", "map_out": "m", "certify_budget": 0.7}, r"certify_budget: 0.7 is out of range \(allowed: 0 to 0.5\)"),
    ],
)
def test_auto_keys_are_checked_before_any_model_loads(table, message):
    with pytest.raises(ConfigError, match=message):
        load_config(table=table)


def _decisions(monkeypatch) -> list[tuple]:
    """(rule index, lead σ, drawn σ) of every train forward, in order."""
    from downscale_plugin.hosts.kohya.run import DownscaleRun

    seen: list[tuple] = []
    on_step = DownscaleRun.on_step

    def spy(self, step, decision, *rest, **kw):
        seen.append((decision.rule_index, decision.lead, tuple(decision.sigmas.reshape(-1).tolist())))
        return on_step(self, step, decision, *rest, **kw)

    monkeypatch.setattr(DownscaleRun, "on_step", spy)
    return seen


def test_a_resumed_auto_run_routes_by_the_certified_windows_without_certifying_again(tmp_path, monkeypatch, steps):  # noqa: F811
    """Accumulation 2, batch 4: the probes are in at forward 4 (step 2); a state at step 8. Resumed there, the run
    takes the state's certified routes from its first forward and routes exactly as the uninterrupted run did."""
    base = ("--resolution", RES, "--train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_train_steps", "24",
            "--dataset_size", "192", "--seed", "5")  # fmt: skip
    config = auto_config(tmp_path, map_margin=0.99)
    seen = _decisions(monkeypatch)
    first = run_double("flux", *base, "--save_state", "--save_every_n_steps", "8", "--output_dir", str(tmp_path / "a"), downscale=config)
    reference = list(seen)
    certified = first.last_run.network.downscale_run.cfg.routes
    assert certified and len(reference) == 48 and any(rule >= 0 for rule, _, _ in reference[4:16])
    seen.clear()
    calls = steps("flux")
    state = tmp_path / "a" / "last-step00000008-state"
    resumed = run_double(
        "flux", *base, "--resume", str(state), "--skip_until_initial_step", "--output_dir", str(tmp_path / "b"), downscale=config
    ).last_run
    run = resumed.network.downscale_run
    assert run.cfg.routes == certified and [shape for shape, _ in calls if shape[0] == 1] == []  # no probe draw ran
    assert len(seen) == 16 and seen == reference[16:32]  # the host's resume arithmetic: forward 16 on, 16 forwards (8 steps) left
    with safe_open(str(tmp_path / "b" / "last.safetensors"), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["ss_downscale_map"])["method"] == "certify" and json.loads(meta["ss_downscale_counts"])["forwards"] == 32


def test_costs_are_in_the_runs_flop_units_and_a_run_that_cannot_pay_trains_native(tmp_path, monkeypatch, caplog, steps):  # noqa: F811
    """Budget, spend and saving in one unit, the run's FLOP model: a route pass at 8x8 of 16x16 costs the model's 0.91,
    not the token fraction 0.25. A safe verdict then costs 16 × 2 × 1.91 = 61.2, and no bin's window could save that
    back over the run's 176 later passes (176 × 0.09 × its mass): by default the run trains native from the start and
    says what would pay; "refuse" stops at start with the same words; "buy" certifies all the same, in FLOP units."""
    monkeypatch.setattr(AutoSession, "pass_fraction", FLOP_FRACTION)
    bought = run_double("flux", *ARGV, downscale=auto_config(tmp_path / "buy", map_margin=0.99)).last_run
    model = bought.network.downscale_run.totals.flop_model
    fraction = model.flops(16) / model.flops(64)  # Flux's patch 2: 8x8 → 16 image tokens, 16x16 → 64
    blob = json.loads((tmp_path / "buy" / "auto" / "certify.json").read_text())
    assert blob["cost"]["route_pass_cost"]["latent_0.5"] == pytest.approx(fraction, abs=1e-6) and fraction > 0.5
    assert blob["cost"]["native_step_equivalents"] > 0 and blob["plan"]["horizon"] is None
    calls = steps("flux")
    with caplog.at_level(logging.INFO):
        run = run_double("flux", *ARGV, downscale=auto_config(tmp_path / "skip", map_margin=0.99, certify_unpaid="skip")).last_run
    assert run.network.downscale_run.cfg.routes == () and not (tmp_path / "skip" / "auto").exists()
    assert [shape for shape, _ in calls if shape[0] == 1] == []  # no probe draw ran
    assert "no certification, the run trains native" in caplog.text and "costs 61.2 native-step equivalents" in caplog.text
    assert "What would pay: a run of at least" in caplog.text and "a windows file certified once on this model" in caplog.text
    assert "certification: none, the run trained native" in caplog.text  # the end summary
    with pytest.raises(HostError, match=r'certify_unpaid = "refuse": certification cannot pay in this run: the best test'):
        run_double("flux", *ARGV, downscale=auto_config(tmp_path / "refuse", map_margin=0.99, certify_unpaid="refuse"))
