"""``check`` and ``plan`` for musubi-tuner (``--host musubi``): its training TOML, σ sampler, timestep range and buckets.

The σ sampler is checked against the host family's own draws (``hosts/musubi/family.MusubiFamily`` on the
doubles' ``NetworkTrainer``, tests/doubles/musubi_trainer_base.py), both where plan uses its exact law
(musubi-tuner not importable) and where it draws through the host's sampler; the real host's parser
choices and defaults are compared where ``musubi_tuner`` is importable."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from downscale_plugin.__main__ import load_commands

load_commands()  # sd-scripts registers first (the default host), then musubi-tuner, as the front door does

from downscale_plugin import cli  # noqa: E402
from downscale_plugin.hosts.musubi import cli as mcli  # noqa: E402
from downscale_plugin.hosts.musubi.facts import BY_ARCH  # noqa: E402
from downscale_plugin.hosts.musubi.family import MusubiFamily  # noqa: E402
from downscale_plugin.hosts.sd_scripts import cli as sd_cli  # noqa: E402
from downscale_plugin.plan import plan_table  # noqa: E402
from downscale_plugin.rng import forked, seed_forked  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOUBLES = str(Path(__file__).parent / "doubles")
WAN22 = ROOT / "example_configs" / "musubi_wan22_high_noise.toml"

QWEN = """
    network_module = "downscale_plugin"
    [training]
    timestep_sampling = "qwen_shift"
    max_train_steps = 100

    [plugins.downscale]
    [[plugins.downscale.routes]]
    route = "1024:768"
    sigma_min = 0.65
    sigma_max = 0.95

    [[plugins.downscale.routes]]
    route = "1024:896"
    sigma_min = 0.5
"""

WAN_WINDOW = """
    network_module = "downscale_plugin"
    [training]
    timestep_sampling = "shift"
    discrete_flow_shift = 12.0
    min_timestep = 875
    max_timestep = 1000

    [plugins.downscale]
    [[plugins.downscale.routes]]
    scale = 0.75
    sigma_min = 0.87   # below the high-noise expert's lowest σ, 0.875
"""


@pytest.fixture
def no_musubi(monkeypatch):
    """musubi-tuner not importable (as on CI): plan uses the exact law."""
    monkeypatch.setattr(mcli, "TRAINER_BASE", "no_such_module.training.trainer_base")


@pytest.fixture
def host_doubles(monkeypatch):
    """The doubles' trainer_base stands in for musubi-tuner's: plan draws through the host's sampler."""
    monkeypatch.syspath_prepend(DOUBLES)
    monkeypatch.setattr(mcli, "TRAINER_BASE", "musubi_trainer_base")
    monkeypatch.setattr(mcli, "PARSER_COMMON", "musubi_trainer_base")  # the double's parser holds the common options too
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _run(capsys, *argv):
    try:
        code = cli.main(list(argv))
    except SystemExit as stop:  # argparse's own errors
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def _plan(*argv: str, arch: str):
    """The plan ``plan --host musubi ARGV`` prints, as numbers."""
    args = cli.build_parser("musubi").parse_args(["plan", "--host", "musubi", *argv])
    cfg, toml, _ = cli.load_cli_config(args)
    inputs = mcli.plan_inputs(args, cli.HostArgs(args, toml), arch)
    plan = plan_table(
        cfg, arch, inputs.sampler, inputs.buckets, inputs.batch_size, inputs.weights, flop_model=inputs.flop_model,
        total_forwards=inputs.total_forwards, mc_samples=args.mc_samples,
    )  # fmt: skip
    return plan, inputs


