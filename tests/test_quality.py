"""Twin runs (hosts/lab/twin.py) and the quality study's statistics (hosts/lab/quality.py,
benchmarks/bench_quality.py's read-offs) on synthetic inputs."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from downscale_plugin.config import load_config
from downscale_plugin.flops import FlopModel
from downscale_plugin.hosts.lab.adapter import LabPlugin
from downscale_plugin.hosts.lab.quality import paired_interval, value_at, variance_ratio
from downscale_plugin.hosts.lab.twin import TwinRun, equal_compute_steps, twin_step
from downscale_plugin.lab.data import LabData, LabDataConfig
from downscale_plugin.lab.model import LabModelConfig, build_model, flop_shape
from downscale_plugin.lab.trainer import step_seed, train_lora
from downscale_plugin.mapping.paired import coupled_small_noise

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
    assert variance_ratio([0.0, 1.0], [0.0, 4.0]) == pytest.approx(16.0) and variance_ratio([1.0], [0.0, 1.0]) is None
    assert equal_compute_steps(64, 0.5) == 141 and equal_compute_steps(64, 0.0, extra=1.0) == 64


def _bench():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_quality.py"
    spec = importlib.util.spec_from_file_location("bench_quality", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _synthetic_run(arm: str, seed: int, flops_per_step: float, slope: float, steps: int, offset: float) -> dict:
    """A run whose validation loss falls linearly in its steps: val = 1 − slope·step + offset."""
    points = range(0, steps + 1, 4)
    return {
        "arm": arm, "seed": seed, "routed_share": 0.0 if arm == "native" else 1.0, "flop_saving": 1.0 - flops_per_step,
        "flop_saving_planned": 1.0 - flops_per_step, "cpu_s_at_steps": 8.0 * flops_per_step,
        "curve": [{"step": s, "flops": s * flops_per_step, "cpu_s": s * flops_per_step, "val": 1.0 - slope * s + offset} for s in points],
    }  # fmt: skip


def test_equal_steps_and_equal_compute_read_offs_on_synthetic_runs() -> None:
    """A routed arm at half the FLOPs per step and 0.8× the progress per step: worse at equal steps,
    better at equal compute (it gets twice the steps), by amounts known in closed form."""
    bench = _bench()
    steps, runs = 8, {}
    for seed, offset in enumerate((0.0, 0.01, -0.02)):  # a seed lottery the pairing must cancel
        runs["native", seed] = _synthetic_run("native", seed, 1.0, 0.01, steps, offset)
        runs["all0.5", seed] = _synthetic_run("all0.5", seed, 0.5, 0.008, 2 * steps + 4, offset + 0.001 * seed)
    s = bench.summarize(runs, steps, base_val=1.0)
    arm = s["arms"]["all0.5"]
    # equal steps: (1 − 0.064) − (1 − 0.08) = +0.016 (+ the seed-specific 0.001·seed); equal compute: 16 steps, 1 − 0.128 vs 1 − 0.08
    assert arm["equal_steps_per_seed"] == pytest.approx([0.016, 0.017, 0.018])
    assert arm["equal_compute_per_seed"] == pytest.approx([-0.048, -0.047, -0.046])
    assert arm["equal_steps"]["mean"] == pytest.approx(0.017) and arm["equal_steps"]["lo"] > 0
    assert arm["equal_compute"]["hi"] < 0 and arm["flop_saving"] == pytest.approx(0.5)
    assert arm["cpu_at_equal_compute_vs_native"] == pytest.approx(1.0) and arm["wall_saving"] == pytest.approx(0.5)
    assert s["native_improvement"] == pytest.approx(0.08 - (0.01 - 0.02) / 3)
    runs["all0.5", 1] = _synthetic_run("all0.5", 1, 0.5, 0.008, steps + 4, 0.0)  # stopped before the native FLOPs
    short = bench.summarize(runs, steps, base_val=1.0)["arms"]["all0.5"]
    assert short["equal_compute_missing_seeds"] == [1] and len(short["equal_compute_per_seed"]) == 2
