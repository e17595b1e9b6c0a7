"""Twin runs: two lab fine-tunes that differ only by routing.

A plain A/B on one seed shares the adapter init and the data order, but not the noise: the first
routed step draws its noise at a smaller grid, so every later step's noise and σ differ from the
native twin's, and the paired difference carries a noise lottery as large as the seed lottery
(docs/FIDELITY.md §6). Twin mode removes it. Each micro-step starts from its own seeded state of
torch's generator (``lab/trainer.py``'s :func:`seed_micro_step`, the same in both runs whatever the steps before consumed), so
both twins draw the same σ (the router's dry run replays the host's draw from that state); and the
step's noise is one native draw ε ~ N(0, I): a native step gets ε itself, a routed step gets the
paired transform M·ε of ``mapping/paired.py`` (exactly N(0, I) at the small grid: the noise the
host would draw there, the native draw's own coarse content). A twin whose router routes nothing
is therefore bitwise its native twin (``tests/test_quality.py``).
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

from ...flops import FlopModel
from ...lab.model import image_tokens
from ...lab.trainer import seed_micro_step
from ...mapping.paired import coupled_small_noise, injected_noise
from ...plan import plan_table
from .adapter import LabPlugin, lab_sampler


@contextmanager
def twin_step(seed: int, micro_step: int, batch: dict) -> Iterator[None]:
    """A ``train_lora`` ``step_scope``: reseed for this micro-step and hand the host's noise draw the
    native draw, or its paired transform when the step runs at a smaller grid."""
    seed_micro_step(seed, micro_step)
    native_shape = tuple(batch["latents"].shape)

    def noise(shape: tuple[int, ...]) -> torch.Tensor:
        native = torch.randn(native_shape)  # what the native twin's randn_like(latents) draws from this state
        return native if shape == native_shape else coupled_small_noise(native, shape[-2:])

    with injected_noise(noise):
        yield


class TwinRun:
    """A twin run's ``step_scope`` that also keeps each micro-step's native image tokens, so the run's
    training FLOPs (the project's FLOP model) can be told per step: a routed step costs its run
    tokens (``LabPlugin.trace``), a native one its native tokens."""

    def __init__(self, seed: int, flop_model: FlopModel, batch_size: int = 1) -> None:
        self.seed, self.flop_model, self.batch_size = seed, flop_model, batch_size
        self.native_tokens: list[int] = []

    def __call__(self, micro_step: int, batch: dict) -> AbstractContextManager:
        self.native_tokens.append(image_tokens(*batch["latents"].shape[-2:]))
        return twin_step(self.seed, micro_step, batch)

    def flops(self, plugin: LabPlugin | None = None) -> tuple[list[float], list[float]]:
        """Cumulative training FLOPs after each micro-step: (as run, had every step been native)."""
        native = self.native_tokens
        run = native if plugin is None else [t.tokens_run for t in plugin.trace]
        if len(run) != len(native):
            raise RuntimeError(f"the plugin traced {len(run)} steps of a twin run's {len(native)}")
        cost = [self.batch_size * self.flop_model.flops(n) for n in run], [self.batch_size * self.flop_model.flops(n) for n in native]
        return list(itertools.accumulate(cost[0])), list(itertools.accumulate(cost[1]))


def planned_saving(plugin: LabPlugin, args: argparse.Namespace, steps: int) -> float:
    """The plan's FLOP saving of ``plugin``'s routes under the run's σ sampler (``args``: the run's ``lab_args``)."""
    plan = plan_table(plugin.cfg, plugin.arch, lab_sampler(args), plugin.buckets, plugin.batch_size,
                      flop_model=plugin.flop_model, total_forwards=steps)  # fmt: skip
    return plan.flop_saving


def equal_compute_steps(native_steps: int, saving: float, extra: float = 1.1) -> int:
    """Steps a routed twin runs to pass its native twin's FLOPs: ``extra`` × the planned equal-compute
    step, since the realized saving scatters around the plan's."""
    if not 0.0 <= saving < 1.0:
        raise ValueError(f"saving must be in [0, 1) (got {saving})")
    return math.ceil(extra * native_steps / (1.0 - saving))
