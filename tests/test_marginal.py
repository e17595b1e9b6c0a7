"""The coupled gate keeps every sample's σ marginal for narrow windows, large batches, every sampler.

As a user runs it: an sd-scripts-like sampler draws σ from torch's GLOBAL RNG and the public
``Router.route`` routes each step (the host then consumes its own draw), with the sampler's exact
law (``SigmaSampler.law``) as a host adapter passes it, or without one (the lead fills).

Per (window mass, B, sampler), one route on the upper tail σ > lo holding that host mass:

- the routed-step count is Bin(steps, mass): every σ of a routed step lies in the window and none of
  a native step, so the in-window fraction of all σ is exactly the routed-step fraction;
- KS of one batch position across steps (i.i.d.) against the host's CDF, and KS of all σ of each
  category's steps against that category's conditional CDF (the σ of one step share its category,
  so all σ pooled are not i.i.d. from the marginal, but given the category they are from p(σ|c));
- the realized fill rate (steps whose rejection ran out) is Bin(steps, plan's prediction).

The default run has a statistical smoke; the full grid is ``-m marginal`` (pyproject.toml).
"""

from __future__ import annotations

import math
from itertools import product

import numpy as np
import pytest
import torch
from scipy import stats
from selected_cases import run_selected_cases

from downscale_plugin.config import RouteRule, load_config
from downscale_plugin.plan import plan_table
from downscale_plugin.router import Router
from downscale_plugin.sigma import DiscreteLaw, SigmaSampler

HW = (128, 128)  # Flux latent of a 1024² bucket
SAMPLERS = {
    "uniform": SigmaSampler("uniform"),
    "sigmoid": SigmaSampler("sigmoid"),
    "shift": SigmaSampler("shift", discrete_flow_shift=3.1582),
    "flux_shift": SigmaSampler("flux_shift"),
    "sigma": SigmaSampler("sigma", weighting_scheme="logit_normal"),  # the scheduler grid; its top atoms are light
}
MASSES = (0.3, 0.05, 5e-3, 1e-4)
BATCHES = (1, 2, 4, 8, 16)
KS_MAX = 50_000  # σ per KS test (a fixed-seed subsample of larger pools)


def window(sampler: SigmaSampler, mass: float) -> tuple[float, float]:
    """(lo, exact host mass of σ > lo) with that mass close to ``mass`` (on the grid: an atom edge)."""
    law = sampler.law(HW)
    if isinstance(law, DiscreteLaw):
        order = torch.argsort(law.values, descending=True)
        tail = torch.cumsum(law.probs[order], 0)
        k = int(torch.searchsorted(tail, torch.tensor([mass], dtype=torch.float64)))
        lo = float(law.values[order[k]])
        return lo, float(law.probs[law.values > lo].sum())
    lo = float(sampler.quantile(torch.tensor([1.0 - mass], dtype=torch.float64), HW)[0])
    return lo, sampler.mass(lo, None, HW)


def steps_for(mass: float) -> int:
    """4 000 steps, or 20 expected routed steps, up to 40 000 (4 expected at mass 1e-4: there the
    routed count is weakly tested, the all-or-nothing consistency, the KS tests and the fill rate fully)."""
    return max(4_000, min(math.ceil(20 / mass), 40_000))


def run_case(name: str, mass: float, batch: int, steps: int, use_law: bool = True, router_cls: type = Router) -> dict:
    """Route ``steps`` steps; what the assertions need (``router_cls``: to run another router revision)."""
    torch.set_num_threads(1)
    sampler = SAMPLERS[name]
    lo, exact = window(sampler, mass)
    rule = RouteRule(lo, None, scale=0.5)
    router = router_cls((rule,), "flux", seed=2024)
    law = {"law": sampler.law(HW)} if use_law else {}

    def draw(n: int) -> torch.Tensor:
        return sampler.sample(n, HW)

    torch.manual_seed(1000 + batch)
    sigmas, routed, fills = [], [], 0
    for step in range(1, steps + 1):
        d = router.route(draw, batch, HW, step, **law)
        draw(batch)  # the host consumes its own draw
        sigmas.append(d.sigmas.double())
        routed.append(d.routed)
        fills += getattr(d, "filled", 0) > 0
    sigmas, routed = torch.stack(sigmas), torch.tensor(routed)
    inside = rule.in_window(sigmas.float() if sampler.has_closed_form else sigmas.to(torch.float32))
    return {
        "lo": lo,
        "mass": exact,
        "steps": steps,
        "routed": int(routed.sum()),
        "in_window": int(inside.sum()),
        "consistent": bool((inside == routed[:, None]).all()),
        "fills": fills,
        "position0": sigmas[:, 0].numpy(),
        "routed_sigmas": sigmas[routed].numpy(),
        "native_sigmas": sigmas[~routed].numpy(),
        "law": use_law,
    }


