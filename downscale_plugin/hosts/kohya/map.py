"""``mode = "map"`` in a kohya run: the gradient map on the run's own model, network and data.

Timeline (one process; docs/FIDELITY.md has the method):

1. The host's ``start`` (``prepare_network``) builds the session. The router has no routes yet, so
   the first steps run native, bitwise the host's. What the run's buckets and length already show
   (a ratio with no smaller grid, too few batches for the probes, several processes, a missing
   package, VAE arms where the host drives no VAE for the architecture) stops the run there, before
   any compute.
2. Every train ``process_batch`` call until the map has run hands its batch to the session, split
   into single-sample probes (``probes.ProbeSession``); the step then runs.
3. At the call that completes ``map_images`` probes, before that step runs: the map
   (:func:`~downscale_plugin.mapping.estimator.run_map` over :class:`~.backend.ProbeBackend`). Every
   draw is the trainer class's own step, forced by the step hook to the arm's grid and the map's σ.
   Torch's CPU and device RNG and Python's and NumPy's global RNG are restored afterwards, and each
   gradient is a backward with every ``.grad`` set aside and put back (``estimator.param_grads``), so
   ``.grad`` (accumulated gradients included) and the optimizer are as they were: training continues
   exactly as if the map had not run. The lab
   map's files go to ``map_out``, and the table to the log.
4. ``after_map = "stop"``: the end summary and the host's ``accelerator.end_training()`` run, then
   ``SystemExit(0)``: the script ends without a traceback and saves no weights.
   ``after_map = "train"``: the windows TOML, read as the router reads it, becomes the run's routes
   (the config's other keys kept); router, plan, accounting (the native steps so far carried over)
   and the saved file's metadata (``ss_downscale_map``) follow, and the step continues, routed.
"""

from __future__ import annotations

import json
import time
from typing import Any

import toml

from ...bins import parse_bins
from ...config import load_config, vae_arm_problems
from ...mapping.arms import build_arms
from ...plan import format_plan
from ...rng import forked, plugin_logger
from ...text import route_rows
from .probes import ProbeSession
from .run import DownscaleRun

logger = plugin_logger(__name__)


class MapSession(ProbeSession):
    """One map run's state; see the module docstring. A host's subclass adds its probes (``ProbeSession``)
    and, where it drives the run's VAE, ``vae_archs`` and :meth:`host_vae`."""

    mode = "map"
    vae_archs: tuple[str, ...] = ()  # the architectures whose VAE the host drives for the map's VAE arms

    def __init__(self, run: DownscaleRun, ctx: Any, family: Any, buckets: Any, record: Any):
        self.refuse_missing_packages(run)  # before the estimator's import needs them
        from ...mapping.estimator import MapSettings

        cfg = run.cfg
        super().__init__(run, ctx, family, buckets, record, cfg.map.images)
        self.arms = build_arms(cfg.map.ratios, pixel=cfg.map.pixel, reenc=cfg.map.reenc)
        self.bins = parse_bins(cfg.map.bins)
        self.settings = MapSettings(
            margin=cfg.map.margin, draws=cfg.map.draws, images=cfg.map.images, seed=run.seed, simultaneous=cfg.map.simultaneous
        )
        self.refuse(self.problems())

    def problems(self) -> list[str]:
        """What makes this map impossible in this run, found before any compute."""
        from ...mapping.estimator import MapInputError, check_inputs

        cfg, run = self.run.cfg, self.run
        problems = self.run_problems(cfg.map.ratios, "map_ratios", "map_images")
        problems += vae_arm_problems(cfg, run.arch, self.vae_archs)
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

    def host_vae(self, arguments: dict[str, Any]) -> Any:
        """The run's VAE for the VAE arms, as the host's latent cache calls it (only where ``vae_archs`` has the arch)."""
        raise NotImplementedError

    def measure(self, arguments: dict[str, Any]) -> tuple[Any, dict[str, str]]:
        """Run the map on the first ``map_images`` probes with the trainer's own step; write every output."""
        from ...mapping.estimator import MapInputError, run_map
        from ...mapping.report import console_table, write_outputs

        vae = self.host_vae(arguments) if any(a.kind in ("reenc", "pixel") for a in self.arms) else None
        backend = self.backend(arguments, vae)
        t0 = time.perf_counter()
        with forked(self.devices):
            try:
                result = run_map(backend, self.arms, self.bins, self.settings, provenance={"command": self.command()})
            except MapInputError as err:
                raise self.error(str(err)) from None
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
