"""The optional packages of ``mode = "map"`` and ``"auto"`` (``config.MODE_PACKAGES``: scipy, matplotlib, tqdm, the
``[map]`` extra): a missing one is named with the extra to install by the startup check and ``check``, before
any model loads, and by the run's start before its session imports any of them (a bare ``ModuleNotFoundError``
after the models had loaded and cached is what a run without the extra got)."""

from __future__ import annotations

import sys
import textwrap

import pytest
from host_modules import run_double
from test_sd_scripts_map import RES

import downscale_plugin_startup as startup
from downscale_plugin.__main__ import load_commands, main
from downscale_plugin.config import load_config, package_problems
from downscale_plugin.hosts.sd_scripts.facts import HostError

TRAIN = """
    [model]
    network_module = "downscale_plugin"

    [plugins.downscale]
    mode = "{mode}"
    map_out = "out"
"""
MEASURING = ("scipy", "matplotlib", "tqdm")  # what the mapping/ modules a measurement loads import


@pytest.fixture
def hidden(monkeypatch):
    """Hide packages as if not installed (``find_spec`` answers None, ``import`` fails) with every module of the
    measurement unloaded; what a test imports anew is dropped again afterwards."""
    load_commands()  # the commands register once per process: their modules stay
    before = set(sys.modules)

    def hide(*names: str) -> None:
        for name in names:
            monkeypatch.setitem(sys.modules, name, None)
        for name in [m for m in sys.modules if _measuring(m)]:
            monkeypatch.delitem(sys.modules, name)

    yield hide
    for name in set(sys.modules) - before:
        if _measuring(name):
            del sys.modules[name]


def _measuring(module: str) -> bool:
    """A module of the measurement (not the command-line registration, which ``main`` loads once per process)."""
    return module.startswith("downscale_plugin.mapping.") and not module.endswith("cli")


def _train(tmp_path, mode: str) -> str:
    path = tmp_path / "train.toml"
    path.write_text(textwrap.dedent(TRAIN.format(mode=mode)))
    return str(path)


@pytest.mark.parametrize(("mode", "names"), [("auto", "scipy, tqdm"), ("map", "scipy, matplotlib, tqdm")])
def test_the_startup_check_and_check_name_the_missing_package_and_the_extra(mode, names, hidden, tmp_path, capsys):
    hidden(*MEASURING)
    text = f'mode = "{mode}" needs {names}, not installed: pip install "downscale-plugin[map]"'
    train = _train(tmp_path, mode)
    report = startup.report(["flux_train_network.py", "--config_file", train])
    assert report is not None and text in report and "stopped before the trainer loads any model" in report
    for argv in (["check", "--config_file", train], ["check", "--", "flux_train_network.py", "--config_file", train]):
        assert main(argv) == 2
        assert text in capsys.readouterr().err


def test_only_a_mode_that_measures_needs_them(hidden):
    hidden(*MEASURING)
    assert package_problems(load_config(table={"mode": "auto", "map_out": "o", "certify_budget": 0.0})) == []
    assert package_problems(load_config(table={"routes": [{"route": "1024:768", "sigma_min": 0.65}]})) == []
    assert package_problems(load_config(table={"mode": "auto", "map_out": "o", "enable": False})) == []
    assert package_problems(load_config(table={"mode": "auto", "map_out": "o"}))


@pytest.mark.usefixtures("host_doubles", "cheap_plan")
@pytest.mark.parametrize("mode", ["auto", "map"])
def test_the_run_names_them_before_its_session_imports_any(mode, hidden, tmp_path):
    hidden("scipy")
    table = {"mode": mode, "map_out": str(tmp_path / "out"), "map_ratios": [0.5]}
    with pytest.raises(HostError, match=rf'mode = "{mode}" needs scipy, not installed: pip install "downscale-plugin\[map\]"'):
        run_double("flux", "--resolution", RES, downscale=table)
    loaded = {m for m in sys.modules if m.startswith("downscale_plugin.mapping.")}
    assert not loaded & {f"downscale_plugin.mapping.{m}" for m in ("estimator", "sequential", "certify", "in_run")}, loaded
