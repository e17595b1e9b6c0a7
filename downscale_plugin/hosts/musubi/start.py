"""One musubi-tuner training run with the plugin: what ``prepare_network(args)`` installs (docs/ARCHITECTURE.md §3, §5).

``NetworkTrainer._build_network`` calls it with the final args, after creating the network and before
``apply_to``, the optimizer, ``accelerator.prepare`` and the loop (training/trainer_base.py). It validates
the config, detects the architecture, checks the hook points and what the run trains on, builds the
router and the accounting, and installs, each recorded in the run's patches (``DownscaleRun.patches``):

- the step hook on the trainer instance's ``process_batch`` (``hook.ProcessBatchHook``), and the step
  logs' ``downscale/*`` scalars on its ``generate_step_logs``;
- ``ss_downscale_*`` metadata on every ``save_weights`` of the inner network (weights untouched);
- the start banner (main process) and the end summary at ``accelerator.end_training``, which every rank
  calls after the loop and before the main process's last save;
- the plugin's counts saved with ``--save_state`` and restored with ``--resume`` (accelerate state hooks);
- with ``mode = "map"`` (``map.py``) or ``mode = "auto"`` and ``certify_budget`` > 0 (``auto.py``), the
  in-run measurement: its forcing step hook in place of the plain one, and the probe collection around it.

The router's forward index is the plugin's own count: musubi-tuner restarts ``global_step`` at 0 on
``--resume`` and has no initial step to skip to, so forward n of a resumed run is absolute forward
(the forwards counted in the resumed state) + n, and spans, the coupled gate's step draws and spread
coins go on where the saved run stopped; T stays ``max_train_steps`` × accumulation.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from ...arch import get_arch
from ...attention import PROPORTIONAL, require_proportional
from ...config import FasterDitConfig
from ...flops import BUILDERS, arch_flops
from ...plan import format_plan, plan_table
from ...rng import accelerator_devices, plugin_logger
from ...router import RouteDecision, Router
from ...text import fasterdit_text, route_rows
from ..kohya.conventions import plugin_config
from ..kohya.run import COUNTS_FILE, DownscaleRun, Routing, shared_seed, show, version
from ..kohya.selfcheck import METADATA_KEY
from .buckets import MusubiBuckets, musubi_buckets
from .compile import compile_warning
from .facts import BASE_TRAINER, SUPPORTED, HostError, MusubiArch, trainer_arch
from .family import MusubiFamily, run_sampler
from .hook import ProcessBatchHook
from .selfcheck import refuse_host_drift
from .trainer import TrainerContext, check_methods, check_run, find_trainer

logger = plugin_logger(__name__)

PLAN_MC_SAMPLES = 8192  # σ draws per bucket for the banner's predicted fractions where no exact law is known
LOGS_METHOD = "generate_step_logs"


class ResumedForwards:
    """The adapter's train forwards before this run (per rank), from the plugin's counts in the state that
    ``--resume`` loads: every rank reads them at ``accelerator.load_state``, which the trainer runs after
    ``prepare_network`` and before the loop (training/trainer_base.py).

    The counts are sums over the *saving* run's processes, each of which ran every forward: forwards per rank is
    their total over the number of processes that saved them (``processes`` in the file), whatever this run's
    number, so a run resumed on another number of processes goes on at the same forward index, and its spans and
    step draws continue the saved run's stream. A file without that number (an older plugin) is read as saved on
    this run's number of processes, with a warning when that is more than one."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.forwards = 0
        self.total_forwards: int | None = None  # the saving run's T, where the file says it

    def load(self, models: Any, input_dir: str) -> None:
        path = os.path.join(input_dir, COUNTS_FILE)
        if not os.path.isfile(path):
            return
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        processes = saved.get("processes")
        if processes is None:
            processes = self.world_size
            if processes > 1:
                logger.warning(
                    "downscale_plugin: %s does not say how many processes saved it (an older plugin): read as %d, this run's "
                    "number; if it was saved on another number, the spans and step draws do not continue the saved run's",
                    path,
                    processes,
                )
        self.forwards = round(sum(saved["counts"]["steps"]) / int(processes))
        self.total_forwards = saved.get("total_forwards")


class MusubiRouter(Router):
    """Reads T = ``max_train_steps`` × accumulation and the resumed forwards at the first train step: the
    trainer recomputes ``max_train_steps`` from ``--max_train_epochs`` and resumes after ``prepare_network``
    (training/trainer_base.py). Forward n of this run is absolute forward (resumed forwards) + n."""

    host: tuple[Any, ResumedForwards] | None = None

    def route(self, *args, **kwargs) -> RouteDecision:
        if self.host is not None:
            host_args, resumed = self.host
            self.total_forwards = _forwards(host_args)
            self.resume_offset = resumed.forwards
            self.host = None
            spans = [r.label for r in self.rules if r.span is not None and r.span.mode != "spread"]
            if spans and resumed.total_forwards not in (None, self.total_forwards):
                logger.warning(
                    "downscale_plugin: the resumed state's run counted its early/late spans (%s) over T = %d train forwards per "
                    "process, this run over T = %d (max_train_steps × accumulation; --max_train_epochs gives another "
                    "max_train_steps on another number of processes): its spans end at other forwards than the saved run's",
                    ", ".join(spans), resumed.total_forwards, self.total_forwards,
                )  # fmt: skip
        return super().route(*args, **kwargs)