def host_draws(arch: str, n: int, latent_hw: tuple[int, int], seed: int, **knobs) -> torch.Tensor:
    """n σ from the host family's sampler (the doubles' NetworkTrainer, as a run binds it), independent of plan's seed."""
    sys.path.insert(0, DOUBLES)
    try:
        import musubi_trainer_base as base
    finally:
        sys.path.remove(DOUBLES)
    args = argparse.Namespace(**{**mcli.DEFAULTS, **knobs})
    trainer = base.NetworkTrainer()
    family = MusubiFamily(trainer, BY_ARCH[arch])
    scheduler = base.FlowMatchDiscreteScheduler(shift=args.discrete_flow_shift)
    shape = (1, 1, 1, *latent_hw) if BY_ARCH[arch].latent_ndim == 5 else (1, 1, *latent_hw)
    with forked():
        seed_forked(seed)
        bound = family.bind(args, scheduler, torch.zeros(shape), "cpu", torch.float32)
        return torch.cat([bound.draw(min(256, n - i)) for i in range(0, n, 256)])


def _close(p: float, q: float, n: int) -> bool:
    """Within 5 standard errors of a Monte-Carlo fraction over n draws."""
    return abs(p - q) <= 5.0 * math.sqrt(max(q * (1 - q), 1e-6) / n) + 1e-9


# -- plan -----------------------------------------------------------------------------------------


def test_wan22_high_noise_expert_routes_every_step_inside_its_window(tmp_path, capsys, no_musubi):
    path = _write(tmp_path, "train.toml", WAN_WINDOW)
    code, out, err = _run(
        capsys, "plan", "--host", "musubi", "--config_file", path, "--script", "wan_train_network.py", "--bucket", "832x480x81"
    )
    assert code == 0, err
    assert "min_timestep 875 (toml), max_timestep 1000 (toml)" in out
    assert "routed 100.0 % of steps" in out and "latent frames 21" in out
    plan, _ = _plan("--config_file", path, "--bucket", "832x480x81", arch="wan")
    assert plan.probs[0] == pytest.approx(1.0, abs=1e-12) and plan.probs[-1] == pytest.approx(0.0, abs=1e-12)
    # the 875-1000 range is what puts every σ in the window: over all timesteps most steps stay native
    wide, _ = _plan("--config_file", path, "--bucket", "832x480x81", "--min_timestep", "0", arch="wan")
    assert wide.probs[-1] > 0.1
    # and the FLOP model is the run's: all 21 latent frames of 832x480 (60x104 latent, 1560 tokens a frame)
    assert plan.buckets[0].tokens[-1] == 1560 and plan.flop_model.frames == 21
    assert plan.flop_model.flops(1560) == pytest.approx(plan.flop_model.base.flops(21 * 1560))


@pytest.mark.parametrize("source", ["law", "host"])
def test_example_wan22_config_odds_match_the_host_sampler(request, source):
    request.getfixturevalue("no_musubi" if source == "law" else "host_doubles")
    plan, inputs = _plan("--config_file", str(WAN22), "--bucket", "1280x720x81", "--mc_samples", "40000", arch="wan")
    assert ("exact law" in inputs.sampler_text) == (source == "law")
    sigmas = host_draws(
        "wan", 40_000, (90, 160), seed=123, timestep_sampling="shift", discrete_flow_shift=12.0, min_timestep=875, max_timestep=1000
    )
    assert float(sigmas.min()) >= 0.875
    top = float(((sigmas > 0.95) & (sigmas < 1.0)).double().mean())
    mid = float(((sigmas > 0.9) & ~((sigmas > 0.95) & (sigmas < 1.0))).double().mean())
    n = 40_000 if source == "law" else 20_000  # both sides Monte Carlo: half the effective draws
    assert _close(plan.probs[0], top, n) and _close(plan.probs[1], mid, n)
    assert _close(plan.probs[-1], 1.0 - top - mid, n)


