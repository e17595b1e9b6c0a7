"""The lab: tiny DiT shapes, data determinism, pretraining drop, host-contract trainer, σ sampler."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("peft", reason="the lab needs the [lab] extra (a host's own environment has not)")  # before the lab imports it

from downscale_plugin.lab import flux_train_utils, flux_utils
from downscale_plugin.lab.data import LabData, LabDataConfig
from downscale_plugin.lab.model import LabModelConfig, LabTextEncoder, build_model, flop_shape, image_tokens
from downscale_plugin.lab.pretrain import cache_dir, load_or_pretrain
from downscale_plugin.lab.trainer import (
    LORA_TARGETS,
    LabAccelerator,
    LabTrainer,
    delta_cosine,
    lab_args,
    make_noise_scheduler,
    native_validation_loss,
    train_lora,
)

TINY = LabModelConfig(hidden_size=32, num_heads=2, double_layers=1, single_layers=1, latent_channels=4,
                      text_tokens=4, text_dim=16, pooled_dim=8)  # fmt: skip
TINY_BUCKETS = ((64, 64), (64, 96), (96, 64))


@pytest.fixture(scope="module")
def tiny_data() -> LabData:
    return LabData(LabDataConfig(buckets=TINY_BUCKETS, latent_channels=TINY.latent_channels))


@pytest.fixture(scope="module")
def tiny_model():
    return build_model(TINY, seed=0)


def test_img_ids_and_packing() -> None:
    ids = flux_utils.prepare_img_ids(2, 3, 4)
    assert ids.shape == (2, 12, 3) and ids.dtype == torch.float32
    assert torch.equal(ids[0], ids[1])
    assert torch.all(ids[..., 0] == 0)
    assert ids[0, :, 1].tolist() == [r for r in range(3) for _ in range(4)]
    assert ids[0, :, 2].tolist() == list(range(4)) * 3

    x = torch.randn(2, 3, 6, 8)
    packed = flux_utils.pack_latents(x)
    assert packed.shape == (2, 12, 12)
    # token (i, j), feature (c, ph, pw) is pixel (2i+ph, 2j+pw) of channel c, as in the host's einops.
    assert packed[1, 1 * 4 + 2, 2 * 4 + 1 * 2 + 0] == x[1, 2, 2 * 1 + 1, 2 * 2 + 0]
    assert torch.equal(flux_utils.unpack_latents(packed, 3, 4), x)


def test_model_config_and_flop_shape() -> None:
    for cfg in (LabModelConfig(), TINY, LabModelConfig(hidden_size=192, num_heads=3)):
        dims = cfg.axes_dims_rope
        assert sum(dims) == cfg.head_dim and all(d % 2 == 0 for d in dims)
    assert flop_shape(LabModelConfig()) == (128, 6, 4.0, 16)
    assert image_tokens(64, 64) == 1024
    with pytest.raises(ValueError):
        LabModelConfig(hidden_size=30, num_heads=4)


@pytest.mark.parametrize("hw", [(8, 8), (8, 12), (12, 8), (16, 16)])
def test_model_output_shape(tiny_model, hw: tuple[int, int]) -> None:
    h, w = hw
    bsz = 2
    x = torch.randn(bsz, TINY.latent_channels, h, w)
    l_pooled, t5_out, txt_ids, _ = LabTextEncoder(TINY).encode(torch.tensor([0, 3]))
    with torch.no_grad():
        out = tiny_model(
            img=flux_utils.pack_latents(x),
            img_ids=flux_utils.prepare_img_ids(bsz, h // 2, w // 2),
            txt=t5_out, txt_ids=txt_ids, y=l_pooled, timesteps=torch.rand(bsz),
            guidance=torch.ones(bsz),
        )  # fmt: skip
    assert out.shape == (bsz, image_tokens(h, w), 4 * TINY.latent_channels)
    assert torch.isfinite(out).all()


def test_text_encoder_is_deterministic_per_class() -> None:
    a = LabTextEncoder(TINY).encode(torch.tensor([1, 2, 1]))
    b = LabTextEncoder(TINY).encode(torch.tensor([1, 2, 1]))
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert torch.equal(a[1][0], a[1][2]) and not torch.equal(a[1][0], a[1][1])
    assert a[0].shape == (3, TINY.pooled_dim) and a[1].shape == (3, TINY.text_tokens, TINY.text_dim)
    assert a[2].shape == (3, TINY.text_tokens, 3)


def test_data_deterministic_with_bucket_shapes(tiny_data: LabData) -> None:
    again = LabData(tiny_data.cfg)
    assert again.names == tiny_data.names and tiny_data.num_sources >= 4
    seen = set()
    for step in range(12):
        a, b = tiny_data.batch(step, 3, seed=5), again.batch(step, 3, seed=5)
        assert torch.equal(a["latents"], b["latents"]) and a["captions"] == b["captions"]
        h, w = a["bucket"]
        seen.add(a["bucket"])
        assert a["latents"].shape == (3, TINY.latent_channels, h // 4, w // 4)
        assert torch.equal(a["loss_weights"], torch.ones(3))
        assert a["class_ids"].min() >= 0 and a["class_ids"].max() < tiny_data.num_sources and torch.equal(a["class_ids"], a["sources"])
    assert seen == set(TINY_BUCKETS)
    assert not torch.equal(tiny_data.batch(0, 3, seed=5)["latents"], tiny_data.batch(0, 3, seed=6)["latents"])
    val = tiny_data.validation_set(per_bucket=2, seed=0)
    assert [b["bucket"] for b in val] == list(TINY_BUCKETS)
    assert all(torch.equal(u["latents"], v["latents"]) for u, v in zip(val, again.validation_set(2, 0), strict=True))
    lat = torch.cat([tiny_data.batch(s, 4, seed=1)["latents"].flatten() for s in range(20)])
    assert abs(lat.mean().item()) < 0.3 and 0.6 < lat.std().item() < 1.4


def test_generated_only_corpus() -> None:
    data = LabData(LabDataConfig(buckets=((64, 64),), latent_channels=4, packaged=False, generated=2))
    assert data.names == ["dead_leaves_0", "pink_noise_0"]
    assert data.batch(0, 2, 0)["latents"].shape == (2, 4, 16, 16)


def test_quick_pretrain_loss_falls_and_is_cached(tmp_path, monkeypatch, tiny_data: LabData) -> None:
    monkeypatch.setenv("DOWNSCALE_PLUGIN_CACHE", str(tmp_path))
    model = load_or_pretrain(TINY, quick=True, progress=False, data=tiny_data)
    losses = model.pretrain_losses
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.8 * first, (first, last)
    assert not any(p.requires_grad for p in model.parameters())
    files = list(cache_dir().glob("*.pt"))
    assert len(files) == 1 and cache_dir().is_relative_to(tmp_path)
    cached = load_or_pretrain(TINY, quick=True, progress=False, data=tiny_data)
    assert cached.pretrain_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), cached.state_dict().values(), strict=True))


def _step_inputs(data: LabData, bsz: int = 2) -> tuple[dict, list[torch.Tensor]]:
    batch = data.batch(0, bsz, seed=0)
    return batch, LabTextEncoder(TINY).encode(batch["class_ids"])


@pytest.mark.parametrize("prediction", ["raw", "additive", "sigma_scaled"])
def test_trainer_step_contract(tiny_model, tiny_data: LabData, prediction: str) -> None:
    args = lab_args(model_prediction_type=prediction, weighting_scheme="cosmap")
    batch, conds = _step_inputs(tiny_data)
    latents = batch["latents"]
    out = LabTrainer().get_noise_pred_and_target(
        args, LabAccelerator(), make_noise_scheduler(args), latents, batch, conds, tiny_model, None,
        torch.float32, True, is_train=False,
    )  # fmt: skip
    model_pred, target, timesteps, weighting = out
    assert model_pred.shape == target.shape == latents.shape
    assert timesteps.shape == (2,) and timesteps.dtype == torch.float32
    assert ((timesteps > 0) & (timesteps < 1000)).all()
    if prediction == "sigma_scaled":
        assert weighting.shape == (2, 1, 1, 1)
    else:
        assert weighting is None


def test_trainer_looks_up_module_attributes_at_call_time(monkeypatch, tiny_model, tiny_data: LabData) -> None:
    calls: list[str] = []
    sampler, ids = flux_train_utils.get_noisy_model_input_and_timesteps, flux_utils.prepare_img_ids

    def spy_sampler(*a, **k):
        calls.append("sampler")
        return sampler(*a, **k)

    def spy_ids(*a, **k):
        calls.append("ids")
        return ids(*a, **k)

    monkeypatch.setattr(flux_train_utils, "get_noisy_model_input_and_timesteps", spy_sampler)
    monkeypatch.setattr(flux_utils, "prepare_img_ids", spy_ids)
    args = lab_args()
    batch, _ = _step_inputs(tiny_data)
    loss = LabTrainer().process_batch(
        batch, LabTextEncoder(TINY), tiny_model, None, make_noise_scheduler(args), torch.float32,
        LabAccelerator(), args, is_train=False,
    )  # fmt: skip
    assert calls == ["sampler", "ids"] and loss.ndim == 0 and torch.isfinite(loss)


def _normal_cdf(z: torch.Tensor) -> torch.Tensor:
    return 0.5 * torch.erfc(-z / math.sqrt(2.0))


def _logit_cdf(u: torch.Tensor, scale: float) -> torch.Tensor:
    return _normal_cdf(torch.logit(u) / scale)


@pytest.mark.parametrize(
    "mode, scale, closed_form",
    [
        ("uniform", 1.0, lambda s, k, mu: s),
        ("sigmoid", 1.3, lambda s, k, mu: _logit_cdf(s, 1.3)),
        ("shift", 1.0, lambda s, k, mu: _logit_cdf(s / (k - (k - 1) * s), 1.0)),
        ("flux_shift", 0.8, lambda s, k, mu: _logit_cdf(1 / (1 + math.exp(mu) * (1 / s - 1)), 0.8)),
    ],
)
def test_sampler_matches_closed_form(mode: str, scale: float, closed_form) -> None:
    n, k = 4000, 3.1582
    args = lab_args(timestep_sampling=mode, sigmoid_scale=scale, discrete_flow_shift=k)
    latents, noise = torch.randn(n, 1, 24, 16), torch.randn(n, 1, 24, 16)
    torch.manual_seed(0)
    noisy, timesteps, sigmas = flux_train_utils.get_noisy_model_input_and_timesteps(
        args, make_noise_scheduler(args), latents, noise, "cpu", torch.float32
    )
    assert sigmas.shape == (n, 1, 1, 1)
    assert torch.allclose(timesteps, sigmas.flatten() * 1000)
    assert torch.allclose(noisy, (1 - sigmas) * latents + sigmas * noise)
    mu = flux_train_utils.get_lin_function(y1=0.5, y2=1.15)(12 * 8)
    s = sigmas.flatten().double().sort().values
    ks = (closed_form(s, k, mu) - torch.arange(1, n + 1, dtype=torch.float64) / n).abs().max().item()
    assert ks < 1.63 / math.sqrt(n), ks  # KS test at the 1% level


def test_sampler_rng_order_and_ip_noise() -> None:
    args = lab_args(timestep_sampling="shift", sigmoid_scale=1.0, ip_noise_gamma=0.1,
                    ip_noise_gamma_random_strength=True)  # fmt: skip
    latents, noise = torch.randn(3, 4, 8, 8), torch.randn(3, 4, 8, 8)
    torch.manual_seed(7)
    noisy, _, sigmas = flux_train_utils.get_noisy_model_input_and_timesteps(
        args, make_noise_scheduler(args), latents, noise, "cpu", torch.float32
    )
    torch.manual_seed(7)  # host order: σ draw, then ξ, then the random strength
    u = torch.randn(3).sigmoid()
    k = args.discrete_flow_shift
    sig = ((u * k) / (1 + (k - 1) * u)).view(-1, 1, 1, 1)
    xi = torch.randn_like(latents)
    gamma = torch.rand(1) * 0.1
    assert torch.equal(sigmas, sig)
    assert torch.allclose(noisy, (1 - sig) * latents + sig * (noise + gamma * xi))


def test_sampler_scheduler_grid_mode() -> None:
    args = lab_args(timestep_sampling="sigma", weighting_scheme="logit_normal", discrete_flow_shift=3.0)
    sched = make_noise_scheduler(args)
    _, timesteps, sigmas = flux_train_utils.get_noisy_model_input_and_timesteps(
        args, sched, torch.randn(64, 4, 8, 8), torch.randn(64, 4, 8, 8), "cpu", torch.float32
    )
    grid = dict(zip(sched.timesteps.tolist(), sched.sigmas.tolist(), strict=True))
    assert all(abs(grid[t] - s) < 1e-6 for t, s in zip(timesteps.tolist(), sigmas.flatten().tolist(), strict=True))
    with pytest.raises(ValueError):
        flux_train_utils.get_noisy_model_input_and_timesteps(
            args, sched, torch.randn(0, 4, 8, 8), torch.randn(0, 4, 8, 8), "cpu", torch.float32
        )


def test_loss_weighting_and_prediction_types() -> None:
    s = torch.tensor([0.25, 0.5]).view(-1, 1, 1, 1)
    assert torch.allclose(flux_train_utils.compute_loss_weighting_for_sd3("sigma_sqrt", s), s**-2)
    assert torch.allclose(flux_train_utils.compute_loss_weighting_for_sd3("cosmap", s),
                          2 / (math.pi * (1 - 2 * s + 2 * s**2)))  # fmt: skip
    assert torch.equal(flux_train_utils.compute_loss_weighting_for_sd3("uniform", s), torch.ones_like(s))
    pred, noisy = torch.randn(2, 1, 2, 2), torch.randn(2, 1, 2, 2)
    ns = SimpleNamespace(weighting_scheme="uniform")
    for kind, expected in [("raw", pred), ("additive", pred + noisy), ("sigma_scaled", -s * pred + noisy)]:
        ns.model_prediction_type = kind
        out, _ = flux_train_utils.apply_model_prediction_type(ns, pred, noisy, s)
        assert torch.allclose(out, expected)
    assert flux_train_utils.time_shift(0.0, 1.0, torch.tensor(0.3)).item() == pytest.approx(0.3)


def test_train_lora_reproducible_and_hookable(tiny_model, tiny_data: LabData) -> None:
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    native = train_lora(tiny_model, tiny_data, steps=3, lr=1e-2, rank=2, seed=3)
    again = train_lora(tiny_model, tiny_data, steps=3, lr=1e-2, rank=2, seed=3)
    assert all(torch.equal(v, tiny_model.state_dict()[k]) for k, v in before.items())
    assert native.losses == again.losses and len(native.step_times) == 3
    assert delta_cosine(native.deltas, again.deltas) == pytest.approx(1.0)
    assert all(name.split(".")[-1] in {t.split(".")[-1] for t in LORA_TARGETS} for name in native.deltas)
    assert any(d.abs().sum() > 0 for d in native.deltas.values())
    assert {"loss/current", "loss/average", "lr/unet", "time/step"} <= native.logs[-1].keys()

    seen: list[int] = []

    def installer(trainer: LabTrainer, args):
        original = trainer.get_noise_pred_and_target

        def wrapped(*a, **k):
            seen.append(a[3].shape[-1])  # latents
            return original(*a, **k)

        @contextlib.contextmanager
        def scope():
            trainer.get_noise_pred_and_target = wrapped
            yield
            del trainer.get_noise_pred_and_target

        assert args.max_train_steps == 3 and args.seed == 3
        return scope()

    hooked = train_lora(tiny_model, tiny_data, steps=3, lr=1e-2, rank=2, seed=3, hook_installer=installer)
    assert len(seen) == 3 and hooked.losses == native.losses

    val = tiny_data.validation_set(per_bucket=1, seed=0)
    base = native_validation_loss(tiny_model, None, val, seed=0)
    zero = {k: torch.zeros_like(v) for k, v in native.deltas.items()}
    assert native_validation_loss(tiny_model, zero, val, seed=0) == pytest.approx(base)
    tuned = native_validation_loss(tiny_model, native.deltas, val, seed=0)
    assert tuned != base and tuned == native_validation_loss(tiny_model, native.deltas, val, seed=0)


def _host_sampler_functions() -> dict:
    """The host's own sampler functions, lifted out of an sd-scripts checkout (no sd-scripts imports)."""
    import ast
    import os
    from collections.abc import Callable

    checkout = os.environ.get("SD_SCRIPTS_DIR")
    if not checkout:
        pytest.skip("set SD_SCRIPTS_DIR to an sd-scripts checkout")
    path = os.path.join(checkout, "library", "flux_train_utils.py")  # a checkout without it fails: no silent skip
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    wanted = {"time_shift", "get_lin_function", "get_sigmas", "compute_density_for_timestep_sampling",
              "compute_loss_weighting_for_sd3", "get_noisy_model_input_and_timesteps"}  # fmt: skip
    body = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    namespace = {"torch": torch, "math": math, "Callable": Callable, "Tuple": tuple}
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), namespace)
    return namespace


