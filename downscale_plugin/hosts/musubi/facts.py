"""What the plugin knows about musubi-tuner: one record per trainer architecture (main 30c658c4).

Adding a musubi-tuner architecture is one :class:`MusubiArch` record here (plus one ``ArchSpec`` in
``downscale_plugin/arch.py``). Everything else in this package reads the records.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_REVISION = "30c658c4"
SUPPORTED = f"downscale_plugin supports musubi-tuner main {SUPPORTED_REVISION} (v0.3.4, 2026-06-24)"

# The methods the hook relies on, by the parameter names of training/trainer_base.py at that revision:
# the hook wraps process_batch and shadows the σ sampler on the trainer instance (docs/ARCHITECTURE.md §2).
PROCESS_BATCH = (
    "args", "accelerator", "transformer", "network", "batch", "latents", "noise", "noise_scheduler",
    "dit_dtype", "network_dtype", "vae", "global_step",
)  # fmt: skip
SAMPLER = ("args", "noise", "latents", "timesteps", "noise_scheduler", "device", "dtype")
SAMPLER_METHOD = "get_noisy_model_input_and_timesteps"
BASE_TRAINER = "NetworkTrainer"  # training/trainer_base.py: its sampler is what every supported arch runs per sample
TRAINER_BASE = "musubi_tuner.training.trainer_base"  # its module: NetworkTrainer and FlowMatchDiscreteScheduler
HOST_PACKAGE = "musubi_tuner"

# Batch keys that carry spatial conditioning the plugin would have to downsample with the latents.
CONDITIONING_PREFIXES = ("latents_image", "latents_control", "latents_clean")


class HostError(RuntimeError):
    """The running musubi-tuner does not offer what the plugin needs; the message says what and why."""


@dataclass(frozen=True)
class MusubiArch:
    """One musubi-tuner LoRA trainer architecture.

    - ``trainer``: the trainer class name (first match along ``type(trainer).__mro__``);
      ``script``: its training script; ``denoisers``: class names of the DiT that select ``inner``,
      the inner network module, when ``inner=`` is not given.
    - ``latent_ndim``: the rank of the trainer's latents (5: B,C,F,H,W for video and for Qwen-Image's
      B,C,1,H,W; 4: B,C,H,W). Routing downsamples the last two axes only, so F never changes.
    - ``expert``: (flag, boundary) attribute names of a trainer that switches between two experts by
      σ (Wan 2.2's ``next_model_is_high_noise`` against ``timestep_boundary``): a replayed step sets
      the flag from its own σ, as the host's sampler would have.
    - ``positions``: how the DiT gets its positions, for the record: every supported DiT builds them
      from the latent shape of the call, so a routed step's positions are the small grid's.
    - ``frame_stride``: the VAE's temporal compression (pixel frames F → latent frames (F − 1) / s + 1;
      None for image models): the FLOP model counts F_latent × the tokens of one frame.
    """

    arch: str
    trainer: str
    script: str
    denoisers: tuple[str, ...]
    inner: str
    latent_ndim: int
    positions: str
    expert: tuple[str, str] | None = None
    frame_stride: int | None = None


MUSUBI_ARCHS: tuple[MusubiArch, ...] = (
    MusubiArch(
        "wan", "WanNetworkTrainer", "wan_train_network", ("WanModel",), "networks.lora_wan", 5,
        "RoPE freqs sliced [:f], [:h], [:w] per call", ("next_model_is_high_noise", "timestep_boundary"), 4,
    ),
    MusubiArch(
        "hunyuan_video", "HunyuanVideoNetworkTrainer", "hv_train_network", ("HYVideoDiffusionTransformer",),
        "networks.lora", 5, "RoPE built per latent shape", frame_stride=4,
    ),
    MusubiArch(
        "hunyuan_video_1_5", "HunyuanVideo15NetworkTrainer", "hv_1_5_train_network",
        ("HunyuanVideo_1_5_DiffusionTransformer",), "networks.lora_hv_1_5", 5, "RoPE built per latent shape", frame_stride=4,
    ),
    MusubiArch(
        "qwen_image", "QwenImageNetworkTrainer", "qwen_image_train_network", ("QwenImageTransformer2DModel",),
        "networks.lora_qwen_image", 5, "centred RoPE positions from img_shapes",
    ),
    MusubiArch(
        "flux_2", "Flux2NetworkTrainer", "flux_2_train_network", ("Flux2",), "networks.lora_flux_2", 4,
        "img_ids from prc_img of the latents",
    ),
    MusubiArch(
        "z_image", "ZImageNetworkTrainer", "zimage_train_network", ("ZImageTransformer2DModel",),
        "networks.lora_zimage", 4, "positions from the patchified latent shape",
    ),
)  # fmt: skip
BY_ARCH = {record.arch: record for record in MUSUBI_ARCHS}
INNER_BY_DENOISER = {name: record.inner for record in MUSUBI_ARCHS for name in record.denoisers}
KNOWN_INNERS = (*dict.fromkeys(INNER_BY_DENOISER.values()), "lycoris.kohya")

# Trainers whose steps carry spatial conditioning or a σ contract of their own: refused by name.
REFUSED_TRAINERS = {
    "FramePackNetworkTrainer": "FramePack trains on clean context latents (latents_clean*) at the native grid",
    "FluxKontextNetworkTrainer": "FLUX.1 Kontext concatenates control latents at the native grid",
    "HiDreamO1NetworkTrainer": "HiDream-O1 trains on pixels with its own σ sampler",
    "Flux2SelfFlowNetworkTrainer": "Self-Flow replaces process_batch with its own dual-timestep step",
}


def trainer_arch(trainer: object) -> MusubiArch:
    """The record of a trainer instance: the first class along its MRO that has a record or is refused."""
    for cls in type(trainer).__mro__:
        if cls.__name__ in REFUSED_TRAINERS:
            raise HostError(f"{cls.__name__}: not supported: {REFUSED_TRAINERS[cls.__name__]}; {SUPPORTED}")
        for record in MUSUBI_ARCHS:
            if record.trainer == cls.__name__:
                return record
    trainers = ", ".join(r.trainer for r in MUSUBI_ARCHS)
    raise HostError(f"{type(trainer).__name__} is not one of the musubi-tuner LoRA trainers the plugin supports ({trainers}); {SUPPORTED}")