@pytest.mark.parametrize("source", ["law", "host"])
def test_qwen_shift_odds_match_a_monte_carlo_of_the_host_family(tmp_path, request, source):
    request.getfixturevalue("no_musubi" if source == "law" else "host_doubles")
    path = _write(tmp_path, "train.toml", QWEN)
    plan, inputs = _plan("--config_file", path, "--bucket", "1024x1024", "--arch", "qwen_image", "--mc_samples", "30000", arch="qwen_image")
    assert ("exact law" in inputs.sampler_text) == (source == "law")
    sigmas = host_draws("qwen_image", 30_000, (128, 128), seed=77, timestep_sampling="qwen_shift")
    r0 = float(((sigmas > 0.65) & (sigmas < 0.95)).double().mean())
    r1 = float((sigmas > 0.5).double().mean()) - r0
    n = 30_000 if source == "law" else 15_000
    assert _close(plan.probs[0], r0, n) and _close(plan.probs[1], r1, n), (plan.probs, r0, r1)
    # qwen_shift's μ depends on the grid: a smaller bucket shifts σ down, and plan follows the host there too
    small, _ = _plan("--config_file", path, "--bucket", "512x512", "--arch", "qwen_image", arch="qwen_image")
    assert small.buckets[0].probs[-1] == pytest.approx(1.0)  # the 1024 px tier's routes do not apply to 512 px
    lower = host_draws("qwen_image", 30_000, (64, 64), seed=78, timestep_sampling="qwen_shift")
    assert float((lower > 0.5).double().mean()) < float((sigmas > 0.5).double().mean()) - 0.02


def test_timestep_buckets_and_the_scheduler_grid_go_through_the_host_sampler(tmp_path, host_doubles, capsys):
    path = _write(tmp_path, "train.toml", QWEN)
    plan, inputs = _plan(
        "--config_file", path, "--bucket", "1024x1024", "--arch", "qwen_image", "--num_timestep_buckets", "4", "--mc_samples", "20000",
        arch="qwen_image",
    )  # fmt: skip
    assert "4 timestep buckets" in inputs.sampler_text and "NetworkTrainer" in inputs.sampler_text
    sigmas = host_draws("qwen_image", 20_000, (128, 128), seed=5, timestep_sampling="qwen_shift")  # each σ keeps the law
    r0 = float(((sigmas > 0.65) & (sigmas < 0.95)).double().mean())
    assert _close(plan.probs[0], r0, 10_000)
    kept, inputs = _plan(
        "--config_file", path, "--bucket", "1024x1024", "--arch", "qwen_image", "--preserve_distribution_shape", "--min_timestep", "500",
        "--mc_samples", "20000", arch="qwen_image",
    )  # fmt: skip
    assert "by rejection" in inputs.sampler_text
    sigmas = host_draws(
        "qwen_image", 20_000, (128, 128), seed=7, timestep_sampling="qwen_shift", preserve_distribution_shape=True, min_timestep=500
    )
    r0 = float(((sigmas > 0.65) & (sigmas < 0.95)).double().mean())
    assert float(sigmas.min()) >= 0.5 and _close(kept.probs[0], r0, 10_000) and kept.probs[-1] < 1e-3
    grid, inputs = _plan(
        "--config_file", path, "--bucket", "1024x1024", "--arch", "qwen_image", "--timestep_sampling", "sigma", arch="qwen_image"
    )
    draws = host_draws("qwen_image", 4096, (128, 128), seed=6)  # sigma, weighting none: uniform on the 1000-step grid
    assert grid.probs[-1] == pytest.approx(float((draws <= 0.5).double().mean()), abs=0.03)
    assert grid.probs[-1] == pytest.approx(0.5, abs=0.004)  # the grid's exact atoms (σ in bf16, as a bf16 run has them)


