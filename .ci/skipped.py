"""pytest plugin for ``.ci/run``: write the node id of every test (or module) the run skipped, one a line, to
``$CI_SKIPPED``; or, with ``$CI_RUN_ONLY`` naming such a list, run only the tests it names. Run in the environment without the hosts, the skipped tests are exactly the ones it cannot run:
the real-host tests (``SD_SCRIPTS_DIR`` / ``MUSUBI_DIR`` unset, musubi-tuner not importable). Each host's own
environment then runs this list, so a new real-host test joins CI by skipping without its host, and the tests of
the doubles run once: a file that holds both is collected whole (a node id inside a module that the host's
environment skips whole would be a usage error) and its doubles' tests are deselected, since a host's pins may lack
what they need (diffusers 0.32's models for the FLOP model's families)."""

from __future__ import annotations

import os

_skipped: list[str] = []


def pytest_collectreport(report):
    if report.skipped:  # a module-level importorskip skips the whole file
        _skipped.append(report.nodeid)


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append(report.nodeid)


def pytest_collection_modifyitems(config, items):
    if "CI_RUN_ONLY" not in os.environ:
        return
    with open(os.environ["CI_RUN_ONLY"], encoding="utf-8") as f:
        listed = {line.strip() for line in f if line.strip()}
    keep = [item for item in items if item.nodeid in listed or item.nodeid.split("::")[0] in listed]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


def pytest_sessionfinish(session):
    if "CI_SKIPPED" in os.environ:
        with open(os.environ["CI_SKIPPED"], "w", encoding="utf-8") as f:
            f.writelines(f"{nodeid}\n" for nodeid in dict.fromkeys(_skipped))
