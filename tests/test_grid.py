"""Grid rule, area downsampling and the σ axis (DDPM t ↔ flow σ, host σ samplers and their CDFs)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import stats

from downscale_plugin.arch import ARCHS
from downscale_plugin.config import RouteRule
from downscale_plugin.grid import (
    area_downsample,
    area_weights,
    eligibility_table,
    rule_ratio,
    target_grid,
    tokens,
)
from downscale_plugin.hosts.sd_scripts.buckets import sd_scripts_buckets
from downscale_plugin.sigma import DdpmSampler, SigmaSampler, ddpm_alphas_cumprod, ddpm_t_to_sigma, flux_mu, sd3_law, sigma_to_ddpm_t

RESOLUTIONS = (512, 768, 1024, 1280)
RESO_STEPS = (32, 64)
RATIOS = (0.5, 0.75, 0.875)


def buckets(resolution: int, step: int) -> list[tuple[int, int]]:
    """sd-scripts buckets (W, H) px, with max_bucket_reso = 2 × resolution as SDXL/Flux configs set it."""
    return sd_scripts_buckets((resolution, resolution), min_size=256, max_size=2 * resolution, divisible=step)


def latent(bucket_wh: tuple[int, int], vae_factor: int) -> tuple[int, int]:
    w, h = bucket_wh
    assert w % vae_factor == 0 and h % vae_factor == 0
    return h // vae_factor, w // vae_factor


def aspect_bound(h: int, w: int, ratio: float, m: int) -> float:
    """Largest |th/tw − h/w| when each axis of (h·r, w·r) moves by at most m/2.

    th/tw is extreme at (h·r ± m/2)/(w·r ∓ m/2); subtracting h/w gives (m/2)(h + w) / (w (w·r ∓ m/2)),
    the larger of the two with the minus sign in the denominator.
    """
    return (m / 2) * (h + w) / (w * (w * ratio - m / 2))


# --- sd-scripts buckets -------------------------------------------------------------------------


def test_sd_scripts_buckets_match_host_arithmetic():
    got = sd_scripts_buckets((1024, 1024), min_size=256, max_size=1024, divisible=64)
    # max_bucket_reso 1024 at 1024²: every width w ≤ 1024 pairs with height 1024 (clamped).
    expected = sorted({(w, 1024) for w in range(256, 1025, 64)} | {(1024, w) for w in range(256, 1025, 64)})
    assert got == expected
    sdxl = buckets(1024, 64)
    for wh in [(1024, 1024), (832, 1216), (896, 1152), (768, 1344), (640, 1536), (1216, 832)]:
        assert wh in sdxl
    assert all(w * h <= 1024 * 1024 and w % 64 == 0 and h % 64 == 0 for w, h in sdxl)


# --- the grid rule over every real bucket, arch and ratio ----------------------------------------


@pytest.mark.parametrize("ratio", RATIOS, ids=lambda r: f"r{r:g}")
@pytest.mark.parametrize("arch", sorted(ARCHS), ids=str)
@pytest.mark.parametrize("step", RESO_STEPS, ids=lambda s: f"steps{s}")
@pytest.mark.parametrize("resolution", RESOLUTIONS, ids=lambda r: f"res{r}")
def test_target_grid_over_real_buckets(resolution, step, arch, ratio):
    spec = ARCHS[arch]
    m = spec.multiple
    for bucket in buckets(resolution, step):
        h, w = latent(bucket, spec.vae_factor)
        target = target_grid((h, w), ratio, spec)
        assert target is not None, (bucket, arch, ratio)  # every real bucket can shrink by ≤ 0.875
        th, tw = target
        assert th % m == 0 and tw % m == 0, (bucket, target)
        assert th * tw < h * w, (bucket, target)
        assert 0 < th <= h and 0 < tw <= w, (bucket, target)
        # each axis is the nearest multiple of m to the exact scaled size
        assert abs(th - h * ratio) <= m / 2 + 1e-9 and abs(tw - w * ratio) <= m / 2 + 1e-9, (bucket, target)
        assert abs(th / tw - h / w) <= aspect_bound(h, w, ratio, m) + 1e-12, (bucket, target)
        assert tokens((th, tw), spec) < tokens((h, w), spec), (bucket, target)


@pytest.mark.parametrize(
    ("arch", "latent_hw", "ratio"),
    [
        pytest.param("sdxl", (4, 4), 0.75, id="sdxl-rounds-back-to-native"),
        pytest.param("sdxl", (7, 7), 0.875, id="sdxl-rounds-up-past-native"),
        pytest.param("flux", (2, 2), 0.5, id="flux-vanishes"),
        pytest.param("flux", (2, 4), 0.875, id="flux-both-axes-round-back"),
        pytest.param("sd1", (1, 1), 0.5, id="sd1-single-pixel"),
        pytest.param("hunyuan_image", (4, 4), 0.875, id="hunyuan-rounds-back"),
    ],
)
def test_ineligible_bucket_has_no_target(arch, latent_hw, ratio):
    assert target_grid(latent_hw, ratio, ARCHS[arch]) is None


def test_eligibility_table_reasons():
    rules = (RouteRule(0.5, 0.9, native=1024, target=768), RouteRule(0.2, 0.4, scale=0.75))
    table = eligibility_table([(128, 128), (96, 96), (4, 4)], rules, ARCHS["sdxl"], 0.1)
    (a, b), (c, d), (e, f) = table
    assert (a.target_hw, b.target_hw) == ((96, 96), (96, 96)) and a.eligible and a.reason == ""
    assert not c.eligible and "1024 px tier" in c.reason and d.target_hw == (72, 72)
    assert not e.eligible and not f.eligible and "multiple of 4" in f.reason


# --- tiers --------------------------------------------------------------------------------------

RULE_1024_768 = RouteRule(0.5, None, native=1024, target=768)
SDXL_1024_BUCKETS = [(1024, 1024), (832, 1216), (1216, 832), (896, 1152), (1152, 896), (768, 1344), (1344, 768), (640, 1536)]


@pytest.mark.parametrize("arch", sorted(ARCHS), ids=str)
def test_tier_matching(arch):
    spec = ARCHS[arch]
    for bucket in SDXL_1024_BUCKETS:
        assert rule_ratio(RULE_1024_768, latent(bucket, spec.vae_factor), spec, 0.1) == 0.75, bucket
    for step in RESO_STEPS:
        for resolution in (512, 768):
            for bucket in buckets(resolution, step):
                if bucket[0] % spec.vae_factor or bucket[1] % spec.vae_factor:
                    continue
                assert rule_ratio(RULE_1024_768, latent(bucket, spec.vae_factor), spec, 0.1) is None, bucket
    # a 1024² run's extreme, clamped buckets have a smaller area (edge √(256·2048) ≈ 724 px): not in the tier
    assert rule_ratio(RULE_1024_768, latent((256, 2048), spec.vae_factor), spec, 0.1) is None
    assert rule_ratio(RULE_1024_768, latent((256, 2048), spec.vae_factor), spec, 0.3) == 0.75


def test_tier_tolerance_edges():
    flux = ARCHS["flux"]
    # edge = √(h·w)·8 px; within 10 % of 1024 is [921.6, 1126.4]
    assert rule_ratio(RULE_1024_768, (116, 116), flux, 0.1) == 0.75  # 928 px
    assert rule_ratio(RULE_1024_768, (114, 114), flux, 0.1) is None  # 912 px
    assert rule_ratio(RULE_1024_768, (140, 140), flux, 0.1) == 0.75  # 1120 px
    assert rule_ratio(RULE_1024_768, (142, 142), flux, 0.1) is None  # 1136 px
    assert rule_ratio(RouteRule(0.5, None, scale=0.6), (4, 4), flux, 0.1) == 0.6  # scale: every bucket


# --- area downsampling --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("shape", "target"),
    [
        pytest.param((2, 16, 128, 96), (96, 72), id="4d-flux"),
        pytest.param((1, 4, 64, 64), (32, 32), id="4d-half"),
        pytest.param((2, 16, 3, 64, 48), (56, 42), id="5d-video"),
    ],
)
def test_area_downsample_dtype_shape_and_exact_weights(shape, target, dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = area_downsample(x, target)
    assert y.dtype == dtype
    assert y.shape == (*shape[:-2], *target)
    # reference: the integral of the piecewise-constant input over each output cell, one cell at a time
    h, w = shape[-2:]
    sh, sw = h / target[0], w / target[1]
    xd = x.double()
    for i, j in ((0, 0), (target[0] - 1, target[1] - 1), (target[0] // 2, target[1] // 3)):
        wr = torch.tensor([max(0.0, min((i + 1) * sh, r + 1) - max(i * sh, r)) for r in range(h)], dtype=torch.float64)
        wc = torch.tensor([max(0.0, min((j + 1) * sw, c + 1) - max(j * sw, c)) for c in range(w)], dtype=torch.float64)
        cell = torch.einsum("...hw,h,w->...", xd, wr, wc) / (sh * sw)
        torch.testing.assert_close(y[..., i, j].double(), cell, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2)


def test_area_weights_rows_sum_to_one_and_columns_weigh_equally():
    for n_in, n_out in ((64, 48), (64, 56), (80, 70), (128, 96), (7, 3)):
        weights = area_weights(n_in, n_out)
        torch.testing.assert_close(weights.sum(1), torch.ones(n_out, dtype=torch.float64))
        torch.testing.assert_close(weights.sum(0), torch.full((n_in,), n_out / n_in, dtype=torch.float64))


def test_area_downsample_5d_is_per_frame():
    x = torch.randn(2, 4, 5, 32, 24, generator=torch.Generator().manual_seed(2))
    y = area_downsample(x, (16, 12))
    for t in range(5):
        assert torch.equal(y[:, :, t], area_downsample(x[:, :, t], (16, 12)))


@pytest.mark.parametrize(
    ("shape", "target"),
    [
        pytest.param((3, 4, 64, 64), (32, 32), id="x2"),
        pytest.param((3, 4, 64, 96), (16, 24), id="x4"),
        pytest.param((1, 2, 3, 64, 48), (32, 24), id="x2-5d"),
        pytest.param((2, 4, 60, 90), (20, 30), id="x3"),
    ],
)
def test_area_downsample_integer_factor_is_average_pooling(shape, target):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    y = area_downsample(x, target)
    pooled = F.avg_pool2d(x.reshape(-1, *shape[-2:]), shape[-1] // target[-1]).reshape(y.shape)
    torch.testing.assert_close(y, pooled, rtol=0, atol=1e-6)


@pytest.mark.parametrize("target", [(48, 48), (56, 56), (48, 56)])
def test_area_downsample_keeps_the_mean_at_fractional_ratios(target):
    x = torch.randn(16, 1, 64, 64, generator=torch.Generator().manual_seed(4)) + 3.0
    y = area_downsample(x, target)
    torch.testing.assert_close(y.double().mean(dim=(-1, -2)), x.double().mean(dim=(-1, -2)), rtol=0, atol=1e-6)


@pytest.mark.parametrize(("ratio", "std"), [(0.875, 0.6255), (0.75, 0.5833), (0.5, 0.5)])
def test_area_downsample_blurs_by_the_ratio_not_like_half(ratio, std):
    # White noise through an exact box of width 1/r: per axis the output variance is Σ w² over the
    # overlap weights (averaged over output phases). torch's area mode (adaptive pooling) gives 0.5
    # at all three ratios: it averages two whole cells per output at 0.875 and 0.75 alike.
    noise = torch.randn(64, 1, 64, 64, generator=torch.Generator().manual_seed(5))
    n = int(64 * ratio)
    assert area_downsample(noise, (n, n)).std().item() == pytest.approx(std, abs=0.005)
    assert F.interpolate(noise, size=(n, n), mode="area").std().item() == pytest.approx(0.5, abs=0.005)


# --- DDPM t ↔ flow σ ----------------------------------------------------------------------------


def test_ddpm_sigma_round_trip_and_monotone():
    ac = ddpm_alphas_cumprod()
    t = torch.arange(1000)
    sigma = ddpm_t_to_sigma(t, ac)
    assert sigma.dtype == torch.float32
    assert torch.all(sigma[1:] > sigma[:-1])
    assert 0 < float(sigma[0]) and float(sigma[-1]) < 1
    assert torch.equal(sigma_to_ddpm_t(sigma, ac), t)
    # midpoints just off the grid go to the nearer neighbour
    lo_side = sigma[:-1] + (sigma[1:] - sigma[:-1]) * 0.25
    hi_side = sigma[:-1] + (sigma[1:] - sigma[:-1]) * 0.75
    assert torch.equal(sigma_to_ddpm_t(lo_side, ac), t[:-1])
    assert torch.equal(sigma_to_ddpm_t(hi_side, ac), t[1:])
    assert sigma_to_ddpm_t(torch.tensor([0.0, 1.0]), ac).tolist() == [0, 999]


def test_ddpm_sigma_is_equal_snr():
    # diffusers' scaled_linear schedule, computed independently in numpy float64
    betas = np.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=np.float64) ** 2
    ac = np.cumprod(1.0 - betas)
    sigma = ddpm_t_to_sigma(torch.arange(1000), ddpm_alphas_cumprod()).double().numpy()
    # the flow x_σ = (1−σ)x + σε has SNR ((1−σ)/σ)²; DDPM's is ᾱ/(1−ᾱ)
    np.testing.assert_allclose(((1 - sigma) / sigma) ** 2, ac / (1 - ac), rtol=2e-6)


# --- host σ samplers ----------------------------------------------------------------------------


def test_flux_mu_endpoints():
    assert flux_mu((32, 32)) == pytest.approx(0.5)  # 256 packed tokens
    assert flux_mu((128, 128)) == pytest.approx(1.15)  # 4096 packed tokens


CLOSED_FORM = [
    pytest.param(SigmaSampler("uniform"), (128, 128), id="uniform"),
    pytest.param(SigmaSampler("sigmoid"), (128, 128), id="sigmoid"),
    pytest.param(SigmaSampler("sigmoid", sigmoid_scale=2.5), (128, 128), id="sigmoid-scale2.5"),
    pytest.param(SigmaSampler("shift", discrete_flow_shift=3.0), (128, 128), id="shift3"),
    pytest.param(SigmaSampler("shift", discrete_flow_shift=0.5, sigmoid_scale=0.7), (128, 128), id="shift0.5"),
    pytest.param(SigmaSampler("flux_shift"), (128, 128), id="flux_shift-1024"),
    pytest.param(SigmaSampler("flux_shift"), (64, 96), id="flux_shift-384x512"),
]


@pytest.mark.parametrize(("sampler", "hw"), CLOSED_FORM)
def test_closed_form_cdf_matches_samples(sampler, hw):
    x = sampler.sample(200_000, hw, generator=torch.Generator().manual_seed(5)).double().numpy()
    cdf = np.vectorize(lambda v: sampler.cdf(float(v), hw))
    assert stats.kstest(x, cdf).pvalue > 1e-3
    # mass() agrees with the empirical window frequency
    for lo, hi in [(0.65, 0.95), (0.5, None), (0.1, 0.3)]:
        inside = (x > lo) & (x < hi) if hi is not None else x > lo
        expected = sampler.mass(lo, hi, hw)
        assert abs(inside.mean() - expected) < 4 * math.sqrt(expected * (1 - expected) / len(x)) + 1e-9


@pytest.mark.parametrize(("sampler", "hw"), CLOSED_FORM)
def test_cdf_shape(sampler, hw):
    grid = np.linspace(0.0, 1.0, 201)
    values = [sampler.cdf(float(v), hw) for v in grid]
    assert values[0] == 0.0 and values[-1] == 1.0
    assert all(b > a for a, b in zip(values[1:-2], values[2:-1], strict=True))


def test_flux_shift_depends_on_latent_size():
    s = SigmaSampler("flux_shift")
    assert s.cdf(0.5, (128, 128)) < s.cdf(0.5, (32, 32))  # more tokens, larger μ, σ pushed up
    assert s.mass(0.65, 0.95, (128, 128)) > s.mass(0.65, 0.95, (32, 32))


def _diffusers_flow_match_sigmas(n: int, shift: float) -> np.ndarray:
    """FlowMatchEulerDiscreteScheduler.__init__: timesteps linspace(1, n, n)[::-1], σ = shifted t/n."""
    timesteps = np.linspace(1, n, n, dtype=np.float32)[::-1].copy()
    s = timesteps / n
    return shift * s / (1 + (shift - 1) * s)


@pytest.mark.parametrize("scheme", ["uniform", "logit_normal", "mode", "cosmap", "none"])
@pytest.mark.parametrize("shift", [1.0, 3.1582], ids=lambda s: f"shift{s:g}")
def test_scheduler_grid_mode_samples_lie_on_grid(scheme, shift):
    sampler = SigmaSampler("sigma", weighting_scheme=scheme, discrete_flow_shift=shift)
    grid = sampler.scheduler_sigmas()
    np.testing.assert_allclose(grid.numpy(), _diffusers_flow_match_sigmas(1000, shift), rtol=1e-6)
    x = sampler.sample(50_000, (128, 128), generator=torch.Generator().manual_seed(6))
    assert torch.isin(x, grid).all()
    assert not sampler.has_closed_form
    with pytest.raises(ValueError, match="no closed form"):
        sampler.cdf(0.5, (128, 128))


def test_scheduler_grid_uniform_scheme_hits_every_index_uniformly():
    sampler = SigmaSampler("sigma", weighting_scheme="uniform")
    grid = sampler.scheduler_sigmas()
    x = sampler.sample(200_000, (128, 128), generator=torch.Generator().manual_seed(7))
    idx = torch.searchsorted(-grid, -x)  # the grid decreases
    assert torch.equal(grid[idx], x)
    counts = torch.bincount(idx, minlength=1000).numpy()
    assert stats.chisquare(counts).pvalue > 1e-3


# --- σ laws: the host's distribution, restricted to a window, drawn exactly ----------------------

LAW_SAMPLERS = [
    pytest.param(SigmaSampler("uniform"), (128, 128), id="uniform"),
    pytest.param(SigmaSampler("sigmoid", sigmoid_scale=1.3), (128, 128), id="sigmoid"),
    pytest.param(SigmaSampler("shift", discrete_flow_shift=3.1582), (128, 128), id="shift"),
    pytest.param(SigmaSampler("flux_shift"), (104, 152), id="flux_shift-1216x832"),
    pytest.param(SigmaSampler("nextdit_shift"), (128, 128), id="nextdit_shift"),
]


def _classify(lo: float, hi: float):
    """Category 0 inside the open window (lo, hi), −1 outside: the router's rule for one route."""
    return lambda x: torch.where((x > lo) & (x < hi), 0, -1)