@pytest.mark.parametrize("mode", ["uniform", "sigmoid", "shift", "flux_shift", "sigma"])
def test_sampler_bitwise_equal_to_host(mode: str) -> None:
    host = _host_sampler_functions()["get_noisy_model_input_and_timesteps"]
    for scheme, gamma, random_strength in [("uniform", None, False), ("logit_normal", 0.1, False), ("mode", 0.1, True)]:
        args = lab_args(timestep_sampling=mode, sigmoid_scale=1.3, weighting_scheme=scheme, ip_noise_gamma=gamma,
                        ip_noise_gamma_random_strength=random_strength)  # fmt: skip
        sched = make_noise_scheduler(args)
        latents = torch.randn(3, 4, 24, 40)
        noise = torch.randn_like(latents)
        outs = []
        for fn in (host, flux_train_utils.get_noisy_model_input_and_timesteps):
            torch.manual_seed(11)
            outs.append((*fn(args, sched, latents, noise, "cpu", torch.float32), torch.randn(2)))  # + RNG state after
        assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


@pytest.mark.parametrize("arch, routes_the_square_bucket", [(None, False), ("flux", True)])
def test_lab_plugin_reads_tiers_at_the_configs_arch(tiny_model, tiny_data: LabData, arch, routes_the_square_bucket) -> None:
    """The map tool's lab windows say arch = "flux" (tiers at 8 px per latent cell): they must fire in lab training."""
    from downscale_plugin.config import load_config
    from downscale_plugin.hosts.lab.adapter import LabPlugin

    # The 64x64 px bucket is a 16x16 latent: the 128 px tier at Flux's VAE factor, 64 px in lab pixels.
    table = {"routes": [{"route": "128:96", "sigma_min": 0.0}], **({"arch": arch} if arch else {})}
    plugin = LabPlugin.for_lab(load_config(table=table), TINY, tiny_data)
    steps, seed = 6, 3
    train_lora(tiny_model, tiny_data, steps=steps, lr=1e-2, rank=2, seed=seed, hook_installer=plugin.installer)
    square = sum(tiny_data.batch(step, 1, seed)["bucket"] == (64, 64) for step in range(steps))
    assert 0 < square < steps
    assert plugin.accounting.demote_fraction() == pytest.approx(square / steps if routes_the_square_bucket else 0.0)


