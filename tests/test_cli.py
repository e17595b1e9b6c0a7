import os
import subprocess
import sys
import textwrap

import pytest

from downscale_plugin import cli
from downscale_plugin.__main__ import load_commands, main
from downscale_plugin.sigma import SigmaSampler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAIN = """
    pretrained_model_name_or_path = "flux1-dev.safetensors"
    network_module = "downscale_plugin"
    network_args = ["ds_seed=7"]

    [training]
    train_batch_size = 4
    resolution = "1024,1024"
    timestep_sampling = "sigmoid"

    [plugins.downscale]
    gate = "coupled"

    [[plugins.downscale.routes]]
    route = "1024:768"
    sigma_min = 0.65
    sigma_max = 0.95

    [[plugins.downscale.routes]]
    route = "1024:896"
    sigma_min = 0.5
    span = "late:0.75"
"""

PLUGIN = """
    gate = "strict"
    arch = "flux"

    [[routes]]
    route = "1024:896"
    sigma_min = 0.5
"""


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_check_a_training_toml(tmp_path, capsys):
    code, out, err = _run(capsys, "check", "--config_file", _write(tmp_path, "train.toml", TRAIN))
    assert code == 0, err
    assert "config OK" in out and "network_args, plugins.downscale" in out
    assert "gate coupled" in out and "seed 7" in out
    assert "r0  1024:768      (0.65, 0.95)" in out
    assert "r1  1024:896      (0.5, 1]        late:0.75" in out
    assert len(out.splitlines()) < 25


def test_check_a_plugin_toml(tmp_path, capsys):
    code, out, _ = _run(capsys, "check", "--config", _write(tmp_path, "plugin.toml", PLUGIN))
    assert code == 0
    assert "gate strict" in out and "arch flux" in out and "1024:896" in out


def test_check_a_map_config(tmp_path, capsys):
    text = 'network_args = ["ds_map_draws=4"]\n[plugins.downscale]\nmode = "map"\nmap_out = "m"\nmap_ratios = [0.75]\n'
    code, out, err = _run(capsys, "check", "--config_file", _write(tmp_path, "t.toml", text))
    assert code == 0, err
    assert "mode map: map_out m, after_map stop, ratios 0.75," in out and "draws 4, images 8" in out and "r0 " not in out


def test_check_an_auto_config(tmp_path, capsys):
    text = 'network_args = ["ds_certify_budget=0.2"]\n[plugins.downscale]\nmode = "auto"\nmap_out = "c"\nmap_ratios = [0.75]\n'
    code, out, err = _run(capsys, "check", "--config_file", _write(tmp_path, "t.toml", text))
    assert code == 0, err
    assert "mode auto: map_out c, ratios 0.75," in out and "certify_budget 0.2 of the run's native compute, draws 4" in out
    assert "windows cache on;" in out
    code, out, err = _run(capsys, "check", "--config_file", _write(tmp_path, "off.toml", text + 'certify_reuse = "off"\n'))
    assert code == 0 and "windows cache off;" in out, err
    code, _, err = _run(capsys, "check", "--config_file", _write(tmp_path, "no.toml", text + "certify_reuse = false\n"))
    assert code == 2 and "certify_reuse: False is not allowed (allowed: on, refresh, off)" in err
    code, _, err = _run(capsys, "check", "--config_file", _write(tmp_path, "bad.toml", text + "map_images = 4\n"))
    assert code == 2 and 'map_images: not used with mode = "auto"' in err


def test_check_lists_every_problem_without_a_traceback(tmp_path, capsys):
    bad = """
        network_args = ["ds_gate=strictly"]

        [plugins.downscale]
        gaet = "coupled"

        [[plugins.downscale.routes]]
        route = "1024:768"
        sigma_min = 0.9
        sigma_max = 0.6

        [[plugins.downscale.routes]]
        route = "768:1024"
        sigma_min = 0.5
    """
    code, out, err = _run(capsys, "check", "--config_file", _write(tmp_path, "bad.toml", bad))
    assert code == 2 and out == ""
    assert "Traceback" not in err
    assert "gate: 'strictly' is not allowed" in err and "did you mean 'strict'" in err
    assert "gaet: unknown key; did you mean 'gate'" in err
    assert "routes[0].sigma_max: 0.6 must be greater than sigma_min" in err
    assert "routes[1].route" in err
    assert err.count("\n  - ") == 4


