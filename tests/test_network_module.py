"""``downscale_plugin`` as sd-scripts' ``--network_module``, on the host doubles (CI; no sd-scripts).

The factories return the inner module's own network object (with ``prepare_network`` attached in a
run, chained to an inner one), only delegate for inference and ``--base_weights``, honour
``--dim_from_weights``, save the inner's exact weights plus ``ss_downscale_*`` metadata, read T and
the resume offset from the loop, and fail early with errors that say what is wrong.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import types
from pathlib import Path

import pytest
import torch
from host_modules import ARCHS, double_args, explicit_hook_class, run_double, trainer_class
from safetensors import safe_open
from safetensors.torch import load_file

import downscale_plugin
from downscale_plugin.arch import get_arch
from downscale_plugin.config import ConfigError, load_config, read_plugin_toml
from downscale_plugin.hosts.kohya.conventions import config_from_training_toml
from downscale_plugin.hosts.sd_scripts import start as sd_scripts_start
from downscale_plugin.hosts.sd_scripts.facts import KNOWN_INNERS, HostError
from downscale_plugin.hosts.sd_scripts.trainer import find_trainer

ALL_ROUTED = {"routes": [{"scale": 0.5, "sigma_min": 0.0}]}
RES = ("--resolution", "128,128")


pytestmark = pytest.mark.usefixtures("host_doubles", "cheap_plan")


def _inner(name: str):
    return sys.modules.get(name) or __import__(name, fromlist=["create_network"])


@pytest.mark.parametrize("arch", list(ARCHS))
def test_create_network_returns_the_auto_detected_inner_network_itself(arch):
    run = run_double(arch, *RES, "--max_train_steps", "1", downscale=ALL_ROUTED).last_run
    plain = run_double(arch, *RES, "--max_train_steps", "1", network_module=ARCHS[arch][2]).last_run
    assert type(run.network) is type(plain.network)
    assert run.network.downscale_run.inner == ARCHS[arch][2]
    assert "prepare_network" in vars(run.network)
    assert run.network.created_with == plain.network.created_with == {"neuron_dropout": None, "dropout": None}


def test_lycoris_inner_gets_the_rest_of_network_args_and_the_plugin_keeps_its_own():
    argv = ("--network_args", "inner=lycoris.kohya", "ds_gate=strict", "algo=lokr", "preset=attn-mlp")
    run = run_double("flux", *RES, "--max_train_steps", "1", *argv, downscale=ALL_ROUTED).last_run
    assert type(run.network).__name__ == "LycorisNetworkKohya"
    assert run.network.created_with == {"algo": "lokr", "preset": "attn-mlp", "dropout": None, "neuron_dropout": None}
    assert run.network.downscale_run.cfg.gate == "strict" and run.network.downscale_run.inner == "lycoris.kohya"


def test_prepare_network_chains_the_inner_networks_own(monkeypatch):
    seen = []
    lora = _inner("networks.lora")

    class WithPrepare(lora.LoRANetwork):
        def prepare_network(self, args):
            seen.append(("inner", "downscale_run" in vars(self)))

    module = types.ModuleType("inner_with_prepare")
    module.create_network = lambda m, d, a, vae, te, unet, neuron_dropout=None, **kw: WithPrepare(unet, m, d or 4, a or 1.0, **kw)
    module.create_network_from_weights = lora.create_network_from_weights
    monkeypatch.setitem(sys.modules, "inner_with_prepare", module)
    run = run_double("sd3", *RES, "--max_train_steps", "1", "--network_args", "inner=inner_with_prepare", downscale=ALL_ROUTED).last_run
    assert seen == [("inner", False)]  # the inner's own ran first, before the plugin installed itself
    assert type(run.network) is WithPrepare and run.network.downscale_run.accounting.total_steps == 1


def test_outside_a_trainer_the_factories_only_delegate(tmp_path):
    flux = _inner("library.tiny_models").Flux()
    network = downscale_plugin.create_network(1.0, 4, 1.0, None, [], flux, dropout=None, ds_gate="strict", inner="networks.lora_flux")
    assert "prepare_network" not in vars(network) and network.created_with == {"neuron_dropout": None, "dropout": None}
    path = str(tmp_path / "lora.safetensors")
    network.save_weights(path, None, {})
    ours, sd = downscale_plugin.create_network_from_weights(1.0, path, None, [], flux, for_inference=True, ds_gate="strict")
    theirs, _ = _inner("networks.lora_flux").create_network_from_weights(1.0, path, None, [], flux, for_inference=True)
    assert type(ours) is type(theirs) and "prepare_network" not in vars(ours) and ours.created_with == theirs.created_with
    assert sd.keys() == load_file(path).keys()


def test_base_weights_merge_inside_a_run_is_pure_delegation(tmp_path):
    base = run_double("flux", *RES, "--max_train_steps", "2", "--output_dir", str(tmp_path), network_module="networks.lora_flux")
    path = str(tmp_path / "last.safetensors")
    argv = (*RES, "--max_train_steps", "1", "--base_weights", path)
    plain = run_double("flux", *argv, network_module="networks.lora_flux").last_run
    run = run_double("flux", *argv, "--network_args", "inner=networks.lora_flux", downscale=ALL_ROUTED).last_run
    assert torch.equal(run.unet.proj.weight, plain.unet.proj.weight)  # merged identically into the base model
    assert not torch.equal(run.unet.proj.weight, base.last_run.unet.proj.weight)


def test_dim_from_weights_network_is_routed(tmp_path):
    run_double("lumina", *RES, "--max_train_steps", "1", "--output_dir", str(tmp_path), network_module="networks.lora_lumina")
    argv = (*RES, "--max_train_steps", "2", "--dim_from_weights", "--network_weights", str(tmp_path / "last.safetensors"))
    run = run_double("lumina", *argv, downscale=ALL_ROUTED).last_run
    assert "prepare_network" in vars(run.network)
    assert [c["shape"] for c in run.unet.calls] == [(1, 4, 8, 8)] * 2


def test_saved_file_is_the_inner_weights_with_downscale_metadata(tmp_path):
    run = run_double("anima", *RES, "--max_train_steps", "3", "--seed", "4", "--output_dir", str(tmp_path), downscale=ALL_ROUTED).last_run
    path = tmp_path / "last.safetensors"
    plain_path = str(tmp_path / "plain.safetensors")
    type(run.network).save_weights(run.network, plain_path, None, {"ss_steps": "3"})  # the inner's own save
    ours, theirs = load_file(path), load_file(plain_path)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta["ss_network_module"] == "downscale_plugin" and meta["ss_downscale_inner"] == "networks.lora_anima"
    assert meta["ss_downscale_arch"] == "anima" and meta["ss_downscale_gate"] == "coupled" and meta["ss_downscale_seed"] == "4"
    assert json.loads(meta["ss_downscale_routes"]) == [{"scale": 0.5, "sigma_min": 0.0}]
    counts = json.loads(meta["ss_downscale_counts"])
    assert counts["forwards"] == 3 and counts["routes"] == {"r0 x0.5": 1.0, "native": 0.0} and counts["token_saving"] == 0.75
    loaded, _ = _inner("networks.lora_anima").create_network_from_weights(1.0, str(path), None, [], run.unet)
    assert not loaded.load_state_dict(ours, strict=True).missing_keys  # loadable by the inner module


def test_no_metadata_adds_no_downscale_keys(tmp_path):
    run_double("flux", *RES, "--max_train_steps", "1", "--no_metadata", "--output_dir", str(tmp_path), downscale=ALL_ROUTED)
    with safe_open(str(tmp_path / "last.safetensors"), "pt") as f:
        assert not any(k.startswith("ss_downscale") for k in f.metadata() or {})


def test_total_forwards_and_resume_offset_are_read_from_the_loop():
    # 4 batches per epoch, 2 epochs: the trainer sets max_train_steps = 8 after prepare_network. --initial_step 5
    # with --skip_until_initial_step: the host starts at epoch 2 (5 // 4), skips 1 batch, global_step 1, and trains
    # 3 forwards, absolute 6..8. late:0.5 fires on forwards 5..8: all three route only if T and the offset are read.
    downscale = {"routes": [{"scale": 0.5, "sigma_min": 0.0, "span": "late:0.5"}]}
    argv = ("--max_train_epochs", "2", "--initial_step", "5", "--skip_until_initial_step")
    run = run_double("sd3", *RES, *argv, downscale=downscale).last_run
    assert run.args.max_train_steps == 8 and run.global_step == 4
    assert [c["shape"] for c in run.unet.calls] == [(1, 4, 8, 8)] * 3
    assert run.network.downscale_run.router.resume_offset == 5


# -- the run's patches: all off at its end ------------------------------------------------------------------------

LAMBDA = {**ALL_ROUTED, "direction_loss_weight": 0.5}  # process_batch is wrapped too
MAP = {"mode": "map", "map_ratios": [0.5], "map_bins": "0,0.5,1", "map_draws": 2, "map_images": 2}
# id → (argv, config, the trainer has the explicit call points, the run ends in SystemExit)
WHOLE_RUNS = {
    "train": (("--max_train_steps", "2"), LAMBDA, False, False),
    "train, last state": (("--max_train_steps", "2", "--save_state"), LAMBDA, False, False),  # off after the last save
    "explicit hook": (("--max_train_steps", "2"), LAMBDA, True, False),
    "map, then train": (("--max_train_steps", "3"), {**MAP, "after_map": "train"}, False, False),  # the map's wrap off mid-run
    "map, then stop": (("--max_train_steps", "3", "--save_state"), MAP, False, True),  # no last save comes
    # one epoch of a picture under two names: the start counts 2 images, the probes skip the repeat, the run ends at 1
    "run ends before its map": (
        ("--max_train_steps", "9", "--max_train_epochs", "1", "--dataset_size", "2", "--distinct_images", "1"),
        MAP,
        False,
        False,
    ),
}


def _plugins(value) -> bool:
    """Whether ``value`` is the plugin's: a wrapper it defined, a bound hook of its run, the run itself."""
    return (getattr(value, "__module__", None) or type(value).__module__).startswith("downscale_plugin.")


