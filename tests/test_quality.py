"""Twin runs (hosts/lab/twin.py) and the quality study's statistics (quality.py,
benchmarks/bench_quality.py's read-offs) on synthetic inputs."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from downscale_plugin.config import load_config
from downscale_plugin.flops import FlopModel
from downscale_plugin.hosts.lab.adapter import LabPlugin
from downscale_plugin.hosts.lab.twin import TwinRun, equal_compute_steps, twin_step
from downscale_plugin.lab.data import LabData, LabDataConfig
from downscale_plugin.lab.model import LabModelConfig, build_model, flop_shape
from downscale_plugin.lab.trainer import step_seed, train_lora
from downscale_plugin.mapping.paired import coupled_small_noise
from downscale_plugin.quality import first_reach, monotone_fit, paired_interval, ratio_interval, value_at

TINY = LabModelConfig(hidden_size=32, num_heads=2, double_layers=1, single_layers=1, latent_channels=4,
                      text_tokens=4, text_dim=16, pooled_dim=8)  # fmt: skip
BUCKETS = ((64, 64), (64, 96), (96, 64))
# At arch flux the 64x64 px bucket (16x16 latent) is the 128 px tier: the route applies to it alone.
ROUTES = [{"route": "128:96", "sigma_min": 0.0}]
NOTHING = [{"route": "128:96", "sigma_min": 0.0, "sigma_max": 1e-6}]  # through the hook, never routed


@pytest.fixture(scope="module")
def lab():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build_model(TINY, seed=0), LabData(LabDataConfig(buckets=BUCKETS, latent_channels=TINY.latent_channels))
    torch.set_num_threads(threads)


def _run(lab, routes, twin: bool, steps: int = 8, seed: int = 3, record: list | None = None):
    model, data = lab
    plugin = None if routes is None else LabPlugin.for_lab(load_config(table={"arch": "flux", "routes": routes}), TINY, data)
    scope = TwinRun(seed, FlopModel(*flop_shape(TINY))) if twin else None
    result = train_lora(model, data, steps=steps, lr=1e-2, rank=2, seed=seed, hook_installer=plugin and plugin.installer,
                        step_scope=scope)  # fmt: skip
    if record is not None:
        record.append(scope)
    return result, plugin


def test_twin_that_routes_nothing_is_bitwise_the_native_twin(lab) -> None:
    native, _ = _run(lab, None, twin=True)
    nothing, plugin = _run(lab, NOTHING, twin=True)
    assert plugin.accounting.total_steps == 8 and plugin.accounting.demote_fraction() == 0.0
    assert nothing.losses == native.losses
    assert all(torch.equal(native.deltas[k], nothing.deltas[k]) for k in native.deltas)


def test_twins_share_every_steps_sigma_and_differ_only_on_routed_steps(lab) -> None:
    """Twin mode pairs σ on every step; without it the routed run's σ drift from the first routed step on."""
    _, reference = _run(lab, NOTHING, twin=True)
    native, _ = _run(lab, None, twin=True)
    twins: list[TwinRun] = []
    routed, plugin = _run(lab, ROUTES, twin=True, record=twins)
    flags = [t.rule_index >= 0 for t in plugin.trace]
    assert any(flags) and not all(flags)
    run_flops, native_flops = twins[0].flops(plugin)
    assert 1 - run_flops[-1] / native_flops[-1] == pytest.approx(plugin.accounting.flop_saving())
    run_steps, native_steps = (
        torch.tensor(run_flops, dtype=torch.float64).diff(prepend=torch.zeros(1)),
        torch.tensor(native_flops, dtype=torch.float64).diff(prepend=torch.zeros(1)),
    )
    assert torch.equal(run_steps < native_steps, torch.tensor(flags))  # a routed step costs less, a native one the same
    assert [t.sigmas for t in plugin.trace] == [t.sigmas for t in reference.trace]
    first = flags.index(True)
    assert routed.losses[:first] == native.losses[:first] and routed.losses[first] != native.losses[first]

    _, plain_reference = _run(lab, NOTHING, twin=False)
    _, plain = _run(lab, ROUTES, twin=False)
    assert [t.sigmas for t in plain.trace] != [t.sigmas for t in plain_reference.trace]


def test_twin_step_hands_the_native_draw_or_its_paired_transform() -> None:
    batch = {"latents": torch.zeros(2, 4, 16, 24)}
    with twin_step(5, 7, batch):
        native = torch.randn_like(batch["latents"])
    torch.manual_seed(step_seed(5, 7))
    expected = torch.randn(2, 4, 16, 24)
    assert torch.equal(native, expected)
    with twin_step(5, 7, batch):
        small = torch.randn_like(torch.zeros(2, 4, 12, 18))
    assert torch.equal(small, coupled_small_noise(expected, (12, 18)))
    for seed, step in ((5, 8), (6, 7)):  # another step, another training seed: another stream
        with twin_step(seed, step, batch):
            assert not torch.equal(torch.randn_like(batch["latents"]), native)


