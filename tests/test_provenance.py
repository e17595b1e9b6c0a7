"""Every stored result records the code revision it was computed with."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from downscale_plugin import __version__, provenance
from downscale_plugin.provenance import code_revision


def test_a_checkout_reports_its_commit_and_whether_tracked_files_differ():
    root = Path(provenance.__file__).resolve().parent.parent
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    revision = code_revision()
    if head.returncode != 0:  # an sdist or wheel: no checkout to name
        assert revision == f"package {__version__}"
        return
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", revision)
    assert revision.startswith(head.stdout.strip())


def test_without_git_the_package_version_is_named(monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(provenance.subprocess, "run", no_git)
    assert code_revision() == f"package {__version__}"
