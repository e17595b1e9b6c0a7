"""musubi-tuner's σ sampler as a host σ family: draw with the trainer's own method, replay by shadowing it.

musubi-tuner's sampler is a trainer *method*, ``get_noisy_model_input_and_timesteps(args, noise,
latents, timesteps, noise_scheduler, device, dtype) -> (noisy_model_input, timesteps)``
(training/trainer_base.py), which ``process_batch`` reaches through ``self``. So a replay is an
instance attribute that shadows it for exactly one call (docs/ARCHITECTURE.md §3), and a dry run calls
it on stand-in tensors: with latents 0 and noise 1 the host's noisy input *is* its σ, in the host's
own arithmetic, so every (timestep, σ) pair in the step's :class:`Pool` is one the host made.

Besides the RNG (forked by the router), the sampler touches trainer state: the timestep-bucket pool
(``timestep_range_pool``, popped by ``get_bucketed_timestep``) and, for Wan 2.2's two experts, the
flag naming the expert of the next forward. Every dry run leaves both as it found them; a replay
first runs the host's own draw at the native grid (so RNG, pool and flag advance exactly as without
the plugin), then builds the step: in the flow modes the host's own sampler does, handed σ through its
path for given timesteps (:func:`given_sigmas`); on the scheduler grid, whose branch draws its own index,
the plugin rebuilds the host's σ·noise + (1 − σ)·latents; and it sets the expert flag from the replayed σ
as the host's sampler would have. What is re-implemented here is checked against the host at start (``selfcheck.py``).

Exact laws (``BoundSampler.law``) exist for the flow modes ``uniform``, ``sigmoid``, ``shift``,
``flux_shift``, ``flux2_shift``, ``qwen_shift``, ``krea2_shift`` (each a logistic-normal σ shifted by
a constant k) and for the scheduler grid (``sigma``) with a density that has a CDF, all with
``--min_timestep``/``--max_timestep``. None (the router then fills with its lead σ, still exact per
sample) with ``--preserve_distribution_shape``, with timestep buckets (the host maps the batch's
stratified uniforms through a clamped inverse CDF) and for ``logsnr``, ``qinglong_*``, ``ideogram4_shift``.
Candidate draws with timestep buckets pass fresh uniforms as the batch's ``timesteps``, so they go
through the host's own bucket path; each bucketed uniform is marginally uniform on [0, 1).
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ...rng import forked, seed_forked
from ...scope import swap_attr
from ...sigma import ContinuousLaw, DiscreteLaw, SigmaLaw, SigmaSampler, density_cdf
from ..kohya.pool import BoundSampler, Pool, PooledLaw
from .facts import BASE_TRAINER, SAMPLER_METHOD, HostError, MusubiArch

# The flow branch of trainer_base's sampler (σ = t, timesteps = 1000·t + 1); every other mode reads the scheduler grid.
FLOW_MODES = (
    "uniform", "sigmoid", "shift", "flux_shift", "qwen_shift", "krea2_shift", "ideogram4_shift", "logsnr",
    "qinglong_flux", "qinglong_qwen", "flux2_shift",
)  # fmt: skip
# Modes whose σ depends on the latent's h, w: stand-ins and candidates keep the native grid.
GRID_MODES = ("flux_shift", "qwen_shift", "krea2_shift", "ideogram4_shift", "qinglong_flux", "qinglong_qwen", "flux2_shift")
# (x1, y1, x2, y2, tokens from (h, w)) of each μ-shift mode's get_lin_function (training/trainer_base.py).
MU_SHIFTS: dict[str, tuple[float, float, float, float, Callable[[int, int], int]]] = {
    "flux_shift": (256, 0.5, 4096, 1.15, lambda h, w: (h // 2) * (w // 2)),
    "flux2_shift": (256, 0.5, 4096, 1.15, lambda h, w: h * w),
    "qwen_shift": (256, 0.5, 8192, 0.9, lambda h, w: (h // 2) * (w // 2)),
    "krea2_shift": (256, 0.5, 6400, 1.15, lambda h, w: (h // 2) * (w // 2)),
}
_STATE_LISTS = ("timestep_range_pool",)
_MC_CHUNK = 256  # μ-shift stand-ins carry the native grid per σ


def shift_of(mode: str, discrete_flow_shift: float, latent_hw: tuple[int, int]) -> float | None:
    """The constant k of a shift mode, σ = k·s / (1 + (k − 1)·s) (None: not a shift mode)."""
    if mode == "shift":
        return float(discrete_flow_shift)
    if mode not in MU_SHIFTS:
        return None
    x1, y1, x2, y2, count = MU_SHIFTS[mode]
    slope = (y2 - y1) / (x2 - x1)
    return math.exp(slope * count(*latent_hw) + (y1 - slope * x1))


def _affine(law: ContinuousLaw, lo: float, hi: float) -> ContinuousLaw:
    """The law of lo + (hi − lo)·σ: trainer_base scales every flow σ to [min_timestep, max_timestep] / 1000."""
    if (lo, hi) == (0.0, 1.0):
        return law
    span = hi - lo
    return ContinuousLaw(lambda x: law.cdf(min(max((x - lo) / span, 0.0), 1.0)), lambda u: lo + span * law.quantile(u))


def flow_law(args: Any, latent_hw: tuple[int, int]) -> ContinuousLaw | None:
    """The exact law of the flow branch's σ for these args on this grid, or None."""
    mode = args.timestep_sampling
    scale = float(args.sigmoid_scale)
    if mode == "uniform":
        base = SigmaSampler("uniform").law(latent_hw)
    elif mode == "sigmoid":
        base = SigmaSampler("sigmoid", sigmoid_scale=scale).law(latent_hw)
    else:
        k = shift_of(mode, args.discrete_flow_shift, latent_hw)
        if k is None:
            return None
        base = SigmaSampler("shift", sigmoid_scale=scale, discrete_flow_shift=k).law(latent_hw)
    t_min = 0.0 if args.min_timestep is None else float(args.min_timestep)
    t_max = 1000.0 if args.max_timestep is None else float(args.max_timestep)
    return _affine(base, t_min / 1000.0, t_max / 1000.0)


