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

FasterDiT options (``FasterDitConfig``; each off by default and then bitwise absent, as on sd-scripts):

- ``sigma_policy``: a routed step runs at the policy's map of the drawn σ, made replayable with the bound
  sampler's ``remember`` (the flow branch's t = 1000·σ + 1, the scheduler grid's nearest atom) and replayed;
  the router's gate has already read the drawn σ, ``on_step`` gets the σ the step runs at (``snr_match``:
  the stds of the step's own scale-shifted latents and their small copies, pooled over the run's routed
  steps per grid pair, per rank: ``fasterdit.policies.RoutedSigmas``).
- ``direction_loss_weight`` λ > 0: for the train call the trainer's ``compute_loss`` is shadowed on the
  instance by one that runs ``NetworkTrainer.compute_loss`` with ``torch.nn.functional.mse_loss``
  returning the elementwise MSE + λ·(1 − cos over channels) (``fasterdit.direction_loss``), so the
  host's weighting and mean apply to the term as to the MSE; with ``direction_loss_only_routed`` only
  routed steps. Checked at install: a trainer whose ``compute_loss`` is not ``NetworkTrainer``'s own
  (as HiDream-O1's and Ideogram 4's, neither a supported trainer, or a user subclass) is refused; at the
  call, a ``compute_loss`` that does not call ``mse_loss`` exactly once is an error. The in-run certifier's forced draws (``probes.ForcingHook``)
  measure the host's plain loss, as on sd-scripts.
- ``positions = "interpolate"`` is refused at start (``start.refuse_unsupported``).

