"""The map backend inside a real sd-scripts run (``mode = "map"``): the user's model, network and data.

Probes are single samples cut from the run's own first batches, whatever a batch holds (cached
latents or images, cached text-encoder outputs or token ids), so every draw runs the trainer's own
``process_batch``: latents, text conditioning, ``get_noise_pred_and_target``, and the host's loss
with its weighting, masks and per-sample loss weights. The arm's grid and the map's σ reach the
host through the plugin's step hook (``map.MapHook``): it area-downsamples the
latents the host hands it, as a routed training step does, and replays σ through the host sampler
slot with ``families.py``'s ``bind(...).replay``.

Adapter: the gradient is taken w.r.t. the network's trainable parameters as they stand when the map
runs (after the native steps that collected the probes). On a fresh LoRA (``lora_up`` = 0) the
``lora_down`` factors get no gradient; the ``lora_up`` gradient is G·Aᵀ, a fixed random projection
of the full weight gradient G, so the cosines still compare full-weight gradients, on fewer
coordinates. ``describe`` reports how many adapter tensors are all zero.

Arms: native, plain latent-area, and (``map_reenc``/``map_pixel``, for hosts whose VAE
:class:`HostVae` drives: ``TrainerArch.vae_calls`` in ``facts.py``) the VAE arms, built once per probe
from its latent z (cached latents, before the trainer's shift/scale; a probe of images is encoded first),
with the VAE called as the host's latent cache calls it: ``reenc`` = encode(decode(z)),
``pixel_<r>`` = encode(area-downsample(decode(z)) to the target grid × the VAE factor). Their latents
replace the probe's and the step runs them as given (no hook downsample). σ-policy or position
variants are not router routes (the lab map has them).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ...arch import get_arch
from ...grid import area_downsample, target_grid
from ...mapping.arms import PLAIN, Arm
from ...rng import forked, seed_forked

Forcing = Callable[[tuple[int, int] | None, float], AbstractContextManager]


def batch_size(batch: Mapping[str, Any]) -> int:
    """Samples in an sd-scripts batch (every batch carries per-sample ``loss_weights``)."""
    weights = batch.get("loss_weights")
    if not isinstance(weights, torch.Tensor) or weights.ndim != 1:
        raise ValueError(f"batch: no per-sample 'loss_weights' tensor (keys: {', '.join(batch)}); not an sd-scripts training batch")
    return int(weights.shape[0])


def _take(value: Any, i: int, n: int) -> Any:
    """Sample i of one batch value: per-sample tensors and lists are cut, per-encoder lists element-wise."""
    if isinstance(value, torch.Tensor):
        return value[i : i + 1].clone() if value.ndim and value.shape[0] == n else value
    if isinstance(value, (list, tuple)):
        if any(isinstance(v, torch.Tensor) for v in value) and all(v is None or isinstance(v, torch.Tensor) for v in value):
            return type(value)(_take(v, i, n) for v in value)  # text_encoder_outputs_list, input_ids_list: one entry per encoder
        if len(value) == n:
            return type(value)([value[i]])  # captions, flippeds, custom_attributes
    return value


def split_batch(batch: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One batch dict per sample, with the host's keys and layout (tensors copied: the host may reuse its own)."""
    n = batch_size(batch)
    return [{key: _take(value, i, n) for key, value in batch.items()} for i in range(n)]


def probe_grid(probe: Mapping[str, Any], vae_factor: int) -> tuple[int, int]:
    """A probe's native latent (h, w): from its cached latents, else from its images."""
    latents = probe.get("latents")
    if isinstance(latents, torch.Tensor):
        return int(latents.shape[-2]), int(latents.shape[-1])
    images = probe.get("images")
    if isinstance(images, torch.Tensor):
        return int(images.shape[-2]) // vae_factor, int(images.shape[-1]) // vae_factor
    raise ValueError("probe: neither 'latents' nor 'images' in the batch")


