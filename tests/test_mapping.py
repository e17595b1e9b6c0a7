"""The map tool: estimator statistics on synthetic gradients, windows, the windows TOML, bad inputs,
and a tiny end-to-end map on the lab DiT."""

from __future__ import annotations

import json
import math

import pytest
import toml
import torch

from downscale_plugin.bins import SigmaBins, parse_bins
from downscale_plugin.config import load_config
from downscale_plugin.mapping.arms import NATIVE_A, NATIVE_B, REENC, Arm, build_arms, latent_arm, pixel_arm
from downscale_plugin.mapping.estimator import BinResult, MapInputError, MapResult, MapSettings, collect, debiased_floor, excess, run_map
from downscale_plugin.mapping.windows import stack_windows, windows_toml
from downscale_plugin.provenance import code_revision
from downscale_plugin.router import Router


class SyntheticBackend:
    """Per-draw gradient = μ_arm(image) + s_arm·ε with known cos(μ_native, μ_route) and noise."""

    rng_devices = ()

    def __init__(self, dim: int, images: int, cosines: dict[str, float], noise: dict[str, float], trainable: bool = True):
        gen = torch.Generator().manual_seed(7)
        self.theta = torch.nn.Parameter(torch.zeros(dim), requires_grad=trainable)
        self.mu: dict[tuple[int, str], torch.Tensor] = {}
        for i in range(images):
            base = torch.randn(dim, generator=gen)
            base /= base.norm()
            orth = torch.randn(dim, generator=gen)
            orth -= (orth @ base) * base
            orth /= orth.norm()
            for name, c in cosines.items():
                self.mu[i, name] = c * base + math.sqrt(1 - c * c) * orth
            self.mu[i, NATIVE_A] = self.mu[i, NATIVE_B] = base
        self.noise = noise
        self.images = images
        self.calls = 0

    def describe(self) -> dict:
        return {"model": "synthetic", "arch": "flux", "native_latent_hw": [128, 128]}

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [self.theta]

    def num_images(self) -> int:
        return self.images

    def unsupported(self, arm: Arm) -> str | None:
        return None

    def arm_input(self, image: int, arm: Arm) -> str:
        return arm.name

    def loss(self, image: int, arm_input: str, sigma: float) -> torch.Tensor:
        self.calls += 1
        s = self.noise.get(arm_input, self.noise["native"]) / math.sqrt(self.theta.numel())
        return self.theta @ (self.mu[image, arm_input] + s * torch.randn(self.theta.numel()))


ROUTE = latent_arm(0.75)
ARMS = (Arm(NATIVE_A, "native"), Arm(NATIVE_B, "native"), ROUTE)


def _synthetic_cells(seed: int = 0):
    # Reliability of an 8-draw sum: 1/(1 + s²/8): native s=1 -> 0.89, route s=3 -> 0.47.
    backend = SyntheticBackend(4000, 24, {ROUTE.name: 0.9}, {"native": 1.0, ROUTE.name: 3.0})
    settings = MapSettings(margin=0.2, draws=8, images=24, seed=seed)
    return backend, collect(backend, ARMS, parse_bins("0,1"), settings, progress=False), settings


def test_debiasing_recovers_the_true_gap_and_raw_is_biased():
    _, cells, _ = _synthetic_cells()
    debiased = sum(excess(c, ROUTE.name) for c in cells) / len(cells)
    raw = sum(excess(c, ROUTE.name, debias=False) for c in cells) / len(cells)
    raw_floor = sum(c.cos[f"{NATIVE_A}|{NATIVE_B}"] for c in cells) / len(cells)
    assert debiased == pytest.approx(0.1, abs=0.03)  # true gap 1 − cos = 0.1
    assert raw > 0.2  # the noisier arm fakes a floor
    assert raw_floor < 0.95  # raw native-vs-native cosine is attenuated below 1
    assert sum(debiased_floor(c) for c in cells) / len(cells) == pytest.approx(1.0, abs=0.01)


def test_collect_is_deterministic_given_a_seed():
    _, a, _ = _synthetic_cells(seed=3)
    _, b, _ = _synthetic_cells(seed=3)
    _, c, _ = _synthetic_cells(seed=4)
    assert [x.cos for x in a] == [x.cos for x in b]
    assert [x.cos for x in a] != [x.cos for x in c]


