"""One kohya training run's plugin state (sd-scripts, musubi-tuner): accounting, cross-rank totals, metadata, end summary.

Under multi-GPU the counts are summed over ranks with ``accelerator.reduce`` every train step (every
rank runs the hook on every step; the host's step logs run on the main process only, where a
collective would deadlock), and only the main process logs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ... import __version__
from ...accounting import Accounting, Counts, StepRecord
from ...config import DownscaleConfig, RouteRule
from ...plan import Plan
from ...rng import plugin_logger
from ...router import RouteDecision, Router
from ...scope import Patches

logger = plugin_logger(__name__)

COUNTS_FILE = "downscale_plugin_counts.json"  # beside the host's train_state.json in every --save_state dir


@functools.cache
def version() -> str:
    """The version of the code that runs: the package's own ``__version__`` (the distribution's metadata,
    absent for a checkout on ``sys.path``, can belong to another copy or an older install)."""
    return __version__


def shared_seed(seed: int, accelerator: Any) -> int:
    """Rank 0's seed on every rank: an unseeded kohya run draws ``args.seed`` per process
    (sd-scripts' train_network.py, musubi-tuner's training/trainer_base.py)."""
    if int(accelerator.num_processes) <= 1:
        return seed
    mine = torch.tensor([seed if int(accelerator.process_index) == 0 else 0], dtype=torch.int64, device=accelerator.device)
    return int(accelerator.reduce(mine, reduction="sum").item())


def _wrapping_handler(log: logging.Logger) -> bool:
    """Whether a handler on ``log``'s way up is rich's, which wraps each line at the console width."""
    rich_logging = sys.modules.get("rich.logging")
    while rich_logging is not None and log is not None:
        if any(isinstance(h, rich_logging.RichHandler) for h in log.handlers):
            return True
        log = log.parent if log.propagate else None
    return False


def show(text: str, what: str) -> None:
    """Main process: a block that must stay a table (the start banner, the end summary).

    sd-scripts logs through rich's handler (``library/utils.py`` ``setup_logging``), which wraps every
    line at the console width, 80 columns when the output goes to a file, into fragments. The block is
    printed to stdout and flushed instead, and the log gets one line pointing at it. Without a rich
    handler (``--console_log_simple``, ``--console_log_file``) the log takes the block itself.
    """
    if not _wrapping_handler(logger.logger):
        logger.info("%s", text)
        return
    sys.stderr.flush()
    print(text, file=sys.stdout, flush=True)
    logger.info("downscale_plugin: %s printed above (stdout, unwrapped)", what)


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
    pad = len(new.rules) - len(old.rules)
    state = old.state()
    new.merge({**state, **old.counts.padded(pad).state(), "window": [(0.0, 0.0)] * pad + state["window"]})


@dataclass(frozen=True)
class Routing:
    """What a run routes by for one config: the router, the banner's plan (None off the main process
    and in a map run before its map), and the accounting that counts against that plan."""

    router: Router
    plan: Plan | None
    accounting: Accounting

    @classmethod
    def counted(
        cls, router: Router, plan: Plan | None, cfg: DownscaleConfig, arch: str, flops: Any, latent_buckets: Sequence[tuple[int, int]]
    ) -> Routing:
        """The routing whose accounting counts ``cfg``'s routes under the run's FLOP model against ``plan``."""
        accounting = Accounting(
            cfg.routes,
            flops,
            plan.probs if plan else None,
            predicted_flop_saving=plan.flop_saving if plan else None,
            token_values=Accounting.vocabulary(latent_buckets, cfg.routes, arch, cfg.tier_tolerance),
            sigma_policy=cfg.fasterdit.sigma_policy,
        )
        return cls(router, plan, accounting)


class DownscaleRun:
    """One training run's plugin state: accounting, cross-rank totals, metadata, summary, and the
    record of every long-lived patch the run puts on the trainer, network and accelerator
    (``patches``, undone by :meth:`close`: docs/ARCHITECTURE.md §3).

    Exposed as ``network.downscale_run`` for inspection.
    """

    def __init__(
        self,
        cfg: DownscaleConfig,
        arch: str,
        inner: str,
        seed: int,
        accelerator: Any,
        routing: Callable[[DownscaleConfig], Routing],
        read_host_state: Callable[[str], dict | None] | None = None,
    ):
        self.cfg = cfg
        self.arch = arch
        self.inner = inner
        self.seed = seed
        self.accelerator = accelerator
        self.rank = int(accelerator.process_index)
        self.world_size = int(accelerator.num_processes)
        self._routing = routing
        chosen = routing(cfg)
        self.router, self.plan, self.accounting = chosen.router, chosen.plan, chosen.accounting
        self.totals = self.accounting  # summed over ranks; the same object on one process
        self.hook: Any = None  # the step hook reading ``router`` (set by start)
        self.finished = False
        self.extra_metadata: dict[str, str] = {}  # e.g. ss_downscale_map after an in-run map
        self.summary_extra: list[Callable[[], list[str]]] = []  # more end-summary lines (an in-run certification's cost)
        self.scalar_extra: list[Callable[[], dict[str, float]]] = []  # more tracker scalars (an in-run certification's net)
        self.read_host_state = read_host_state  # a state dir → the host's own record in it (sd-scripts' train_state.json)
        self.host_state: dict | None = None  # that record of the state the run resumed from
        self.patches = Patches()  # undone by close(), at the run's end
        self._pending: dict | None = None  # restored counts for other routes (a map run: merged once they match)
        # An in-run measurement (map, auto) takes over the routes a resumed state was measured into, instead of measuring again.
        self.adopt_saved: Callable[[dict], None] | None = None

    def retarget(self, routes: Sequence[RouteRule]) -> Plan | None:
        """Route by ``routes`` from now on (after an in-run map): router, plan and accounting follow, the
        counts so far carried over as native steps. Returns the new plan (None without routes)."""
        cfg = self.cfg.with_routes(routes)
        chosen = self._routing(cfg)
        carry_native(self.accounting, chosen.accounting)
        self.cfg, self.router, self.plan = cfg, chosen.router, chosen.plan
        self.accounting = self.totals = chosen.accounting
        if self.hook is not None:
            self.hook.router = chosen.router
        if self._pending is not None:
            self._restore(self._pending, "")
        return chosen.plan

    # -- counts across --save_state / --resume ----------------------------------------------------

    def install_save_and_end(self, network: Any, args: Any) -> None:
        """Instance wraps: ``ss_downscale_*`` keys on every save (the weights are the inner's, untouched);
        the end summary at ``accelerator.end_training`` (every rank calls it, so the last reduce is symmetric).

        The run's patches come off on the main process after the last weights, which follow
        ``end_training`` there in both kohya trainers (after the last state with ``--save_state``), and
        need this ``save_weights`` wrap; on the other ranks at ``end_training``: the saves are main-process only."""
        save = network.save_weights
        end = self.accelerator.end_training

        def save_weights(file, dtype, metadata):
            if metadata is not None and not getattr(args, "no_metadata", False):
                metadata = {**metadata, **self.metadata()}
            try:
                return save(file, dtype, metadata)
            finally:
                if self.finished:
                    self.close()

        def end_training(*a, **kw):
            self.finish()
            if self.rank != 0:
                self.close()  # no save follows on this rank
            return end(*a, **kw)

        self.patches.set(network, "save_weights", save_weights)
        self.patches.set(self.accelerator, "end_training", end_training)

    def install_state_hooks(self) -> None:
        """Save the counts with every ``accelerator.save_state`` and restore them at ``load_state`` (the
        host's ``--save_state`` / ``--resume``), through accelerate's state pre-hooks; :meth:`close` removes them."""
        acc = self.accelerator
        if not callable(getattr(acc, "register_save_state_pre_hook", None)):
            return
        for register, hook in ((acc.register_save_state_pre_hook, self._save_state), (acc.register_load_state_pre_hook, self._load_state)):
            self.patches.on_undo(register(hook).remove)

    def close(self) -> None:
        """Undo every patch of the run, in reverse, at its end (``install_save_and_end`` says
        when: after the host's last save on the main process); idempotent."""
        self.patches.undo()

    def _counts_layout(self) -> list[dict[str, Any]]:
        return [_rule_dict(r) for r in self.cfg.routes]

    def _save_state(self, models: Any, weights: Any, output_dir: str) -> None:
        """The cross-rank totals so far, into ``output_dir`` (main process; the host saves state there only)."""
        if self.rank != 0:
            return
        # the counts are sums over the saving run's processes (a resume on another number divides by this one), and its
        # spans ran over its total_forwards (musubi-tuner's resume compares: start.MusubiRouter)
        payload = {
            "version": version(), "processes": self.world_size, "total_forwards": int(self.router.total_forwards),
            "routes": self._counts_layout(), "counts": self.totals.state(),
        }  # fmt: skip
        if "ss_downscale_map" in self.extra_metadata:  # what measured those routes, for a resumed run's metadata
            payload["measurement"] = self.extra_metadata["ss_downscale_map"]
        path = os.path.join(output_dir, COUNTS_FILE)
        os.makedirs(output_dir, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(payload, f)

    def _load_state(self, models: Any, input_dir: str) -> None:
        """Every rank: the host's own record of the state (where the run resumes); the main process adds the
        saved totals to its counts, so the cross-rank sums and ``ss_downscale_counts`` cover the whole run."""
        if self.read_host_state is not None:
            self.host_state = self.read_host_state(input_dir)
        path = os.path.join(input_dir, COUNTS_FILE)
        if self.rank != 0:
            return
        if not os.path.isfile(path):
            logger.info("downscale_plugin: %s has no %s; the counts start at this run", input_dir, COUNTS_FILE)
            return
        with open(path, encoding="utf-8") as f:
            self._restore(json.load(f), input_dir)

    def _restore(self, saved: dict, source: str) -> None:
        if saved.get("routes") != self._counts_layout() and saved.get("routes") and self.adopt_saved is not None:
            self.adopt_saved(saved)  # retargets to the saved routes: the layouts match below
        if saved.get("routes") != self._counts_layout():
            self._pending = saved
            logger.warning(
                "downscale_plugin: the counts in %s are for routes %s, this run routes by %s: kept aside until they match",
                source or "the resumed state",
                json.dumps(saved.get("routes")),
                json.dumps(self._counts_layout()),
            )
            return
        self._pending = None
        counts = dict(saved["counts"])
        missing = [f.name for f in dataclasses.fields(Counts) if f.name not in counts]
        if missing:
            logger.warning(
                "downscale_plugin: the counts in %s lack %s (saved by another plugin version): the summary counts this run only",
                source or "the resumed state",
                ", ".join(missing),
            )
            return
        counts["window"] = [(0.0, 0.0)] * len(counts["steps"])  # the recent-loss windows restart with the run
        self.accounting.merge(counts)
        logger.info("downscale_plugin: restored the counts of %.0f earlier train forwards", sum(counts["steps"]))

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
        for extra in self.scalar_extra:
            logs.update(extra())

    def finish(self) -> None:
        """Every rank, once, at ``accelerator.end_training``: final totals and the end summary."""
        if self.finished:
            return
        self.finished = True
        if self.world_size > 1:
            self.totals = self.accounting.reduced(self._reduce)
        if self.rank == 0:
            show("\n".join([self.totals.summary_text(), *(line for extra in self.summary_extra for line in extra())]), "end summary")

    def metadata(self) -> dict[str, str]:
        totals = self.totals
        counts = {
            "forwards": totals.total_steps,
            "routes": {("native" if i < 0 else f"r{i} {self.cfg.routes[i].label}"): f for i, f in totals.fractions().items()},
            "fallbacks": totals.counts.fallbacks,
            "token_saving": totals.token_saving(),
            "flop_saving": totals.flop_saving(),
        }
        routed = totals.routed_samples
        if routed:
            counts["routed_sigma_mean"] = {"drawn": totals.counts.sigma_drawn / routed, "run": totals.counts.sigma_run / routed}
        return {
            "ss_downscale_version": version(),
            "ss_downscale_inner": self.inner,
            "ss_downscale_arch": self.arch,
            "ss_downscale_gate": self.cfg.gate,
            "ss_downscale_seed": str(self.seed),
            "ss_downscale_routes": json.dumps([_rule_dict(r) for r in self.cfg.routes]),
            "ss_downscale_counts": json.dumps(counts),
            "ss_downscale_fasterdit": json.dumps(dataclasses.asdict(self.cfg.fasterdit)),
            **self.extra_metadata,
        }
