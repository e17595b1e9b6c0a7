"""Before the trainer: the drift self-check (``selfcheck.py``) of the musubi-tuner a training command line runs,
for the startup check (``downscale_plugin_startup.DRIFT_CHECKS``) and ``check --host musubi -- SCRIPT ...``, and what
the run refuses of the config whatever the checkout (:func:`command_line_refusals`).

It imports nothing heavy (torch, the host) unless the command runs a supported musubi-tuner training script and
``musubi_tuner`` is importable, from the script's checkout (its ``src``: the wrapper scripts at the checkout's
root, the package's own scripts in ``src/musubi_tuner``) or as installed; the host's modules are forgotten again
afterwards. Importing ``training/trainer_base.py`` takes seconds (it imports accelerate, diffusers, transformers); the
training script is imported too, for its own parser (the args the check calls the host with are the run's).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from ..kohya.conventions import host_imports, host_namespace, trainer_arguments
from .facts import BASE_TRAINER, BY_ARCH, HOST_PACKAGE, MUSUBI_ARCHS, TRAINER_BASE, MusubiArch

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


def script_parser(script: ModuleType) -> argparse.ArgumentParser:
    """The parser a musubi-tuner training script's ``main`` builds: ``setup_parser_common()``, then the one
    ``<arch>_setup_parser`` the script defines itself."""
    own = [f for name, f in vars(script).items() if name.endswith("_setup_parser") and getattr(f, "__module__", None) == script.__name__]
    if len(own) != 1:
        raise LookupError(f"{script.__name__} defines {len(own)} functions named *_setup_parser, not one")
    return own[0](script.setup_parser_common())


def command_line_drift(argv: Sequence[str]) -> list[str]:
    """The drift findings of the musubi-tuner a training command line runs, on the args the script will run with (its
    own parser on the command line and its training TOML); nothing when it runs no musubi-tuner script, musubi-tuner or
    the script is not importable here (the run checks again at ``prepare_network``) or the command line does not parse
    (the script says why)."""
    found = script_checkout(argv)
    if found is None:
        return []
    record, root = found
    with host_imports(root, (HOST_PACKAGE,)):
        if importlib.util.find_spec(HOST_PACKAGE) is None:
            return []
        from ..kohya.selfcheck import drift_problems, uncallable
        from .selfcheck import CHECKED_AGAINST, standalone

        try:
            trainer_base = importlib.import_module(TRAINER_BASE)
            script = importlib.import_module(f"{HOST_PACKAGE}.{record.script}")
        except Exception:  # the script would fail to import the same way when it runs (e.g. a model module needing a GPU)
            return []
        try:
            base = host_namespace(script_parser(script), trainer_arguments(argv))
        except Exception as err:
            return [uncallable(f"{script.__name__}'s parser", "the run's options for the self-check", err, CHECKED_AGAINST)]
        if base is None:
            return []
        try:
            checks = standalone(record, trainer_base, base)
        except Exception as err:  # a fresh NetworkTrainer and its loop scheduler
            return [uncallable(f"{TRAINER_BASE}.{BASE_TRAINER}", "the self-check's trainer and scheduler", err, CHECKED_AGAINST)]
        return drift_problems(checks, CHECKED_AGAINST)


def command_line_refusals(argv: Sequence[str], cfg: Any, host_args: Mapping[str, Any]) -> list[str]:
    """What ``prepare_network`` refuses of ``cfg`` on musubi-tuner (``start.refuse_unsupported``), said before any
    model loads for a command line that runs a musubi-tuner script."""
    found = script_checkout(argv)
    if found is None:
        return []
    from .facts import HostError
    from .start import refuse_unsupported

    try:
        refuse_unsupported(cfg, found[0].arch)
    except HostError as err:
        return [str(err)]
    return []
