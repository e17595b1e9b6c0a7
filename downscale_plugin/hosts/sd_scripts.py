"""sd-scripts adapter: the ``--network_module downscale_plugin`` entry points (DESIGN §2).

Everything here that knows sd-scripts' names, except the σ sampler families (``families.py``):

- ``create_network`` / ``create_network_from_weights`` with the host's exact signatures. They pop the
  plugin's keys, build the network with the inner module (``inner=`` or auto-detected from the
  denoiser's class name) and return **that object itself**: the host type-checks it on save/resume,
  DDP and DeepSpeed wrap it, and several inner modules override ``state_dict``. In a training run
  they attach ``prepare_network(args)`` to it (chaining one the inner has). Outside a trainer, and
  for ``for_inference=True`` (``--base_weights`` merges, ``gen_img.py``), they only delegate.
- finding the trainer: the ``self`` of ``train`` in the caller frames (the class may live in
  ``__main__``, so the plugin never imports ``train_network``), and the architecture and σ sampler
  family from its class names.

``prepare_network(args)`` itself, everything a training run installs, is in ``sd_scripts_run.py``;
it is imported only when a run starts, so inference tools that import this module only delegate.
"""

from __future__ import annotations

import importlib
import inspect
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ..config import DownscaleConfig, load_config, network_args_dict, split_network_args
from ..grid import get_arch
from .families import DDPMFamily, FlowFamily
from .hook import StepOptions

SUPPORTED_REVISION = "48d368fa"
SUPPORTED = f"downscale_plugin supports sd-scripts main {SUPPORTED_REVISION} (2026-02-16)"

# Denoiser class name (type(unet).__name__) → inner network module (host-sd-scripts.md §1.1).
INNER_BY_DENOISER = {
    "UNet2DConditionModel": "networks.lora",
    "SdxlUNet2DConditionModel": "networks.lora",
    "MMDiT": "networks.lora_sd3",
    "Flux": "networks.lora_flux",
    "Chroma": "networks.lora_flux",
    "NextDiT": "networks.lora_lumina",
    "Anima": "networks.lora_anima",
    "HYImageDiffusionTransformer": "networks.lora_hunyuan_image",
}
KNOWN_INNERS = (*dict.fromkeys(INNER_BY_DENOISER.values()), "lycoris.kohya")

# Trainer class name → architecture; the first match along type(trainer).__mro__ wins (subclass first).
ARCH_BY_TRAINER = {
    "AnimaNetworkTrainer": "anima",
    "HunyuanImageNetworkTrainer": "hunyuan_image",
    "LuminaNetworkTrainer": "lumina",
    "FluxNetworkTrainer": "flux",
    "Sd3NetworkTrainer": "sd3",
    "SdxlNetworkTrainer": "sdxl",
    "NetworkTrainer": "sd1",
}

# Architecture → (module holding the σ sampler slot, family contract).
SAMPLER_BY_ARCH = {
    "flux": ("library.flux_train_utils", "flux"),
    "chroma": ("library.flux_train_utils", "flux"),
    "anima": ("library.flux_train_utils", "flux"),
    "hunyuan_image": ("library.flux_train_utils", "flux"),
    "sd3": ("library.sd3_train_utils", "sd3"),
    "lumina": ("library.lumina_train_util", "lumina"),
    "sdxl": ("library.train_util", "ddpm"),
    "sd1": ("library.train_util", "ddpm"),
}

