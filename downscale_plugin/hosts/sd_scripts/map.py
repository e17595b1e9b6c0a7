"""The in-run measurements (``mode = "map"``, ``"auto"``) on sd-scripts: its forced step hook and probes.

The sessions are the kohya ones (``hosts/kohya/map.py``, ``hosts/kohya/auto.py``); sd-scripts adds:

- :class:`MapHook`: the step hook (``hook.DownscaleHook``) whose forced call runs
  ``get_noise_pred_and_target`` at the arm's grid (the latents the host hands it area-downsampled) and
  the forced σ replayed through the host's sampler slot;
- :class:`SdScriptsProbes`: a probe is one sample of a ``process_batch`` batch in the host's own layout
  (``map_backend.split_batch``), its step the trainer class's ``process_batch`` with the rest of the
  call that completed the probes; ``is_train`` says which calls are train steps;
- the map's VAE arms on ``facts.VAE_ARCHS`` (``map_backend.HostVae``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from ...certify_config import VAE_ARM_KEYS
from ...rng import accelerator_devices, forked
from ..kohya.map import MapSession
from ..kohya.probes import ForcedSteps
from .facts import VAE_ARCHS, HostError
from .hook import DownscaleHook, HostCall, at_grid
from .map_backend import HostVae, split_batch


class MapHook(ForcedSteps, DownscaleHook):
    """The step hook of an in-run measurement (``map``, ``auto``): inside :meth:`forcing` a train step runs the
    host at the given grid (None: native) and σ, and is not counted; outside it, the plain hook."""

    def train_step(self, original: Any, call: HostCall) -> Any:
        if self.forced is None:
            return super().train_step(original, call)
        target_hw, sigma = self.forced
        device = call.accelerator.device
        sampler = self.family.bind(call.args, call.noise_scheduler, call.latents, device, call.weight_dtype)
        with forked(accelerator_devices(device)):
            sampler.first()  # records the host's output dtypes for the replay
        keys = self.family.remember(sampler, call.noise_scheduler, torch.tensor([sigma], dtype=torch.float64))
        return self.run_host(original, call, sampler, at_grid(call.latents, target_hw), keys, nullcontext())


class SdScriptsProbes:
    """sd-scripts' probes and step for a kohya measurement session (mixed in before it)."""

    model_key = "unet"
    error = HostError
    hook_class = MapHook

    def is_train(self, arguments: dict[str, Any]) -> bool:
        return bool(arguments["is_train"])

    def split(self, arguments: dict[str, Any]) -> list[dict[str, Any]]:
        return split_batch(arguments["batch"])

    def probe_step(self, arguments: dict[str, Any]) -> Callable[[dict[str, Any]], torch.Tensor]:
        trainer = self.ctx.trainer
        host_step = type(trainer).process_batch  # the host's own, without any plugin wrapper
        rest = {k: v for k, v in arguments.items() if k not in ("self", "batch")}
        return lambda probe: host_step(trainer, probe, **rest)

    def model_path(self) -> str | None:
        return getattr(self.ctx.args, "pretrained_model_name_or_path", None)


class SdScriptsMapSession(SdScriptsProbes, MapSession):
    """``mode = "map"`` on sd-scripts, with the VAE arms on ``VAE_ARCHS``."""

    vae_archs = VAE_ARCHS

    def host_vae(self, arguments: dict[str, Any]) -> HostVae:
        if arguments["vae"] is None:
            raise HostError(f'mode = "map": {" / ".join(VAE_ARM_KEYS)}: the trainer passed no VAE to process_batch')
        return HostVae(arguments["vae"], self.record.vae_calls, arguments["accelerator"].device, self.devices)
