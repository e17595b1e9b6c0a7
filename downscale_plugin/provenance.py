"""The code revision a stored result was computed with.

Every stored result (a map, a certification, a lab base) records it, so that a figure can be traced
to the code that made it: the checkout's git commit, ``+dirty`` when tracked files differ from it,
or ``package <version>`` where the package is installed without a checkout.
"""

from __future__ import annotations

import subprocess
from importlib import metadata
from pathlib import Path


def code_revision() -> str:
    """``<commit>[+dirty]`` of the checkout this package runs from, else ``package <version>``."""
    root = Path(__file__).resolve().parent
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        if Path(top).resolve() != root.parent:  # the package sits inside some other repository
            raise subprocess.CalledProcessError(1, "git")
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return f"package {_version()}"
    return head + ("+dirty" if dirty.strip() else "")


def _version() -> str:
    """The installed distribution's version (core may not import the package entry, docs/ARCHITECTURE.md §1)."""
    try:
        return metadata.version("downscale-plugin")
    except metadata.PackageNotFoundError:
        return "unknown"
