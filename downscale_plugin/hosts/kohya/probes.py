"""What both in-run measurements (``mode = "map"``, ``"auto"``) share on a kohya host: probes, forced steps.

A measurement runs inside the training run, on its own model, adapter and data (docs/ARCHITECTURE.md §4):
the first train batches are cut into single-sample probes (copied before the host touches them)
by a wrap on the trainer's ``process_batch``; at the call that completes them, before its step, the
measurement runs, every draw the trainer class's own step forced by the step hook to a grid and σ
(:class:`ForcedSteps`). The host's subclass says how its batch splits, how its step is called, and
which argument holds the denoiser.

Multi-process runs are refused: ranks would measure different probes and derive different windows.
Probes are distinct images: a sample whose latents (else pixels) equal an earlier probe's is a repeat
(``num_repeats``, a second epoch) and is skipped, and a dataset with fewer distinct images than the
measurement needs is refused at start (a bound on repeats would read one image as several).
"""

from __future__ import annotations

import hashlib
import inspect
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ...arch import get_arch
from ...config import load_config, package_problems
from ...grid import target_grid
from ...rng import accelerator_devices, plugin_logger
from ...scope import Patches
from ...text import route_rows
from .backend import ProbeBackend
from .conventions import file_identity, measurement_option_problems
from .run import DownscaleRun, version

logger = plugin_logger(__name__)

FOREIGN_BACKWARD = ("DEEPSPEED", "FSDP", "MEGATRON_LM")  # accelerate's DistributedType names whose engines own the backward