@dataclass(frozen=True)
class VaeCalls:
    """How a host's latent cache calls its VAE: ``encode(vae, pixels in [-1, 1])`` is the latent it caches,
    before the trainer's ``shift_scale_latents`` (which ``process_batch`` applies to an arm's latent as to
    the cached one); ``decode(vae, z)`` inverts it (the sample code's decode, after its unscaling)."""

    encode: Callable[[Any, torch.Tensor], torch.Tensor]
    decode: Callable[[Any, torch.Tensor], torch.Tensor]
    text: str


# Convention → calls (which architecture has which: ``TrainerArch.vae_calls`` in ``facts.py``).
VAE_CALLS = {
    # Flux's AutoEncoder (FluxLatentsCachingStrategy), SD3's SDVAE (Sd3LatentsCachingStrategy; raw, process_in comes later)
    "direct": VaeCalls(lambda vae, x: vae.encode(x), lambda vae, z: vae.decode(z), "vae.encode(x) / vae.decode(z)"),
    # diffusers' AutoencoderKL (SdSdxlLatentsCachingStrategy; unscaled, × vae_scale_factor comes later)
    "diffusers": VaeCalls(
        lambda vae, x: vae.encode(x).latent_dist.sample(),
        lambda vae, z: vae.decode(z).sample,
        "vae.encode(x).latent_dist.sample() / vae.decode(z).sample",
    ),
}


class HostVae:
    """The run's VAE as the host's latent cache calls it (``calls``: a :data:`VAE_CALLS` key), so an arm's
    latent stands where the cached latent does and the trainer's own shift/scale follows. It runs in the
    VAE's dtype, under no_grad, on ``device`` (a cached-latents run parks it on the CPU: moved there and
    back, as the sample code does). ``encode`` samples the posterior: it runs in a forked RNG seeded by
    ``key``, so an arm's latent is reproducible and the run's RNG untouched. Decoded pixels are clamped to
    the [-1, 1] range the encoder is trained on."""

    def __init__(self, vae: Any, calls: str, device: torch.device | str, rng_devices: Sequence[torch.device]):
        if calls not in VAE_CALLS:
            raise ValueError(f"HostVae: calls {calls!r} unknown; allowed: {', '.join(VAE_CALLS)}")
        self.vae, self.calls, self.device, self.rng_devices = vae, VAE_CALLS[calls], torch.device(device), tuple(rng_devices)

    @contextmanager
    def _on_device(self) -> Iterator[torch.nn.Module]:
        home = self.vae.device
        self.vae.to(self.device)
        try:
            yield self.vae
        finally:
            self.vae.to(home)

    @torch.no_grad()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        with self._on_device() as vae:
            return self.calls.decode(vae, z.to(self.device, vae.dtype)).clamp(-1, 1)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor, key: int) -> torch.Tensor:
        with self._on_device() as vae, forked(self.rng_devices):
            seed_forked(key, self.rng_devices)
            return self.calls.encode(vae, pixels.to(self.device, vae.dtype))


