"""The drop-in hook for musubi-tuner: wraps a trainer instance's ``process_batch`` (docs/ARCHITECTURE.md §2).

musubi-tuner's loop draws the step's noise (``torch.randn_like(latents)``) *before* ``process_batch``,
which draws σ (``get_noisy_model_input_and_timesteps``), calls the DiT (``call_dit``) and the loss
(``compute_loss``) (training/trainer_base.py). Per train step the hook:

1. binds the trainer's own sampler to the step (the batch's bucketed ``timesteps`` included) and
   lets the router dry-run it under a forked RNG; the RNG at the call is already past the noise, so
   the first dry draw is the σ the host is about to draw;
2. a native step whose σ needed no conditioning calls ``process_batch`` unchanged: bitwise the host's;
3. otherwise a routed step area-downsamples the spatial axes of the latents (video F untouched),
   draws its own unit-variance noise at the small grid (the loop's native noise is never resized),
   hands ``call_dit`` a shallow copy of the batch whose ``latents`` are the small ones (Qwen-Image's
   ``call_dit`` re-reads ``batch["latents"]``), and replays the chosen σ through the shadowed
   sampler, so noisy input, positions (built by every supported DiT from the latent shape) and
   target are the small grid's.

The wrap is an instance attribute recorded in the run's patches (``scope.Patches``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ...grid import area_downsample
from ...router import RouteDecision, Router
from ...scope import Patches
from .facts import CONDITIONING_PREFIXES, HostError
from .family import MusubiFamily

STEP_METHOD = "process_batch"


class StepCall(NamedTuple):
    """The arguments of one host ``process_batch`` call, by name (training/trainer_base.py; facts.PROCESS_BATCH)."""

    args: Any
    accelerator: Any
    transformer: Any
    network: Any
    batch: dict
    latents: torch.Tensor
    noise: torch.Tensor
    noise_scheduler: Any
    dit_dtype: Any
    network_dtype: Any
    vae: Any
    global_step: int


def check_batch(batch: dict) -> None:
    """Refuse a batch carrying spatial conditioning (a cache written for image-to-video or control training): its
    latents would stay at the native grid while the step's shrink. HunyuanVideo 1.5 reads ``latents_image``
    whenever the batch has it, whatever it trains; the trainer flags checked at start cannot see the cache."""
    found = sorted(key for key in batch if key.startswith(CONDITIONING_PREFIXES))
    if found:
        raise HostError(
            f"the batch carries {', '.join(found)}: spatial conditioning stays at the native grid while a routed step's latents "
            "shrink; the plugin supports text-to-image/video training only (re-cache the latents without it)"
        )


def small_batch(batch: dict, target_hw: tuple[int, int]) -> dict:
    """A shallow copy of the batch whose ``latents`` are area-downsampled to ``target_hw`` (every other entry shared)."""
    out = dict(batch)
    out["latents"] = area_downsample(batch["latents"], target_hw)
    return out


class ProcessBatchHook:
    """Routes a musubi-tuner trainer's train steps; ``on_step(step, decision, native_hw, run_hw, run_sigmas)`` sees each."""

    def __init__(
        self,
        router: Router,
        family: MusubiFamily,
        *,
        rank: int = 0,
        world_size: int = 1,
        on_step: Callable[[int, RouteDecision, tuple[int, int], tuple[int, int], torch.Tensor], None] | None = None,
    ):
        self.router = router
        self.family = family
        self.rank = rank
        self.world_size = world_size
        self.on_step = on_step
        self.step = 0  # the plugin's own forward count (this run's forwards, 1-based at the first)
        self.last: RouteDecision | None = None

    def install(self, trainer: Any, patches: Patches) -> None:
        """Wrap the instance's ``process_batch`` for the run (undone by ``patches``)."""
        original = trainer.process_batch
        signature = inspect.signature(original)

        def process_batch(*args: Any, **kwargs: Any) -> Any:
            return self.train_step(original, StepCall(**signature.bind(*args, **kwargs).arguments))

        patches.set(trainer, STEP_METHOD, process_batch)

    def train_step(self, original: Callable, call: StepCall) -> Any:
        check_batch(call.batch)
        latents = call.latents
        self.step += 1
        native_hw = tuple(latents.shape[-2:])
        sampler = self.family.bind(
            call.args, call.noise_scheduler, latents, call.accelerator.device, call.dit_dtype, timesteps=call.batch.get("timesteps")
        )
        decision = self.router.route(
            sampler.draw, latents.shape[0], native_hw, self.step, self.rank, self.world_size, first=sampler.first, law=sampler.law
        )
        self.last = decision
        run_hw = decision.target_hw if decision.routed else native_hw
        if self.on_step is not None:
            self.on_step(self.step, decision, native_hw, run_hw, decision.sigmas)
        if not decision.needs_replay:
            return original(*call)
        return self.run_host(original, call, sampler, run_hw if decision.routed else None, decision.source_index)

    @staticmethod
    def run_host(original: Callable, call: StepCall, sampler: Any, target_hw: tuple[int, int] | None, positions: torch.Tensor) -> Any:
        """The host's step with σ replayed from the sampler's pool; at ``target_hw`` (None: native) on the
        area-downsampled latents with the step's own unit noise at that grid."""
        if target_hw is not None:
            small = area_downsample(call.latents, target_hw)
            call = call._replace(batch=small_batch(call.batch, target_hw), latents=small, noise=torch.randn_like(small))
        with sampler.replay(positions):
            return original(*call)
