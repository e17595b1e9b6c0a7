"""musubi-tuner's drift self-check: what the plugin re-implements of musubi-tuner, against musubi-tuner's own
functions on a tiny fixed input (``hosts/kohya/selfcheck.py``; the inventory is docs/ARCHITECTURE.md §3).

A routed step in the flow modes is the host's own: the replay hands ``NetworkTrainer.get_noisy_model_input_and_timesteps``
the chosen σ through its own path for given timesteps (``family.given_sigmas``), so the noisy input and
timesteps = 1000·σ + 1 are the host's. What the plugin still re-implements:

- the exact σ law of each flow mode the coupled gate fills from (``family.flow_law``: the μ tables of
  ``flux_shift``, ``flux2_shift``, ``qwen_shift``, ``krea2_shift`` at two grids, the shift, the timestep range):
  its quantile at the host's own normal (or uniform) draw must be the σ the host returns;
- the ``sigma`` grid's law (``family.grid_law``): the atom at the host's own density draw must be the host's
  (timestep, σ), also with a timestep range;
- a replayed step, σ handed through the host's path or, on the scheduler grid, built by the plugin
  (σ·noise + (1 − σ)·latents in the DiT dtype): the host's own draw replayed must give the host's own
  noisy input and timesteps;
- Wan 2.2's choice of expert for a replayed σ (``family.expert_is_high``) against the trainer's own override,
  on both sides of ``timestep_boundary`` (a run training both experts only).

The checks run at ``prepare_network`` (after musubi-tuner has loaded the DiT: the trainer builds the network
after the model; on the trainer's args) and, before any model loads, in the startup check and ``check --host musubi
-- SCRIPT ...`` where the script's musubi-tuner is importable (``startup.py``: on what the script's own parser reads
from the command line).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from ...rng import seed_forked
from ..kohya.selfcheck import SEED, Piece, refuse_drift, same, settle_drift, uncallable
from .facts import BASE_TRAINER, SUPPORTED_REVISION, TRAINER_BASE, HostError, MusubiArch
from .family import MU_SHIFTS, MusubiFamily, expert_is_high, flow_law, grid_law, loop_scheduler

CHECKED_AGAINST = f"musubi-tuner {SUPPORTED_REVISION}"
DRAWS = 8
GRIDS = ((8, 8), (64, 48))  # two μ for the grid-dependent modes
LAW_MODES = ("uniform", "sigmoid", "shift", *MU_SHIFTS)
LAW_ATOL = 1e-5  # the host draws σ in float32, the law's quantile is float64
FUNCTION = f"{TRAINER_BASE}.{BASE_TRAINER}.get_noisy_model_input_and_timesteps"


# What each check fixes over the run's args (fixed values, not musubi-tuner's defaults; everything else the host's
# sampler reads is the run's own value).
FIXED = dict(
    timestep_sampling="sigmoid", discrete_flow_shift=3.1, sigmoid_scale=1.3, weighting_scheme="none", logit_mean=0.2,
    logit_std=1.1, mode_scale=1.29, min_timestep=None, max_timestep=None, preserve_distribution_shape=False,
)  # fmt: skip


def host_args(base: Any, **given: Any) -> SimpleNamespace:
    """The run's ``args`` (``base``: the trainer's, or the training script's own parser on the command line, so every
    option the host reads is there at the run's value) with the options a check fixes over them, ``given`` over those."""
    return SimpleNamespace(**{**vars(base), **FIXED, **given})


def _fixed(*shape: int) -> torch.Tensor:
    """A fixed, non-random tensor (a draw here would depend on the seed of the check)."""
    return torch.sin(torch.arange(torch.Size(shape).numel(), dtype=torch.float32) * 0.7).reshape(shape)


