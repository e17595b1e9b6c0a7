"""σ router: priority, spans, eligibility, the coupled gate's exact marginal, the strict gate's p^B, ranks, RNG hygiene."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from gloo_ranks import join_group, spawn_ranks
from scipy import stats
from selected_cases import run_selected_cases

from downscale_plugin.config import DownscaleConfig, RouteRule, Span, parse_span
from downscale_plugin.router import Router, candidate_rounds
from downscale_plugin.sigma import SigmaSampler

HW = (128, 128)  # Flux latent of a 1024² bucket: in the 1024 tier, eligible for every rule below
SMALL_HW = (96, 96)  # 768² bucket: not in the 1024 tier
DEEP = RouteRule(0.65, 0.95, native=1024, target=768)  # → (96, 96)
SHALLOW = RouteRule(0.5, None, native=1024, target=896)  # → (112, 112); no upper bound, σ = 1 included
STACK = (DEEP, SHALLOW)

SAMPLERS = {
    "uniform": SigmaSampler("uniform"),
    "sigmoid": SigmaSampler("sigmoid"),
    "shift": SigmaSampler("shift", discrete_flow_shift=3.0),
    "flux_shift": SigmaSampler("flux_shift"),
}


def host_draw(sampler: SigmaSampler, hw=HW):
    """Like the host: σ from torch's global default generator, computed for the native grid."""
    return lambda n: sampler.sample(n, hw)


def fixed_draw(sigma: float, dtype=torch.float32):
    return lambda n: torch.full((n,), sigma, dtype=dtype)


def categories(sigmas: torch.Tensor, rules) -> torch.Tensor:
    """Per σ, the index of the first of `rules` (all active) whose window holds it, else −1."""
    cat = torch.full(sigmas.shape, -1)
    for i in reversed(range(len(rules))):
        cat[rules[i].in_window(sigmas)] = i
    return cat


def in_category(sigmas: torch.Tensor, index: int, rules) -> torch.Tensor:
    return categories(sigmas, rules) == index


# --- case tables at B = 1 (the host's σ is the decision's σ) -------------------------------------

OPEN_TOP = RouteRule(0.5, 1.0, native=1024, target=896)  # strict upper bound at 1: σ = 1 excluded

