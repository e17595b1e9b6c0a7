"""sd-scripts' side of the in-run measurements' backend (``kohya/backend.py``): its batch layout and its VAE.

- :func:`split_batch`: a batch as single-sample probes, whatever a batch holds (cached latents or
  images, cached text-encoder outputs or token ids, per-encoder lists), copied before the host
  touches it;
- :class:`HostVae`: the run's VAE called as the host's latent cache calls it (``TrainerArch.vae_calls``
  in ``facts.py``), for the map's ``map_reenc`` / ``map_pixel`` arms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ...rng import forked, seed_forked


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
