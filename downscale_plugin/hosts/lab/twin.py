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
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ...flops import FlopModel
from ...grid import target_grid
from ...lab.model import image_tokens
from ...lab.trainer import seed_micro_step, train_lora
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


@dataclass
class BudgetRun:
    """A twin run to a compute budget (``run_to_budget``): per step the tokens it ran and its clock
    seconds; per validation point (the first at step 0) the step, the training FLOPs and clock seconds
    spent so far, the validation loss and its per-item losses."""

    steps: list[int] = field(default_factory=list)  # validation points: steps done
    flops: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    val: list[float] = field(default_factory=list)
    items: list[list[float]] = field(default_factory=list)
    tokens_run: list[int] = field(default_factory=list)  # per step
    step_seconds: list[float] = field(default_factory=list)  # per step
    native_flops: float = 0.0  # the native twin's training FLOPs over ``native_steps``: the budget's unit
    deltas: dict[str, torch.Tensor] = field(default_factory=dict)  # the adapter's ΔW at the end


def native_run_flops(data: Any, seed: int, steps: int, batch_size: int, flop_model: FlopModel) -> float:
    """The training FLOPs of a native run's first ``steps`` steps: its batches' grids are a function
    of (seed, step), so every twin of the same seed shares it."""
    grids = (data.batch(step, batch_size, seed)["latents"].shape[-2:] for step in range(steps))
    return sum(batch_size * flop_model.flops(image_tokens(*hw)) for hw in grids)


def cosine_decay(progress: float) -> float:
    """The cosine schedule's factor at ``progress`` (0 → 1) of the run, zero from 1 on."""
    return 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))


SCHEDULES: dict[str, Callable[[float], float] | None] = {"constant": None, "cosine": cosine_decay}


def run_to_budget(
    model: Any,
    data: Any,
    plugin: LabPlugin | None,
    *,
    seed: int,
    native_steps: int,
    budget: float,
    points: int,
    lr: float,
    rank: int,
    validate: Callable[[dict], torch.Tensor],
    flop_model: FlopModel,
    batch_size: int = 1,
    schedule: Callable[[float], float] | None = None,
    clock: Callable[[], float] = time.process_time,
    step_budget: int | None = None,
) -> BudgetRun:
    """Train a twin until it has spent ``budget`` × its native twin's FLOPs over ``native_steps``,
    validating when the FLOPs spent first reach each k/``points`` of that unit (so every arm of a seed
    is read on one FLOP grid; a native twin at budget 1 stops at exactly ``native_steps``).

    ``validate(deltas)`` returns per-item native-grid losses (``lab.trainer.native_validation_losses``
    bound to the held-out set); a point's loss is their mean. ``schedule(progress)`` scales ``lr``
    by the FLOPs spent ÷ the native unit (not by steps), so every arm of a seed follows one learning-
    rate curve over compute and an arm that spends less per step decays over more steps.

    ``step_budget``: stop after that many steps instead (or at the FLOP budget, if sooner), the schedule
    read at the steps done ÷ ``step_budget`` (the same steps for every arm: fewer FLOPs for a routed one)."""
    if budget <= 0 or points < 1 or native_steps < 1:
        raise ValueError(f"budget must be > 0, points and native_steps >= 1 (got {budget}, {points}, {native_steps})")
    out = BudgetRun(native_flops=native_run_flops(data, seed, native_steps, batch_size, flop_model))
    twin = TwinRun(seed, flop_model, batch_size)
    spent, next_point, last = [0.0], [1], budget * out.native_flops * (1 - 1e-12)

    def tokens_of(step: int) -> int:
        return twin.native_tokens[step] if plugin is None else plugin.trace[step].tokens_run

    def step_done(done: int) -> bool:
        out.tokens_run.append(tokens_of(done - 1))
        spent[0] += batch_size * flop_model.flops(out.tokens_run[-1])
        return spent[0] >= last or done == step_budget

    def lr_factor(done: int) -> float:
        # called after step ``done``'s optimizer step, before ``step_done`` counts it
        if step_budget is not None:
            return schedule(done / step_budget)
        ahead = sum(batch_size * flop_model.flops(tokens_of(k)) for k in range(len(out.tokens_run), done))
        return schedule((spent[0] + ahead) / out.native_flops)

    def at_point(done: int) -> bool:
        reached = spent[0] >= next_point[0] * out.native_flops / points * (1 - 1e-12)
        while spent[0] >= next_point[0] * out.native_flops / points * (1 - 1e-12):
            next_point[0] += 1
        return reached

    def record(deltas: dict) -> float:
        items = validate(deltas)
        out.items.append([round(v, 7) for v in items.flatten().tolist()])
        out.val.append(items.mean().item())
        out.flops.append(spent[0])
        return out.val[-1]

    ceiling = math.ceil(budget * out.native_flops / (batch_size * min_step_flops(data, plugin, flop_model)))
    result = train_lora(
        model, data, steps=ceiling, lr=lr, rank=rank, seed=seed, batch_size=batch_size,
        hook_installer=None if plugin is None else plugin.installer, validate=record,
        validate_if=at_point, stop_if=step_done, step_scope=twin, clock=clock,
        lr_factor=None if schedule is None else lr_factor,
    )  # fmt: skip
    out.step_seconds, out.deltas = list(result.step_times), result.deltas
    elapsed = list(itertools.accumulate(result.step_times))
    out.steps = [steps for _, steps, _ in result.val_curve]
    out.seconds = [elapsed[s - 1] if s else 0.0 for s in out.steps]
    return out


def min_step_flops(data: Any, plugin: LabPlugin | None, flop_model: FlopModel) -> float:
    """The fewest FLOPs one sample's step can cost (its smallest reachable grid): bounds a budget run's steps."""
    grids = [data.cfg.latent_hw(b) for b in data.cfg.buckets]
    if plugin is not None:
        grids += [g for hw in grids for rule in plugin.cfg.routes if (g := target_grid(hw, rule.ratio, plugin.arch)) is not None]
    return min(flop_model.flops(image_tokens(*hw)) for hw in grids)
