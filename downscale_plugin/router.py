"""The σ router: which grid a train step runs at, and with which per-sample σ.

Contract (usable by any trainer): ``Router.route(draw, batch_size, latent_hw, step)`` where
``draw(n)`` returns n σ drawn exactly the way the host draws them for this native latent grid,
from torch's global RNG (the router forks and seeds that RNG around every call, so the host's own
stream is never advanced). The step's first draw runs on the host's current RNG state, so it *is*
the σ the host would draw next: ``draw(batch_size)``, or ``first()`` when the host consumes RNG
before its σ draw (sd-scripts draws the noise first) and the caller reproduces that.

Gates (DESIGN §1.2):

- ``coupled``: a lead σ* drawn under an RNG seeded by (seed, step), identical on every rank, picks
  the step's category (first eligible, span-active rule whose window holds σ*, else native). Each
  sample then keeps the host's own draw if it lies in that category, else is redrawn on the rank's
  private stream, conditioned on it (bounded rejection). Marginal of σ_i: Σ_c P(c)·p(σ|c) = p(σ),
  exactly, at any batch size. At batch size 1 on one process the host draw itself is the lead
  (same distribution, no extra draw, every step bitwise the host's).
- ``strict``: the seed paper's rule: route to a rule iff every σ in the batch is in its window.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .arch import ArchSpec, get_arch
from .config import DownscaleConfig, RouteRule
from .grid import rule_ratio, target_grid
from .rng import forked, seed_forked

SigmaDraw = Callable[[int], torch.Tensor]

_LEAD_STREAM = 0x1EAD
_PRIVATE_STREAM = 0x5EED
_MASK64 = (1 << 64) - 1
_MAX_CANDIDATES = 256  # per rejection round; a host draw may allocate a latent-sized tensor per σ


def _mix(*values: int) -> int:
    """SplitMix64 over the values: a well-spread 63-bit seed that is a pure function of them."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (v & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
        x ^= x >> 31
    return x >> 1


@dataclass(frozen=True)
class RouteDecision:
    """What one train step runs: the rule (None = native), its grid, and the per-sample σ."""

    rule_index: int
    rule: RouteRule | None
    sigmas: torch.Tensor
    target_hw: tuple[int, int] | None
    resampled: int = 0
    fallback: str | None = None
    lead: float | None = None

    @property
    def routed(self) -> bool:
        return self.rule is not None

    @property
    def needs_replay(self) -> bool:
        """True when the host must be fed ``sigmas`` instead of drawing its own."""
        return self.routed or self.resampled > 0


@dataclass(frozen=True)
class _Active:
    index: int
    rule: RouteRule
    target_hw: tuple[int, int]