def test_lab_plugin_rejects_an_arch_that_packs_unlike_the_lab(tiny_data: LabData) -> None:
    from downscale_plugin.config import load_config
    from downscale_plugin.hosts.lab.adapter import LabPlugin

    with pytest.raises(ValueError, match="arch: 'sdxl'.*allowed: flux"):
        LabPlugin.for_lab(load_config(table={"arch": "sdxl", "routes": [{"route": "128:96", "sigma_min": 0.0}]}), TINY, tiny_data)


def test_lab_auto_certifies_on_its_first_16_samples_then_routes(tiny_model, tiny_data: LabData, tmp_path) -> None:
    """mode = "auto" on the lab trainer: native until the 16th sample, certified windows after; budget 0: the native run."""
    import json

    from downscale_plugin.config import load_config
    from downscale_plugin.hosts.lab.adapter import LabPlugin

    table = {"mode": "auto", "arch": "flux", "map_out": str(tmp_path / "auto"), "map_ratios": [0.5], "map_bins": "0,0.5,1"}
    table.update(map_margin=0.99, certify_draws=2, certify_budget=0.5)  # 50 passes: a safe top bin costs 16 × 2 × 1.25 = 40
    table.update(certify_unpaid="buy")  # a 100-pass run cannot pay that back: certify all the same (the mechanics)
    common = dict(steps=100, lr=1e-2, rank=2, seed=3)
    native = train_lora(tiny_model, tiny_data, **common)
    off = LabPlugin.for_lab(load_config(table={**table, "certify_budget": 0.0}), TINY, tiny_data)
    assert train_lora(tiny_model, tiny_data, **common, hook_installer=off.installer).losses == native.losses and off.auto is None
    plugin = LabPlugin.for_lab(load_config(table=table), TINY, tiny_data)
    auto = train_lora(tiny_model, tiny_data, **common, hook_installer=plugin.installer)
    assert auto.losses[:15] == native.losses[:15]  # the probes' native steps, untouched by what the certifier drew
    blob = json.loads((tmp_path / "auto" / "certify.json").read_text())
    assert 0 < blob["cost"]["native_step_equivalents"] <= 50 and any(row["safe"] for row in blob["bins"])
    assert plugin.auto.done.result.spent == pytest.approx(blob["cost"]["native_step_equivalents"], abs=1e-3) and plugin.cfg.routes
    routed = [t.step for t in plugin.trace if t.rule_index >= 0]
    assert routed and min(routed) >= 16 and plugin.accounting.total_steps == 100
    short = LabPlugin.for_lab(load_config(table={**table, "certify_budget": 0.2}), TINY, tiny_data)  # 20: below one safe verdict
    with pytest.raises(ValueError, match=r"costs 39.7 native-step equivalents; certify_budget 0.2 of the run.s 100 passes is 20.0"):
        train_lora(tiny_model, tiny_data, **common, hook_installer=short.installer)
    unpaid = {**table, "certify_unpaid": "skip", "certify_draws": 4}  # a safe verdict 79: 84 later passes × 0.66 repay no bin
    unpaid = LabPlugin.for_lab(load_config(table=unpaid), TINY, tiny_data)
    assert train_lora(tiny_model, tiny_data, **common, hook_installer=unpaid.installer).losses == native.losses
    assert unpaid.auto.skipped.startswith("certification cannot pay in this run") and not unpaid.cfg.routes