@pytest.mark.parametrize(("sampler", "hw"), LAW_SAMPLERS)
@pytest.mark.parametrize(("lo", "hi"), [(0.65, 0.95), (0.985, 1.0), (0.0, 0.02)], ids=["wide", "top-tail", "bottom-tail"])
def test_continuous_law_conditional_is_the_host_restricted_to_the_window(sampler, hw, lo, hi):
    law = sampler.law(hw)
    mass = sampler.mass(lo, hi, hw)
    assert law.masses(_classify(lo, hi), [lo, hi])[0] == pytest.approx(mass, rel=1e-9)
    x = law.draw(20_000, 0, _classify(lo, hi), [lo, hi], torch.Generator().manual_seed(3)).numpy()
    assert ((x > lo) & (x < hi)).all()
    base = sampler.cdf(lo, hw)
    assert stats.kstest(x, np.vectorize(lambda v: (sampler.cdf(float(v), hw) - base) / mass)).pvalue > 1e-3


@pytest.mark.parametrize(("sampler", "hw"), LAW_SAMPLERS)
def test_quantile_inverts_the_cdf_and_samples_follow_it(sampler, hw):
    u = torch.linspace(1e-6, 1 - 1e-6, 101, dtype=torch.float64)
    back = torch.tensor([sampler.cdf(float(v), hw) for v in sampler.quantile(u, hw)], dtype=torch.float64)
    torch.testing.assert_close(back, u, atol=1e-9, rtol=0)
    x = sampler.sample(100_000, hw, generator=torch.Generator().manual_seed(4)).double().numpy()
    assert stats.kstest(x, np.vectorize(lambda v: sampler.cdf(float(v), hw))).pvalue > 1e-3


