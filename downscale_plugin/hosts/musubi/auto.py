"""``mode = "auto"`` in a musubi-tuner run: certify windows on the run's own model, then train with them.

The session is the sd-scripts host's (``hosts/sd_scripts/auto.py``: timeline, budget, refusals at
start, the certify-and-write of ``mapping/in_run.py``, the switch to the certified windows, metadata,
end summary, adopting a resumed state's windows); what differs on musubi-tuner is here:

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
- provenance names ``--dit`` (its hash, as the windows' model key) and the σ mass is the trainer's own
  sampler's (``family.PlanSampler``, as the start banner's plan).

Only ``auto`` of the in-run measurements: ``mode = "map"`` stays refused on this host.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from ...rng import accelerator_devices, forked
from ..kohya import ForcedSteps, model_identity
from ..sd_scripts.auto import AutoSession
from ..sd_scripts.map_backend import SdScriptsBackend
from .facts import HostError
from .family import PlanSampler
from .hook import ProcessBatchHook, StepCall, check_batch

# process_batch's arguments a forced step takes from the call that completed the probes (the rest are the probe's)
_KEPT = ("args", "accelerator", "transformer", "network", "noise_scheduler", "dit_dtype", "network_dtype", "vae", "global_step")


class ForcingHook(ForcedSteps, ProcessBatchHook):
    """The step hook of an ``auto`` run: inside :meth:`forcing` a call runs the host at the given grid
    (None: native) and σ, draws the step's noise itself and is not counted; outside it, the plain hook."""

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


class MusubiAutoSession(AutoSession):
    """One musubi-tuner ``auto`` run; see the module docstring."""

    model_key = "transformer"
    error = HostError

    def make_hook(self, *args: Any, **kwargs: Any) -> ForcingHook:
        self.hook = ForcingHook(*args, **kwargs)
        return self.hook

    def is_train(self, arguments: dict[str, Any]) -> bool:
        return True  # the loop calls process_batch for train steps only (validation has its own path)

    def split(self, arguments: dict[str, Any]) -> list[dict[str, Any]]:
        return split_step(arguments["batch"], arguments["latents"])

    def model_path(self) -> str | None:
        return getattr(self.ctx.args, "dit", None)

    def model_identity(self) -> str | None:
        return model_identity(SimpleNamespace(pretrained_model_name_or_path=self.model_path()))

    def host_sampler(self) -> PlanSampler:
        from .start import noise_scheduler

        ctx = self.ctx
        return PlanSampler(self.family, ctx.args, noise_scheduler(ctx.trainer, ctx.args), ctx.dit_dtype or torch.bfloat16)

    def backend(self, arguments: dict[str, Any], vae: Any = None) -> SdScriptsBackend:
        """The map backend over the first ``images`` probes: every draw the hook's forced call of the
        trainer class's own ``process_batch`` (no plugin wrapper), its loss the step's."""
        trainer, hook = self.ctx.trainer, self.hook
        host_step = type(trainer).process_batch.__get__(trainer)
        kept = {name: arguments[name] for name in _KEPT}
        network = arguments["accelerator"].unwrap_model(arguments["network"])
        params = [p for p in network.parameters() if p.requires_grad]

        def step(probe: dict[str, Any]) -> torch.Tensor:
            latents = probe["latents"]
            call = StepCall(batch=dict(probe["batch"]), latents=latents, noise=torch.zeros_like(latents), **kept)
            loss, _ = hook.train_step(host_step, call)  # the forced step replaces the placeholder noise
            return loss

        return SdScriptsBackend(
            self.probes[: self.images],
            step,
            hook.forcing,
            params,
            self.run.arch,
            self.devices,
            self.describe(arguments),
            None,
            self.run.seed,
        )