def test_verdict_uses_the_safe_read_at_the_tests_level():
    from downscale_plugin.mapping.sequential import safe_quantile

    backend, _, settings = _synthetic_cells()
    bins = parse_bins("0,1")
    tight = run_map(backend, ARMS, bins, settings, progress=False)
    row = tight.row(ROUTE.name, 0)
    assert row.n == 24 and row.trimmed == 0
    assert row.level == settings.alpha  # one arm, one bin: the whole family's α
    c = safe_quantile(settings.alpha, 24, settings.margin)
    assert row.ub == pytest.approx(row.excess + c * row.se) and c > 2 * 1.71  # t(0.95, 23) = 1.71: heavier tails cost more
    assert row.safe == (row.ub < settings.margin)
    strict = run_map(backend, ARMS, bins, MapSettings(margin=0.05, draws=8, images=24), progress=False)
    assert not strict.row(ROUTE.name, 0).safe


def test_a_saved_map_rederives_at_another_margin_without_gradients(tmp_path):
    from downscale_plugin.mapping.report import write_json

    backend, _, settings = _synthetic_cells()
    result = run_map(backend, ARMS, parse_bins("0,0.5,1"), settings, progress=False)
    write_json(result, str(tmp_path / "map.json"))
    calls = backend.calls
    loaded = MapResult.from_json(json.loads((tmp_path / "map.json").read_text()))
    assert loaded.rows == result.rows
    looser = MapResult.from_json(json.loads((tmp_path / "map.json").read_text()), margin=0.5)
    assert all(r.safe for r in looser.rows) and backend.calls == calls
    assert loaded.provenance["code_revision"] == code_revision()  # the stored map names its code


# ---------------------------------------------------------------------------------------------- bins


def test_default_segmented_bins():
    bins = parse_bins("0,0.1,4:0.1,0.9,6:0.9,1,4")
    assert len(bins) == 15 and bins.n_segmented == 14 and bins.is_endpoint(14)
    assert bins.edges[4] == 0.1 and bins.edges[10] == 0.9 and bins.bounds(14) == (1.0, 1.0)
    assert parse_bins(bins.spec()) == bins
    sig = bins.sigmas(5, [0.5] * 4)
    assert all(bins.edges[5] < s < bins.edges[6] for s in sig) and sig == sorted(sig)


@pytest.mark.parametrize("text", ["0.1,0.5,1", "0,0.5,0.4,1", "0,0.5,0.9", "0", "0,a,1", "0,0.5,2:0.6,1,2"])
def test_bad_bins_are_rejected(text):
    with pytest.raises(ValueError, match="bins"):
        parse_bins(text)


# ------------------------------------------------------------------------------------------- windows


def _result(pattern: dict[float, str], edges=(0, 0.25, 0.5, 0.75, 1.0), endpoint=True) -> MapResult:
    """A MapResult whose route ``ratio`` is safe on the bins marked 'T' (last char = endpoint bin)."""
    bins = SigmaBins(tuple(float(e) for e in edges), endpoint)
    arms = (Arm(NATIVE_A, "native"), Arm(NATIVE_B, "native"), *(latent_arm(r) for r in pattern))
    rows = []
    for ratio, marks in pattern.items():
        assert len(marks) == len(bins)
        for b, m in enumerate(marks):
            lo, hi = bins.bounds(b)
            ub = 0.01 if m == "T" else 0.5
            rows.append(BinResult(f"latent_{ratio:g}", "latent", ratio, b, lo, hi, 0.5 * (lo + hi), bins.is_endpoint(b), 8, 0,
                                  ub, 0.0, ub, ub, 0.0, 0.9, 1.0, 0.9, 0.9, 1.0, 1.0, m == "T"))  # fmt: skip
    settings = MapSettings(margin=0.05, draws=4, images=8)
    prov = {"backend": {"model": "m", "adapter": "a", "data": "d", "arch": "flux", "native_latent_hw": [128, 128]}}
    return MapResult(bins, arms, settings, rows, [], prov)


def _windows(result):
    return [(w.ratio, w.sigma_min, w.sigma_max) for w in stack_windows(result).windows]


