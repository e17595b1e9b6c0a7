"""musubi-tuner's part of the commands: its training TOML, σ sampler, timestep range and buckets.

``check --host musubi`` reads a musubi-tuner training TOML (or a whole command line after ``--``) as
the trainer and the network module will, and adds what a musubi-tuner run refuses at start (the in-run
map, the FasterDiT options, an arch the script does not train, a sampler value musubi-tuner does not
have). ``plan --host musubi`` reproduces what the trainer will draw: each knob comes from the flag,
else the training TOML, else musubi-tuner's parser default (training/parser_common.py).

The σ sampler is the host's own: with musubi-tuner importable, ``NetworkTrainer.get_noisy_model_input_and_timesteps``
itself through :class:`~.family.PlanSampler`, exactly as the start banner's plan runs it (Monte Carlo
through the host's draws, the scheduler grid's exact atoms); without it, the exact law of the flow
modes that the run's router uses (:func:`~.family.flow_law`). The buckets come from ``--bucket`` or
the dataset TOML (``dataset_config``): each dataset's resolution and, for video, its target frames.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import toml
import torch

from ...arch import get_arch
from ...cli import HostArgs, HostPart, PlanInputs, register_host
from ...config import ConfigError, DownscaleConfig, vae_arm_problems
from ...plan import Sampler
from ...sigma import ContinuousLaw
from ..kohya.conventions import config_from_command_line, config_from_training_toml
from ..kohya.selfcheck import warned
from .buckets import MusubiBuckets, latent_frames
from .facts import BY_ARCH, HOST_PACKAGE, MUSUBI_ARCHS, REFUSED_TRAINERS, SUPPORTED, TRAINER_BASE, HostError
from .family import FLOW_MODES, MusubiFamily, flow_law, run_sampler
from .startup import command_line_drift

TIMESTEP_SAMPLING = ("sigma", *FLOW_MODES)  # --timestep_sampling's choices (training/parser_common.py)
WEIGHTING_SCHEMES = ("logit_normal", "mode", "cosmap", "sigma_sqrt", "none")
# musubi-tuner's parser defaults (training/parser_common.py _add_timestep_args)
DEFAULTS: dict[str, Any] = {
    "timestep_sampling": "sigma",
    "discrete_flow_shift": 1.0,
    "sigmoid_scale": 1.0,
    "weighting_scheme": "none",
    "logit_mean": 0.0,
    "logit_std": 1.0,
    "mode_scale": 1.29,
    "min_timestep": None,
    "max_timestep": None,
    "preserve_distribution_shape": False,
    "num_timestep_buckets": None,
}
KINDS: dict[str, type] = {
    "timestep_sampling": str, "discrete_flow_shift": float, "sigmoid_scale": float, "weighting_scheme": str, "logit_mean": float,
    "logit_std": float, "mode_scale": float, "min_timestep": int, "max_timestep": int, "preserve_distribution_shape": bool,
    "num_timestep_buckets": int,
}  # fmt: skip
SAMPLER_KNOBS = tuple(DEFAULTS)
SCRIPTS = {record.script: record.arch for record in MUSUBI_ARCHS}
# Training scripts of the trainers refused at start (facts.REFUSED_TRAINERS), by script name.
REFUSED_SCRIPTS = {
    "fpack_train_network": "FramePackNetworkTrainer",
    "flux_kontext_train_network": "FluxKontextNetworkTrainer",
    "hidream_o1_train_network": "HiDreamO1NetworkTrainer",
    "flux_2_train_network_self_flow": "Flux2SelfFlowNetworkTrainer",
}
DEFAULT_MAX_TRAIN_STEPS = 1600  # training/parser_common.py
PARSER_COMMON = f"{HOST_PACKAGE}.training.parser_common"  # setup_parser_common: the options every training script has
DEFAULT_RESOLUTION = (960, 544)  # dataset/config_utils.py BaseDatasetParams
FRAME_MODES = ("head", "chunk", "slide", "uniform")  # frame_extraction modes whose items have target_frames frames


# -- the training TOML and the command line -------------------------------------------------------


def _knob_problems(values: Mapping[str, Any]) -> list[str]:
    """What musubi-tuner's parser would refuse, or silently read another way, in these sampler values."""
    problems = []
    mode = values.get("timestep_sampling")
    if mode is not None and mode not in TIMESTEP_SAMPLING:
        problems.append(f"timestep_sampling: {mode!r} is not one of musubi-tuner's samplers (allowed: {', '.join(TIMESTEP_SAMPLING)})")
    scheme = values.get("weighting_scheme")
    if scheme is not None and scheme not in WEIGHTING_SCHEMES:
        problems.append(f"weighting_scheme: {scheme!r} is not allowed (allowed: {', '.join(WEIGHTING_SCHEMES)})")
    lo, hi = values.get("min_timestep"), values.get("max_timestep")
    if isinstance(lo, (int, float)) or isinstance(hi, (int, float)):
        t_min = 0 if lo is None else lo
        t_max = 1000 if hi is None else hi
        if not (isinstance(t_min, (int, float)) and isinstance(t_max, (int, float)) and 0 <= t_min < t_max <= 1000):
            problems.append(f"min_timestep/max_timestep: need 0 <= min_timestep ({lo}) < max_timestep ({hi}) <= 1000")
    buckets = values.get("num_timestep_buckets")
    if isinstance(buckets, int) and not isinstance(buckets, bool) and buckets < 0:
        problems.append(f"num_timestep_buckets: {buckets} must be at least 0 (0, 1 or unset: no buckets)")
    return problems