@pytest.mark.parametrize("scheme", ["uniform", "logit_normal", "cosmap"])
def test_grid_law_atoms_are_the_host_index_frequencies(scheme):
    sampler = SigmaSampler("sigma", weighting_scheme=scheme, logit_mean=0.3, logit_std=1.2)
    law = sampler.law((128, 128))
    assert torch.equal(law.values, sampler.scheduler_sigmas()) and law.probs.sum().item() == pytest.approx(1.0)
    x = sampler.sample(400_000, (128, 128), generator=torch.Generator().manual_seed(8))
    idx = torch.searchsorted(-law.values, -x)
    counts = torch.bincount(idx, minlength=1000).double()
    expected = law.probs * x.numel()
    keep = expected > 5
    chi = float((((counts - expected) ** 2 / expected)[keep]).sum())
    assert stats.chi2.sf(chi, int(keep.sum()) - 1) > 1e-3
    assert SigmaSampler("sigma", weighting_scheme="mode").law((128, 128)) is None  # no closed-form inverse


def test_ddpm_law_is_the_uniform_integer_timesteps():
    law = DdpmSampler(100, 900).law((64, 64))
    assert torch.equal(law.labels, torch.arange(100, 900)) and torch.allclose(law.probs, torch.full((800,), 1 / 800, dtype=torch.float64))
    inside = _classify(0.5, 0.9)
    t = law.labels[law.draw_atoms(5000, 0, inside, torch.Generator().manual_seed(0))]
    sigma = ddpm_t_to_sigma(t, ddpm_alphas_cumprod())
    assert bool(((sigma > 0.5) & (sigma < 0.9)).all())
    window = law.labels[inside(law.values) == 0]
    assert stats.chisquare(torch.bincount(t - window.min(), minlength=window.numel()).numpy()).pvalue > 1e-3