def test_window_open_top_only_when_the_endpoint_bin_is_safe():
    assert _windows(_result({0.75: "FTTTT"})) == [(0.75, 0.25, None)]
    assert _windows(_result({0.75: "FTTTF"})) == [(0.75, 0.25, 1.0)]
    assert _windows(_result({0.75: "TFTFF"})) == [(0.75, 0.0, 0.25), (0.75, 0.5, 0.75)]
    no_end = _result({0.75: "FTTT"}, endpoint=False)
    assert _windows(no_end) == [(0.75, 0.25, 1.0)]


def test_endpoint_alone_is_not_a_window():
    result = _result({0.75: "FFFFT"})
    assert _windows(result) == []
    assert any("single point" in n for n in stack_windows(result).notes)


def test_routes_stack_deepest_first_and_covered_windows_are_dropped():
    stacked = stack_windows(_result({0.75: "FTTTT", 0.5: "FFTTT"}))
    assert [(w.ratio, w.sigma_min, w.sigma_max) for w in stacked.windows] == [(0.5, 0.5, 1.0), (0.75, 0.25, None)]
    assert any("closed at 1" in n for n in stacked.notes)
    covered = stack_windows(_result({0.75: "FFTTT", 0.5: "FTTTT"}))
    assert [(w.ratio, w.sigma_min) for w in covered.windows] == [(0.5, 0.25)]
    assert any("never fire" in n for n in covered.notes)


def test_windows_toml_round_trips_into_config_and_router():
    text = windows_toml(_result({0.75: "FTTTT", 0.5: "FFTTF"}), command="python -m downscale_plugin map --lab", date="D")
    assert text.startswith("# downscale-plugin windows") and "# command: python -m downscale_plugin map --lab" in text
    cfg = load_config(plugin_toml=toml.loads(text))
    assert [(r.label, r.sigma_min, r.sigma_max) for r in cfg.routes] == [("1024:512", 0.5, 1.0), ("1024:768", 0.25, None)]
    router = Router.from_config(cfg, "flux", seed=0, total_forwards=10)
    for sigma, expect in ((0.1, None), (0.3, 1), (0.6, 0), (1.0, 1)):
        decision = router.route(lambda n, s=sigma: torch.full((n,), s), 1, (128, 128), 1)
        assert (decision.rule_index if decision.routed else None) == expect, sigma
        if decision.routed:
            assert decision.target_hw == ((64, 64) if expect == 0 else (96, 96))


def test_a_route_with_a_low_and_a_high_window_round_trips_into_config_and_router():
    """Route 0.5 safe at both ends ((0, 0.25) from σ > 0, (0.75, 1]) and 0.75 between: the windows file carries both
    of 0.5's windows as two rules of one route, the config takes them (none shadows another) and the router routes
    each window to 0.5's grid."""
    result = _result({0.5: "TFFTT", 0.75: "FTFFF"})
    assert _windows(result) == [(0.5, 0.0, 0.25), (0.5, 0.75, 1.0), (0.75, 0.25, 0.5)]  # only the last rule may stay open
    cfg = load_config(plugin_toml=toml.loads(windows_toml(result, date="D")))
    assert [(r.label, r.sigma_min, r.sigma_max) for r in cfg.routes] == [
        ("1024:512", 0.0, 0.25),
        ("1024:512", 0.75, 1.0),
        ("1024:768", 0.25, 0.5),
    ]
    router = Router.from_config(cfg, "flux", seed=0, total_forwards=10)
    for sigma, expect in ((0.1, (64, 64)), (0.3, (96, 96)), (0.6, None), (0.9, (64, 64)), (1.0, None)):
        decision = router.route(lambda n, s=sigma: torch.full((n,), s), 1, (128, 128), 1)
        assert decision.target_hw == expect, sigma


def test_no_window_disables_the_plugin():
    cfg = load_config(plugin_toml=toml.loads(windows_toml(_result({0.5: "FFFFF"}))))
    assert cfg.enable is False and cfg.routes == ()


# ---------------------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    "settings, match",
    [
        (MapSettings(draws=1), "draws"),
        (MapSettings(draws=3), "even"),
        (MapSettings(images=1), "images"),
        (MapSettings(margin=0.0), "margin"),
    ],
)
def test_bad_settings_fail_before_any_compute(settings, match):
    backend = SyntheticBackend(10, 4, {ROUTE.name: 0.9}, {"native": 1.0})
    with pytest.raises(MapInputError, match=match):
        collect(backend, ARMS, parse_bins("0,1"), settings, progress=False)
    assert backend.calls == 0