def test_musubi_dataset_toml_buckets(tmp_path, no_musubi):
    dataset = _write(
        tmp_path,
        "dataset.toml",
        """
        [general]
        resolution = [1280, 720]
        batch_size = 2

        [[datasets]]
        video_directory = "/videos"
        target_frames = [1, 26, 45]

        [[datasets]]
        image_directory = "/images"
        resolution = 1024
        batch_size = 1
        """,
    )
    train = _write(tmp_path, "train.toml", WAN_WINDOW.replace("[training]", f'dataset_config = "{Path(dataset).name}"\n    [training]'))
    plan, inputs = _plan("--config_file", train, "--script", "wan_train_network.py", arch="wan")
    # the dataset rounds target frames to 4k + 1 (26 → 25); frames of one spatial grid are averaged by steps, as a run's
    assert plan.buckets[0].latent_hw == (90, 160) and plan.buckets[1].latent_hw == (128, 128)
    assert inputs.batch_size == 2 and "4 bucket(s)" in inputs.bucket_note
    assert inputs.flop_model.frames == pytest.approx((1 + 7 + 12) / 3 * 3 / 4 + 1 / 4)
    bad = _write(tmp_path, "full.toml", '[[datasets]]\nvideo_directory = "/v"\nframe_extraction = "full"\n')
    with pytest.raises(cli.ConfigError, match="frame_extraction: 'full'.*--bucket WxHxFRAMES"):
        _plan("--config_file", train, "--dataset_config", bad, arch="wan")


# -- the options: per host ------------------------------------------------------------------------


def _option(parser: argparse.ArgumentParser, command: str, flag: str) -> argparse.Action | None:
    sub = parser.get_default("command_parsers")[command]
    return next((a for a in sub._actions if flag in a.option_strings), None)


def test_hosts_keep_their_own_flags_with_the_same_names():
    # one parser with both hosts' options is what clashed: argparse refuses the second --timestep_sampling
    both = argparse.ArgumentParser()
    sd_cli.add_arguments(both)
    with pytest.raises(argparse.ArgumentError, match="timestep_sampling"):
        mcli.add_arguments(both)
    for host in ("sd_scripts", "musubi"):
        parser = cli.build_parser(host)
        for command in ("plan", "snr"):
            assert _option(parser, command, "--timestep_sampling") is not None and _option(parser, command, "--host") is not None
    musubi, sd = cli.build_parser("musubi"), cli.build_parser("sd_scripts")
    assert tuple(_option(musubi, "plan", "--timestep_sampling").choices) == mcli.TIMESTEP_SAMPLING
    assert _option(sd, "plan", "--timestep_sampling").choices is None  # sd-scripts' flag stays free-form
    assert _option(sd, "plan", "--num_timestep_buckets") is None and _option(musubi, "plan", "--enable_bucket") is None
    # each command line is parsed with its own host's options, --host anywhere and spelled any way argparse takes it
    assert cli.selected_host(["plan", "--config", "x.toml", "--host=musubi"]) == "musubi"
    assert cli.selected_host(["check", "--host", "musubi", "--", "train.py", "--host", "sd_scripts"]) == "musubi"
    assert cli.selected_host(["plan", "--config", "x.toml"]) == "sd_scripts"


def test_each_host_parses_its_own_sampler_flags(tmp_path, capsys, no_musubi):
    path = _write(tmp_path, "train.toml", QWEN)
    code, out, err = _run(
        capsys, "plan", "--config_file", path, "--host", "musubi", "--arch", "qwen_image", "--bucket", "1024x1024",
        "--timestep_sampling", "flux2_shift", "--num_timestep_buckets", "1",
    )  # fmt: skip
    assert code == 0, err
    assert "timestep_sampling flux2_shift (flag)" in out and "num_timestep_buckets 1 (flag)" in out
    code, out, err = _run(capsys, "plan", "--config_file", path, "--arch", "flux", "--timestep_sampling", "flux_shift", "--enable_bucket")
    assert code == 0, err  # sd-scripts' command line as before
    assert "timestep_sampling flux_shift (flag)" in out and "sd-scripts buckets" in out