def grid_law(args: Any, noise_scheduler: Any, dtype: torch.dtype) -> DiscreteLaw | None:
    """The scheduler branch's law: index k = ⌊u·(t_max − t_min) + t_min⌋ of the scheduler's grid, σ in ``dtype``."""
    cdf = density_cdf(args.weighting_scheme, args.logit_mean, args.logit_std)
    if cdf is None:
        return None
    t_min = 0 if args.min_timestep is None else int(args.min_timestep)
    t_max = 1000 if args.max_timestep is None else int(args.max_timestep)
    span = t_max - t_min
    edges = cdf(torch.arange(span + 1, dtype=torch.float64) / span)
    timesteps = noise_scheduler.timesteps.detach().cpu()[t_min:t_max]
    sigmas = noise_scheduler.sigmas.detach().cpu().to(dtype)[t_min:t_max]
    return DiscreteLaw(sigmas.double(), edges[1:] - edges[:-1], timesteps)


# The flow branch's own path for σ the caller gives: "uniform" with the batch's timesteps returns them as t, and an
# unset range scales by exactly 1 (training/trainer_base.py); selfcheck.py checks it against the host's own draws.
GIVEN_SIGMAS = {"timestep_sampling": "uniform", "min_timestep": None, "max_timestep": None, "preserve_distribution_shape": False}


def given_sigmas(args: Any) -> Any:
    """``args`` for which the host's flow branch runs the σ it is handed as the batch's ``timesteps``."""
    out = copy.copy(args)
    for name, value in GIVEN_SIGMAS.items():
        setattr(out, name, value)
    return out


def expert_is_high(timesteps: torch.Tensor, boundary: float) -> bool:
    """Wan 2.2's choice of expert for a batch, from its first timestep (wan_train_network.py's sampler override)."""
    return bool(timesteps[0] / 1000.0 >= boundary)


def base_sampler(trainer: Any) -> Callable:
    """``NetworkTrainer``'s own sampler bound to this trainer: what every supported arch draws each sample with
    (Wan 2.2's two-expert override only selects among its draws)."""
    for cls in type(trainer).__mro__:
        if cls.__name__ == BASE_TRAINER and SAMPLER_METHOD in vars(cls):
            return vars(cls)[SAMPLER_METHOD].__get__(trainer)
    raise HostError(f"{type(trainer).__name__} has no {BASE_TRAINER}.{SAMPLER_METHOD} in its classes")


