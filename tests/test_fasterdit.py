"""FasterDiT options: direction loss arithmetic and scoping, log-SNR PDF, σ policies, interpolated positions."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from downscale_plugin.arch import get_arch
from downscale_plugin.config import RouteRule
from downscale_plugin.fasterdit.direction_loss import direction_loss_scope, direction_term
from downscale_plugin.fasterdit.latent_stds import measure_stds
from downscale_plugin.fasterdit.policies import POLICIES, RunningStd, make_policy, res_shift, shift_sigma, snr_match
from downscale_plugin.fasterdit.positions import (
    img_ids_scope,
    interpolate_ids,
    meshgrid_scope,
    pi_factors,
    positions_scope,
    rope_angles_scope,
    rope_embedder_scope,
)
from downscale_plugin.fasterdit.snr import log_snr, log_snr_cdf, log_snr_histogram, log_snr_pdf
from downscale_plugin.fasterdit.snr_report import build_report
from downscale_plugin.fasterdit.stats import Moments
from downscale_plugin.grid import area_downsample
from downscale_plugin.hosts.sd_scripts.cli import npz_latents
from downscale_plugin.lab import flux_utils as lab_flux_utils
from downscale_plugin.scope import swap_attr
from downscale_plugin.sigma import SigmaSampler

FLUX = get_arch("flux")


# -- direction loss ----------------------------------------------------------------------------


def _host_module() -> types.ModuleType:
    """Stands in for ``library.train_util``: the host's elementwise ``conditional_loss`` signature."""
    module = types.ModuleType("train_util_standin")
    module.conditional_loss = lambda pred, target, loss_type, reduction, huber_c=None: F.mse_loss(pred, target, reduction=reduction)
    return module


def _host_per_sample(module, pred, target, weighting=None) -> torch.Tensor:
    """sd-scripts ``process_batch``: elementwise loss, × weighting, mean over every non-batch dim."""
    loss = module.conditional_loss(pred.float(), target.float(), "l2", "none", None)
    if weighting is not None:
        loss = loss * weighting
    return loss.mean(dim=list(range(1, loss.ndim)))


@pytest.mark.parametrize("shape", [(2, 4, 3, 5), (2, 4, 2, 3, 5)])
def test_direction_loss_known_values(shape):
    module = _host_module()
    lam = 0.7
    target = torch.randn(shape)
    ortho = torch.zeros(shape)
    ortho[:, 0], ortho[:, 1] = -target[:, 1], target[:, 0]  # orthogonal over channels at every position
    for pred, extra in ((target.clone(), 0.0), (-target, 2 * lam), (ortho, lam)):
        base = _host_per_sample(module, pred, target)
        with direction_loss_scope(module, lam):
            added = _host_per_sample(module, pred, target)
        torch.testing.assert_close(added - base, torch.full((shape[0],), extra), atol=1e-5, rtol=0)


def test_direction_loss_exact_mean_over_positions_and_host_weighting():
    module = _host_module()
    pred, target = torch.randn(3, 16, 6, 7), torch.randn(3, 16, 6, 7)
    cos = F.cosine_similarity(pred, target, dim=1)  # (B, H, W)
    expected = 0.25 * (1 - cos).mean(dim=(1, 2))
    weighting = torch.tensor([1.0, 2.0, 0.5]).view(3, 1, 1, 1)
    base, base_w = _host_per_sample(module, pred, target), _host_per_sample(module, pred, target, weighting)
    with direction_loss_scope(module, 0.25):
        torch.testing.assert_close(_host_per_sample(module, pred, target) - base, expected)
        torch.testing.assert_close(_host_per_sample(module, pred, target, weighting) - base_w, expected * weighting.flatten())
    assert direction_term(pred, target).shape == (3, 1, 6, 7)


def test_direction_loss_zero_weight_is_bitwise_and_unwrapped():
    module = _host_module()
    original = module.conditional_loss
    pred, target = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    before = _host_per_sample(module, pred, target)
    with direction_loss_scope(module, 0.0):
        assert module.conditional_loss is original
        assert torch.equal(_host_per_sample(module, pred, target), before)


