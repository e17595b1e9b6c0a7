"""``mode = "auto"`` on the lab trainer: certify windows inside a lab LoRA run, then train with them.

The same steps as the sd-scripts host (``hosts/sd_scripts/auto.py``): the first 16 training samples
become probes; before the batch that completes them the certifier (``mapping/in_run.py``) runs once
over them, every draw the lab trainer's own ``process_batch`` at the route's grid and a σ of the bin
(the map hook's forcing), within ``certify_budget`` of the run's native compute; the certified
windows become the run's routes from that batch on. The certification's time falls inside that
batch's step time, so a run's wall time includes it. The lab latents' tiers are counted at the
config's ``arch`` (``"flux"``: 8 px per cell), as the windows TOML names them.
"""

from __future__ import annotations

import argparse
import inspect
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import toml

from ... import __version__
from ...arch import get_arch
from ...config import load_config
from ...grid import target_grid
from ...rng import plugin_logger
from ...scope import Patches
from ..kohya.backend import ProbeBackend
from ..kohya.probes import probe_identity
from ..sd_scripts.map import MapHook
from ..sd_scripts.map_backend import split_batch

logger = plugin_logger(__name__)

if TYPE_CHECKING:
    from ...config import DownscaleConfig, RouteRule
    from ...flops import FlopModel
    from ...mapping.in_run import InRunCertification


class AutoPlugin(Protocol):
    """What an auto session needs of the lab's plugin (hosts/lab/adapter.py): its settings, the run's
    buckets and FLOP model, and the switch to certified routes. A protocol, so that the adapter, which
    starts the session, is the only one of the two that imports the other."""

    cfg: DownscaleConfig
    batch_size: int
    buckets: list[tuple[int, int]]
    flop_model: FlopModel

    def retarget(self, routes: Sequence[RouteRule], hook: Any) -> None: ...


class LabAutoSession:
    """One lab ``auto`` run: probe collection, the certification, the switch to its windows."""

    def __init__(self, plugin: AutoPlugin, args: argparse.Namespace, seed: int):
        from ...mapping.in_run import in_run_setup, pass_costs, start_plan, unpaid_problem
        from .sampler import lab_sampler

        cfg = plugin.cfg
        passes = args.max_train_steps * args.gradient_accumulation_steps * plugin.batch_size
        setup = in_run_setup(cfg, passes, seed)
        self.plugin, self.args, self.images = plugin, args, setup.settings.looks.last
        self.routes, self.bins, self.settings = setup.routes, setup.bins, setup.settings
        self.fraction = pass_costs(plugin.flop_model, cfg.arch)  # the run's FLOP unit, as the kohya hosts count
        problems = list(setup.problems)
        self.skipped: str | None = None  # why no test can pay: the run trains native
        if cfg.arch is None:
            problems.append('arch: mode = "auto" on the lab needs an arch (e.g. "flux"): the windows name tiers at its VAE factor')
        else:
            native, spec = plugin.buckets[0], get_arch(cfg.arch)
            smalls = [target_grid(native, arm.ratio, spec) for arm in self.routes]
            if all(smalls) and not setup.problems:
                sampler = lab_sampler(args)
                plan = start_plan(
                    setup, [self.fraction(s, native) for s in smalls], lambda lo, hi: sampler.mass(lo, hi, native) if hi > lo else 0.0
                )
                self.skipped = unpaid_problem(cfg, plan, self.bins, passes)
                if self.skipped is not None and cfg.certify.unpaid != "skip":
                    problems.append(
                        f'certify_unpaid = "{cfg.certify.unpaid}": {self.skipped}; certify_unpaid = "skip" trains native instead'
                    )
        if problems:
            raise ValueError('mode = "auto":\n  - ' + "\n  - ".join(problems))
        if self.skipped is not None:
            logger.warning('downscale_plugin: mode = "auto": no certification, the run trains native: %s', self.skipped)
        self.probes: list[dict[str, Any]] = []
        self.seen: set[str] = set()  # probe_identity of every probe taken: a repeat is no new probe
        self.batches = 0
        self.done: InRunCertification | None = None

    def install(self, trainer: Any, hook: MapHook, patches: Patches) -> None:
        """Wrap the trainer's ``process_batch`` until the probes are in (undone then, or at the run's end); nothing when
        no test can pay (the run is the plain run)."""
        if self.skipped is not None:
            return
        current = trainer.process_batch
        signature = inspect.signature(type(trainer).process_batch)
        own = Patches()

        def process_batch(*args: Any, **kwargs: Any) -> Any:
            call = signature.bind(trainer, *args, **kwargs)
            call.apply_defaults()
            if call.arguments["is_train"]:
                self.batches += 1
                for probe in split_batch(call.arguments["batch"]):
                    key = probe_identity(probe)
                    if key not in self.seen:
                        self.probes.append(probe)
                        self.seen.update([key] if key is not None else [])
                if len(self.probes) >= self.images:
                    own.undo()
                    self.certify(trainer, hook, call.arguments)
            return current(*args, **kwargs)

        own.set(trainer, "process_batch", process_batch)
        patches.on_undo(own.undo)

    def certify(self, trainer: Any, hook: MapHook, arguments: dict[str, Any]) -> None:
        from ...mapping.in_run import certify_in_run
        from .sampler import lab_sampler

        cfg = self.plugin.cfg
        rest = {k: v for k, v in arguments.items() if k not in ("self", "batch")}
        params = [p for p in arguments["network"].parameters() if p.requires_grad]
        info = {
            "model": f"lab DiT ({sum(p.numel() for p in arguments['unet'].parameters()) / 1e6:.2f} M parameters)",
            "adapter": f"the run's LoRA (rank {self.args.network_dim}) after {self.batches - 1} native step(s)",
            "data": f"the run's first {self.images} training samples",
            "plugin_version": __version__,
        }
        host_step = type(trainer).process_batch
        backend = ProbeBackend(
            self.probes[: self.images], lambda probe: host_step(trainer, probe, **rest), hook.forcing, params, cfg.arch, (), info
        )
        sampler, hw = lab_sampler(self.args), backend.grids[0]
        text = f"lab trainer: timestep_sampling {self.args.timestep_sampling} at latent {hw[0]}x{hw[1]}"
        command = f"lab train_lora (mode = auto, before train batch {self.batches})"
        out = os.path.abspath(cfg.map.out)
        self.done = certify_in_run(
            backend,
            self.routes,
            self.bins,
            self.settings,
            lambda lo, hi: sampler.mass(lo, hi, hw) if hi > lo else 0.0,
            text,
            out,
            command,
            fraction=self.fraction,
        )
        self.plugin.retarget(load_config(plugin_toml=toml.load(self.done.windows_toml)).routes, hook)
