"""A bound host σ sampler and the pool it replays from, for both kohya hosts (docs/ARCHITECTURE.md §3).

A host's σ family binds its trainer's own sampler to one step (``hosts/sd_scripts/families.py``,
``hosts/musubi/family.py``). Each sample is replayed by its position in the step's :class:`Pool` (every
(timestep, σ) pair drawn, in draw order: the router's ``RouteDecision.sources``), never by σ value: in
bf16 several of a timestep grid's values share one σ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...sigma import DiscreteLaw, SigmaLaw


@dataclass
class Pool:
    """Every (timestep, σ) pair one bound sampler produced, in draw order (float64, CPU)."""

    timesteps: list[float] = field(default_factory=list)
    sigmas: list[float] = field(default_factory=list)

    def add(self, timesteps: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
        """Record host-made pairs; returns their positions."""
        start = len(self.sigmas)
        self.timesteps.extend(timesteps.detach().reshape(-1).double().cpu().tolist())
        self.sigmas.extend(sigmas.detach().reshape(-1).double().cpu().tolist())
        return torch.arange(start, len(self.sigmas))

    def pairs(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(timesteps, σ) at these positions, float64."""
        index = positions.reshape(-1).tolist()
        t = torch.tensor([self.timesteps[i] for i in index], dtype=torch.float64)
        return t, torch.tensor([self.sigmas[i] for i in index], dtype=torch.float64)


def record_pairs(pool: Pool, timesteps: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """Record host (t, σ) per sample; return σ as the float64 values the router compares and hands back."""
    pool.add(timesteps, sigmas)
    return sigmas.detach().reshape(-1).double().cpu()


@dataclass(frozen=True)
class PooledLaw:
    """A σ law whose draws enter the step's pool like the host's own: an atom as its host (t, σ) pair, a
    continuous draw rounded to the host's σ dtype and paired as ``pair`` says (the host's t = σ·T)."""

    law: SigmaLaw
    pool: Pool
    pair: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None  # continuous laws only

    def masses(self, classify: Callable, edges: Any) -> dict[int, float]:
        return self.law.masses(classify, edges)

    def draw(self, n: int, category: int, classify: Callable, edges: Any, generator: torch.Generator) -> torch.Tensor:
        if isinstance(self.law, DiscreteLaw):
            atoms = self.law.draw_atoms(n, category, classify, generator)
            return record_pairs(self.pool, self.law.labels[atoms], self.law.values[atoms])
        return record_pairs(self.pool, *self.pair(self.law.draw(n, category, classify, edges, generator)))


@dataclass
class BoundSampler:
    """The host sampler bound to one step's arguments.

    ``first()`` reproduces the host's RNG use up to and including its σ draw (sd-scripts draws the
    noise inside the sampler's call first, musubi-tuner before it), so under a forked RNG it returns the σ the host is about to draw. ``draw(n)``
    returns n fresh σ the host's way. Both, and ``law``'s draws, record each sample's host-made
    (timestep, σ) in ``pool``; ``replay(positions)`` hands the host back those pairs.
    """

    first: Callable[[], torch.Tensor]
    draw: Callable[[int], torch.Tensor]
    replay: Callable[[torch.Tensor], Any]
    pool: Pool
    law: PooledLaw | None = None
