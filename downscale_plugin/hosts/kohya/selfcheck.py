"""Host drift caught at start: the host's own function on a tiny fixed input against the plugin's version.

Where a routed step can call the host's own function at the small grid, it does, and nothing can drift.
What the plugin still re-implements (the noisy input a replayed σ is built into, a σ law's exact fill,
a μ table) is a :class:`Piece`: what the plugin does, the host function it mirrors, and a ``compare`` that
runs both on a tiny fixed input and says what differs. A host whose function changed since the revision
the plugin was checked against then stops the run before it trains a single routed step, naming the
function and that revision (:func:`refuse_drift`), instead of training on a formula the host no longer uses.

The host's functions are called with the run's own ``args`` (the trainer's inside the run; before it, the
training script's own parser on the command line) with only the options a piece fixes set over them, so a
host that merely added options, at neutral defaults, passes. Two findings are told apart: the host's result
differs from the plugin's (a changed formula), or the probe could not call the host at all (the exception:
a changed signature or contract, whose formula is then unknown). ``host_check = "warn"`` (``config.py``)
turns both from a refusal into a warning the run records in its LoRA's metadata (:data:`METADATA_KEY`).

Every ``compare`` runs on the CPU inside :func:`~downscale_plugin.rng.forked` with its forks seeded
(:func:`~downscale_plugin.rng.seed_forked`): it may draw from the global generators exactly as the host
function does, and leaves them as they were. A check that runs before the trainer (the startup check,
``check --``) imports the host from its checkout with :func:`~.conventions.host_imports`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ...rng import forked, plugin_logger, seed_forked

SEED = 0  # every compare's forks start here
METADATA_KEY = "ss_downscale_host_check"  # the findings a run trained on anyway (host_check = "warn"), a JSON list
logger = plugin_logger(__name__)


@dataclass(frozen=True)
class Piece:
    """One piece the plugin re-implements: ``what`` (the plugin's side, e.g. "the routed step's noisy
    input (families.FlowFamily replay)"), ``function`` (the host function it mirrors, dotted), and
    ``compare()`` → None when they agree on the tiny input, else what differs."""

    what: str
    function: str
    compare: Callable[[], str | None]


def same(name: str, ours: torch.Tensor, host: torch.Tensor, atol: float = 0.0) -> str | None:
    """None when ``ours`` equals ``host`` (bit for bit, or within ``atol``), else what differs about ``name``."""
    ours, host = torch.as_tensor(ours), torch.as_tensor(host)
    if ours.shape != host.shape:
        return f"{name}: shape {tuple(host.shape)} from the host, {tuple(ours.shape)} from the plugin"
    if atol == 0.0 and ours.dtype != host.dtype:
        return f"{name}: dtype {host.dtype} from the host, {ours.dtype} from the plugin"
    gap = (ours.double() - host.double()).abs().max().item() if ours.numel() else 0.0
    if (atol == 0.0 and not torch.equal(ours, host)) or gap > atol:
        return f"{name}: max |host − plugin| = {gap:.3g}" + (f" (allowed {atol:g})" if atol else " (bitwise expected)")
    return None


def differs(piece: Piece, difference: str, checked_against: str) -> str:
    """A finding: the host's function returned another result than the plugin's version of it (a changed formula)."""
    return (
        f"{piece.function} no longer matches {piece.what}: the host's result differs ({difference}), "
        f"its formula changed; the plugin was checked against {checked_against}"
    )


def uncallable(function: str, what: str, err: BaseException, checked_against: str) -> str:
    """A finding: the probe could not call (or prepare the call of) the host's ``function``; its formula is unknown."""
    return (
        f"the plugin's probe could not call {function} to check {what} ({type(err).__name__}: {err}): its signature "
        f"or what it needs changed, so whether its formula still matches is unknown; the plugin was checked against {checked_against}"
    )


def drift_problems(pieces: Iterable[Piece], checked_against: str) -> list[str]:
    """One finding per piece whose host function no longer agrees with the plugin (:func:`differs`) or
    that the probe could not call (:func:`uncallable`)."""
    problems = []
    for piece in pieces:
        with forked():
            seed_forked(SEED)
            try:
                difference = piece.compare()
            except Exception as err:  # the call itself failed: no result to compare
                problems.append(uncallable(piece.function, piece.what, err, checked_against))
                continue
        if difference:
            problems.append(differs(piece, difference, checked_against))
    return problems


HEADLINE = "the host's own functions differ from what the plugin re-implements of them, or its probe could not call them"


def warned(problems: list[str], policy: str) -> list[str]:
    """The findings ``host_check`` (``policy``, ``config.py``) refuses: all with "error"; none with "warn",
    which logs each instead (the startup check and ``check --`` go on with it)."""
    if policy != "warn":
        return problems
    for problem in problems:
        logger.warning('downscale_plugin: %s; host_check = "warn": training on', problem)
    return []


def settle_drift(problems: list[str], policy: str, error: type[Exception]) -> list[str]:
    """``host_check`` on a run's findings: "error" raises ``error`` listing them (nothing when there are none);
    "warn" logs each (:func:`warned`) and returns them, for the LoRA's metadata (:data:`METADATA_KEY`)."""
    if warned(problems, policy):
        raise error(
            f"{HEADLINE}; routed steps could train on formulas the host no longer uses "
            '(host_check = "warn" trains on and records this in the LoRA\'s metadata):\n  - ' + "\n  - ".join(problems)
        )
    return problems


def refuse_drift(pieces: Iterable[Piece], checked_against: str, error: type[Exception], policy: str = "error") -> list[str]:
    """:func:`settle_drift` on the pieces' findings."""
    return settle_drift(drift_problems(pieces, checked_against), policy, error)