def test_a_bad_host_flag_is_a_clean_error(tmp_path, capsys, no_musubi):
    path = _write(tmp_path, "train.toml", QWEN)
    base = ("plan", "--host", "musubi", "--config_file", path, "--arch", "qwen_image")
    code, _, err = _run(capsys, *base, "--timestep_sampling", "nextdit_shift")
    assert code == 2 and "argument --timestep_sampling: invalid choice: 'nextdit_shift'" in err and "'qwen_shift'" in err
    assert "Traceback" not in err
    code, _, err = _run(capsys, *base, "--enable_bucket")  # an sd-scripts option
    assert code == 2 and "unrecognized arguments: --enable_bucket (read with host musubi's options" in err
    code, _, err = _run(capsys, "plan", "--config_file", path, "--num_timestep_buckets", "3")  # a musubi option, default host
    assert code == 2 and "unrecognized arguments: --num_timestep_buckets 3 (read with host sd_scripts's options" in err
    code, _, err = _run(capsys, "plan", "--host", "kohya", "--config_file", path)
    assert code == 2 and "argument --host: invalid choice: 'kohya' (choose from 'sd_scripts', 'musubi')" in err
    code, _, err = _run(capsys, *base, "--bucket", "1020x1024")
    assert code == 2 and "multiples of qwen_image's VAE factor 8" in err
    code, _, err = _run(capsys, *base, "--bucket", "1024x1024x9")
    assert code == 2 and "qwen_image trains on images" in err
    code, _, err = _run(capsys, *base, "--bucket", "1024x1024", "--min_timestep", "900", "--max_timestep", "100")
    assert code == 2 and "need 0 <= min_timestep (900) < max_timestep (100) <= 1000" in err
    code, _, err = _run(capsys, *base, "--bucket", "1024x1024", "--timestep_sampling", "sigma")  # needs the host's own grid
    assert code == 2 and "timestep_sampling 'sigma': plan draws it with musubi-tuner's own sampler" in err
    code, _, err = _run(capsys, *base, "--bucket", "1024x1024", "--preserve_distribution_shape")
    assert code == 2 and "--preserve_distribution_shape: plan draws it with musubi-tuner's own sampler" in err
    code, _, err = _run(capsys, "plan", "--host", "musubi", "--config_file", path, "--bucket", "1024x1024")
    assert code == 2 and "arch: unknown" in err and "--host musubi --help" in err
    code, _, err = _run(
        capsys, "plan", "--host", "musubi", "--config_file", path, "--bucket", "1024x1024", "--script", "fpack_train_network.py"
    )
    assert code == 2 and "FramePack" in err
    code, _, err = _run(capsys, *base, "--bucket", "1024x1024", "--script", "wan_train_network.py")
    assert code == 2 and "--arch is 'qwen_image' but the host's options name 'wan'" in err


# -- check ----------------------------------------------------------------------------------------


def test_check_a_musubi_training_toml(tmp_path, capsys):
    code, out, err = _run(capsys, "check", "--host", "musubi", "--config_file", str(WAN22))
    assert code == 0, err
    assert "config OK" in out and "x0.75" in out and "(0.95, 1)" in out
    bad = _write(
        tmp_path,
        "bad.toml",
        """
        network_module = "downscale_plugin"
        network_args = ["ds_gate=nope"]
        timestep_sampling = "flux_shfit"
        [plugins.downscale]
        arch = "flux"
        positions = "interpolate"
        [[plugins.downscale.routes]]
        scale = 0.75
        sigma_min = 0.9
        """,
    )
    code, _, err = _run(capsys, "check", "--host", "musubi", "--config_file", bad)
    assert code == 2 and "gate: 'nope' is not allowed" in err  # the config itself, as for sd-scripts
    fixed = bad.replace("bad.toml", "fixed.toml")
    Path(fixed).write_text(Path(bad).read_text().replace('network_args = ["ds_gate=nope"]', ""))
    code, _, err = _run(capsys, "check", "--host", "musubi", "--config_file", fixed)
    assert code == 2
    assert "timestep_sampling: 'flux_shfit' is not one of musubi-tuner's samplers (allowed: sigma, uniform" in err
    assert "arch: 'flux' is not trained by musubi-tuner (allowed: wan," in err
    assert "positions: 'interpolate' is not available on musubi-tuner (allowed: 'plain')" in err
    code, _, err = _run(capsys, "check", "--config_file", fixed)  # sd-scripts reads the same TOML its own way
    assert code == 0, err


