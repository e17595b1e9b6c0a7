"""The map backend inside a real kohya run (``mode = "map"``, ``"auto"``): the user's model, network and data.

Probes are single samples cut from the run's own first batches (each host's session says how:
``hosts/sd_scripts/map.py``, ``hosts/musubi/probes.py``), so every draw runs the trainer's own step:
latents, text conditioning, the host's noise, σ and target, and the host's loss with its weighting,
masks and per-sample loss weights. The arm's grid and the map's σ reach the host through the
plugin's step hook (a :class:`~.probes.ForcedSteps` hook): it area-downsamples the latents the host
hands it, as a routed training step does, and replays σ through the host sampler slot.

Adapter: the gradient is taken w.r.t. the network's trainable parameters as they stand when the map
runs (after the native steps that collected the probes). On a fresh LoRA (``lora_up`` = 0) the
``lora_down`` factors get no gradient; the ``lora_up`` gradient is G·Aᵀ, a fixed random projection
of the full weight gradient G, so the cosines still compare full-weight gradients, on fewer
coordinates. ``describe`` reports how many adapter tensors are all zero.

Arms: native, plain latent-area, and (``map_reenc``/``map_pixel``, for hosts whose VAE the backend is
given) the VAE arms, built once per probe from its latent z (cached latents, before the trainer's
shift/scale; a probe of images is encoded first): ``reenc`` = encode(decode(z)), ``pixel_<r>`` =
encode(area-downsample(decode(z)) to the target grid × the VAE factor). Their latents replace the
probe's and the step runs them as given (no hook downsample). σ-policy or position variants are not
router routes (the lab map has them).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from ...arch import get_arch
from ...grid import area_downsample, target_grid
from ...mapping.arms import PLAIN, Arm

Forcing = Callable[[tuple[int, int] | None, float], AbstractContextManager]


def probe_grid(probe: Mapping[str, Any], vae_factor: int) -> tuple[int, int]:
    """A probe's native latent (h, w): from its cached latents, else from its images."""
    latents = probe.get("latents")
    if isinstance(latents, torch.Tensor):
        return int(latents.shape[-2]), int(latents.shape[-1])
    images = probe.get("images")
    if isinstance(images, torch.Tensor):
        return int(images.shape[-2]) // vae_factor, int(images.shape[-1]) // vae_factor
    raise ValueError("probe: neither 'latents' nor 'images' in the batch")


class ProbeBackend:
    """:class:`~downscale_plugin.mapping.arms.MapBackend` over a running kohya trainer (``mode = "map"``, ``"auto"``).

    ``step(probe)`` runs the trainer's own step on one probe and returns its loss;
    ``forcing(target_hw, sigma)`` is the hook's scope that makes that step run at the arm's grid
    (None: native) and σ. ``info`` is the run's provenance (model, adapter, data). ``vae`` (None: the
    VAE arms are unsupported) builds the VAE arms' latents, encoding with seeds drawn from ``seed``: the
    host's VAE as its latent cache calls it (``encode(pixels, key)``, ``decode(z)``, ``.vae``, ``.calls.text``;
    sd-scripts' ``map_backend.HostVae``).
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
        vae: Any = None,
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
            return f"arm {arm.name}: the in-run map measures the router's plain setting only (keep σ, plain positions, plain attention; the lab map has the others)"
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