@pytest.mark.parametrize(
    "text,message",
    [
        ("[downscale]\ngate = 'strict'\n", "put the plugin's keys under [plugins.downscale]"),
        ("[plugins.downscale\n", "is not valid TOML"),
        ("[plugins.downscale]\nenable = true\n", "at least one route is required"),
    ],
)
def test_check_rejects(tmp_path, capsys, text, message):
    code, _, err = _run(capsys, "check", "--config_file", _write(tmp_path, "t.toml", text))
    assert code == 2 and message in err


def test_check_missing_file_and_missing_option(tmp_path, capsys):
    code, _, err = _run(capsys, "check", "--config", str(tmp_path / "nope.toml"))
    assert code == 2 and "file not found" in err
    code, _, err = _run(capsys, "check")  # no source: exit 2 with the problem, as for a bad config
    assert code == 2 and "give --config_file" in err


def test_check_a_whole_trainer_command_line(tmp_path, capsys):
    """``check -- SCRIPT ARGS``: the training TOML, with the command line over it, as the run reads them."""
    path = _write(tmp_path, "train.toml", TRAIN)
    code, out, err = _run(capsys, "check", "--", "flux_train_network.py", "--config_file", path, "--network_args", "ds_gate=strict")
    assert code == 0, err
    assert out.startswith(f"config OK: the command line with {path}") and "gate strict" in out and "seed the run's --seed" in out
    assert "r1  1024:896" in out  # the TOML's routes; the command line's network_args replaced the TOML's (ds_seed=7)


def test_check_a_launcher_command_line_without_the_toml_suffix(tmp_path, capsys):
    path = _write(tmp_path, "train.toml", TRAIN)
    argv = ["accelerate", "launch", "--config_file", "accelerate.yaml", "flux_train_network.py", "--config_file", path[: -len(".toml")]]
    code, out, err = _run(capsys, "check", "--", *argv)
    assert code == 0, err
    assert "seed 7" in out  # the TOML's network_args: the launcher's own --config_file is not the trainer's


def test_check_a_command_line_lists_every_problem(tmp_path, capsys):
    path = _write(tmp_path, "train.toml", TRAIN.replace('gate = "coupled"', 'gate = "fast"'))
    argv = ["flux_train_network.py", "--config_file", path, "--network_args", "ds_max_tries=many", "ds_routes=1024:768@a-0.95", "oops"]
    code, out, err = _run(capsys, "check", "--", *argv)
    assert code == 2 and not out
    assert err.startswith("downscale_plugin: 4 problem(s):"), err
    for fragment in (
        "network_args: 'oops' is not of the form key=value",
        "[network_args] ds_max_tries: 'many' is not an integer",
        "[network_args] ds_routes: entry '1024:768@a-0.95': sigma_min 'a' is not a number",
        "[plugins.downscale] gate: 'fast' is not allowed",
    ):
        assert fragment in err, (fragment, err)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["x.py", "--network_module", "networks.lora_flux"], "--network_module is 'networks.lora_flux'"),
        (["x.py", "--network_args", "ds_gate=strict"], "no --network_module"),
        (["x.py", "--network_module", "downscale_plugin", "--config_file", "nope.toml"], "config_file: file not found: nope.toml"),
        (["x.py", "--network_module"], "command line: argument --network_module: expected one argument"),
    ],
)
def test_check_a_command_line_that_does_not_train_with_the_plugin(capsys, argv, message):
    code, _, err = _run(capsys, "check", "--", *argv)
    assert code == 2 and message in err, err


def test_check_needs_one_source(tmp_path, capsys):
    code, _, err = _run(capsys, "check")
    assert code == 2 and "give --config_file TRAIN_TOML, --config PLUGIN_TOML or -- TRAINER COMMAND" in err
    path = _write(tmp_path, "train.toml", TRAIN)
    code, _, err = _run(capsys, "check", "--config_file", path, "--", "x.py", "--config_file", path)
    assert code == 2 and "not both" in err