def test_check_refuses_the_maps_vae_arms_as_a_musubi_run_does(tmp_path, capsys):
    """musubi-tuner hands process_batch no VAE: the map's VAE arms are refused by check as at prepare_network."""
    path = _write(
        tmp_path,
        "map.toml",
        """
        network_module = "downscale_plugin"
        timestep_sampling = "shift"
        [plugins.downscale]
        mode = "map"
        map_out = "map_out"
        map_pixel = true
        """,
    )
    code, _, err = _run(capsys, "check", "--host", "musubi", "--", "wan_train_network.py", "--config_file", path)
    assert code == 2 and "map_pixel: the VAE arms are not supported for wan (supported: none on this host)" in err
    code, _, err = _run(capsys, "check", "--host", "musubi", "--config_file", path)
    assert code == 2 and "map_pixel: the VAE arms are not supported for any musubi-tuner architecture" in err
    Path(path).write_text(Path(path).read_text().replace("map_pixel = true", ""))
    code, _, err = _run(capsys, "check", "--host", "musubi", "--config_file", path)
    assert code == 0, err


def test_check_a_musubi_command_line(tmp_path, capsys):
    train = _write(tmp_path, "train.toml", QWEN.replace("[plugins.downscale]", '[plugins.downscale]\narch = "qwen_image"'))
    line = ("accelerate", "launch", "src/musubi_tuner/qwen_image_train_network.py", "--config_file", train)
    code, out, err = _run(capsys, "check", "--host", "musubi", "--", *line)
    assert code == 0, err
    assert f"the command line with {train}" in out
    code, _, err = _run(capsys, "check", "--host", "musubi", "--", "wan_train_network.py", "--config_file", train)
    assert code == 2 and "arch: the config says 'qwen_image' but the script trains 'wan'" in err
    code, _, err = _run(
        capsys, "check", "--host", "musubi", "--", "python", "-m", "musubi_tuner.fpack_train_network", "--config_file", train
    )
    assert code == 2 and "fpack_train_network: not supported: FramePack" in err
    code, _, err = _run(
        capsys,
        "check",
        "--host",
        "musubi",
        "--",
        "qwen_image_train_network.py",
        "--config_file",
        train,
        "--network_module",
        "networks.lora",
    )
    assert code == 2 and "does not train with downscale_plugin" in err


# -- the real host --------------------------------------------------------------------------------


def _real_musubi():
    return pytest.importorskip("musubi_tuner.training.parser_common", reason="musubi-tuner is not importable")


def test_flags_and_defaults_are_musubi_tuners():
    parser = _real_musubi().setup_parser_common()
    actions = {a.dest: a for a in parser._actions}
    assert set(actions["timestep_sampling"].choices) == set(mcli.TIMESTEP_SAMPLING)
    assert set(actions["weighting_scheme"].choices) == set(mcli.WEIGHTING_SCHEMES)
    for name, default in mcli.DEFAULTS.items():
        assert actions[name].default == default or (default is False and actions[name].default is False), name
    assert actions["max_train_steps"].default == mcli.DEFAULT_MAX_TRAIN_STEPS


def test_plan_draws_with_the_real_host_sampler(tmp_path):
    _real_musubi()
    path = _write(tmp_path, "train.toml", QWEN)
    args = ("--config_file", path, "--bucket", "1024x1024", "--arch", "qwen_image", "--mc_samples", "30000")
    real, inputs = _plan(*args, arch="qwen_image")
    assert "NetworkTrainer" in inputs.sampler_text
    mcli.TRAINER_BASE, saved = "no_such_module", mcli.TRAINER_BASE
    try:
        law, inputs = _plan(*args, arch="qwen_image")
    finally:
        mcli.TRAINER_BASE = saved
    assert "exact law" in inputs.sampler_text
    for i in (0, 1, -1):
        assert _close(real.probs[i], law.probs[i], 30_000)


