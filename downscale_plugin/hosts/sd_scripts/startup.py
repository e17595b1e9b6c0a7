"""Before the trainer: the drift self-check (``selfcheck.py``) of the sd-scripts checkout a training command
line runs, for the startup check (``downscale_plugin_startup.DRIFT_CHECKS``) and ``check -- SCRIPT ...``.

It imports nothing heavy (torch, the host) unless the command runs an sd-scripts training script whose
checkout has the host's ``library`` package; the host's modules are forgotten again afterwards.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Sequence

from ..kohya.conventions import host_imports
from .facts import TRAINER_ARCHS, TrainerArch

HOST_PACKAGES = ("library",)  # what the check imports from the checkout, and forgets again


def script_record(argv: Sequence[str]) -> tuple[TrainerArch, str] | None:
    """The record of the sd-scripts training script a command line runs, and its checkout (None: not one)."""
    for arg in argv:
        name = os.path.basename(str(arg))
        if name.endswith(".py"):
            records = [r for r in TRAINER_ARCHS if r.script == name[:-3]]
            if records:
                return records[0], os.path.dirname(os.path.abspath(str(arg)))
    return None


def command_line_drift(argv: Sequence[str]) -> list[str]:
    """The drift problems of the checkout a training command line runs; nothing when the command runs no
    sd-scripts script or the host is not importable here (the run checks again at ``prepare_network``)."""
    found = script_record(argv)
    if found is None:
        return []
    record, root = found
    with host_imports(root, HOST_PACKAGES):
        if importlib.util.find_spec(HOST_PACKAGES[0]) is None:
            return []
        from ..kohya.selfcheck import drift_problems
        from .selfcheck import CHECKED_AGAINST, standalone

        try:
            checks = standalone(record, importlib.import_module(record.sampler[0]))
        except (ImportError, AttributeError):
            return []
        return drift_problems(checks, CHECKED_AGAINST)