def test_direction_loss_scope_restores_gates_and_rejects_reduced_losses():
    module = _host_module()
    original = module.conditional_loss
    pred, target = torch.randn(2, 4, 3, 3), torch.randn(2, 4, 3, 3)
    with pytest.raises(RuntimeError, match="boom"), direction_loss_scope(module, 1.0):
        assert module.conditional_loss is not original
        raise RuntimeError("boom")
    assert module.conditional_loss is original
    routed = {"now": False}
    base = _host_per_sample(module, pred, target)
    with direction_loss_scope(module, 1.0, gate=lambda: routed["now"]):
        assert torch.equal(_host_per_sample(module, pred, target), base)
        routed["now"] = True
        assert not torch.equal(_host_per_sample(module, pred, target), base)
        with pytest.raises(ValueError, match="reduction 'none'"):
            module.conditional_loss(pred, target, "l2", "mean")
    with pytest.raises(ValueError):
        direction_loss_scope(module, -1.0)


# -- scope primitive ---------------------------------------------------------------------------


def test_swap_attr_deletes_instance_shadow_of_a_method():
    class Host:
        def method(self):
            return "class"

    host = Host()
    with pytest.raises(KeyError), swap_attr(host, "method", lambda: "scoped"):
        assert host.method() == "scoped"
        raise KeyError
    assert "method" not in vars(host) and host.method() == "class"


# -- log-SNR PDF -------------------------------------------------------------------------------

CLOSED = [
    SigmaSampler(mode="uniform"),
    SigmaSampler(mode="sigmoid", sigmoid_scale=1.3),
    SigmaSampler(mode="shift", discrete_flow_shift=3.1582),
    SigmaSampler(mode="flux_shift"),
]


@pytest.mark.parametrize("sampler", CLOSED, ids=lambda s: s.mode)
def test_log_snr_pdf_normalised_consistent_with_cdf_and_samples(sampler):
    hw, std = (128, 96), 0.6
    lam = np.linspace(-40, 40, 40001)
    pdf = log_snr_pdf(lam, sampler, hw, std)
    assert abs(np.trapezoid(pdf, lam) - 1.0) < 1e-6
    for x in (-3.0, -0.5, 1.0, 2.5):  # the pdf is the derivative of the CDF built from sigma.py's closed form
        h = 1e-4
        slope = (log_snr_cdf(x + h, sampler, hw, std) - log_snr_cdf(x - h, sampler, hw, std)) / (2 * h)
        assert slope == pytest.approx(float(log_snr_pdf(np.array([x]), sampler, hw, std)[0]), rel=1e-4, abs=1e-7)
    draws = log_snr(sampler.sample(200_000, hw, generator=torch.Generator().manual_seed(0)), std).numpy()
    edges = np.linspace(-8, 8, 33)
    hist = log_snr_histogram(draws[np.isfinite(draws)], edges, len(draws))
    width = edges[1] - edges[0]
    mass = np.array(
        [log_snr_cdf(b, sampler, hw, std) - log_snr_cdf(a, sampler, hw, std) for a, b in zip(edges[:-1], edges[1:], strict=True)]
    )
    assert np.max(np.abs(hist * width - mass)) < 4e-3


def test_log_snr_offset_of_data_std_and_no_closed_form_for_the_grid():
    sigma = torch.tensor([0.1, 0.5, 0.9])
    torch.testing.assert_close(log_snr(sigma, 0.5) - log_snr(sigma, 1.0), torch.full((3,), 2 * math.log(0.5), dtype=torch.float64))
    with pytest.raises(ValueError, match="no closed form"):
        log_snr_pdf(np.zeros(1), SigmaSampler(mode="sigma"), (64, 64), 1.0)


