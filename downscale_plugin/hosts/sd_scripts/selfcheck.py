"""sd-scripts' drift self-check: what the plugin re-implements of sd-scripts, against sd-scripts' own
functions on a tiny fixed input (``hosts/kohya/selfcheck.py``; the inventory is docs/ARCHITECTURE.md §3).

- the routed step's noisy input (``families.FlowFamily`` replay): the host draws σ itself, so a
  replayed σ is built into ``(1 − σ)·x + σ·(n + γ·ξ)`` (SD3: ``σ·n + (1 − σ)·x``) by the plugin; it must be
  what the host's ``get_noisy_model_input_and_timesteps`` returns for the σ it drew, with ξ and γ drawn
  the same way (Flux family, Lumina, SD3);
- the coupled gate's exact fill (``families.flow_law``, ``sigma.py``): each closed-form mode's quantile,
  with ``flux_shift``'s and ``nextdit_shift``'s μ at two grids, maps the host's own normal or uniform
  draw to the σ the host returns; the ``sigma`` grid's and SD3's atoms are the host's (t, σ) at the
  index its density draw picks; ``get_timesteps`` draws the DDPM law's uniform atoms;
- SD1/SDXL's replay (``families.DDPMFamily``) reaches the host's noise path through
  ``train_util.get_timesteps``;
- the dry run's RNG use before the σ draw (``BoundSampler.first``) is the trainer's own
  ``get_noise_pred_and_target``'s (``prepare_network`` only: it needs the trainer);
- with ``positions = "interpolate"`` on Lumina, RoPE at real positions equals the host's ``RopeEmbedder``
  at integer ones (``prepare_network`` only: the option is the run's).

Everything else a step needs the host builds itself (noise, ids, masks, target, the DDPM noisy input,
the size embeddings). The checks run in ``start`` (``prepare_network``, after the models load, on the trainer's
args), in ``check -- SCRIPT ...`` and in the startup check, where the script's checkout is importable there:
before any model loads, on what the script's own ``setup_parser()`` reads from the command line (``startup.py``).
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from ...fasterdit.positions import continuous_rope
from ...rng import forked, seed_forked
from ...scope import swap_attr
from ...sigma import ddpm_alphas_cumprod, ddpm_law
from ..kohya.selfcheck import SEED, Piece, refuse_drift, same, settle_drift, uncallable
from .facts import SUPPORTED_REVISION, HostError, TrainerArch
from .families import DDPMFamily, FlowFamily, SamplerFamily, flow_law

CHECKED_AGAINST = f"sd-scripts {SUPPORTED_REVISION}"
SCHEDULER_HANDLE = ("library.sd3_train_utils", "FlowMatchEulerDiscreteScheduler")  # what every flow trainer's get_noise_scheduler builds
LUMINA_ROPE = ("library.lumina_models", "RopeEmbedder")  # NextDiT.rope_embedder's class
DRAWS = 8
GRIDS = ((32, 32), (128, 96))  # two μ for the grid-dependent modes
LAW_ATOL = 1e-5  # the host draws σ in float32, the law's quantile is float64


# What each check fixes over the run's args (everything else the host's functions read is the run's own value).
FIXED = dict(
    timestep_sampling="sigmoid", sigmoid_scale=1.0, discrete_flow_shift=3.0, weighting_scheme="uniform", logit_mean=0.0,
    logit_std=1.0, mode_scale=1.29, training_shift=1.0, min_timestep=None, max_timestep=None, ip_noise_gamma=None,
    ip_noise_gamma_random_strength=False, noise_offset=None, noise_offset_random_strength=False, adaptive_noise_scale=None,
    multires_noise_iterations=None, multires_noise_discount=0.3,
)  # fmt: skip


def host_args(base: Any, **given: Any) -> SimpleNamespace:
    """The run's ``args`` (``base``: the trainer's, or the training script's own parser on the command line, so every
    option the host reads is there at the run's value) with the options a check fixes over them, ``given`` over those."""
    return SimpleNamespace(**{**vars(base), **FIXED, **given})


def _fixed(*shape: int) -> torch.Tensor:
    """A fixed, non-random tensor (a draw here would depend on the seed of the check)."""
    n = 1
    for edge in shape:
        n *= edge
    return torch.sin(torch.arange(n, dtype=torch.float32) * 0.7).reshape(shape)


