"""Host σ-sampler families: draw σ with the host's own sampler, replay a drawn σ through its slot.

Every sd-scripts LoRA trainer reaches its σ sampler through a module attribute at call time, so a
scoped replacement of that attribute is seen by exactly the call it wraps (docs/ARCHITECTURE.md §3):

- ``flux``: ``library.flux_train_utils.get_noisy_model_input_and_timesteps`` (FLUX.1, Chroma,
  Anima, HunyuanImage; the lab trainer's module follows the same contract)
- ``lumina``: ``library.lumina_train_util.get_noisy_model_input_and_timesteps``
- ``sd3``: ``library.sd3_train_utils.get_noisy_model_input_and_timesteps`` (no noise_scheduler arg)
- ``ddpm``: ``library.train_util.get_timesteps`` (SD1.x/SDXL integer t, mapped to flow σ by SNR)

A replay returns exactly what the host sampler would have returned for those samples: the same
timesteps and σ values and dtypes the host produced when it drew them, the noisy input built the
host's way at whatever grid the latents now have, and ``--ip_noise_gamma`` drawn at that grid.
Each sample is replayed by its position in the step's :class:`Pool` (every pair drawn, in draw
order: the router's ``RouteDecision.sources``), never by σ value: in bf16 several of the ``sigma``
grid's timesteps share one σ.

Each bound sampler also carries the host mode's exact σ law (``BoundSampler.law``, None where the
mode has none), built from the host's own arguments and scheduler arrays, so the coupled gate can
fill what rejection did not find with exact draws that replay like the host's own.
It first runs the host's own σ draw and discards it, so the host's RNG stream advances exactly as
without the plugin: skipping it would leave, e.g., torch's cached second Box-Muller normal in place
and every later step would draw the same σ.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any, Protocol

import torch

from ...rng import forked, seed_forked
from ...scope import swap_attr
from ...sigma import LAW_MODES, SigmaLaw, SigmaSampler, ddpm_law, ddpm_t_to_sigma, grid_law, sd3_law, sigma_to_ddpm_t
from ..kohya.pool import BoundSampler, Pool, PooledLaw, record_pairs

FLOW_CONTRACTS = ("flux", "lumina", "sd3")
# Modes whose σ depends on the latent's h, w (the μ shift): candidates must keep the native grid.
GRID_DEPENDENT_MODES = ("flux_shift", "nextdit_shift")
_MC_CHUNK = 256  # grid-dependent samplers allocate a latent-sized tensor per σ


class SamplerFamily(Protocol):
    """What the hook, the run and the map need of a host σ family (docs/ARCHITECTURE.md §3)."""

    name: str

    def bind(self, args: Any, noise_scheduler: Any, latents: torch.Tensor, device: Any, dtype: Any) -> BoundSampler:
        """The host's sampler bound to one step's arguments."""
        ...

    def remember(self, sampler: BoundSampler, noise_scheduler: Any, sigmas: torch.Tensor) -> torch.Tensor:
        """Make σ the host did not draw replayable; returns their positions in the sampler's pool."""
        ...


def flow_law(args: Any, contract: str, noise_scheduler: Any, latent_hw: tuple[int, int], dtype: Any) -> SigmaLaw | None:
    """The exact law of the host's flow σ draw for these args (None: a mode or density without one).

    flux_train_utils / lumina_train_util: ``uniform``, ``sigmoid``, ``shift``, ``flux_shift`` and (Lumina)
    ``nextdit_shift`` in closed form; ``sigma``: t = scheduler.timesteps[⌊u·T⌋], σ = scheduler.sigmas
    at that index in the weight dtype; sd3_train_utils: its integer-t law (:func:`sd3_law`).
    """
    get = lambda name, default: getattr(args, name, default)  # noqa: E731
    scheme, mean, std = get("weighting_scheme", "uniform"), get("logit_mean", 0.0), get("logit_std", 1.0)
    if contract == "sd3":
        t_min = 0 if get("min_timestep", None) is None else args.min_timestep
        t_max = 1000 if get("max_timestep", None) is None else args.max_timestep
        return sd3_law(t_min, t_max, float(get("training_shift", 1.0)), scheme, dtype, mean, std)
    mode = get("timestep_sampling", None)
    if mode in LAW_MODES and (mode != "nextdit_shift" or contract == "lumina"):
        sampler = SigmaSampler(
            mode, sigmoid_scale=float(get("sigmoid_scale", 1.0)), discrete_flow_shift=float(get("discrete_flow_shift", 1.0))
        )
        return sampler.law(latent_hw)
    if mode == "sigma":
        timesteps = noise_scheduler.timesteps.detach().cpu()
        values = noise_scheduler.sigmas.detach().cpu().to(dtype)[: timesteps.numel()]
        return grid_law(values.double(), timesteps, scheme, mean, std)  # as the float64 keys _record hands the router
    return None