def _cdf(sampler: SigmaSampler):
    """The host's CDF, vectorized (the grid: its atoms' step function)."""
    law = sampler.law(HW)
    if isinstance(law, DiscreteLaw):
        order = torch.argsort(law.values)
        values, cum = law.values[order].double().numpy(), torch.cumsum(law.probs[order], 0).numpy()
        return lambda x: np.where(np.searchsorted(values, x, side="right") > 0, cum[np.searchsorted(values, x, side="right") - 1], 0.0)
    return np.vectorize(lambda x: sampler.cdf(float(x), HW))


def _subsample(x: np.ndarray) -> np.ndarray:
    return x if x.size <= KS_MAX else np.random.default_rng(0).choice(x, KS_MAX, replace=False)


def _predicted_fill(name: str, lo: float, batch: int) -> float:
    cfg = load_config(table={"routes": [{"scale": 0.5, "sigma_min": lo}]})
    return plan_table(cfg, "flux", SAMPLERS[name], [HW], batch_size=batch).fallback


def check(name: str, batch: int, run: dict) -> None:
    """Every assertion of the module docstring for one case."""
    sampler, steps, mass = SAMPLERS[name], run["steps"], run["mass"]
    assert run["consistent"]  # routed steps: every σ in the window; native steps: none
    assert run["in_window"] == run["routed"] * batch
    assert abs(run["routed"] - steps * mass) <= 4 * math.sqrt(steps * mass * (1 - mass)) + 1, (run["routed"], steps * mass)
    cdf = _cdf(sampler)
    assert stats.kstest(_subsample(run["position0"]), cdf).pvalue > 1e-4
    low = cdf(np.array([run["lo"]]))[0]
    conditional = {"routed_sigmas": lambda x: (cdf(x) - low) / (1.0 - low), "native_sigmas": lambda x: np.minimum(cdf(x), low) / low}
    for key, category_cdf in conditional.items():
        pooled = run[key]
        # law fills are i.i.d. given the category: test all σ pooled; lead fills repeat the lead within
        # a step, so only each batch position is i.i.d. across the category's steps
        samples = [pooled.reshape(-1)] if run["law"] else [pooled[:, j] for j in sorted({0, batch - 1})]
        for sample in samples:
            if sample.size:
                assert stats.kstest(_subsample(sample), category_cdf).pvalue > 1e-4, key
    fill = _predicted_fill(name, run["lo"], batch)
    assert abs(run["fills"] - steps * fill) <= 4 * math.sqrt(steps * fill * (1 - fill)) + 2, (run["fills"], steps * fill)


# --- default run: a statistical smoke ------------------------------------------------------------

SMOKE = [
    pytest.param("sigmoid", 5e-3, 8, 8_000, True, id="sigmoid-mass5e-3-B8-law"),
    pytest.param("sigmoid", 5e-3, 8, 8_000, False, id="sigmoid-mass5e-3-B8-lead"),
    pytest.param("sigma", 0.05, 16, 3_000, True, id="grid-mass0.05-B16-law"),
]


@pytest.mark.parametrize(("name", "mass", "batch", "steps", "use_law"), SMOKE)
def test_narrow_window_marginal_smoke(name, mass, batch, steps, use_law):
    check(name, batch, run_case(name, mass, batch, steps, use_law))


# --- the full grid (pytest -m marginal) ----------------------------------------------------------

GRID = list(product(sorted(SAMPLERS), MASSES, BATCHES))


def _grid_case(case: tuple[str, float, int]) -> dict:
    name, mass, batch = case
    return run_case(name, mass, batch, steps_for(mass))


@pytest.fixture(scope="module")
def grid_runs(request):
    """Every selected grid case, run once (largest first)."""
    order = lambda c: (-steps_for(c[1]) * (1 + c[2] / 8), c)  # noqa: E731
    return run_selected_cases(request, "test_marginal_grid", ("name", "mass", "batch"), _grid_case, order)