def _sd3_host_timesteps(n, t_min, t_max, shift, dtype, generator):
    """sd3_train_utils.get_noisy_model_input_and_timesteps (sd-scripts 48d368fa) with a logit-normal u."""
    u = torch.sigmoid(torch.normal(0.0, 1.0, size=(n,), generator=generator))
    u = (u * shift) / (1 + (shift - 1) * u)
    return (u * (t_max - t_min) + t_min).long().to(dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sd3_law_matches_the_host_integer_timesteps(dtype):
    law = sd3_law(0, 1000, 3.0, "logit_normal", dtype)
    t = _sd3_host_timesteps(400_000, 0, 1000, 3.0, dtype, torch.Generator().manual_seed(2))
    atoms, index = torch.unique(law.labels, return_inverse=True)
    probs = torch.zeros(atoms.numel(), dtype=torch.float64).index_add_(0, index, law.probs)
    counts = torch.bincount(torch.searchsorted(atoms.float(), t.float()), minlength=atoms.numel()).double()
    expected = probs * t.numel()
    keep = expected > 5
    assert stats.chi2.sf(float((((counts - expected) ** 2 / expected)[keep]).sum()), int(keep.sum()) - 1) > 1e-3
    assert torch.equal(law.values, (law.labels / 1000).double())


# --- host sampler families: laws from the host's args, replay by position ------------------------


def _bound(mode: str, dtype=torch.float32, hw=(8, 8), **knobs):
    from diffusers import FlowMatchEulerDiscreteScheduler

    from downscale_plugin.hosts.sd_scripts.families import FlowFamily
    from downscale_plugin.lab import flux_train_utils
    from downscale_plugin.lab.trainer import lab_args

    args = lab_args(timestep_sampling=mode, **knobs)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=args.discrete_flow_shift)
    latents = torch.zeros(4, 16, *hw)
    return FlowFamily(flux_train_utils, "flux").bind(args, scheduler, latents, "cpu", dtype), scheduler, latents, args


