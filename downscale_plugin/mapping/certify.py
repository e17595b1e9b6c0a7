"""The certifier: (route, σ-bin) windows for a tenth of the full map's passes, never wider than it.

Where the full map (``estimator.py``) spends N images × D draws × (2 + routes) passes on every bin,
the certifier spends evidence only where a verdict is still open and worth having
(docs/FIDELITY.md, "Certification at a tenth of the cost"):

- **Paired draws** (``paired.py``): one native arm per (image, bin, draw), every route's noise coupled
  to it; the per-image estimate is the U-statistic cosine gap of ``sequential.py``.
- **Sequential per bin**: images arrive one at a time in a seeded order; the bound is read at the
  looks of a :class:`~downscale_plugin.mapping.sequential.Looks` confidence sequence and the bin
  stops once ``safe``/``unsafe``/``futile``/``inconclusive`` (``sequential.verdict``).
- **A plan before any evidence** (:func:`plan_tests`, docs/FIDELITY.md §9.4): every (route, bin) the
  sampler draws, valued at its own bin's mass × the route's saving per pass (1 − its pass cost) and
  priced at its safe read alone; tests run one at a time, best value per cost first, each to its
  verdict. Each route has two chains in the family (``safe_read.Family.both_ends``), fixed before any
  evidence: its bins in the plan's order and its bins from the lowest up, so a window at low σ is
  certified from its own evidence whatever the top bins read. The plan values a low bin as any other (its
  own mass × saving per cost; only exact ties go to the higher bin). A bin the sampler never draws (σ = 1
  under a continuous law) is never tested, it routes nothing; a milder route is not tested on a bin a
  deeper route is already safe on (its rule comes first).
- **Prune between two bins that ended not safe at a look**: an inconclusive bin ends nothing else; a bin between
  two bins of its route that ended ``unsafe`` (lower bound above ε) or ``futile`` (projected unable to read safe) is
  not tested. This assumes the excess has one hump in σ (the lab maps: highest in the middle, lower at both ends,
  docs/FIDELITY.md §4), so the bins above ε form one interval. A futile bracket counts because the first look is
  at 2 images, where the t lower bound (at α/K, 1 degree of freedom) almost never confirms excess: a clearly unsafe
  bin stops there futile, and brackets of confirmed excess alone would prune almost nothing. A futile bin's mean may
  still lie under ε (a heavy probe among few), so this prunes some bins that are safe: it costs power (windows),
  never soundness, since untested bins are never safe. A single bracket prunes nothing: a route not safe on one side
  is tested bin by bin there (a clearly unsafe bin stops at the first look, and in a run the stake caps what is at
  risk). ``spot_checks`` of pruned bins are tested all the same once the search is done; one that comes out safe
  is reported as a second hump and never routed (``Verdicts``).
- **Safe only on the whole image pool**: a bin ends safe only at ``Looks.safe_from`` images (default
  the last look, the full map's N); earlier looks stop it only toward not-safe (``sequential.py``).
- **Only evidence that can pay** (in a training run, ``CertifySettings.horizon`` = the passes the
  windows would serve): a test runs only if its window, safe, saves back over the horizon the evidence
  it still needs (``cost`` otherwise), if that evidence fits what is left of the budget (``budget``;
  each test on its own), and if what its route has spent and not yet won back by its own safe windows,
  plus it, stays within the route's stake, one safe read of the route (``stake``): each route risks
  its own stake and no route's failure stops another's tests, so the run's worst case is the sum of
  the stakes, within the budget (``Plan.stake``). A safe spot check is reported as ``spot-safe``,
  never as a safe bin.

Cost model: a native pass (one forward+backward at the native grid) is 1; a route pass counts its
token fraction (h_r·w_r)/(h·w) of the grids actually run (= r² on the lab's default grids); the
budget and ``native_step_equivalents`` are in these units. Each test draws its own native passes (a
route that reaches an (image, bin) another route has drawn draws it again and pays again: keeping
draws would hold D × p floats per (image, bin)).

Memory: a draw is reduced as it is taken (``sequential.PairedSums``: per arm a running sum on the
gradients' devices, the rest float64 scalars), so a certification holds (1 + routes) sums and one
native draw per parameter, whatever the number of probes, bins and draws; nothing is kept per (image, bin).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Protocol

import numpy as np
import torch

from ..bins import SigmaBins
from ..certify_config import DEFAULT_MARGIN
from ..provenance import code_revision
from ..rng import forked, seed_forked
from .arms import PLAIN, Arm, MapBackend
from .estimator import arm_key, param_grads
from .paired import coupled_small_noise, injected_noise
from .safe_read import SAFE_READ
from .sequential import FUTILE, SAFE, UNSAFE, Bound, Family, Grads, Looks, PairedSums, describe_safe_read, read, verdict
from .windows import measured_tiers, probe_header, render_windows, stack_windows, tier_entries, utc_now

BUDGET, UNTESTED = "budget", "untested"  # verdicts of tests the certifier did not finish / never ran
COST = "cost"  # a test whose window could not save what its remaining evidence costs (a run's horizon)
STAKE = "stake"  # a test not started: its route would have more at risk than the route's stake (spent and not won back)
UNFINISHED = (BUDGET, COST, STAKE)  # verdicts of tests that may get more evidence in a later run (``certify_resume``)
SPOT_SAFE = "spot-safe"  # a spot check of a pruned bin whose bound read safe: a second hump, never a window


@dataclass(frozen=True)
class CertifySettings:
    """ε, draws per (image, bin), the look schedule (its last look = the image pool used), the pass
    budget in native-step equivalents, the certifier's seed, the spot checks of each route's pruned bins, and the
    passes the windows would serve (``horizon``; None: no pay rule, as in the ``certify`` command)."""

    margin: float = DEFAULT_MARGIN
    draws: int = 4
    looks: Looks = field(default_factory=Looks)
    budget: float = 300.0
    seed: int = 0
    spot_checks: int = 2
    horizon: float | None = None


def settings_problems(s: CertifySettings) -> list[str]:
    problems = []
    if s.draws < 2:
        problems.append(f"draws: {s.draws} must be >= 2 (the U-statistics pair distinct draws)")
    if not 0.0 < s.margin < 1.0:
        problems.append(f"margin: {s.margin} must be strictly between 0 and 1 (cosine-distance units)")
    if not s.budget > 0:
        problems.append(f"budget: {s.budget} native-step equivalents must be > 0")
    if s.spot_checks < 0:
        problems.append(f"spot_checks: {s.spot_checks} must be >= 0")
    if s.horizon is not None and s.looks.first_safe != s.looks.last:
        problems.append(
            f"looks: safe_from {s.looks.first_safe} before the last look {s.looks.last}: in a run (a horizon) a test may read "
            "safe only at its last look, so that a safe read is all the evidence it can spend (the stake)"
        )
    return problems


Sink = Callable[[str | None, Grads], None]  # one draw: the arm's name (None: native) and its per-parameter gradient


class DrawSource(Protocol):
    """Gradient draws for the certifier. ``draw_pairs(image, bin, routes, sink)`` runs the D paired draws of
    one (image, bin): for each d, the native draw d, then each route's draw d (same σ, coupled noise),
    each handed to ``sink`` as it is taken and not kept (``PairedSums.add``); ``cost(arm)`` →
    native-step equivalents of one pass (None: native, 1)."""

    def num_images(self) -> int: ...

    def draw_pairs(self, image: int, bin_: int, routes: Sequence[Arm], sink: Sink) -> None: ...

    def cost(self, arm: Arm | None) -> float: ...


def token_fraction(small: tuple[int, ...], native: tuple[int, ...]) -> float:
    """(h_r·w_r)/(h·w) of two latent shapes (…, h, w): a route pass's cost in native passes by tokens."""
    return (small[-2] * small[-1]) / (native[-2] * native[-1])