def _plugin_state(trainer, network, accelerator) -> dict[str, list[str]]:
    """The plugin's instance attributes on each object, and its accelerate state hooks."""
    state = {
        name: sorted(k for k, v in vars(obj).items() if _plugins(v))
        for name, obj in zip(("trainer", "network", "accelerator"), (trainer, network, accelerator), strict=True)
    }
    hooks = [*accelerator._save_model_state_pre_hook.values(), *accelerator._load_model_state_pre_hook.values()]
    state["state hooks"] = [h.__qualname__ for h in hooks if _plugins(h)]
    return state


@pytest.mark.parametrize(("argv", "config", "explicit", "stops"), WHOLE_RUNS.values(), ids=WHOLE_RUNS.keys())
def test_a_whole_run_leaves_trainer_network_and_accelerator_as_it_found_them(argv, config, explicit, stops, tmp_path, monkeypatch):
    """Every patch of the run (step hook or explicit call points, loss, save, end, state hooks, the map's
    process_batch) is in the run's record and off at its end; ``network.downscale_run`` stays for inspection."""
    seen = []
    start = sd_scripts_start.start

    def spy(network, *rest):  # the plugin's state just before the run installs itself, and just after
        ctx = find_trainer()
        objects = (ctx.trainer, network, ctx.accelerator)
        seen.extend([objects, _plugin_state(*objects)])
        run = start(network, *rest)
        seen.append(_plugin_state(*objects))
        return run

    monkeypatch.setattr(sd_scripts_start, "start", spy)
    argv = (*RES, *argv, "--output_dir", str(tmp_path / "out"))
    config = {**config, "map_out": str(tmp_path / "map")} if "mode" in config else config
    trainer = (explicit_hook_class if explicit else trainer_class)("flux")()
    with pytest.raises(SystemExit) if stops else contextlib.nullcontext():
        run_double("flux", *argv, downscale=config, trainer=trainer)
    objects, before, installed = seen
    assert before == {"trainer": [], "network": ["prepare_network"], "accelerator": [], "state hooks": []}
    assert installed["trainer"] and installed["accelerator"] == ["end_training"] and len(installed["state hooks"]) == 2
    assert _plugin_state(*objects) == {**before, "network": ["downscale_run", "prepare_network"]}