The wraps are instance attributes recorded in the run's patches (``scope.Patches``) or scoped to one call
(``scope.swap_attr``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple

import torch

from ...config import FasterDitConfig
from ...fasterdit.direction_loss import with_direction_term
from ...fasterdit.policies import RoutedSigmas
from ...grid import area_downsample
from ...router import RouteDecision, Router
from ...scope import Patches, swap_attr
from .facts import BASE_TRAINER, CONDITIONING_PREFIXES, SUPPORTED, HostError
from .family import MusubiBound, MusubiFamily

STEP_METHOD = "process_batch"
# The direction loss's handles (training/trainer_base.py): NetworkTrainer.compute_loss by these parameter names,
# whose one elementwise torch.nn.functional.mse_loss(pred, target, reduction="none") gets the term.
LOSS_METHOD = "compute_loss"
COMPUTE_LOSS = ("args", "output", "timesteps", "noise_scheduler", "dit_dtype", "network_dtype", "global_step")
LOSS_FN = "mse_loss"


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


def check_loss(trainer: Any) -> None:
    """Refuse, at start, a trainer whose loss the direction term cannot reach: ``compute_loss`` must be
    ``NetworkTrainer``'s own (none of the supported trainers overrides it), with ``COMPUTE_LOSS``'s parameters, computing
    its elementwise loss with ``torch.nn.functional.mse_loss``."""
    name = type(trainer).__name__
    base = next((vars(cls).get(LOSS_METHOD) for cls in type(trainer).__mro__ if cls.__name__ == BASE_TRAINER), None)
    if base is None or type(trainer).compute_loss is not base:
        raise HostError(
            f"direction_loss_weight: {name} overrides compute_loss, so the plugin cannot add the direction term under the host's "
            f"weighting (it adds it inside {BASE_TRAINER}.compute_loss's elementwise mse_loss); set direction_loss_weight = 0; {SUPPORTED}"
        )
    found = tuple(inspect.signature(trainer.compute_loss).parameters)
    if found != COMPUTE_LOSS or LOSS_FN not in getattr(getattr(base, "__code__", None), "co_names", ()):
        raise HostError(
            f"direction_loss_weight: {name}.compute_loss({', '.join(found)}): expected ({', '.join(COMPUTE_LOSS)}) computing "
            f"torch.nn.functional.{LOSS_FN}(..., reduction='none'); this musubi-tuner revision changed the loss; {SUPPORTED}"
        )


def direction_loss_scope(trainer: Any, weight: float) -> AbstractContextManager:
    """For one ``process_batch`` call: the trainer's ``compute_loss`` (shadowed on the instance) runs the host's
    own with ``torch.nn.functional.mse_loss`` returning the elementwise MSE + λ·(1 − cos over channels), per
    position (B, 1, *S) broadcast over the channels, before the host's weighting and mean: each sample's
    loss grows by λ·mean_S(1 − cos) × its weighting (fasterdit/direction_loss.py). λ = 0: nothing replaced."""
    if not weight:
        return nullcontext()
    host_loss = getattr(trainer, LOSS_METHOD)

    def compute_loss(*args: Any, **kwargs: Any) -> Any:
        calls = []
        term = with_direction_term(getattr(torch.nn.functional, LOSS_FN), weight)

        def mse_loss(*a: Any, **k: Any) -> torch.Tensor:
            calls.append(True)
            return term(*a, **k)

        with swap_attr(torch.nn.functional, LOSS_FN, mse_loss):
            out = host_loss(*args, **kwargs)
        if len(calls) != 1:
            raise HostError(
                f"direction_loss_weight: {type(trainer).__name__}.compute_loss called torch.nn.functional.{LOSS_FN} {len(calls)} "
                f"times (expected once, the elementwise loss); {SUPPORTED}"
            )
        return out

    return swap_attr(trainer, LOSS_METHOD, compute_loss)


class ProcessBatchHook:
    """Routes a musubi-tuner trainer's train steps; ``on_step(step, decision, native_hw, run_hw, run_sigmas)`` sees each
    (``run_sigmas``: the σ the step runs at, ``decision.sigmas`` itself unless a σ policy mapped them)."""

    def __init__(
        self,
        router: Router,
        family: MusubiFamily,
        *,
        fasterdit: FasterDitConfig | None = None,
        rank: int = 0,
        world_size: int = 1,
        on_step: Callable[[int, RouteDecision, tuple[int, int], tuple[int, int], torch.Tensor], None] | None = None,
    ):
        self.router = router
        self.family = family
        self.fasterdit = fasterdit if fasterdit is not None else FasterDitConfig()
        self.policy = RoutedSigmas(self.fasterdit.sigma_policy)
        self.rank = rank
        self.world_size = world_size
        self.on_step = on_step
        self.step = 0  # the plugin's own forward count (this run's forwards, 1-based at the first)
        self.last: RouteDecision | None = None
        self.trainer: Any = None  # set by install: the trainer whose compute_loss gets the direction term

    def install(self, trainer: Any, patches: Patches) -> None:
        """Wrap the instance's ``process_batch`` for the run (undone by ``patches``); with λ > 0 check its loss first."""
        if self.fasterdit.direction_loss_weight:
            check_loss(trainer)
        self.trainer = trainer
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
        small = area_downsample(latents, run_hw) if decision.routed else None
        sigmas, positions = self.run_sigmas(decision, sampler, latents, small)
        if self.on_step is not None:
            self.on_step(self.step, decision, native_hw, run_hw, sigmas)
        with self.loss_scope(decision):
            if not decision.needs_replay:
                return original(*call)
            return self.run_host(original, call, sampler, run_hw if decision.routed else None, positions, small=small)

    def loss_scope(self, decision: RouteDecision) -> AbstractContextManager:
        """The direction loss for this train step's host call (λ = 0, or a native step with only_routed: none)."""
        options = self.fasterdit
        if not options.direction_loss_weight or (options.direction_loss_only_routed and not decision.routed):
            return nullcontext()
        return direction_loss_scope(self.trainer, options.direction_loss_weight)

    def run_sigmas(
        self, decision: RouteDecision, sampler: MusubiBound, native: torch.Tensor, small: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The σ a step runs at and their pool positions for the replay: the decision's own samples, or on a
        routed step under a σ policy their map, made replayable by the sampler's ``remember`` (the σ returned is
        the pool's: the host's rounding of it, or the scheduler grid's nearest atom)."""
        if small is None:
            return decision.sigmas, decision.source_index
        mapped = self.policy(decision.sigmas, native, small, self.router.arch)
        if mapped is decision.sigmas:
            return decision.sigmas, decision.source_index
        positions = sampler.remember(mapped)
        return sampler.pool.pairs(positions)[1], positions

    @staticmethod
    def run_host(
        original: Callable,
        call: StepCall,
        sampler: Any,
        target_hw: tuple[int, int] | None,
        positions: torch.Tensor,
        small: torch.Tensor | None = None,
    ) -> Any:
        """The host's step with σ replayed from the sampler's pool; at ``target_hw`` (None: native) on the
        area-downsampled latents (``small``, when the caller has them already) with the step's own unit noise at that grid."""
        if target_hw is not None:
            small = area_downsample(call.latents, target_hw) if small is None else small
            call = call._replace(batch=small_batch(call.batch, target_hw), latents=small, noise=torch.randn_like(small))
        with sampler.replay(positions):
            return original(*call)
