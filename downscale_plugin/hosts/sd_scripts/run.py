"""One sd-scripts training run's plugin state: accounting, cross-rank totals, metadata, end summary.

Under multi-GPU the counts are summed over ranks with ``accelerator.reduce`` every train step (every
rank runs the hook on every step; the host's step logs run on the main process only, where a
collective would deadlock), and only the main process logs.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

import torch

from ... import __version__
from ...accounting import Accounting, StepRecord
from ...config import DownscaleConfig, RouteRule
from ...plan import Plan
from ...router import RouteDecision, Router

Routing = Callable[[DownscaleConfig], tuple[Router, "Plan | None", Accounting]]

logger = logging.getLogger(__name__)

FASTERDIT_KEYS = ("direction_loss_weight", "direction_loss_only_routed", "sigma_policy", "positions")


@functools.cache
def version() -> str:
    """The installed distribution's version; the package's own when it is imported from a checkout."""
    try:
        return metadata.version("downscale-plugin")
    except metadata.PackageNotFoundError:
        return __version__


def _rule_dict(rule: RouteRule) -> dict[str, Any]:
    out: dict[str, Any] = {"route": f"{rule.native}:{rule.target}"} if rule.native else {"scale": rule.scale}
    out["sigma_min"] = rule.sigma_min
    if rule.sigma_max is not None:
        out["sigma_max"] = rule.sigma_max
    if rule.span is not None:
        out["span"] = str(rule.span)
    if rule.name:
        out["name"] = rule.name
    return out


def carry_native(old: Accounting, new: Accounting) -> None:
    """Count the native steps before the map (an accounting without routes) in ``new`` (native: its last slot)."""
    state = old.state()
    pad = len(new.rules) - len(old.rules)
    for key in ("steps", "samples", "loss_sum", "loss_count"):
        state[key] = [0.0] * pad + state[key]
    state["window"] = [(0.0, 0.0)] * pad + state["window"]
    new.merge(state)


class DownscaleRun:
    """One training run's plugin state: accounting, cross-rank totals, metadata, summary.

    Exposed as ``network.downscale_run`` for inspection.
    """

    def __init__(self, cfg: DownscaleConfig, arch: str, inner: str, seed: int, accelerator: Any, routing: Routing):
        self.cfg = cfg
        self.arch = arch
        self.inner = inner
        self.seed = seed
        self.accelerator = accelerator
        self.rank = int(accelerator.process_index)
        self.world_size = int(accelerator.num_processes)
        self._routing = routing
        self.router, self.plan, self.accounting = routing(cfg)
        self.totals = self.accounting  # summed over ranks; the same object on one process
        self.hook: Any = None  # the step hook reading ``router`` (set by start)
        self.finished = False
        self.extra_metadata: dict[str, str] = {}  # e.g. ss_downscale_map after an in-run map

    def retarget(self, routes: Sequence[RouteRule]) -> Plan | None:
        """Route by ``routes`` from now on (after an in-run map): router, plan and accounting follow, the
        counts so far carried over as native steps. Returns the new plan (None without routes)."""
        cfg = self.cfg.with_routes(routes)
        router, plan, accounting = self._routing(cfg)
        carry_native(self.accounting, accounting)
        self.cfg, self.router, self.plan, self.accounting, self.totals = cfg, router, plan, accounting, accounting
        if self.hook is not None:
            self.hook.router = router
        return plan

    def _reduce(self, vector: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(vector.to(self.accelerator.device), reduction="sum")

    def on_step(
        self, step: int, decision: RouteDecision, native_hw: tuple[int, int], run_hw: tuple[int, int], run_sigmas: torch.Tensor
    ) -> None:
        """Every rank, every train step (so the collective is symmetric): record, then sum over ranks."""
        self.accounting.record(StepRecord.from_decision(step, decision, native_hw, self.arch, run_sigmas=run_sigmas))
        if self.world_size > 1:
            self.totals = self.accounting.reduced(self._reduce)

    def step_logs(self, logs: dict[str, float], current_loss: Any) -> None:
        """Main process only (trackers exist there): the step's loss goes to its route, scalars to the logs."""
        if current_loss is not None:
            self.accounting.record_loss(float(current_loss))
        logs.update(self.totals.scalars())

    def finish(self) -> None:
        """Every rank, once, at ``accelerator.end_training``: final totals and the end summary."""
        if self.finished:
            return
        self.finished = True
        if self.world_size > 1:
            self.totals = self.accounting.reduced(self._reduce)
        if self.rank == 0:
            logger.info("%s", self.totals.summary_text())

    def metadata(self) -> dict[str, str]:
        totals = self.totals
        counts = {
            "forwards": totals.total_steps,
            "routes": {("native" if i < 0 else f"r{i} {self.cfg.routes[i].label}"): f for i, f in totals.fractions().items()},
            "fallbacks": totals.fallbacks,
            "token_saving": totals.token_saving(),
            "flop_saving": totals.flop_saving(),
        }
        routed = totals.routed_samples
        if routed:
            counts["routed_sigma_mean"] = {"drawn": totals.sigma_drawn / routed, "run": totals.sigma_run / routed}
        return {
            "ss_downscale_version": version(),
            "ss_downscale_inner": self.inner,
            "ss_downscale_arch": self.arch,
            "ss_downscale_gate": self.cfg.gate,
            "ss_downscale_seed": str(self.seed),
            "ss_downscale_routes": json.dumps([_rule_dict(r) for r in self.cfg.routes]),
            "ss_downscale_counts": json.dumps(counts),
            "ss_downscale_fasterdit": json.dumps({key: getattr(self.cfg, key) for key in FASTERDIT_KEYS}),
            **self.extra_metadata,
        }