# -- resume: spans, the lead and spread coins keyed to the absolute forward index; counts across states -------------

# B = 2 (the coupled gate draws a lead keyed to the index), a window that needs the lead, and spread coins.
RESUME_ROUTES = {"routes": [{"scale": 0.5, "sigma_min": 0.5, "span": "spread:0.5"}]}
# accumulation → (argv of the uninterrupted run that saves states, forwards it runs); batches per epoch L = 16 and 8.
UNINTERRUPTED = {
    2: (("--dataset_size", "32", "--max_train_steps", "12", "--gradient_accumulation_steps", "2", "--save_every_n_steps", "3"), 24),
    1: (("--dataset_size", "16", "--max_train_steps", "16", "--save_every_n_steps", "5"), 16),
}


def _recording(patch: pytest.MonkeyPatch) -> list[tuple]:
    """(rule index, lead σ, drawn σ) of every train forward, in order."""
    from downscale_plugin.hosts.kohya.run import DownscaleRun

    seen: list[tuple] = []
    on_step = DownscaleRun.on_step

    def spy(self, step, decision, *rest, **kw):
        seen.append((decision.rule_index, decision.lead, tuple(decision.sigmas.reshape(-1).tolist())))
        return on_step(self, step, decision, *rest, **kw)

    patch.setattr(DownscaleRun, "on_step", spy)
    return seen