# FasterDiT handles (module, attribute): the loss ``NetworkTrainer.process_batch`` calls (tn:468), and per
# architecture the module holding the position ids ``positions = "interpolate"`` scales (Lumina and
# Anima: the denoiser itself).
LOSS_HANDLE = ("library.train_util", "conditional_loss")
# Architecture → how its latent cache calls the VAE (mapping/sd_scripts_backend.VAE_CALLS), for the map's VAE arms:
# "direct" ``vae.encode(x)`` / ``vae.decode(z)``: Flux's AutoEncoder (Lumina loads it too; it shifts and scales
# itself), SD3's SDVAE (raw latents: the trainer's shift_scale_latents applies SDVAE.process_in after loading);
# "diffusers" ``vae.encode(x).latent_dist.sample()`` / ``vae.decode(z).sample``: SD1/SDXL's AutoencoderKL (unscaled
# latents: the trainer multiplies by vae_scale_factor after loading). Both cache the latent before that shift/scale.
VAE_BY_ARCH = {"flux": "direct", "chroma": "direct", "lumina": "direct", "sd3": "direct", "sdxl": "diffusers", "sd1": "diffusers"}
VAE_ARCHS = tuple(VAE_BY_ARCH)
POSITIONS_HANDLE_BY_ARCH = {
    "flux": ("library.flux_utils", "prepare_img_ids"),
    "chroma": ("library.flux_utils", "prepare_img_ids"),
    "hunyuan_image": ("library.hunyuan_image_utils", "get_meshgrid_nd"),
}


class HostError(RuntimeError):
    """The running sd-scripts does not offer what the plugin needs; the message says what and why."""


# ---------------------------------------------------------------------------------------------
# Finding the trainer


@dataclass(frozen=True)
class TrainerContext:
    """What ``NetworkTrainer.train``'s frame holds when it calls the network module (tn:491-697)."""

    trainer: Any
    args: Any
    accelerator: Any
    weight_dtype: Any
    current_step: Any  # the loop's multiprocessing Value, set to global_step every step (tn:1416)
    dataset_group: Any  # train_dataset_group; deleted from the frame later (tn:1285)


def find_trainer() -> TrainerContext | None:
    """The nearest caller frame that is a sd-scripts trainer's ``train`` (duck-typed), else None."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            me = frame.f_locals.get("self") if frame.f_code.co_name == "train" else None
            if callable(getattr(me, "process_batch", None)) and callable(getattr(me, "get_noise_pred_and_target", None)):
                loc = frame.f_locals
                return TrainerContext(
                    me,
                    loc.get("args"),
                    loc.get("accelerator"),
                    loc.get("weight_dtype"),
                    loc.get("current_step"),
                    loc.get("train_dataset_group"),
                )
            frame = frame.f_back
        return None
    finally:
        del frame


def detect_arch(trainer: Any, args: Any) -> str:
    for cls in type(trainer).__mro__:
        arch = ARCH_BY_TRAINER.get(cls.__name__)
        if arch is not None:
            return "chroma" if arch == "flux" and getattr(args, "model_type", None) == "chroma" else arch
    raise HostError(f"{type(trainer).__name__} is not one of sd-scripts' LoRA trainers ({', '.join(ARCH_BY_TRAINER)}); {SUPPORTED}")


def make_family(arch: str) -> FlowFamily | DDPMFamily:
    """The σ sampler family of an architecture, bound to the host's module (the one the trainer uses)."""
    module_name, contract = SAMPLER_BY_ARCH[arch]
    try:
        module = importlib.import_module(module_name)
        return DDPMFamily(module) if contract == "ddpm" else FlowFamily(module, contract)
    except (ImportError, AttributeError) as err:
        raise HostError(f"{arch}: missing hook point: {err}; {SUPPORTED}") from err


def _handle_module(arch: str, name: str, attr: str) -> ModuleType:
    try:
        module = importlib.import_module(name)
    except ImportError as err:
        raise HostError(f"{arch}: missing hook point: {err}; {SUPPORTED}") from err
    if not callable(getattr(module, attr, None)):
        raise HostError(f"{arch}: missing hook point: {name}.{attr}; {SUPPORTED}")
    return module


def step_options(cfg: DownscaleConfig, arch: str) -> StepOptions:
    """The run's FasterDiT options bound to this host's handles (imported only when an option needs them)."""
    handles: dict[str, Any] = {}
    if cfg.direction_loss_weight:
        handles["loss_module"] = _handle_module(arch, *LOSS_HANDLE)
    if cfg.positions == "interpolate":
        handles["positions_arch"] = get_arch(arch)
        if arch in POSITIONS_HANDLE_BY_ARCH:
            handles["positions_module"] = _handle_module(arch, *POSITIONS_HANDLE_BY_ARCH[arch])
    try:
        return StepOptions.from_config(cfg, **handles)
    except ValueError as err:
        raise HostError(str(err)) from err


