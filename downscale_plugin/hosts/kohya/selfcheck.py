"""Host drift caught at start: the host's own function on a tiny fixed input against the plugin's version.

Where a routed step can call the host's own function at the small grid, it does, and nothing can drift.
What the plugin still re-implements (the noisy input a replayed σ is built into, a σ law's exact fill,
a μ table) is a :class:`Piece`: what the plugin does, the host function it mirrors, and a ``compare`` that
runs both on a tiny fixed input and says what differs. A host whose function changed since the revision
the plugin was checked against then stops the run before it trains a single routed step, naming the
function and that revision (:func:`refuse_drift`), instead of training on a formula the host no longer uses.

Every ``compare`` runs on the CPU inside :func:`~downscale_plugin.rng.forked` with its forks seeded
(:func:`~downscale_plugin.rng.seed_forked`): it may draw from the global generators exactly as the host
function does, and leaves them as they were. A check that runs before the trainer (the startup check,
``check --``) imports the host from its checkout with :func:`~.conventions.host_imports`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ...rng import forked, seed_forked

SEED = 0  # every compare's forks start here


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


def drift_problems(pieces: Iterable[Piece], checked_against: str) -> list[str]:
    """One line per piece whose host function no longer agrees with the plugin (a compare that raises counts)."""
    problems = []
    for piece in pieces:
        with forked():
            seed_forked(SEED)
            try:
                difference = piece.compare()
            except Exception as err:  # a signature or contract change is drift too
                difference = f"it raised {type(err).__name__}: {err}"
        if difference:
            problems.append(
                f"{piece.function} no longer matches {piece.what} ({difference}); the plugin was checked against {checked_against}"
            )
    return problems


def refuse_drift(pieces: Iterable[Piece], checked_against: str, error: type[Exception]) -> None:
    """Raise ``error`` listing every drifted piece (nothing when all agree)."""
    problems = drift_problems(pieces, checked_against)
    if problems:
        raise error(
            "the host's own functions differ from what the plugin re-implements of them; routed steps would train on "
            "formulas the host no longer uses:\n  - " + "\n  - ".join(problems)
        )
