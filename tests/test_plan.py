import math
from collections import Counter

import pytest
import torch
from selected_cases import run_selected_cases

from downscale_plugin.config import RouteRule, Span, load_config
from downscale_plugin.flops import FlopModel
from downscale_plugin.plan import (
    exhaustion_probability,
    format_plan,
    plan_table,
    route_probabilities,
    span_states,
)
from downscale_plugin.router import Router
from downscale_plugin.sigma import DdpmSampler, SigmaSampler, ddpm_alphas_cumprod, ddpm_t_to_sigma, flux_mu

HW = (128, 128)  # a 1024 px bucket (flux latent)
STACKED = (RouteRule(0.65, 0.95, native=1024, target=768), RouteRule(0.5, None, native=1024, target=896))


def _host_draw(mode: str):
    """What sd-scripts' flux sampler does: randn, then sigmoid (flux_shift: time-shift, = sigmoid(z + μ))."""
    mu = flux_mu(HW) if mode == "flux_shift" else 0.0

    def draw(n: int) -> torch.Tensor:
        return torch.sigmoid(torch.randn(n) + mu)

    return draw


def _router_fractions(rules, mode, gate, batch, steps, max_tries=8, total=0, seed=11):
    """Route `steps` train steps with the real Router; the host's own draw advances its RNG as in a run."""
    router = Router(rules, "flux", gate=gate, seed=seed, max_tries=max_tries, total_forwards=total)
    draw = _host_draw(mode)
    counts = Counter()
    torch.default_generator.manual_seed(seed)
    for step in range(1, steps + 1):
        counts[router.route(draw, batch, HW, step).rule_index] += 1
        torch.default_generator.manual_seed(seed * 1_000_003 + step)  # the host's step consumes RNG
    return {k: v / steps for k, v in counts.items()}


def _assert_within(predicted: dict[int, float], observed: dict[int, float], n: int, k: float = 4.0):
    for index, p in predicted.items():
        q = observed.get(index, 0.0)
        se = math.sqrt(max(p * (1 - p), 1e-12) / n)
        assert abs(q - p) <= k * se + 1e-12, f"route {index}: router {q:.5f} vs plan {p:.5f} (±{k}·{se:.5f})"


def test_closed_forms_for_stacked_windows():
    s = SigmaSampler("sigmoid")
    m_deep, m_high = s.mass(0.65, 0.95, HW), s.mass(0.5, None, HW)
    assert m_deep == pytest.approx(0.266, abs=1e-3) and m_high == pytest.approx(0.5)
    coupled = route_probabilities(STACKED, s, HW, "flux", gate="coupled", batch_size=4)
    assert coupled == pytest.approx({0: m_deep, 1: m_high - m_deep, -1: 0.5}, abs=1e-9)
    strict = route_probabilities(STACKED, s, HW, "flux", gate="strict", batch_size=4)
    assert strict == pytest.approx({0: m_deep**4, 1: m_high**4 - m_deep**4, -1: 1 - m_high**4})


# (gate, batch, steps). A step costs ~0.4 ms (two RNG forks), the coupled gate at B=4 more (a lead draw,
# redraws), which gets 25k steps (≈ 150k σ draws); _assert_within's tolerance scales with the steps. Strict at B=1 is the coupled decision itself
# (test_gates_agree_at_batch_one), so it needs no run of its own.
MC_CASES = [("coupled", 1, 50_000), ("strict", 4, 50_000), ("coupled", 4, 25_000)]


def _mc_case(case: tuple[str, str, int, int]) -> dict[int, float]:
    """One (mode, gate, batch, steps) case's router fractions (a worker process: one torch thread)."""
    torch.set_num_threads(1)
    mode, gate, batch, steps = case
    return _router_fractions(STACKED, mode, gate, batch, steps)


@pytest.fixture(scope="module")
def mc_fractions(request):
    """Every selected Monte Carlo case run once, both cores (the coupled B=4 steps cost most: first)."""
    cost = lambda c: (-c[3] * (4 if (c[1], c[2]) == ("coupled", 4) else 1), c)  # noqa: E731
    return run_selected_cases(request, "test_plan_matches_the_router", ("mode", "gate", "batch", "steps"), _mc_case, cost)


@pytest.mark.long  # the default run checks the plan against the router in this file's cheaper tests (fill, demotion, spans)
@pytest.mark.parametrize("mode", ["sigmoid", "flux_shift"])
@pytest.mark.parametrize("gate,batch,steps", MC_CASES)
def test_plan_matches_the_router(mc_fractions, mode, gate, batch, steps):
    predicted = route_probabilities(STACKED, SigmaSampler(mode), HW, "flux", gate=gate, batch_size=batch)
    _assert_within(predicted, mc_fractions[(mode, gate, batch, steps)], steps)