def test_twin_small_noise_is_unit_white_noise() -> None:
    """Over micro-steps, the routed step's noise is N(0, I) at the small grid (mean 0, identity covariance)."""
    batch = {"latents": torch.zeros(1, 8, 8, 8)}
    samples = []
    for k in range(300):
        with twin_step(1, k, batch):
            samples.append(torch.randn_like(torch.zeros(1, 8, 6, 6)).reshape(8, 36))
    x = torch.cat(samples).double()  # 2 400 draws of a 36-cell grid
    cov = x.T @ x / x.shape[0]
    assert x.mean().abs() < 0.02
    assert (cov.diagonal() - 1).abs().max() < 0.12
    off = cov - torch.diag(cov.diagonal())
    assert off.abs().max() < 0.1 and off.abs().mean() < 0.025


def test_paired_interval_is_the_student_t_interval() -> None:
    iv = paired_interval([1.0, 2.0, 3.0, 4.0])
    half = 3.182446305284263 * math.sqrt(5 / 3) / 2  # t(0.975, 3) · sd / √n
    assert iv.mean == 2.5 and iv.lo == pytest.approx(2.5 - half) and iv.hi == pytest.approx(2.5 + half)
    assert iv.excludes_zero and not paired_interval([-1.0, 1.0, 0.5]).excludes_zero
    assert paired_interval([0.3]).lo is None
    wide = paired_interval([1.0, 2.0, 3.0, 4.0], level=0.99)
    assert wide.lo < iv.lo and wide.hi > iv.hi
    with pytest.raises(ValueError, match="level"):
        paired_interval([1.0, 2.0], level=1.0)


def test_value_at_interpolates_and_refuses_to_extrapolate() -> None:
    xs, ys = [0.0, 10.0, 20.0], [1.0, 0.5, 0.25]
    assert value_at(xs, ys, 5.0) == pytest.approx(0.75) and value_at(xs, ys, 15.0) == pytest.approx(0.375)
    assert value_at(xs, ys, 20.0) == 0.25 and value_at(xs, ys, 0.0) == 1.0
    assert value_at(xs, ys, 20.5) is None and value_at(xs, ys, -1.0) is None
    with pytest.raises(ValueError, match="non-decreasing"):
        value_at([0.0, 2.0, 1.0], ys, 1.0)
    assert equal_compute_steps(64, 0.5) == 141 and equal_compute_steps(64, 0.0, extra=1.0) == 64