def test_measured_stds_white_vs_smooth_and_npz_reading(tmp_path):
    gen = torch.Generator().manual_seed(0)
    white = [torch.randn(4, 64, 64, generator=gen) for _ in range(3)]
    smooth = [torch.randn(4, 1, 1, generator=gen).expand(4, 64, 64).clone() for _ in range(3)]
    rule = RouteRule(sigma_min=0.5, sigma_max=0.9, scale=0.5)
    white_stds = measure_stds(white, [rule], FLUX, 0.1).routes[0]
    assert white_stds.ratio == pytest.approx(0.5, abs=0.02)  # 2×2 mean of white noise
    assert white_stds.effective_shift == pytest.approx(2.0, rel=0.05)
    assert measure_stds(smooth, [rule], FLUX, 0.1).routes[0].ratio == pytest.approx(1.0, abs=1e-6)
    np.savez(
        tmp_path / "a.npz", latents_64x64=white[0].numpy(), latents_flipped_64x64=white[1].numpy(), original_size_64x64=np.array([512, 512])
    )
    np.savez(tmp_path / "b.npz", latents=white[2].numpy())
    loaded = list(npz_latents(str(tmp_path)))
    assert len(loaded) == 2 and torch.equal(loaded[0], white[0]) and torch.equal(loaded[1], white[2])
    assert Moments().add(torch.cat([x.flatten() for x in white])).std == pytest.approx(measure_stds(white, [], FLUX, 0.1).native.std)


def test_snr_match_mixture_equals_native_and_keep_does_not():
    gen = torch.Generator().manual_seed(1)
    latents = [torch.randn(4, 32, 32, generator=gen) for _ in range(4)]
    stds = measure_stds(latents, [RouteRule(sigma_min=0.6, sigma_max=0.95, scale=0.5)], FLUX, 0.1)
    sampler = SigmaSampler(mode="shift", discrete_flow_shift=3.0)
    matched = build_report(stds, sampler, FLUX, "snr_match", samples=100_000)
    kept = build_report(stds, sampler, FLUX, "keep", samples=100_000)
    assert matched.tv_distance < 0.01 < kept.tv_distance
    assert matched.routes[0].routed_fraction == pytest.approx(sampler.mass(0.6, 0.95, (32, 32)), abs=0.01)
    assert matched.closed_form and np.trapezoid(matched.native, matched.centers) == pytest.approx(1.0, abs=0.01)


def test_snr_command_writes_png_and_summary(tmp_path, capsys):
    import downscale_plugin.fasterdit.cli  # noqa: F401  (registers the command)
    from downscale_plugin.__main__ import main

    gen = torch.Generator().manual_seed(2)
    for i in range(3):
        np.savez(tmp_path / f"{i}.npz", latents_16x16=torch.randn(4, 16, 16, generator=gen).numpy())
    (tmp_path / "p.toml").write_text('arch = "flux"\n[[routes]]\nscale = 0.5\nsigma_min = 0.6\nsigma_max = 0.95\n')
    out = tmp_path / "snr.png"
    argv = ["snr", "--config", str(tmp_path / "p.toml"), "--latents", str(tmp_path), "--samples", "20000", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "eff.shift" in text and "r0 x0.5" in text and out.stat().st_size > 10_000


# -- σ policies --------------------------------------------------------------------------------


def test_policies_monotone_fix_endpoints_and_are_keep_at_ratio_one():
    sigma = torch.linspace(0, 1, 1001, dtype=torch.float64)
    for name, kw in (("keep", {}), ("res_shift", {}), ("snr_match", {"native_std": 1.0, "small_std": 0.8})):
        out = make_policy(name, 4096, 2304, **kw)(sigma)
        assert torch.all(out.diff() > 0) and out[0] == 0 and out[-1] == 1
        assert torch.all(out <= sigma)  # fewer tokens / lower std: never a higher σ
        same = make_policy(name, 4096, 4096, native_std=0.9, small_std=0.9)(sigma)
        assert torch.equal(same, sigma)
    assert set(POLICIES) == {"keep", "res_shift", "snr_match"}


def test_policy_definitions():
    sigma = torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)
    matched = snr_match(sigma, 1.0, 0.7)
    torch.testing.assert_close(log_snr(matched, 0.7), log_snr(sigma, 1.0))  # equal extended log-SNR
    n, m = 64 * 64, 48 * 48
    shifted = res_shift(sigma, n, m)
    uncertainty = lambda s, tokens: s / ((1 - s) * math.sqrt(tokens))  # noqa: E731 (SD3 resolution shift)
    torch.testing.assert_close(uncertainty(shifted, m), uncertainty(sigma, n))
    assert shift_sigma(0.5, 3.0) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="needs the measured data stds"):
        make_policy("snr_match", n, m)
    with pytest.raises(ValueError, match="allowed"):
        make_policy("bogus", n, m)