def _seeded() -> None:
    seed_forked(SEED)  # inside drift_problems' fork: both sides start from the same draws


def _slot(
    family: FlowFamily, args: Any, scheduler: Any, latents: torch.Tensor, noise: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    """What the module's σ slot returns now (the host's function, or a replay around it), on the CPU."""
    return family.call_host(getattr(family.module, family.fn_name), args, scheduler, latents, noise, "cpu", dtype)


def _rebuild(family: FlowFamily, scheduler: Any, base: Any) -> Callable[[], str | None]:
    """The replayed σ's noisy input against the host's own for the σ it drew (ξ and γ drawn alike), in float32
    and in bf16 (the weight dtype the host casts the noisy input and draws ξ in)."""
    variants = [host_args(base)]
    if family.contract != "sd3":
        variants += [host_args(base, ip_noise_gamma=0.1), host_args(base, ip_noise_gamma=0.1, ip_noise_gamma_random_strength=True)]
    latents, noise = _fixed(2, 4, 4, 6), _fixed(2, 4, 4, 6).flip(-1)

    def compare() -> str | None:
        for args in variants:
            for dtype in (torch.float32, torch.bfloat16):
                _seeded()
                host = _slot(family, args, scheduler, latents, noise, dtype)
                bound = family.bind(args, scheduler, latents, "cpu", dtype)
                bound.draw(1)  # the host's output dtypes
                positions = bound.pool.add(host[1], host[2])
                _seeded()
                with bound.replay(positions):
                    ours = _slot(family, args, scheduler, latents, noise, dtype)
                for name, a, b in zip(("noisy input", "timesteps", "σ"), ours, host, strict=True):
                    gap = same(f"{name} (ip_noise_gamma {args.ip_noise_gamma}, {dtype})", a, b)
                    if gap:
                        return gap
        return None

    return compare


def _continuous_law(family: FlowFamily, scheduler: Any, mode: str, base: Any) -> Callable[[], str | None]:
    """The mode's quantile at the host's own uniform (Φ of its normal, or its uniform) against the host's σ."""
    args = host_args(base, timestep_sampling=mode, sigmoid_scale=1.3, discrete_flow_shift=3.1)
    uniform = mode in ("uniform", "nextdit_shift")

    def compare() -> str | None:
        for grid in GRIDS if mode in ("flux_shift", "nextdit_shift") else GRIDS[:1]:
            dummy = torch.zeros(DRAWS, 1, *grid)
            _seeded()
            host = _slot(family, args, scheduler, dummy, dummy)[2]
            _seeded()
            u = torch.rand(DRAWS) if uniform else torch.special.ndtr(torch.randn(DRAWS).double())
            law = flow_law(args, family.contract, scheduler, grid, torch.float32)
            gap = same(f"σ at latent {grid[0]}x{grid[1]}", law.quantile(u.double()), host.reshape(-1), atol=LAW_ATOL)
            if gap:
                return gap
        return None

    return compare


def _atom_law(family: FlowFamily, scheduler: Any, scheme: str, base: Any) -> Callable[[], str | None]:
    """The grid law's (``sigma``; SD3's) atom at the host's own density draw against the host's (t, σ)."""
    args = host_args(base, timestep_sampling="sigma", weighting_scheme=scheme, logit_mean=0.2, logit_std=1.1, training_shift=3.0)

    def compare() -> str | None:
        dummy = torch.zeros(DRAWS, 1, 2, 2)
        _seeded()
        _, t, sigmas = _slot(family, args, scheduler, dummy, dummy)
        _seeded()
        if scheme == "logit_normal":
            v = torch.special.ndtr(
                (torch.normal(args.logit_mean, args.logit_std, size=(DRAWS,)).double() - args.logit_mean) / args.logit_std
            )
        else:
            v = torch.rand(DRAWS).double()
        law = flow_law(args, family.contract, scheduler, (2, 2), torch.float32)
        index = torch.searchsorted(law.probs.cumsum(0), v, right=True).clamp(max=law.values.numel() - 1)
        return same("timesteps", law.labels[index].double(), t.reshape(-1).double()) or same(
            "σ", law.values[index].double(), sigmas.reshape(-1).double()
        )

    return compare


def _ddpm_law(family: DDPMFamily) -> Callable[[], str | None]:
    """``get_timesteps`` against the DDPM law's uniform atoms on [t_min, t_max) (t_max alone when empty)."""

    def compare() -> str | None:
        for lo, hi in ((0, 1000), (200, 700), (500, 500)):
            _seeded()
            host = family.module.get_timesteps(lo, hi, DRAWS, "cpu")
            _seeded()
            atoms = ddpm_law(lo, hi, ddpm_alphas_cumprod()).labels
            ours = atoms[torch.randint(0, atoms.numel(), (DRAWS,))] if atoms.numel() > 1 else atoms.expand(DRAWS)
            gap = same(f"timesteps on [{lo}, {hi})", ours.long(), host.long())
            if gap:
                return gap
        return None

    return compare


class _DdpmScheduler:
    """The DDPM scheduler surface ``get_noise_noisy_latents_and_timesteps`` reads (a fixed input)."""

    config = SimpleNamespace(num_train_timesteps=1000)

    def __init__(self) -> None:
        self.alphas_cumprod = ddpm_alphas_cumprod().float()

    def add_noise(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        a = self.alphas_cumprod[timesteps].view(-1, 1, 1, 1)
        return a.sqrt() * latents + (1 - a).sqrt() * noise


def _ddpm_replay(family: DDPMFamily, scheduler: Any, base: Any) -> Callable[[], str | None]:
    """A replayed timestep reaches the host's noise path (it looks ``get_timesteps`` up as a module attribute)."""

    def compare() -> str | None:
        args, latents = host_args(base), _fixed(2, 4, 4, 4)
        bound = family.bind(args, scheduler, latents, "cpu", torch.float32)
        wanted = torch.tensor([17, 923])
        positions = bound.pool.add(wanted, torch.zeros(2))
        with bound.replay(positions):
            _, _, t = family.module.get_noise_noisy_latents_and_timesteps(args, copy.copy(scheduler), latents)
        return same("the replayed timesteps", t.long().cpu(), wanted)

    return compare


class _Reached(Exception):
    """The call reached the host's σ draw (a preamble check stops it there)."""


def _preamble(trainer: Any, family: SamplerFamily, args: Any, scheduler: Any) -> Callable[[], str | None]:
    """The dry run's RNG use up to the σ draw (``BoundSampler.first``: Flux family, Lumina, SD3 one ``randn_like``
    of the latents; SD1/SDXL the host's noise path) against the trainer's own ``get_noise_pred_and_target``,
    both stopped where the σ draw starts: the CPU generator must be in the same state there."""
    slot = "get_timesteps" if isinstance(family, DDPMFamily) else family.fn_name
    latents, cpu = _fixed(2, 4, 8, 8), SimpleNamespace(device=torch.device("cpu"))

    def state_at_draw(call: Callable[[], Any]) -> torch.Tensor | None:
        seen = []

        def stop(*_: Any, **__: Any) -> None:
            seen.append(torch.get_rng_state())
            raise _Reached

        with forked(), swap_attr(family.module, slot, stop):  # each side from the same Python random (multires noise draws it)
            _seeded()
            try:
                call()
            except _Reached:
                pass
        return seen[0] if seen else None

    def compare() -> str | None:
        host = state_at_draw(
            lambda: trainer.get_noise_pred_and_target(args, cpu, scheduler, latents, {}, [], None, None, torch.float32, True, is_train=True)
        )
        if host is None:
            return f"{type(trainer).__name__}.get_noise_pred_and_target returned without calling {family.module.__name__}.{slot}"
        ours = state_at_draw(lambda: family.bind(args, scheduler, latents, "cpu", torch.float32).first())
        return same("the CPU generator at the σ draw", ours, host)

    return compare


def pieces(family: SamplerFamily, scheduler: Any, base: Any) -> list[Piece]:
    """The self-check of one σ family (the module the trainer reaches), with ``scheduler`` as the fixed
    input of its flow modes (the trainer's own at ``prepare_network``; the host's class before) and ``base``
    the run's args (:func:`host_args`)."""
    if isinstance(family, DDPMFamily):
        name = family.module.__name__
        ddpm_scheduler = scheduler if hasattr(scheduler, "add_noise") else _DdpmScheduler()
        return [
            Piece("the DDPM law's uniform atoms (sigma.ddpm_law)", f"{name}.get_timesteps", _ddpm_law(family)),
            Piece("the routed step's timestep replay (families.DDPMFamily)", f"{name}.get_noise_noisy_latents_and_timesteps",
                  _ddpm_replay(family, ddpm_scheduler, base)),
        ]  # fmt: skip
    function = f"{family.module.__name__}.{family.fn_name}"
    out = [
        Piece("the routed step's noisy input for a replayed σ (families.FlowFamily replay)", function, _rebuild(family, scheduler, base))
    ]
    if family.contract == "sd3":
        return out + [
            Piece(f"SD3's exact σ law, {scheme} density (sigma.sd3_law)", function, _atom_law(family, scheduler, scheme, base))
            for scheme in ("uniform", "logit_normal")
        ]
    modes = ("uniform", "sigmoid", "shift", "flux_shift") + (("nextdit_shift",) if family.contract == "lumina" else ())
    out += [
        Piece(f"the exact σ law of timestep_sampling={mode} (sigma.SigmaSampler)", function, _continuous_law(family, scheduler, mode, base))
        for mode in modes
    ]
    return out + [
        Piece(f"the sigma grid's exact law, {scheme} density (sigma.grid_law)", function, _atom_law(family, scheduler, scheme, base))
        for scheme in ("uniform", "logit_normal")
    ]


def _lumina_rope() -> str | None:
    """``positions = "interpolate"`` on Lumina evaluates RoPE at real positions (``fasterdit.positions.continuous_rope``,
    from the embedder's ``theta`` and ``axes_dims``); at integer positions it must be the host embedder's table."""
    embedder = importlib.import_module(LUMINA_ROPE[0]).RopeEmbedder(theta=10000.0, axes_dims=[4, 8, 8], axes_lens=[3, 6, 7])
    ids = torch.stack(torch.meshgrid(torch.arange(3), torch.arange(6), torch.arange(7), indexing="ij"), dim=-1).reshape(1, -1, 3)
    host = embedder(ids)
    ours = continuous_rope(embedder.axes_dims, embedder.theta, embedder.freqs_cis[0].dtype)(ids.double())
    return same("RoPE factors at integer positions", torch.view_as_real(ours), torch.view_as_real(host), atol=1e-6)


def refuse_host_drift(trainer: Any, family: SamplerFamily, args: Any, interpolate: str | None = None, policy: str = "error") -> list[str]:
    """``start``: :func:`pieces` on the trainer's own scheduler and the run's ``args``, its step's RNG use before
    the σ draw, and with ``positions = "interpolate"`` (``interpolate``: the arch) Lumina's RoPE, settled by
    ``host_check`` (``policy``): HostError, or the findings logged and returned for the LoRA's metadata."""
    getter = f"{type(trainer).__name__}.get_noise_scheduler"
    try:
        scheduler = trainer.get_noise_scheduler(args, torch.device("cpu"))
    except Exception as err:  # nothing to check the flow pieces on
        return settle_drift([uncallable(getter, "the self-check's scheduler", err, CHECKED_AGAINST)], policy, HostError)
    preamble = Piece(
        "the dry run's RNG use before the σ draw (families' BoundSampler.first)",
        f"{type(trainer).__name__}.get_noise_pred_and_target",
        _preamble(trainer, family, copy.copy(args), scheduler),
    )
    rope = [Piece("RoPE at real positions (fasterdit.positions.continuous_rope)", ".".join(LUMINA_ROPE), _lumina_rope)]
    checks = [*pieces(family, scheduler, args), preamble, *(rope if interpolate == "lumina" else [])]
    return refuse_drift(checks, CHECKED_AGAINST, HostError, policy)


def standalone(record: TrainerArch, module: ModuleType, base: Any) -> list[Piece]:
    """The pieces before a trainer exists, on ``base`` (the training script's own parser on the command line):
    the host's own scheduler class (flow) or a fixed DDPM stand-in."""
    contract = record.sampler[1]
    if contract == "ddpm":
        return pieces(DDPMFamily(module), _DdpmScheduler(), base)
    scheduler_module, scheduler_class = SCHEDULER_HANDLE
    scheduler = getattr(importlib.import_module(scheduler_module), scheduler_class)(num_train_timesteps=1000, shift=3.0)
    return pieces(FlowFamily(module, contract), scheduler, base)