@dataclass(frozen=True)
class FramesFlops:
    """An architecture's per-frame FLOP model run on F latent frames: a video DiT attends over all
    F × (tokens of one frame) at once, so the cost is the model's at F·N, not F times its cost at N.
    The router and the token counts work per frame (F is never resized, so token ratios are F-free)."""

    base: Any  # anything with flops(n_image_tokens)
    frames: float

    def flops(self, n_image_tokens: float) -> float:
        return self.base.flops(self.frames * n_image_tokens)

    def describe(self) -> str:
        return f"{self.base.describe()}; at {self.frames:g} latent frames (F × the tokens of a frame)"


DEFAULT_RANK = 4  # musubi-tuner's networks/lora.py: network_dim None → 4


def run_flops(arch: str, buckets: MusubiBuckets, args: Any = None) -> Any:
    """The run's FLOP model at the run's latent frames (their step-weighted mean when buckets differ): the arch's
    per-block builder at ``--network_dim`` and ``--gradient_checkpointing`` where it has one, else its coarse preset."""
    if arch in BUILDERS:
        rank = getattr(args, "network_dim", None) or DEFAULT_RANK
        base = arch_flops(arch, lora_rank=int(rank), checkpointing=bool(getattr(args, "gradient_checkpointing", False)))
    else:
        base = get_arch(arch).flops
    total = sum(buckets.weights)
    frames = sum(f * w for f, w in zip(buckets.frames, buckets.weights, strict=True)) / total if total else 1.0
    return base if frames == 1.0 else FramesFlops(base, frames)


def _forwards(args: Any) -> int:
    return int(args.max_train_steps) * int(getattr(args, "gradient_accumulation_steps", 1) or 1)


def refuse_unsupported(cfg: Any, arch: str | None = None) -> None:
    """Features whose host handles this package does not provide: refused by key, not silently ignored (``arch``:
    the run's, where known).

    ``attention = "proportional"``: no musubi-tuner DiT's joint attention has a handle the plugin biases for a routed
    forward (``downscale_plugin/attention.py``; sd-scripts' FLUX.1 and the lab DiT have one).

    ``positions = "interpolate"``: every supported DiT builds its RoPE from the latent shape, and Wan
    (``freqs_fhw``), Qwen-Image (``rope_cache``) and HunyuanVideo (``pos_embed_cache``) cache it keyed by the
    token grid alone, so a routed step's interpolated positions would be served to native buckets of that grid;
    FLUX.2's ``prc_img`` ids are integers. None has a position handle the plugin scales (``arch.ArchSpec.positions``)."""
    plain = FasterDitConfig().positions
    if cfg.fasterdit.positions != plain:
        raise HostError(
            f"positions: {cfg.fasterdit.positions!r} is not available on musubi-tuner (allowed: {plain!r}): its DiTs build RoPE "
            "from the latent shape, cached per token grid (Wan's freqs_fhw, Qwen-Image's rope_cache, HunyuanVideo's "
            "pos_embed_cache), with no position handle the plugin can scale for a routed step alone"
        )
    if cfg.fasterdit.attention == PROPORTIONAL:
        try:
            require_proportional("musubi-tuner", arch or "any architecture", (), "sd-scripts' flux and the lab DiT take it")
        except ValueError as err:
            raise HostError(str(err)) from None


def routing(
    ctx: TrainerContext, family: MusubiFamily, cfg: Any, arch: str, seed: int, buckets: MusubiBuckets, resumed: ResumedForwards
) -> Routing:
    """The router, the banner's plan (main process) and the accounting for ``cfg``'s routes."""
    args, accelerator = ctx.args, ctx.accelerator
    router = MusubiRouter.from_config(cfg, arch, seed, total_forwards=_forwards(args), devices=accelerator_devices(accelerator.device))
    router.host = (args, resumed)
    plan = None
    flops = run_flops(arch, buckets, args)
    if int(accelerator.process_index) == 0 and buckets.latent_buckets and (cfg.mode == "train" or cfg.routes):  # auto: once certified
        plan = plan_table(
            cfg, arch, run_sampler(family, args, ctx.dit_dtype), buckets.latent_buckets, buckets.batch_size, buckets.weights,
            flop_model=flops, total_forwards=_forwards(args), mc_samples=PLAN_MC_SAMPLES, seed=0,
            world_size=int(accelerator.num_processes),
        )  # fmt: skip
    return Routing.counted(router, plan, cfg, arch, flops, buckets.latent_buckets)


def _sampler_text(args: Any) -> str:
    extra = f", min/max_timestep {args.min_timestep}/{args.max_timestep}" if args.min_timestep or args.max_timestep else ""
    return f"host {BASE_TRAINER}.get_noisy_model_input_and_timesteps (timestep_sampling={args.timestep_sampling}{extra})"