def _resume_run(accumulation: int, *argv: str, out: Path):
    base, _ = UNINTERRUPTED[accumulation]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sd_scripts_start, "PLAN_MC_SAMPLES", 256)
        seen = _recording(patch)
        run = run_double("flux", *RES, "--train_batch_size", "2", *base, *argv, "--output_dir", str(out), downscale=RESUME_ROUTES)
    return seen, run.last_run


@pytest.fixture(scope="module")
def uninterrupted(host_doubles, tmp_path_factory):
    """Per accumulation: the uninterrupted run's decisions and its output dir (a state every few steps)."""
    runs = {}
    for accumulation, (_, forwards) in UNINTERRUPTED.items():
        out = tmp_path_factory.mktemp(f"uninterrupted{accumulation}")
        seen, run = _resume_run(accumulation, "--save_state", out=out)
        assert len(seen) == forwards
        assert len(run.accelerator._save_model_state_pre_hook) == 1  # off after the last state and weights: the host's own left
        runs[accumulation] = (seen, out)
    return runs


def _counts(out: Path) -> dict:
    with safe_open(str(out / "last.safetensors"), "pt") as f:
        return json.loads(f.metadata()["ss_downscale_counts"])


# (id, accumulation, argv, absolute index of forward 0, this run's forwards, σ replayed too (RNG restored), forwards restored)
RESUME_PATHS = [
    # L 16, A 2, state at step 3: S = 6, epoch_to_start 6 // 8 = 0, 6 batches skipped, global_step 6 → 12 forwards
    ("resume+skip, A 2", 2, ("--resume", "step3", "--skip_until_initial_step"), 6, 12, True, 6),
    # --resume alone: epoch_to_start 3 // 8 = 0 from its first batch, global_step 0 → 24 forwards
    ("resume, A 2", 2, ("--resume", "step3"), 6, 24, True, 6),
    # L 8, A 1, state at step 10: epoch_to_start 1, 2 batches skipped, global_step 2; the epochs end after 6 forwards
    ("resume+skip, A 1", 1, ("--resume", "step10", "--skip_until_initial_step"), 10, 6, True, 10),
    ("resume, A 1", 1, ("--resume", "step10"), 10, 8, True, 10),  # epoch 2 from its first batch
    ("initial_step+skip, A 2", 2, ("--initial_step", "3", "--skip_until_initial_step"), 6, 12, False, 0),
    ("initial_epoch+skip, A 1", 1, ("--initial_epoch", "2", "--skip_until_initial_step"), 8, 8, False, 0),  # s = 1 × ⌈8 / 1⌉
    ("initial_step, A 1", 1, ("--initial_step", "5"), 5, 16, False, 0),  # informative: epoch 1, global_step 0
]