@pytest.mark.marginal
@pytest.mark.parametrize(("name", "mass", "batch"), GRID, ids=[f"{n}-mass{m:g}-B{b}" for n, m, b in GRID])
def test_marginal_grid(grid_runs, name, mass, batch):
    check(name, batch, grid_runs[(name, mass, batch)])


# --- one route, two windows: a low one from σ = 0 and a high one open at the top ---------------------


def run_two_windows(name: str, mass: float, batch: int, steps: int, use_law: bool) -> tuple[list[tuple[float, float]], dict]:
    """One route (×0.5) on (0, a) and on (b, 1], each window holding about ``mass`` of the host's σ (two router rules,
    as a windows file writes a route with two windows): its intervals and the run (σ per step, its rule)."""
    torch.set_num_threads(1)
    sampler = SAMPLERS[name]
    a, b = (float(x) for x in sampler.quantile(torch.tensor([mass, 1.0 - mass], dtype=torch.float64), HW))
    cfg = load_config(plugin_toml={"routes": [{"scale": 0.5, "sigma_min": 0.0, "sigma_max": a}, {"scale": 0.5, "sigma_min": b}]})
    router = Router(cfg.routes, "flux", seed=2024)
    law = {"law": sampler.law(HW)} if use_law else {}
    torch.manual_seed(3000 + batch)
    sigmas, rules_run = [], []
    for step in range(1, steps + 1):
        d = router.route(lambda n: sampler.sample(n, HW), batch, HW, step, **law)
        sampler.sample(batch, HW)  # the host consumes its own draw
        sigmas.append(d.sigmas.double())
        rules_run.append(d.rule_index)
    return [(0.0, a), (b, 1.0)], {"sigmas": torch.stack(sigmas).numpy(), "rules": np.array(rules_run), "config": cfg}


TWO_WINDOWS = [
    pytest.param("sigmoid", 5e-3, 8, 8_000, True, id="narrow-sigmoid-B8-law"),
    pytest.param("flux_shift", 5e-3, 4, 8_000, False, id="narrow-flux_shift-B4-lead"),
    pytest.param("sigmoid", 0.3, 4, 3_000, True, id="wide-sigmoid-B4-law"),
    pytest.param("flux_shift", 0.3, 16, 2_000, False, id="wide-flux_shift-B16-lead"),
]


@pytest.mark.parametrize(("name", "mass", "batch", "steps", "use_law"), TWO_WINDOWS)
def test_a_route_with_two_windows_keeps_the_marginal(name, mass, batch, steps, use_law):
    """Each step's σ all lie in its rule's window (native: in neither); each rule fires Bin(steps, its mass); a batch
    position is the host's marginal; and given the rule, the step's σ follow the host's law on its window."""
    sampler = SAMPLERS[name]
    windows, run = run_two_windows(name, mass, batch, steps, use_law)
    sigmas, fired = run["sigmas"], run["rules"]
    cdf = _cdf(sampler)
    inside = [(sigmas > lo) & (sigmas < hi) for lo, hi in windows]
    for i in (0, 1):
        assert inside[i][fired == i].all() and not inside[1 - i][fired == i].any()
    assert not (inside[0] | inside[1])[fired == -1].any()
    assert stats.kstest(_subsample(sigmas[:, 0]), cdf).pvalue > 1e-4
    outside = [(windows[0][1], windows[1][0])]
    for c, intervals in ((0, [windows[0]]), (1, [windows[1]]), (-1, outside)):
        p_c = sum(sampler.mass(lo, hi, HW) for lo, hi in intervals)
        assert abs(np.sum(fired == c) - steps * p_c) <= 4 * math.sqrt(steps * p_c * (1 - p_c)) + 1, (c, np.sum(fired == c), steps * p_c)

        def conditional(x, intervals=intervals, p_c=p_c):
            return sum(np.clip(cdf(np.minimum(x, hi)) - cdf(np.array([lo]))[0], 0.0, None) for lo, hi in intervals) / p_c

        pooled = sigmas[fired == c]
        for sample in [pooled.reshape(-1)] if use_law else [pooled[:, j] for j in sorted({0, batch - 1})]:
            if sample.size:
                assert stats.kstest(_subsample(sample), conditional).pvalue > 1e-4, c
    plan = plan_table(run["config"], "flux", sampler, [HW], batch_size=batch)  # ``plan`` predicts what the router does
    assert [plan.probs[0], plan.probs[1]] == pytest.approx([sampler.mass(lo, hi, HW) for lo, hi in windows], rel=1e-6)
