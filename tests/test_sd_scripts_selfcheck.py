"""Host drift caught at start (``hosts/sd_scripts/selfcheck.py``), on the sd-scripts doubles.

Every piece the plugin re-implements agrees with the doubles (which follow the host exactly); a host
function patched to drift stops the run in ``prepare_network`` before its first step, and the startup
check and ``check --`` before any model loads, each naming the function and the revision the plugin
was checked against.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from host_modules import DOUBLES, run_double, trainer_class

from downscale_plugin.__main__ import main as cli_main
from downscale_plugin.hosts.kohya.selfcheck import drift_problems
from downscale_plugin.hosts.sd_scripts import selfcheck
from downscale_plugin.hosts.sd_scripts.facts import BY_ARCH, TRAINER_ARCHS, HostError
from downscale_plugin.hosts.sd_scripts.startup import command_line_drift
from downscale_plugin.hosts.sd_scripts.trainer import make_family

pytestmark = pytest.mark.usefixtures("host_doubles", "cheap_plan")

ROUTED = {"routes": [{"scale": 0.5, "sigma_min": 0.0}]}
RES = "128,128"
CHECKED = "the plugin was checked against sd-scripts 48d368fa"


def _startup_check():
    """This checkout's startup file (an installed ``.pth`` may have imported another one first)."""
    spec = importlib.util.spec_from_file_location("this_startup_check", Path(__file__).parent.parent / "downscale_plugin_startup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_args(record, *argv: str):
    """The args the record's training script parses from ``argv`` (its own parser: every option at its default)."""
    return importlib.import_module(record.script).setup_parser().parse_args(list(argv))


def _scaled_noise(monkeypatch, module_name: str) -> None:
    """The host's noisy input with the noise scaled by 1.01 (σ, timesteps and draws unchanged)."""
    module = importlib.import_module(module_name)
    original = module.get_noisy_model_input_and_timesteps

    def drifted(*args):
        *head, noise, device, dtype = args
        return original(*head, noise * 1.01, device, dtype)

    monkeypatch.setattr(module, "get_noisy_model_input_and_timesteps", drifted)


@pytest.mark.parametrize("record", TRAINER_ARCHS, ids=lambda r: r.arch)
def test_every_piece_agrees_with_the_host(record):
    family = make_family(record)
    checks = selfcheck.standalone(record, family.module, run_args(record))
    assert len(checks) >= 2
    before = torch.get_rng_state()
    assert drift_problems(checks, selfcheck.CHECKED_AGAINST) == []
    assert torch.equal(torch.get_rng_state(), before)  # every compare ran in a fork


@pytest.mark.parametrize(
    ("arch", "module"), [("flux", "library.flux_train_utils"), ("lumina", "library.lumina_train_util"), ("sd3", "library.sd3_train_utils")]
)
def test_a_drifted_noisy_input_stops_the_run_before_its_first_step(arch, module, monkeypatch):
    _scaled_noise(monkeypatch, module)
    with pytest.raises(HostError) as raised:
        run_double(arch, "--resolution", RES, "--max_train_steps", "2", downscale=ROUTED)
    text = str(raised.value)
    assert f"{module}.get_noisy_model_input_and_timesteps no longer matches the routed step's noisy input" in text
    assert CHECKED in text and "noisy input (ip_noise_gamma None, torch.float32): max |host − plugin| = " in text


def test_a_drifted_mu_table_names_the_law_and_the_grid(monkeypatch):
    """Lumina's ``nextdit_shift`` μ read off another line (a host change of ``get_lin_function``'s ends)."""
    module = importlib.import_module("library.lumina_train_util")
    original = module.get_noisy_model_input_and_timesteps

    def drifted(args, scheduler, latents, noise, device, dtype):
        noisy, t, sigmas = original(args, scheduler, latents, noise, device, dtype)
        if args.timestep_sampling == "nextdit_shift":
            sigmas = sigmas**1.05
        return noisy, t, sigmas

    monkeypatch.setattr(module, "get_noisy_model_input_and_timesteps", drifted)
    problems = drift_problems(selfcheck.standalone(BY_ARCH["lumina"], module, run_args(BY_ARCH["lumina"])), selfcheck.CHECKED_AGAINST)
    assert len(problems) == 1, problems
    assert "the exact σ law of timestep_sampling=nextdit_shift (sigma.SigmaSampler)" in problems[0]
    assert "σ at latent 32x32: max |host − plugin|" in problems[0] and CHECKED in problems[0]


def test_ddpm_drifts_are_refused(monkeypatch):
    """SD1/SDXL: ``get_timesteps`` drawing another law, and a noise path that no longer reaches it."""
    train_util = importlib.import_module("library.train_util")
    original = train_util.get_timesteps
    monkeypatch.setattr(
        train_util, "get_timesteps", lambda lo, hi, b, device: original(lo, hi + 1, b, device) if lo < hi else original(lo, hi, b, device)
    )
    with pytest.raises(HostError, match=r"library\.train_util\.get_timesteps no longer matches the DDPM law's uniform atoms"):
        run_double("sdxl", "--resolution", RES, "--max_train_steps", "2", downscale=ROUTED)
    monkeypatch.setattr(train_util, "get_timesteps", original)
    noise_path = train_util.get_noise_noisy_latents_and_timesteps
    monkeypatch.setattr(
        train_util,
        "get_noise_noisy_latents_and_timesteps",
        lambda args, scheduler, latents: _inlined(noise_path, original, args, scheduler, latents),
    )
    sdxl = BY_ARCH["sdxl"]
    problems = drift_problems(selfcheck.pieces(make_family(sdxl), selfcheck._DdpmScheduler(), run_args(sdxl)), selfcheck.CHECKED_AGAINST)
    assert len(problems) == 1 and "get_noise_noisy_latents_and_timesteps no longer matches the routed step's timestep replay" in problems[0]


def _inlined(noise_path, get_timesteps, args, scheduler, latents):
    """The host's noise path with ``get_timesteps`` bound at definition instead of looked up at call time."""
    globals_ = dict(noise_path.__globals__, get_timesteps=get_timesteps)
    inlined = type(noise_path)(noise_path.__code__, globals_, noise_path.__name__, noise_path.__defaults__, noise_path.__closure__)
    return inlined(args, scheduler, latents)


def test_the_startup_check_and_check_refuse_a_drifted_host_before_any_model_loads(monkeypatch, capsys):
    command = [f"{DOUBLES}/flux_train_network.py", "--network_module", "downscale_plugin", "--network_args", "ds_routes=1024:768@0.65-0.95"]
    startup = _startup_check()
    assert startup.report(command) is None
    assert cli_main(["check", "--", *command]) == 0
    _scaled_noise(monkeypatch, "library.flux_train_utils")
    report = startup.report(command)
    assert "library.flux_train_utils.get_noisy_model_input_and_timesteps no longer matches" in report and CHECKED in report
    assert "stopped before the trainer loads any model" in report
    capsys.readouterr()
    assert cli_main(["check", "--", *command]) == 2
    assert "library.flux_train_utils.get_noisy_model_input_and_timesteps no longer matches" in capsys.readouterr().err


def test_a_script_of_another_host_is_left_alone():
    assert command_line_drift(["wan_train_network.py", "--network_module", "downscale_plugin"]) == []


@pytest.mark.parametrize("options", [(), ("--multires_noise_iterations", "3", "--noise_offset", "0.1", "--noise_offset_random_strength")])
def test_sd_noise_options_that_draw_python_random_pass_the_preamble_check(options):
    """SD1/SDXL's multires noise draws Python's random before σ: both sides of the check start from the same state."""
    run_double("sdxl", "--resolution", RES, "--max_train_steps", "2", *options, downscale=ROUTED)


@pytest.mark.parametrize("arch", ["flux", "sdxl"])
def test_a_trainer_drawing_before_its_sigma_draw_is_refused(arch):
    """The trainer's step drawing once more before its σ draw (the dry run would predict another σ)."""
    base = trainer_class(arch)

    class Drifted(base):
        def get_noise_pred_and_target(self, *args, **kwargs):
            torch.rand(1)
            return super().get_noise_pred_and_target(*args, **kwargs)

    with pytest.raises(HostError) as raised:
        run_double(arch, "--resolution", RES, "--max_train_steps", "2", downscale=ROUTED, trainer=Drifted())
    text = str(raised.value)
    assert "Drifted.get_noise_pred_and_target no longer matches the dry run's RNG use before the σ draw" in text and CHECKED in text


# -- the run's own options, the two kinds of finding, host_check ------------------------------------

FLUX_COMMAND = [
    f"{DOUBLES}/flux_train_network.py",
    "--network_module",
    "downscale_plugin",
    "--network_args",
    "ds_routes=1024:768@0.65-0.95",
]
FLUX_SAMPLER = "library.flux_train_utils.get_noisy_model_input_and_timesteps"


def _added_option(monkeypatch) -> None:
    """A newer host: one more option (``--noise_scale``, neutral default 1.0) that its noise function reads as ``args.noise_scale``."""
    train_network = importlib.import_module("train_network")
    module = importlib.import_module("library.flux_train_utils")
    parser, original = train_network.setup_parser, module.get_noisy_model_input_and_timesteps

    def newer_parser():
        p = parser()
        p.add_argument("--noise_scale", type=float, default=1.0)
        return p

    monkeypatch.setattr(train_network, "setup_parser", newer_parser)
    monkeypatch.setattr(
        module, "get_noisy_model_input_and_timesteps", lambda a, s, x, n, dev, dt: original(a, s, x, n * a.noise_scale, dev, dt)
    )


def test_a_host_that_added_an_option_at_a_neutral_default_passes_every_check(monkeypatch, capsys):
    """The check calls the host with the run's own args (the trainer's; before it, the script's parser on the
    command line), so an option the plugin never heard of is there; given a non-neutral value, the formula differs."""
    _added_option(monkeypatch)
    run_double("flux", "--resolution", RES, "--max_train_steps", "2", downscale=ROUTED)
    assert command_line_drift(FLUX_COMMAND) == []
    assert _startup_check().report(FLUX_COMMAND) is None
    assert cli_main(["check", "--", *FLUX_COMMAND]) == 0
    changed = command_line_drift([*FLUX_COMMAND, "--noise_scale", "1.01"])
    assert changed and all(f"{FLUX_SAMPLER} no longer matches" in p and "the host's result differs" in p for p in changed)
    with pytest.raises(HostError, match="the host's result differs"):
        run_double("flux", "--resolution", RES, "--max_train_steps", "2", "--noise_scale", "1.01", downscale=ROUTED)


def test_a_host_function_the_probe_cannot_call_is_told_apart_from_a_changed_formula(monkeypatch):
    module = importlib.import_module("library.flux_train_utils")
    original = module.get_noisy_model_input_and_timesteps
    monkeypatch.setattr(module, "get_noisy_model_input_and_timesteps", lambda a, s, x, n, dev, dt, extra: original(a, s, x, n, dev, dt))
    problems = command_line_drift(FLUX_COMMAND)
    assert problems and all(p.startswith(f"the plugin's probe could not call {FLUX_SAMPLER} to check ") for p in problems)
    assert "(TypeError: " in problems[0] and "whether its formula still matches is unknown" in problems[0] and CHECKED in problems[0]
    assert not any("no longer matches" in p for p in problems)
    monkeypatch.setattr(module, "get_noisy_model_input_and_timesteps", original)
    _scaled_noise(monkeypatch, "library.flux_train_utils")
    problems = command_line_drift(FLUX_COMMAND)
    assert problems and not any("could not call" in p for p in problems)


def test_a_broken_script_parser_is_the_probe_failing_not_drift(monkeypatch):
    monkeypatch.setattr(importlib.import_module("flux_train_network"), "setup_parser", lambda: 1 / 0)
    (problem,) = command_line_drift(FLUX_COMMAND)
    assert problem.startswith("the plugin's probe could not call flux_train_network.setup_parser to check the run's options")
    assert "(ZeroDivisionError: division by zero)" in problem


def test_a_command_line_the_script_cannot_parse_is_left_to_the_script(monkeypatch):
    """Without the run's options there is nothing to call the host with; the script's own parser stops that command
    before any model loads and says why."""
    _scaled_noise(monkeypatch, "library.flux_train_utils")
    assert command_line_drift(FLUX_COMMAND)
    assert command_line_drift([*FLUX_COMMAND, "--no_such_option"]) == []


def test_host_check_warn_trains_on_logs_and_records_the_findings(monkeypatch, tmp_path, caplog, capsys):
    _scaled_noise(monkeypatch, "library.flux_train_utils")
    warn = ["--network_args", "ds_routes=1024:768@0.65-0.95", "ds_host_check=warn"]
    command = [*FLUX_COMMAND[:3], *warn]
    assert _startup_check().report(command) is None
    assert cli_main(["check", "--", *command]) == 0
    caplog.clear()
    run = run_double(
        "flux", "--resolution", RES, "--max_train_steps", "2", "--output_dir", str(tmp_path), downscale={**ROUTED, "host_check": "warn"}
    ).last_run
    assert run.global_step == 2
    assert (
        f"{FLUX_SAMPLER} no longer matches the routed step's noisy input" in caplog.text
        and 'host_check = "warn": training on' in caplog.text
    )
    from safetensors import safe_open

    with safe_open(str(tmp_path / "last.safetensors"), "pt") as f:
        recorded = json.loads(f.metadata()["ss_downscale_host_check"])
    assert recorded and all(f"{FLUX_SAMPLER} no longer matches" in p for p in recorded)


def test_without_drift_the_lora_carries_no_host_check_record(tmp_path):
    run_double(
        "flux", "--resolution", RES, "--max_train_steps", "2", "--output_dir", str(tmp_path), downscale={**ROUTED, "host_check": "warn"}
    )
    from safetensors import safe_open

    with safe_open(str(tmp_path / "last.safetensors"), "pt") as f:
        assert "ss_downscale_host_check" not in f.metadata()