@pytest.mark.parametrize("mode", ["sigmoid", "flux_shift"])
def test_gates_agree_at_batch_one(mode):
    coupled, strict = Router(STACKED, "flux", gate="coupled", seed=3), Router(STACKED, "flux", gate="strict", seed=3)
    draw = _host_draw(mode)
    for step in range(1, 5001):
        torch.default_generator.manual_seed(step)  # torch.manual_seed formats a stack trace per call
        a, b = coupled.route(draw, 1, HW, step), strict.route(draw, 1, HW, step)
        assert a.rule_index == b.rule_index and torch.equal(a.sigmas, b.sigmas)
    s = SigmaSampler(mode)
    assert route_probabilities(STACKED, s, HW, "flux", gate="strict") == pytest.approx(route_probabilities(STACKED, s, HW, "flux"))


def _router_fill_rate(rules, batch, steps, max_tries, seed=11):
    """Fraction of coupled steps whose rejection ran out (filled by the lead: no law passed)."""
    router = Router(rules, "flux", seed=seed, max_tries=max_tries)
    draw = _host_draw("sigmoid")
    torch.default_generator.manual_seed(seed)
    fills = 0
    for step in range(1, steps + 1):
        fills += router.route(draw, batch, HW, step).filled > 0
        torch.default_generator.manual_seed(seed * 1_000_003 + step)
    return fills / steps


def test_coupled_fill_rate_is_modelled_and_routes_are_not():
    # One window of mass ≈ 0.34 and two rejection rounds (4 + 8 candidates for up to 4 redraws):
    # about 15 % of the routed steps run out and fill; they still run their route.
    rule = (RouteRule(0.6, None, native=1024, target=768),)
    s = SigmaSampler("sigmoid")
    q = s.mass(0.6, None, HW)
    p_ex = exhaustion_probability(q, 4, 2)
    assert 0.1 < p_ex < 0.3
    assert exhaustion_probability(q, 4, 8) < 1e-12
    predicted = route_probabilities(rule, s, HW, "flux", gate="coupled", batch_size=4, max_tries=2)
    assert predicted[0] == pytest.approx(q, rel=1e-12)
    steps = 15_000
    _assert_within(predicted, _router_fractions(rule, "sigmoid", "coupled", 4, steps, max_tries=2), steps)
    cfg = load_config(table={"routes": [{"route": "1024:768", "sigma_min": 0.6}], "max_tries": 2})
    fill = plan_table(cfg, "flux", s, [HW], batch_size=4).fallback
    assert fill == pytest.approx(q * p_ex + (1 - q) * exhaustion_probability(1 - q, 4, 2), rel=1e-9)
    _assert_within({1: fill}, {1: _router_fill_rate(rule, 4, steps, max_tries=2)}, steps)


def test_exhaustion_counts_the_capped_rounds():
    # The case: mass 0.485 %, B = 8, 8 rounds of 8, 16, …, 256, 256, 256 = 1016 candidates
    # (not 8·255 = 2040, which gives 0.23): rejection runs out on ≈ 87 % of the routed steps, as the
    # router realizes.
    s = SigmaSampler("sigmoid")
    q = s.mass(0.93, None, HW)
    assert exhaustion_probability(q, 8, 8) == pytest.approx(0.87, abs=0.01)
    rule = (RouteRule(0.93, None, native=1024, target=768),)
    cfg = load_config(table={"routes": [{"route": "1024:768", "sigma_min": 0.93}]})
    predicted = plan_table(cfg, "flux", s, [HW], batch_size=8).fallback
    steps = 20_000
    _assert_within({1: predicted}, {1: _router_fill_rate(rule, 8, steps, max_tries=8)}, steps)


def test_strict_demote_rate_is_p_to_the_b():
    rule = (RouteRule(0.3, 0.8, native=1024, target=768),)
    s = SigmaSampler("uniform")
    for b in range(1, 9):
        assert route_probabilities(rule, s, HW, "flux", gate="strict", batch_size=b)[0] == pytest.approx(0.5**b)
    steps = 20_000
    observed = _router_fractions(rule, "sigmoid", "strict", 3, steps)
    p = SigmaSampler("sigmoid").mass(0.3, 0.8, HW)
    _assert_within({0: p**3, -1: 1 - p**3}, observed, steps)


def test_span_states_partition_the_run():
    rules = [
        RouteRule(0.6, 0.9, native=1024, target=768, span=Span("late", 0.5)),
        RouteRule(0.5, 0.95, native=1024, target=896, span=Span("early", 0.75)),
        RouteRule(0.4, None, scale=0.9, span=Span("spread", 0.3)),
    ]
    cont = span_states(rules)
    assert sum(cont.values()) == pytest.approx(1.0)
    expected = {
        frozenset({1}): 0.5,
        frozenset({0, 1}): 0.25,
        frozenset({0}): 0.25,
    }
    for on, frac in expected.items():
        assert cont[on] == pytest.approx(0.7 * frac)
        assert cont[on | {2}] == pytest.approx(0.3 * frac)
    # At a finite T the intervals are Span.active's own step counts.
    total = 37
    exact = span_states(rules[:2], total)
    by_hand = Counter(frozenset(i for i in (0, 1) if rules[i].span.active(idx, total, 0)) for idx in range(1, total + 1))
    assert exact == pytest.approx({k: v / total for k, v in by_hand.items()})