@pytest.mark.parametrize("mode", ["uniform", "sigmoid", "shift", "flux_shift", "sigma"])
def test_bound_law_is_the_host_samplers_law(mode):
    sampler, *_ = _bound(mode, hw=(104, 152), weighting_scheme="logit_normal")
    assert sampler.law is not None
    lo, hi = 0.7, 0.9
    torch.manual_seed(0)
    host = torch.cat([sampler.draw(256) for _ in range(80)]).numpy()
    mass = sampler.law.masses(_classify(lo, hi), [lo, hi])[0]
    inside = float(((host > lo) & (host < hi)).mean())
    assert abs(inside - mass) < 4 * math.sqrt(mass * (1 - mass) / host.size)


def test_bound_law_draws_enter_the_pool_in_the_hosts_dtypes():
    sampler, *_ = _bound("sigmoid")
    with torch.random.fork_rng(devices=[]):
        sampler.first()
    start = len(sampler.pool.sigmas)
    drawn = sampler.law.draw(6, 0, _classify(0.9, 0.95), [0.9, 0.95], torch.Generator().manual_seed(1))
    t, s = sampler.pool.pairs(torch.arange(start, start + 6))
    assert torch.equal(s, drawn) and torch.equal(drawn.float().double(), drawn)  # rounded to the host's float32 σ
    assert torch.equal(t, drawn * 1000)  # t = σ·T, as the host pairs them
    assert _bound("sigma", weighting_scheme="mode")[0].law is None


