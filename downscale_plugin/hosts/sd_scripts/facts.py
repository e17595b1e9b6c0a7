"""What the plugin knows about sd-scripts: one record per trainer architecture (main 48d368fa).

Adding an sd-scripts architecture is one :class:`TrainerArch` record here (plus, for a new
denoiser architecture, one ``ArchSpec`` in ``downscale_plugin/arch.py``). Everything else in this
package reads the records.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_REVISION = "48d368fa"
SUPPORTED = f"downscale_plugin supports sd-scripts main {SUPPORTED_REVISION} (2026-02-16)"

# The σ sampler slot contracts (families.py): the Flux-family module function with a noise_scheduler
# argument, SD3's without it, Lumina's (the Flux contract, own module), SD1/SDXL's DDPM get_timesteps.
CONTRACTS = ("flux", "sd3", "lumina", "ddpm")


class HostError(RuntimeError):
    """The running sd-scripts does not offer what the plugin needs; the message says what and why."""


@dataclass(frozen=True)
class TrainerArch:
    """One sd-scripts LoRA trainer architecture.

    - ``trainer``: the trainer class name (the first match along ``type(trainer).__mro__`` wins,
      so subclasses come first in :data:`TRAINER_ARCHS`); ``model_type``: the ``--model_type`` that
      selects this arch within that trainer (Chroma in the Flux trainer).
    - ``script``: the training script; ``denoisers``: class names of ``type(unet)`` that select
      ``inner``, the inner network module, when ``inner=`` is not given.
    - ``sampler``: (module holding the σ sampler slot, its contract in :data:`CONTRACTS`);
      ``default_sampling``: the trainer's (``--timestep_sampling``, ``--discrete_flow_shift``)
      defaults for ``plan`` (None: the contract has no such knob).
    - ``vae_calls``: how its latent cache calls the VAE (``map_backend.VAE_CALLS``; None: the map's
      VAE arms are refused). "direct" ``vae.encode(x)`` / ``vae.decode(z)`` (Flux's AutoEncoder, which
      Lumina loads too and which shifts and scales itself; SD3's SDVAE, whose raw latents the trainer's
      ``shift_scale_latents`` processes after loading); "diffusers" ``vae.encode(x).latent_dist.sample()``
      / ``vae.decode(z).sample`` (SD1/SDXL's AutoencoderKL, unscaled latents). Both cache the latent
      before the trainer's shift/scale.
    - ``positions_handle``: (module, attribute) holding the position ids ``positions = "interpolate"``
      scales, for module-level handles (Lumina and Anima use the unwrapped denoiser itself).
    - ``latent_scale``: what ``shift_scale_latents`` multiplies cached latents by (a shift does not
      change a std; ``snr`` reads it).
    - ``text_lengths``: (FLOP-builder keyword, the trainer's length argument, its default) for each
      text sequence the denoiser sees (``flop_args.run_flops`` counts the run's own lengths).
    """

    arch: str
    trainer: str
    script: str
    denoisers: tuple[str, ...]
    inner: str
    sampler: tuple[str, str]
    default_sampling: tuple[str, float] | None = None
    vae_calls: str | None = None
    positions_handle: tuple[str, str] | None = None
    latent_scale: float = 1.0
    model_type: str | None = None
    text_lengths: tuple[tuple[str, str, int], ...] = ()


TRAINER_ARCHS: tuple[TrainerArch, ...] = (
    TrainerArch(
        "anima", "AnimaNetworkTrainer", "anima_train_network", ("Anima",), "networks.lora_anima",
        ("library.flux_train_utils", "flux"), ("sigmoid", 1.0),
        text_lengths=(("t5_tokens", "t5_max_token_length", 512), ("qwen_tokens", "qwen3_max_token_length", 512)),
    ),
    TrainerArch(
        "hunyuan_image", "HunyuanImageNetworkTrainer", "hunyuan_image_train_network", ("HYImageDiffusionTransformer",),
        "networks.lora_hunyuan_image", ("library.flux_train_utils", "flux"), ("sigma", 5.0),
        positions_handle=("library.hunyuan_image_utils", "get_meshgrid_nd"), latent_scale=0.75289,
    ),
    TrainerArch(
        "lumina", "LuminaNetworkTrainer", "lumina_train_network", ("NextDiT",), "networks.lora_lumina",
        ("library.lumina_train_util", "lumina"), ("shift", 6.0), vae_calls="direct",
        text_lengths=(("text_tokens", "gemma2_max_token_length", 256),),
    ),
    TrainerArch(
        "chroma", "FluxNetworkTrainer", "flux_train_network", ("Chroma",), "networks.lora_flux",
        ("library.flux_train_utils", "flux"), ("sigma", 3.0), vae_calls="direct",
        positions_handle=("library.flux_utils", "prepare_img_ids"), model_type="chroma",
        text_lengths=(("text_tokens", "t5xxl_max_token_length", 512),),
    ),
    TrainerArch(
        "flux", "FluxNetworkTrainer", "flux_train_network", ("Flux",), "networks.lora_flux",
        ("library.flux_train_utils", "flux"), ("sigma", 3.0), vae_calls="direct",
        positions_handle=("library.flux_utils", "prepare_img_ids"),
        text_lengths=(("text_tokens", "t5xxl_max_token_length", 512),),  # schnell: 256 (flop_args.py)
    ),
    TrainerArch(
        "sd3", "Sd3NetworkTrainer", "sd3_train_network", ("MMDiT",), "networks.lora_sd3",
        ("library.sd3_train_utils", "sd3"), vae_calls="direct", latent_scale=1.5305,
        text_lengths=(("t5_tokens", "t5xxl_max_token_length", 256),),  # + 77 CLIP tokens in the preset
    ),
    TrainerArch(
        "sdxl", "SdxlNetworkTrainer", "sdxl_train_network", ("SdxlUNet2DConditionModel",), "networks.lora",
        ("library.train_util", "ddpm"), vae_calls="diffusers", latent_scale=0.13025,
    ),
    TrainerArch(
        "sd1", "NetworkTrainer", "train_network", ("UNet2DConditionModel",), "networks.lora",
        ("library.train_util", "ddpm"), vae_calls="diffusers", latent_scale=0.18215,
    ),
)  # fmt: skip
BY_ARCH = {record.arch: record for record in TRAINER_ARCHS}
ARCHS = tuple(BY_ARCH)
INNER_BY_DENOISER = {name: record.inner for record in TRAINER_ARCHS for name in record.denoisers}
KNOWN_INNERS = (*dict.fromkeys(INNER_BY_DENOISER.values()), "lycoris.kohya")
VAE_ARCHS = tuple(record.arch for record in TRAINER_ARCHS if record.vae_calls)

# The module whose ``conditional_loss`` ``NetworkTrainer.process_batch`` calls (the direction loss wraps it).
LOSS_HANDLE = ("library.train_util", "conditional_loss")


def trainer_arch(trainer: object, model_type: str | None) -> TrainerArch:
    """The record of a trainer instance: first class along its MRO with a record (``model_type`` picks within it)."""
    for cls in type(trainer).__mro__:
        candidates = [r for r in TRAINER_ARCHS if r.trainer == cls.__name__]
        if candidates:
            chosen = [r for r in candidates if r.model_type is not None and r.model_type == model_type]
            return chosen[0] if chosen else next(r for r in candidates if r.model_type is None)
    trainers = ", ".join(dict.fromkeys(r.trainer for r in TRAINER_ARCHS))
    raise HostError(f"{type(trainer).__name__} is not one of sd-scripts' LoRA trainers ({trainers}); {SUPPORTED}")
