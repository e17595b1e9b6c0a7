"""``.ci/real_hosts.py``: CI fails, naming the test, when a real-host test (one the default suite skipped, listed by
``.ci/skipped.py``) passed in no host environment. Synthetic runs: a tiny test tree run by pytest as ``.ci/run`` runs
it (the default suite writes the list, each "host" runs the list with ``--junitxml``), and hand-written junit files."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CI = Path(__file__).resolve().parent.parent / ".ci"
spec = importlib.util.spec_from_file_location("real_hosts", CI / "real_hosts.py")
real_hosts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(real_hosts)

TREE = """
import os

import pytest

HOST = os.environ.get("FAKE_HOST")  # unset in the default suite: the real-host tests skip


@pytest.mark.skipif(not HOST, reason="no host")
@pytest.mark.parametrize("case", ["a", "b/c.d"])
def test_real(case):
    if HOST == "old" and case == "b/c.d":
        pytest.skip("this host cannot run it either")


@pytest.mark.skipif(not HOST, reason="no host")
class TestReal:
    def test_method(self):
        pass


def test_double():
    pass
"""


def pytest_run(tree: Path, *args: str, **env: str) -> int:
    """pytest in ``tree`` (its own rootdir) with ``.ci/skipped.py`` loadable, as ``.ci/run`` calls it."""
    full = {k: v for k, v in os.environ.items() if k not in ("FAKE_HOST", "CI_SKIPPED", "CI_RUN_ONLY")}
    full.update(env, PYTHONPATH=str(CI), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # only pytest and the CI plugin
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "skipped", "-p", "no:cacheprovider", *args],
                          cwd=tree, env=full, capture_output=True, text=True).returncode  # fmt: skip


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    (root / "tests").mkdir(parents=True)
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "tests" / "test_hosts.py").write_text(textwrap.dedent(TREE))
    return root


def checker(*args: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CI / "real_hosts.py"), *map(str, args)], capture_output=True, text=True)


def test_a_listed_test_that_skips_again_in_its_host_fails_ci_by_name(tree: Path, tmp_path: Path):
    listed = tmp_path / "skipped.txt"
    assert pytest_run(tree, CI_SKIPPED=str(listed)) == 0
    assert listed.read_text().split() == [
        "tests/test_hosts.py::test_real[a]",
        "tests/test_hosts.py::test_real[b/c.d]",
        "tests/test_hosts.py::TestReal::test_method",
    ]
    old = tmp_path / "venv-old.xml"
    # the host phase passes (the old CI's only check) although one listed test skipped again
    assert pytest_run(tree, "--junitxml", str(old), CI_RUN_ONLY=str(listed), FAKE_HOST="old") == 0
    done = checker(listed, old)
    assert done.returncode == 1, done.stdout
    assert "tests/test_hosts.py::test_real[b/c.d]: skipped in venv-old" in done.stdout
    assert "test_real[a]:" not in done.stdout and "test_method" not in done.stdout

    new = tmp_path / "venv-new.xml"
    assert pytest_run(tree, "--junitxml", str(new), CI_RUN_ONLY=str(listed), FAKE_HOST="new") == 0
    done = checker(listed, old, new)  # passed in one environment of two: enough
    assert done.returncode == 0 and "all 3 listed passed" in done.stdout, done.stdout


def test_a_listed_test_no_environment_collects_fails_ci(tree: Path, tmp_path: Path):
    """Renamed or deselected everywhere: pytest exits 5 ("no tests collected"), which the old CI took for a pass."""
    listed = tmp_path / "skipped.txt"
    listed.write_text("tests/test_hosts.py::test_renamed\n")
    junit = tmp_path / "venv-host.xml"
    assert pytest_run(tree, "--junitxml", str(junit), "tests/test_hosts.py", CI_RUN_ONLY=str(listed), FAKE_HOST="new") == 5
    done = checker(listed, junit)
    assert done.returncode == 1 and "tests/test_hosts.py::test_renamed: not run anywhere" in done.stdout, done.stdout


def test_a_missing_junit_file_fails_unless_nothing_is_listed(tmp_path: Path):
    listed = tmp_path / "skipped.txt"
    listed.write_text("tests/test_x.py::test_y\n")
    done = checker(listed, tmp_path / "venv-gone.xml")
    assert done.returncode == 1 and "no junit-xml at" in done.stdout
    listed.write_text("")
    assert checker(listed, tmp_path / "venv-gone.xml").returncode == 0


def junit(path: Path, *cases: tuple[str, str, str]) -> Path:
    """A junit-xml file of (classname, name, outcome) testcases, as pytest writes them."""
    body = {"passed": "", "skipped": '<skipped message="s"/>', "failed": '<failure message="f"/>', "error": '<error message="e"/>'}
    rows = "".join(f'<testcase classname="{c}" name="{n}" time="0">{body[o]}</testcase>' for c, n, o in cases)
    path.write_text(f'<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">{rows}</testsuite></testsuites>')
    return path


def test_a_failure_or_teardown_error_is_not_a_pass(tmp_path: Path):
    runs = {
        "venv-a": real_hosts.outcomes(
            junit(
                tmp_path / "a.xml",
                ("tests.test_m", "test_f", "failed"),
                ("tests.test_m", "test_e", "passed"),
                ("tests.test_m", "test_e", "error"),
            )
        ),  # fmt: skip
    }
    assert real_hosts.unmet(["tests/test_m.py::test_f", "tests/test_m.py::test_e"], runs) == [
        "tests/test_m.py::test_f: failed in venv-a",
        "tests/test_m.py::test_e: failed in venv-a",
    ]


def test_a_listed_module_needs_a_test_run_and_every_test_of_it_passed_somewhere(tmp_path: Path):
    skipped_whole = junit(tmp_path / "a.xml", ("", "tests.test_lab", "skipped"))  # the module's own skip record
    ran = junit(tmp_path / "b.xml", ("tests.test_lab", "test_x", "passed"), ("tests.test_lab.TestY", "test_z", "skipped"),
                ("tests.test_labs", "test_other_module", "skipped"))  # fmt: skip
    runs = {"venv-a": real_hosts.outcomes(skipped_whole)}
    assert real_hosts.unmet(["tests/test_lab.py"], runs) == ["tests/test_lab.py (a module): no test of it ran in any environment"]
    runs["venv-b"] = real_hosts.outcomes(ran)
    assert real_hosts.unmet(["tests/test_lab.py"], runs) == [
        "tests/test_lab.py (a module), tests.test_lab.TestY::test_z: its module skipped whole in venv-a; skipped in venv-b"
    ]
