"""The σ router: which grid a train step runs at, and with which per-sample σ.

Contract (usable by any trainer): ``Router.route(draw, batch_size, latent_hw, step)`` where
``draw(n)`` returns n σ drawn exactly the way the host draws them for this native latent grid,
from torch's global RNG (the router forks and seeds that RNG around every call, so the host's own
stream is never advanced). The step's first draw runs on the host's current RNG state, so it *is*
the σ the host would draw next: ``draw(batch_size)``, or ``first()`` when the host consumes RNG
before its σ draw (sd-scripts draws the noise first) and the caller reproduces that.

Gates (docs/ARCHITECTURE.md §2):

- ``coupled``: the step's category c (first eligible, span-active rule whose window holds σ, else
  native) is drawn with the host's P(c), independently of the host's batch, and identically seeded
  on every rank: with a σ *law* (``law=``, :mod:`downscale_plugin.sigma`) by one uniform u seeded
  by (seed, step) mapped through this rank's own P(c) (native first, then the rules in priority order), so
  ranks on different buckets agree as often as their P(c) allow; without one by a lead σ* drawn with
  the host's sampler under an RNG seeded by (seed, step). Each sample then keeps the host's own
  draw if it lies in c, else is redrawn on the rank's private stream, conditioned on c (bounded
  rejection: the host's own numbers); what rejection did not find is filled from c's conditional:
  the law's exact draws, or without a law the lead σ* itself (an exact draw from c's conditional
  whose value does not depend on whether rejection ran out). Marginal of σ_i: Σ_c P(c)·p(σ|c) =
  p(σ), exactly, at any batch size and window mass. At batch size 1 on one process the host draw
  itself is the step's σ and picks c (same distribution, no extra draw, every step bitwise the host's).
- ``strict``: the seed paper's rule: route to a rule iff every σ in the batch is in its window.

``RouteDecision.sources`` says, per sample, which σ the step runs: its position in the sequence of
every σ that ``first``/``draw``/``law.draw`` returned during the call, in call order (the host's
batch first). A host adapter that records each draw in that order replays every sample's own
(timestep, σ) by position, never by σ value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .arch import ArchSpec, get_arch
from .config import DownscaleConfig, RouteRule, require_gate
from .grid import rule_ratio, target_grid
from .rng import forked, seed_forked
from .sigma import SigmaLaw

SigmaDraw = Callable[[int], torch.Tensor]

_LEAD_STREAM = 0x1EAD
_PRIVATE_STREAM = 0x5EED
_LAW_STREAM = 0x1A3
_MASK64 = (1 << 64) - 1
_MAX_CANDIDATES = 256  # per rejection round; a host draw may allocate a latent-sized tensor per σ
_LAW_TRIES = 16  # law draws that round out of the category in the host's dtype are drawn again


def candidate_rounds(batch: int, max_tries: int) -> list[int]:
    """Candidates per rejection round: doubling from the batch size, capped at max(B, 256); each round is drawn whole."""
    return [min(batch << attempt, max(batch, _MAX_CANDIDATES)) for attempt in range(max_tries)]


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
    """What one train step runs: the rule (None = native), its grid, and the per-sample σ.

    ``resampled``: samples whose σ is not the host's first draw; ``filled`` of them came after
    rejection ran out, and ``fallback`` names how (``law_fill``, ``lead_fill``). ``sources``: per
    sample, the position of its σ among everything the call drew (module docstring; None: the
    host's first draw in order).
    """

    rule_index: int
    rule: RouteRule | None
    sigmas: torch.Tensor
    target_hw: tuple[int, int] | None
    resampled: int = 0
    fallback: str | None = None
    lead: float | None = None
    sources: torch.Tensor | None = None
    filled: int = 0

    @property
    def source_index(self) -> torch.Tensor:
        """Per sample, the position of its σ among the call's draws (the host's batch is 0..B−1)."""
        return self.sources if self.sources is not None else torch.arange(self.sigmas.numel())

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


class _Tally:
    """Counts the σ a route call has received, in order, to give each its ``sources`` position."""

    def __init__(self, start: int):
        self.count = start

    def take(self, n: int) -> torch.Tensor:
        out = torch.arange(self.count, self.count + n)
        self.count += n
        return out


@dataclass
class _Fill:
    """One coupled step's per-sample σ and sources while it is being filled."""

    sigmas: torch.Tensor
    sources: torch.Tensor
    missing: torch.Tensor  # positions still outside the category

    def put(self, values: torch.Tensor, sources: torch.Tensor) -> None:
        """Give the first len(values) missing positions these σ."""
        where, self.missing = self.missing[: values.numel()], self.missing[values.numel() :]
        self.sigmas[where] = values.to(self.sigmas.dtype)
        self.sources[where] = sources


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
        require_gate(gate)
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
        self._masses: tuple[SigmaLaw | None, dict[tuple[int, ...], dict[int, float]]] = (None, {})  # the last law's P(c) per active set
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
        law: SigmaLaw | None = None,
    ) -> RouteDecision:
        """Route one train step; ``law``: the host sampler's exact σ law on this grid, when it has one."""
        active = self.active(latent_hw, step)
        with forked(self.devices):
            host = (first() if first is not None else draw(batch_size)).reshape(-1)
            if not active:
                return RouteDecision(-1, None, host, None)
            if self.gate == "strict":
                return self._strict(host, active)
            return self._coupled(draw, host, active, step, rank, world_size, law)

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

    @staticmethod
    def _edges(active: Sequence[_Active]) -> list[float]:
        return [a.rule.sigma_min for a in active] + [a.rule.sigma_max for a in active if a.rule.sigma_max is not None]

    def _law_category(self, law: SigmaLaw, active: Sequence[_Active], idx: int) -> int:
        """The category of one uniform u, shared by every rank at this step, through this rank's P(c)
        laid out native first, then the rules in priority order: the same u lands in the same category wherever the
        ranks' cumulative P(c) agree."""
        masses = self._category_masses(law, active)
        generator = torch.Generator().manual_seed(_mix(self.seed, idx, _LEAD_STREAM))
        u = float(torch.rand(1, dtype=torch.float64, generator=generator))
        # Native first: the ranks disagree exactly where their cumulative odds differ, and a bucket
        # change moves the route windows' masses together (flux_shift's μ), so with native first the
        # boundaries move least: 1024² vs 1216×832 under flux_shift with the seed paper's two routes
        # disagree on 0.66 % of steps, the total-variation bound (native last: 1.17 %).
        order = [-1] + [a.index for a in active]
        total = 0.0
        for c in order:
            total += masses.get(c, 0.0)
            if u < total:
                return c
        return [c for c in order if masses.get(c, 0.0) > 0.0][-1]  # u above a sum rounded below 1

    def _category_masses(self, law: SigmaLaw, active: Sequence[_Active]) -> dict[int, float]:
        """P(c) under ``law`` for this active set, kept while the caller passes the same law object."""
        if self._masses[0] is not law:
            self._masses = (law, {})
        key = tuple(a.index for a in active)
        cache = self._masses[1]
        if key not in cache:
            cache[key] = law.masses(lambda x: self.categories(x, active), self._edges(active))
        return cache[key]

    def _coupled(
        self,
        draw: SigmaDraw,
        host: torch.Tensor,
        active: Sequence[_Active],
        step: int,
        rank: int,
        world_size: int,
        law: SigmaLaw | None,
    ) -> RouteDecision:
        cats = self.categories(host, active)
        batch = host.numel()
        if batch == 1 and world_size == 1:
            return self._decision(int(cats[0]), active, host, lead=float(host[0]))
        idx = self.resume_offset + step
        tally = _Tally(batch)
        lead = lead_source = None
        if law is not None:
            category = self._law_category(law, active, idx)
        else:
            seed_forked(_mix(self.seed, idx, _LEAD_STREAM), self.devices)
            lead = draw(1).reshape(-1)
            lead_source = tally.take(1)
            category = int(self.categories(lead, active)[0])
        lead_value = None if lead is None else float(lead[0])
        fill = _Fill(host.clone(), torch.arange(batch), (cats != category).nonzero().flatten())
        if fill.missing.numel() == 0:
            return self._decision(category, active, host, lead=lead_value)
        resampled = fill.missing.numel()
        seed_forked(_mix(self.seed, idx, rank, _PRIVATE_STREAM), self.devices)
        self._reject(draw, fill, category, active, batch, tally)
        filled, how = fill.missing.numel(), None
        if filled and law is not None:
            if not self._law_fill(law, fill, category, active, tally, _mix(self.seed, idx, rank, _LAW_STREAM)):
                return RouteDecision(-1, None, host, None, fallback="other")  # the host's own step, counted
            how = "law_fill"
        elif filled:
            fill.put(lead.expand(filled), lead_source.expand(filled))
            how = "lead_fill"
        return self._decision(
            category, active, fill.sigmas, resampled=resampled, lead=lead_value, sources=fill.sources, filled=filled, fallback=how
        )

    def _reject(self, draw: SigmaDraw, fill: _Fill, category: int, active: Sequence[_Active], batch: int, tally: _Tally) -> None:
        """Bounded rejection from the host's own sampler (the private stream is seeded by the caller)."""
        for size in candidate_rounds(batch, self.max_tries):
            cand = draw(size).reshape(-1).to(fill.sigmas.device)
            sources = tally.take(cand.numel())
            ok = (self.categories(cand, active) == category).nonzero().flatten()[: fill.missing.numel()]
            fill.put(cand[ok], sources[ok])
            if fill.missing.numel() == 0:
                return

    def _law_fill(self, law: SigmaLaw, fill: _Fill, category: int, active: Sequence[_Active], tally: _Tally, seed: int) -> bool:
        """Fill the rest from the law's conditional on a private generator; a draw that the host's
        dtype rounds out of the category is drawn again. False when ``_LAW_TRIES`` rounds all fall
        outside it (a law that is not the host's): the caller runs the host's own draws natively."""
        generator = torch.Generator().manual_seed(seed)
        classify = lambda x: self.categories(x, active)  # noqa: E731
        for _ in range(_LAW_TRIES):
            cand = law.draw(fill.missing.numel(), category, classify, self._edges(active), generator)
            cand = cand.to(device=fill.sigmas.device, dtype=fill.sigmas.dtype)
            sources = tally.take(cand.numel())
            ok = (self.categories(cand, active) == category).nonzero().flatten()
            fill.put(cand[ok], sources[ok])
            if fill.missing.numel() == 0:
                return True
        return False
