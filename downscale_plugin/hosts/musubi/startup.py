"""Before the trainer: the drift self-check (``selfcheck.py``) of the musubi-tuner a training command line runs,
for the startup check (``downscale_plugin_startup.DRIFT_CHECKS``) and ``check --host musubi -- SCRIPT ...``.

It imports nothing heavy (torch, the host) unless the command runs a supported musubi-tuner training script and
``musubi_tuner`` is importable, from the script's checkout (its ``src``: the wrapper scripts at the checkout's
root, the package's own scripts in ``src/musubi_tuner``) or as installed; the host's modules are forgotten again
afterwards. Importing ``training/trainer_base.py`` takes seconds (it imports accelerate, diffusers, transformers).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Sequence

from ..kohya.conventions import host_imports
from .facts import BY_ARCH, HOST_PACKAGE, MUSUBI_ARCHS, TRAINER_BASE, MusubiArch

SCRIPTS = {record.script: record.arch for record in MUSUBI_ARCHS}


def script_checkout(argv: Sequence[str]) -> tuple[MusubiArch, str | None] | None:
    """The record of the musubi-tuner training script a command line runs and the folder its ``musubi_tuner``
    package imports from (None: as installed), or None when it runs no supported musubi-tuner script."""
    argv = [str(a) for a in argv]
    for i, token in enumerate(argv):
        if token == "-m" and i + 1 < len(argv):
            name = argv[i + 1].rsplit(".", 1)[-1]
            return (BY_ARCH[SCRIPTS[name]], None) if name in SCRIPTS else None
        if token.endswith(".py") and not token.startswith("-"):
            name = os.path.basename(token)[:-3]
            if name not in SCRIPTS:
                continue  # a launcher's own script; the training script follows
            folder = os.path.dirname(os.path.abspath(token))
            roots = [
                root for root in (os.path.join(folder, "src"), os.path.dirname(folder)) if os.path.isdir(os.path.join(root, HOST_PACKAGE))
            ]
            return BY_ARCH[SCRIPTS[name]], roots[0] if roots else None
    return None


def command_line_drift(argv: Sequence[str]) -> list[str]:
    """The drift problems of the musubi-tuner a training command line runs; nothing when it runs no musubi-tuner
    script or musubi-tuner is not importable here (the run checks again at ``prepare_network``)."""
    found = script_checkout(argv)
    if found is None:
        return []
    record, root = found
    with host_imports(root, (HOST_PACKAGE,)):
        if importlib.util.find_spec(HOST_PACKAGE) is None:
            return []
        from ..kohya.selfcheck import drift_problems
        from .selfcheck import CHECKED_AGAINST, standalone

        try:
            checks = standalone(record, importlib.import_module(TRAINER_BASE))
        except (ImportError, AttributeError):
            return []
        return drift_problems(checks, CHECKED_AGAINST)