def _run_problems(cfg: DownscaleConfig, values: Mapping[str, Any], script_arch: str | None = None) -> list[str]:
    """What a musubi-tuner run with this config refuses at start, and what the command line's values are not."""
    from .start import refuse_unsupported  # the run's own check

    problems = []
    try:
        refuse_unsupported(cfg, script_arch)
    except HostError as err:
        problems.append(str(err))
    archs = tuple(BY_ARCH)
    problems += vae_arm_problems(cfg, script_arch or cfg.arch or "any musubi-tuner architecture", ())  # no VAE reaches process_batch
    if cfg.arch is not None and cfg.arch not in archs:
        problems.append(f"arch: {cfg.arch!r} is not trained by musubi-tuner (allowed: {', '.join(archs)})")
    elif cfg.arch is not None and script_arch is not None and cfg.arch != script_arch:
        problems.append(f"arch: the config says {cfg.arch!r} but the script trains {script_arch!r}; remove arch or fix it")
    return problems + _knob_problems(values)


def read_training_config(path: str) -> tuple[DownscaleConfig, dict[str, Any]]:
    """A musubi-tuner training TOML, flattened as ``read_config_from_file`` does: the plugin config, the host args."""
    cfg, flat = config_from_training_toml(path)
    problems = _run_problems(cfg, flat)
    if problems:
        raise ConfigError(problems)
    return cfg, flat


def script_arch(argv: Sequence[str]) -> str | None:
    """The arch of the musubi-tuner training script a command line runs (``wan_train_network.py``,
    ``-m musubi_tuner.wan_train_network``; None: another script); HostError for a script whose trainer the plugin refuses."""
    argv = [str(a) for a in argv]
    for i, token in enumerate(argv):
        if token == "-m" and i + 1 < len(argv):
            name = argv[i + 1].rsplit(".", 1)[-1]
        elif token.endswith(".py") and not token.startswith("-"):
            name = os.path.basename(token)[:-3]
        else:
            continue
        if name in REFUSED_SCRIPTS:
            raise HostError(f"{name}: not supported: {REFUSED_TRAINERS[REFUSED_SCRIPTS[name]]}; {SUPPORTED}")
        return SCRIPTS.get(name)
    return None


