"""The drop-in hook: wraps a trainer instance's ``get_noise_pred_and_target`` (docs/ARCHITECTURE.md §2).

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
- ``attention = "proportional"``: the routed forward runs inside the host's attention scope
  (``StepOptions.attention_scope``: sd-scripts' ``attention.py``, the lab's), which adds ln(N_native / N_small)
  to the logits of the small grid's image keys (``downscale_plugin/attention.py``).

The wrap is an instance attribute: it shadows the class method for exactly that trainer, whatever
module the class lives in (``python train_network.py`` puts it in ``__main__``), and goes into the
run's record of patches (``scope.Patches``), which takes it off at the run's end.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ...arch import ArchSpec
from ...attention import PROPORTIONAL, log_size
from ...config import DownscaleConfig, FasterDitConfig
from ...fasterdit.direction_loss import direction_loss_scope
from ...fasterdit.policies import RoutedSigmas
from ...fasterdit.positions import positions_scope, require_interpolate
from ...grid import area_downsample, tokens
from ...router import RouteDecision, Router
from ...scope import Patches
from .families import BoundSampler, SamplerFamily

WRAPPED_METHODS = ("get_noise_pred_and_target", "generate_step_logs")
LOSS_METHOD = "process_batch"  # wrapped only when direction_loss_weight > 0


@dataclass(frozen=True)
class StepOptions:
    """A run's FasterDiT settings (checked by :class:`FasterDitConfig` itself), bound to the host
    handles they replace.

    ``loss_module``: the module whose ``conditional_loss`` the trainer's ``process_batch`` calls
    (sd-scripts' ``library.train_util``, ``downscale_plugin.lab.trainer``); needed when λ > 0.
    ``positions_arch`` / ``positions_module``: the architecture whose position handle
    ``positions_scope`` scales and the module holding it (Flux ``flux_utils``, HunyuanImage
    ``hunyuan_image_utils``; Lumina and Anima use the unwrapped denoiser); needed for ``interpolate``.
    ``attention_scope``: the host's ``(image tokens of the routed grid, ln s) → scope`` adding ln s to the logits
    of those image keys in its joint attention for one routed forward; needed for ``proportional``.
    """

    settings: FasterDitConfig = FasterDitConfig()
    loss_module: Any = None
    positions_arch: ArchSpec | None = None
    positions_module: Any = None
    attention_scope: Callable[[int, float], AbstractContextManager] | None = None

    def __post_init__(self) -> None:
        if self.settings.direction_loss_weight and self.loss_module is None:
            raise ValueError("direction_loss_weight > 0 needs loss_module, the module holding the trainer's conditional_loss")
        if self.settings.positions == "interpolate":
            if self.positions_arch is None:
                raise ValueError("positions = 'interpolate' needs positions_arch, the architecture whose position handle it scales")
            require_interpolate(self.positions_arch)
        if self.settings.attention == PROPORTIONAL and self.attention_scope is None:
            raise ValueError(f"attention = {PROPORTIONAL!r} needs attention_scope, the host's scope that biases its joint attention")

    @classmethod
    def from_config(cls, cfg: DownscaleConfig, **handles: Any) -> StepOptions:
        """The config's FasterDiT settings plus the host's ``handles`` (keyword fields above)."""
        return cls(cfg.fasterdit, **handles)


def at_grid(latents: torch.Tensor, hw: tuple[int, int] | None) -> torch.Tensor:
    """The latents at grid ``hw``, area-downsampled (None or the latents' own grid: as given)."""
    return latents if hw is None or tuple(hw) == tuple(latents.shape[-2:]) else area_downsample(latents, hw)


# The batch's (B, 2) pixel (h, w) coordinates of the grid its latents stand for (library/train_util.py): the bucket's
# size (the cached latent's size × 8) and the crop's top-left in it. ``original_sizes_hw``, the source image's size, is
# not one of them. SDXL's ``call_unet`` embeds all three (``sdxl_train_util.get_size_embeddings``).
GRID_SIZE_KEYS = ("crop_top_lefts", "target_sizes_hw")


def at_grid_batch(batch: Any, native_hw: tuple[int, int], run_hw: tuple[int, int]) -> Any:
    """The batch a step at latent grid ``run_hw`` hands the host: a shallow copy whose size conditioning is what
    sd-scripts gives the same image trained in a bucket of the small grid's size (target and crop scaled per axis
    by run / native, rounded as the host's integers; the source's original size kept), so SDXL's "target 1024"
    is only trained on 1024-px content. The host's batch is never changed; at the native grid it is returned as is."""
    if tuple(run_hw) == tuple(native_hw) or not isinstance(batch, dict) or not all(k in batch for k in GRID_SIZE_KEYS):
        return batch
    out = dict(batch)
    for key in GRID_SIZE_KEYS:
        value = batch[key]
        scale = torch.tensor([run_hw[0] / native_hw[0], run_hw[1] / native_hw[1]], dtype=torch.float64, device=value.device)
        out[key] = (value.double() * scale).round().to(value.dtype)
    return out


class HostCall(NamedTuple):
    """The positional arguments of one host ``get_noise_pred_and_target`` call, by name (the host's
    signature: ``NetworkTrainer.get_noise_pred_and_target`` in tests/doubles/train_network.py). A routed
    step calls the host with the same arguments but the latents and the batch's size conditioning (:meth:`DownscaleHook.run_host`)."""

    args: Any
    accelerator: Any
    noise_scheduler: Any
    latents: torch.Tensor
    batch: Any
    text_encoder_conds: Any
    unet: Any
    network: Any
    weight_dtype: Any
    train_unet: bool


class DownscaleHook:
    """Routes a trainer's train steps; ``on_step`` observers see every decision.

    ``on_step(step, decision, native_hw, run_hw, run_sigmas)``: ``run_sigmas`` is the σ the step
    runs at (``decision.sigmas`` itself unless a σ policy mapped them).
    """

    def __init__(
        self,
        router: Router,
        family: SamplerFamily,
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
        self.policy = RoutedSigmas(self.options.settings.sigma_policy)
        self.rank = rank
        self.world_size = world_size
        self.on_step = on_step
        self.step_logs = step_logs
        self.step = 0
        self.last: RouteDecision | None = None

    def install(self, trainer: Any, patches: Patches) -> None:
        """Wrap the trainer instance's step and step-log methods (and its loss, for the direction loss),
        recorded in the run's ``patches`` so the run's end takes them off again."""
        for name in WRAPPED_METHODS:
            if not callable(getattr(trainer, name, None)):
                raise AttributeError(f"trainer {type(trainer).__name__} has no method {name!r}: unsupported host revision")
        self.install_loss(trainer, patches)
        original_step = trainer.get_noise_pred_and_target
        original_logs = trainer.generate_step_logs

        def get_noise_pred_and_target(
            args, accelerator, noise_scheduler, latents, batch, text_encoder_conds, unet, network, weight_dtype, train_unet, is_train=True
        ):
            call = HostCall(args, accelerator, noise_scheduler, latents, batch, text_encoder_conds, unet, network, weight_dtype, train_unet)
            return self.dispatch(original_step, *call, is_train=is_train)

        def generate_step_logs(*args, **kwargs):
            logs = original_logs(*args, **kwargs)
            if self.step_logs is not None:
                self.step_logs(logs, args[1] if len(args) > 1 else kwargs.get("current_loss"))
            return logs

        patches.set(trainer, "get_noise_pred_and_target", get_noise_pred_and_target)
        patches.set(trainer, "generate_step_logs", generate_step_logs)

    def install_loss(self, trainer: Any, patches: Patches) -> None:
        """Wrap ``process_batch`` for the direction loss (λ > 0 only; a patched host's call points cover the rest)."""
        weight = self.options.settings.direction_loss_weight
        if not weight:
            return
        original = getattr(trainer, LOSS_METHOD, None)
        if not callable(original) or "is_train" not in inspect.signature(original).parameters:
            raise AttributeError(f"trainer {type(trainer).__name__} has no {LOSS_METHOD}(..., is_train): unsupported host revision")
        signature = inspect.signature(original)
        module = self.options.loss_module
        gate = self._routed if self.options.settings.direction_loss_only_routed else None

        def process_batch(*args: Any, **kwargs: Any) -> Any:
            call = signature.bind(*args, **kwargs)
            call.apply_defaults()
            if not call.arguments["is_train"]:  # validation: the host's loss, untouched
                return original(*args, **kwargs)
            with direction_loss_scope(module, weight, gate=gate):
                return original(*args, **kwargs)

        patches.set(trainer, LOSS_METHOD, process_batch)

    def _routed(self) -> bool:
        """Whether the current train step was routed (read by the gated direction loss)."""
        return self.last is not None and self.last.routed

    def dispatch(self, original: Callable, *call: Any, is_train: bool = True) -> Any:
        """One host ``get_noise_pred_and_target`` call: routed when training, untouched otherwise."""
        return self.train_step(original, HostCall(*call)) if is_train else original(*call, is_train=False)

    def train_step(self, original: Callable, call: HostCall) -> Any:
        latents = call.latents
        self.step += 1
        native_hw = tuple(latents.shape[-2:])
        sampler = self.family.bind(call.args, call.noise_scheduler, latents, call.accelerator.device, call.weight_dtype)
        decision = self.router.route(
            sampler.draw, latents.shape[0], native_hw, self.step, self.rank, self.world_size, first=sampler.first, law=sampler.law
        )
        self.last = decision
        run_hw = decision.target_hw if decision.routed else native_hw
        if not decision.needs_replay:
            self._observe(decision, native_hw, run_hw, decision.sigmas)
            return original(*call, is_train=True)
        small = at_grid(latents, run_hw)
        sigmas, positions = self.run_sigmas(decision, sampler, call.noise_scheduler, latents, small)
        self._observe(decision, native_hw, run_hw, sigmas)
        return self.run_host(
            original, call, sampler, small, positions, self._routed_scope(decision, call.accelerator, call.unet, native_hw, run_hw)
        )

    @staticmethod
    def run_host(
        original: Callable,
        call: HostCall,
        sampler: BoundSampler,
        small: torch.Tensor,
        positions: torch.Tensor,
        scope: AbstractContextManager,
    ) -> Any:
        """Run the host's own train step on ``small`` latents, with the batch's size conditioning at their grid
        (:func:`at_grid_batch`), and σ replayed from the sampler pool's ``positions``: the one way a routed
        train step and a map arm (map.py) run the host at a grid and σ."""
        batch = at_grid_batch(call.batch, tuple(call.latents.shape[-2:]), tuple(small.shape[-2:]))
        with sampler.replay(positions), scope:
            return original(*call._replace(latents=small, batch=batch), is_train=True)

    def _observe(self, decision: RouteDecision, native_hw: tuple[int, int], run_hw: tuple[int, int], sigmas: torch.Tensor) -> None:
        if self.on_step is not None:
            self.on_step(self.step, decision, native_hw, run_hw, sigmas)

    def run_sigmas(
        self, decision: RouteDecision, sampler: BoundSampler, noise_scheduler: Any, native: torch.Tensor, small: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The σ a step runs at and their pool positions for the replay: the decision's own samples
        (by position, router.py ``sources``), or on a routed step the policy's map of them, registered."""
        if not decision.routed:
            return decision.sigmas, decision.source_index
        mapped = self.policy(decision.sigmas, native, small, self.router.arch)
        if mapped is decision.sigmas:
            return decision.sigmas, decision.source_index
        positions = self.family.remember(sampler, noise_scheduler, mapped)
        return sampler.pool.pairs(positions)[1], positions  # the σ the host replays (SD1/SDXL: the nearest timestep's)

    @contextmanager
    def _routed_scope(
        self, decision: RouteDecision, accelerator: Any, unet: Any, native_hw: tuple[int, int], run_hw: tuple[int, int]
    ) -> Iterator[None]:
        """The scopes a routed forward runs inside: interpolated positions, proportional attention (none on other steps)."""
        settings = self.options.settings
        with ExitStack() as stack:
            if decision.routed and settings.positions != "plain":
                model = accelerator.unwrap_model(unet) if unet is not None else None
                stack.enter_context(
                    positions_scope(self.options.positions_arch, native_hw, run_hw, model=model, module=self.options.positions_module)
                )
            if decision.routed and settings.attention == PROPORTIONAL:
                arch = self.router.arch
                small = tokens(run_hw, arch)
                stack.enter_context(self.options.attention_scope(small, log_size(tokens(native_hw, arch), small)))
            yield