def _host_sigmas(family: MusubiFamily, args: Any, scheduler: Any, grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The host's (timesteps, σ) for DRAWS samples on ``grid``, from the seeded forks (latents 0, noise 1: the noisy input is σ)."""
    seed_forked(SEED)
    noisy, t = family.base(args, torch.ones(DRAWS, 1, *grid), torch.zeros(DRAWS, 1, *grid), None, scheduler, "cpu", torch.float32)
    return t.reshape(-1), noisy.reshape(DRAWS, -1)[:, 0]


def _flow_law(family: MusubiFamily, scheduler: Any, args: Any) -> Callable[[], str | None]:
    """The mode's quantile at the host's own uniform (Φ of its normal, or its uniform) against the host's σ."""
    mode = args.timestep_sampling

    def compare() -> str | None:
        for grid in GRIDS if mode in MU_SHIFTS else GRIDS[:1]:
            _, host = _host_sigmas(family, args, scheduler, grid)
            seed_forked(SEED)
            u = torch.rand(DRAWS).double() if mode == "uniform" else torch.special.ndtr(torch.randn(DRAWS).double())
            gap = same(f"σ at latent {grid[0]}x{grid[1]}", flow_law(args, grid).quantile(u), host.double(), atol=LAW_ATOL)
            if gap:
                return gap
        return None

    return compare


def _grid_law(family: MusubiFamily, scheduler: Any, args: Any) -> Callable[[], str | None]:
    """The ``sigma`` grid's atom at the host's own density draw against the host's (timestep, σ)."""

    def compare() -> str | None:
        t, sigmas = _host_sigmas(family, args, scheduler, (2, 2))
        seed_forked(SEED)
        if args.weighting_scheme == "logit_normal":
            normal = torch.normal(mean=args.logit_mean, std=args.logit_std, size=(DRAWS,)).double()
            v = torch.special.ndtr((normal - args.logit_mean) / args.logit_std)
        else:
            v = torch.rand(DRAWS).double()
        law = grid_law(args, scheduler, torch.float32)
        index = torch.searchsorted(law.probs.cumsum(0), v, right=True).clamp(max=law.values.numel() - 1)
        return same("timesteps", law.labels[index].double(), t.double()) or same("σ", law.values[index].double(), sigmas.double())

    return compare


def _replay(family: MusubiFamily, scheduler: Any, args: Any) -> Callable[[], str | None]:
    """The host's own draw, replayed through the plugin (flow: the host's path for given σ; grid: the plugin's
    rebuild), against that draw: noisy input and timesteps, bit for bit, on video-shaped latents."""
    latents = _fixed(2, 4, 3, 4, 6)
    noise = latents.flip(-1)

    def compare() -> str | None:
        seed_forked(SEED)
        host = family.base(args, noise, latents, None, scheduler, "cpu", torch.float32)
        bound = family.bind(args, scheduler, latents, "cpu", torch.float32)
        seed_forked(SEED)
        positions = torch.arange(latents.shape[0])
        bound.first()  # the same draw at the stand-ins: the pool's (timesteps, σ) are the host's own
        with bound.replay(positions):
            ours = family.trainer.get_noisy_model_input_and_timesteps(args, noise, latents, None, scheduler, "cpu", torch.float32)
        return same("noisy input", ours[0], host[0]) or same("timesteps", ours[1], host[1])

    return compare


def _expert(trainer: Any, record: MusubiArch, scheduler: Any, base: Any) -> Callable[[], str | None]:
    """Wan 2.2's override picks the expert from its first sample's timestep: the plugin's rule on that timestep, both sides."""
    flag, boundary_name = record.expert
    family = MusubiFamily(trainer, record)

    def compare() -> str | None:
        boundary = float(getattr(trainer, boundary_name))
        for u in (max(boundary - 0.01, 0.0), min(boundary + 0.01, 1.0)):
            args = host_args(base, timestep_sampling="uniform")
            stand_in = (torch.ones(1, 1, 1, 2, 2), torch.zeros(1, 1, 1, 2, 2))
            with family.kept_state():
                _, t = family.base(args, *stand_in, [u], scheduler, "cpu", torch.float32)
                trainer.get_noisy_model_input_and_timesteps(args, *stand_in, [u], scheduler, "cpu", torch.float32)
                host = bool(getattr(trainer, flag))
            if expert_is_high(t, boundary) != host:
                return f"{flag} {host} for timestep {float(t[0]):g} against boundary {boundary:g}, the plugin's rule says {not host}"
        return None

    return compare


def pieces(trainer: Any, record: MusubiArch, base: Any) -> list[Piece]:
    """The self-check of a musubi-tuner trainer's sampler on the run's args ``base`` (:func:`host_args`): its base
    class's own on a fresh instance (no run state), and Wan 2.2's expert override on ``trainer`` itself when it trains
    both experts."""
    cls = next(cls for cls in type(trainer).__mro__ if cls.__name__ == BASE_TRAINER)
    family = MusubiFamily(cls(), record)
    scheduler = loop_scheduler(family.trainer, host_args(base))
    out = [
        Piece(f"the exact σ law of timestep_sampling={mode} (family.flow_law)", FUNCTION, _flow_law(family, scheduler, host_args(base, timestep_sampling=mode)))
        for mode in LAW_MODES
    ]  # fmt: skip
    ranged = {"min_timestep": 100, "max_timestep": 900}
    out.append(
        Piece("the exact σ law with a timestep range (family.flow_law)", FUNCTION, _flow_law(family, scheduler, host_args(base, **ranged)))
    )
    out += [
        Piece(f"the sigma grid's exact law, {name} (family.grid_law)", FUNCTION, _grid_law(family, scheduler, host_args(base, timestep_sampling="sigma", **given)))
        for name, given in (("uniform density", {}), ("logit_normal density", {"weighting_scheme": "logit_normal"}), ("a timestep range", ranged))
    ]  # fmt: skip
    replays = (host_args(base), host_args(base, timestep_sampling="flux_shift", **ranged), host_args(base, timestep_sampling="sigma"))
    out += [
        Piece(f"a replayed σ's step, timestep_sampling={args.timestep_sampling} (family.MusubiFamily replay)", FUNCTION, _replay(family, scheduler, args))
        for args in replays
    ]  # fmt: skip
    if record.expert and getattr(trainer, "high_low_training", False):
        out.append(Piece("Wan 2.2's expert for a replayed σ (family.expert_is_high)", f"{type(trainer).__name__}.get_noisy_model_input_and_timesteps",
                         _expert(trainer, record, scheduler, base)))  # fmt: skip
    return out


def refuse_host_drift(trainer: Any, record: MusubiArch, args: Any, policy: str = "error") -> list[str]:
    """``start``: :func:`pieces` on the run's ``args``, settled by ``host_check`` (``policy``): HostError, or the
    findings logged and returned for the LoRA's metadata."""
    try:
        checks = pieces(trainer, record, args)
    except Exception as err:  # the fresh trainer or its loop scheduler: nothing to check on
        return settle_drift(
            [uncallable(f"{TRAINER_BASE}.{BASE_TRAINER}", "the self-check's trainer and scheduler", err, CHECKED_AGAINST)],
            policy,
            HostError,
        )
    return refuse_drift(checks, CHECKED_AGAINST, HostError, policy)


def standalone(record: MusubiArch, trainer_base: Any, base: Any) -> list[Piece]:
    """The pieces before a trainer exists (the startup check, ``check --``): on musubi-tuner's own ``NetworkTrainer``,
    with ``base`` the training script's own parser on the command line."""
    return pieces(trainer_base.NetworkTrainer(), record, base)