def test_plan_prints_the_probabilities(tmp_path, capsys):
    s = SigmaSampler("sigmoid")
    deep, high = s.mass(0.65, 0.95, (128, 128)), s.mass(0.5, None, (128, 128))
    path = _write(tmp_path, "train.toml", TRAIN)
    code, out, err = _run(capsys, "plan", "--config_file", path, "--arch", "flux", "--max_train_steps", "1000")
    assert code == 0, err
    assert "timestep_sampling sigmoid (toml)" in out and "batch_size 4 (toml)" in out
    assert "one bucket 1024x1024" in out and "spans over 1000 train forwards" in out
    # late:0.75 on r1: the first quarter of the run has r0 alone.
    r1 = 0.75 * (high - deep)
    assert f"{100 * deep:.1f} %" in out and f"{100 * r1:.1f} %" in out
    assert f"{100 * (1 - deep - r1):.1f} %" in out
    assert "FLOPs saved" in out and "never routing" not in out


TWO_WINDOWS = """
    arch = "flux"

    [[routes]]
    route = "1024:512"
    sigma_min = 0.0
    sigma_max = 0.1

    [[routes]]
    route = "1024:512"
    sigma_min = 0.9
"""


def test_check_and_plan_take_a_route_with_a_low_and_a_high_window(tmp_path, capsys):
    """One route on (0, 0.1) (from σ > 0) and on (0.9, 1]: ``check`` lists both windows, ``plan`` gives each its own
    mass under the sampler and the route's saving on both."""
    path = _write(tmp_path, "plugin.toml", TWO_WINDOWS)
    code, out, err = _run(capsys, "check", "--config", path)
    assert code == 0, err
    assert "r0  1024:512      (0, 0.1)" in out and "r1  1024:512      (0.9, 1]" in out
    s = SigmaSampler("sigmoid")
    low, high = s.mass(0.0, 0.1, (128, 128)), s.mass(0.9, None, (128, 128))
    code, out, err = _run(capsys, "plan", "--config", path, "--timestep_sampling", "sigmoid", "--resolution", "1024", "--batch_size", "4")
    assert code == 0, err
    assert f"{100 * low:.1f} %" in out and f"{100 * high:.1f} %" in out and f"routed {100 * (low + high):.1f} % of steps" in out


def test_plan_counts_the_runs_own_text_length(tmp_path, capsys):
    """A run with short T5 captions spends less of its step on text, so routing saves more of it:
    ``plan`` builds the FLOP model from the training TOML's own t5xxl_max_token_length."""

    def flop_saving(extra: str) -> float:
        path = _write(tmp_path, "train.toml", TRAIN.replace("[training]\n", "[training]\n    " + extra))
        code, out, err = _run(capsys, "plan", "--config_file", path, "--arch", "flux")
        assert code == 0, err
        return float(out.split("FLOPs saved ")[1].split(" %")[0])

    assert flop_saving("t5xxl_max_token_length = 32\n") > flop_saving("t5xxl_max_token_length = 512\n")


def test_plan_flags_override_the_toml_and_buckets(tmp_path, capsys):
    path = _write(tmp_path, "train.toml", TRAIN)
    argv = ["plan", "--config_file", path, "--arch", "flux", "--batch_size", "4", "--timestep_sampling", "uniform"]
    code, out, _ = _run(capsys, *argv, "--bucket", "1024x1024:3", "--bucket", "512x512")
    assert code == 0
    assert "timestep_sampling uniform (flag)" in out and "2 bucket(s) from --bucket" in out
    assert "never routing (1): 512x512" in out
    # Uniform σ: in the 1024 bucket r0 fires with probability 0.3, r1 with 0.2 while active (3/4);
    # that bucket has 3 of 4 steps.
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert float(lines["r0"].split()[-2]) == pytest.approx(22.5, abs=0.051)
    assert float(lines["r1"].split()[-2]) == pytest.approx(11.25, abs=0.051)