def read_command_line(argv: Sequence[str]) -> tuple[DownscaleConfig, dict[str, Any]]:
    """``check --host musubi -- TRAINER COMMAND``: the run's config as the network module reads it, and
    what the run would refuse at start, including the drift self-check of the script's musubi-tuner where it is
    importable (``selfcheck.py``)."""
    try:
        arch = script_arch(argv)
    except HostError as err:
        raise ConfigError([str(err)]) from None
    cfg, merged = config_from_command_line(argv)
    problems = _run_problems(cfg, merged, arch) + warned(command_line_drift(argv), cfg.host_check)
    if problems:
        raise ConfigError(problems)
    return cfg, merged


# -- the σ sampler --------------------------------------------------------------------------------


def sampler_args(host: HostArgs) -> SimpleNamespace:
    """The sampler's args as the trainer will have them (flag, else training TOML, else musubi-tuner's default)."""
    values = {name: host.get(name, default, KINDS[name]) for name, default in DEFAULTS.items()}
    problems = _knob_problems(values)
    if problems:
        raise ConfigError(problems)
    return SimpleNamespace(**values)


def trainer_base() -> ModuleType | None:
    """musubi-tuner's ``training/trainer_base.py``, or None where musubi-tuner is not importable."""
    try:
        return importlib.import_module(TRAINER_BASE)
    except ImportError:
        return None


@dataclass(frozen=True)
class LawSampler:
    """The exact law of a flow mode (:func:`~.family.flow_law`, what the run's router fills from) as a ``plan`` sampler."""

    args: Any
    has_closed_form = True

    def law(self, latent_hw: tuple[int, int]) -> ContinuousLaw:
        law = flow_law(self.args, tuple(latent_hw))
        assert law is not None  # only built for modes with a law
        return law

    def mass(self, lo: float, hi: float | None, latent_hw: tuple[int, int]) -> float:
        return self.law(latent_hw).mass(lo, 1.0 if hi is None else hi)

    def sample(self, n: int, latent_hw: tuple[int, int], generator: torch.Generator | None = None) -> torch.Tensor:
        return self.law(latent_hw).quantile(torch.rand(n, dtype=torch.float64, generator=generator)).float()


def _describe(args: SimpleNamespace) -> str:
    mode = args.timestep_sampling
    if mode == "sigma":
        text = f"sigma: {args.weighting_scheme} density on the shift-{args.discrete_flow_shift:g} scheduler grid"
    elif mode == "shift":
        text = f"shift (shift {args.discrete_flow_shift:g}, sigmoid_scale {args.sigmoid_scale:g})"
    elif mode == "uniform":
        text = "uniform"
    else:
        text = f"{mode} (sigmoid_scale {args.sigmoid_scale:g}{', μ from each bucket' if mode != 'sigmoid' else ''})"
    if args.min_timestep is not None or args.max_timestep is not None:
        lo = 0 if args.min_timestep is None else args.min_timestep
        hi = 1000 if args.max_timestep is None else args.max_timestep
        text += f", timesteps [{lo}, {hi}]" + (" by rejection" if args.preserve_distribution_shape and mode != "sigma" else "")
    if (args.num_timestep_buckets or 0) > 1:
        text += f", {args.num_timestep_buckets} timestep buckets (each σ's law; strict odds treat a batch's σ as independent)"
    return text


