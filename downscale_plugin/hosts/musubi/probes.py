"""The in-run measurements (``mode = "map"``, ``"auto"``) on musubi-tuner: its forced step hook and probes.

The sessions are the kohya ones (``hosts/kohya/map.py``, ``hosts/kohya/auto.py``); musubi-tuner adds:

- the step hook wraps ``process_batch`` itself (``hook.ProcessBatchHook``), so a forced draw
  (:class:`ForcingHook`) calls the hook with the trainer class's own ``process_batch``: the trainer's
  sampler bound to the probe, the forced σ made replayable (``family.MusubiBound.remember``: the flow
  branch's t = 1000·σ + 1, the scheduler branch's nearest grid atom) and replayed, Wan 2.2's expert
  flag set from it as in a routed step; at a route's grid the latents are area-downsampled (spatial
  axes only: a video's F is kept) as a routed step does;
- musubi-tuner's loop draws the step's noise (``torch.randn_like(latents)``) before ``process_batch``,
  so a forced step draws it itself: ``randn_like(latents)`` on the native grid, the routed step's
  ``randn_like(small)`` on a route's. Either is the step's first ``randn_like``, the one the
  certifier's paired noise (``mapping/paired.injected_noise``) fills; trainer state the host's
  sampler touches (bucket pool, expert flag) is left as it was (``MusubiFamily.kept_state``);
- a probe is one sample of the batch the loop handed ``process_batch`` with its scale-shifted
  ``latents`` (per-sample tensors and the varlen lists, e.g. ``t5``, cut; ``timesteps`` per sample);
- provenance names ``--dit`` (its hash, as the windows' model key). musubi-tuner trains from cached
  latents and hands ``process_batch`` no VAE the map could drive: the map's VAE arms are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...rng import accelerator_devices, forked
from ..kohya.probes import ForcedSteps
from .facts import HostError
from .hook import ProcessBatchHook, StepCall, check_batch

# process_batch's arguments a forced step takes from the call that completed the probes (the rest are the probe's)
_KEPT = ("args", "accelerator", "transformer", "network", "noise_scheduler", "dit_dtype", "network_dtype", "vae", "global_step")


class ForcingHook(ForcedSteps, ProcessBatchHook):
    """The step hook of an in-run measurement (``map``, ``auto``): inside :meth:`forcing` a call runs the host at the
    given grid (None: native) and σ, draws the step's noise itself and is not counted (nor gets the direction loss: a
    measurement compares the host's own loss); outside it, the plain hook."""

    def train_step(self, original: Any, call: StepCall) -> Any:
        if self.forced is None:
            return super().train_step(original, call)
        check_batch(call.batch)
        target_hw, sigma = self.forced
        device = call.accelerator.device
        with self.family.kept_state():
            sampler = self.family.bind(
                call.args, call.noise_scheduler, call.latents, device, call.dit_dtype, timesteps=call.batch.get("timesteps")
            )
            with forked(accelerator_devices(device)):
                sampler.first()  # records the host's timestep dtype for the replay
            positions = sampler.remember(torch.full((call.latents.shape[0],), sigma, dtype=torch.float64))
            if target_hw is None:
                call = call._replace(noise=torch.randn_like(call.latents))  # the loop's own draw, before σ
            return self.run_host(original, call, sampler, target_hw, positions)


def split_step(batch: dict[str, Any], latents: torch.Tensor) -> list[dict[str, Any]]:
    """One probe per sample: ``{"batch": that sample's batch, "latents": its scale-shifted latents}`` (copies)."""
    n = int(latents.shape[0])

    def take(value: Any, i: int) -> Any:
        if isinstance(value, torch.Tensor):
            return value[i : i + 1].clone() if value.ndim and value.shape[0] == n else value
        if isinstance(value, (list, tuple)) and len(value) == n:  # varlen_* keys, per-sample timesteps
            item = value[i]
            return type(value)([item.clone() if isinstance(item, torch.Tensor) else item])
        return value

    return [{"batch": {k: take(v, i) for k, v in batch.items()}, "latents": latents[i : i + 1].clone()} for i in range(n)]


class MusubiProbes:
    """musubi-tuner's probes and step for a kohya measurement session (mixed in before it)."""

    model_key = "transformer"
    error = HostError
    hook_class = ForcingHook

    def is_train(self, arguments: dict[str, Any]) -> bool:
        return True  # the loop calls process_batch for train steps only (validation has its own path)

    def split(self, arguments: dict[str, Any]) -> list[dict[str, Any]]:
        return split_step(arguments["batch"], arguments["latents"])

    def probe_step(self, arguments: dict[str, Any]) -> Callable[[dict[str, Any]], torch.Tensor]:
        """Every draw the hook's forced call of the trainer class's own ``process_batch`` (no plugin wrapper)."""
        trainer, hook = self.ctx.trainer, self.hook
        host_step = type(trainer).process_batch.__get__(trainer)
        kept = {name: arguments[name] for name in _KEPT}

        def step(probe: dict[str, Any]) -> torch.Tensor:
            latents = probe["latents"]
            call = StepCall(batch=dict(probe["batch"]), latents=latents, noise=torch.zeros_like(latents), **kept)
            loss, _ = hook.train_step(host_step, call)  # the forced step replaces the placeholder noise
            return loss

        return step

    def model_path(self) -> str | None:
        return getattr(self.ctx.args, "dit", None)

    def model_files(self) -> list[str | None]:
        """The DiT, and Wan 2.2's high-noise expert when it trains too (its steps are the high-σ ones windows route)."""
        high = getattr(self.ctx.args, "dit_high_noise", None)
        return [self.model_path(), *([high] if high else [])]
