"""The drop-in hook: wraps a trainer instance's ``get_noise_pred_and_target`` (DESIGN §1).

Per train step: the host's own sampler draws σ on the native grid under a forked RNG; the router
picks the step's route; a native step whose σ needed no conditioning calls the host unchanged
(bitwise identical to a run without the plugin); otherwise the latents are area-downsampled to the
route's grid (or kept, for a conditioned native step) and the drawn σ is replayed through the
host's sampler slot, so the host builds noise, noisy input, ids, masks and target at that grid.
Validation (``is_train=False``) passes straight through and consumes no RNG.

The wrap is an instance attribute: it shadows the class method for exactly that trainer, whatever
module the class lives in (``python train_network.py`` puts it in ``__main__``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..grid import area_downsample
from ..router import RouteDecision, Router
from .families import DDPMFamily, FlowFamily

logger = logging.getLogger(__name__)

WRAPPED_METHODS = ("get_noise_pred_and_target", "generate_step_logs")


class DownscaleHook:
    """Routes a trainer's train steps; ``on_step`` observers see every decision."""

    def __init__(
        self,
        router: Router,
        family: FlowFamily | DDPMFamily,
        *,
        rank: int = 0,
        world_size: int = 1,
        on_step: Callable[[int, RouteDecision, tuple[int, int], tuple[int, int]], None] | None = None,
        step_logs: Callable[[dict[str, float], Any], None] | None = None,
    ):
        self.router = router
        self.family = family
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
        if self.on_step is not None:
            self.on_step(self.step, decision, native_hw, run_hw)
        if not decision.needs_replay:
            return original(*call, is_train=True)
        small = area_downsample(latents, run_hw) if decision.routed else latents
        with sampler.replay(decision.sigmas):
            return original(args, accelerator, noise_scheduler, small, *call[4:], is_train=True)


def fork_devices(device: torch.device | str) -> list[int]:
    """CUDA device indices ``torch.random.fork_rng`` must save for σ draws made on ``device``."""
    device = torch.device(device)
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]