def host_sampler(arch: str, host: HostArgs) -> tuple[Sampler, str]:
    """The σ sampler musubi-tuner's trainer runs with these knobs, and a description."""
    args = sampler_args(host)
    base = trainer_base()
    text = _describe(args)
    if base is not None:
        trainer = base.NetworkTrainer()
        trainer.num_timestep_buckets = args.num_timestep_buckets
        # every option of musubi-tuner's own parser at its default under the knobs: the host's sampler may read more
        run_args = SimpleNamespace(**{**vars(importlib.import_module(PARSER_COMMON).setup_parser_common().parse_args([])), **vars(args)})
        return run_sampler(
            MusubiFamily(trainer, BY_ARCH[arch]), run_args, torch.bfloat16
        ), f"{text}; musubi-tuner's NetworkTrainer.get_noisy_model_input_and_timesteps"
    if args.timestep_sampling in FLOW_MODES and not args.preserve_distribution_shape and flow_law(args, (64, 64)) is not None:
        return LawSampler(args), f"{text}; exact law (musubi-tuner not importable)"
    exact = ", ".join(m for m in FLOW_MODES if flow_law(SimpleNamespace(**{**vars(args), "timestep_sampling": m}), (64, 64)))
    preserved = args.preserve_distribution_shape and args.timestep_sampling in FLOW_MODES
    what = "--preserve_distribution_shape" if preserved else f"timestep_sampling {args.timestep_sampling!r}"
    raise ConfigError(
        [
            f"{what}: plan draws it with musubi-tuner's own sampler, and {TRAINER_BASE} is not importable here; "
            f"install musubi-tuner into this environment (pip install -e /path/to/musubi-tuner), or plan a mode with an exact law ({exact})"
        ]
    )


# -- buckets --------------------------------------------------------------------------------------


def _bucket(text: str) -> tuple[int, int, int | None, float]:
    """``WxH[xF][:WEIGHT]`` in pixels (F: pixel frames of a video bucket)."""
    size, _, weight = text.partition(":")
    parts = size.lower().split("x")
    try:
        edges = [int(p) for p in parts]
        wt = float(weight) if weight else 1.0
    except ValueError:
        edges, wt = [], 1.0
    if len(edges) not in (2, 3) or min(edges) <= 0 or wt < 0:
        raise ConfigError([f"--bucket: {text!r} must be WIDTHxHEIGHT[xFRAMES][:WEIGHT] in pixels, e.g. 1280x720x81 or 1024x1024:3"])
    return edges[0], edges[1], edges[2] if len(edges) == 3 else None, wt


def _resolution(value: Any, where: str) -> tuple[int, int]:
    """A dataset's ``resolution``: one edge or [W, H] (dataset/config_utils.py)."""
    edges = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    ok = (
        isinstance(edges, (list, tuple))
        and len(edges) in (1, 2)
        and all(isinstance(e, int) and not isinstance(e, bool) and e > 0 for e in edges)
    )
    if not ok:
        raise ConfigError([f"{where} resolution: {value!r} must be SIZE or [WIDTH, HEIGHT] in pixels"])
    return edges[0], edges[-1]


def _dataset_path(path: str, toml_path: str | None) -> str:
    """musubi-tuner opens ``dataset_config`` as given (relative to the working directory); plan also looks beside the training TOML."""
    if os.path.isfile(path) or os.path.isabs(path) or not toml_path:
        return path
    beside = os.path.join(os.path.dirname(os.path.abspath(toml_path)), path)
    return beside if os.path.isfile(beside) else path