@pytest.mark.parametrize(
    ("accumulation", "argv", "offset", "forwards", "replayed", "restored"), [p[1:] for p in RESUME_PATHS], ids=[p[0] for p in RESUME_PATHS]
)
def test_resumed_run_routes_by_the_absolute_forward_index(
    uninterrupted, tmp_path, accumulation, argv, offset, forwards, replayed, restored
):
    """Every resume path of the host's loop: forward n of the resumed run routes as the uninterrupted run's forward
    offset + n (same lead, same spread coin, so the same route; with the state's RNG also the same σ), the counts
    continue from the state's, and the run's state hooks are off the accelerator at the end."""
    reference, states = uninterrupted[accumulation]
    argv = tuple(str(states / f"last-{a[:4]}{int(a[4:]):08d}-state") if a.startswith("step") else a for a in argv)
    seen, run = _resume_run(accumulation, *argv, out=tmp_path)
    assert len(seen) == forwards and run.network.downscale_run.router.resume_offset == offset
    overlap = list(zip(seen, reference[offset:], strict=False))
    assert len(overlap) >= min(forwards, 6)
    assert [(rule, lead) for rule, lead, _ in seen[: len(overlap)]] == [
        (rule, lead) for rule, lead, _ in reference[offset : offset + len(overlap)]
    ]
    if replayed:
        assert seen[: len(overlap)] == reference[offset : offset + len(overlap)]
    counts = _counts(tmp_path)
    history = reference[:restored] + seen
    assert counts["forwards"] == restored + forwards
    assert counts["routes"]["r0 x0.5"] == pytest.approx(sum(rule == 0 for rule, _, _ in history) / len(history))
    accelerator = run.accelerator
    assert len(accelerator._save_model_state_pre_hook) == len(accelerator._load_model_state_pre_hook) == 1  # the host's own


def test_resume_is_stated_in_the_start_banner_and_at_the_first_step(uninterrupted, tmp_path, caplog, capsys):
    state = uninterrupted[2][1] / "last-step00000003-state"
    with caplog.at_level(logging.INFO, logger="downscale_plugin"):
        _resume_run(2, "--resume", str(state), "--skip_until_initial_step", out=tmp_path)
    text = caplog.text + capsys.readouterr().out  # the banner may be printed rather than logged
    assert f"resume (--resume {state} --skip_until_initial_step): spans, the coupled gate's step draws and spread coins" in text
    assert "keyed to the absolute forward index s × 2 + n (n: this run's forward), s = 3 (train_state.json current_step)" in text
    assert "absolute forward index = 3 × 2 + n = 6 + n (initial step 3 from train_state.json current_step 3)" in text
    assert "restored the counts of 6 earlier train forwards" in text