def test_no_routes_and_no_trainable_parameters_fail_before_any_compute():
    with pytest.raises(ValueError, match="ratios"):
        build_arms([])
    with pytest.raises(ValueError, match="strictly between"):
        build_arms([1.5])
    backend = SyntheticBackend(10, 4, {ROUTE.name: 0.9}, {"native": 1.0})
    with pytest.raises(MapInputError, match="no route"):
        collect(backend, ARMS[:2], parse_bins("0,1"), MapSettings(draws=2, images=2), progress=False)
    frozen = SyntheticBackend(10, 4, {ROUTE.name: 0.9}, {"native": 1.0}, trainable=False)
    with pytest.raises(MapInputError, match="no trainable parameters"):
        collect(frozen, ARMS, parse_bins("0,1"), MapSettings(draws=2, images=2), progress=False)
    assert backend.calls == frozen.calls == 0


def test_cli_lists_every_bad_input_and_exits_2_before_building_anything(capsys):
    import downscale_plugin.mapping.cli  # noqa: F401  (registers the command)
    from downscale_plugin.__main__ import main

    argv = ["map", "--lab", "--ratios", "", "--bins", "0,0.6,0.5,1", "--draws", "1", "--images", "1", "--native_size", "63x64"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    for word in ("ratios", "strictly increasing", "draws", "images", "native size"):
        assert word in err
    assert main(["map", "--lab", "--ratios", "0.9", "--native_size", "8x8"]) == 2
    assert "no strictly smaller" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- the lab


def test_lab_loss_runs_the_trainer_step_at_the_replayed_sigma(tiny_lab):
    from downscale_plugin.lab import flux_utils

    probe = tiny_lab.probes[0]
    x = probe["latents"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        got = tiny_lab.loss(0, tiny_lab.arm_input(0, ARMS[0]), 0.7).detach()
    torch.manual_seed(5)
    noise = torch.randn_like(x)
    l_pooled, t5_out, txt_ids, _ = probe["text_encoder_outputs_list"]
    noisy = 0.3 * x + 0.7 * noise
    pred = tiny_lab.model(img=flux_utils.pack_latents(noisy), img_ids=flux_utils.prepare_img_ids(1, 8, 8), txt=t5_out,
                          txt_ids=txt_ids, y=l_pooled, timesteps=torch.tensor([0.7]))  # fmt: skip
    want = torch.nn.functional.mse_loss(flux_utils.unpack_latents(pred, 8, 8), noise - x)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)


def test_tiny_lab_map_end_to_end(tiny_lab, tmp_path):
    from downscale_plugin.mapping.report import console_table, write_outputs

    arms = (*build_arms([0.75, 0.5], pixel=True, reenc=True), latent_arm(0.5, "res_shift", "interpolate"))
    result = run_map(tiny_lab, arms, parse_bins("0,0.5,1"), MapSettings(margin=0.1, draws=2, images=2), progress=False)
    assert len(result.rows) == 6 * 3 and all(math.isfinite(r.floor_cos) for r in result.rows)
    assert all(math.isfinite(r.over_reenc) == (r.arm != "reenc") for r in result.rows)
    assert {p.grad is None for p in tiny_lab.params} == {True}  # gradients never leak into .grad
    paths = write_outputs(result, str(tmp_path), command="test")
    load_config(plugin_toml=toml.load(paths["toml"]))
    table = console_table(result)
    assert "latent_0.5" in table and "pixel_0.75" in table and "over the re-encode control" in table
    assert "latent_0.5@res_shift+interp" in (tmp_path / "windows.toml").read_text()  # listed, not a route there
    variant = load_config(plugin_toml=toml.load(paths["toml@res_shift+interp"]))
    assert (variant.fasterdit.sigma_policy, variant.fasterdit.positions) == ("res_shift", "interpolate") and paths[
        "toml@res_shift+interp"
    ].endswith("windows@res_shift+interp.toml")
    assert all((tmp_path / name).stat().st_size > 0 for name in ("windows.toml", "map.csv", "map.json", "map.png"))


# ------------------------------------------------- VAE arms, σ policies, positions (issues 4 and 5)


def test_codec_decode_is_the_pseudo_inverse_of_encode():
    from downscale_plugin.lab.data import FACTOR, LatentCodec

    codec = LatentCodec(16, seed=3)
    gen = torch.Generator().manual_seed(0)
    codec.mean, codec.std = torch.randn(16, generator=gen), torch.rand(16, generator=gen) + 0.5
    z = torch.randn(2, 16, 6, 5, generator=gen)
    assert codec.decode(z).shape == (2, 3, 6 * FACTOR, 5 * FACTOR)
    torch.testing.assert_close(codec.encode(codec.decode(z)), z, atol=1e-5, rtol=0)
    x = torch.rand(2, 3, 24, 20, generator=gen)
    p = codec.project(x)  # decode(encode(x)) is the per-patch orthogonal projection onto the kept rows
    want = torch.nn.functional.pixel_shuffle(torch.einsum("ck,bchw->bkhw", codec.projection, p), FACTOR)
    got = codec.decode(codec.encode(x))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(codec.decode(codec.encode(got)), got, atol=1e-5, rtol=0)  # idempotent
    residual = torch.nn.functional.pixel_unshuffle(x - got, FACTOR)
    assert torch.einsum("ck,bkhw->bchw", codec.projection, residual).abs().max() < 1e-5  # the loss is orthogonal to the kept rows
    assert (x - got).norm() > 0.1 * x.norm()  # lossy: 32 of 48 directions dropped
    full = LatentCodec(48, seed=3)
    torch.testing.assert_close(full.decode(full.encode(x)), x, atol=1e-5, rtol=0)


def test_arm_names_routability_and_bad_arms():
    arms = build_arms([0.75], pixel=True, reenc=True, policies=["res_shift", "keep"], positions=["interpolate"])
    assert [a.name for a in arms] == [NATIVE_A, NATIVE_B, "latent_0.75", "latent_0.75+interp", "latent_0.75@res_shift",
                                      "latent_0.75@res_shift+interp", "pixel_0.75", "reenc"]  # fmt: skip
    assert [a.name for a in arms if a.routable] == ["latent_0.75"]
    assert arms[-1] == REENC and arms[5].policy == "res_shift" and arms[5].positions == "interpolate"
    with pytest.raises(ValueError, match=r"policies: \['warp'\] not allowed \(allowed: keep, res_shift, snr_match\)"):
        build_arms([0.75], policies=["warp"])
    with pytest.raises(ValueError, match=r"positions: .*allowed: plain, interpolate"):
        build_arms([0.75], positions=["yarn"])
    with pytest.raises(ValueError, match="duplicates"):
        build_arms([0.75], policies=["keep", "keep"])
    with pytest.raises(ValueError, match="small-grid arms"):
        Arm("reenc", "reenc", policy="res_shift")
    with pytest.raises(ValueError, match="ratio is required"):
        Arm("latent", "latent")
    with pytest.raises(ValueError, match="allowed: native, latent, reenc, pixel"):
        Arm("x", "vae")


def test_cli_rejects_bad_policies_and_pixel_arms_without_a_grid(capsys):
    import downscale_plugin.mapping.cli  # noqa: F401  (registers the command)
    from downscale_plugin.__main__ import main

    assert main(["map", "--lab", "--policies", "keep,warp", "--positions", "yarn"]) == 2
    assert "policies: ['warp'] not allowed (allowed: keep, res_shift, snr_match)" in capsys.readouterr().err
    assert main(["map", "--lab", "--ratios", "0.9", "--pixel", "--native_size", "8x8"]) == 2
    assert "arm pixel_0.9: ratio 0.9: no strictly smaller" in capsys.readouterr().err


def test_excess_over_reenc_is_the_paired_difference():
    from downscale_plugin.mapping.report import console_table

    route, variant = latent_arm(0.75), latent_arm(0.75, "res_shift")
    backend = SyntheticBackend(2000, 12, {route.name: 0.9, variant.name: 0.95, "reenc": 0.97}, {"native": 1.0})
    arms = (*ARMS[:2], route, variant, REENC)
    result = run_map(backend, arms, parse_bins("0,1"), MapSettings(margin=0.5, draws=8, images=12), progress=False)
    row, reenc = result.row(route.name, 0), result.row("reenc", 0)
    want = [excess(c, route.name) - excess(c, "reenc") for c in result.cells if c.bin == 0]
    assert row.over_reenc == pytest.approx(sum(want) / len(want)) and row.over_reenc_n == 12
    assert row.over_reenc == pytest.approx(0.1 - 0.03, abs=0.03) and row.over_reenc < row.over_reenc_ub
    assert math.isnan(reenc.over_reenc) and reenc.over_reenc_n == 0
    assert math.isnan(run_map(backend, ARMS, parse_bins("0,1"), result.settings, progress=False).row(ROUTE.name, 0).over_reenc)
    assert "over the re-encode control" in console_table(result)
    # one TOML per setting: the default one routes latent_0.75 and lists the variant; the variant's sets its policy
    assert result.route_settings() == [("keep", "plain", "plain"), ("res_shift", "plain", "plain")]
    assert [w.arm for w in stack_windows(result).windows] == [route.name]
    text = windows_toml(result)
    assert f"#   {variant.name}: (0, 1]" in text and "#   reenc" not in text
    assert load_config(plugin_toml=toml.loads(text)).fasterdit.sigma_policy == "keep"
    cfg = load_config(plugin_toml=toml.loads(windows_toml(result, setting=variant.setting)))
    assert cfg.fasterdit.sigma_policy == "res_shift" and [(r.label, r.sigma_min, r.sigma_max) for r in cfg.routes] == [
        ("1024:768", 0.0, None)
    ]


def _spy(model):
    """Record (σ timestep, img_ids) of every model forward."""
    seen = []
    handle = model.register_forward_pre_hook(
        lambda m, a, kw: seen.append((kw["timesteps"].item(), kw["img_ids"].clone())), with_kwargs=True
    )
    return seen, handle


def test_lab_backend_runs_every_arm_kind_with_the_right_inputs(tiny_lab):
    arms = build_arms([0.5, 0.75], pixel=True, reenc=True, policies=["keep", "res_shift", "snr_match"], positions=["plain", "interpolate"])
    native = tiny_lab.probes[0]["latents"]
    for arm in arms:
        inp = tiny_lab.arm_input(0, arm)
        small = {0.5: (8, 8), 0.75: (12, 12)}.get(arm.ratio, (16, 16))
        assert inp.latents.shape == (1, native.shape[1], *small), arm.name
        assert math.isfinite(tiny_lab.loss(0, inp, 0.6).item()), arm.name
    torch.testing.assert_close(tiny_lab.arm_input(0, REENC).latents, native, atol=1e-4, rtol=0)  # the lab round trip is exact
    pixel, latent = tiny_lab.arm_input(0, pixel_arm(0.75)).latents, tiny_lab.arm_input(0, latent_arm(0.75)).latents
    assert (pixel - latent).norm() > 0.05 * latent.norm()  # downscaling pixels is not downscaling latents


def test_policy_arms_run_at_their_sigma_and_interpolated_ids_span_the_native_grid(tiny_lab):
    from downscale_plugin.fasterdit.policies import shift_sigma
    from downscale_plugin.lab import flux_utils

    original = flux_utils.prepare_img_ids
    seen, handle = _spy(tiny_lab.model)
    try:
        for arm in (latent_arm(0.5), latent_arm(0.5, "res_shift"), latent_arm(0.5, "snr_match", "interpolate")):
            tiny_lab.loss(0, tiny_lab.arm_input(0, arm), 0.7)
    finally:
        handle.remove()
    (t_keep, ids_keep), (t_res, ids_res), (t_snr, ids_snr) = seen
    assert t_keep == pytest.approx(0.7)
    assert t_res == pytest.approx(shift_sigma(0.7, 0.5)) and t_res < 0.6  # k = √(16 / 64 tokens)
    native_std, small_std = tiny_lab.stds["latent", 0.5]
    assert t_snr == pytest.approx(shift_sigma(0.7, small_std / native_std), rel=1e-5) and small_std < native_std
    assert tiny_lab.describe()["sigma_policy_factors"]["latent_0.5@res_shift"] == 0.5
    # 8x8 latent = 4x4 packed tokens; native 16x16 = 8x8: plain ids 0..3, interpolated 0, 2, 4, 6 (pitch 2 spans [0, 8))
    assert ids_keep[..., 1].max() == 3 and ids_res[..., 1].max() == 3
    for axis in (1, 2):
        assert sorted(set(ids_snr[..., axis].flatten().tolist())) == [0, 2, 4, 6]
    assert flux_utils.prepare_img_ids is original  # restored after the forward


# --------------------------------------------------------------------- variants vs their plain latent arm

T_975_2 = 4.302652729911275  # t(0.975; 2 dof): the two-sided 95% interval of a mean over 3 images
GAPS = {  # debiased excess per image (3 images, one bin)
    "latent_0.75": (0.30, 0.25, 0.20),
    "latent_0.75@res_shift": (0.20, 0.13, 0.06),  # − plain: −0.10, −0.12, −0.14
    "pixel_0.75": (0.40, 0.25, 0.30),  # − plain: +0.10, 0.00, +0.10
    "latent_0.5@snr_match": (0.10, 0.10, 0.20),  # no latent_0.5 in the map
    "reenc": (0.01, 0.02, 0.03),
}


def _hand_map():
    """Cells whose debiased excess is GAPS by construction: natives agree (cos 1, reliability 1); an arm
    at gap g has cos (1 − g)·√ρ with half-cosine 1/3 (ρ = 2/3 / (4/3) = 0.5) for the variants, so the
    raw excess differs from the debiased one."""
    from downscale_plugin.mapping.estimator import Cell, summarize

    arms = (Arm(NATIVE_A, "native"), Arm(NATIVE_B, "native"), latent_arm(0.75), latent_arm(0.75, "res_shift"), pixel_arm(0.75),
            latent_arm(0.5, "snr_match"), REENC)  # fmt: skip
    rho = {name: 1.0 if name in ("latent_0.75", "reenc") else 0.5 for name in GAPS}
    cells = []
    for i in range(3):
        cos = {f"{NATIVE_A}|{NATIVE_B}": 1.0}
        for name, gaps in GAPS.items():
            cos[f"{NATIVE_A}|{name}"] = cos[f"{NATIVE_B}|{name}"] = (1 - gaps[i]) * math.sqrt(rho[name])
        half = {NATIVE_A: 1.0, NATIVE_B: 1.0, **{name: 1.0 if r == 1.0 else 1 / 3 for name, r in rho.items()}}
        cells.append(Cell(i, 0, half, cos, {name: 1.0 for name in half}))
    bins, settings = SigmaBins((0.0, 1.0), endpoint=False), MapSettings(margin=0.05, draws=8, images=3)
    return MapResult(bins, arms, settings, summarize(cells, arms, bins, settings), cells, {"command": "hand"})


def test_vs_plain_is_the_paired_difference_of_debiased_excesses_with_a_t_interval():
    from downscale_plugin.mapping.report import console_table

    result = _hand_map()
    assert [excess(c, "latent_0.75@res_shift") for c in result.cells] == pytest.approx(GAPS["latent_0.75@res_shift"])
    row = result.row("latent_0.75@res_shift", 0)
    se = 0.02 / math.sqrt(3)  # sd of (−0.10, −0.12, −0.14) over √3
    assert (row.vs_plain, row.vs_plain_se, row.vs_plain_n) == (pytest.approx(-0.12), pytest.approx(se), 3)
    assert (row.vs_plain_lo, row.vs_plain_hi) == (pytest.approx(-0.12 - T_975_2 * se), pytest.approx(-0.12 + T_975_2 * se))
    assert row.vs_plain != pytest.approx(row.raw_excess - result.row("latent_0.75", 0).raw_excess)  # debiased, not raw
    pixel = result.row("pixel_0.75", 0)
    assert pixel.vs_plain == pytest.approx(0.2 / 3) and pixel.vs_plain_lo < 0 < pixel.vs_plain_hi
    for name in ("latent_0.75", "latent_0.5@snr_match", "reenc"):  # the plain arm itself, no plain sibling, not a small arm
        r = result.row(name, 0)
        assert r.vs_plain_n == 0 and all(math.isnan(v) for v in (r.vs_plain, r.vs_plain_se, r.vs_plain_lo, r.vs_plain_hi))
    table = console_table(result).split("paired difference vs the plain latent arm (negative = closer to native)")[1]
    assert "-0.120 ± 0.012 [-0.170, -0.070]<" in table and "+0.067 ± 0.033 [-0.077, +0.210]\n" in table  # no mark: spans 0
    assert "latent_0.5@snr_match" not in table.split("windows")[0]


def test_vs_plain_is_recomputed_from_the_cells_by_from_json(tmp_path, capsys):
    import downscale_plugin.mapping.cli  # noqa: F401  (registers the command)
    from downscale_plugin.__main__ import main
    from downscale_plugin.mapping.report import write_json

    result = _hand_map()
    write_json(result, str(tmp_path / "map.json"))
    blob = json.loads((tmp_path / "map.json").read_text())
    assert MapResult.from_json(blob).rows == result.rows
    for row in blob["rows"]:  # stale rows: from_json must not read them back
        row["vs_plain"] = 9.0
    (tmp_path / "map.json").write_text(json.dumps(blob))
    assert main(["map", "--from_json", str(tmp_path / "map.json"), "--out", str(tmp_path / "out")]) == 0
    assert "-0.120 ± 0.012 [-0.170, -0.070]<" in capsys.readouterr().out
    rows = {r["arm"]: r for r in json.loads((tmp_path / "out" / "map.json").read_text())["rows"]}
    assert rows["latent_0.75@res_shift"]["vs_plain"] == pytest.approx(-0.12) and rows["latent_0.75"]["vs_plain"] is None
    header = (tmp_path / "out" / "map.csv").read_text().splitlines()[0].split(",")
    assert header[-6:] == ["vs_plain", "vs_plain_se", "vs_plain_lo", "vs_plain_hi", "vs_plain_n", "level"]


# ---------------------------------------------------------------------- proportional attention (the attention axis)


def test_the_attention_axis_adds_prop_arms_and_keeps_every_stored_name():
    from downscale_plugin.mapping.arms import setting_suffix

    arms = build_arms([0.5, 0.75], policies=["keep", "res_shift"], attentions=["proportional"])
    names = [a.name for a in arms]
    assert names[2:] == ["latent_0.5", "latent_0.5+prop", "latent_0.5@res_shift", "latent_0.5@res_shift+prop",
                         "latent_0.75", "latent_0.75+prop", "latent_0.75@res_shift", "latent_0.75@res_shift+prop"]  # fmt: skip
    assert setting_suffix(("res_shift", "interpolate", "plain")) == "@res_shift+interp"  # a stored map's names
    stored = {"name": "latent_0.5@res_shift", "kind": "latent", "ratio": 0.5, "policy": "res_shift", "positions": "plain"}
    assert Arm(**stored).setting == ("res_shift", "plain", "plain")  # a map.json from before the axis re-reads
    with pytest.raises(ValueError, match=r"attention: .*allowed: plain, proportional"):
        build_arms([0.5], attentions=["tome"])


def test_the_in_run_map_backend_refuses_proportional_arms():
    from types import SimpleNamespace

    from downscale_plugin.hosts.kohya.backend import ProbeBackend

    why = ProbeBackend.unsupported(SimpleNamespace(vae=None), latent_arm(0.5, attention="proportional"))
    assert why.startswith("arm latent_0.5+prop: the in-run map measures the router's plain setting only")


def test_a_proportional_arm_runs_on_the_lab_differs_from_plain_and_is_reported_against_it(tiny_lab, tmp_path):
    from downscale_plugin.mapping.report import console_table, write_outputs

    plain, prop = latent_arm(0.5), latent_arm(0.5, attention="proportional")
    losses = []
    for arm in (plain, prop):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(5)
            losses.append(tiny_lab.loss(0, tiny_lab.arm_input(0, arm), 0.7).item())
    assert losses[0] != losses[1]  # the same draw, the bias changes the step
    arms = build_arms([0.5], attentions=["plain", "proportional"])
    result = run_map(tiny_lab, arms, parse_bins("0,0.5,1"), MapSettings(margin=0.1, draws=2, images=2), progress=False)
    rows = [r for r in result.rows if r.arm == prop.name]
    assert len(rows) == 3 and all(math.isfinite(r.vs_plain) and r.vs_plain != 0.0 for r in rows)  # two bins and σ = 1
    assert all(math.isnan(r.vs_plain) for r in result.rows if r.arm == plain.name)
    table = console_table(result)
    assert (
        "paired difference vs the plain latent arm" in table
        and "windows+prop.toml (sigma_policy = keep, positions = plain, attention = proportional" in table
    )
    paths = write_outputs(result, str(tmp_path), command="test")
    assert paths["toml+prop"].endswith("windows+prop.toml")
    assert load_config(plugin_toml=toml.load(paths["toml+prop"])).fasterdit.attention == "proportional"
    assert load_config(plugin_toml=toml.load(paths["toml"])).fasterdit.attention == "plain"
