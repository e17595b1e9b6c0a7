"""One sd-scripts training run with the plugin: what ``prepare_network(args)`` installs (docs/ARCHITECTURE.md §3, §5).

``start`` is called by ``NetworkTrainer.train`` (train_network.py) with the final merged args, before the
optimizer, ``accelerator.prepare``, resume and the loop. It validates the config, detects the
architecture, checks the hook points, builds the router and the accounting, and installs:

- the step hook (``hook.DownscaleHook``) on the trainer instance, or in the explicit call points of a
  patched host (``patches/``);
- ``ss_downscale_*`` metadata on every ``save_weights`` of the inner network (weights untouched);
- the start banner (main process) and the end summary at ``accelerator.end_training``, which every
  rank calls after the loop and before the last save (train_network.py), so the final cross-rank sum there is
  a symmetric collective;
- with ``mode = "map"``, the map session (``map.py``), with ``mode = "auto"`` the certifier's
  (``auto.py``): routes come from what it measures on the run's first batches.

Each of these patches, and the accelerate state hooks, goes through the run's one record
(``DownscaleRun.patches``), undone after the host's last save, so the trainer, the network and the
accelerator leave the run as they came (``network.downscale_run`` stays, for inspection).

Under multi-GPU the counts are summed over ranks with ``accelerator.reduce`` every train step (every
rank runs the hook on every step; the host's step logs run on the main process only, where a
collective would deadlock), and only the main process logs.
"""

from __future__ import annotations

import json
from typing import Any

from ...arch import get_arch
from ...certify_config import foreign_windows
from ...config import DownscaleConfig
from ...plan import Plan, format_plan, plan_table
from ...rng import accelerator_devices, plugin_logger
from ...router import RouteDecision, Router
from ...scope import Patches
from ...text import fasterdit_text, route_rows
from ..kohya.conventions import model_identity, plugin_config
from ..kohya.run import DownscaleRun, Routing, shared_seed, show, version
from ..kohya.selfcheck import METADATA_KEY
from .buckets import DatasetBuckets, dataset_buckets
from .facts import SUPPORTED, HostError, TrainerArch
from .families import SamplerFamily
from .flop_args import run_flops
from .hook import DownscaleHook
from .resume import HostResume, banner_line, read_host_state
from .selfcheck import refuse_host_drift
from .trainer import TrainerContext, detect_arch, find_trainer, make_family, plan_sampler, step_options

logger = plugin_logger(__name__)

# Explicit call points added by patches/sd-scripts-48d368fa-explicit-hook.patch (see patches/README.md).
EXPLICIT_STEP_HOOK = "noise_pred_and_target_hook"
EXPLICIT_LOGS_HOOK = "step_logs_hook"

PLAN_MC_SAMPLES = 8192  # σ draws per bucket for the banner's predicted fractions (±0.6 % at p = 0.5)


def host_warnings(args: Any, arch: str, cfg: DownscaleConfig, world_size: int) -> list[str]:
    """Host options the plugin honours but that change what a routed step costs or means."""
    notes = []
    if getattr(args, "torch_compile", False):  # --dynamo_backend only applies with it (library/train_util.py)
        notes.append(
            "torch compile: every routed grid is a new input shape and recompiles the denoiser; "
            "expect compile stalls early on and raise torch._dynamo.config.cache_size_limit if it falls back to eager"
        )
    if arch == "sd3" and getattr(args, "enable_scaled_pos_embed", False):
        notes.append("--enable_scaled_pos_embed: a routed step picks the position table of a smaller registered resolution")
    if cfg.gate == "strict" and world_size > 1:
        notes.append("gate = strict with several processes: ranks route independently and wait for the slowest at each all-reduce")
    return notes


class HostRouter(Router):
    """Reads T and the resume offset from the host at the first train step.

    The trainer recomputes ``max_train_steps`` from ``--max_train_epochs`` after ``prepare_network``
    (train_network.py) and resumes (``accelerator.load_state``, train_network.py) after it too. The offset is the
    absolute forward index of this run's forward 0, from what the host restored (``resume.py``).
    """

    host: tuple[Any, HostResume] | None = None  # (args, the run's resume resolver)

    def route(self, *args, **kwargs) -> RouteDecision:
        if self.host is not None:
            host_args, resume = self.host
            accumulation = int(getattr(host_args, "gradient_accumulation_steps", 1) or 1)
            self.total_forwards = int(host_args.max_train_steps) * accumulation
            self.resume_offset = resume.resolve().offset
            self.host = None
        return super().route(*args, **kwargs)


