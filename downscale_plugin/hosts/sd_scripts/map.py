"""``mode = "map"`` in an sd-scripts run: the gradient map on the run's own model, network and data.

Timeline (one process; docs/FIDELITY.md has the method):

1. ``start`` (``prepare_network``) builds a :class:`MapSession`. The router has no routes yet, so
   the first steps run native, bitwise the host's. What the run's buckets and length already show
   (a ratio with no smaller grid, too few batches for the probes, several processes, a missing
   package, VAE arms on an architecture outside ``VAE_ARCHS``) stops the run there, before any compute.
2. Every train ``process_batch`` call until the map has run hands its batch to the session, split
   into single-sample probes (copied before the host touches the batch); the step then runs.
3. At the call that completes ``map_images`` probes, before that step runs: the map
   (:func:`~downscale_plugin.mapping.estimator.run_map` over
   :class:`~downscale_plugin.mapping.sd_scripts_backend.SdScriptsBackend`). Every draw is the
   trainer class's own ``process_batch``, run by :class:`MapHook` at the arm's grid and the map's σ.
   Torch's CPU and device RNG and Python's and NumPy's global RNG are restored afterwards, and the
   gradients come from ``autograd.grad``, so ``.grad`` (accumulated gradients included) and the
   optimizer are never touched: training continues exactly as if the map had not run. The lab
   map's files go to ``map_out``, and the table to the log.
4. ``after_map = "stop"``: the end summary and the host's ``accelerator.end_training()`` run, then
   ``SystemExit(0)``: the script ends without a traceback and saves no weights.
   ``after_map = "train"``: the windows TOML, read as the router reads it, becomes the run's routes
   (the config's other keys kept); router, plan, accounting (the native steps so far carried over)
   and the saved file's metadata (``ss_downscale_map``) follow, and the step continues, routed.

Multi-process runs are refused: ranks would measure different probes and derive different windows.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import math
import os
import sys
import time
from contextlib import nullcontext
from typing import Any

import toml
import torch

from ...arch import get_arch
from ...bins import parse_bins
from ...config import VAE_ARM_KEYS, load_config
from ...grid import target_grid
from ...mapping.arms import build_arms
from ...plan import format_plan
from ...rng import accelerator_devices, forked
from ...scope import Patches
from ...text import route_rows
from ..kohya import ForcedSteps, model_identity
from .buckets import DatasetBuckets
from .facts import VAE_ARCHS, HostError, TrainerArch
from .families import SamplerFamily
from .hook import DownscaleHook, HostCall, at_grid
from .map_backend import HostVae, SdScriptsBackend, split_batch
from .run import DownscaleRun, version
from .trainer import TrainerContext

logger = logging.getLogger(__name__)

MAP_PACKAGES = ("scipy", "matplotlib", "tqdm")  # the estimator's bound, the heatmap, the progress bar (imported on use)


class MapHook(ForcedSteps, DownscaleHook):
    """The step hook of a map run: inside :meth:`forcing` a train step runs the host at the given
    grid (None: native) and σ, and is not counted; outside it, the plain hook."""

    def train_step(self, original: Any, call: HostCall) -> Any:
        if self.forced is None:
            return super().train_step(original, call)
        target_hw, sigma = self.forced
        device = call.accelerator.device
        sampler = self.family.bind(call.args, call.noise_scheduler, call.latents, device, call.weight_dtype)
        with forked(accelerator_devices(device)):
            sampler.first()  # records the host's output dtypes for the replay
        keys = self.family.remember(sampler, call.noise_scheduler, torch.tensor([sigma], dtype=torch.float64))
        return self.run_host(original, call, sampler, at_grid(call.latents, target_hw), keys, nullcontext())


class ProbeSession:
    """What an in-run measurement (``mode = "map"``, ``mode = "auto"``) shares: probes cut from the
    run's first train batches, the step hook that can force a grid and σ, the ``process_batch`` wrap
    that collects them, and the run's provenance. A subclass says what runs once ``images`` probes
    are in (:meth:`complete`) and what the run cannot do (:meth:`problems`)."""

    mode = ""
    model_key = "unet"  # the process_batch argument holding the denoiser
    error: type[Exception] = HostError  # what a refusal raises (the host's own HostError)

    def __init__(
        self, run: DownscaleRun, ctx: TrainerContext, family: SamplerFamily, buckets: DatasetBuckets, record: TrainerArch, images: int
    ):
        missing = [name for name in self.packages() if importlib.util.find_spec(name) is None]
        if missing:
            raise self.error(
                f'mode = "{self.mode}": {", ".join(missing)} not installed; it needs them: pip install "downscale-plugin[map]"'
            )
        self.run, self.ctx, self.family, self.buckets, self.record = run, ctx, family, buckets, record
        self.images = images
        self.out_dir = os.path.abspath(run.cfg.map.out)
        self.devices = accelerator_devices(ctx.accelerator.device)
        self.batches_needed = math.ceil(images / max(buckets.batch_size, 1))
        self.probes: list[dict[str, Any]] = []
        self.batches = 0
        self.measured = False
        self.hook: MapHook | None = None
        self.patches = Patches()  # the process_batch wrap: undone once the measurement has run, else at the run's end

    def packages(self) -> tuple[str, ...]:
        """The optional packages the measurement imports on use."""
        return ()

    def refuse(self, problems: list[str]) -> None:
        if problems:
            raise self.error(f'mode = "{self.mode}":\n  - ' + "\n  - ".join(problems))

    def run_problems(self, ratios: tuple[float, ...], key: str, images_key: str) -> list[str]:
        """What this run's processes, buckets and length rule out for ``images`` probes at ``ratios``."""
        run = self.run
        problems = []
        if run.world_size > 1:
            problems.append(f"{run.world_size} processes: the {self.mode} runs on one process (launch with --num_processes 1)")
        spec = get_arch(run.arch)
        for h, w in self.buckets.latent_buckets:
            bad = [r for r in ratios if target_grid((h, w), r, spec) is None]
            if bad:
                problems.append(
                    f"{key}: {', '.join(f'{r:g}' for r in bad)} give no strictly smaller {spec.name} grid (multiple {spec.multiple}) "
                    f"for the {h}x{w} latent bucket of this dataset"
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

    def make_hook(self, *args: Any, **kwargs: Any) -> MapHook:
        """The run's step hook (``DownscaleHook``'s arguments)."""
        self.hook = MapHook(*args, **kwargs)
        return self.hook

    # -- the process_batch wrapper ----------------------------------------------------------------

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
        return bool(arguments["is_train"])

    def split(self, arguments: dict[str, Any]) -> list[dict[str, Any]]:
        """A train step's batch as single-sample probes."""
        return split_batch(arguments["batch"])

    def offer(self, arguments: dict[str, Any]) -> None:
        """A train batch: take its samples as probes; with enough, run the measurement and what follows it."""
        self.batches += 1
        self.probes += self.split(arguments)
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

    def backend(self, arguments: dict[str, Any], vae: HostVae | None = None) -> SdScriptsBackend:
        """The map backend over the first ``images`` probes: every draw the trainer class's own ``process_batch``."""
        trainer, accelerator = self.ctx.trainer, arguments["accelerator"]
        host_step = type(trainer).process_batch  # the host's own, without any plugin wrapper
        rest = {k: v for k, v in arguments.items() if k not in ("self", "batch")}
        network = accelerator.unwrap_model(arguments["network"])
        params = [p for p in network.parameters() if p.requires_grad]
        return SdScriptsBackend(
            self.probes[: self.images],
            lambda probe: host_step(trainer, probe, **rest),
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

    def model_path(self) -> str | None:
        """The base model's file or name as the run's args give it."""
        return getattr(self.ctx.args, "pretrained_model_name_or_path", None)

    def model_identity(self) -> str | None:
        """The base model's hash for provenance (``kohya.model_identity``), None when there is no file to hash."""
        return model_identity(self.ctx.args)

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


class MapSession(ProbeSession):
    """One map run's state; see the module docstring. ``buckets`` is ``dataset_buckets``' answer."""

    mode = "map"

    def __init__(self, run: DownscaleRun, ctx: TrainerContext, family: SamplerFamily, buckets: DatasetBuckets, record: TrainerArch):
        from ...mapping.estimator import MapSettings

        cfg = run.cfg
        super().__init__(run, ctx, family, buckets, record, cfg.map.images)
        self.arms = build_arms(cfg.map.ratios, pixel=cfg.map.pixel, reenc=cfg.map.reenc)
        self.bins = parse_bins(cfg.map.bins)
        self.settings = MapSettings(
            margin=cfg.map.margin, draws=cfg.map.draws, images=cfg.map.images, seed=run.seed, simultaneous=cfg.map.simultaneous
        )
        self.refuse(self.problems())

    def packages(self) -> tuple[str, ...]:
        return MAP_PACKAGES

    def problems(self) -> list[str]:
        """What makes this map impossible in this run, found before any compute."""
        from ...mapping.estimator import MapInputError, check_inputs

        cfg, run = self.run.cfg, self.run
        problems = self.run_problems(cfg.map.ratios, "map_ratios", "map_images")
        if run.arch not in VAE_ARCHS:
            problems += [
                f"{key}: the VAE arms are not supported for {run.arch} (supported: {', '.join(VAE_ARCHS)}); set {key} = false"
                for key in VAE_ARM_KEYS
                if getattr(cfg.map, key.removeprefix("map_"))
            ]
        try:
            check_inputs(self.arms, self.bins, self.settings)
        except MapInputError as err:
            problems += err.problems
        return problems

    def banner(self) -> str:
        s, cfg = self.settings, self.run.cfg
        passes = s.images * len(self.bins) * len(self.arms) * s.draws
        return (
            f'  mode = "map": the gradient map runs when the first {s.images} training samples are in (batch {self.batches_needed}, '
            f"before its step); routes {', '.join(a.name for a in self.arms if a.compared)}, σ bins {self.bins.spec()} "
            f"({len(self.bins)} with σ = 1), D = {s.draws}, margin {s.margin:g}{' (Bonferroni)' if s.simultaneous else ''}: "
            f"{passes} forward+backward passes; outputs to {self.out_dir}; then after_map = {cfg.after_map!r}"
        )

    def complete(self, arguments: dict[str, Any]) -> None:
        result, paths = self.measure(arguments)
        if self.run.cfg.after_map == "stop":
            logger.info(
                'downscale_plugin: map written to %s; after_map = "stop": ending the run before training batch %d (no weights saved)',
                self.out_dir,
                self.batches,
            )
            self.run.accelerator.end_training()
            self.run.close()  # no last state or weights follow: the script ends here
            raise SystemExit(0)
        self.train_with(result, paths["toml"])

    # -- the map ----------------------------------------------------------------------------------

    def command(self) -> str:
        return f"python {' '.join(sys.argv)} (downscale_plugin mode = map, before train batch {self.batches})"

    def measure(self, arguments: dict[str, Any]) -> tuple[Any, dict[str, str]]:
        """Run the map on the first ``map_images`` probes with the trainer's own step; write every output."""
        from ...mapping.estimator import MapInputError, run_map
        from ...mapping.report import console_table, write_outputs

        vae = None
        if any(a.kind in ("reenc", "pixel") for a in self.arms):
            if arguments["vae"] is None:
                raise HostError(f'mode = "map": {" / ".join(VAE_ARM_KEYS)}: the trainer passed no VAE to process_batch')
            vae = HostVae(arguments["vae"], self.record.vae_calls, arguments["accelerator"].device, self.devices)
        backend = self.backend(arguments, vae)
        t0 = time.perf_counter()
        with forked(self.devices):
            try:
                result = run_map(backend, self.arms, self.bins, self.settings, provenance={"command": self.command()})
            except MapInputError as err:
                raise HostError(str(err)) from None
        paths = write_outputs(result, self.out_dir, self.command())
        logger.info(
            "downscale_plugin: gradient map before train batch %d (%.1f s)\n%s\n%s",
            self.batches,
            time.perf_counter() - t0,
            console_table(result),
            "\n".join(f"wrote {p}" for p in paths.values()),
        )
        return result, paths

    # -- after_map = "train" ----------------------------------------------------------------------

    def train_with(self, result: Any, windows_path: str) -> None:
        """Make the windows TOML the run's routes: router, plan, accounting, metadata; log them."""
        from ...mapping.windows import stack_windows

        derived = load_config(plugin_toml=toml.load(windows_path))
        run = self.run
        plan = run.retarget(derived.routes)
        cfg = run.cfg
        s = self.settings
        run.extra_metadata["ss_downscale_map"] = json.dumps(
            {
                "windows_toml": windows_path,
                "windows": [f"{w.arm} {w.text()}" for w in stack_windows(result).windows],
                "before_train_batch": self.batches,
                "probes": s.images,
                "ratios": list(run.cfg.map.ratios),
                "bins": self.bins.spec(),
                "draws": s.draws,
                "margin": s.margin,
                "alpha": s.alpha,
                "simultaneous": s.simultaneous,
            }
        )
        if not cfg.routes:
            logger.warning(
                'downscale_plugin: after_map = "train": no route has a safe window at margin %g; training continues native', s.margin
            )
            return
        rules = "\n".join(f"  {row}".rstrip() for row in route_rows(cfg.routes))
        logger.info(
            'downscale_plugin: after_map = "train": training continues from batch %d with the derived windows (%s)\n%s',
            self.batches,
            windows_path,
            format_plan(plan) if plan else rules,
        )