def test_plan_generates_sd_scripts_buckets(tmp_path, capsys):
    code, out, _ = _run(capsys, "plan", "--config", _write(tmp_path, "p.toml", PLUGIN), "--enable_bucket", "--mc_samples", "20000")
    assert code == 0
    assert "25 sd-scripts buckets for 1024x1024" in out
    assert "sigma: uniform density on the shift-3 scheduler grid (Monte Carlo)" in out
    assert "never routing (18)" in out


@pytest.mark.parametrize(
    "arch,expected",
    [
        ("sdxl", "DDPM t uniform on [0, 1000)"),
        ("sd3", "uniform density, training_shift 1"),
        ("lumina", "shift (scale 1, shift 6)"),
        ("anima", "sigmoid (scale 1)"),
        ("hunyuan_image", "shift-5 scheduler grid"),
    ],
)
def test_plan_uses_each_trainers_default_sampler(tmp_path, capsys, arch, expected):
    path = _write(tmp_path, "p.toml", PLUGIN.replace('arch = "flux"', ""))
    code, out, err = _run(capsys, "plan", "--config", path, "--arch", arch, "--mc_samples", "20000")
    assert code == 0, err
    assert expected in out


def test_plan_needs_an_arch(tmp_path, capsys):
    path = _write(tmp_path, "p.toml", PLUGIN.replace('arch = "flux"', ""))
    code, _, err = _run(capsys, "plan", "--config", path)
    assert code == 2 and "pass --arch" in err and "hunyuan_image" in err


def test_plan_reports_bad_host_values(tmp_path, capsys):
    path = _write(tmp_path, "p.toml", PLUGIN)
    code, _, err = _run(capsys, "plan", "--config", path, "--bucket", "1020x1024")
    assert code == 2 and "multiples of flux's VAE factor 8" in err
    code, _, err = _run(capsys, "plan", "--config", path, "--resolution", "big")
    assert code == 2 and "resolution: 'big'" in err
    code, _, err = _run(capsys, "plan", "--config", path, "--enable_bucket", "--bucket_reso_steps", "0")
    assert code == 2 and "bucket_reso_steps (0) > 0" in err


def test_commands_register_from_other_modules(monkeypatch):
    load_commands()  # the front door imports the command modules, which register their commands
    assert {"check", "plan", "snr"} <= set(cli.COMMANDS)
    monkeypatch.setattr(cli, "COMMANDS", dict(cli.COMMANDS))
    seen = []
    cli.register("example", "test command", lambda p: p.add_argument("--x", type=int), lambda a: seen.append(a.x) or 3)
    assert cli.main(["example", "--x", "5"]) == 3 and seen == [5]
    with pytest.raises(ValueError):
        cli.register("example", "again", lambda p: None, lambda a: 0)


def test_module_entry_point(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    bad = _write(tmp_path, "bad.toml", "[plugins.downscale]\ngate = 'nope'\n")
    proc = subprocess.run(
        [sys.executable, "-m", "downscale_plugin", "check", "--config_file", bad], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == 2
    assert "gate: 'nope' is not allowed" in proc.stderr and "Traceback" not in proc.stderr


def test_command_whose_extra_is_missing_says_what_to_install(monkeypatch, capsys):
    def ghost(args):
        import downscale_plugin.no_such_module  # noqa: F401 (stands for a missing optional dependency)

    monkeypatch.setattr(cli, "COMMANDS", dict(cli.COMMANDS))
    cli.register("ghost", "needs a missing package", lambda parser: None, ghost)
    assert cli.main(["ghost"]) == 2
    err = capsys.readouterr().err
    assert "ghost: needs the package 'downscale_plugin.no_such_module'" in err and "pip install 'downscale-plugin[lab]'" in err


def test_check_shows_the_fasterdit_options(tmp_path, capsys):
    text = 'direction_loss_weight = 0.1\nsigma_policy = "snr_match"\n'  # the direction loss alone needs no routes
    code, out, err = _run(capsys, "check", "--config", _write(tmp_path, "plugin.toml", text))
    assert code == 0, err
    assert "direction_loss_weight 0.1, direction_loss_only_routed false, sigma_policy snr_match, positions plain" in out
