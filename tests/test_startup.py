"""The startup check (``downscale_plugin_startup``, imported by ``downscale_plugin_startup.pth`` at every
interpreter start): a bad plugin config fails before the trainer runs; every other command is untouched.

In-process tests call ``report(argv)``; subprocess tests run ``main()`` as the ``.pth`` line does, with the
argv set first (``sys.modules`` shows what it imported). The installed ``.pth`` itself is tested when the
running interpreter has it (``pip install -e .``, as ``.ci/run`` does), and the build puts it into both
wheels.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

import downscale_plugin_startup as startup

ROOT = Path(__file__).resolve().parent.parent
PTH = "downscale_plugin_startup.pth"

TRAIN = """
    [model]
    pretrained_model_name_or_path = "flux1-dev.safetensors"
    network_module = "downscale_plugin"
    network_args = ["ds_seed=7"]

    [plugins.downscale]
    gate = "coupled"

    [[plugins.downscale.routes]]
    route = "1024:768"
    sigma_min = 0.65
    sigma_max = 0.95
"""


def _write(path: Path, text: str) -> str:
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture
def train(tmp_path) -> str:
    return _write(tmp_path / "train.toml", TRAIN)


def _problems(argv) -> list[str]:
    text = startup.report(argv)
    assert text is not None, f"no report for {argv}"
    assert "stopped before the trainer loads any model" in text and "DOWNSCALE_PLUGIN_NO_STARTUP_CHECK=1" in text
    return [line[4:] for line in text.splitlines() if line.startswith("  - ")]


# --- which commands it checks ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "prefix",
    [
        ["flux_train_network.py"],  # python flux_train_network.py ... (sys.argv[0] is the script)
        ["/venv/bin/accelerate", "launch", "--num_processes", "2", "--config_file", "accelerate.yaml", "flux_train_network.py"],
        ["-m", "--config_file", "accelerate.yaml", "sd3_train_network.py"],  # python -m accelerate.commands.launch ...
        ["/venv/bin/torchrun", "--nproc_per_node", "2", "/abs/train_network.py"],
        ["-m"],  # python -m flux_train_network ...
        [],  # check -- --config_file ...: the arguments alone
    ],
    ids=["script", "accelerate-launch", "python-m-launcher", "torchrun", "python-m-script", "arguments-only"],
)
def test_every_launch_shape_is_checked(prefix, train):
    argv = [*prefix, "--config_file", train, "--network_args", "ds_gate=sometimes"]
    assert _problems(argv) == ["[network_args] ds_gate: 'sometimes' is not allowed (allowed: coupled, strict)"]


@pytest.mark.parametrize(
    "named",
    [
        ["--network_module", "downscale_plugin"],
        ["--network_module=downscale_plugin"],
        ["--network_mod", "downscale_plugin"],  # argparse takes a unique prefix, as the trainer's parser does
    ],
)
def test_network_module_on_the_command_line(named):
    (found,) = _problems(["train_network.py", *named, "--network_args", "ds_routes=1024:768@a-0.95"])
    assert found.startswith("[network_args] ds_routes: entry '1024:768@a-0.95': sigma_min 'a' is not a number (form: ROUTE@LO-HI")


def test_network_module_in_the_toml_only(tmp_path):
    path = _write(tmp_path / "t.toml", TRAIN.replace('gate = "coupled"', 'gate = "sometimes"'))
    (found,) = _problems(["flux_train_network.py", "--config_file", path])
    assert found.startswith("[plugins.downscale] gate: 'sometimes'")
    assert _problems(["flux_train_network.py", "--config_file", path[: -len(".toml")]]) == [found]  # the trainer appends .toml


def test_the_command_lines_network_module_wins_over_the_toml(tmp_path):
    path = _write(tmp_path / "t.toml", TRAIN.replace('gate = "coupled"', 'gate = "sometimes"'))
    assert startup.report(["flux_train_network.py", "--config_file", path, "--network_module", "networks.lora_flux"]) is None


def test_the_command_lines_network_args_replace_the_tomls(tmp_path):
    bad_in_toml = _write(tmp_path / "bad.toml", TRAIN.replace('"ds_seed=7"', '"ds_seed=seven"'))
    assert _problems(["x.py", "--config_file", bad_in_toml]) == ["[network_args] ds_seed: 'seven' is not an integer"]
    assert startup.report(["x.py", "--config_file", bad_in_toml, "--network_args", "ds_seed=7"]) is None
    good = _write(tmp_path / "good.toml", TRAIN)
    assert _problems(["x.py", "--config_file", good, "--network_args", "ds_seed=seven", "dim=4", "oops"]) == [
        "network_args: 'oops' is not of the form key=value",
        "[network_args] ds_seed: 'seven' is not an integer",
    ]


def test_every_source_the_network_module_reads(tmp_path):
    """network_args, [plugins.downscale] and the downscale_config plugin TOML (relative to the training TOML)."""
    (tmp_path / "cfg").mkdir()
    _write(tmp_path / "cfg" / "plugin.toml", "max_trys = 3\n")
    path = _write(
        tmp_path / "cfg" / "train.toml",
        TRAIN.replace('gate = "coupled"', 'gate = "coupled"\ndownscale_config = "plugin.toml"\nseed = -1'),
    )
    found = _problems(["flux_train_network.py", "--config_file", path, "--network_args", "ds_max_tries=0"])
    heads = sorted(p.split(":")[0] for p in found)
    assert heads == ["[downscale_config] max_trys", "[network_args] ds_max_tries", "[plugins.downscale] seed"], found
    missing = _write(tmp_path / "m.toml", TRAIN.replace('gate = "coupled"', 'downscale_config = "nope.toml"'))
    assert _problems(["x.py", "--config_file", missing]) == [f"downscale_config: file not found: {tmp_path / 'nope.toml'}"]


def test_a_one_level_downscale_table_is_refused(tmp_path):
    path = _write(tmp_path / "t.toml", TRAIN + '\n[downscale]\ngate = "strict"\n')
    (found,) = _problems(["x.py", "--config_file", path])
    assert found.startswith("[downscale]: a one-level table")


def test_a_good_config_passes(train):
    assert startup.report(["flux_train_network.py", "--config_file", train]) is None
    assert (
        startup.report(["x.py", "--network_module", "downscale_plugin", "--network_args", "ds_routes=x0.5@0.3-", "ds_gate=strict"]) is None
    )


@pytest.mark.parametrize(
    "argv",
    [
        [],
        [""],
        ["python"],
        ["-c"],
        ["pytest", "-q", "tests"],
        ["x.py", "--config_file", "accelerate.yaml"],
        ["x.py", "--config_file"],
        ["x.py", "--config_file=", "--network_module"],
        ["x.py", "--network_module"],  # the trainer's parser reports it
        ["x.py", "--network", "downscale_plugin"],  # ambiguous abbreviation: the trainer's parser reports it
        ["x.py", "--network_module", "downscale_plugin", "--help"],
        ["x.py", "--network_module", "downscale_plugin", "--network_args", "ds_gate=x", "--output_config", "--config_file", "new.toml"],
        ["x.py", "--network_module", "networks.lora", "--network_args", "ds_gate=sometimes"],
        ["x.py", "--", "--network_module", "downscale_plugin", "--network_args", "ds_gate=x"],
        ["x.py", "--network_module", "downscale_plugin_other"],
    ],
)
def test_other_commands_and_odd_argv_are_left_alone(argv):
    assert startup.report(argv) is None


def test_unreadable_toml_is_left_to_the_trainer(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text('network_module = "downscale_plugin"\nnetwork_dim = = 4\n')
    assert startup.report(["x.py", "--config_file", str(path)]) is None  # network_module not readable: not ours to say
    assert _problems(["x.py", "--config_file", str(path), "--network_module", "downscale_plugin"])[0].startswith("config_file:")


def test_own_commands_are_not_checked_twice(monkeypatch):
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "downscale_plugin", "check", "--", "x.py"], raising=False)
    assert startup._own_command()
    monkeypatch.setattr(sys, "orig_argv", ["python", "x.py", "--network_module", "downscale_plugin"], raising=False)
    monkeypatch.setattr(sys, "argv", ["x.py", "--network_module", "downscale_plugin"])
    assert not startup._own_command()


# --- as the .pth runs it: subprocesses ------------------------------------------------------------

PROBE = """
import sys
sys.argv = {argv!r}
import downscale_plugin_startup  # an installed .pth may have imported it already: main() is what the line runs
downscale_plugin_startup.main()
print("SCRIPT RAN", sorted(set(m.split(".")[0] for m in sys.modules) & set(("torch", "toml", "downscale_plugin", "numpy"))))
"""


def _probe(argv, **env):
    full = {k: v for k, v in os.environ.items() if k != startup.DISABLE}
    full = {**full, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env}
    return subprocess.run([sys.executable, "-c", PROBE.format(argv=list(argv))], capture_output=True, text=True, env=full, cwd=ROOT)


def test_bad_config_exits_2_before_the_script(train):
    proc = _probe(["flux_train_network.py", "--config_file", train, "--network_args", "ds_gate=sometimes", "ds_max_tries=0"])
    assert proc.returncode == 2, proc.stderr
    assert "SCRIPT RAN" not in proc.stdout
    assert proc.stderr.startswith("downscale_plugin: 2 problem(s):\n  - [network_args] ds_gate: 'sometimes'"), proc.stderr
    assert "[network_args] ds_max_tries: 0 is out of range" in proc.stderr and "Traceback" not in proc.stderr


def test_nothing_is_imported_unless_the_plugin_is_named():
    proc = _probe(["train.py", "--config_file", "other.yaml", "--lr", "1"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "SCRIPT RAN []", proc.stdout  # no toml, no torch, not even the package


def test_a_good_config_leaves_nothing_imported_and_no_torch(train):
    proc = _probe(["flux_train_network.py", "--config_file", train])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "SCRIPT RAN ['toml']", proc.stdout  # the package is gone again; torch never came
    assert not proc.stderr


def test_disabled_by_the_environment(train):
    argv = ["flux_train_network.py", "--config_file", train, "--network_args", "ds_gate=sometimes"]
    proc = _probe(argv, DOWNSCALE_PLUGIN_NO_STARTUP_CHECK="1")
    assert proc.returncode == 0 and proc.stdout.strip() == "SCRIPT RAN []", (proc.stdout, proc.stderr)
    assert _probe(argv, DOWNSCALE_PLUGIN_NO_STARTUP_CHECK="0").returncode == 2


def test_a_failing_check_never_breaks_the_command(train, tmp_path):
    """An error inside the check itself: one warning line, and the command runs."""
    fake = tmp_path / "fake"
    (fake / "downscale_plugin" / "hosts" / "kohya").mkdir(parents=True)
    for package in ("downscale_plugin", "downscale_plugin/hosts", "downscale_plugin/hosts/kohya"):
        (fake / package / "__init__.py").write_text("")
    (fake / "downscale_plugin" / "hosts" / "kohya" / "conventions.py").write_text("raise RuntimeError('boom')\n")
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(argv=["x.py", "--config_file", train])],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), str(ROOT)]), startup.DISABLE: ""},
        cwd=tmp_path,
    )
    assert proc.returncode == 0 and "SCRIPT RAN" in proc.stdout, proc.stderr
    assert "startup check did not run (RuntimeError: boom)" in proc.stderr


# --- installation ---------------------------------------------------------------------------------


def _installed_pth() -> Path | None:
    for key in ("purelib", "platlib"):
        path = Path(sysconfig.get_paths()[key]) / PTH
        if path.is_file():
            return path
    return None


@pytest.mark.skipif(_installed_pth() is None, reason="downscale_plugin_startup.pth is not installed (pip install -e .)")
def test_the_installed_pth_runs_the_check_at_interpreter_start(tmp_path, train):
    script = tmp_path / "flux_train_network.py"
    script.write_text("print('SCRIPT RAN')\n")
    env = {k: v for k, v in os.environ.items() if k != startup.DISABLE}
    bad = subprocess.run(
        [sys.executable, str(script), "--config_file", train, "--network_args", "ds_gate=sometimes"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert bad.returncode == 2 and "SCRIPT RAN" not in bad.stdout and "ds_gate: 'sometimes'" in bad.stderr, (bad.stdout, bad.stderr)
    good = subprocess.run([sys.executable, str(script), "--config_file", train], capture_output=True, text=True, env=env)
    assert good.returncode == 0 and good.stdout == "SCRIPT RAN\n" and not good.stderr, good.stderr


def _pth_line() -> str:
    namespace: dict = {}
    exec(next(line for line in (ROOT / "setup.py").read_text().splitlines() if line.startswith("PTH_LINE = ")), namespace)
    return namespace["PTH_LINE"]


def test_the_pth_line_is_guarded():
    line = _pth_line()
    assert line.startswith("import ") and line.count("\n") == 1  # site.py executes one-line 'import' entries
    proc = subprocess.run([sys.executable, "-S", "-c", line], capture_output=True, text=True, cwd="/", env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0 and not proc.stderr  # the module missing: silent


@pytest.mark.parametrize("kind", ["wheel", "editable"])
def test_both_wheels_install_the_pth_into_site_packages(kind, tmp_path):
    """``pip install .`` and ``pip install -e .`` install a wheel's root files into purelib: the .pth must be there."""
    pytest.importorskip("setuptools.command.editable_wheel", reason="setuptools >= 64 builds the wheels (pip's build does)")
    code = f"from setuptools import build_meta; print(build_meta.build_{kind}({str(tmp_path)!r}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheel = tmp_path / proc.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert PTH in names, names
        assert zf.read(PTH).decode() == _pth_line()
        if kind == "wheel":
            assert "downscale_plugin_startup.py" in names
        else:  # the editable finder maps the top-level module to the checkout
            finder = next(n for n in names if n.endswith("_finder.py"))
            assert "downscale_plugin_startup" in zf.read(finder).decode()
