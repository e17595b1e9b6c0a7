"""What a user reads in an sd-scripts run: the start banner and the end summary stay tables under the host's
rich log handler, and ``ss_downscale_version`` is the running code's version."""

from __future__ import annotations

import io
import logging
from importlib import metadata

import pytest
from host_modules import run_double

import downscale_plugin
from downscale_plugin.hosts.kohya import run as kohya_run
from downscale_plugin.plan import format_plan

rich_logging = pytest.importorskip("rich.logging")
from rich.console import Console  # noqa: E402

pytestmark = pytest.mark.usefixtures("host_doubles", "cheap_plan")

ALL_ROUTED = {"routes": [{"scale": 0.5, "sigma_min": 0.0}]}
RES = ("--resolution", "128,128")


@pytest.fixture
def rich_log():
    """The root handler sd-scripts' ``setup_logging`` installs (``RichHandler(console=Console(stderr=True))``,
    library/utils.py), on a file: rich wraps at 80 columns there. Yields that file."""
    out = io.StringIO()
    handler = rich_logging.RichHandler(console=Console(file=out, width=80))
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield out
    root.removeHandler(handler)
    root.setLevel(level)


def test_banner_and_summary_are_printed_unwrapped_under_the_hosts_rich_handler(rich_log, capsys):
    run = run_double("flux", *RES, "--max_train_steps", "2", downscale=ALL_ROUTED).last_run.network.downscale_run
    out = capsys.readouterr().out.splitlines()
    table = format_plan(run.plan).splitlines()
    assert max(len(line) for line in table) > 80  # wider than the log file's wrap: the case that broke
    for line in table + run.totals.summary_text().splitlines():
        assert line in out, (line, out)
    head = next(line for line in out if line.startswith("downscale_plugin "))
    assert "flux (FluxNetworkTrainer), inner network networks.lora_flux, gate coupled" in head
    log = rich_log.getvalue()
    assert "downscale_plugin: start banner printed" in log and "downscale_plugin: end summary printed" in log  # rich wraps these too
    assert "128x128" not in log  # the tables are not in the wrapped log


def test_without_a_rich_handler_the_log_keeps_the_tables(caplog, capsys):
    with caplog.at_level(logging.INFO, logger="downscale_plugin"):
        run = run_double("flux", *RES, "--max_train_steps", "2", downscale=ALL_ROUTED).last_run.network.downscale_run
    assert format_plan(run.plan) in caplog.text and run.totals.summary_text() in caplog.text
    assert "128x128" not in capsys.readouterr().out


@pytest.mark.parametrize("installed", ["0.0.1", None], ids=["stale-metadata", "checkout-not-installed"])
def test_version_is_the_running_packages(monkeypatch, installed):
    def version(name):
        if installed is None:
            raise metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(metadata, "version", version)
    kohya_run.version.cache_clear()
    try:
        assert kohya_run.version() == downscale_plugin.__version__
        run = run_double("flux", *RES, "--max_train_steps", "1", downscale=ALL_ROUTED).last_run.network.downscale_run
        assert run.metadata()["ss_downscale_version"] == downscale_plugin.__version__
    finally:
        kohya_run.version.cache_clear()