class FlowFamily:
    """Flow-matching samplers with sd-scripts' ``(noisy, timesteps, sigmas)`` return contract."""

    fn_name = "get_noisy_model_input_and_timesteps"

    def __init__(self, module: ModuleType, contract: str):
        if contract not in FLOW_CONTRACTS:
            raise ValueError(f"contract: {contract!r} is not allowed (allowed: {', '.join(FLOW_CONTRACTS)})")
        if not callable(getattr(module, self.fn_name, None)):
            raise AttributeError(f"{module.__name__}.{self.fn_name} is missing: this host revision has no σ sampler hook point")
        self.module = module
        self.contract = contract
        self.name = contract

    def call_host(self, fn: Callable, args: Any, noise_scheduler: Any, latents: torch.Tensor, noise: torch.Tensor, device: Any, dtype: Any):
        """Call ``fn``, the slot's function (the host's or a replay), with the contract's arguments."""
        if self.contract == "sd3":
            return fn(args, latents, noise, device, dtype)
        return fn(args, noise_scheduler, latents, noise, device, dtype)

    def _steps(self, noise_scheduler: Any) -> int:
        return 1000 if self.contract == "sd3" else noise_scheduler.config.num_train_timesteps

    def remember(self, sampler: BoundSampler, noise_scheduler: Any, sigmas: torch.Tensor) -> torch.Tensor:
        """Make σ the host did not draw (a σ policy's map) replayable: t = σ·T, as every continuous host mode pairs them
        (sd3: T = 1000 fixed). Returns their pool positions."""
        return sampler.pool.add(sigmas.double() * self._steps(noise_scheduler), sigmas)

    def bind(self, args: Any, noise_scheduler: Any, latents: torch.Tensor, device: Any, dtype: Any) -> BoundSampler:
        pool = Pool()
        out_dtypes: dict[str, torch.dtype] = {}
        fn = getattr(self.module, self.fn_name)

        quiet_args = copy.copy(args)
        quiet_args.ip_noise_gamma = None  # ξ is drawn after σ; candidates need no latent-sized noise
        grid = tuple(latents.shape[-2:]) if getattr(args, "timestep_sampling", None) in GRID_DEPENDENT_MODES else (1, 1)

        def sample(n: int) -> torch.Tensor:
            # The host's σ draw reads only the batch size, device and (μ-shift modes) the grid, so a
            # one-channel stand-in draws the same σ without building a latent-sized noisy input.
            dummy = latents.new_zeros((n, 1, *grid))
            _, timesteps, sigmas = self.call_host(fn, quiet_args, noise_scheduler, dummy, dummy, device, dtype)
            out_dtypes.setdefault("t", timesteps.dtype)
            out_dtypes.setdefault("s", sigmas.dtype)
            return record_pairs(pool, timesteps, sigmas)

        def first() -> torch.Tensor:
            torch.randn_like(latents)  # the host draws its noise before σ: advance the RNG the same way
            return sample(latents.shape[0])

        def consume_draw() -> None:
            dummy = latents.new_zeros((latents.shape[0], 1, *grid))
            self.call_host(fn, quiet_args, noise_scheduler, dummy, dummy, device, dtype)

        def replay(positions: torch.Tensor):
            t_values, s_values = pool.pairs(positions)
            return swap_attr(self.module, self.fn_name, self._replay_fn(t_values, s_values, out_dtypes, consume_draw))

        steps = self._steps(noise_scheduler)

        def pair(sigmas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            rounded = sigmas.to(out_dtypes.get("s", torch.float32)).double()  # the host's σ dtype (known after first())
            return rounded * steps, rounded

        law = flow_law(args, self.contract, noise_scheduler, tuple(latents.shape[-2:]), dtype)
        return BoundSampler(first, sample, replay, pool, None if law is None else PooledLaw(law, pool, pair))

    def _replay_fn(
        self, t_values: torch.Tensor, s_values: torch.Tensor, out_dtypes: dict[str, torch.dtype], consume_draw: Callable[[], None]
    ) -> Callable:
        contract = self.contract

        def build(args, latents, noise, device, dtype):
            consume_draw()
            timesteps = t_values.to(device=device, dtype=out_dtypes["t"])
            view = (-1,) + (1,) * (latents.ndim - 1) if contract == "flux" else (-1, 1, 1, 1)
            sigmas = s_values.to(device=device, dtype=out_dtypes["s"]).view(view)
            if contract == "sd3":
                return sigmas * noise + (1.0 - sigmas) * latents, timesteps, sigmas
            if getattr(args, "ip_noise_gamma", None):
                xi = torch.randn_like(latents, device=latents.device, dtype=dtype)
                gamma = args.ip_noise_gamma
                if getattr(args, "ip_noise_gamma_random_strength", False):
                    gamma = torch.rand(1, device=latents.device, dtype=dtype) * args.ip_noise_gamma
                noisy = (1.0 - sigmas) * latents + sigmas * (noise + gamma * xi)
            else:
                noisy = (1.0 - sigmas) * latents + sigmas * noise
            return noisy.to(dtype), timesteps, sigmas

        if contract == "sd3":
            return lambda args, latents, noise, device, dtype: build(args, latents, noise, device, dtype)
        return lambda args, noise_scheduler, latents, noise, device, dtype: build(args, latents, noise, device, dtype)


class DDPMFamily:
    """SD1.x/SDXL: integer DDPM timesteps from ``train_util.get_timesteps``, on the flow σ axis."""

    fn_name = "get_timesteps"
    name = "ddpm"

    def __init__(self, module: ModuleType):
        for symbol in (self.fn_name, "get_noise_noisy_latents_and_timesteps"):
            if not callable(getattr(module, symbol, None)):
                raise AttributeError(f"{module.__name__}.{symbol} is missing: this host revision has no σ sampler hook point")
        self.module = module

    def remember(self, sampler: BoundSampler, noise_scheduler: Any, sigmas: torch.Tensor) -> torch.Tensor:
        """Make σ the host did not draw replayable: the nearest integer timestep; returns the pool positions."""
        t = sigma_to_ddpm_t(sigmas, noise_scheduler.alphas_cumprod)
        return sampler.pool.add(t, ddpm_t_to_sigma(t, noise_scheduler.alphas_cumprod))

    def bind(self, args: Any, noise_scheduler: Any, latents: torch.Tensor, device: Any, dtype: Any) -> BoundSampler:
        pool = Pool()
        alphas = noise_scheduler.alphas_cumprod
        t_min = 0 if args.min_timestep is None else args.min_timestep
        t_max = noise_scheduler.config.num_train_timesteps if args.max_timestep is None else args.max_timestep

        def keys(t: torch.Tensor) -> torch.Tensor:
            return record_pairs(pool, t, ddpm_t_to_sigma(t, alphas))

        def first() -> torch.Tensor:
            _, _, t = self.module.get_noise_noisy_latents_and_timesteps(args, noise_scheduler, latents)
            return keys(t)

        def draw(n: int) -> torch.Tensor:
            return keys(self.module.get_timesteps(t_min, t_max, n, latents.device))

        def replay(positions: torch.Tensor):
            t = pool.pairs(positions)[0].long()
            original = self.module.get_timesteps

            def replayed(min_t: int, max_t: int, b: int, dev: Any) -> torch.Tensor:
                original(min_t, max_t, b, dev)  # advance the host's RNG as its own draw would
                return t.to(dev)

            return swap_attr(self.module, self.fn_name, replayed)

        atoms = ddpm_law(t_min, t_max, alphas)
        law = PooledLaw(replace(atoms, values=atoms.values.double()), pool)  # classified as the float64 keys _record hands the router
        return BoundSampler(first, draw, replay, pool, law)


@dataclass(frozen=True)
class HostSampler:
    """The host's own σ sampler as a ``plan`` sampler (Monte Carlo; every host mode, exact quantisation).

    Draws are cached per (n, seed) unless the mode's σ depends on the latent grid, so a run with many
    buckets pays for one sample.
    """

    family: SamplerFamily
    args: Any
    noise_scheduler: Any
    dtype: Any
    cache: dict = field(default_factory=dict, compare=False)

    has_closed_form = False

    def sample(self, n: int, latent_hw: tuple[int, int], generator: torch.Generator | None = None) -> torch.Tensor:
        seed = generator.initial_seed() if generator is not None else 0
        grid_dependent = getattr(self.args, "timestep_sampling", None) in GRID_DEPENDENT_MODES
        key = (n, seed, tuple(latent_hw) if grid_dependent else None)
        if key not in self.cache:
            with forked():  # the host's sampler draws on the CPU here; forked() also keeps random/NumPy
                seed_forked(seed)
                bound = self.family.bind(self.args, self.noise_scheduler, torch.zeros(1, 1, *latent_hw), "cpu", self.dtype)
                self.cache[key] = torch.cat([bound.draw(min(_MC_CHUNK, n - i)) for i in range(0, n, _MC_CHUNK)]).float()
        return self.cache[key]