# ---------------------------------------------------------------------------------------------
# The inner network module


def plugin_config(plugin_keys: dict[str, str], args: Any) -> DownscaleConfig:
    """Merge and validate the three sources (DESIGN §3); relative paths are relative to the training TOML."""
    config_file = getattr(args, "config_file", None)
    base_dir = os.path.dirname(os.path.abspath(config_file)) if config_file else "."
    return load_config(plugin_keys, getattr(args, "downscale", None), base_dir=base_dir)


def inner_module(name: str | None, unet: Any) -> tuple[str, ModuleType]:
    """Import the inner module: ``name``, else the one for this denoiser class."""
    if name is None:
        name = INNER_BY_DENOISER.get(type(unet).__name__)
        if name is None:
            raise HostError(
                f"inner: cannot tell the inner network module from the denoiser class {type(unet).__name__!r} "
                f"(known: {', '.join(INNER_BY_DENOISER)}); set inner=MODULE in --network_args (choices: {', '.join(KNOWN_INNERS)})"
            )
    if name.split(".")[0] == __name__.split(".")[0]:
        raise HostError(f"inner: {name!r} is this plugin itself; choose a LoRA module (choices: {', '.join(KNOWN_INNERS)})")
    try:
        module = importlib.import_module(name)
    except ImportError as err:
        raise HostError(f"inner: cannot import {name!r} ({err}); choices: {', '.join(KNOWN_INNERS)}") from err
    missing = [f for f in ("create_network", "create_network_from_weights") if not callable(getattr(module, f, None))]
    if missing:
        raise HostError(f"inner: {name!r} has no {' or '.join(missing)}: not a network module; choices: {', '.join(KNOWN_INNERS)}")
    return name, module


def _inner_name(plugin_keys: dict[str, str], ctx: TrainerContext | None) -> str | None:
    """The requested inner module: in a run from any config source (validating it), else ``inner=``."""
    return plugin_config(plugin_keys, ctx.args).inner if ctx is not None else plugin_keys.get("inner")


def create_network(multiplier, network_dim, network_alpha, vae, text_encoder, unet, neuron_dropout=None, **kwargs):
    ctx = find_trainer()
    plugin_keys, inner_kwargs = split_network_args(kwargs)
    name, module = inner_module(_inner_name(plugin_keys, ctx), unet)
    network = module.create_network(
        multiplier, network_dim, network_alpha, vae, text_encoder, unet, neuron_dropout=neuron_dropout, **inner_kwargs
    )
    return network if ctx is None or network is None else _attach(network, name, plugin_keys)


def create_network_from_weights(multiplier, file, vae, text_encoder, unet, weights_sd=None, for_inference=False, **kwargs):
    ctx = find_trainer()
    plugin_keys, inner_kwargs = split_network_args(kwargs)
    config_keys = plugin_keys
    if ctx is not None and for_inference and not kwargs:
        # A --base_weights merge gets no network_args (tn:655-656); the run's own inner= still applies.
        config_keys = split_network_args(network_args_dict(getattr(ctx.args, "network_args", None)))[0]
    name, module = inner_module(_inner_name(config_keys, ctx), unet)
    network, weights_sd = module.create_network_from_weights(
        multiplier, file, vae, text_encoder, unet, weights_sd=weights_sd, for_inference=for_inference, **inner_kwargs
    )
    if ctx is not None and not for_inference:  # --dim_from_weights: this is the training network (tn:671-672)
        network = _attach(network, name, plugin_keys)
    return network, weights_sd


def _attach(network: Any, inner_name: str, plugin_keys: dict[str, str]) -> Any:
    """Give the inner network a ``prepare_network(args)`` (instance attribute; an inner one runs first)."""
    previous = getattr(network, "prepare_network", None)

    def prepare_network(args: Any) -> None:
        from .sd_scripts_run import start  # the run's machinery (plan, accounting) only loads for training

        if previous is not None:
            previous(args)
        start(network, inner_name, plugin_keys, args)

    network.prepare_network = prepare_network
    return network