def probe_identity(probe: dict[str, Any]) -> str | None:
    """A probe's image by content: a hash of its latents' (else its pixels') bytes, at the top level or in its
    ``batch``; None when it carries neither (then it is never taken for a repeat)."""
    for holder in (probe, probe.get("batch")):
        for key in ("latents", "images"):
            value = holder.get(key) if isinstance(holder, dict) else None
            if isinstance(value, torch.Tensor):
                return hashlib.sha1(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    return None


class ForcedSteps:
    """A step hook's forcing scope: inside :meth:`forcing` the hook runs the host's step at ``target_hw``
    (None: native) and σ, uncounted; each host's hook says how (``sd_scripts/map.MapHook``,
    ``musubi/probes.ForcingHook``)."""

    forced: tuple[tuple[int, int] | None, float] | None = None

    @contextmanager
    def forcing(self, target_hw: tuple[int, int] | None, sigma: float) -> Iterator[None]:
        self.forced = (target_hw, float(sigma))
        try:
            yield
        finally:
            self.forced = None


class ProbeSession:
    """What an in-run measurement (``mode = "map"``, ``mode = "auto"``) shares: probes cut from the
    run's first train batches, the step hook that can force a grid and σ, the ``process_batch`` wrap
    that collects them, and the run's provenance. A subclass says what runs once ``images`` probes
    are in (:meth:`complete`) and what the run cannot do (:meth:`problems`)."""

    mode = ""
    # What each host's subclass says (``hosts/sd_scripts/map.py`` ``SdScriptsProbes``, ``hosts/musubi/probes.py``):
    model_key: str  # the step call's argument holding the denoiser
    error: type[Exception]  # what a refusal raises (the host's own HostError)
    hook_class: type[ForcedSteps]  # the host's step hook with a forcing scope

    def __init__(self, run: DownscaleRun, ctx: Any, family: Any, buckets: Any, record: Any, images: int):
        """``ctx``: the host's trainer context (``trainer``, ``args``, ``accelerator``); ``family``: its σ family;
        ``buckets``: the dataset's (``latent_buckets``, ``batch_size``); ``record``: the host's architecture record."""
        self.run, self.ctx, self.family, self.buckets, self.record = run, ctx, family, buckets, record
        self.images = images
        self.out_dir = os.path.abspath(run.cfg.map.out)
        self.devices = accelerator_devices(ctx.accelerator.device)
        self.batches_needed = math.ceil(images / max(buckets.batch_size, 1))
        self.probes: list[dict[str, Any]] = []
        self.seen: set[str] = set()  # probe_identity of every probe taken
        self.batches = 0
        self.measured = False
        self.hook: Any = None  # the run's step hook (a ``hook_class``), from make_hook
        self.patches = Patches()  # the process_batch wrap: undone once the measurement has run, else at the run's end

    def refuse_missing_packages(self, run: DownscaleRun) -> None:
        """Stop on a package the mode imports that is not installed, naming the extra (``config.package_problems``);
        a subclass calls it before it imports any of them."""
        problems = package_problems(run.cfg)
        if problems:
            raise self.error("\n".join(problems))

    def refuse(self, problems: list[str]) -> None:
        if problems:
            raise self.error(f'mode = "{self.mode}":\n  - ' + "\n  - ".join(problems))

    def run_problems(self, ratios: tuple[float, ...], key: str, images_key: str) -> list[str]:
        """What this run's processes, buckets and length rule out for ``images`` probes at ``ratios``."""
        run = self.run
        problems = []
        if run.world_size > 1:
            problems.append(f"{run.world_size} processes: the {self.mode} runs on one process (launch with --num_processes 1)")
        problems += measurement_option_problems(run.cfg, self.ctx.args)
        distributed = getattr(getattr(run.accelerator, "distributed_type", None), "name", None)
        if distributed in FOREIGN_BACKWARD:
            problems.append(
                f"accelerate's {distributed}: the {self.mode} takes each gradient by a plain backward, which its engine's "
                "gradient partitions or shards would take as the run's; measure in a run without it"
            )
        spec = get_arch(run.arch)
        for h, w in self.buckets.latent_buckets:
            bad = [r for r in ratios if target_grid((h, w), r, spec) is None]
            if bad:
                problems.append(
                    f"{key}: {', '.join(f'{r:g}' for r in bad)} give no strictly smaller {spec.name} grid (multiple {spec.multiple}) "
                    f"for the {h}x{w} latent bucket of this dataset"
                )
        distinct = getattr(self.buckets, "images", None)
        if distinct is not None and distinct < self.images:
            problems.append(
                f"{images_key}: the dataset has {distinct} distinct images; {self.images} probes must be {self.images} distinct "
                f"images (a repeat is no new evidence){'; lower map_images or' if images_key == 'map_images' else ';'} add images"
            )
        if self.forwards() < self.batches_needed:
            problems.append(
                f"{images_key}: {self.images} probes need {self.batches_needed} train batches of {self.buckets.batch_size}, "
                f"but the run has {self.forwards()}; {'lower map_images or ' if images_key == 'map_images' else ''}raise --max_train_steps"
            )
        return problems

    def forwards(self) -> int:
        """Train forwards (batches) the run will make, as ``prepare_network`` sees its length."""
        args = self.ctx.args
        return int(args.max_train_steps) * int(getattr(args, "gradient_accumulation_steps", 1) or 1)

    def make_hook(self, *args: Any, **kwargs: Any) -> ForcedSteps:
        """The run's step hook (the host hook's own arguments)."""
        self.hook = self.hook_class(*args, **kwargs)
        return self.hook

    # -- the process_batch wrapper (both kohya trainers' step: training/trainer_base.py, train_network.py) --

    def install(self) -> None:
        """Wrap the trainer's ``process_batch`` (around any wrapper already installed) until the
        measurement has run, and ``accelerator.end_training`` to say so when a run ends before it. Both go
        into the run's record, the first through the session's own, undone when the measurement is done."""
        accelerator = self.run.accelerator
        end = accelerator.end_training

        def end_training(*args: Any, **kwargs: Any) -> Any:
            if not self.measured:  # e.g. --max_train_epochs made the run shorter than prepare_network saw
                logger.error(
                    'downscale_plugin: mode = "%s": the run ended after %d of the %d probe samples it needs; nothing was measured',
                    self.mode,
                    len(self.probes),
                    self.images,
                )
            return end(*args, **kwargs)

        self.run.patches.set(accelerator, "end_training", end_training)
        trainer = self.ctx.trainer
        current = trainer.process_batch
        signature = inspect.signature(type(trainer).process_batch)

        def process_batch(*args: Any, **kwargs: Any) -> Any:
            call = signature.bind(trainer, *args, **kwargs)
            call.apply_defaults()
            if self.is_train(call.arguments):
                self.offer(call.arguments)
            return current(*args, **kwargs)

        self.patches.set(trainer, "process_batch", process_batch)
        self.run.patches.on_undo(self.patches.undo)  # a run that ends before its measurement
        self.run.adopt_saved = self.adopt

    def is_train(self, arguments: dict[str, Any]) -> bool:
        """Whether a ``process_batch`` call (its arguments by name) is a train step."""
        raise NotImplementedError

    def split(self, arguments: dict[str, Any]) -> list[dict[str, Any]]:
        """A train step's batch as single-sample probes (copies)."""
        raise NotImplementedError

    def probe_step(self, arguments: dict[str, Any]) -> Callable[[dict[str, Any]], torch.Tensor]:
        """One probe → its loss through the trainer class's own step (no plugin wrapper), the rest of the
        call (``arguments``, by name) the one that completed the probes."""
        raise NotImplementedError

    def model_path(self) -> str | None:
        """The base model's file or name as the run's args give it."""
        raise NotImplementedError

    def model_files(self) -> list[str | None]:
        """Every base model file the run's steps run (what cached windows are keyed by)."""
        return [self.model_path()]

    def offer(self, arguments: dict[str, Any]) -> None:
        """A train batch: take its samples as probes; with enough, run the measurement and what follows it."""
        self.batches += 1
        for probe in self.split(arguments):
            key = probe_identity(probe)
            if key in self.seen:
                continue  # a repeat of an image already probed
            self.probes.append(probe)
            if key is not None:
                self.seen.add(key)
        if len(self.probes) < self.images:
            return
        self.patches.undo()
        self.measured = True
        self.complete(arguments)

    def complete(self, arguments: dict[str, Any]) -> None:
        raise NotImplementedError

    def adopt(self, saved: dict[str, Any]) -> None:
        """A ``--resume``d state saved after the measurement: its routes (and what measured them) are this
        run's from the first step, and nothing is measured again (the probes, the adapter and the cost would
        all be new; the saved run's routed steps were taken under these routes)."""
        routes = load_config(table={"routes": saved["routes"]}).routes
        self.patches.undo()
        self.measured = True
        self.run.retarget(routes)
        if saved.get("measurement"):
            self.run.extra_metadata["ss_downscale_map"] = saved["measurement"]
        logger.info(
            'downscale_plugin: mode = "%s": the resumed state was saved after the measurement; routing by its windows, not measuring again\n%s',
            self.mode,
            "\n".join(f"  {row}".rstrip() for row in route_rows(routes)),
        )

    def backend(self, arguments: dict[str, Any], vae: Any = None) -> ProbeBackend:
        """The map backend over the first ``images`` probes: every draw the trainer class's own step."""
        network = arguments["accelerator"].unwrap_model(arguments["network"])
        params = [p for p in network.parameters() if p.requires_grad]
        return ProbeBackend(
            self.probes[: self.images],
            self.probe_step(arguments),
            self.hook.forcing,
            params,
            self.run.arch,
            self.devices,
            self.describe(arguments),
            vae,
            self.run.seed,
        )

    def command(self) -> str:
        return f"python {' '.join(sys.argv)} (downscale_plugin mode = {self.mode}, before train batch {self.batches})"

    def model_identity(self) -> str | None:
        """The base model's hash for provenance (``conventions.file_identity``), None when there is no file to hash."""
        return file_identity(self.model_path())

    def describe(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Provenance of the model, adapter and data (every output file carries it)."""
        args, accelerator = arguments["args"], arguments["accelerator"]
        unet = accelerator.unwrap_model(arguments[self.model_key])
        n = self.images
        captions = [str(p["captions"][0])[:60] for p in self.probes[:n] if p.get("captions")]
        return {
            "model": f"{type(unet).__name__} ({sum(p.numel() for p in unet.parameters()) / 1e6:.1f} M parameters), "
            f"{self.model_path() or '?'}",
            "adapter": f"{self.run.inner} (network_dim {getattr(args, 'network_dim', '?')}, network_alpha {getattr(args, 'network_alpha', '?')}), "
            f"as trained by the {self.batches - 1} native step(s) before the {self.mode}",
            "data": f"the run's first {n} training samples (train batches 1-{self.batches})"
            + (f"; captions: {' | '.join(captions)}" if captions else ""),
            "trainer": type(self.ctx.trainer).__name__,
            "model_identity": self.model_identity(),
            "plugin_version": version(),
        }
