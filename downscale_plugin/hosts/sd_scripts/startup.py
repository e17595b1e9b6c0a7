"""Before the trainer: the drift self-check (``selfcheck.py``) of the sd-scripts checkout a training command
line runs, for the startup check (``downscale_plugin_startup.DRIFT_CHECKS``) and ``check -- SCRIPT ...``, and what
the script's architecture refuses whatever the checkout (:func:`command_line_refusals`).

It imports nothing heavy (torch, the host) unless the command runs an sd-scripts training script whose
checkout has the host's ``library`` package; then it imports the script too, for its own parser (the args the
check calls the host with are the run's), and forgets the host's modules again afterwards.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Mapping, Sequence
from typing import Any

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


def _option(arguments: Sequence[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` among a script's arguments (the last given), else None."""
    value = None
    for i, arg in enumerate(arguments):
        if arg == f"--{name}" and i + 1 < len(arguments):
            value = arguments[i + 1]
        elif arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
    return value


def script_arch(argv: Sequence[str], host_args: Mapping[str, Any]) -> str | None:
    """The architecture a command line trains: its script's record, ``--model_type`` (command line, else the
    training TOML's) picking within it as ``facts.trainer_arch`` does (None: no sd-scripts script)."""
    found = script_record(argv)
    if found is None:
        return None
    records = [r for r in TRAINER_ARCHS if r.script == found[0].script]
    model_type = _option(trainer_arguments(argv), "model_type") or host_args.get("model_type")
    chosen = [r for r in records if r.model_type is not None and r.model_type == model_type]
    return (chosen[0] if chosen else next(r for r in records if r.model_type is None)).arch


def command_line_refusals(argv: Sequence[str], cfg: Any, host_args: Mapping[str, Any]) -> list[str]:
    """What ``prepare_network`` would refuse of ``cfg`` for the architecture the command line trains, said before any
    model loads: ``attention = "proportional"`` where the architecture's attention cannot take it (``attention.py``)."""
    if cfg.fasterdit.attention != "proportional":
        return []
    arch = script_arch(argv, host_args)
    if arch is None:
        return []
    from .attention import refuse_unsupported

    try:
        refuse_unsupported(arch)
    except ValueError as err:
        return [str(err)]
    return []