@pytest.mark.parametrize(
    ("argv", "state", "batches", "processes", "expected"),
    [
        # (initial step, absolute index of forward 0, epoch_to_start, batches skipped in it, global_step at the first step)
        (("--gradient_accumulation_steps", "2", "--skip_until_initial_step"), 3, 16, 1, (3, 6, 0, 6, 6)),  # the run
        (("--gradient_accumulation_steps", "2", "--skip_until_initial_step"), 3, 4, 1, (3, 6, 3, 0, -6)),  # 4 batches: 3 epochs
        (("--gradient_accumulation_steps", "2"), 3, 16, 1, (3, 6, 0, 0, 0)),  # --resume alone
        (("--skip_until_initial_step",), 10, 8, 1, (10, 10, 1, 2, 2)),
        (("--initial_epoch", "3", "--gradient_accumulation_steps", "2"), None, 16, 2, (8, 16, 1, 0, 0)),  # 2 × ⌈16 / 2 / 2⌉
        (("--initial_step", "0", "--skip_until_initial_step"), 5, 8, 1, (0, 0, 0, 0, 0)),  # the host ignores the state's 5
        ((), None, 8, 1, (0, 0, 0, 0, 0)),
    ],
)
def test_host_start_is_the_hosts_arithmetic(argv, state, batches, processes, expected):
    from downscale_plugin.hosts.sd_scripts.resume import HostStart

    args = double_args("flux", *argv)
    start = HostStart.of(args, state, batches, processes)
    assert (start.initial_step, start.offset, start.epoch_to_start, start.skipped, start.global_step) == expected
    assert (start.warning() is not None) == (batches == 4)  # only there the host leaves the uninterrupted data order


def test_counts_are_saved_in_every_state_dir(uninterrupted):
    _, states = uninterrupted[1]
    saved = json.loads((states / "last-step00000010-state" / "downscale_plugin_counts.json").read_text())
    assert sum(saved["counts"]["steps"]) == 10 and saved["routes"] == RESUME_ROUTES["routes"]
    assert json.loads((states / "last-step00000010-state" / "train_state.json").read_text()) == {"current_epoch": 2, "current_step": 10}
    assert sum(json.loads((states / "last-state" / "downscale_plugin_counts.json").read_text())["counts"]["steps"]) == 16


def test_banner_summary_and_step_logs(caplog):
    with caplog.at_level(logging.INFO, logger="downscale_plugin"):
        run = run_double("flux", *RES, "--max_train_steps", "2", downscale=ALL_ROUTED).last_run
    text = caplog.text
    assert "flux (FluxNetworkTrainer), inner network networks.lora_flux, gate coupled" in text
    assert "library.flux_train_utils.get_noisy_model_input_and_timesteps (timestep_sampling=sigma)" in text
    assert "128x128" in text and "16x16" in text and "8x8" in text  # the bucket, its latent and its routed grid
    assert "downscale: 2 train forwards" in text
    logs = run.accelerator.trackers[0].records[-1][1]
    assert logs["downscale/frac/r0_x0.5"] == 1.0 and logs["downscale/steps"] == 2.0 and "loss/current" in logs
    assert "downscale/loss/r0_x0.5" in logs


def test_torch_compile_is_honoured_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="downscale_plugin"):
        run_double("flux", *RES, "--max_train_steps", "1", "--torch_compile", downscale=ALL_ROUTED)
    assert "recompiles" in caplog.text


def test_bad_config_fails_before_any_step():
    trainer = trainer_class("flux")()
    with pytest.raises(ConfigError, match="gate: 'sometimes' is not allowed"):
        run_double("flux", *RES, "--network_args", "ds_gate=sometimes", downscale=ALL_ROUTED, trainer=trainer)
    assert not hasattr(trainer, "last_run")


@pytest.mark.parametrize(("inner", "message"), [("networks.nope", "cannot import"), ("downscale_plugin", "this plugin itself")])
def test_unknown_inner_lists_the_choices(inner, message):
    with pytest.raises(HostError, match=message) as err:
        run_double("flux", *RES, "--network_args", f"inner={inner}", downscale=ALL_ROUTED)
    assert all(choice in str(err.value) for choice in KNOWN_INNERS)