PRIORITY_CASES = [
    # id, rules, σ, expected rule index (−1 native)
    ("deep-middle", STACK, 0.8, 0),
    ("deep-low-edge-inside", STACK, 0.66, 0),
    ("deep-high-edge-inside", STACK, 0.94, 0),
    ("below-deep-above-shallow", STACK, 0.55, 1),
    ("above-deep", STACK, 0.97, 1),
    ("sigma-one-no-upper-bound", STACK, 1.0, 1),
    ("sigma-one-strict-upper-bound", (DEEP, OPEN_TOP), 1.0, -1),
    ("just-below-one-strict-upper-bound", (DEEP, OPEN_TOP), 0.99, 1),
    ("boundary-0.65-not-in-deep", STACK, 0.65, 1),
    ("boundary-0.95-not-in-deep", STACK, 0.95, 1),
    ("boundary-0.5-native", STACK, 0.5, -1),
    ("below-all-native", STACK, 0.3, -1),
    ("sigma-zero-native", STACK, 0.0, -1),
    ("boundary-0.65-alone", (DEEP,), 0.65, -1),
    ("boundary-0.95-alone", (DEEP,), 0.95, -1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("rules", "sigma", "expected"), [c[1:] for c in PRIORITY_CASES], ids=[c[0] for c in PRIORITY_CASES])
def test_priority_between_stacked_rules(rules, sigma, expected, dtype):
    # windows compare at the σ tensor's own precision: float32/bf16 0.95 is the edge, not just below it
    router = Router(rules, "flux")
    decision = router.route(fixed_draw(sigma, dtype), 1, HW, step=1)
    assert decision.rule_index == expected
    assert decision.routed == (expected >= 0)
    assert decision.rule is (rules[expected] if expected >= 0 else None)
    assert decision.target_hw == {0: (96, 96), 1: (112, 112), -1: None}[expected]
    assert decision.sigmas.dtype == dtype and decision.sigmas.tolist() == [float(torch.tensor(sigma, dtype=dtype))]


SCALE_LOW = RouteRule(0.2, 0.6, scale=0.5)

SPAN_CASES = [
    # id, rules, arch, latent hw, σ, step (of T = 100), expected
    ("early-span-active", (RouteRule(0.65, 0.95, 1024, 768, span=Span("early", 0.5)), SHALLOW), "flux", HW, 0.8, 50, 0),
    ("early-span-over-falls-through", (RouteRule(0.65, 0.95, 1024, 768, span=Span("early", 0.5)), SHALLOW), "flux", HW, 0.8, 51, 1),
    ("late-span-not-yet-falls-through", (RouteRule(0.65, 0.95, 1024, 768, span=Span("late", 0.5)), SHALLOW), "flux", HW, 0.8, 10, 1),
    ("late-span-active", (RouteRule(0.65, 0.95, 1024, 768, span=Span("late", 0.5)), SHALLOW), "flux", HW, 0.8, 51, 0),
    ("late-span-other-rule-window", (RouteRule(0.65, 0.95, 1024, 768, span=Span("late", 0.5)), SHALLOW), "flux", HW, 0.55, 90, 1),
    ("both-spans-inactive-native", (RouteRule(0.65, 0.95, 1024, 768, span=Span("late", 0.2)), SHALLOW), "flux", HW, 0.3, 10, -1),
    ("bucket-not-in-tier-native", STACK, "flux", SMALL_HW, 0.8, 1, -1),
    ("bucket-not-in-tier-falls-to-scale", (DEEP, SCALE_LOW), "flux", SMALL_HW, 0.55, 1, 1),
    ("bucket-not-in-tier-outside-scale", (DEEP, SCALE_LOW), "flux", SMALL_HW, 0.8, 1, -1),
    ("ineligible-bucket-sdxl-4x4", (RouteRule(0.2, None, scale=0.75),), "sdxl", (4, 4), 0.8, 1, -1),
    ("ineligible-bucket-falls-through", (RouteRule(0.2, 0.9, scale=0.875), RouteRule(0.2, None, scale=0.5)), "sdxl", (8, 8), 0.8, 1, 1),
    ("eligible-same-rule-larger-bucket", (RouteRule(0.2, 0.9, scale=0.875), RouteRule(0.2, None, scale=0.5)), "sdxl", (32, 32), 0.8, 1, 0),
]


@pytest.mark.parametrize(("rules", "arch", "hw", "sigma", "step", "expected"), [c[1:] for c in SPAN_CASES], ids=[c[0] for c in SPAN_CASES])
def test_spans_tiers_and_eligibility(rules, arch, hw, sigma, step, expected):
    router = Router(rules, arch, total_forwards=100)
    decision = router.route(fixed_draw(sigma), 1, hw, step=step)
    assert decision.rule_index == expected
    assert decision.sigmas.tolist() == [pytest.approx(sigma)]


def test_spans_need_total_forwards():
    with pytest.raises(ValueError, match="total_forwards"):
        Router((RouteRule(0.5, None, scale=0.5, span=Span("late", 0.5)),), "flux")
    Router((RouteRule(0.5, None, scale=0.5, span=Span("spread", 0.5)),), "flux")  # spread needs no T


def test_from_config():
    cfg = DownscaleConfig(gate="strict", routes=STACK, max_tries=3, tier_tolerance=0.2)
    router = Router.from_config(cfg, "flux", seed=7, total_forwards=10)
    assert (router.gate, router.seed, router.max_tries, router.tier_tolerance, router.rules) == ("strict", 7, 3, 0.2, STACK)
    assert Router.from_config(DownscaleConfig(routes=STACK, seed=5), "flux", seed=7, total_forwards=10).seed == 5


# --- spans --------------------------------------------------------------------------------------

FRACTIONS = [0.1, 0.15, 0.25, 0.3, 1 / 3, 0.5, 0.7, 0.75, 0.85, 0.9, 0.95]
TOTALS = [1, 2, 3, 5, 7, 10, 15, 20, 33, 100, 101, 999, 1000]


@pytest.mark.parametrize("frac", FRACTIONS, ids=lambda f: f"f{f:.3g}")
def test_early_and_late_complement_partition_exactly(frac):
    early = Span("early", frac)
    lates = [Span("late", 1 - frac), parse_span(f"late:{1 - frac:.12g}")]
    for total in TOTALS:
        fired = [early.active(i, total, seed=0) for i in range(1, total + 1)]
        count = sum(fired)
        assert fired == [True] * count + [False] * (total - count), (frac, total)  # a prefix
        assert abs(count - frac * total) <= 0.5 + 1e-9, (frac, total, count)
        for late in lates:
            assert all(late.active(i, total, seed=0) != e for i, e in zip(range(1, total + 1), fired, strict=True)), (frac, total, late)


@pytest.mark.parametrize(
    ("frac", "total", "early_count"),
    [
        pytest.param(0.5, 7, 4, id="half-of-7"),
        pytest.param(0.3, 5, 2, id="0.3-of-5-is-1.5"),
        pytest.param(0.7, 5, 4, id="0.7-of-5-is-3.5"),
        pytest.param(0.15, 10, 2, id="0.15-of-10-is-1.5"),
        pytest.param(0.25, 2, 1, id="0.25-of-2-is-0.5"),
        pytest.param(0.1, 15, 2, id="0.1-of-15-is-1.5"),
    ],
)
def test_half_integer_cuts(frac, total, early_count):
    assert sum(Span("early", frac).active(i, total, 0) for i in range(1, total + 1)) == early_count
    assert sum(Span("late", 1 - frac).active(i, total, 0) for i in range(1, total + 1)) == total - early_count


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_spread_is_pure_and_has_frequency_p(p):
    span = Span("spread", p)
    n = 20_000
    python_state = random.getstate()
    torch_state = torch.get_rng_state()
    coins = [span.active(i, 0, seed=11) for i in range(1, n + 1)]
    assert random.getstate() == python_state and torch.equal(torch.get_rng_state(), torch_state)
    assert coins[::-1] == [Span("spread", p).active(i, 12345, seed=11) for i in range(n, 0, -1)]  # order, T irrelevant
    assert abs(sum(coins) / n - p) < 4 * math.sqrt(p * (1 - p) / n)
    other = [span.active(i, 0, seed=12) for i in range(1, n + 1)]
    assert coins != other


def test_spread_rule_in_router_is_pure_function_of_seed_and_step():
    rules = (RouteRule(0.65, 0.95, 1024, 768, span=Span("spread", 0.3)), SHALLOW)
    a, b = Router(rules, "flux", seed=3), Router(rules, "flux", seed=3)
    steps = list(range(1, 401))
    forward = [a.route(fixed_draw(0.8), 1, HW, s).rule_index for s in steps]
    backward = [b.route(fixed_draw(0.8), 1, HW, s).rule_index for s in reversed(steps)][::-1]
    assert forward == backward
    assert forward == [0 if Span("spread", 0.3).active(s, 0, 3) else 1 for s in steps]
    assert 0.2 < forward.count(0) / len(steps) < 0.4


def test_two_spread_rules_flip_independent_coins():
    # Overlapping windows, both spread:0.5: σ = 0.8 goes to rule 0 when its coin is up, else to rule 1
    # when its own coin is up, else native — a shared coin would never give rule 1 or "both down".
    rules = (
        RouteRule(0.65, 0.95, scale=0.75, span=Span("spread", 0.5)),
        RouteRule(0.5, None, scale=0.875, span=Span("spread", 0.5)),
    )
    router = Router(rules, "flux", seed=5)
    picks = [router.route(fixed_draw(0.8), 1, HW, s).rule_index for s in range(1, 4001)]
    for rule_index, p in ((0, 0.5), (1, 0.25), (-1, 0.25)):
        assert abs(picks.count(rule_index) / len(picks) - p) < 4 * math.sqrt(p * (1 - p) / len(picks))


def test_resume_offset_shifts_spans_and_lead():
    rules = (RouteRule(0.65, 0.95, 1024, 768, span=Span("early", 0.5)), SHALLOW)
    fresh = Router(rules, "flux", seed=9, total_forwards=200)
    resumed = Router(rules, "flux", seed=9, total_forwards=200, resume_offset=80)
    draw = host_draw(SAMPLERS["sigmoid"])
    torch.manual_seed(0)
    for step in range(1, 41):
        state = torch.get_rng_state()
        a = fresh.route(draw, 4, HW, 80 + step)
        torch.set_rng_state(state)
        b = resumed.route(draw, 4, HW, step)
        assert (a.rule_index, a.lead) == (b.rule_index, b.lead)
        assert torch.equal(a.sigmas, b.sigmas)
        draw(4)
    # forward 101 of 200 is past early:0.5 → the deep rule is off after resuming at 80 + 21
    assert [a.index for a in resumed.active(HW, 20)] == [0, 1]
    assert [a.index for a in resumed.active(HW, 21)] == [1]


# --- RNG hygiene and the B = 1 fast path ---------------------------------------------------------

HYGIENE = [
    pytest.param("coupled", 1, 1, STACK, id="coupled-B1"),
    pytest.param("coupled", 1, 2, STACK, id="coupled-B1-two-ranks"),
    pytest.param("coupled", 8, 1, STACK, id="coupled-B8"),
    pytest.param("strict", 8, 1, STACK, id="strict-B8"),
    pytest.param("coupled", 8, 1, (RouteRule(0.2, 0.3, 512, 256),), id="no-rule-eligible"),
    pytest.param("coupled", 8, 1, (RouteRule(0.2, 0.3, 1024, 768, span=Span("late", 0.1)),), id="span-inactive"),
]


@pytest.mark.parametrize(("gate", "batch", "world_size", "rules"), HYGIENE)
def test_router_never_advances_global_rng(gate, batch, world_size, rules):
    router = Router(rules, "flux", gate=gate, seed=1, total_forwards=100)
    draw = host_draw(SAMPLERS["sigmoid"])
    torch.manual_seed(123)
    resampled = 0
    for step in range(1, 61):
        before = torch.get_rng_state()
        python_before = random.getstate()
        decision = router.route(draw, batch, HW, step, rank=1, world_size=world_size)
        assert torch.equal(torch.get_rng_state(), before)
        assert random.getstate() == python_before
        resampled += decision.resampled
        host = draw(batch)  # the host's own draw, from the same state
        if decision.resampled == 0 and decision.fallback is None:
            assert torch.equal(decision.sigmas, host)
    if gate == "coupled" and batch > 1 and len(rules) > 1:
        assert resampled > 0  # the replay path was exercised


@pytest.mark.parametrize("mode", sorted(SAMPLERS))
def test_batch_one_single_process_is_the_host_draw(mode):
    router = Router(STACK, "flux", seed=4)
    draw = host_draw(SAMPLERS[mode])
    torch.manual_seed(5)
    seen = set()
    for step in range(1, 301):
        decision = router.route(draw, 1, HW, step)
        host = draw(1)
        assert torch.equal(decision.sigmas, host)
        assert decision.resampled == 0 and decision.lead == float(host[0])
        assert bool(in_category(host, decision.rule_index, STACK)[0])
        seen.add(decision.rule_index)
    assert seen == {-1, 0, 1}


def _tiny_window_around_the_lead(draw, batch=4):
    """A window of mass 2e-6 around step 1's lead σ: the step's category, which the host's batch and
    short rejection rounds cannot fill."""
    probe = Router((RouteRule(0.0, None, scale=0.5),), "flux", seed=21)
    torch.manual_seed(0)
    lead = probe.route(draw, batch, HW, step=1).lead
    return lead, RouteRule(lead - 1e-6, lead + 1e-6, scale=0.5)


class Recorder:
    """A host draw that keeps every σ it returns, in order: what ``RouteDecision.sources`` indexes."""

    def __init__(self, sampler: SigmaSampler, hw=HW):
        self.sampler, self.hw, self.seen = sampler, hw, []

    def __call__(self, n: int) -> torch.Tensor:
        self.seen.append(self.sampler.sample(n, self.hw))
        return self.seen[-1]

    def pool(self) -> torch.Tensor:
        return torch.cat(self.seen)


def test_exhaustion_without_a_law_fills_with_the_lead_and_still_routes():
    draw = host_draw(SAMPLERS["uniform"])
    lead, tiny = _tiny_window_around_the_lead(draw)
    router = Router((tiny,), "flux", seed=21, max_tries=1)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    recorder = Recorder(SAMPLERS["uniform"])
    decision = router.route(recorder, 4, HW, step=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert decision.lead == lead and bool(tiny.in_window(torch.tensor([lead])))
    assert decision.rule is tiny and decision.routed and decision.needs_replay  # the category runs: no fallback to native
    assert decision.fallback == "lead_fill" and decision.filled == 4 and decision.resampled == 4
    assert decision.sigmas.tolist() == [pytest.approx(lead)] * 4
    assert decision.sources.tolist() == [4] * 4  # the lead is the σ drawn right after the host's batch
    assert torch.equal(recorder.pool()[decision.sources], decision.sigmas)


def test_exhaustion_with_a_law_fills_from_the_exact_conditional():
    # window mass 1e-3 and one round of 4 candidates: a routed step almost never finds its σ by rejection
    top = RouteRule(0.999, None, scale=0.5)
    router = Router((top,), "flux", seed=21, max_tries=1)
    law = SAMPLERS["uniform"].law(HW)
    torch.manual_seed(0)
    recorder = Recorder(SAMPLERS["uniform"])
    decision = next(d for d in (router.route(recorder, 4, HW, step, law=law) for step in range(1, 20_001)) if d.routed)
    assert decision.fallback == "law_fill" and decision.filled >= 3 and decision.lead is None
    assert bool(top.in_window(decision.sigmas).all()) and decision.sigmas.unique().numel() == 4
    assert decision.sources.max() >= 4 + 4  # law draws come after the host's batch and the round of 4 (no lead with a law)


def test_a_law_that_is_not_the_hosts_runs_the_hosts_own_step_natively():
    """A law whose conditional draws never land in the chosen category (here: a law for another
    window) cannot fill the step: it runs the host's own σ natively, counted as ``other``, instead
    of stopping the run."""

    class OffLaw:  # P(c) of the real law, but conditional draws from far outside every window
        def __init__(self, real):
            self.real = real

        def masses(self, classify, edges):
            return self.real.masses(classify, edges)

        def draw(self, n, category, classify, edges, generator):
            return torch.full((n,), 0.01)

    top = RouteRule(0.9, None, scale=0.5)
    router = Router((top,), "flux", seed=21, max_tries=1)
    law = OffLaw(SAMPLERS["uniform"].law(HW))
    torch.manual_seed(0)
    recorder = Recorder(SAMPLERS["uniform"])
    decisions = [router.route(recorder, 4, HW, step, law=law) for step in range(1, 400)]
    broken = [d for d in decisions if d.fallback == "other"]
    assert broken and all(not d.routed and d.rule is None and d.filled == 0 for d in broken)
    assert all(d.fallback in (None, "other") for d in decisions)  # never a partly filled step


def test_sources_index_every_samples_own_draw():
    recorder = Recorder(SAMPLERS["sigmoid"])
    router = Router(STACK, "flux", seed=3)
    torch.manual_seed(0)
    replaced = 0
    for step in range(1, 201):
        recorder.seen.clear()
        d = router.route(recorder, 4, HW, step)
        assert torch.equal(recorder.pool()[d.source_index], d.sigmas)
        replaced += int((d.source_index >= 4).sum())
    assert replaced > 50


def test_first_callable_is_the_host_draw_and_kept_where_in_category():
    draw = host_draw(SAMPLERS["flux_shift"])

    def first():  # sd-scripts draws its noise before σ; the caller reproduces that
        torch.randn(2, 16, 8, 8)
        return draw(4)

    router = Router(STACK, "flux", seed=3)
    torch.manual_seed(0)
    resampled = 0
    for step in range(1, 201):
        state = torch.get_rng_state()
        d = router.route(draw, 4, HW, step, first=first)
        assert torch.equal(torch.get_rng_state(), state)
        host = first()  # what the host itself draws from the same state
        keep = in_category(host, d.rule_index, STACK)
        assert torch.equal(d.sigmas[keep], host[keep])  # host σ already in the category are kept
        assert d.resampled == int((~keep).sum())
        resampled += d.resampled
    assert resampled > 0


def test_rejection_rounds_grow_but_stay_capped():
    sizes = []
    sampler = SAMPLERS["uniform"]

    def draw(n):
        sizes.append(n)
        return sampler.sample(n, HW)

    _, tiny = _tiny_window_around_the_lead(draw)
    router = Router((tiny,), "flux", seed=21, max_tries=10)
    sizes.clear()
    torch.manual_seed(0)
    decision = router.route(draw, 4, HW, step=1)
    assert decision.fallback == "lead_fill"
    assert sizes == [4, 1, 4, 8, 16, 32, 64, 128, 256, 256, 256, 256]  # host, lead, then the rounds
    assert sizes[2:] == candidate_rounds(4, 10)


# --- ranks and reproducibility ------------------------------------------------------------------


def _run(router, draw, batch, steps, global_seed, rank=0, world_size=1):
    torch.manual_seed(global_seed)
    out = []
    for step in range(1, steps + 1):
        out.append(router.route(draw, batch, HW, step, rank=rank, world_size=world_size))
        draw(batch)  # the host consumes its own draw
    return out


@pytest.mark.parametrize("batch", [1, 4], ids=lambda b: f"B{b}")
def test_two_ranks_same_route_different_sigmas(batch):
    draw = host_draw(SAMPLERS["flux_shift"])
    rank0 = _run(Router(STACK, "flux", seed=77), draw, batch, 2000, global_seed=1, rank=0, world_size=2)
    rank1 = _run(Router(STACK, "flux", seed=77), draw, batch, 2000, global_seed=2, rank=1, world_size=2)
    assert [d.rule_index for d in rank0] == [d.rule_index for d in rank1]
    assert [d.lead for d in rank0] == [d.lead for d in rank1]
    assert all(not torch.equal(a.sigmas, b.sigmas) for a, b in zip(rank0, rank1, strict=True))
    assert {d.rule_index for d in rank0} == {-1, 0, 1}
    for decisions in (rank0, rank1):
        for d in decisions:
            assert d.fallback is None and bool(in_category(d.sigmas, d.rule_index, STACK).all())


def test_ranks_resample_from_private_streams():
    # same host stream on both ranks: kept host σ agree, resampled σ come from each rank's own stream
    draw = host_draw(SAMPLERS["sigmoid"])
    rank0 = _run(Router(STACK, "flux", seed=77), draw, 4, 500, global_seed=1, rank=0, world_size=2)
    rank1 = _run(Router(STACK, "flux", seed=77), draw, 4, 500, global_seed=1, rank=1, world_size=2)
    resampled_steps = 0
    for a, b in zip(rank0, rank1, strict=True):
        assert a.rule_index == b.rule_index and a.resampled == b.resampled
        if a.resampled:
            resampled_steps += 1
            assert not torch.equal(a.sigmas, b.sigmas)
        else:
            assert torch.equal(a.sigmas, b.sigmas)
    assert resampled_steps > 100


@pytest.mark.parametrize("gate", ["coupled", "strict"])
def test_reproducible_from_seed(gate):
    draw = host_draw(SAMPLERS["shift"])
    first = _run(Router(STACK, "flux", gate=gate, seed=5), draw, 4, 300, global_seed=8)
    again = _run(Router(STACK, "flux", gate=gate, seed=5), draw, 4, 300, global_seed=8)
    assert [(d.rule_index, d.lead, d.sigmas.tolist()) for d in first] == [(d.rule_index, d.lead, d.sigmas.tolist()) for d in again]
    if gate == "coupled":
        other = _run(Router(STACK, "flux", gate=gate, seed=6), draw, 4, 300, global_seed=8)
        assert [d.lead for d in first] != [d.lead for d in other]


# --- strict gate: demotion follows p^B ------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 2, 4, 8], ids=lambda b: f"B{b}")
def test_strict_gate_routes_with_probability_p_to_the_B(batch):
    sampler = SAMPLERS["uniform"]
    draw = host_draw(sampler)
    n = 10_000
    stack = (RouteRule(0.2, 0.9, 1024, 768), RouteRule(0.1, None, 1024, 896))  # masses 0.7 and 0.9 under uniform
    decisions = _run(Router(stack, "flux", gate="strict", seed=3), draw, batch, n, global_seed=batch)
    p_deep = sampler.mass(0.2, 0.9, HW)
    p_shallow_window = sampler.mass(0.1, None, HW)  # contains the deep window
    expected = {0: p_deep**batch, 1: p_shallow_window**batch - p_deep**batch}
    expected[-1] = 1 - expected[0] - expected[1]
    for index, q in expected.items():
        freq = sum(d.rule_index == index for d in decisions) / n
        assert abs(freq - q) <= 4 * math.sqrt(q * (1 - q) / n), (index, freq, q)
    for d in decisions:
        assert d.resampled == 0 and d.fallback is None
        if d.routed:
            assert bool(d.rule.in_window(d.sigmas).all())


# --- coupled gate: every sample's σ keeps the host's marginal ----------------------------------------
#
# The B samples of one step share its category, so pooled σ are *not* independent and a KS test on
# the pool against the marginal would reject a correct gate (the per-category fractions vary like
# the step count, not the sample count). What holds, and is tested here, is the decomposition
# p(σ) = Σ_c P(c)·p(σ|c): (1) each batch position across steps is i.i.d. with the host's marginal;
# (2) the steps' categories are i.i.d. with P(c); (3) given the category, a step's σ are i.i.d.
# from p(σ|c), so all σ pooled per category follow the conditional CDF.

N_SAMPLES = 50_000  # per case; the full grid of tests/test_marginal.py (-m marginal) goes further
BATCHES = (1, 2, 4, 8)
# STACK's categories as unions of intervals (σ ∈ [0, 1]; the edges have measure zero)
CATEGORY_INTERVALS = {0: [(0.65, 0.95)], 1: [(0.5, 0.65), (0.95, 1.0)], -1: [(0.0, 0.5)]}


def _coupled_run(case: tuple[str, int]) -> dict:
    """One (sampler, B) run of the coupled gate: N_SAMPLES per-sample σ with fixed seeds."""
    torch.set_num_threads(1)
    mode, batch = case
    draw = host_draw(SAMPLERS[mode])
    router = Router(STACK, "flux", seed=2024)
    sigmas, routes, fallbacks = [], [], 0
    torch.manual_seed(1000 + batch)
    for step in range(1, N_SAMPLES // batch + 1):
        d = router.route(draw, batch, HW, step)
        draw(batch)  # the host consumes its own draw
        sigmas.append(d.sigmas)
        routes.append(d.rule_index)
        fallbacks += d.fallback is not None
    sigmas, routes = torch.stack(sigmas), torch.tensor(routes)
    consistent = bool((categories(sigmas, STACK) == routes[:, None]).all())
    return {"sigmas": sigmas.double().numpy(), "routes": routes.numpy(), "fallbacks": fallbacks, "consistent": consistent}


@pytest.fixture(scope="module")
def coupled_runs(request):
    """Run every selected (sampler, B) case once (slowest first)."""
    order = lambda c: ({2: 0, 1: 1, 4: 1, 8: 2}[c[1]], c)  # noqa: E731
    return run_selected_cases(request, "test_coupled_gate_keeps_host_marginal", ("mode", "batch"), _coupled_run, order)


# The whole (sampler, B) grid is long (-m long, run by CI); the default run keeps flux_shift (μ from the latent
# size) at the largest batch.
COUPLED_CASES = [
    pytest.param(mode, batch, id=f"{mode}-B{batch}", marks=[] if (mode, batch) == ("flux_shift", 8) else [pytest.mark.long])
    for mode in sorted(SAMPLERS)
    for batch in BATCHES
]


@pytest.mark.parametrize("mode,batch", COUPLED_CASES)
def test_coupled_gate_keeps_host_marginal(coupled_runs, mode, batch):
    run = coupled_runs[(mode, batch)]
    sampler = SAMPLERS[mode]
    sigmas, routes = run["sigmas"], run["routes"]
    steps = len(routes)
    assert sigmas.size >= N_SAMPLES
    assert run["consistent"]  # every σ lies in its step's category
    assert run["fallbacks"] == 0
    cdf = np.vectorize(lambda x: sampler.cdf(float(x), HW))
    # (1) the marginal of a batch position, exactly the host's
    for position in sorted({0, batch - 1}):
        assert stats.kstest(sigmas[:, position], cdf).pvalue > 1e-3, position
    for c, intervals in CATEGORY_INTERVALS.items():
        p_c = sum(sampler.mass(lo, hi, HW) for lo, hi in intervals)
        # (2) the step's category follows the lead: P(c) in closed form
        freq = float(np.mean(routes == c))
        assert abs(freq - p_c) <= 4 * math.sqrt(p_c * (1 - p_c) / steps), (c, freq, p_c)

        # (3) all σ of the category's steps against p(σ|c)
        def conditional_cdf(x, intervals=intervals, p_c=p_c):
            return sum(np.clip(cdf(np.minimum(x, hi)) - sampler.cdf(lo, HW), 0.0, None) for lo, hi in intervals) / p_c

        pooled = sigmas[routes == c].ravel()
        assert pooled.size > 0.5 * p_c * N_SAMPLES
        assert stats.kstest(pooled, conditional_cdf).pvalue > 1e-3, c


# --- ranks on different buckets: one shared uniform through each rank's own P(c) ------------------

WIDE_HW = (104, 152)  # Flux latent of a 1216×832 bucket: the 1024 tier, a different flux_shift μ


def _category_probs(sampler: SigmaSampler, hw) -> list[float]:
    """STACK's categories in priority order, native last."""
    deep = sampler.mass(0.65, 0.95, hw)
    shallow = sampler.mass(0.5, 0.65, hw) + sampler.mass(0.95, None, hw)
    return [deep, shallow, 1.0 - deep - shallow]


def _bucket_decisions(hw, rank: int, steps: int, law: bool):
    sampler = SAMPLERS["flux_shift"]
    router = Router(STACK, "flux", seed=77)
    draw = host_draw(sampler, hw)
    torch.manual_seed(100 + rank)
    out = []
    for step in range(1, steps + 1):
        out.append(router.route(draw, 2, hw, step, rank=rank, world_size=2, law=sampler.law(hw) if law else None))
        draw(2)
    return out


def test_ranks_on_different_buckets_agree_as_the_shared_uniform_allows():
    steps = 6000
    a, b = (_bucket_decisions(hw, rank, steps, law=True) for rank, hw in enumerate((HW, WIDE_HW)))
    disagree = sum(x.rule_index != y.rule_index for x, y in zip(a, b, strict=True)) / steps
    pa, pb = (_category_probs(SAMPLERS["flux_shift"], hw) for hw in (HW, WIDE_HW))
    # the same u lands in different categories where the cumulative P(c) differ (native first)
    expected = abs(pa[2] - pb[2]) + abs(pa[2] + pa[0] - pb[2] - pb[0])
    total_variation = sum(abs(p - q) for p, q in zip(pa, pb, strict=True)) / 2
    assert expected <= total_variation + 1e-9  # maximal here: no coupling disagrees less often
    assert abs(disagree - expected) <= 4 * math.sqrt(expected / steps)
    for decisions, probs in ((a, pa), (b, pb)):  # each rank's own marginal P(c), exactly
        for index, p in zip((0, 1, -1), probs, strict=True):
            freq = sum(d.rule_index == index for d in decisions) / steps
            assert abs(freq - p) <= 4 * math.sqrt(p * (1 - p) / steps)
        assert all(bool(in_category(d.sigmas, d.rule_index, STACK).all()) for d in decisions)


def _gloo_rank(rank: int, world: int, port: int, steps: int, out_dir: str) -> None:
    import torch.distributed as dist

    from downscale_plugin.accounting import Accounting, StepRecord

    join_group(rank, world, port)
    try:
        hw = (HW, WIDE_HW)[rank]
        accounting = Accounting(STACK, token_values=Accounting.vocabulary([HW, WIDE_HW], STACK, "flux", 0.1))

        def all_reduce(vector: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(vector)
            return vector

        routes = []
        for decision in _bucket_decisions(hw, rank, steps, law=True):  # as hosts/kohya/run.py: record, reduce
            accounting.record(StepRecord.from_decision(len(routes) + 1, decision, hw, "flux"))
            totals = accounting.reduced(all_reduce)
            routes.append(decision.rule_index)
        torch.save(
            {"routes": routes, "compared": totals.compared, "disagreed": totals.disagreed, "summary": totals.summary_text()},
            f"{out_dir}/{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_on_different_buckets_count_their_disagreements(tmp_path):
    steps = 1500
    spawn_ranks(_gloo_rank, 2, steps, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    differ = sum(x != y for x, y in zip(r0["routes"], r1["routes"], strict=True))
    assert differ > 0  # 1024² and 1216×832 under flux_shift: P(c) differ, so some steps must
    assert (r0["compared"], r0["disagreed"]) == (r1["compared"], r1["disagreed"]) == (steps, differ)
    assert f"ranks ran different routes on {differ} of {steps} steps" in r0["summary"]
