"""The math behind ``plan``: how often each route fires, and what that saves (docs/ARCHITECTURE.md §5).

Windows are intervals on the σ axis and the router's decisions are first-match rules over them, so
every probability is an inclusion–exclusion sum of interval masses. The masses come from the
sampler's closed-form CDF where it has one, else from a sorted Monte-Carlo sample of the sampler
itself (same strict comparisons as the router, so a discrete grid's atoms land on the right side).

- ``coupled``: the step's category c has P(c) = P(σ ∈ W_c and in no higher active window), and
  the step always runs it; when the bounded rejection runs out, the step's remaining σ are filled
  from c's conditional (the fill rate is modelled exactly, with the router's per-round cap).
- ``strict``: P(r) = P(all B σ in W_r and, for no higher active rule h, all B σ in W_h), i.e.
  Σ over subsets S of the higher rules of (−1)^|S| · mass(W_r ∩ ⋂_S W_h)^B.
- Spans: early/late are deterministic step partitions and spread coins are independent of them;
  the fraction of steps in each joint active state weights the per-state probabilities.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations, pairwise, product
from typing import Protocol

import torch

from .arch import ArchSpec, get_arch
from .config import DownscaleConfig, RouteRule, Span, require_gate
from .flops import FlopModel, predicted_saving
from .grid import eligibility, tokens
from .router import candidate_rounds
from .sigma import DiscreteLaw
from .text import ROUTE_HEADER, pct, route_rows

Window = tuple[float, float | None]  # strict (lo, hi); hi None: no upper bound


class Sampler(Protocol):
    """What ``plan`` needs of a σ sampler (:class:`~downscale_plugin.sigma.SigmaSampler`, :class:`~downscale_plugin.sigma.DdpmSampler`)."""

    @property
    def has_closed_form(self) -> bool: ...

    def sample(self, n: int, latent_hw: tuple[int, int], generator: torch.Generator | None = None) -> torch.Tensor: ...

    def mass(self, lo: float, hi: float | None, latent_hw: tuple[int, int]) -> float: ...


class _Mass:
    """Window mass for one bucket: closed form, the exact atoms of a discrete law, or a sorted
    Monte-Carlo sample of the sampler (a window of mass 1e-4 needs the exact forms: its fill rate
    is steep in the mass)."""

    def __init__(self, sampler: Sampler, latent_hw: tuple[int, int], mc_samples: int, seed: int):
        self.sampler = sampler
        self.latent_hw = latent_hw
        self.sorted: torch.Tensor | None = None
        law = sampler.law(latent_hw) if hasattr(sampler, "law") else None
        self.atoms = law if isinstance(law, DiscreteLaw) else None
        if not sampler.has_closed_form and self.atoms is None:
            gen = torch.Generator().manual_seed(seed)
            self.sorted = sampler.sample(mc_samples, latent_hw, generator=gen).reshape(-1).sort().values

    def __call__(self, window: Window) -> float:
        lo, hi = window
        if self.atoms is not None:
            values = self.atoms.values
            inside = values > lo if hi is None else (values > lo) & (values < hi)
            return float(self.atoms.probs[inside].sum())
        if self.sorted is None:
            return self.sampler.mass(lo, hi, self.latent_hw)
        s = self.sorted
        above = s.numel() - int(torch.searchsorted(s, torch.tensor([lo], dtype=s.dtype), right=True))
        at_or_above_hi = 0 if hi is None else s.numel() - int(torch.searchsorted(s, torch.tensor([hi], dtype=s.dtype), right=False))
        return max(0, above - at_or_above_hi) / s.numel()


def _intersect(rules: Sequence[RouteRule]) -> Window | None:
    lo = max(r.sigma_min for r in rules)
    tops = [r.sigma_max for r in rules if r.sigma_max is not None]
    hi = min(tops) if tops else None
    return None if hi is not None and hi <= lo else (lo, hi)


def _first_match(rule: RouteRule, higher: Sequence[RouteRule], mass: _Mass, power: int) -> float:
    """Σ_S (−1)^|S| mass(W_rule ∩ ⋂_S W)^power over subsets S of ``higher``."""
    total = 0.0
    for k in range(len(higher) + 1):
        for subset in combinations(higher, k):
            window = _intersect((rule, *subset))
            if window is not None:
                total += (-1) ** k * mass(window) ** power
    return min(max(total, 0.0), 1.0)


def _log_binom_pmf(k: int, n: int, p: float) -> float:
    if p <= 0.0:
        return 0.0 if k == 0 else -math.inf
    if p >= 1.0:
        return 0.0 if k == n else -math.inf
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p) + (n - k) * math.log1p(-p)


def exhaustion_probability(q: float, batch_size: int, max_tries: int) -> float:
    """P(the coupled gate's rejection runs out) for a category of mass q.

    The m ~ Bin(B, 1 − q) host σ outside the category are redrawn from the rounds' candidates
    (:func:`~downscale_plugin.router.candidate_rounds`: each round is drawn whole, so N candidates
    in all); rejection runs out when fewer than m of the N land in the category.
    """
    candidates = sum(candidate_rounds(batch_size, max_tries))
    total = 0.0
    for m in range(1, batch_size + 1):
        p_m = math.exp(_log_binom_pmf(m, batch_size, 1.0 - q))
        if p_m > 0.0:
            total += p_m * sum(math.exp(_log_binom_pmf(k, candidates, q)) for k in range(m))
    return min(total, 1.0)


def _state_odds(
    active: Sequence[tuple[int, RouteRule]], mass: _Mass, gate: str, batch_size: int, max_tries: int, world_size: int
) -> tuple[dict[int, float], float]:
    """Route probabilities and fill probability for one fixed set of active rules.

    A coupled step whose rejection runs out still runs its category (the rest of its σ are filled
    from the category's conditional), so the fill rate does not move the route probabilities.
    """
    rules = [r for _, r in active]
    power = batch_size if gate == "strict" else 1
    probs = {i: _first_match(r, rules[:k], mass, power) for k, (i, r) in enumerate(active)}
    probs[-1] = max(0.0, 1.0 - sum(probs.values()))
    fill = 0.0
    if gate == "coupled" and (batch_size > 1 or world_size > 1):
        fill = sum(p * exhaustion_probability(p, batch_size, max_tries) for p in probs.values())
    return probs, fill


def span_states(rules: Sequence[RouteRule], total_forwards: int = 0) -> dict[frozenset[int], float]:
    """Fraction of train forwards in each joint state: the set of spanned rules that are active.

    early/late spans are step intervals (exact at ``total_forwards``, in fractions when it is 0);
    spread spans are independent coins. Rules without a span are not listed (always active).
    """
    fixed = [(i, r.span) for i, r in enumerate(rules) if r.span is not None and r.span.mode != "spread"]
    coins = [(i, r.span.frac) for i, r in enumerate(rules) if r.span is not None and r.span.mode == "spread"]
    length = float(total_forwards) if total_forwards > 0 else 1.0
    spans = {i: _interval(span, total_forwards) for i, span in fixed}
    cuts = sorted({0.0, length, *(x for iv in spans.values() for x in iv)})
    states: dict[frozenset[int], float] = {}
    for x0, x1 in pairwise(cuts):
        on = frozenset(i for i, (a, b) in spans.items() if a <= x0 and x1 <= b)
        for heads in product((True, False), repeat=len(coins)):
            p = math.prod(f if h else 1.0 - f for (_, f), h in zip(coins, heads, strict=True))
            key = on | frozenset(i for (i, _), h in zip(coins, heads, strict=True) if h)
            states[key] = states.get(key, 0.0) + (x1 - x0) / length * p
    return states


def _interval(span: Span, total: int) -> tuple[float, float]:
    """[start, end) of the forwards where an early/late span is active (fractions when total is 0)."""
    if total <= 0:
        return (0.0, span.frac) if span.mode == "early" else (1.0 - span.frac, 1.0)
    # Count active forwards by bisection on Span.active (monotone in the index), not by re-deriving its rounding.
    lo, hi = 0, total  # early: the last active index; late: the last inactive one
    want = span.mode == "early"
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if span.active(mid, total, 0) == want:
            lo = mid
        else:
            hi = mid - 1
    return (0.0, float(lo)) if want else (float(lo), float(total))


def _eligible(rules: Sequence[RouteRule], latent_hw: tuple[int, int], arch: ArchSpec, tier_tolerance: float) -> list[tuple[int, RouteRule]]:
    return [(i, r) for i, r in enumerate(rules) if eligibility(latent_hw, i, r, arch, tier_tolerance).eligible]


def _route_odds(
    rules: Sequence[RouteRule],
    sampler: Sampler,
    latent_hw: tuple[int, int],
    arch: ArchSpec,
    tier_tolerance: float,
    gate: str,
    batch_size: int,
    states: Mapping[frozenset[int], float],
    mc_samples: int,
    seed: int,
    max_tries: int,
    world_size: int,
) -> tuple[dict[int, float], float]:
    eligible = _eligible(rules, latent_hw, arch, tier_tolerance)
    probs = {i: 0.0 for i, _ in eligible} | {-1: 0.0}
    if not eligible:
        probs[-1] = 1.0
        return probs, 0.0
    mass = _Mass(sampler, latent_hw, mc_samples, seed)
    fallback = 0.0
    memo: dict[tuple[int, ...], tuple[dict[int, float], float]] = {}
    for state, weight in states.items():
        active = tuple((i, r) for i, r in eligible if r.span is None or i in state)
        key = tuple(i for i, _ in active)
        if key not in memo:
            memo[key] = _state_odds(active, mass, gate, batch_size, max_tries, world_size) if active else ({-1: 1.0}, 0.0)
        odds, lost = memo[key]
        for i, p in odds.items():
            probs[i] += weight * p
        fallback += weight * lost
    return probs, fallback


def route_probabilities(
    rules: Sequence[RouteRule],
    sampler: Sampler,
    latent_hw: tuple[int, int],
    arch: str | ArchSpec,
    tier_tolerance: float = 0.1,
    gate: str = "coupled",
    batch_size: int = 1,
    spans_active_fraction: Mapping[frozenset[int], float] | None = None,
    mc_samples: int = 200_000,
    seed: int = 0,
    *,
    total_forwards: int = 0,
    max_tries: int = 8,
    world_size: int = 1,
) -> dict[int, float]:
    """Per rule index (−1 = native) the probability that a step of this bucket runs it.

    ``spans_active_fraction`` maps each joint state of the spanned rules (the set active) to its
    fraction of steps; by default :func:`span_states` of the rules at ``total_forwards``. A coupled
    step runs its category whether or not its rejection ran out (``max_tries`` moves only the fill rate).
    """
    require_gate(gate)
    spec = arch if isinstance(arch, ArchSpec) else get_arch(arch)
    states = spans_active_fraction if spans_active_fraction is not None else span_states(rules, total_forwards)
    probs, _ = _route_odds(
        rules, sampler, latent_hw, spec, tier_tolerance, gate, batch_size, states, mc_samples, seed, max_tries, world_size
    )
    return probs


def route_histogram(probs: Mapping[int, float], route_tokens: Mapping[int, int], weight: float = 1.0) -> dict[int, float]:
    """Per-route probabilities (rule index, −1 native) × the tokens each route runs → a token histogram."""
    hist: dict[int, float] = {}
    for index, p in probs.items():
        if p > 0:
            n = route_tokens[index]
            hist[n] = hist.get(n, 0.0) + weight * p
    return hist


@dataclass(frozen=True)
class BucketPlan:
    """One bucket's row of the plan."""

    latent_hw: tuple[int, int]
    weight: float
    targets: dict[int, tuple[int, int]]  # eligible rule → target latent (h, w)
    reasons: dict[int, str]  # ineligible rule → why
    probs: dict[int, float]  # rule index (−1 native) → step probability
    fallback: float  # probability a coupled step's rejection runs out and fills its remaining σ
    tokens: dict[int, int]  # rule index (−1 native) → image tokens per sample
    token_saving: float
    flop_saving: float

    @property
    def routed(self) -> float:
        return 1.0 - self.probs[-1]


@dataclass(frozen=True)
class Plan:
    """The whole plan: per-bucket rows and their weighted totals."""

    rules: tuple[RouteRule, ...]
    arch: ArchSpec
    gate: str
    batch_size: int
    flop_model: FlopModel
    buckets: list[BucketPlan]
    probs: dict[int, float]
    fallback: float
    token_saving: float
    flop_saving: float
    never_routing: list[tuple[int, int]] = field(default_factory=list)


def plan_table(
    cfg: DownscaleConfig,
    arch: str | ArchSpec,
    sampler: Sampler,
    buckets: Sequence[tuple[int, int]],
    batch_size: int = 1,
    weights: Sequence[float] | None = None,
    *,
    flop_model: FlopModel | None = None,
    total_forwards: int = 0,
    mc_samples: int = 200_000,
    seed: int = 0,
    world_size: int = 1,
) -> Plan:
    """Route probabilities and savings per latent bucket (h, w), and overall.

    ``weights`` are the buckets' shares of steps (default equal). Savings compare each bucket's
    expected per-sample cost with its native cost; overall figures pool them by weight.
    """
    spec = arch if isinstance(arch, ArchSpec) else get_arch(arch)
    model = flop_model if flop_model is not None else spec.flops
    if model is None:
        raise ValueError(f"plan_table: arch {spec.name!r} has no FLOP model; pass flop_model=")
    weights = list(weights) if weights is not None else [1.0] * len(buckets)
    if len(weights) != len(buckets) or not buckets or sum(weights) <= 0:
        raise ValueError("plan_table: need at least one bucket and one non-negative weight per bucket, not all zero")
    norm = [w / sum(weights) for w in weights]
    states = span_states(cfg.routes, total_forwards)
    rows: list[BucketPlan] = []
    hist_run: dict[int, float] = {}
    hist_native: dict[int, float] = {}
    for hw, w in zip(buckets, norm, strict=True):
        hw = (int(hw[0]), int(hw[1]))
        cells = [eligibility(hw, i, r, spec, cfg.tier_tolerance) for i, r in enumerate(cfg.routes)]
        probs, fallback = _route_odds(
            cfg.routes, sampler, hw, spec, cfg.tier_tolerance, cfg.gate, batch_size, states, mc_samples, seed, cfg.max_tries, world_size
        )
        route_tokens = {-1: tokens(hw, spec)} | {c.rule_index: tokens(c.target_hw, spec) for c in cells if c.eligible}
        run = route_histogram(probs, route_tokens)
        native = {route_tokens[-1]: 1.0}
        rows.append(
            BucketPlan(
                latent_hw=hw,
                weight=w,
                targets={c.rule_index: c.target_hw for c in cells if c.eligible},
                reasons={c.rule_index: c.reason for c in cells if not c.eligible},
                probs=probs,
                fallback=fallback,
                tokens=route_tokens,
                token_saving=predicted_saving(run, native),
                flop_saving=predicted_saving(run, native, model),
            )
        )
        for n_tok, c in run.items():
            hist_run[n_tok] = hist_run.get(n_tok, 0.0) + w * c
        hist_native[route_tokens[-1]] = hist_native.get(route_tokens[-1], 0.0) + w
    overall = {i: sum(row.weight * row.probs.get(i, 0.0) for row in rows) for i in [*range(len(cfg.routes)), -1]}
    return Plan(
        rules=tuple(cfg.routes),
        arch=spec,
        gate=cfg.gate,
        batch_size=batch_size,
        flop_model=model,
        buckets=rows,
        probs=overall,
        fallback=sum(row.weight * row.fallback for row in rows),
        token_saving=predicted_saving(hist_run, hist_native),
        flop_saving=predicted_saving(hist_run, hist_native, model),
        never_routing=[row.latent_hw for row in rows if row.routed <= 1e-12],
    )


def _px(hw: tuple[int, int], arch: ArchSpec) -> str:
    return f"{hw[1] * arch.vae_factor}x{hw[0] * arch.vae_factor}"


def format_plan(plan: Plan, sampler_text: str = "") -> str:
    """The console table ``python -m downscale_plugin plan`` prints."""
    arch = plan.arch
    labels = [f"r{i} {r.label}" for i, r in enumerate(plan.rules)]
    lines = [
        f"router: gate {plan.gate}, batch size {plan.batch_size}, arch {arch.name}"
        + (f", σ sampler {sampler_text}" if sampler_text else "")
    ]
    lines.append(f"  {ROUTE_HEADER}{'fires':>9}")
    lines += [f"  {row}{pct(plan.probs[i]):>9}" for i, row in enumerate(route_rows(plan.rules))]
    lines.append(f"  {'native':<46}{pct(plan.probs[-1]):>9}")
    if plan.fallback >= 5e-4:
        lines.append(
            f"  ({pct(plan.fallback)} of steps run out of rejection rounds and fill their remaining σ from the category's conditional; the σ marginal stays exact)"
        )
    lines.append("")
    lines.append("per bucket (pixels W x H, latent h x w, image tokens; per route: target latent and probability):")
    width = max([20, *(len(s) + 2 for s in labels)])  # no routes (direction loss alone): the header width
    header = f"  {'bucket':<11}{'latent':<10}{'tokens':>7}  " + "".join(f"{s:<{width}}" for s in labels)
    lines.append(header + f"{'native':>8}{'tokens saved':>14}{'FLOPs saved':>13}")
    for row in plan.buckets:
        cells = ""
        for i in range(len(plan.rules)):
            t = row.targets.get(i)
            cells += f"{(f'{t[0]}x{t[1]} {pct(row.probs[i])}' if t else '-'):<{width}}"
        lines.append(
            f"  {_px(row.latent_hw, arch):<11}{f'{row.latent_hw[0]}x{row.latent_hw[1]}':<10}{row.tokens[-1]:>7}  {cells}"
            f"{pct(row.probs[-1]):>8}{pct(row.token_saving):>14}{pct(row.flop_saving):>13}"
        )
    lines.append("")
    lines.append(
        f"overall ({len(plan.buckets)} buckets, weighted): routed {pct(1.0 - plan.probs[-1])} of steps, "
        f"tokens saved {pct(plan.token_saving)}, FLOPs saved {pct(plan.flop_saving)}"
    )
    if plan.never_routing:
        lines.append(f"never routing ({len(plan.never_routing)}): " + ", ".join(_px(hw, arch) for hw in plan.never_routing))
    return "\n".join(lines)