@dataclass
class MusubiBound(BoundSampler):
    """A bound musubi-tuner sampler that can also make a σ the host did not draw replayable:
    ``remember(sigmas)`` returns their pool positions (for a forced step, as ``families.remember`` does on sd-scripts)."""

    remember: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass
class _Kind:
    """What the first host draw of a bound sampler showed: the dtype of the host's timesteps (and of the flow branch's σ)."""

    timesteps: torch.dtype | None = None


class MusubiFamily:
    """The σ family of one musubi-tuner trainer: ``bind`` as in the SamplerFamily protocol of
    hosts/sd_scripts/families.py; the bound sampler's ``remember`` makes a forced σ replayable (``mode = "auto"``)."""

    name = "musubi"

    def __init__(self, trainer: Any, record: MusubiArch):
        self.trainer = trainer
        self.record = record
        self.base = base_sampler(trainer)

    @contextmanager
    def kept_state(self) -> Iterator[None]:
        """Leave the trainer's sampler state (bucket pool, expert flag) as it was, whatever ran inside."""
        saved = {name: list(getattr(self.trainer, name)) for name in _STATE_LISTS if hasattr(self.trainer, name)}
        flag = self.record.expert[0] if self.record.expert else None
        if flag is not None and hasattr(self.trainer, flag):
            saved[flag] = getattr(self.trainer, flag)
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(self.trainer, name, value)

    def bind(
        self, args: Any, noise_scheduler: Any, latents: torch.Tensor, device: Any, dtype: Any, timesteps: list[float] | None = None
    ) -> BoundSampler:
        """The host's sampler for one step: ``timesteps`` is the batch's ``batch["timesteps"]`` (bucketed uniforms, or None)."""
        pool = Pool()
        kind = _Kind()
        mode = args.timestep_sampling
        flow = mode in FLOW_MODES
        native_hw = tuple(latents.shape[-2:])
        grid = native_hw if mode in GRID_MODES else (1, 1)
        bucketed = (self.trainer.num_timestep_buckets or 0) > 1
        expert = self.record.expert if self.record.expert and getattr(self.trainer, "high_low_training", False) else None

        def stand_ins(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            shape = (n, 1) + (1,) * (latents.ndim - 4) + grid
            return latents.new_ones(shape, dtype=torch.float32), latents.new_zeros(shape, dtype=torch.float32)

        def host(fn: Callable, n: int, batch_timesteps: list[float] | None) -> tuple[torch.Tensor, torch.Tensor]:
            noise, zeros = stand_ins(n)
            with self.kept_state():
                noisy, t = fn(args, noise, zeros, batch_timesteps, noise_scheduler, device, dtype)
            if kind.timesteps is None:
                kind.timesteps = t.dtype
            return t, noisy.reshape(noisy.shape[0], -1)[:, 0]  # latents 0, noise 1: the noisy input is σ

        def record(t: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
            pool.add(t, sigmas)
            return sigmas.detach().reshape(-1).double().cpu()

        def first() -> torch.Tensor:
            return record(*host(self.trainer.get_noisy_model_input_and_timesteps, latents.shape[0], timesteps))

        def draw(n: int) -> torch.Tensor:
            fresh = torch.rand(n, dtype=torch.float64).tolist() if bucketed else None
            return record(*host(self.base, n, fresh))

        def replay(positions: torch.Tensor):
            t_values, s_values = pool.pairs(positions)
            original = self.trainer.get_noisy_model_input_and_timesteps

            def replayed(args, noise, latents, timesteps, noise_scheduler, device, dtype):
                # the host's own draw at the native grid: RNG, bucket pool and expert flag advance as without the plugin
                original(args, *stand_ins(latents.shape[0]), timesteps, noise_scheduler, device, dtype)
                if flow:  # the host builds the step from σ itself: noisy input, timesteps = 1000·σ + 1
                    noisy, t = self.base(given_sigmas(args), noise, latents, s_values.tolist(), noise_scheduler, device, dtype)
                else:  # the scheduler branch draws its own index: the plugin builds its formula (selfcheck.py checks it)
                    t = t_values.to(device=device, dtype=kind.timesteps)
                    sigma = s_values.to(device=device, dtype=dtype).view((-1,) + (1,) * (latents.ndim - 1))
                    noisy = sigma * noise + (1.0 - sigma) * latents
                if expert is not None:
                    flag, boundary = expert
                    setattr(self.trainer, flag, expert_is_high(t, getattr(self.trainer, boundary)))
                return noisy, t

            return swap_attr(self.trainer, SAMPLER_METHOD, replayed)

        def remember(sigmas: torch.Tensor) -> torch.Tensor:
            # as the host pairs a σ: the flow branch's t = 1000·σ + 1 in its timestep dtype; the scheduler branch's
            # nearest grid atom (its (timestep, σ) pair, so every later lookup of the timestep finds it on the grid)
            if flow:
                return pool.add(*self._pair(kind)(sigmas.double()))
            grid = noise_scheduler.sigmas.detach().cpu().double()[: noise_scheduler.timesteps.numel()]
            index = (grid.view(1, -1) - sigmas.double().view(-1, 1)).abs().argmin(1)
            atoms = noise_scheduler.sigmas.detach().cpu().to(dtype)[index]
            return pool.add(noise_scheduler.timesteps.detach().cpu()[index], atoms)

        law = self._law(args, noise_scheduler, native_hw, dtype, flow, bucketed)
        pooled = None if law is None else PooledLaw(law, pool, self._pair(kind))
        return MusubiBound(first, draw, replay, pool, pooled, remember)

    @staticmethod
    def _pair(kind: _Kind) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """A continuous law draw as the host would return it: σ in the timestep dtype, timesteps = σ·1000 + 1 in that dtype."""

        def pair(sigmas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            rounded = sigmas.to(kind.timesteps or torch.float32)
            return (rounded * 1000.0 + 1).double(), rounded.double()

        return pair

    def _law(self, args: Any, noise_scheduler: Any, latent_hw: tuple[int, int], dtype: Any, flow: bool, bucketed: bool) -> SigmaLaw | None:
        if bucketed or getattr(args, "preserve_distribution_shape", False):
            return None
        return flow_law(args, latent_hw) if flow else grid_law(args, noise_scheduler, dtype)


@dataclass
class PlanSampler:
    """The trainer's own sampler as a ``plan`` sampler: Monte Carlo through the host's draws (cached per
    (n, seed), and per grid for the μ-shift modes), and the exact scheduler-grid atoms where they exist."""

    family: MusubiFamily
    args: Any
    noise_scheduler: Any
    dtype: Any
    cache: dict = field(default_factory=dict, compare=False)

    has_closed_form = False

    def _bind(self, latent_hw: tuple[int, int]) -> BoundSampler:
        return self.family.bind(self.args, self.noise_scheduler, torch.zeros(1, 1, *latent_hw), "cpu", self.dtype)

    def sample(self, n: int, latent_hw: tuple[int, int], generator: torch.Generator | None = None) -> torch.Tensor:
        seed = generator.initial_seed() if generator is not None else 0
        key = (n, seed, tuple(latent_hw) if self.args.timestep_sampling in GRID_MODES else None)
        if key not in self.cache:
            with forked():  # the host's sampler draws from the global CPU generator (and Python's random) here
                seed_forked(seed)
                bound = self._bind(latent_hw)
                self.cache[key] = torch.cat([bound.draw(min(_MC_CHUNK, n - i)) for i in range(0, n, _MC_CHUNK)]).float()
        return self.cache[key]

    def law(self, latent_hw: tuple[int, int]) -> SigmaLaw | None:
        law = self._bind(latent_hw).law
        return None if law is None else law.law


def loop_scheduler(trainer: Any, args: Any) -> Any:
    """The scheduler the loop builds, ``FlowMatchDiscreteScheduler(shift=--discrete_flow_shift, reverse=True,
    solver="euler")``, from the trainer base class's own module (the scheduler-grid σ of ``timestep_sampling = "sigma"``)."""
    base = next(cls for cls in type(trainer).__mro__ if cls.__name__ == BASE_TRAINER)
    return sys.modules[base.__module__].FlowMatchDiscreteScheduler(shift=args.discrete_flow_shift, reverse=True, solver="euler")


def run_sampler(family: MusubiFamily, args: Any, dit_dtype: Any) -> PlanSampler:
    """The run's own sampler as a ``plan`` sampler: what the start banner's plan and ``mode = "auto"``'s σ mass draw from."""
    return PlanSampler(family, args, loop_scheduler(family.trainer, args), dit_dtype or torch.bfloat16)