class Router:
    """Routes train steps by σ; see the module docstring for the contract."""

    def __init__(
        self,
        rules: Sequence[RouteRule],
        arch: str | ArchSpec,
        gate: str = "coupled",
        seed: int = 0,
        total_forwards: int = 0,
        resume_offset: int = 0,
        max_tries: int = 8,
        tier_tolerance: float = 0.1,
        devices: Sequence[torch.device] = (),
    ):
        if gate not in ("coupled", "strict"):
            raise ValueError(f"gate: {gate!r} is not allowed (allowed: coupled, strict)")
        self.rules = tuple(rules)
        self.arch = arch if isinstance(arch, ArchSpec) else get_arch(arch)
        self.gate = gate
        self.seed = int(seed)
        self.total_forwards = int(total_forwards)
        self.resume_offset = int(resume_offset)
        self.max_tries = int(max_tries)
        self.tier_tolerance = float(tier_tolerance)
        self.devices = tuple(devices)
        self._eligible: dict[tuple[int, int], tuple[_Active, ...]] = {}
        if any(r.span is not None and r.span.mode != "spread" for r in self.rules) and self.total_forwards <= 0:
            raise ValueError("early/late spans need total_forwards = max_train_steps × gradient_accumulation_steps > 0")

    @classmethod
    def from_config(cls, cfg: DownscaleConfig, arch: str, seed: int, total_forwards: int, **kwargs) -> Router:
        return cls(
            cfg.routes,
            arch,
            gate=cfg.gate,
            seed=cfg.seed if cfg.seed is not None else seed,
            total_forwards=total_forwards,
            max_tries=cfg.max_tries,
            tier_tolerance=cfg.tier_tolerance,
            **kwargs,
        )

    def eligible(self, latent_hw: tuple[int, int]) -> tuple[_Active, ...]:
        """Rules that can give this bucket a valid smaller grid (cached per bucket)."""
        latent_hw = tuple(latent_hw)
        cached = self._eligible.get(latent_hw)
        if cached is None:
            found = []
            for i, rule in enumerate(self.rules):
                ratio = rule_ratio(rule, latent_hw, self.arch, self.tier_tolerance)
                target = None if ratio is None else target_grid(latent_hw, ratio, self.arch)
                if target is not None:
                    found.append(_Active(i, rule, target))
            cached = self._eligible[latent_hw] = tuple(found)
        return cached

    def active(self, latent_hw: tuple[int, int], step: int) -> tuple[_Active, ...]:
        """Eligible rules whose span is active at this step (``step`` is 1-based, this run)."""
        idx = self.resume_offset + step
        return tuple(
            a
            for a in self.eligible(latent_hw)
            if a.rule.span is None or a.rule.span.active(idx, self.total_forwards, self.seed, stream=a.index)
        )

    @staticmethod
    def categories(sigmas: torch.Tensor, active: Sequence[_Active]) -> torch.Tensor:
        """Per σ, the index of the first active rule whose window holds it, else -1 (native)."""
        cat = torch.full(sigmas.shape, -1, dtype=torch.long, device=sigmas.device)
        for a in reversed(active):
            cat[a.rule.in_window(sigmas)] = a.index
        return cat

    def route(
        self,
        draw: SigmaDraw,
        batch_size: int,
        latent_hw: tuple[int, int],
        step: int,
        rank: int = 0,
        world_size: int = 1,
        first: Callable[[], torch.Tensor] | None = None,
    ) -> RouteDecision:
        active = self.active(latent_hw, step)
        with forked(self.devices):
            host = (first() if first is not None else draw(batch_size)).reshape(-1)
            if not active:
                return RouteDecision(-1, None, host, None)
            if self.gate == "strict":
                return self._strict(host, active)
            return self._coupled(draw, host, active, step, rank, world_size)

    def _decision(self, index: int, active: Sequence[_Active], sigmas: torch.Tensor, **extra) -> RouteDecision:
        for a in active:
            if a.index == index:
                return RouteDecision(a.index, a.rule, sigmas, a.target_hw, **extra)
        return RouteDecision(-1, None, sigmas, None, **extra)

    def _strict(self, host: torch.Tensor, active: Sequence[_Active]) -> RouteDecision:
        for a in active:
            if bool(a.rule.in_window(host).all()):
                return RouteDecision(a.index, a.rule, host, a.target_hw)
        return RouteDecision(-1, None, host, None)

    def _coupled(
        self, draw: SigmaDraw, host: torch.Tensor, active: Sequence[_Active], step: int, rank: int, world_size: int
    ) -> RouteDecision:
        cats = self.categories(host, active)
        batch = host.numel()
        if batch == 1 and world_size == 1:
            return self._decision(int(cats[0]), active, host, lead=float(host[0]))
        idx = self.resume_offset + step
        seed_forked(_mix(self.seed, idx, _LEAD_STREAM), self.devices)
        lead = draw(1).reshape(-1)
        category = int(self.categories(lead, active)[0])
        missing = (cats != category).nonzero().flatten()
        if missing.numel() == 0:
            return self._decision(category, active, host, lead=float(lead[0]))
        seed_forked(_mix(self.seed, idx, rank, _PRIVATE_STREAM), self.devices)
        sigmas = host.clone()
        filled = 0
        for attempt in range(self.max_tries):
            cand = draw(min(batch << attempt, max(batch, _MAX_CANDIDATES))).reshape(-1).to(sigmas.device)
            ok = cand[self.categories(cand, active) == category]
            take = min(ok.numel(), missing.numel() - filled)
            sigmas[missing[filled : filled + take]] = ok[:take].to(sigmas.dtype)
            filled += take
            if filled == missing.numel():
                return self._decision(category, active, sigmas, resampled=filled, lead=float(lead[0]))
        return RouteDecision(-1, None, host, None, fallback="exhausted", lead=float(lead[0]))
