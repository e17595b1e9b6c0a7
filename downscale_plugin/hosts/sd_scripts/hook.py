"""The drop-in hook: wraps a trainer instance's ``get_noise_pred_and_target`` (DESIGN §1).

Per train step: the host's own sampler draws σ on the native grid under a forked RNG; the router
picks the step's route; a native step whose σ needed no conditioning calls the host unchanged
(bitwise identical to a run without the plugin); otherwise the latents are area-downsampled to the
route's grid (or kept, for a conditioned native step) and the drawn σ is replayed through the
host's sampler slot, so the host builds noise, noisy input, ids, masks and target at that grid.
Validation (``is_train=False``) passes straight through and consumes no RNG.

FasterDiT options (:class:`StepOptions`, ``fasterdit``), each off by default and then bitwise absent:

- ``direction_loss_weight`` λ > 0: ``process_batch`` is wrapped too, and its train calls run inside
  ``direction_loss_scope`` on the module whose ``conditional_loss`` it calls (validation calls do
  not); with ``direction_loss_only_routed`` only calls whose step was routed get the term.
- ``sigma_policy``: a routed step runs at the policy's map of the drawn σ, registered with the
  sampler so the host replays it; the router's gate has already read the drawn σ, and ``on_step``
  observers get both. ``snr_match`` reads the data stds of the run's own latents, native and
  downsampled, pooled over its routed steps so far (``RunningStd``; per rank).
- ``positions = "interpolate"``: the routed forward runs inside ``positions_scope``.

The wrap is an instance attribute: it shadows the class method for exactly that trainer, whatever
module the class lives in (``python train_network.py`` puts it in ``__main__``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from ...arch import ArchSpec
from ...config import POSITIONS, SIGMA_POLICIES, DownscaleConfig
from ...fasterdit.direction_loss import direction_loss_scope
from ...fasterdit.policies import RunningStd, make_policy
from ...fasterdit.positions import positions_scope, require_interpolate
from ...grid import area_downsample, tokens
from ...router import RouteDecision, Router
from .families import BoundSampler, DDPMFamily, FlowFamily

logger = logging.getLogger(__name__)

WRAPPED_METHODS = ("get_noise_pred_and_target", "generate_step_logs")
LOSS_METHOD = "process_batch"  # wrapped only when direction_loss_weight > 0


@dataclass(frozen=True)
class StepOptions:
    """A run's FasterDiT options, bound to the host handles they replace.

    ``loss_module``: the module whose ``conditional_loss`` the trainer's ``process_batch`` calls
    (sd-scripts' ``library.train_util``, ``downscale_plugin.lab.trainer``); needed when λ > 0.
    ``positions_arch`` / ``positions_module``: the architecture whose position handle
    ``positions_scope`` scales and the module holding it (Flux ``flux_utils``, HunyuanImage
    ``hunyuan_image_utils``; Lumina and Anima use the unwrapped denoiser); needed for ``interpolate``.
    """

    direction_loss_weight: float = 0.0
    direction_loss_only_routed: bool = False
    sigma_policy: str = "keep"
    positions: str = "plain"
    loss_module: Any = None
    positions_arch: ArchSpec | None = None
    positions_module: Any = None

    def __post_init__(self) -> None:
        if not self.direction_loss_weight >= 0:
            raise ValueError(f"direction_loss_weight: {self.direction_loss_weight} must be >= 0")
        if self.direction_loss_weight and self.loss_module is None:
            raise ValueError("direction_loss_weight > 0 needs loss_module, the module holding the trainer's conditional_loss")
        if self.sigma_policy not in SIGMA_POLICIES:
            raise ValueError(f"sigma_policy: {self.sigma_policy!r} is not allowed (allowed: {', '.join(SIGMA_POLICIES)})")
        if self.positions not in POSITIONS:
            raise ValueError(f"positions: {self.positions!r} is not allowed (allowed: {', '.join(POSITIONS)})")
        if self.positions == "interpolate":
            if self.positions_arch is None:
                raise ValueError("positions = 'interpolate' needs positions_arch, the architecture whose position handle it scales")
            require_interpolate(self.positions_arch)

    @classmethod
    def from_config(cls, cfg: DownscaleConfig, **handles: Any) -> StepOptions:
        """The config's four FasterDiT keys plus the host's ``handles`` (keyword fields above)."""
        return cls(cfg.direction_loss_weight, cfg.direction_loss_only_routed, cfg.sigma_policy, cfg.positions, **handles)


class DownscaleHook:
    """Routes a trainer's train steps; ``on_step`` observers see every decision.

    ``on_step(step, decision, native_hw, run_hw, run_sigmas)``: ``run_sigmas`` is the σ the step
    runs at (``decision.sigmas`` itself unless a σ policy mapped them).
    """

    def __init__(
        self,
        router: Router,
        family: FlowFamily | DDPMFamily,
        *,
        options: StepOptions | None = None,
        rank: int = 0,
        world_size: int = 1,
        on_step: Callable[[int, RouteDecision, tuple[int, int], tuple[int, int], torch.Tensor], None] | None = None,
        step_logs: Callable[[dict[str, float], Any], None] | None = None,
    ):
        self.router = router
        self.family = family
        self.options = options if options is not None else StepOptions()
        self.stds = RunningStd() if self.options.sigma_policy == "snr_match" else None
        self.rank = rank
        self.world_size = world_size
        self.on_step = on_step
        self.step_logs = step_logs
        self.step = 0
        self.last: RouteDecision | None = None
        self._installed: dict[str, Any] = {}

    def install(self, trainer: Any) -> None:
        if self._installed:
            raise RuntimeError("downscale hook is already installed on a trainer")
        for name in WRAPPED_METHODS:
            if not callable(getattr(trainer, name, None)):
                raise AttributeError(f"trainer {type(trainer).__name__} has no method {name!r}: unsupported host revision")
        self._installed = {name: trainer.__dict__.get(name) for name in WRAPPED_METHODS}
        self.install_loss(trainer)
        original_step = trainer.get_noise_pred_and_target
        original_logs = trainer.generate_step_logs

        def get_noise_pred_and_target(
            args, accelerator, noise_scheduler, latents, batch, text_encoder_conds, unet, network, weight_dtype, train_unet, is_train=True
        ):
            call = (args, accelerator, noise_scheduler, latents, batch, text_encoder_conds, unet, network, weight_dtype, train_unet)
            return self.dispatch(original_step, *call, is_train=is_train)

        def generate_step_logs(*args, **kwargs):
            logs = original_logs(*args, **kwargs)
            if self.step_logs is not None:
                self.step_logs(logs, args[1] if len(args) > 1 else kwargs.get("current_loss"))
            return logs

        trainer.get_noise_pred_and_target = get_noise_pred_and_target
        trainer.generate_step_logs = generate_step_logs

    def install_loss(self, trainer: Any) -> None:
        """Wrap ``process_batch`` for the direction loss (λ > 0 only; a patched host's call points cover the rest)."""
        weight = self.options.direction_loss_weight
        if not weight:
            return
        original = getattr(trainer, LOSS_METHOD, None)
        if not callable(original) or "is_train" not in inspect.signature(original).parameters:
            raise AttributeError(f"trainer {type(trainer).__name__} has no {LOSS_METHOD}(..., is_train): unsupported host revision")
        signature = inspect.signature(original)
        module = self.options.loss_module
        gate = self._routed if self.options.direction_loss_only_routed else None

        def process_batch(*args: Any, **kwargs: Any) -> Any:
            call = signature.bind(*args, **kwargs)
            call.apply_defaults()
            if not call.arguments["is_train"]:  # validation: the host's loss, untouched
                return original(*args, **kwargs)
            with direction_loss_scope(module, weight, gate=gate):
                return original(*args, **kwargs)

        self._installed.setdefault(LOSS_METHOD, trainer.__dict__.get(LOSS_METHOD))
        setattr(trainer, LOSS_METHOD, process_batch)

    def _routed(self) -> bool:
        """Whether the current train step was routed (read by the gated direction loss)."""
        return self.last is not None and self.last.routed

    def uninstall(self, trainer: Any) -> None:
        for name, previous in self._installed.items():
            if previous is None:
                trainer.__dict__.pop(name, None)
            else:
                setattr(trainer, name, previous)
        self._installed = {}

    def dispatch(self, original: Callable, *call: Any, is_train: bool = True) -> Any:
        """One host ``get_noise_pred_and_target`` call: routed when training, untouched otherwise."""
        return self.train_step(original, call) if is_train else original(*call, is_train=False)

    def train_step(self, original: Callable, call: tuple) -> Any:
        args, accelerator, noise_scheduler, latents = call[:4]
        self.step += 1
        native_hw = tuple(latents.shape[-2:])
        sampler = self.family.bind(args, noise_scheduler, latents, accelerator.device, call[8])
        decision = self.router.route(sampler.draw, latents.shape[0], native_hw, self.step, self.rank, self.world_size, first=sampler.first)
        self.last = decision
        run_hw = decision.target_hw if decision.routed else native_hw
        if not decision.needs_replay:
            self._observe(decision, native_hw, run_hw, decision.sigmas)
            return original(*call, is_train=True)
        small = area_downsample(latents, run_hw) if decision.routed else latents
        sigmas = self.run_sigmas(decision, sampler, noise_scheduler, latents, small)
        self._observe(decision, native_hw, run_hw, sigmas)
        with sampler.replay(sigmas), self._positions(decision, accelerator, call[6], native_hw, run_hw):
            return original(args, accelerator, noise_scheduler, small, *call[4:], is_train=True)

    def _observe(self, decision: RouteDecision, native_hw: tuple[int, int], run_hw: tuple[int, int], sigmas: torch.Tensor) -> None:
        if self.on_step is not None:
            self.on_step(self.step, decision, native_hw, run_hw, sigmas)

    def run_sigmas(
        self, decision: RouteDecision, sampler: BoundSampler, noise_scheduler: Any, native: torch.Tensor, small: torch.Tensor
    ) -> torch.Tensor:
        """The σ a step runs at: on a routed step the policy's map of the drawn σ, registered for the replay."""
        name = self.options.sigma_policy
        if name == "keep" or not decision.routed:
            return decision.sigmas
        stds = self.stds.update(native, small) if self.stds is not None else (None, None)
        arch = self.router.arch
        policy = make_policy(name, tokens(tuple(native.shape[-2:]), arch), tokens(tuple(small.shape[-2:]), arch), *stds)
        mapped = policy(decision.sigmas)
        return decision.sigmas if mapped is decision.sigmas else self.family.remember(sampler, noise_scheduler, mapped)

    def _positions(
        self, decision: RouteDecision, accelerator: Any, unet: Any, native_hw: tuple[int, int], run_hw: tuple[int, int]
    ) -> AbstractContextManager:
        if self.options.positions == "plain" or not decision.routed:
            return nullcontext()
        model = accelerator.unwrap_model(unet) if unet is not None else None
        return positions_scope(self.options.positions_arch, native_hw, run_hw, model=model, module=self.options.positions_module)