def test_spans_against_the_router():
    rules = (
        RouteRule(0.65, 0.95, native=1024, target=768, span=Span("late", 0.5)),
        RouteRule(0.5, None, native=1024, target=896, span=Span("early", 0.75)),
    )
    total = 20_000
    s = SigmaSampler("sigmoid")
    predicted = route_probabilities(rules, s, HW, "flux", gate="strict", total_forwards=total)
    deep, high = s.mass(0.65, 0.95, HW), s.mass(0.5, None, HW)
    # early 3/4: rule 1 alone; overlap 1/4: stacked; last 1/4: rule 0 alone.
    assert predicted[0] == pytest.approx(0.5 * deep)
    assert predicted[1] == pytest.approx(0.5 * high + 0.25 * (high - deep))
    _assert_within(predicted, _router_fractions(rules, "sigmoid", "strict", 1, total, total=total), total)


class _Hidden:
    """A sampler whose closed form is hidden, to force the Monte-Carlo path."""

    has_closed_form = False

    def __init__(self, inner):
        self.inner = inner

    def sample(self, n, latent_hw, generator=None):
        return self.inner.sample(n, latent_hw, generator=generator)


@pytest.mark.parametrize("gate", ["coupled", "strict"])
def test_monte_carlo_path_agrees_with_the_closed_form(gate):
    s = SigmaSampler("flux_shift")
    closed = route_probabilities(STACKED, s, HW, "flux", gate=gate, batch_size=4)
    mc = route_probabilities(STACKED, _Hidden(s), HW, "flux", gate=gate, batch_size=4, mc_samples=200_000)
    for k in closed:
        assert mc[k] == pytest.approx(closed[k], abs=4 * 4 * math.sqrt(0.25 / 200_000))


def test_scheduler_grid_sampler_uses_exact_atoms():
    s = SigmaSampler("sigma", discrete_flow_shift=3.0)
    grid = s.scheduler_sigmas()
    lo = float(grid[500])  # a window edge on an atom: strictness decides, as in the router
    rule = (RouteRule(lo, None, native=1024, target=768),)
    p = route_probabilities(rule, s, HW, "flux", mc_samples=400_000)[0]
    exact = float((grid > torch.tensor(lo)).double().mean())
    assert p == pytest.approx(exact, abs=4 * math.sqrt(0.25 / 400_000))


def test_ddpm_sampler_is_exact_on_its_grid():
    s = DdpmSampler()
    sigmas = ddpm_t_to_sigma(torch.arange(1000), ddpm_alphas_cumprod())
    assert s.mass(0.5, None, (128, 128)) == pytest.approx(float((sigmas > 0.5).double().mean()))
    draws = s.sample(50_000, (128, 128), torch.Generator().manual_seed(0))
    assert float((draws > 0.5).double().mean()) == pytest.approx(s.mass(0.5, None, (128, 128)), abs=0.01)
    short = DdpmSampler(0, 500)
    assert short.mass(0.0, None, (64, 64)) == 1.0
    assert short.mass(float(sigmas[499]), None, (64, 64)) == 0.0


def test_plan_table_savings_and_never_routing():
    cfg = load_config(
        table={"routes": [{"route": "1024:768", "sigma_min": 0.65, "sigma_max": 0.95}, {"route": "1024:896", "sigma_min": 0.5}]}
    )
    model = FlopModel(hidden=256, depth=4, text_tokens=10)
    buckets = [(128, 128), (64, 64)]  # 1024² routes; 512² is outside the 1024 tier
    plan = plan_table(cfg, "flux", SigmaSampler("sigmoid"), buckets, batch_size=1, weights=[3, 1], flop_model=model)
    big, small = plan.buckets
    assert big.targets == {0: (96, 96), 1: (112, 112)} and small.targets == {}
    assert "1024 px tier" in small.reasons[0]
    assert plan.never_routing == [(64, 64)]
    p0, p1 = big.probs[0], big.probs[1]
    tokens = {-1: 4096, 0: 48 * 48, 1: 56 * 56}
    assert big.tokens == tokens
    assert big.token_saving == pytest.approx(p0 * (1 - 2304 / 4096) + p1 * (1 - 3136 / 4096))
    cost = model.flops
    assert big.flop_saving == pytest.approx(1 - (big.probs[-1] * cost(4096) + p0 * cost(2304) + p1 * cost(3136)) / cost(4096))
    assert plan.probs[0] == pytest.approx(0.75 * p0)
    spent = 0.75 * (big.probs[-1] * cost(4096) + p0 * cost(2304) + p1 * cost(3136)) + 0.25 * cost(1024)
    assert plan.flop_saving == pytest.approx(1 - spent / (0.75 * cost(4096) + 0.25 * cost(1024)))
    text = format_plan(plan, "sigmoid (scale 1)")
    assert "26.6 %" in text and "23.4 %" in text and "never routing (1): 512x512" in text