def _bench():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_quality.py"
    spec = importlib.util.spec_from_file_location("bench_quality", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_quality"] = module  # its dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def test_monotone_fit_first_reach_and_ratio_interval() -> None:
    assert monotone_fit([3.0, 1.0, 2.0, 0.0]) == pytest.approx([3.0, 1.5, 1.5, 0.0])
    assert monotone_fit([1.0, 2.0, 3.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert first_reach([0.0, 10.0, 20.0], [1.0, 0.6, 0.2], 0.4) == pytest.approx(15.0)
    assert first_reach([0.0, 10.0], [1.0, 0.6], 0.5) is None and first_reach([5.0, 10.0], [0.3, 0.2], 0.5) == 5.0
    iv = ratio_interval([0.5, 0.5, 2.0, 2.0], [True, True, True, False])
    assert iv.ratio == pytest.approx(1.0) and iv.lo < 1.0 < iv.hi and iv.reached == 3 and iv.seeds == 4
    assert iv.boot_lo <= 1.0 <= iv.boot_hi and iv.lo < iv.boot_lo  # the bootstrap's percentile interval is the narrower at n = 4
    with pytest.raises(ValueError, match="positive ratio"):
        ratio_interval([0.0], [True])


def test_stored_runs_record_the_code_and_stale_ones_are_refused() -> None:
    bench = _bench()
    now = bench.code_state()
    assert bench.stale_reason({"code": dict(now)}, now) is None
    assert "no code revision" in bench.stale_reason({}, now)
    other = "" if now["uncommitted"] else "feed"
    assert "another uncommitted change" in bench.stale_reason({"code": {**now, "uncommitted": other}}, now)
    assert "does not descend" in bench.stale_reason({"code": {"revision": "0" * 40, "uncommitted": now["uncommitted"]}}, now)


def test_two_seeds_share_no_sigma_or_noise_draw(lab, monkeypatch) -> None:
    """Every twin micro-step draws from its own stream: over two training seeds' runs, no σ and no noise
    tensor repeats, across seeds or steps (runs made before the step-seed hash shared both)."""
    from downscale_plugin.lab import flux_train_utils

    original = flux_train_utils.get_noisy_model_input_and_timesteps
    draws: dict[int, list[tuple[float, tuple[float, ...]]]] = {0: [], 1: []}
    seed_now = [0]

    def record(args, noise_scheduler, latents, noise, device, dtype):
        out = original(args, noise_scheduler, latents, noise, device, dtype)
        draws[seed_now[0]].append((float(out[2].flatten()[0]), tuple(noise.flatten()[:8].tolist())))
        return out

    monkeypatch.setattr(flux_train_utils, "get_noisy_model_input_and_timesteps", record)
    for seed in (0, 1):
        seed_now[0] = seed
        _run(lab, None, twin=True, steps=24, seed=seed)
    sigmas = [d[0] for seed in (0, 1) for d in draws[seed]]
    noises = [d[1] for seed in (0, 1) for d in draws[seed]]
    assert len(draws[0]) == len(draws[1]) == 24
    assert len(set(sigmas)) == len(sigmas) and len(set(noises)) == len(noises)


def test_run_to_budget_validates_on_the_flop_grid(lab) -> None:
    """A native twin at budget 1 stops at exactly its steps; a routed one runs past them to its budget,
    validated once per 1/points of the native FLOPs it crosses."""
    from downscale_plugin.hosts.lab.twin import run_to_budget

    model, data = lab
    flop_model = FlopModel(*flop_shape(TINY))

    def validate(deltas: dict) -> torch.Tensor:
        return torch.tensor([float(sum(d.abs().sum() for d in deltas.values()))])

    common = dict(seed=2, native_steps=8, points=4, lr=1e-2, rank=2, validate=validate, flop_model=flop_model)
    native = run_to_budget(model, data, None, budget=1.0, **common)
    assert len(native.tokens_run) == 8 and native.flops[-1] == pytest.approx(native.native_flops)
    assert native.steps[0] == 0 and native.steps[-1] == 8 and len(native.steps) == 5  # step 0, then each quarter
    assert native.val[0] == 0.0 and len(native.items) == 5
    plugin = LabPlugin.for_lab(load_config(table={"arch": "flux", "routes": ROUTES}), TINY, data)
    routed = run_to_budget(model, data, plugin, budget=1.5, **common)
    assert routed.native_flops == native.native_flops  # the same seed: the same batches
    assert 1.5 * native.native_flops <= routed.flops[-1] < 1.5 * native.native_flops + flop_model.flops(max(routed.tokens_run))
    assert len(routed.tokens_run) > 8 and len(routed.steps) == 1 + 6  # 6 quarters in 1.5 units
    marks = [k * native.native_flops / 4 for k in range(1, 7)]
    assert all(f >= m * (1 - 1e-9) for f, m in zip(routed.flops[1:], marks, strict=True))


def test_schedule_follows_the_flops_spent_not_the_steps(lab) -> None:
    """``run_to_budget``'s schedule is read at each step's FLOPs spent ÷ the native unit (a routed twin
    decays over more, cheaper steps), from 0 at the first step; a zero schedule trains nothing."""
    from downscale_plugin.hosts.lab.twin import cosine_decay, run_to_budget

    model, data = lab
    flop_model = FlopModel(*flop_shape(TINY))

    def validate(deltas: dict) -> torch.Tensor:
        return torch.tensor([float(sum(d.abs().sum() for d in deltas.values()))])

    common = dict(seed=2, native_steps=8, points=4, lr=1e-2, rank=2, validate=validate, flop_model=flop_model, budget=1.0)
    plugin = LabPlugin.for_lab(load_config(table={"arch": "flux", "routes": ROUTES}), TINY, data)
    read: list[float] = []
    routed = run_to_budget(model, data, plugin, schedule=lambda u: read.append(u) or 0.0, **common)
    assert routed.val[-1] == 0.0  # lr × 0 from the first step on
    spent = [sum(flop_model.flops(t) for t in routed.tokens_run[:k]) / routed.native_flops for k in range(len(routed.tokens_run) + 1)]
    assert read == pytest.approx(spent)  # at construction (0 spent), then after each step, that step included
    assert len(routed.tokens_run) > 8  # more steps than the native twin over the same schedule
    assert cosine_decay(0.0) == 1.0 and cosine_decay(0.5) == pytest.approx(0.5) and cosine_decay(1.0) == cosine_decay(1.3) == 0.0
    cosine = run_to_budget(model, data, None, schedule=cosine_decay, **common)
    constant = run_to_budget(model, data, None, **common)
    assert 0.0 < cosine.val[-1] < constant.val[-1]  # a decaying lr moves the adapter less