def start(network: Any, inner: str, plugin_keys: dict[str, str], args: Any) -> DownscaleRun | None:
    """``prepare_network``: validate, detect, check, build the router and accounting, install everything."""
    cfg = plugin_config(plugin_keys, args)
    if not cfg.enable:
        logger.info("downscale_plugin: enable = false; training the inner network %s unchanged", inner)
        return None
    ctx = find_trainer()
    if ctx is None or ctx.accelerator is None:
        raise HostError(
            f"prepare_network: no musubi-tuner NetworkTrainer._build_network (with its accelerator) in the calling frames; {SUPPORTED}"
        )
    record = trainer_arch(ctx.trainer)
    if cfg.arch is not None and cfg.arch != record.arch:
        raise HostError(
            f"arch: the config says {cfg.arch!r} but this run is {record.arch!r} ({type(ctx.trainer).__name__}); remove arch or fix it"
        )
    refuse_unsupported(cfg, record.arch)
    check_methods(ctx.trainer)
    check_run(ctx, record, cfg.gate)
    drift = refuse_host_drift(ctx.trainer, record, args, cfg.host_check)  # selfcheck.py; the startup check ran it before the DiT loaded
    family = MusubiFamily(ctx.trainer, record)
    accelerator = ctx.accelerator
    rank, world = int(accelerator.process_index), int(accelerator.num_processes)
    seed = shared_seed(cfg.seed if cfg.seed is not None else int(args.seed or 0), accelerator)
    buckets = musubi_buckets(ctx.dataset_group, get_arch(record.arch).vae_factor, record.frame_stride)
    measured = cfg.mode == "map" or (cfg.mode == "auto" and cfg.certify.budget > 0)
    compiled = compile_warning(args, cfg, record.arch, buckets, measured)
    if compiled and rank == 0:
        logger.warning("%s", compiled)
    resumed = ResumedForwards(world)
    run = DownscaleRun(cfg, record.arch, inner, seed, accelerator, lambda c: routing(ctx, family, c, record.arch, seed, buckets, resumed))
    if drift:  # host_check = "warn": the run trains on, and its LoRA says on what
        run.extra_metadata[METADATA_KEY] = json.dumps(drift)
    session = None
    if cfg.mode == "map":
        from .map import MusubiMapSession  # the estimator and the plots load for a map run only

        session = MusubiMapSession(run, ctx, family, buckets, record)
    elif cfg.mode == "auto" and cfg.certify.budget > 0:
        from .auto import MusubiAutoSession  # the certifier loads for an auto run only

        session = MusubiAutoSession(run, ctx, family, buckets, record)
        run.summary_extra.append(session.summary_lines)
    hook = (session.make_hook if session else ProcessBatchHook)(
        run.router, family, fasterdit=cfg.fasterdit, rank=rank, world_size=world, on_step=run.on_step
    )
    run.hook = hook
    hook.install(ctx.trainer, run.patches)
    if session:
        session.install()  # around the hook's wrap: the probes, then the certification, before the step that completes them
    _wrap_logs(ctx.trainer, run)
    run.install_state_hooks()  # counts saved with --save_state, restored (main process) on --resume
    run.patches.on_undo(accelerator.register_load_state_pre_hook(resumed.load).remove)
    run.install_save_and_end(network, args)
    if rank == 0:
        show(_banner(run, record, ctx, args, buckets, session), "start banner")
    network.downscale_run = run
    return run


def _banner(run: DownscaleRun, record: MusubiArch, ctx: TrainerContext, args: Any, buckets: MusubiBuckets, session: Any = None) -> str:
    cfg = run.cfg
    frames = (
        f"; latent frames {', '.join(f'{f:g}' for f in buckets.frames)} per bucket (never resized; the FLOP model runs F × frame tokens)"
        if any(f > 1 for f in buckets.frames)
        else ""
    )
    head = (
        f"downscale_plugin {version()}: {record.arch} ({type(ctx.trainer).__name__}), inner network {run.inner}, gate {cfg.gate}, "
        f"seed {run.seed}, {run.world_size} process(es); σ from {_sampler_text(args)}; {fasterdit_text(cfg.fasterdit)}; "
        f"the DiT's positions: {record.positions}{frames}"
    )
    rules = "\n".join(f"  {row}".rstrip() for row in route_rows(cfg.routes))
    if cfg.mode == "map":
        rules = session.banner()
    elif cfg.mode == "auto":
        rules = session.banner() if session else '  mode = "auto", certify_budget = 0: no probes; the run trains native, as the plain run'
    return f"{head}\n{format_plan(run.plan) if run.plan else rules}"


def _wrap_logs(trainer: Any, run: DownscaleRun) -> None:
    """The host's step logs (main process, only with trackers) get the step's loss per route and the ``downscale/*`` scalars."""
    original = getattr(trainer, LOGS_METHOD)

    def generate_step_logs(*args: Any, **kwargs: Any) -> dict:
        logs = original(*args, **kwargs)
        run.step_logs(logs, args[1] if len(args) > 1 else kwargs.get("current_loss"))
        return logs

    run.patches.set(trainer, LOGS_METHOD, generate_step_logs)