class SdScriptsBackend:
    """:class:`~downscale_plugin.mapping.arms.MapBackend` over a running sd-scripts trainer.

    ``step(probe)`` runs the trainer's ``process_batch`` on one probe batch and returns its loss;
    ``forcing(target_hw, sigma)`` is the hook's scope that makes that step run at the arm's grid
    (None: native) and σ. ``info`` is the run's provenance (model, adapter, data). ``vae`` (None: the
    VAE arms are unsupported) builds the VAE arms' latents, encoding with seeds drawn from ``seed``.
    """

    def __init__(
        self,
        probes: Sequence[dict[str, Any]],
        step: Callable[[dict[str, Any]], torch.Tensor],
        forcing: Forcing,
        params: Sequence[torch.nn.Parameter],
        arch: str,
        rng_devices: Sequence[torch.device],
        info: Mapping[str, Any],
        vae: HostVae | None = None,
        seed: int = 0,
    ):
        self.probes = list(probes)
        self.step = step
        self.forcing = forcing
        self.params = list(params)
        self.arch = get_arch(arch)
        self.rng_devices = tuple(rng_devices)
        self.info = dict(info)
        self.vae, self.seed = vae, seed
        self.grids = [probe_grid(p, self.arch.vae_factor) for p in self.probes]

    def describe(self) -> dict[str, Any]:
        zero = sum(1 for p in self.params if not bool(p.detach().any()))
        grids = sorted(set(self.grids))
        out = {
            **self.info,
            "adapter_params": sum(p.numel() for p in self.params),
            "adapter_zero_tensors": f"{zero} of {len(self.params)} (a fresh LoRA's lora_up is 0: its lora_down gets no gradient)",
            "arch": self.arch.name,
            "probe_grids": [list(g) for g in grids],
        }
        if len(grids) == 1:  # one tier: the windows TOML can name it ("1024:768"); several: scale rules
            out["native_latent_hw"] = list(grids[0])
        if self.vae is not None:
            out["vae"] = (
                f"the run's {type(self.vae.vae).__name__} ({self.vae.vae.dtype}), called as its latent cache does "
                f"({self.vae.calls.text}); reenc: encode(decode(z)); "
                "pixel_<r>: encode(area-downsampled decode(z)); decoded pixels clamped to [-1, 1], one seeded posterior draw per encode"
            )
        return out

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return list(self.params)

    def num_images(self) -> int:
        return len(self.probes)

    def unsupported(self, arm: Arm) -> str | None:
        if arm.kind == "native":
            return None
        if arm.kind in ("reenc", "pixel") and self.vae is None:
            return f"arm {arm.name}: needs the run's VAE, which this backend was not given"
        if arm.kind == "reenc":
            return None
        if arm.setting != PLAIN:
            return f"arm {arm.name}: the in-run map measures the router's plain setting only (keep σ, plain positions; the lab map has the others)"
        bad = sorted({g for g in self.grids if target_grid(g, arm.ratio, self.arch) is None})
        if bad:
            return f"arm {arm.name}: no strictly smaller {self.arch.name} grid (multiple {self.arch.multiple}) for probe latents {bad}"
        return None

    def _latent(self, image: int) -> torch.Tensor:
        """The probe's latent z: its cached latents, else its images encoded (the host's own encode)."""
        probe = self.probes[image]
        if isinstance(probe.get("latents"), torch.Tensor):
            return probe["latents"]
        return self.vae.encode(probe["images"], _key(self.seed, image, "latent"))

    def arm_input(self, image: int, arm: Arm) -> tuple[tuple[int, int] | None, torch.Tensor | None]:
        """(the grid the hook downsamples the step to, None: as given; the VAE arm's latents replacing the probe's, or None)."""
        if arm.kind == "native":
            return None, None
        if arm.kind == "latent":
            return target_grid(self.grids[image], arm.ratio, self.arch), None
        z = self._latent(image)
        pixels = self.vae.decode(z)
        if arm.kind == "pixel":
            h, w = target_grid(self.grids[image], arm.ratio, self.arch)
            pixels = area_downsample(pixels, (h * self.arch.vae_factor, w * self.arch.vae_factor))
        return None, self.vae.encode(pixels, _key(self.seed, image, arm.name)).to(z.device, z.dtype)

    def loss(self, image: int, arm_input: tuple[tuple[int, int] | None, torch.Tensor | None], sigma: float) -> torch.Tensor:
        target_hw, latents = arm_input
        probe = dict(self.probes[image])  # a fresh dict: some trainers rewrite batch keys in place
        if latents is not None:
            probe["latents"] = latents
        with self.forcing(target_hw, sigma):
            return self.step(probe)


def _key(seed: int, image: int, name: str) -> int:
    """A VAE encode's seed: per run seed, probe and arm."""
    return zlib.crc32(f"{seed}:{image}:{name}".encode())