def dataset_buckets(path: str, frame_stride: int | None) -> tuple[list[tuple[int, int, int | None, float]], list[int], str]:
    """(W, H, pixel frames or None, weight) per bucket of a musubi-tuner dataset TOML, each bucket's batch size, a note."""
    if not os.path.isfile(path):
        raise ConfigError([f"dataset_config: file not found: {path}"])
    try:
        data = toml.load(path)
    except toml.TomlDecodeError as err:
        raise ConfigError([f"dataset_config: {path} is not valid TOML: {err}"]) from None
    general = data.get("general", {}) or {}
    datasets = data.get("datasets") or []
    if not isinstance(datasets, list) or not datasets:
        raise ConfigError([f"dataset_config: {path} has no [[datasets]]"])
    out: list[tuple[int, int, int | None, float]] = []
    batches: list[int] = []
    notes: set[str] = set()
    for n, entry in enumerate(datasets):
        merged = {**general, **entry}
        where = f"dataset_config [[datasets]] {n}"
        w, h = _resolution(merged.get("resolution", list(DEFAULT_RESOLUTION)), where)
        if merged.get("enable_bucket"):
            notes.add(
                f"enable_bucket: the data's aspect ratios pick buckets of about this area; planned at {w}x{h} (pass --bucket for the real list)"
            )
        batch = merged.get("batch_size", 1)
        video = any(key in merged for key in ("video_directory", "video_jsonl_file"))
        if not video:
            out.append((w, h, None, 1.0))
            batches.append(int(batch))
            continue
        if frame_stride is None:
            raise ConfigError([f"{where}: a video dataset, but this architecture trains on images"])
        mode = merged.get("frame_extraction", "head")
        if mode not in FRAME_MODES:
            raise ConfigError([f"{where} frame_extraction: {mode!r}: the frame counts come from the videos; pass --bucket WxHxFRAMES"])
        frames = sorted(
            {(int(f) - 1) // frame_stride * frame_stride + 1 for f in merged.get("target_frames", [1])}
        )  # the dataset rounds them
        out += [(w, h, f, 1.0) for f in frames]
        batches += [int(batch)] * len(frames)
    note = f"{len(out)} bucket(s) from {path}, equal weights (the item counts decide the real shares; --bucket WxH[xF]:WEIGHT sets them)"
    return out, batches, "; ".join([note, *sorted(notes)])


def plan_buckets(args: argparse.Namespace, host: HostArgs, arch: str) -> tuple[MusubiBuckets, str]:
    """The run's buckets at the latent grid, as ``buckets.musubi_buckets`` reports a run's: frames averaged per grid."""
    record = BY_ARCH[arch]
    spec = get_arch(arch)
    batches: list[int] = []
    if args.bucket:
        parsed = [_bucket(b) for b in args.bucket]
        note = f"{len(parsed)} bucket(s) from --bucket"
    else:
        config = host.get("dataset_config", None)
        if config is None:
            raise ConfigError(
                [
                    "buckets: give --bucket WIDTHxHEIGHT[xFRAMES] or a dataset TOML (--dataset_config, or dataset_config in the training TOML)"
                ]
            )
        parsed, batches, note = dataset_buckets(_dataset_path(config, getattr(args, "config_file", None)), record.frame_stride)
    bad = [f"{w}x{h}" for w, h, _, _ in parsed if w % spec.vae_factor or h % spec.vae_factor]
    if bad:
        raise ConfigError([f"buckets {', '.join(bad)}: sides must be multiples of {arch}'s VAE factor {spec.vae_factor}"])
    if record.frame_stride is None and any(f not in (None, 1) for *_, f, _ in parsed):
        raise ConfigError([f"buckets: {arch} trains on images; give buckets as WIDTHxHEIGHT"])
    weights: dict[tuple[int, int], float] = {}
    frames: dict[tuple[int, int], float] = {}
    for w, h, f, wt in parsed:
        hw = (h // spec.vae_factor, w // spec.vae_factor)
        weights[hw] = weights.get(hw, 0.0) + wt
        frames[hw] = frames.get(hw, 0.0) + wt * latent_frames(f or 1, record.frame_stride)
    batch = host.get("batch_size", Counter(batches).most_common(1)[0][0] if batches else 1, int)
    buckets = MusubiBuckets(
        list(weights), list(weights.values()), batch, [frames[hw] / weights[hw] if weights[hw] else 1.0 for hw in weights]
    )
    if any(f > 1 for f in buckets.frames):
        note += "; latent frames " + ", ".join(f"{f:g}" for f in buckets.frames) + " (never resized; the FLOP model runs F × frame tokens)"
    return buckets, note


def plan_inputs(args: argparse.Namespace, host: HostArgs, arch: str) -> PlanInputs:
    sampler, sampler_text = host_sampler(arch, host)
    buckets, note = plan_buckets(args, host, arch)
    epochs = host.get("max_train_epochs", None, int)
    steps = host.get("max_train_steps", DEFAULT_MAX_TRAIN_STEPS, int)
    total = (
        0
        if epochs is not None and getattr(args, "max_train_steps", None) is None
        else steps * host.get("gradient_accumulation_steps", 1, int)
    )
    from .start import run_flops  # the FLOP model the run's banner and accounting use

    run = SimpleNamespace(
        network_dim=host.get("network_dim", None, int), gradient_checkpointing=host.get("gradient_checkpointing", False, bool)
    )
    flops = run_flops(arch, buckets, run)
    return PlanInputs(
        sampler,
        sampler_text,
        buckets.latent_buckets,
        buckets.weights,
        note,
        buckets.batch_size,
        total,
        (*SAMPLER_KNOBS, "batch_size"),
        flops,
    )


# -- the options ----------------------------------------------------------------------------------


def add_sampler_arguments(parser: argparse.ArgumentParser) -> None:
    """musubi-tuner's σ-sampler options (its spellings and choices), each overriding the training TOML's value."""
    group = parser.add_argument_group("musubi-tuner σ sampler (default: the training TOML, else musubi-tuner's default)")
    group.add_argument("--timestep_sampling", choices=TIMESTEP_SAMPLING, help="default sigma")
    group.add_argument("--weighting_scheme", choices=WEIGHTING_SCHEMES, help="density of the sigma grid path (default none)")
    for name in ("discrete_flow_shift", "sigmoid_scale", "logit_mean", "logit_std", "mode_scale"):
        group.add_argument(f"--{name}", type=float, help=f"default {DEFAULTS[name]:g}")
    group.add_argument("--min_timestep", type=int, help="lowest timestep, 0-999 (σ from min_timestep/1000; default 0)")
    group.add_argument("--max_timestep", type=int, help="highest timestep, 1-1000 (default 1000)")
    group.add_argument("--preserve_distribution_shape", action="store_true", default=None, help="timestep range by rejection")
    group.add_argument("--num_timestep_buckets", type=int, help="stratified timestep buckets (default none)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``plan``'s musubi-tuner options: the training script, the σ sampler, buckets, batches and the run length."""
    parser.add_argument("--script", help=f"the musubi-tuner training script, naming the arch ({', '.join(f'{s}.py' for s in SCRIPTS)})")
    add_sampler_arguments(parser)
    data = parser.add_argument_group("batches and buckets")
    data.add_argument("--dataset_config", metavar="DATASET_TOML", help="musubi-tuner dataset TOML (default: the training TOML's)")
    data.add_argument(
        "--bucket",
        action="append",
        metavar="WxH[xF][:WEIGHT]",
        help="bucket in pixels, F pixel frames (repeatable); replaces the dataset's",
    )
    data.add_argument("--batch_size", type=int, help="default: the dataset TOML's most common batch_size, else 1")
    steps = parser.add_argument_group("spans")
    steps.add_argument("--max_train_steps", type=int, help=f"default {DEFAULT_MAX_TRAIN_STEPS} (unknown with max_train_epochs)")
    steps.add_argument("--gradient_accumulation_steps", type=int)


def arch_hint(args: argparse.Namespace) -> str | None:
    script = getattr(args, "script", None)
    if script is None:
        return None
    name = os.path.basename(script)
    name = name[:-3] if name.endswith(".py") else name
    if name in REFUSED_SCRIPTS:
        raise ConfigError([f"--script {script}: not supported: {REFUSED_TRAINERS[REFUSED_SCRIPTS[name]]}"])
    if name not in SCRIPTS:
        raise ConfigError(
            [f"--script: {script!r} is not a musubi-tuner LoRA training script the plugin supports (allowed: {', '.join(SCRIPTS)})"]
        )
    return SCRIPTS[name]


register_host(
    HostPart(
        name="musubi",
        archs=tuple(BY_ARCH),
        read_training_config=read_training_config,
        add_sampler_arguments=add_sampler_arguments,
        add_arguments=add_arguments,
        sampler=host_sampler,
        plan_inputs=plan_inputs,
        latent_scale=lambda arch: 1.0,  # musubi-tuner's caches hold latents as the DiT reads them
        read_command_line=read_command_line,
        arch_hint=arch_hint,
    )
)
