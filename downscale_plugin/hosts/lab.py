"""Host adapter for the lab trainer: the plugin attached the way ``prepare_network`` attaches it
to sd-scripts, through the same hook, sampler family and accounting (no separate code path).

The lab's "VAE" is a 4× pixel unshuffle, so its latent grid gets its own :class:`ArchSpec`
(Flux packing: multiple 2, patch 2) and route tiers read in lab pixels (``"256:192"``).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..accounting import Accounting, FlopModel, StepRecord
from ..config import DownscaleConfig
from ..grid import ArchSpec
from ..lab import flux_train_utils
from ..lab.data import FACTOR
from ..plan import Plan, plan_table
from ..router import RouteDecision, Router
from ..sigma import SigmaSampler
from .families import FlowFamily
from .hook import DownscaleHook

LAB_ARCH = ArchSpec("lab", multiple=2, patch=2, vae_factor=FACTOR)


def lab_sampler(args: argparse.Namespace) -> SigmaSampler:
    """The lab trainer's σ sampler as a ``plan`` sampler (same formulas as its sampler module)."""
    return SigmaSampler(
        mode=args.timestep_sampling,
        sigmoid_scale=args.sigmoid_scale,
        discrete_flow_shift=args.discrete_flow_shift,
        weighting_scheme=args.weighting_scheme,
        logit_mean=args.logit_mean,
        logit_std=args.logit_std,
        mode_scale=args.mode_scale,
    )


@dataclass
class StepTrace:
    """What the plugin did on one lab train step (for the demo's route timeline)."""

    step: int
    rule_index: int
    tokens_run: int
    sigmas: list[float]


@dataclass
class LabPlugin:
    """Plugin state for one lab run: ``installer`` is the lab trainer's ``hook_installer``."""

    cfg: DownscaleConfig
    flop_model: FlopModel
    buckets: Sequence[tuple[int, int]]  # latent (h, w) the run can see, each equally likely
    batch_size: int = 1
    accounting: Accounting | None = None
    plan: Plan | None = None
    trace: list[StepTrace] = field(default_factory=list)

    @contextmanager
    def installer(self, trainer: object, args: argparse.Namespace) -> Iterator[None]:
        total = args.max_train_steps * args.gradient_accumulation_steps
        seed = self.cfg.seed if self.cfg.seed is not None else args.seed
        router = Router.from_config(self.cfg, LAB_ARCH, seed, total)
        self.plan = plan_table(
            self.cfg, LAB_ARCH, lab_sampler(args), self.buckets, self.batch_size, flop_model=self.flop_model, total_forwards=total
        )
        self.accounting = Accounting(
            self.cfg.routes,
            self.flop_model,
            self.plan.probs,
            predicted_flop_saving=self.plan.flop_saving,
            token_values=Accounting.vocabulary(self.buckets, self.cfg.routes, LAB_ARCH, self.cfg.tier_tolerance),
        )
        hook = DownscaleHook(router, FlowFamily(flux_train_utils, "flux"), on_step=self._on_step, step_logs=self._step_logs)
        hook.install(trainer)
        try:
            yield
        finally:
            hook.uninstall(trainer)

    def _on_step(self, step: int, decision: RouteDecision, native_hw: tuple[int, int], run_hw: tuple[int, int]) -> None:
        record = StepRecord.from_decision(step, decision, native_hw, LAB_ARCH)
        self.accounting.record(record)
        self.trace.append(StepTrace(step, decision.rule_index, record.tokens_run, record.sigmas))

    def _step_logs(self, logs: dict[str, float], current_loss: float | None) -> None:
        if current_loss is not None:
            self.accounting.record_loss(float(current_loss))
        logs.update(self.accounting.scalars())