def test_running_std_pools_batches_per_grid_pair():
    gen = torch.Generator().manual_seed(3)
    tracker = RunningStd()
    batches = [torch.randn(2, 4, 16, 16, generator=gen) * (i + 1) for i in range(3)]
    for batch in batches:
        s_native, s_small = tracker.update(batch, area_downsample(batch, (8, 8)))
    everything = torch.cat(batches)
    assert s_native == pytest.approx(everything.double().std(unbiased=False).item(), rel=1e-9)
    assert s_small == pytest.approx(area_downsample(everything, (8, 8)).double().std(unbiased=False).item(), rel=1e-9)


# -- positions ---------------------------------------------------------------------------------


def test_interpolated_img_ids_span_native_extent_and_restore():
    native, small = (32, 24), (24, 18)  # packed tokens of a 64x48 latent and its x0.75 route
    original = lab_flux_utils.prepare_img_ids
    with img_ids_scope(lab_flux_utils, native):
        ids = lab_flux_utils.prepare_img_ids(2, *small)
        unchanged = lab_flux_utils.prepare_img_ids(2, *native)
    assert lab_flux_utils.prepare_img_ids is original
    assert ids.shape == (2, 24 * 18, 3) and ids.dtype == torch.float32 and torch.all(ids[..., 0] == 0)
    for axis, (n_native, n_small) in enumerate(zip(native, small, strict=True), start=1):
        k = n_native / n_small
        values = ids[0, :, axis].unique()
        torch.testing.assert_close(values, torch.arange(n_small) * k)  # pitch k, anchored at 0
        assert values.max().item() + k == pytest.approx(n_native)  # the k-wide cells tile [0, N_native)
    assert torch.equal(unchanged, original(2, *native))
    with pytest.raises(RuntimeError), img_ids_scope(lab_flux_utils, native):
        raise RuntimeError
    assert lab_flux_utils.prepare_img_ids is original


def test_pi_ids_anchor_the_area_each_small_token_averages():
    native_rows = torch.arange(16.0).view(1, 1, 16, 1).expand(1, 1, 16, 4)
    averaged = area_downsample(native_rows, (4, 2))[0, 0, :, 0]  # integer ratio 4: centre of [4i, 4i + 4)
    ids = interpolate_ids(lab_flux_utils.prepare_img_ids(1, 4, 2), pi_factors((16, 4), (4, 2)))
    torch.testing.assert_close(ids[0, ::2, 1], averaged - (4 - 1) / 2)


class _TableRope:
    """Lumina-like embedder: integer ids gather from a precomputed complex table (per axis)."""

    def __init__(self, axes_dims=(4, 6, 6), theta=10000.0, length=64):
        self.axes_dims, self.theta = list(axes_dims), theta
        self.freqs_cis = []
        for d in axes_dims:
            angles = torch.outer(torch.arange(length, dtype=torch.float64), theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d))
            self.freqs_cis.append(torch.polar(torch.ones_like(angles), angles))

    def __call__(self, ids):
        return torch.cat([table[ids[..., i].long()] for i, table in enumerate(self.freqs_cis)], dim=-1)


def test_rope_embedder_scope_matches_table_and_scales_spatial_axes():
    model = types.SimpleNamespace(rope_embedder=_TableRope())
    ids = torch.zeros(1, 7, 3, dtype=torch.int32)
    ids[0, :3, 0] = torch.arange(3, dtype=torch.int32)  # caption tokens: index axis only
    ids[0, 3:, 0] = 3
    ids[0, 3:, 1] = torch.tensor([0, 0, 1, 1], dtype=torch.int32)
    ids[0, 3:, 2] = torch.tensor([0, 1, 0, 1], dtype=torch.int32)
    table = model.rope_embedder
    with rope_embedder_scope(model, (1.0, 1.0)):
        torch.testing.assert_close(model.rope_embedder(ids), table(ids))
    scaled_ids = ids.clone()
    scaled_ids[..., 1] *= 2
    scaled_ids[..., 2] *= 3
    with rope_embedder_scope(model, (2.0, 3.0)):
        out = model.rope_embedder(ids)
    assert model.rope_embedder is table
    torch.testing.assert_close(out, table(scaled_ids))
    torch.testing.assert_close(out[0, :3], table(ids)[0, :3])  # caption positions unchanged


