"""``map --resume``: a map that ends early keeps its finished cells and resumes to the map run in one go."""

from __future__ import annotations

import json

import pytest

from downscale_plugin.__main__ import main
from downscale_plugin.mapping import cli as map_cli
from downscale_plugin.mapping.journal import JOURNAL, CellJournal

# two images x (two bins + the σ = 1 endpoint): six cells, each with both natives and one route
ARGV = ["map", "--lab", "--quick", "--native_size", "16x16", "--ratios", "0.5", "--bins", "0,0.5,1"]
ARGV += ["--draws", "2", "--images", "2", "--warm_steps", "3", "--rank", "4", "--threads", "1", "--no_progress"]
CELLS = 6


class Interrupted(Exception):
    """Stands for a process that ends mid-map (a session's end, a preempted job)."""


@pytest.fixture
def lab_map(tiny_lab, monkeypatch):
    """``map`` with the lab source building ``tiny_lab`` (conftest); returns a runner that counts model builds."""
    from downscale_plugin.hosts.lab import map_backend

    builds = []
    monkeypatch.setattr(map_backend, "LabBackend", lambda cfg, images, progress: builds.append(cfg) or tiny_lab)

    def run(*extra: str) -> int:
        return main([*ARGV, *extra])

    run.builds = builds
    return run


def _cells(out) -> list[dict]:
    return json.loads((out / "map.json").read_text())["cells"]


def _settings(toml_path) -> list[str]:
    """A windows file's lines less its comments and date (they name the output folder and the time)."""
    return [line for line in toml_path.read_text().splitlines() if not line.startswith(("#", "windows_date"))]


def _interrupted(lab_map, out, monkeypatch, count: int) -> None:
    """``map --out out`` ended by the process's end right after its ``count``-th cell reached the journal."""
    real, calls = CellJournal.append, []

    def append(self, cell, seconds):
        real(self, cell, seconds)
        calls.append(cell)
        if len(calls) == count:
            raise Interrupted

    with monkeypatch.context() as patch:
        patch.setattr(CellJournal, "append", append)
        with pytest.raises(Interrupted):
            lab_map("--out", str(out))


def _measured(monkeypatch) -> list:
    """The (image, bin) of every cell measured from now on (each reaches the journal as it ends)."""
    real, cells = CellJournal.append, []
    monkeypatch.setattr(CellJournal, "append", lambda self, cell, s: cells.append((cell.image, cell.bin)) or real(self, cell, s))
    return cells


def test_an_interrupted_map_resumes_to_the_map_run_in_one_go(lab_map, tmp_path, monkeypatch):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert lab_map("--out", str(whole)) == 0
    assert not (whole / JOURNAL).exists()  # the outputs hold every cell; the journal goes

    _interrupted(lab_map, parts, monkeypatch, 4)
    journal = (parts / JOURNAL).read_text().splitlines()
    assert len(journal) == 1 + 4 and not (parts / "map.json").exists()
    with open(parts / JOURNAL, "a") as fh:
        fh.write(journal[-1][:30])  # the process ended while writing a fifth cell: a torn line

    assert lab_map("--out", str(parts), "--resume") == 0
    assert _cells(parts) == _cells(whole)  # every cell bit for bit (JSON floats round-trip exactly)
    stored = json.loads((parts / "map.json").read_text())
    assert stored["rows"] == json.loads((whole / "map.json").read_text())["rows"]
    assert stored["provenance"]["resumed"]["cells"] == 4 and not (parts / JOURNAL).exists()
    assert _settings(parts / "windows.toml") == _settings(whole / "windows.toml")


def test_resume_measures_only_the_cells_the_journal_lacks(lab_map, tmp_path, monkeypatch):
    out = tmp_path / "m"
    _interrupted(lab_map, out, monkeypatch, 5)
    measured = _measured(monkeypatch)
    assert lab_map("--out", str(out), "--resume") == 0
    assert measured == [(1, 2)]  # the sixth cell alone (image-major, bins in order)
    assert len(_cells(out)) == CELLS


def test_a_journal_under_other_settings_or_code_is_refused_before_the_model_loads(lab_map, tmp_path, monkeypatch, capsys):
    out = tmp_path / "m"
    _interrupted(lab_map, out, monkeypatch, 2)
    builds = len(lab_map.builds)
    capsys.readouterr()

    assert main([*ARGV, "--out", str(out), "--resume", "--draws", "4"]) == 2
    assert "draws: 2 in the journal, 4 now" in capsys.readouterr().err
    monkeypatch.setattr(map_cli, "code_revision", lambda: "0" * 40)
    assert lab_map("--out", str(out), "--resume") == 2
    assert "code_revision" in capsys.readouterr().err
    assert len(lab_map.builds) == builds  # refused before any model was built
    assert len((out / JOURNAL).read_text().splitlines()) == 1 + 2  # and the journal is kept


def test_without_resume_a_journal_is_started_over_and_resume_without_one_measures_all(lab_map, tmp_path, monkeypatch, capsys):
    out = tmp_path / "m"
    _interrupted(lab_map, out, monkeypatch, 2)
    measured = _measured(monkeypatch)
    assert lab_map("--out", str(out)) == 0
    assert len(measured) == CELLS and "provenance" in json.loads((out / "map.json").read_text())
    assert "resumed" not in json.loads((out / "map.json").read_text())["provenance"]

    assert lab_map("--out", str(tmp_path / "fresh"), "--resume") == 0
    assert "resume: no " in capsys.readouterr().out and len(measured) == 2 * CELLS


def test_resume_is_refused_with_from_json(tmp_path, capsys):
    assert main(["map", "--from_json", str(tmp_path / "map.json"), "--resume"]) == 2
    assert "--resume: a measurement flag" in capsys.readouterr().err
