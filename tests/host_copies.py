"""Patched copies of a real host checkout, for the drift self-check's tests (``hosts/kohya/selfcheck.py``): a newer
host is simulated by editing a copy, never the checkout the other tests import."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def host_copy(source: str | os.PathLike, dest: Path, edits: tuple[tuple[str, str, str], ...]) -> Path:
    """``source`` copied to ``dest`` (without ``.git``) with each edit (file, a line found there once, the line put after
    it) applied."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    for name, anchor, line in edits:
        path = dest / name
        text = path.read_text(encoding="utf-8")
        assert text.count(anchor) == 1, (name, anchor)
        path.write_text(text.replace(anchor, f"{anchor}\n{line}"), encoding="utf-8")
    return dest


def startup_env(**extra: str) -> dict[str, str]:
    """This environment with the startup check on (``downscale_plugin_startup.pth``), offline, unwrapped logs."""
    env = {k: v for k, v in os.environ.items() if k != "DOWNSCALE_PLUGIN_NO_STARTUP_CHECK"}
    return {**env, "HF_HUB_OFFLINE": "1", "COLUMNS": "1000", **extra}