def looks_json(looks: Looks) -> dict[str, Any]:
    """A look schedule as ``certify.json`` records it (and a resumed result must match)."""
    return {"at": list(looks.at), "alpha": looks.alpha, "safe_from": looks.first_safe, "safe_read": SAFE_READ}


def _key(*parts: int) -> int:
    return int(np.random.SeedSequence([p & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


class BackendDraws:
    """:class:`DrawSource` over any :class:`~downscale_plugin.mapping.arms.MapBackend`: each draw is the
    backend's (the trainer's own) loss at a σ drawn uniformly in the bin, with the noise injected
    (``paired.injected_noise``): the native draw's ε from a private generator, each route's ε_r = M·ε
    (``paired=False``: an independent ε_r, the unpaired baseline the variance reduction is measured against).
    Every call runs in a forked, seeded RNG, as the map's draws do."""

    def __init__(
        self,
        backend: MapBackend,
        bins: SigmaBins,
        draws: int,
        seed: int,
        paired: bool = True,
        fraction: Callable[[tuple[int, ...], tuple[int, ...]], float] | None = None,
    ):
        """``fraction(small_shape, native_shape)`` (the noise tensors' shapes): a route pass's cost in native
        passes (default: its token fraction; a run passes its FLOP model's, so that the budget and the saving
        share one unit)."""
        self.backend, self.bins, self.draws, self.seed, self.paired = backend, bins, draws, seed, paired
        self.fraction = fraction or token_fraction
        self.params = [p for p in backend.trainable_parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("certify: the model has no trainable parameters (attach a trainable adapter)")
        self.inputs: dict[tuple[int, str], Any] = {}
        self.native_shape: dict[int, tuple[int, ...]] = {}
        self.fractions: dict[str, float] = {}

    def num_images(self) -> int:
        return self.backend.num_images()

    def cost(self, arm: Arm | None) -> float:
        if arm is None:
            return 1.0
        return self.fractions.get(arm.name, arm.ratio**2)

    def _input(self, image: int, arm: Arm) -> Any:
        if (image, arm.name) not in self.inputs:
            self.inputs[image, arm.name] = self.backend.arm_input(image, arm)
        return self.inputs[image, arm.name]

    def _sigma(self, image: int, bin_: int, d: int) -> float:
        if self.bins.is_endpoint(bin_):
            return 1.0
        lo, hi = self.bins.bounds(bin_)
        u = float(np.random.default_rng(_key(self.seed, image, bin_, d, 0x5167)).random())
        return lo + (hi - lo) * (1.0 - u)  # in (lo, hi]: the bin's own half-open interval

    def _noise(self, image: int, bin_: int, d: int, shape: tuple[int, ...], stream: int = 0) -> torch.Tensor:
        gen = torch.Generator().manual_seed(_key(self.seed, image, bin_, d, 0xE751, stream))
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    def _grad(self, image: int, arm: Arm, sigma: float, noise: Callable[[tuple[int, ...]], torch.Tensor], key: int) -> list[torch.Tensor]:
        shapes: list[tuple[int, ...]] = []

        def make(shape: tuple[int, ...]) -> torch.Tensor:
            shapes.append(shape)
            return noise(shape)

        devices = self.backend.rng_devices
        with forked(devices), injected_noise(make):
            seed_forked(key, devices)
            loss = self.backend.loss(image, self._input(image, arm), sigma)
        if arm.kind != "native":
            native = self.native_shape[image]
            self.fractions[arm.name] = self.fraction(tuple(shapes[0]), tuple(native))
        else:
            self.native_shape[image] = shapes[0]
        return param_grads(loss, self.params)

    def draw_pairs(self, image: int, bin_: int, routes: Sequence[Arm], sink: Sink) -> None:
        """Native draw d, then each route's draw d on the native ε's coupled noise (``paired``), for every d."""
        native = Arm("native_a", "native")
        for d in range(self.draws):
            sigma = self._sigma(image, bin_, d)
            key = _key(self.seed, image, bin_, arm_key(native), d)
            sink(None, self._grad(image, native, sigma, partial(self._noise, image, bin_, d), key))
            for arm in routes:
                noise = partial(self._route_noise, image, bin_, d, arm)
                sink(arm.name, self._grad(image, arm, sigma, noise, _key(self.seed, image, bin_, arm_key(arm), d)))

    def _route_noise(self, image: int, bin_: int, d: int, arm: Arm, shape: tuple[int, ...]) -> torch.Tensor:
        """The route's ε_r = M·ε of native draw d's ε (seeded: the same tensor again), or an independent ε_r (unpaired)."""
        if self.paired:
            return coupled_small_noise(self._noise(image, bin_, d, self.native_shape[image]), shape[-2:])
        return self._noise(image, bin_, d, shape, stream=arm_key(arm))


@dataclass
class BinTest:
    """One (route, σ-bin) test: its evidence (per-image estimates, in arrival order), last reading and verdict."""

    route: str
    ratio: float
    bin: int
    lo: float
    hi: float
    value: float  # sampler mass × token saving: what a safe verdict is worth
    spot: bool = False  # a spot check of a pruned bin (``Certifier._pruned``), not part of its search
    images: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    bound: Bound | None = None
    verdict: str | None = None
    cost: float = 0.0

    @property
    def open(self) -> bool:
        return self.verdict is None

    @property
    def safe(self) -> bool:
        return self.verdict == SAFE

    @property
    def arm(self) -> str:
        return self.route


@dataclass
class CertifyResult:
    bins: SigmaBins
    routes: tuple[Arm, ...]
    settings: CertifySettings
    tests: list[BinTest]
    spent: float
    notes: list[str]
    provenance: dict[str, Any] = field(default_factory=dict)
    plan: Plan | None = None  # the plan the tests ran by (``plan_tests``)

    def test(self, route: str, bin_: int) -> BinTest | None:
        return next((t for t in self.tests if t.route == route and t.bin == bin_), None)

    def rows(self, route: Arm) -> list[BinTest]:
        """One row per bin for ``route`` (an untested bin: a row with verdict ``untested``), by bin."""
        out = []
        for b in range(len(self.bins)):
            found = self.test(route.name, b)
            if found is None:
                lo, hi = self.bins.bounds(b)
                found = BinTest(route.name, route.ratio, b, lo, hi, 0.0, verdict=UNTESTED)
            out.append(found)
        return out

    def to_json(self) -> dict[str, Any]:
        s = self.settings
        bins = []
        for route in self.routes:
            for t in self.rows(route):
                b = t.bound
                bins.append(
                    {
                        "route": t.route,
                        "ratio": t.ratio,
                        "bin": t.bin,
                        "label": self.bins.label(t.bin),
                        "lo": t.lo,
                        "hi": t.hi,
                        "verdict": t.verdict,
                        "safe": t.safe,  # a spot check never is: its safe read is "spot-safe"
                        "spot_check": t.spot,
                        "bound": None
                        if b is None
                        else {"mean": b.mean, "sd": b.sd, "lower": b.lower, "upper": b.upper, "n": b.n, "level": b.level},
                        "evidence": {"images": t.images, "excess": t.values},
                        "value": t.value,
                        "cost": t.cost,
                    }
                )
        return {
            "method": "certify: paired noise, U-statistic cosine gap, looks (safe read on the last: mean + c·sd/√n, c calibrated on "
            "heavy tails, at each test's level of two fallback chains per route, family-wise α), planned search (value per cost)",
            "provenance": self.provenance,
            "settings": {**asdict(s), "looks": looks_json(s.looks)},
            "bins_spec": {"edges": list(self.bins.edges), "endpoint": self.bins.endpoint},
            "cost": {"native_step_equivalents": self.spent, "budget": s.budget, "model": "native pass 1, route pass its token fraction"},
            "bins": bins,
            "safe_bins": len(self.safe_tests()),
            "scope": scope_text(self.provenance.get("backend", {})),
            "spot_checks": self.spot_summary(),
            "plan": None if self.plan is None else self.plan.summary(),
            "notes": list(self.notes),
        }

    def safe_tests(self) -> list[BinTest]:
        """The safe bins (the certified windows' evidence); spot checks are never among them."""
        return [t for t in self.tests if t.safe]

    def spot_summary(self) -> dict[str, Any]:
        spots = [t for t in self.tests if t.spot]
        safe = [f"{t.route} {self.bins.label(t.bin)}" for t in spots if t.verdict == SPOT_SAFE]
        return {"run": len(spots), "safe_never_routed": safe, "cost": sum(t.cost for t in spots)}

    def spot_text(self) -> str:
        """One line for logs and summaries: spot checks as what they are."""
        spot = self.spot_summary()
        if not spot["run"]:
            return "spot checks: none"
        return f"spot checks: {spot['run']} run, {len(spot['safe_never_routed'])} safe, never routed ({spot['cost']:.1f} native-step equivalents)"


Progress = Callable[[float, str], None]


@dataclass(frozen=True)
class Planned:
    """One (route, bin) test as planned before any evidence: the bin's sampler mass, the route's saving per routed
    pass (1 − its pass cost) and the evidence of a safe verdict on the test alone (``safe_cost``)."""

    route: Arm
    bin: int
    mass: float
    saving: float
    cost: float

    @property
    def value(self) -> float:
        """Native-step equivalents a safe verdict saves per later pass: its own bin's mass × the route's saving."""
        return self.mass * self.saving


def safe_cost(settings: CertifySettings, fraction: float) -> float:
    """Native-step equivalents of one route's safe verdict on one bin: ``first_safe`` probes × D × (1 native + the route)."""
    return settings.looks.first_safe * settings.draws * (1.0 + fraction)


@dataclass(frozen=True)
class Plan:
    """The certification's plan, made before any probe (docs/FIDELITY.md §9.4): every (route, bin) the sampler draws,
    best value per cost first (the order the tests are run in, and their chains' order in the family), with what
    the plan can win and lose over ``horizon`` later passes (None: no run to pay back, as in the ``certify`` command)."""

    tests: tuple[Planned, ...]
    horizon: float | None
    budget: float
    first_look: float = 1.0  # the share of a safe read's evidence spent by the first look (where a clear not-safe stops)

    def pays(self, t: Planned, taken: float = 0.0) -> bool:
        """Whether ``t``'s window, safe, saves its evidence back over the horizon; ``taken``: the saving per pass a
        deeper route already safe in its bin takes of it (its router rule comes first)."""
        return self.horizon is None or self.horizon * t.mass * (t.saving - taken) >= t.cost

    @property
    def paying(self) -> list[Planned]:
        return [t for t in self.tests if self.pays(t)]

    @property
    def stakes(self) -> dict[str, float]:
        """Each route's stake, the most its tests may have at risk (spent and not yet won back by its own safe windows):
        the safe read of its first paying test (a route's tests all cost the same), the cheapest way to learn whether the
        route certifies at all; routes whose safe read the budget cannot hold never start and have none. A route's
        stake is its own: another route's failure never stops its tests."""
        out: dict[str, float] = {}
        for t in self.paying:
            if t.cost <= self.budget:
                out.setdefault(t.route.name, t.cost)
        return out

    @property
    def stake(self) -> float:
        """The run's worst case (spent and never won back): every route's stake lost, its first test read to its last
        look and not safe; never more than the budget."""
        return min(math.fsum(self.stakes.values()), self.budget)

    def best_case(self) -> tuple[list[Planned], float, float]:
        """Were every test safe: the tests run (in order, within the budget, none a deeper safe route makes
        worthless), their spend and their routed saving over the horizon."""
        taken: dict[int, float] = {}
        gain: dict[int, float] = {}
        run, spent = [], 0.0
        for t in self.tests:
            if t.saving > taken.get(t.bin, 0.0) and self.pays(t, taken.get(t.bin, 0.0)) and spent + t.cost <= self.budget:
                run.append(t)
                spent += t.cost
                taken[t.bin], gain[t.bin] = t.saving, t.value
        return run, spent, (self.horizon or 0.0) * sum(gain.values())

    def summary(self) -> dict[str, Any]:
        """What ``certify.json`` records of the plan: its order, horizon, stakes (the run's worst case and each route's) and
        best case."""
        run, spent, saving = self.best_case()
        return {
            "order": [[t.route.name, t.bin] for t in self.tests],
            "horizon": self.horizon,
            "stake": self.stake,
            "stakes": self.stakes,
            "best_case": {"tests": len(run), "spend": spent, "routed_saving": saving},
        }

    def lines(self, bins: SigmaBins, passes: float) -> list[str]:
        """The plan as the start banner and the log print it: expected spend, break-even, best and worst case."""
        paying = self.paying
        if self.horizon is None or not paying:
            return []
        first, stakes = paying[0], self.stakes
        run, spent, saving = self.best_case()
        worst = "" if self.stake == math.fsum(stakes.values()) else f", held to the budget {self.budget:.0f}"
        return [
            f"plan: {len(paying)} of {len(self.tests)} (route, σ bin) tests can pay back over the run's {self.horizon:g} later passes, "
            f"best saving per cost first; first {first.route.name} {bins.label(first.bin)} (σ mass {first.mass:.3f}: saves "
            f"{self.horizon * first.value:.1f} if safe, costs {first.cost:.1f})",
            f"  expected spend: {math.fsum(stakes.values()) * self.first_look:.1f} if every route's first test is clearly not safe "
            f"(its first look), {spent:.1f} if every test is safe; break-even: a safe first test pays its cost back after "
            f"{first.cost / first.value:.0f} later passes",
            f"  best case (every test safe, {len(run)} within the budget {self.budget:.0f}): spend {spent:.1f}, routed saving "
            f"{saving:.1f}, net {saving - spent:+.1f} ({pct_of(saving - spent, passes)} of the run)",
            f"  worst case: net {-self.stake:.1f} ({pct_of(-self.stake, passes)}): every route's stake lost "
            f"({', '.join(f'{name} {cost:.1f}' for name, cost in stakes.items())}{worst}), its first test read to its last look "
            "and not safe; a route's further test starts only while what the route has spent and not won back by its own safe "
            "windows stays within its stake, whatever the other routes lose",
        ]


def pct_of(x: float, total: float) -> str:
    return f"{100.0 * x / total:+.2f} %" if total else "n/a"


def plan_tests(
    routes: Sequence[Arm],
    bins: SigmaBins,
    settings: CertifySettings,
    mass: Callable[[float, float], float],
    fraction: Callable[[Arm], float],
) -> Plan:
    """Every (route, bin) with sampler mass, ordered by value per cost (ties: the higher bin, then the deeper route)."""
    tests = []
    for arm in routes:
        f = fraction(arm)
        for b in range(len(bins)):
            m = mass(*bins.bounds(b))
            if m > 0.0:
                tests.append(Planned(arm, b, m, 1.0 - f, safe_cost(settings, f)))
    tests.sort(key=lambda t: (round(-t.value / t.cost, 12), -t.bin, t.route.ratio))  # equal to rounding: the higher bin first
    looks = settings.looks
    return Plan(tuple(tests), settings.horizon, settings.budget, looks.at[0] / looks.first_safe)


class Certifier:
    """Runs the planned tests over one :class:`DrawSource`; see the module docstring for the rules."""

    def __init__(
        self,
        source: DrawSource,
        routes: Sequence[Arm],
        bins: SigmaBins,
        settings: CertifySettings,
        mass: Callable[[float, float], float],
        progress: Progress | None = None,
        prior: Sequence[BinTest] = (),
    ):
        problems = settings_problems(settings)
        if source.num_images() < settings.looks.last:
            problems.append(f"images: the last look needs {settings.looks.last} probe images, the source has {source.num_images()}")
        if not routes or any(a.kind != "latent" for a in routes):
            problems.append("routes: at least one latent route arm, and only latent arms")
        if problems:
            raise ValueError("certify:\n  - " + "\n  - ".join(problems))
        self.source, self.bins, self.settings, self.mass = source, bins, settings, mass
        self.routes = tuple(sorted(routes, key=lambda a: -a.ratio))
        self.progress = progress or (lambda spent, text: None)
        rng = np.random.default_rng(_key(settings.seed, 0x0D3E))
        self.order = {b: [int(i) for i in rng.permutation(source.num_images())] for b in range(len(bins))}
        self.tests: list[BinTest] = []
        self.prior = {(t.route, t.bin, t.spot): t for t in prior}
        self.notes: list[str] = []
        self.spent = 0.0
        self.spent_on: dict[str, float] = {}  # each route's share of ``spent`` (its tests' natives included): its stake's ledger
        self.plan = plan_tests(self.routes, bins, settings, mass, source.cost)

    def _mass(self, b: int) -> float:
        lo, hi = self.bins.bounds(b)
        return self.mass(lo, hi)

    def _new_test(self, route: Arm, b: int, spot: bool = False) -> BinTest:
        """The (route, bin) test, continuing a prior run's evidence when there is one (a test a prior run did not
        finish, for its budget, stake or horizon, is open again: more images continue its confidence sequence)."""
        test = self.prior.pop((route.name, b, spot), None)
        if test is None:
            lo, hi = self.bins.bounds(b)
            test = BinTest(route.name, route.ratio, b, lo, hi, self._mass(b) * (1.0 - self.source.cost(route)), spot=spot)
        elif test.verdict in UNFINISHED:
            test.verdict = None
        self.tests.append(test)
        return test

    # -- evidence -----------------------------------------------------------------------------------

    def _image_cost(self, route: Arm) -> float:
        """One more image for a test of ``route``: D native passes and D of the route."""
        return self.settings.draws * (1.0 + self.source.cost(route))

    def _need(self, route: Arm, images: int) -> float:
        """The evidence a test of ``route`` with ``images`` images still needs for a safe read."""
        return max(self.settings.looks.first_safe - images, 0) * self._image_cost(route)

    def _arm(self, name: str) -> Arm:
        return next(a for a in self.routes if a.name == name)

    def _add_image(self, t: BinTest) -> bool:
        """One more image for ``t`` (the next of its bin's seeded order); False when over budget."""
        arm, k = self._arm(t.route), len(t.values)
        image = self.order[t.bin][k]
        if self.spent + self._image_cost(arm) > self.settings.budget:
            return False
        sums = PairedSums()
        self.source.draw_pairs(image, t.bin, [arm], sums.add)
        t.values.append(sums.excess(t.route))
        t.images.append(image)
        t.cost += self.settings.draws * self.source.cost(arm)
        self.spent += self._image_cost(arm)
        self.spent_on[t.route] = self.spent_on.get(t.route, 0.0) + self._image_cost(arm)
        self.progress(self.spent, f"{self.bins.label(t.bin)} {t.route} n={k + 1}")
        return True

    def _settle(self, t: BinTest) -> None:
        """Read ``t`` look by look to its verdict (``budget`` when the budget ends first)."""
        looks = self.settings.looks
        while t.open:
            target = looks.next_look(len(t.values)) or len(t.values)
            while len(t.values) < target:
                if not self._add_image(t):
                    self._end(t, BUDGET)
                    return
            t.bound = read(t.values, looks, self._level(t), self.settings.margin)
            t.verdict = verdict(t.bound, self.settings.margin, looks, self._level(t))
        if t.spot and t.verdict == SAFE:
            t.verdict = SPOT_SAFE
        elif not t.spot:
            self.family.settle((t.route, t.bin), t.safe)

    def _end(self, t: BinTest, why: str) -> None:
        t.verdict = why
        t.bound = read(t.values, self.settings.looks, self._level(t), self.settings.margin) if len(t.values) >= 2 else None

    def _level(self, t: BinTest) -> float:
        """The test's false-safe level: its share of the run's family (``sequential.Family``); a spot check, never
        routed, is read at α."""
        return self.settings.looks.alpha if t.spot else self.family.level((t.route, t.bin))

    # -- the plan -----------------------------------------------------------------------------------

    def _taken(self, b: int) -> float:
        """The saving per routed pass a route already safe in bin ``b`` gives it (the deepest: its rule comes first)."""
        return max((1.0 - self.source.cost(self._arm(t.route)) for t in self.tests if t.safe and t.bin == b), default=0.0)

    def won(self, route: str | None = None) -> float:
        """What the safe windows so far save over the horizon (0 without one); ``route``: its own windows' share.

        A bin's saving (its deepest safe route's: that rule comes first) is shared by increments: each route safe there
        is credited what it saves beyond the milder routes safe there. The shares add up to the bin's saving, and a share
        once won is never taken back, since in a run a milder route is not tested on a bin a deeper one is safe on."""
        total = 0.0
        for b in range(len(self.bins)):
            safe = sorted((1.0 - self.source.cost(self._arm(t.route)), t.route) for t in self.tests if t.safe and t.bin == b)
            below = 0.0
            for saving, name in safe:
                if route is None or name == route:
                    total += self._mass(b) * (saving - below)
                below = saving
        return (self.settings.horizon or 0.0) * total

    def _blocked(self, p: Planned) -> str | None:
        """Why the planned test gets no evidence now; None: run it.

        ``cost``: a deeper route already safe in its bin routes it (its rule comes first), or, in a run (a horizon),
        its window would not save back the evidence it still needs (its own bin's mass only, less what a deeper safe
        route takes there). ``budget``: in a run, that evidence does not fit what is left of the budget (without a
        horizon, not even one more image does: the ``certify`` command may leave a test open for a later run to
        continue). ``stake``: in a run, its route would have more at risk than the route's stake (what the route has spent
        and not yet won back by its own safe windows, plus this evidence): a route's failure blocks no other route.
        """
        started = self.test(p.route.name, p.bin)
        images = len(started.values) if started is not None else 0
        need, horizon, taken = self._need(p.route, images), self.settings.horizon, self._taken(p.bin)
        if p.saving <= taken or (horizon is not None and horizon * p.mass * (p.saving - taken) < need):
            return COST
        if self.spent + (need if horizon is not None else self._image_cost(p.route)) > self.settings.budget:
            return BUDGET
        route = p.route.name
        if horizon is not None and self.spent_on.get(route, 0.0) - self.won(route) + need > self.plan.stakes.get(route, 0.0) + 1e-9:
            return STAKE
        return None

    def _pruned(self, p: Planned) -> bool:
        """Between two bins of its route that ended ``unsafe`` or ``futile``: the excess is taken to have one hump in σ,
        so the bins it is above ε on are one interval and the bin is not tested. Futile brackets too: at the first look
        (2 images) the lower bound almost never confirms excess, so a clearly unsafe bin stops futile there, and
        confirmed brackets alone would prune almost nothing. A futile bin may be safe (a heavy probe among few), so this
        can prune safe bins: it costs power, never soundness (an untested bin is never safe). An inconclusive bin
        brackets nothing, nor does the σ = 1 endpoint (its own estimand)."""
        lo, hi = self.bins.bounds(p.bin)
        brackets = [
            t
            for t in self.tests
            if t.route == p.route.name and t.verdict in (UNSAFE, FUTILE) and not t.spot and not self.bins.is_endpoint(t.bin)
        ]
        return any(t.hi <= lo for t in brackets) and any(t.lo >= hi for t in brackets)

    # -- the search ---------------------------------------------------------------------------------

    def run(self) -> list[BinTest]:
        self.family = Family.both_ends(self._chains(), self.settings.looks.alpha)
        for route, b in self.family.keys:  # a resumed run's safe tests pass their level on again
            if (prior := self.prior.get((route, b, False))) is not None and prior.safe:
                self.family.settle((route, b), True)
        for route, b, _ in [key for key in self.prior if not key[2]]:  # a resumed run's tests: settled ones stand, the rest reopen
            self._new_test(self._arm(route), b)
        while True:
            pending = [(p, self._blocked(p)) for p in self.plan.tests if not self._done(p) and not self._pruned(p)]
            runnable = next((p for p, why in pending if why is None), None)
            if runnable is None:
                break
            self._settle(self.test(runnable.route.name, runnable.bin) or self._new_test(runnable.route, runnable.bin))
        for p, why in pending:
            self._end(self.test(p.route.name, p.bin) or self._new_test(p.route, p.bin), why or BUDGET)
        for t in self.tests:
            if t.open:  # resumed evidence outside this plan (a bin without mass here)
                self._end(t, BUDGET)
        self._spot_checks()
        self._note_unfinished()
        self._note_violations()
        return self.tests

    def _chains(self) -> list[tuple[list[tuple[str, int]], list[tuple[str, int]]]]:
        """Per route, its two chains in the family (``safe_read.Family.both_ends``): its planned bins in the plan's
        order, and the same bins from the lowest up; both fixed before any evidence."""
        chains = []
        for a in self.routes:
            planned = [p.bin for p in self.plan.tests if p.route == a]
            chains.append(([(a.name, b) for b in planned], [(a.name, b) for b in sorted(planned)]))
        return chains

    def _done(self, p: Planned) -> bool:
        t = self.test(p.route.name, p.bin)
        return t is not None and not t.open

    def _spot_checks(self) -> None:
        """``spot_checks`` bins evenly spread over each route's pruned bins (between two that ended unsafe or futile), within the budget."""
        for arm in self.routes:
            pruned = [
                p.bin
                for p in sorted(self.plan.tests, key=lambda p: -p.bin)
                if p.route == arm and self._pruned(p) and not self.test(arm.name, p.bin)
            ]
            n = min(self.settings.spot_checks, len(pruned))
            for i in sorted({int(round(x)) for x in np.linspace(0, len(pruned) - 1, n)} if n else ()):
                t = self._new_test(arm, pruned[i], spot=True)
                if self.spent + self._need(arm, len(t.values)) > self.settings.budget:
                    self._end(t, BUDGET)
                else:
                    self._settle(t)

    def _note_unfinished(self) -> None:
        for why, text in (
            (BUDGET, f"the budget of {self.settings.budget:g} native-step equivalents cannot finish them (not safe)"),
            (
                COST,
                "a deeper route already routes the bin"
                + (
                    f", or a safe window would not save its evidence back over the run's {self.settings.horizon:g} later passes"
                    if self.settings.horizon is not None
                    else ""
                )
                + " (not safe)",
            ),
            (
                STAKE,
                "not started: its route would have more than its stake at risk, spent and not won back by its own windows (stakes: "
                + ", ".join(f"{name} {cost:.1f}" for name, cost in self.plan.stakes.items())
                + "; not safe)",
            ),
        ):
            names = [f"{t.route} {self.bins.label(t.bin)}" for t in self.tests if t.verdict == why]
            if names:
                self.notes.append(f"{why}: {', '.join(names)}: {text}")

    def test(self, route: str, bin_: int) -> BinTest | None:
        return next((t for t in self.tests if t.route == route and t.bin == bin_ and not t.spot), None)

    def _note_violations(self) -> None:
        for t in self.tests:
            if t.verdict == SPOT_SAFE:
                self.notes.append(
                    f"{t.route} {self.bins.label(t.bin)}: a spot check between two bins that ended unsafe or futile is safe: the excess has more "
                    "than one hump in σ there; not routed, the bins pruned around it were not tested"
                )


def run_certify(
    source: DrawSource,
    routes: Sequence[Arm],
    bins: SigmaBins,
    settings: CertifySettings,
    mass: Callable[[float, float], float],
    progress: Progress | None = None,
    provenance: dict[str, Any] | None = None,
    prior: Sequence[BinTest] = (),
) -> CertifyResult:
    """Certify and collect the result, with the wall time in the provenance; ``prior`` (a saved
    result's tests, :func:`load_tests`) is evidence to continue, not to redo."""
    t0 = time.perf_counter()
    certifier = Certifier(source, routes, bins, settings, mass, progress, prior)
    tests = certifier.run()
    prov = {**(provenance or {}), "wall_s": round(time.perf_counter() - t0, 2), "code_revision": code_revision()}
    return CertifyResult(bins, certifier.routes, settings, tests, certifier.spent, certifier.notes, prov, certifier.plan)


def load_tests(blob: dict[str, Any]) -> list[BinTest]:
    """The tests of a saved ``certify.json`` (untested rows are not evidence and are skipped)."""
    tests = []
    for row in blob["bins"]:
        if row["verdict"] == UNTESTED:
            continue
        b = row["bound"]
        bound = (
            None
            if b is None
            else Bound(b["n"], *(math.inf if b[k] is None else b[k] for k in ("mean", "sd", "lower", "upper")), b.get("level", math.nan))
        )
        evidence = row["evidence"]
        tests.append(
            BinTest(
                row["route"],
                row["ratio"],
                row["bin"],
                row["lo"],
                row["hi"],
                row["value"],
                row["spot_check"],
                list(evidence["images"]),
                list(evidence["excess"]),
                bound,
                row["verdict"],
                row["cost"],
            )  # fmt: skip
        )
    return tests


@dataclass(frozen=True)
class Verdicts:
    """A certify result as the window rules read a map (``windows.stack_windows``): routes, one row per
    (route, bin) with ``arm``/``bin``/``lo``/``hi``/``safe``, and ``row(arm, bin)``."""

    result: CertifyResult

    @property
    def bins(self) -> SigmaBins:
        return self.result.bins

    @property
    def rows(self) -> list[BinTest]:
        """Every (route, bin) row; a spot check of a pruned bin is never safe (``spot-safe``: never a window)."""
        return [t for a in self.result.routes for t in self.result.rows(a)]

    def routes(self, setting: tuple[str, str] = PLAIN) -> list[Arm]:
        return [a for a in self.result.routes if a.setting == setting]

    def row(self, arm: str, bin_: int) -> BinTest:
        return next(t for t in self.rows if t.arm == arm and t.bin == bin_)


def windows_toml(result: CertifyResult, command: str = "", date: str | None = None) -> str:
    """The plugin TOML of the certified windows (``downscale_config=``), with the method in its header."""
    backend = result.provenance.get("backend", {})
    stack = stack_windows(Verdicts(result))  # type: ignore[arg-type]  # duck-typed: the rows a map's window rules read
    _, _, described = probe_header(backend)
    s = result.settings
    date = date or utc_now()
    header = [
        "# downscale-plugin windows, written by the certifier (certify).",
        *described,
        f"# paired draws D = {s.draws} per (image, bin), looks at {list(s.looks.at)} images, seed {s.seed}; bins: {result.bins.spec()}",
        f"# margin ε = {s.margin:g}; {describe_safe_read(s.looks, s.margin)}; untested bins and spot checks of pruned bins are not routed",
        f"# cost: {result.spent:.1f} native-step equivalents (budget {s.budget:g}); date: {date}",
        f"# command: {command or '?'}",
    ]
    routes, unscoped = [], []
    for w in stack.windows:
        entries, notes = tier_entries(w, backend)
        routes += entries
        unscoped += notes
    header.append(f"# {scope_text(backend)}")
    header += [f"# note: {n}" for n in (*stack.notes, *result.notes, *unscoped)]
    method = (
        f"certify (paired noise, D = {s.draws}, looks {list(s.looks.at)}, safe from {s.looks.first_safe} images, "
        f"heavy-tail calibrated safe read, false-safe ≤ {s.looks.alpha:g} family-wise)"
    )
    images = max((len(t.values) for t in result.tests), default=0) or None
    return render_windows(backend, stack, header, method, s.margin, images, date, routes=routes)


def scope_text(backend: dict) -> str:
    """Which buckets the certified windows serve: the tiers the probes were measured on, and no other."""
    tiers = measured_tiers(backend)
    if not tiers:
        return "scope: no arch or probe grid recorded; the windows name no tier and are not routed"
    measured = ", ".join(f"{h}x{w} (tier {edge:g} px)" for (h, w), edge in tiers)
    return f"measured on buckets: {measured}; serves: buckets within the run's tier_tolerance of {', '.join(f'{round(e)}' for _, e in tiers)} px only"


def full_map_cost(images: int, draws: int, bins: int, fractions: Sequence[float]) -> float:
    """Native-step equivalents of the full map on the same grids: N × bins × D × (2 natives + Σ route fractions)."""
    return float(images * bins * draws * (2.0 + math.fsum(fractions)))
