"""Before the trainer: the drift self-check (``selfcheck.py``) of the sd-scripts checkout a training command
line runs, for the startup check (``downscale_plugin_startup.DRIFT_CHECKS``) and ``check -- SCRIPT ...``.

It imports nothing heavy (torch, the host) unless the command runs an sd-scripts training script whose
checkout has the host's ``library`` package; then it imports the script too, for its own parser (the args the
check calls the host with are the run's), and forgets the host's modules again afterwards.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Sequence

from ..kohya.conventions import host_imports, host_namespace, trainer_arguments
from .facts import TRAINER_ARCHS, TrainerArch

SCRIPTS = tuple(dict.fromkeys(record.script for record in TRAINER_ARCHS))
HOST_PACKAGES = ("library", "networks", *SCRIPTS)  # what the check imports from the checkout, and forgets again


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
    """The drift findings of the checkout a training command line runs, on the args the script will run with (its
    own ``setup_parser()`` on the command line and its training TOML); nothing when the command runs no sd-scripts
    script, the host is not importable here (the run checks again at ``prepare_network``) or the command line does
    not parse (the script says why)."""
    found = script_record(argv)
    if found is None:
        return []
    record, root = found
    with host_imports(root, HOST_PACKAGES):
        if importlib.util.find_spec(HOST_PACKAGES[0]) is None:
            return []
        from ..kohya.selfcheck import drift_problems, uncallable
        from .selfcheck import CHECKED_AGAINST, SCHEDULER_HANDLE, standalone

        try:
            module, script = importlib.import_module(record.sampler[0]), importlib.import_module(record.script)
        except ImportError:
            return []
        try:
            base = host_namespace(script.setup_parser(), trainer_arguments(argv))
        except Exception as err:
            return [uncallable(f"{record.script}.setup_parser", "the run's options for the self-check", err, CHECKED_AGAINST)]
        if base is None:
            return []
        try:
            checks = standalone(record, module, base)
        except Exception as err:  # the host's scheduler class, the fixed input of the flow pieces
            return [uncallable(".".join(SCHEDULER_HANDLE), "the self-check's fixed scheduler", err, CHECKED_AGAINST)]
        return drift_problems(checks, CHECKED_AGAINST)