def _predict(
    ctx: TrainerContext, family: SamplerFamily, cfg: DownscaleConfig, arch: str, buckets: DatasetBuckets, world: int, flops: Any
) -> Plan | None:
    """The plan for this run's buckets under the host's own sampler (banner, predicted fractions)."""
    if not buckets.latent_buckets:
        return None
    sampler = plan_sampler(ctx, family)
    total = int(ctx.args.max_train_steps) * int(getattr(ctx.args, "gradient_accumulation_steps", 1) or 1)
    hw, weights, batch = buckets.latent_buckets, buckets.weights, buckets.batch_size
    return plan_table(
        cfg, arch, sampler, hw, batch, weights, flop_model=flops, total_forwards=total, mc_samples=PLAN_MC_SAMPLES, seed=0, world_size=world
    )


def _sampler_text(record: TrainerArch, args: Any) -> str:
    module, contract = record.sampler
    if contract == "ddpm":
        return f"host {module}.get_timesteps (DDPM t → flow σ)"
    mode = "weighting_scheme=" + str(args.weighting_scheme) if contract == "sd3" else "timestep_sampling=" + str(args.timestep_sampling)
    return f"host {module}.get_noisy_model_input_and_timesteps ({mode})"


def routing(
    ctx: TrainerContext,
    family: SamplerFamily,
    cfg: DownscaleConfig,
    arch: str,
    seed: int,
    buckets: DatasetBuckets,
    resume: HostResume | None = None,
) -> Routing:
    """The router, the banner's plan (main process) and the accounting for ``cfg``'s routes.

    ``buckets`` is :func:`dataset_buckets`' answer. A map run has no routes until its map has run,
    so it gets no plan until then. ``resume`` (one per run, shared by the routers of a map run)
    gives the absolute forward index of the run's forward 0 at the first train step.
    """
    args, accelerator = ctx.args, ctx.accelerator
    accumulation = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    router = HostRouter.from_config(
        cfg, arch, seed, total_forwards=int(args.max_train_steps) * accumulation, devices=accelerator_devices(accelerator.device)
    )
    router.host = (args, resume or HostResume(args, accelerator, ctx.frame, ctx.current_step, lambda: None))
    predict = int(accelerator.process_index) == 0 and (cfg.mode == "train" or bool(cfg.routes))
    world = int(accelerator.num_processes)
    flops = run_flops(arch, args, ctx.trainer)  # the run's own text lengths, rank, checkpointing
    plan = _predict(ctx, family, cfg, arch, buckets, world, flops) if predict else None
    return Routing.counted(router, plan, cfg, arch, flops, buckets.latent_buckets)


def check_windows(cfg: DownscaleConfig, model: str | None, arch: str, buckets: DatasetBuckets) -> None:
    """Windows certified for another model, arch or tier (``certify_config.foreign_windows``) stop the run,
    naming each mismatch, unless ``windows_foreign = "warn"``, which logs them."""
    problems = foreign_windows(cfg.windows, model, arch, buckets.latent_buckets, cfg.tier_tolerance)
    if problems and cfg.windows.foreign == "error":
        raise HostError(
            'windows certified for another model, arch or tier (windows_foreign = "warn" uses them anyway):\n  - ' + "\n  - ".join(problems)
        )
    for problem in problems:
        logger.warning('downscale_plugin: %s; windows_foreign = "warn": using the windows anyway', problem)


