"""Host options the in-run measurement (``mode = "map"``, ``"auto"``) refuses (``conventions.MEASUREMENT_REFUSED``:
block swap, Flux's ``--split_mode``, DeepSpeed; accelerate's DeepSpeed/FSDP/Megatron at start), named by the
startup check and ``check`` before any model loads and by the run's start; the same options with ``mode = "train"``,
or with ``certify_budget = 0``, are left alone. docs/ARCHITECTURE.md has the table of every option."""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest
from host_modules import run_double
from test_sd_scripts_map import RES

import downscale_plugin_startup as startup
from downscale_plugin.__main__ import main
from downscale_plugin.hosts.sd_scripts.facts import HostError

AUTO = """
    [model]
    network_module = "downscale_plugin"
    {host}

    [plugins.downscale]
    mode = "auto"
    map_out = "out"
    {plugin}
"""
TRAIN = """
    [model]
    network_module = "downscale_plugin"
    {host}

    [plugins.downscale]
    [[plugins.downscale.routes]]
    route = "1024:768"
    sigma_min = 0.65
"""


def _toml(tmp_path, template: str = AUTO, host: str = "", plugin: str = "", name: str = "train") -> str:
    path = tmp_path / f"{name}.toml"
    path.write_text(textwrap.dedent(template.format(host=host, plugin=plugin)))
    return str(path)


def _report(*argv: str) -> str | None:
    return startup.report(["flux_train_network.py", *argv])


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (("--blocks_to_swap", "4"), '--blocks_to_swap 4: mode = "auto" does not run with it: its offloader moves'),
        (("--blocks_to_swap=12",), "--blocks_to_swap 12:"),
        (("--split_mode",), '--split_mode: mode = "auto" does not run with it: it swaps blocks'),
        (("--deepspeed",), '--deepspeed: mode = "auto" does not run with it: DeepSpeed\'s engine owns the backward'),
    ],
)
def test_the_startup_check_names_a_refused_option_on_the_command_line(options, named, tmp_path):
    report = _report("--config_file", _toml(tmp_path), *options)
    assert report is not None and named in report and "stopped before the trainer loads any model" in report, report


def test_a_refused_block_swap_says_what_to_do_instead(tmp_path):
    """Flux at 1024² on a 24 GB card needs --blocks_to_swap: the refusal names the ways to certify without it and to train with it."""
    report = _report("--config_file", _toml(tmp_path), "--blocks_to_swap", "18")
    assert report is not None and "a lower-resolution bucket, whose windows route only that tier's buckets" in report
    assert 'a windows file certified for this model and tier elsewhere; then train this run with mode = "train"' in report
    assert "downscale_config = that windows.toml and --blocks_to_swap" in report


def test_and_in_the_training_toml(tmp_path):
    report = _report("--config_file", _toml(tmp_path, host="blocks_to_swap = 2"))
    assert report is not None and '--blocks_to_swap 2: mode = "auto"' in report


@pytest.mark.parametrize(
    ("template", "host", "plugin", "options"),
    [
        pytest.param(TRAIN, "blocks_to_swap = 8", "", ("--deepspeed",), id="mode-train"),
        pytest.param(AUTO, "", "certify_budget = 0.0", ("--blocks_to_swap", "8"), id="auto-budget-0"),
        pytest.param(AUTO, "", "", ("--blocks_to_swap", "0"), id="no-blocks-swapped"),
        pytest.param(AUTO, "", "", ("--blocks", "8"), id="an-abbreviation-is-the-scripts"),
    ],
)
def test_runs_that_do_not_measure_keep_the_options(template, host, plugin, options, tmp_path):
    assert _report("--config_file", _toml(tmp_path, template, host, plugin), *options) is None


def test_check_names_them_for_both_hosts(tmp_path, capsys):
    train, plain = _toml(tmp_path, host="blocks_to_swap = 3"), _toml(tmp_path, name="plain")
    for argv in (
        ["check", "--config_file", train],
        ["check", "--host", "musubi", "--config_file", train],
        ["check", "--", "flux_train_network.py", "--config_file", plain, "--blocks_to_swap", "3"],
        ["check", "--host", "musubi", "--", "wan_train_network.py", "--config_file", plain, "--blocks_to_swap", "3"],
    ):
        assert main(argv) == 2, argv
        assert '--blocks_to_swap 3: mode = "auto" does not run with it' in capsys.readouterr().err, argv


@pytest.mark.usefixtures("host_doubles", "cheap_plan")
class TestTheRunsStart:
    def config(self, tmp_path) -> dict:
        return {"mode": "auto", "map_out": str(tmp_path / "out"), "map_ratios": [0.5]}

    def test_refuses_a_refused_option_before_any_step(self, tmp_path):
        trainer = None
        with pytest.raises(HostError, match=r'--blocks_to_swap 2: mode = "auto" does not run with it'):
            trainer = run_double("flux", "--resolution", RES, "--blocks_to_swap", "2", downscale=self.config(tmp_path))
        assert trainer is None and not (tmp_path / "out").exists()

    def test_refuses_an_accelerate_engine_that_owns_the_backward(self, tmp_path, monkeypatch):
        from library import train_util

        monkeypatch.setattr(train_util.TinyAccelerator, "distributed_type", SimpleNamespace(name="DEEPSPEED"), raising=False)
        with pytest.raises(HostError, match=r"accelerate's DEEPSPEED: the auto takes each gradient by a plain backward"):
            run_double("flux", "--resolution", RES, downscale=self.config(tmp_path))

    def test_mode_train_keeps_them(self):
        table = {"routes": [{"route": "128:64", "sigma_min": 0.5}]}
        run = run_double("flux", "--resolution", RES, "--max_train_steps", "2", "--blocks_to_swap", "2", downscale=table).last_run
        assert len(run.losses) == 2
