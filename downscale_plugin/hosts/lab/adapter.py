"""Host adapter for the lab trainer: the plugin attached the way ``prepare_network`` attaches it
to sd-scripts, through the same hook, sampler family and accounting (no separate code path).

The lab's "VAE" is a 4× pixel unshuffle, so its latent grid gets its own :class:`ArchSpec`
(Flux packing: multiple 2, patch 2) and route tiers read in lab pixels (``"256:192"``), unless the
config names an ``arch``: then tiers count the lab latents at that arch's VAE factor, as the map tool
writes them (its lab windows say ``arch = "flux"``, a 64x64 latent being the ``512`` px tier).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ...accounting import Accounting, StepRecord
from ...arch import ARCHS, ArchSpec, get_arch
from ...attention import PROPORTIONAL
from ...config import DownscaleConfig, RouteRule
from ...flops import FlopModel
from ...lab import flux_train_utils, flux_utils
from ...lab import trainer as lab_trainer
from ...lab.data import FACTOR, LabData
from ...lab.model import LabModelConfig, flop_shape
from ...plan import Plan, plan_table
from ...router import RouteDecision, Router
from ...scope import Patches
from ..kohya.run import carry_native
from ..sd_scripts.families import FlowFamily
from ..sd_scripts.hook import DownscaleHook, StepOptions
from ..sd_scripts.map import MapHook
from .attention import attention_scope
from .auto import LabAutoSession
from .sampler import lab_sampler

# The lab trainer keeps the Flux trainer contract: Flux packing (patch 2) and ids from flux_utils.prepare_img_ids.
LAB_ARCH = ArchSpec("lab", multiple=2, patch=2, vae_factor=FACTOR, positions="img_ids")


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
    arch: ArchSpec = field(init=False)
    auto: LabAutoSession | None = None  # mode = "auto": the in-run certification
    _args: argparse.Namespace | None = field(default=None, init=False, repr=False)  # the run's, for retarget

    def __post_init__(self) -> None:
        self.arch = LAB_ARCH if self.cfg.arch is None else get_arch(self.cfg.arch)
        if (self.arch.multiple, self.arch.patch) != (LAB_ARCH.multiple, LAB_ARCH.patch):
            same = [a.name for a in ARCHS.values() if (a.multiple, a.patch) == (LAB_ARCH.multiple, LAB_ARCH.patch)]
            raise ValueError(f"arch: {self.cfg.arch!r} does not pack latents like the lab DiT (allowed: {', '.join(same)}, or no arch)")

    @classmethod
    def for_lab(cls, cfg: DownscaleConfig, model_cfg: LabModelConfig, data: LabData, batch_size: int = 1) -> LabPlugin:
        """The plugin for a lab run over ``data``'s buckets, costed with the lab DiT's FLOP shape."""
        return cls(cfg, FlopModel(*flop_shape(model_cfg)), [data.cfg.latent_hw(b) for b in data.cfg.buckets], batch_size)

    def _routing(self, cfg: DownscaleConfig, args: argparse.Namespace) -> Router:
        """Router, plan and accounting for ``cfg``'s routes (no plan without routes: an auto run before its certification)."""
        total = args.max_train_steps * args.gradient_accumulation_steps
        seed = cfg.seed if cfg.seed is not None else args.seed
        router = Router.from_config(cfg, self.arch, seed, total)
        self.plan = (
            plan_table(cfg, self.arch, lab_sampler(args), self.buckets, self.batch_size, flop_model=self.flop_model, total_forwards=total)
            if cfg.routes or cfg.mode == "train"
            else None
        )
        self.accounting = Accounting(
            cfg.routes,
            self.flop_model,
            self.plan.probs if self.plan else None,
            predicted_flop_saving=self.plan.flop_saving if self.plan else None,
            token_values=Accounting.vocabulary(self.buckets, cfg.routes, self.arch, cfg.tier_tolerance),
            sigma_policy=cfg.fasterdit.sigma_policy,
        )
        self.cfg = cfg
        return router

    def retarget(self, routes: Sequence[RouteRule], hook: DownscaleHook) -> None:
        """Route by ``routes`` from the next step on, the steps so far counted as native (an auto run's certification)."""
        before = self.accounting
        hook.router = self._routing(self.cfg.with_routes(routes), self._args)
        carry_native(before, self.accounting)

    @contextmanager
    def installer(self, trainer: object, args: argparse.Namespace) -> Iterator[None]:
        self._args = args
        router = self._routing(self.cfg, args)
        scope = attention_scope() if self.cfg.fasterdit.attention == PROPORTIONAL else None
        options = StepOptions.from_config(
            self.cfg, loss_module=lab_trainer, positions_arch=LAB_ARCH, positions_module=flux_utils, attention_scope=scope
        )
        auto = self.cfg.mode == "auto" and self.cfg.certify.budget > 0
        hook = (MapHook if auto else DownscaleHook)(
            router, FlowFamily(flux_train_utils, "flux"), options=options, on_step=self._on_step, step_logs=self._step_logs
        )
        patches = Patches()  # the run's record, as sd-scripts' DownscaleRun keeps one
        hook.install(trainer, patches)
        if auto:
            self.auto = LabAutoSession(self, args, self.cfg.seed if self.cfg.seed is not None else args.seed)
            self.auto.install(trainer, hook, patches)
        try:
            yield
        finally:
            patches.undo()

    def _on_step(
        self, step: int, decision: RouteDecision, native_hw: tuple[int, int], run_hw: tuple[int, int], run_sigmas: torch.Tensor
    ) -> None:
        record = StepRecord.from_decision(step, decision, native_hw, self.arch, run_sigmas=run_sigmas)
        self.accounting.record(record)
        self.trace.append(StepTrace(step, decision.rule_index, record.tokens_run, record.sigmas))

    def _step_logs(self, logs: dict[str, float], current_loss: float | None) -> None:
        if current_loss is not None:
            self.accounting.record_loss(float(current_loss))
        logs.update(self.accounting.scalars())