def start(network: Any, inner: str, plugin_keys: dict[str, str], args: Any) -> DownscaleRun | None:
    """``prepare_network``: validate, detect, build the router and accounting, install everything."""
    cfg = plugin_config(plugin_keys, args)
    if not cfg.enable:
        logger.info("downscale_plugin: enable = false; training the inner network %s unchanged", inner)
        return None
    ctx = find_trainer()
    if ctx is None or ctx.accelerator is None:
        raise HostError(f"prepare_network: no sd-scripts NetworkTrainer.train (with its accelerator) in the calling frames; {SUPPORTED}")
    record = detect_arch(ctx.trainer, args)
    arch = record.arch
    if cfg.arch is not None and cfg.arch != arch:
        raise HostError(
            f"arch: the config says {cfg.arch!r} but this run is {arch!r} ({type(ctx.trainer).__name__}); remove arch or fix it"
        )
    family = make_family(record)
    # The host's functions against what the plugin re-implements (selfcheck.py); the startup check ran it before the models loaded.
    drift = refuse_host_drift(ctx.trainer, family, args, arch if cfg.fasterdit.positions == "interpolate" else None, cfg.host_check)
    options = step_options(cfg, record)
    accelerator = ctx.accelerator
    rank, world = int(accelerator.process_index), int(accelerator.num_processes)
    for note in host_warnings(args, arch, cfg, world):
        logger.warning("downscale_plugin: %s", note)
    seed = shared_seed(cfg.seed if cfg.seed is not None else int(args.seed or 0), accelerator)
    buckets = dataset_buckets(ctx.dataset_group, get_arch(arch).vae_factor)
    check_windows(cfg, model_identity(args), arch, buckets)
    resume = HostResume(args, accelerator, ctx.frame, ctx.current_step, lambda: run.host_state)
    run = DownscaleRun(cfg, arch, inner, seed, accelerator, lambda c: routing(ctx, family, c, arch, seed, buckets, resume), read_host_state)
    if drift:  # host_check = "warn": the run trains on, and its LoRA says on what
        run.extra_metadata[METADATA_KEY] = json.dumps(drift)
    router, plan = run.router, run.plan
    session = None
    if cfg.mode == "map":
        from .map import SdScriptsMapSession  # the estimator and the plots load for a map run only

        session = SdScriptsMapSession(run, ctx, family, buckets, record)
    elif cfg.mode == "auto" and cfg.certify.budget > 0:
        from .auto import SdScriptsAutoSession

        session = SdScriptsAutoSession(run, ctx, family, buckets, record)
        run.summary_extra.append(session.summary_lines)
    hook = (session.make_hook if session else DownscaleHook)(
        router, family, options=options, rank=rank, world_size=world, on_step=run.on_step, step_logs=run.step_logs
    )
    run.hook = hook
    try:
        _install_hook(hook, ctx.trainer, run.patches)
    except AttributeError as err:
        run.close()  # what was installed before the missing hook point
        raise HostError(f"missing hook point: {err}; {SUPPORTED}") from err
    if session:
        session.install()
    run.install_state_hooks()  # counts saved with --save_state, restored (with train_state.json) on --resume
    run.install_save_and_end(network, args)
    if rank == 0:
        head = (
            f"downscale_plugin {version()}: {arch} ({type(ctx.trainer).__name__}), inner network {inner}, gate {cfg.gate}, "
            f"seed {seed}, {world} process(es); σ from {_sampler_text(record, args)}; " + fasterdit_text(cfg.fasterdit)
        )
        resumed = banner_line(args)
        if resumed:
            head += "\n" + resumed
        rules = "\n".join(f"  {row}".rstrip() for row in route_rows(cfg.routes))
        if cfg.mode == "auto" and session is None:
            rules = '  mode = "auto", certify_budget = 0: no probes; the run trains native, as the plain run'
        show(f"{head}\n{session.banner() if session else format_plan(plan) if plan else rules}", "start banner")
    network.downscale_run = run
    return run


def _install_hook(hook: DownscaleHook, trainer: Any, patches: Patches) -> None:
    """Use the patched host's explicit call points when present, else wrap the instance's methods;
    either way recorded in the run's ``patches``."""
    if not hasattr(type(trainer), EXPLICIT_STEP_HOOK):
        hook.install(trainer, patches)
        return
    patches.set(trainer, EXPLICIT_STEP_HOOK, hook.dispatch)
    patches.set(trainer, EXPLICIT_LOGS_HOOK, hook.step_logs)
    hook.install_loss(trainer, patches)  # the patch has no call point around the loss
