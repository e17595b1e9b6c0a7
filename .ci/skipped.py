"""pytest plugin for ``.ci/run``: write the node id of every test (or module) the run skipped, one a line, to
``$CI_SKIPPED``. Run in the environment without the hosts, the skipped tests are exactly the ones it cannot run:
the real-host tests (``SD_SCRIPTS_DIR`` / ``MUSUBI_DIR`` unset, musubi-tuner not importable). Each host's own
environment then runs this list, so a new real-host test joins CI by skipping without its host, and the tests of
the doubles run once."""

from __future__ import annotations

import os

_skipped: list[str] = []


def pytest_collectreport(report):
    if report.skipped:  # a module-level importorskip skips the whole file
        _skipped.append(report.nodeid)


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session):
    with open(os.environ["CI_SKIPPED"], "w", encoding="utf-8") as f:
        f.writelines(f"{nodeid}\n" for nodeid in dict.fromkeys(_skipped))