def test_replay_is_by_position_when_bf16_merges_timesteps():
    # --timestep_sampling sigma in bf16: neighbouring grid timesteps share one bf16 σ
    sampler, scheduler, latents, args = _bound("sigma", dtype=torch.bfloat16)
    grid_t, grid_s = scheduler.timesteps, scheduler.sigmas[:1000].to(torch.bfloat16)
    t16 = grid_t.to(torch.bfloat16)
    i = next(i for i in range(999) if grid_s[i] == grid_s[i + 1] and t16[i] != t16[i + 1])
    with torch.random.fork_rng(devices=[]):
        sampler.first()
    positions = sampler.pool.add(grid_t[[i, i + 1, i]], grid_s[[i, i + 1, i]])
    with sampler.replay(positions):
        from downscale_plugin.lab import flux_train_utils

        _, timesteps, sigmas = flux_train_utils.get_noisy_model_input_and_timesteps(
            args, scheduler, latents[:3], torch.zeros_like(latents[:3]), "cpu", torch.bfloat16
        )
    assert timesteps.tolist() == grid_t[[i, i + 1, i]].to(torch.bfloat16).tolist()  # each sample its own t, not its neighbour's
    assert timesteps[0] != timesteps[1] and sigmas.flatten()[0] == sigmas.flatten()[1]