class _AnglesRope(torch.nn.Module):
    """Anima-like embedder: angles laid out [t, h, w] × 2 over a (T, H, W) grid, from a ``seq`` buffer."""

    def __init__(self, dim_t=4, dim_h=6, length=32):
        super().__init__()
        self.register_buffer("seq", torch.arange(length, dtype=torch.float32))
        self.freqs = [10000.0 ** (-torch.arange(0, d, 2).float() / d) for d in (dim_t, dim_h, dim_h)]

    def angles(self, t, h, w, rows, cols):
        et = torch.outer(self.seq[:t], self.freqs[0])[:, None, None].expand(t, h, w, -1)
        eh = torch.outer(rows, self.freqs[1])[None, :, None].expand(t, h, w, -1)
        ew = torch.outer(cols, self.freqs[2])[None, None, :].expand(t, h, w, -1)
        return torch.cat([et, eh, ew] * 2, dim=-1).reshape(t * h * w, 1, 1, -1)

    def generate_embeddings(self, B_T_H_W_C, fps=None):
        _, t, h, w, _ = B_T_H_W_C
        return self.angles(t, h, w, self.seq[:h], self.seq[:w])

    def forward(self, x, fps=None):
        return self.generate_embeddings(x.shape, fps=fps)


def test_rope_angles_scope_scales_each_axis_and_restores():
    embedder = _AnglesRope()
    x = torch.zeros(1, 1, 5, 7, 8)
    with rope_angles_scope(embedder, (1.25, 4 / 3)):
        out = embedder(x)
    assert "generate_embeddings" not in vars(embedder)
    expected = embedder.angles(1, 5, 7, torch.arange(5.0) * 1.25, torch.arange(7.0) * (4 / 3))
    torch.testing.assert_close(out, expected)


def test_meshgrid_scope_for_hunyuan_like_module():
    module = types.ModuleType("hunyuan_utils_standin")
    exec(
        "import torch\n"
        "def get_meshgrid_nd(start, dim=2):\n"
        "    axes = [torch.arange(n, dtype=torch.float32) for n in start]\n"
        "    return torch.stack(torch.meshgrid(*axes, indexing='ij'))\n"
        "def get_nd_rotary_pos_embed(dims, start, theta=10000.0):\n"
        "    grid = get_meshgrid_nd(start, dim=len(dims))\n"
        "    return torch.cat([torch.outer(grid[i].reshape(-1), theta ** (-torch.arange(0, d, 2).float() / d)) for i, d in enumerate(dims)], 1).cos()\n",
        module.__dict__,
    )
    plain = module.get_nd_rotary_pos_embed([4, 4], (3, 5))
    with meshgrid_scope(module, (2.0, 0.5)):
        scaled = module.get_nd_rotary_pos_embed([4, 4], (3, 5))
    grid = module.get_meshgrid_nd((3, 5))
    freqs = 10000.0 ** (-torch.arange(0, 4, 2).float() / 4)
    expected = torch.cat([torch.outer(grid[0].reshape(-1) * 2.0, freqs), torch.outer(grid[1].reshape(-1) * 0.5, freqs)], 1).cos()
    torch.testing.assert_close(scaled, expected)
    assert torch.equal(module.get_nd_rotary_pos_embed([4, 4], (3, 5)), plain)


def test_positions_scope_dispatch():
    with positions_scope(FLUX, (64, 64), (64, 64), module=None):
        pass  # same grid: nothing to scale, nothing needed
    with positions_scope(FLUX, (64, 48), (48, 36), module=lab_flux_utils):
        ids = lab_flux_utils.prepare_img_ids(1, 24, 18)
    assert ids[0, :, 1].max().item() == pytest.approx(23 * 32 / 24)
    with pytest.raises(ValueError, match="needs module="):
        positions_scope(FLUX, (64, 48), (48, 36))
    with pytest.raises(ValueError, match="not available for sd3"):
        positions_scope(get_arch("sd3"), (64, 64), (48, 48))