def test_unknown_denoiser_asks_for_inner():
    mystery = type("Mystery", (_inner("library.tiny_models").MMDiT,), {})
    trainer = trainer_class("sd3")()
    trainer.denoiser = mystery
    with pytest.raises(HostError, match="denoiser class 'Mystery'.*set inner=MODULE"):
        run_double("sd3", *RES, downscale=ALL_ROUTED, trainer=trainer)
    trainer = trainer_class("sd3")()
    trainer.denoiser = mystery
    run = run_double(
        "sd3", *RES, "--max_train_steps", "1", "--network_args", "inner=networks.lora_sd3", downscale=ALL_ROUTED, trainer=trainer
    )
    assert run.last_run.network.downscale_run.inner == "networks.lora_sd3"


@pytest.mark.parametrize(
    ("arch", "module", "symbol"),
    [("flux", "library.flux_train_utils", "get_noisy_model_input_and_timesteps"), ("sdxl", "library.train_util", "get_timesteps")],
)
def test_missing_hook_symbol_names_it_and_the_supported_revision(arch, module, symbol, monkeypatch):
    monkeypatch.delattr(sys.modules[module], symbol)
    with pytest.raises(HostError, match=f"{module}.{symbol} is missing.*48d368fa"):
        run_double(arch, *RES, downscale=ALL_ROUTED)


def test_missing_trainer_method_names_it():
    trainer = trainer_class("lumina")()
    trainer.generate_step_logs = None
    with pytest.raises(HostError, match="generate_step_logs.*48d368fa"):
        run_double("lumina", *RES, downscale=ALL_ROUTED, trainer=trainer)


def test_architecture_errors():
    with pytest.raises(HostError, match="config says 'sd3' but this run is 'chroma'"):
        run_double("chroma", *RES, "--network_args", "ds_arch=sd3", downscale=ALL_ROUTED)
    with pytest.raises(ConfigError, match="arch: 'sd5' is not allowed"):
        run_double("flux", *RES, downscale={**ALL_ROUTED, "arch": "sd5"})
    with pytest.raises(ValueError, match="'sd5' is not a known architecture"):
        get_arch("sd5")
    base = trainer_class("sd1")
    custom = type("CustomTrainer", (), {k: v for k, v in vars(base).items() if not k.startswith("__") or k == "__init__"})
    with pytest.raises(HostError, match="CustomTrainer is not one of sd-scripts' LoRA trainers"):
        run_double("sd1", *RES, downscale=ALL_ROUTED, trainer=custom())


@pytest.mark.parametrize("path", sorted((Path(__file__).parent.parent / "example_configs").glob("*.toml")), ids=lambda p: p.stem)
def test_example_configs_are_valid_and_say_where_their_windows_come_from(path):
    text = path.read_text()
    if path.stem.endswith(("_map", "_auto")):  # no windows of its own: it measures them on the user's model
        cfg, flat = config_from_training_toml(str(path))
        assert flat["network_module"] == "downscale_plugin" and cfg.mode == path.stem.rsplit("_", 1)[1] and cfg.map.out and not cfg.routes
        return
    assert "NOT certified" in text or "NOT on" in text  # provenance: measured elsewhere, not for latent-area downsampling
    if path.stem == "anima_seed_paper_windows":
        cfg = load_config(plugin_toml=read_plugin_toml(str(path)))
        assert [(r.label, r.sigma_min, r.sigma_max) for r in cfg.routes] == [("paper-768", 0.65, 0.95), ("paper-896", 0.5, None)]
        assert "VAE RE-ENCODED" in text and "anchor-sigma-lowres.md §0" in text and "§6.4" in text
        return
    cfg, flat = config_from_training_toml(str(path))
    assert flat["network_module"] == "downscale_plugin" and len(cfg.routes) == 2