def test_the_real_hosts_functions_pass_the_self_check(monkeypatch):
    """Every piece the plugin re-implements agrees with musubi-tuner's own functions, Wan 2.2's expert override too."""
    _real_musubi()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # wan/modules/t5.py evaluates it at import (no GPU here)
    from musubi_tuner import wan_train_network

    from downscale_plugin.hosts.kohya.selfcheck import drift_problems
    from downscale_plugin.hosts.musubi.selfcheck import CHECKED_AGAINST, pieces
    from downscale_plugin.hosts.musubi.startup import script_parser

    wan = wan_train_network.WanNetworkTrainer()
    wan.high_low_training, wan.timestep_boundary, wan.next_model_is_high_noise = True, 0.875, False  # as --dit_high_noise sets them
    checks = pieces(wan, BY_ARCH["wan"], script_parser(wan_train_network).parse_args([]))  # the script's options at their defaults
    assert "expert" in checks[-1].what and drift_problems(checks, CHECKED_AGAINST) == []


def _startup_check():
    """This checkout's startup file (an installed ``.pth`` may have imported another one first)."""
    spec = importlib.util.spec_from_file_location("this_startup_check", ROOT / "downscale_plugin_startup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_check_and_the_startup_check_report_a_drifted_musubi_function(tmp_path, capsys, monkeypatch):
    """``check --host musubi -- SCRIPT`` and the startup check run the self-check on the script's musubi-tuner before
    any model loads: a μ line that moved is named with the host function and the revision, as the run's refusal names
    it; the real functions pass."""
    _real_musubi()
    from musubi_tuner.utils import train_utils

    script = str(Path(train_utils.__file__).resolve().parents[3] / "qwen_image_train_network.py")
    train = _write(tmp_path, "train.toml", QWEN)
    startup = _startup_check()
    assert startup.report(["accelerate", "launch", script, "--config_file", train]) is None
    code, _, err = _run(capsys, "check", "--host", "musubi", "--", script, "--config_file", train)
    assert code == 0, err
    host = train_utils.get_lin_function
    monkeypatch.setattr(train_utils, "get_lin_function", lambda x1=256, y1=0.5, x2=4096, y2=1.15: host(x1, y1, x2, y2 + 0.05))
    code, _, err = _run(capsys, "check", "--host", "musubi", "--", script, "--config_file", train)
    assert code == 2
    assert "musubi_tuner.training.trainer_base.NetworkTrainer.get_noisy_model_input_and_timesteps no longer matches" in err
    assert "the exact σ law of timestep_sampling=flux_shift" in err and "checked against musubi-tuner 30c658c4" in err
    report = startup.report(["accelerate", "launch", script, "--config_file", train])
    assert "NetworkTrainer.get_noisy_model_input_and_timesteps no longer matches the exact σ law of timestep_sampling=qwen_shift" in report
    assert "stopped before the trainer loads any model" in report


def test_the_compile_warning_reads_musubi_tuners_own_compile_options():
    """The options ``compile_warning`` reads are musubi-tuner's parser's (names, the unset dynamic mode, the limit)."""
    from downscale_plugin.config import load_config
    from downscale_plugin.hosts.musubi.buckets import MusubiBuckets
    from downscale_plugin.hosts.musubi.compile import compile_warning

    parser = _real_musubi().setup_parser_common()
    cfg = load_config(table={"routes": [{"scale": 0.5, "sigma_min": 0.5}]})
    buckets = MusubiBuckets([(8, 8), (16, 16)], [1.0, 1.0], 1, [1.0, 1.0])
    warned = compile_warning(parser.parse_args(["--compile", "--compile_cache_size_limit", "2"]), cfg, "qwen_image", buckets, False)
    assert "(--compile_dynamic auto)" in warned and "more than --compile_cache_size_limit = 2" in warned
    assert compile_warning(parser.parse_args(["--compile", "--compile_dynamic", "true"]), cfg, "qwen_image", buckets, False) is None
    assert compile_warning(parser.parse_args([]), cfg, "qwen_image", buckets, False) is None
