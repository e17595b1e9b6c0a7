"""The plugin against a real sd-scripts checkout (skipped unless ``SD_SCRIPTS_DIR`` points at one).

Trainer-class level: the real trainer classes, samplers, schedulers and ``process_batch``, with tiny
denoisers built from sd-scripts' own model classes (Flux, Chroma, MMDiT, NextDiT, Anima; the
HunyuanImage and SD/SDXL U-Net classes hard-code multi-billion-parameter configs, so those three use
the doubles' stand-ins under the host's class names) and a ``MagicMock`` accelerator. Then the
explicit call points of ``patches/``, applied to a copy of the checkout's ``train_network.py``, and
end-to-end runs of the real training scripts (``tests/sd_scripts_e2e.py``).

Run: ``SD_SCRIPTS_DIR=/path/to/sd-scripts python -m pytest tests/test_sd_scripts_real.py`` in an
environment with sd-scripts' requirements and this package installed.
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import importlib.util
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
from multiprocessing import Value
from pathlib import Path
from unittest.mock import MagicMock

import numpy as np
import pytest
import toml
import torch
from host_copies import host_copy, startup_env
from host_modules import host_modules
from rng_trap import NativeStepCheck, RngTrap
from rng_trap import same as rng_same

import downscale_plugin
from downscale_plugin.__main__ import main as cli_main
from downscale_plugin.fasterdit.policies import shift_sigma
from downscale_plugin.hosts.kohya.conventions import plugin_config
from downscale_plugin.hosts.kohya.selfcheck import drift_problems
from downscale_plugin.hosts.sd_scripts import selfcheck
from downscale_plugin.hosts.sd_scripts import start as sd_scripts_start
from downscale_plugin.hosts.sd_scripts.facts import BY_ARCH
from downscale_plugin.hosts.sd_scripts.startup import command_line_drift
from downscale_plugin.sigma import ddpm_t_to_sigma

SD_SCRIPTS_DIR = os.environ.get("SD_SCRIPTS_DIR")
pytestmark = pytest.mark.skipif(not SD_SCRIPTS_DIR, reason="set SD_SCRIPTS_DIR to an sd-scripts checkout (main 48d368fa)")

HERE = Path(__file__).parent
PATCH = HERE.parent / "patches" / "sd-scripts-48d368fa-explicit-hook.patch"
ALL_ROUTED = {"routes": [{"scale": 0.5, "sigma_min": 0.0}]}
SCRIPTS = {
    "sd1": ("train_network", "NetworkTrainer"),
    "sdxl": ("sdxl_train_network", "SdxlNetworkTrainer"),
    "sd3": ("sd3_train_network", "Sd3NetworkTrainer"),
    "flux": ("flux_train_network", "FluxNetworkTrainer"),
    "chroma": ("flux_train_network", "FluxNetworkTrainer"),
    "lumina": ("lumina_train_network", "LuminaNetworkTrainer"),
    "anima": ("anima_train_network", "AnimaNetworkTrainer"),
    "hunyuan_image": ("hunyuan_image_train_network", "HunyuanImageNetworkTrainer"),
}
EXTRA_ARGV = {"chroma": ("--model_type", "chroma", "--apply_t5_attn_mask")}


@pytest.fixture(scope="module", autouse=True)
def host():
    with host_modules(SD_SCRIPTS_DIR):
        yield


@pytest.fixture(autouse=True)
def quick_plan(monkeypatch):
    monkeypatch.setattr(sd_scripts_start, "PLAN_MC_SAMPLES", 512)


def _stand_ins():
    """The doubles' stand-in denoisers (host class names), loaded without the doubles' ``library``."""
    spec = importlib.util.spec_from_file_location("tiny_stand_ins", HERE / "doubles" / "library" / "tiny_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_model(arch: str) -> torch.nn.Module:
    """A tiny denoiser of the host's own class for ``arch`` (4 latent channels)."""
    torch.manual_seed(0)
    if arch == "flux":
        from library import flux_models

        params = flux_models.FluxParams(
            in_channels=16, vec_in_dim=8, context_in_dim=8, hidden_size=64, mlp_ratio=2.0, num_heads=2, depth=1,
            depth_single_blocks=1, axes_dim=[8, 12, 12], theta=10_000, qkv_bias=True, guidance_embed=True,
        )  # fmt: skip
        return flux_models.Flux(params)
    if arch == "chroma":
        from library import chroma_models

        params = chroma_models.ChromaParams(
            in_channels=16, context_in_dim=8, hidden_size=64, mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=1,
            axes_dim=[8, 12, 12], theta=10_000, qkv_bias=True, guidance_embed=True, approximator_in_dim=64,
            approximator_depth=1, approximator_hidden_size=64, _use_compiled=False,
        )  # fmt: skip
        return chroma_models.Chroma(params)
    if arch == "sd3":
        from library import sd3_models, strategy_base, strategy_sd3

        if strategy_base.TextEncodingStrategy.get_strategy() is None:  # the SD3 trainer reads it from there
            strategy_base.TextEncodingStrategy.set_strategy(strategy_sd3.Sd3TextEncodingStrategy())
        model = sd3_models.MMDiT(
            input_size=None, pos_embed_max_size=16, patch_size=2, in_channels=4, adm_in_channels=8, depth=2, num_patches=256,
            context_embedder_in_features=4096, context_embedder_out_features=128, model_type="sd3m",
        )  # fmt: skip
        model.initialize_weights()  # its pos_embed buffer starts empty; checkpoints fill it
        return model
    if arch == "lumina":
        from library import lumina_models

        return lumina_models.NextDiT(
            patch_size=2, in_channels=4, dim=120, n_layers=1, n_refiner_layers=1, n_heads=4, n_kv_heads=2,
            axes_dims=[10, 10, 10], axes_lens=[10, 32, 32], cap_feat_dim=32,
        )  # fmt: skip
    if arch == "anima":
        from library import anima_models

        model = anima_models.Anima(
            max_img_h=64, max_img_w=64, max_frames=1, in_channels=4, out_channels=4, patch_spatial=2, patch_temporal=1,
            model_channels=64, num_blocks=1, num_heads=2, crossattn_emb_channels=32, pos_emb_cls="rope3d", pos_emb_learnable=True,
            use_adaln_lora=True, adaln_lora_dim=16, rope_h_extrapolation_ratio=4.0, rope_w_extrapolation_ratio=4.0,
            rope_enable_fps_modulation=False, use_llm_adapter=False,
        )  # fmt: skip
        model.llm_adapter = anima_models.LLMAdapter(32, 32, 32, num_layers=1, num_heads=2, self_attn=True)  # the real one is 1024-wide
        return model
    stand_ins = _stand_ins()
    name = {"sd1": "UNet2DConditionModel", "sdxl": "SdxlUNet2DConditionModel", "hunyuan_image": "HYImageDiffusionTransformer"}[arch]
    return getattr(stand_ins, name)(4)


def text_conds(arch: str, batch: int) -> list:
    """Cached text-encoder outputs in the layout each trainer unpacks."""
    gen = torch.Generator().manual_seed(1)

    def randn(*shape):
        return torch.randn(batch, *shape, generator=gen)

    ones = torch.ones(batch, 6)
    return {
        "sd1": lambda: [randn(7, 8)],
        "sdxl": lambda: [randn(7, 8), randn(7, 8), randn(8)],
        "sd3": lambda: [randn(5, 8), randn(6, 4096), randn(8), ones[:, :5], ones[:, :5], ones],
        "flux": lambda: [randn(8), randn(6, 8), torch.zeros(batch, 6, 3), ones],
        "chroma": lambda: [randn(8), randn(6, 8), torch.zeros(batch, 6, 3), ones],
        "lumina": lambda: [randn(6, 32), torch.zeros(batch, 6, dtype=torch.long), ones.long()],
        "anima": lambda: [randn(6, 32), ones, torch.zeros(batch, 6, dtype=torch.long), ones, torch.zeros(batch)],  # + dropout rates
        "hunyuan_image": lambda: [randn(6, 8), ones, randn(4, 8), ones[:, :4], None],
    }[arch]()


def batch_for(arch: str, batch: int, seed: int) -> dict:
    side = 4 if arch == "hunyuan_image" else 16  # 128 px: HunyuanImage's VAE is 32x, the others 8x
    return {
        "latents": torch.randn(batch, 4, side, side, generator=torch.Generator().manual_seed(seed)),
        "text_encoder_outputs_list": text_conds(arch, batch),
        "loss_weights": torch.ones(batch),
        "original_sizes_hw": torch.tensor([[128, 128]] * batch),
        "crop_top_lefts": torch.tensor([[0, 0]] * batch),
        "target_sizes_hw": torch.tensor([[128, 128]] * batch),
    }


def accelerator() -> MagicMock:
    acc = MagicMock()
    acc.device = torch.device("cpu")
    acc.process_index, acc.num_processes, acc.is_main_process = 0, 1, True
    acc.autocast.side_effect = contextlib.nullcontext
    acc.unwrap_model.side_effect = lambda model: model
    acc.reduce.side_effect = lambda tensor, reduction="sum": tensor
    return acc


class Setup:
    """A real trainer, its args, a tiny denoiser with the plugin's LoRA applied, and a call recorder."""

    def __init__(self, arch: str, downscale: dict | None, *argv: str):
        script, cls = SCRIPTS[arch]
        module = importlib.import_module(script)
        self.arch = arch
        self.trainer = getattr(module, cls)()
        self.plain = getattr(module, cls)()
        self.args = module.setup_parser().parse_args(["--network_module", "downscale_plugin", *EXTRA_ARGV.get(arch, ()), *argv])
        self.args.downscale = downscale
        for trainer in (self.trainer, self.plain):
            trainer.model_type = getattr(self.args, "model_type", None)
        self.acc = accelerator()
        self.unet = tiny_model(arch)
        self.calls: list[tuple[tuple, dict]] = []
        forward = self.unet.forward
        self.unet.forward = lambda *a, **k: self.calls.append((a, k)) or forward(*a, **k)
        self.network = train(self.trainer, self.args, self.acc, self.unet)
        self.scheduler = self.trainer.get_noise_scheduler(self.args, torch.device("cpu"))
        self.encoding = self.trainer.get_text_encoding_strategy(self.args) if arch == "anima" else None  # its process_batch uses it

    def step(self, batch: dict, is_train: bool = True, trainer=None) -> torch.Tensor:
        trainer = trainer or self.trainer
        return trainer.process_batch(
            batch, [], self.unet, self.network, None, self.scheduler, torch.float32, torch.float32, self.acc, self.args, self.encoding, None,
            is_train=is_train, train_text_encoder=False, train_unet=True,
        )  # fmt: skip

    def model_input(self, index: int = -1) -> tuple[torch.Size, torch.Tensor]:
        """(denoiser input shape, its time input) of a recorded call."""
        a, k = self.calls[index]
        if self.arch in ("flux", "chroma"):
            return k["img"].shape, k["timesteps"]
        if self.arch == "lumina":
            return k["x"].shape, k["t"]
        return a[0].shape, a[1]

    def sigma(self, index: int = -1) -> torch.Tensor:
        """The flow σ the denoiser's time input of a recorded call stands for."""
        t = self.model_input(index)[1].double()
        if self.arch == "lumina":
            return 1.0 - t
        if self.arch in ("sd3", "hunyuan_image"):
            return t / 1000
        if self.arch in ("sd1", "sdxl"):
            return ddpm_t_to_sigma(t.long(), self.scheduler.alphas_cumprod).double()
        return t


def train(self, args, accelerator, unet):
    """Stands in for ``NetworkTrainer.train``'s frame: the plugin finds ``self`` and the loop state here."""
    current_step = Value("i", 0)  # noqa: F841 (read by the plugin from this frame)
    weight_dtype = torch.float32  # noqa: F841
    text_encoders = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    network = downscale_plugin.create_network(1.0, 4, 1.0, None, text_encoders, unet, neuron_dropout=None, dropout=None)
    network.prepare_network(args)
    network.apply_to(text_encoders, unet, False, True)
    return network


def small_shape(arch: str, batch: int) -> tuple[int, ...]:
    return {
        "flux": (batch, 16, 16),
        "chroma": (batch, 16, 16),
        "anima": (batch, 4, 1, 8, 8),
        "hunyuan_image": (batch, 4, 2, 2),
    }.get(arch, (batch, 4, 8, 8))


@pytest.mark.parametrize("arch", list(SCRIPTS))
def test_routed_step_runs_the_real_trainer_at_the_small_grid_with_the_host_sigma(arch):
    setup = Setup(arch, ALL_ROUTED)
    torch.manual_seed(3)
    loss = setup.step(batch_for(arch, 1, 0))
    routed_shape, routed_sigma = setup.model_input()[0], setup.sigma()
    torch.manual_seed(3)
    setup.step(batch_for(arch, 1, 0), trainer=setup.plain)  # the class's own method: what the host does unpatched
    assert torch.isfinite(loss) and tuple(routed_shape) == small_shape(arch, 1)
    assert tuple(setup.model_input()[0]) != small_shape(arch, 1)
    assert torch.equal(routed_sigma, setup.sigma())  # the σ the host drew at the native grid, exactly
    setup.step(batch_for(arch, 2, 1))
    assert tuple(setup.model_input()[0]) == small_shape(arch, 2)


@pytest.mark.parametrize("arch", list(SCRIPTS))
def test_native_step_and_validation_are_bitwise_the_host(arch):
    probe = Setup(arch, ALL_ROUTED)
    torch.manual_seed(5)
    probe.step(batch_for(arch, 1, 0), trainer=probe.plain)
    sigma = float(probe.sigma())
    window = {"sigma_min": 0.0, "sigma_max": sigma - 1e-3} if sigma > 0.5 else {"sigma_min": sigma + 1e-3}
    setup = Setup(arch, {"routes": [{"scale": 0.5, **window}]})  # eligible, but this step's σ is outside the window
    results = []
    for trainer in (setup.trainer, setup.plain):
        for is_train in (True, False):
            torch.manual_seed(5)
            loss = setup.step(batch_for(arch, 1, 0), is_train=is_train, trainer=trainer)
            results.append((loss.detach(), torch.get_rng_state(), setup.model_input()[1]))
    for ours, theirs in zip(results[:2], results[2:], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert setup.network.downscale_run.accounting.total_steps == 1  # the validation call was not a train step


@pytest.mark.parametrize("arch", ["flux", "sd3", "lumina", "sdxl"])
def test_sampler_slot_is_restored_after_a_host_exception(arch):
    setup = Setup(arch, ALL_ROUTED)
    module_name, contract = BY_ARCH[arch].sampler
    module = importlib.import_module(module_name)
    name = "get_timesteps" if contract == "ddpm" else "get_noisy_model_input_and_timesteps"
    original = getattr(module, name)
    setup.unet.forward = MagicMock(side_effect=RuntimeError("host failure"))
    with pytest.raises(RuntimeError, match="host failure"):
        setup.step(batch_for(arch, 1, 0))
    assert getattr(module, name) is original


def test_a_routed_sdxl_step_conditions_on_the_small_buckets_sizes_and_a_native_one_on_the_hosts():
    """The real ``SdxlNetworkTrainer.call_unet``: a routed step's size embeddings are ``get_size_embeddings`` of the
    source's original size, the crop and the target at the small grid (hook.at_grid_batch); the host's batch is
    untouched and a step left to the host embeds its own sizes."""
    from library import sdxl_train_util

    setup = Setup("sdxl", ALL_ROUTED)
    batch = batch_for("sdxl", 2, 0)
    batch.update(
        original_sizes_hw=torch.tensor([[300, 400], [128, 128]]),
        crop_top_lefts=torch.tensor([[16, 8], [0, 0]]),
        target_sizes_hw=torch.tensor([[128, 128], [128, 128]]),
    )
    frozen = {key: value.clone() for key, value in batch.items() if torch.is_tensor(value)}
    pool = batch["text_encoder_outputs_list"][2].shape[1]
    setup.step(batch)
    routed = setup.calls[-1][0]
    assert tuple(routed[0].shape[-2:]) == (8, 8)
    small = sdxl_train_util.get_size_embeddings(
        batch["original_sizes_hw"], batch["crop_top_lefts"] // 2, batch["target_sizes_hw"] // 2, "cpu"
    )
    assert torch.equal(routed[3][:, pool:], small)
    assert all(torch.equal(batch[key], value) for key, value in frozen.items())
    setup.step(batch, trainer=setup.plain)
    native = setup.calls[-1][0]
    own = sdxl_train_util.get_size_embeddings(batch["original_sizes_hw"], batch["crop_top_lefts"], batch["target_sizes_hw"], "cpu")
    assert torch.equal(native[3][:, pool:], own) and not torch.equal(own, small)


# -- host drift caught at start (hosts/sd_scripts/selfcheck.py) --------------------------------------


@pytest.mark.parametrize("arch", ["flux", "lumina", "sd3", "sdxl"])
def test_selfcheck_every_piece_agrees_with_the_real_host(arch):
    record = BY_ARCH[arch]
    base = importlib.import_module(SCRIPTS[arch][0]).setup_parser().parse_args([])  # the script's own options at their defaults
    checks = selfcheck.standalone(record, importlib.import_module(record.sampler[0]), base)
    assert len(checks) >= 2 and drift_problems(checks, selfcheck.CHECKED_AGAINST) == []
    assert command_line_drift([f"{SD_SCRIPTS_DIR}/{SCRIPTS[arch][0]}.py", "--network_module", "downscale_plugin"]) == []


def test_real_flux_noise_scaled_by_1_01_is_refused_at_start_by_check_and_by_the_startup_check(monkeypatch, capsys):
    module = importlib.import_module("library.flux_train_utils")
    original = module.get_noisy_model_input_and_timesteps
    monkeypatch.setattr(module, "get_noisy_model_input_and_timesteps", lambda a, s, x, n, dev, dt: original(a, s, x, n * 1.01, dev, dt))
    named = "library.flux_train_utils.get_noisy_model_input_and_timesteps no longer matches the routed step's noisy input"
    with pytest.raises(sd_scripts_start.HostError) as raised:
        Setup("flux", ALL_ROUTED)
    assert named in str(raised.value) and "the plugin was checked against sd-scripts 48d368fa" in str(raised.value)
    command = [
        f"{SD_SCRIPTS_DIR}/flux_train_network.py",
        "--network_module",
        "downscale_plugin",
        "--network_args",
        "ds_routes=1024:768@0.65-0.95",
    ]
    spec = importlib.util.spec_from_file_location("this_startup_check", HERE.parent / "downscale_plugin_startup.py")
    startup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(startup)
    report = startup.report(command)
    assert named in report and "stopped before the trainer loads any model" in report
    capsys.readouterr()
    assert cli_main(["check", "--", *command]) == 2 and named in capsys.readouterr().err


def test_a_real_trainer_drawing_before_its_sigma_draw_is_refused_at_start(monkeypatch):
    """The real FluxNetworkTrainer's step drawing once more before its σ draw: the dry run would predict another σ."""
    trainer_class = importlib.import_module("flux_train_network").FluxNetworkTrainer
    own = trainer_class.get_noise_pred_and_target

    def drifted(self, *args, **kwargs):
        torch.rand(1)
        return own(self, *args, **kwargs)

    monkeypatch.setattr(trainer_class, "get_noise_pred_and_target", drifted)
    with pytest.raises(
        sd_scripts_start.HostError, match="FluxNetworkTrainer.get_noise_pred_and_target no longer matches the dry run's RNG use"
    ):
        Setup("flux", ALL_ROUTED)


def test_lumina_rope_drift_is_refused_only_where_the_run_interpolates_positions(monkeypatch):
    """``positions = "interpolate"`` re-evaluates Lumina's RoPE; the host embedder's table drifting stops that run only."""
    interpolate = {**ALL_ROUTED, "positions": "interpolate"}
    Setup("lumina", interpolate)  # the plugin's RoPE is the host's at integer positions
    embedder = importlib.import_module("library.lumina_models").RopeEmbedder
    table = embedder.__call__
    monkeypatch.setattr(embedder, "__call__", lambda self, ids: table(self, ids) * 1.001)
    with pytest.raises(sd_scripts_start.HostError, match="library.lumina_models.RopeEmbedder no longer matches RoPE at real positions"):
        Setup("lumina", interpolate)
    Setup("lumina", ALL_ROUTED)


def test_fasterdit_options_on_the_real_flux_trainer(monkeypatch):
    """λ > 0, ``res_shift`` and ``interpolate`` together on a routed step of the real Flux trainer."""
    from library import flux_utils, train_util

    seen = []
    host_loss, host_ids = train_util.conditional_loss, flux_utils.prepare_img_ids
    recorder = lambda pred, target, *a, **k: seen.append((pred.detach(), target.detach())) or host_loss(pred, target, *a, **k)  # noqa: E731
    monkeypatch.setattr(train_util, "conditional_loss", recorder)
    options = {**ALL_ROUTED, "sigma_policy": "res_shift", "positions": "interpolate"}
    setup, without = Setup("flux", {**options, "direction_loss_weight": 0.5}), Setup("flux", options)
    losses = []
    for s in (setup, without):
        torch.manual_seed(3)
        losses.append(s.step(batch_for("flux", 1, 0)).detach())
    routed_shape, routed_sigma = setup.model_input(0)[0], setup.sigma(0)
    ids = setup.calls[0][1]["img_ids"]
    torch.manual_seed(3)
    setup.step(batch_for("flux", 1, 0), trainer=setup.plain)  # the class's own method: the σ the host draws natively
    assert tuple(routed_shape) == small_shape("flux", 1)
    torch.testing.assert_close(routed_sigma, shift_sigma(setup.sigma(), 0.5), atol=1e-6, rtol=0)  # 16 of 64 tokens
    assert sorted(set(ids[0, :, 1].tolist())) == [0.0, 2.0, 4.0, 6.0] and sorted(set(ids[0, :, 2].tolist())) == [0.0, 2.0, 4.0, 6.0]
    assert flux_utils.prepare_img_ids is host_ids and train_util.conditional_loss is recorder  # every scope restored
    pred, target = seen[0]
    term = (1 - torch.nn.functional.cosine_similarity(pred, target, dim=1)).mean()
    torch.testing.assert_close(losses[0] - losses[1], 0.5 * term, rtol=1e-4, atol=1e-6)
    accounting = setup.network.downscale_run.accounting
    assert accounting.counts.sigma_run == pytest.approx(float(routed_sigma), abs=1e-6)
    assert accounting.counts.sigma_drawn == pytest.approx(float(setup.sigma()), abs=1e-6)


def test_patched_host_uses_the_explicit_call_points(tmp_path):
    patched = tmp_path / "patched"
    patched.mkdir()
    shutil.copy(Path(SD_SCRIPTS_DIR) / "train_network.py", patched / "train_network.py")
    subprocess.run(["patch", "-s", "-p1", "-d", str(patched), "-i", str(PATCH)], check=True)
    for name in ("train_network", "flux_train_network"):
        sys.modules.pop(name, None)
    sys.path.insert(0, str(patched))
    try:
        setup = Setup("flux", ALL_ROUTED)
        assert setup.trainer.noise_pred_and_target_hook is not None
        assert "get_noise_pred_and_target" not in vars(setup.trainer) and "generate_step_logs" not in vars(setup.trainer)
        setup.step(batch_for("flux", 1, 0))
        assert tuple(setup.model_input()[0]) == small_shape("flux", 1)
        assert sys.modules["train_network"].__file__ == str(patched / "train_network.py")
    finally:
        sys.path.remove(str(patched))
        for name in ("train_network", "flux_train_network"):
            sys.modules.pop(name, None)


@pytest.mark.parametrize("name", list(SCRIPTS)[1:])
def test_example_configs_reach_the_plugin_through_the_hosts_own_toml_reader(name, monkeypatch):
    """``read_config_from_file`` flattens the TOML; ``[plugins.downscale]`` must arrive intact as ``args.downscale``."""
    from library import train_util

    parser = importlib.import_module(SCRIPTS[name][0]).setup_parser()
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--config_file", str(HERE.parent / "example_configs" / f"{name}.toml")])
    args = train_util.read_config_from_file(parser.parse_args(), parser)  # re-parses sys.argv over the TOML, as the scripts do
    assert args.network_module == "downscale_plugin" and isinstance(args.downscale, dict)
    routes = {"anima": ["paper-768", "paper-896"], "hunyuan_image": ["2048:1536", "2048:1792"]}.get(name, ["1024:768", "1024:896"])
    assert [r.label for r in plugin_config({}, args).routes] == routes


EARLY_ERROR_TOML = """
[model]
pretrained_model_name_or_path = "no-such-flux-checkpoint.safetensors"
clip_l = "no-such-clip.safetensors"
t5xxl = "no-such-t5.safetensors"
ae = "no-such-ae.safetensors"

[training]
network_module = "downscale_plugin"
network_dim = 4
output_dir = "out"
max_train_steps = 4

[[plugins.downscale.routes]]
route = "1024:768"
sigma_min = 0.65
sigma_max = 0.95
"""
# What the real script logs on its way to the models: none of it may come before the plugin's error.
HOST_PROGRESS = ("Loading settings from", "Loading dataset config", "import network module", "Building", "loading", "caching")


def _early_error_run(tmp_path: Path, launcher: str, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    import time

    config = tmp_path / "train.toml"
    config.write_text(EARLY_ERROR_TOML)
    script = [str(Path(SD_SCRIPTS_DIR) / "flux_train_network.py"), "--config_file", str(config)]
    script += ["--network_args", "ds_gate=sometimes", "ds_routes=1024:768@a-0.95"]  # the user's unchanged command + a bad arg
    if launcher == "accelerate":
        script = ["-m", "accelerate.commands.launch", "--num_processes", "1", "--num_cpu_threads_per_process", "1", *script]
    full_env = {k: v for k, v in os.environ.items() if k != "DOWNSCALE_PLUGIN_NO_STARTUP_CHECK"}
    full_env.update({"HF_HUB_OFFLINE": "1", "COLUMNS": "1000", **env})
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *script], cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=300)
    return proc, time.perf_counter() - start


@pytest.mark.parametrize("launcher", ["python", "accelerate"])
def test_bad_plugin_config_fails_before_the_real_script_loads_a_model(launcher, tmp_path):
    """The real ``flux_train_network.py`` imports the network module after loading and caching every model;
    the installed startup check (``downscale_plugin_startup.pth``) stops a bad config before the script runs."""
    import sysconfig

    pth = [Path(sysconfig.get_paths()[k]) / "downscale_plugin_startup.pth" for k in ("purelib", "platlib")]
    assert any(p.is_file() for p in pth), f"the startup hook is not installed in {sys.prefix}: pip install --no-deps -e ."
    proc, seconds = _early_error_run(tmp_path, launcher)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log[-3000:]
    assert "[network_args] ds_gate: 'sometimes' is not allowed (allowed: coupled, strict)" in log, log[-3000:]
    assert "[network_args] ds_routes: entry '1024:768@a-0.95': sigma_min 'a' is not a number" in log
    assert "stopped before the trainer loads any model" in log
    assert not [marker for marker in HOST_PROGRESS if marker in log], log[-3000:]
    assert seconds < 20, f"{seconds:.1f} s to the error"


def test_without_the_startup_check_the_real_script_runs_into_its_models(tmp_path):
    """The control: the same command with ``DOWNSCALE_PLUGIN_NO_STARTUP_CHECK=1`` gets past the point where the
    check stopped it (the host reads its settings and goes on towards the checkpoints, which do not exist)."""
    proc, _ = _early_error_run(tmp_path, "python", DOWNSCALE_PLUGIN_NO_STARTUP_CHECK="1")
    log = proc.stdout + proc.stderr
    assert "Loading settings from" in log and "stopped before the trainer loads any model" not in log, log[-3000:]


def test_banner_tables_stay_tables_under_the_hosts_logging_setup(capsys):
    """``library.utils.setup_logging`` (rich, wrapping at the console width: 80 columns into a file) is what
    every real script installs; the banner and summary go around it, unwrapped, and the log says so."""
    import logging

    from library.utils import setup_logging

    from downscale_plugin.hosts.kohya.run import show

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    table = "\n".join(f"  r{i}  {'1024x1024':<10} {'128x128':<10} {i * 11.1:>6.1f} %" + " " * 40 + f"{'FLOPs saved':>20}" for i in range(4))
    try:
        setup_logging(reset=True)
        show(table, "test table")
        out, err = capsys.readouterr()
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert max(map(len, table.splitlines())) > 80
    assert table in out, out
    assert "test table printed" in err and "FLOPs saved" not in err, err


def end_to_end(arch: str, work: Path, mode: str = "train", **e2e_env: str) -> str:
    """Run ``tests/sd_scripts_e2e.py`` (the real script's ``__main__`` path, ``e2e_env``: its ``E2E_*`` settings); its
    log, whitespace collapsed (the host logs through rich, which pads lines)."""
    env = {**os.environ, "COLUMNS": "1000", **e2e_env}  # unwrapped log lines
    proc = subprocess.run(
        [sys.executable, str(HERE / "sd_scripts_e2e.py"), arch, str(work), mode],
        cwd=SD_SCRIPTS_DIR,
        env=env,
        capture_output=True,
        text=True,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "E2E OK" in log, log[-4000:]
    return " ".join(log.split())


@pytest.mark.parametrize("arch", ["flux", "sd3", "anima"])
def test_real_training_script_end_to_end(arch, tmp_path):
    """``--network_module downscale_plugin`` with routes, in the real script."""
    log = end_to_end(arch, tmp_path)
    assert "downscale_plugin" in log and "train forwards" in log and "routed" in log


@pytest.mark.parametrize("after_map", ["stop", "train"])
@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_map_mode_in_the_real_training_script(arch, after_map, tmp_path):
    """``mode = "map"`` on the tiny Flux / SD3 run's own model, LoRA and images: the map's files, then the
    script ends (exit 0, no weights) or trains with the derived windows (the e2e script checks both).
    map_reenc / map_pixel run the VAE arms on the run's own real VAE class (Flux's tiny AutoEncoder,
    SD3's full-size SDVAE with random weights)."""
    e2e_env = {}
    if after_map == "train":  # 8 probes (fewer certify nothing at the family-wise calibrated read) of 8 distinct images
        e2e_env = {"E2E_MAP_IMAGES": "8", "E2E_IMAGES": "8", "E2E_REPEATS": "1", "E2E_STEPS": "16"}
    log = end_to_end(arch, tmp_path, f"map-{after_map}", **e2e_env)
    found = re.search(r"gradient map before train batch (\d+)", log)
    assert found, log[-4000:]
    batch = int(found[1])  # a repeated image is no probe: the map may come after batch 8, and routed steps must follow
    assert (batch == 2) if after_map == "stop" else (8 <= batch < 16), batch
    rows = list(csv.DictReader((tmp_path / "map" / "map.csv").open()))
    assert sorted({r["arm"] for r in rows}) == ["latent_0.5", "pixel_0.5", "reenc"] and all(math.isfinite(float(r["excess"])) for r in rows)
    windows = (tmp_path / "map" / "windows.toml").read_text()
    if after_map == "stop":  # 2 probes: no safe window, and the file says so (the plugin disabled)
        assert "routes" not in toml.loads(windows) and toml.loads(windows)["enable"] is False, windows
        assert "# no route has a safe window at this margin: the plugin is disabled" in windows
        assert f"ending the run before training batch {batch} (no weights saved)" in log
    else:
        assert toml.loads(windows)["routes"] and f"training continues from batch {batch} with the derived windows" in log


# -- drift on copies of the real checkout: an added option passes, a changed formula stops the script ----------

NOISE_DRAW = ("library/flux_train_utils.py", '    assert bsz > 0, "Batch size not large enough"')  # in get_noisy_model_input_and_timesteps
ADDED_OPTION = (
    ("library/flux_train_utils.py", "def add_flux_train_arguments(parser: argparse.ArgumentParser):",
     '    parser.add_argument("--noise_scale", type=float, default=1.0)'),
    (*NOISE_DRAW, "    noise = noise * args.noise_scale"),
)  # fmt: skip
CHANGED_FORMULA = ((*NOISE_DRAW, "    noise = noise * 1.01"),)
FLUX_SAMPLER = "library.flux_train_utils.get_noisy_model_input_and_timesteps"


def flux_record(work: Path, checkout: Path | str) -> tuple[dict, list[float]]:
    """The real Flux script of ``checkout`` through ``tests/sd_scripts_e2e.py record`` (routes at every σ > 0.3): its
    ``record.json`` and every step's ``loss/current`` from its TensorBoard log."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    env = {**os.environ, "COLUMNS": "1000"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "sd_scripts_e2e.py"), "flux", str(work), "record"],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "E2E OK" in log, log[-4000:]
    (events,) = (work / "logs").rglob("events.out.tfevents.*")
    scalars = EventAccumulator(str(events))
    scalars.Reload()
    return json.loads((work / "record.json").read_text()), [e.value for e in scalars.Scalars("loss/current")]


def test_a_real_host_copy_that_added_an_option_trains_exactly_as_the_unchanged_host(tmp_path):
    """A newer sd-scripts with one more option (neutral default) that its noise function reads as ``args.noise_scale``:
    the check calls it with the run's own args, so the run is not refused, and its routed steps and losses are the
    unchanged host's, bit for bit. Before the model loads, the same check on the command line passes it at the default
    and refuses ``--noise_scale 1.01``, the run's own value, as a changed result."""
    copy = host_copy(SD_SCRIPTS_DIR, tmp_path / "sd-scripts", ADDED_OPTION)
    reference, reference_losses = flux_record(tmp_path / "unchanged", SD_SCRIPTS_DIR)
    record, losses = flux_record(tmp_path / "added", copy)
    assert sum(step["rule"] >= 0 for step in record["steps"]) >= 4  # routed steps
    assert record["steps"] == reference["steps"] and losses == reference_losses and len(losses) == len(record["steps"])
    assert "ss_downscale_host_check" not in record["metadata"]
    check = [sys.executable, "-m", "downscale_plugin", "check", "--", str(copy / "flux_train_network.py")]
    check += ["--config_file", str(tmp_path / "added" / "train.toml")]
    passed = subprocess.run(check, cwd=tmp_path, env=startup_env(), capture_output=True, text=True, timeout=300)
    assert passed.returncode == 0 and "config OK" in passed.stdout, (passed.stdout + passed.stderr)[-3000:]
    refused = subprocess.run(
        [*check, "--noise_scale", "1.01"], cwd=tmp_path, env=startup_env(), capture_output=True, text=True, timeout=300
    )
    assert refused.returncode == 2, (refused.stdout + refused.stderr)[-3000:]
    assert f"{FLUX_SAMPLER} no longer matches the routed step's noisy input" in refused.stderr
    assert "the host's result differs" in refused.stderr and "could not call" not in refused.stderr


def test_a_real_host_copy_with_a_changed_noise_formula_is_refused_before_the_script_loads_a_model(tmp_path):
    """The copy's noise × 1.01 in its own ``get_noisy_model_input_and_timesteps``: the real script, started as a user
    starts it, stops in the startup check before it reads its settings; ``host_check = "warn"`` logs it and goes on."""
    copy = host_copy(SD_SCRIPTS_DIR, tmp_path / "sd-scripts", CHANGED_FORMULA)
    config = tmp_path / "train.toml"
    config.write_text(EARLY_ERROR_TOML)  # checkpoints that do not exist: a run past the check fails loading them
    script = [sys.executable, str(copy / "flux_train_network.py"), "--config_file", str(config)]
    proc = subprocess.run(script, cwd=tmp_path, env=startup_env(), capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log[-3000:]
    found = "no longer matches the routed step's noisy input for a replayed σ (families.FlowFamily replay): the host's result differs"
    assert f"{FLUX_SAMPLER} {found} (noisy input (ip_noise_gamma None, torch.float32): max |host − plugin| = " in log, log[-3000:]
    assert "the plugin was checked against sd-scripts 48d368fa" in log and "stopped before the trainer loads any model" in log
    assert not [marker for marker in HOST_PROGRESS if marker in log], log[-3000:]
    warned = subprocess.run(
        [*script, "--network_args", "ds_host_check=warn"], cwd=tmp_path, env=startup_env(), capture_output=True, text=True, timeout=300
    )
    log = warned.stdout + warned.stderr
    assert f"{FLUX_SAMPLER} no longer matches" in log and 'host_check = "warn": training on' in log, log[-3000:]
    assert "stopped before the trainer loads any model" not in log and "Loading settings from" in log, log[-3000:]


# -- issue 10 items 2 and 3: the host's generators, untouched (tests/rng_trap.py) ----------------------

RNG_ALL_NOISE = (
    "--multires_noise_iterations", "3", "--multires_noise_discount", "0.5", "--noise_offset", "0.1", "--noise_offset_random_strength",
    "--adaptive_noise_scale", "0.05", "--ip_noise_gamma", "0.1", "--ip_noise_gamma_random_strength",
)  # fmt: skip
RNG_IP = ("--ip_noise_gamma", "0.1", "--ip_noise_gamma_random_strength")
# What each host noise path reads (tu:6071-6107; ftu:519-527; ltu:863-871; sd3_train_utils: none of them).
RNG_CASES = [
    ("sd1", ("--multires_noise_iterations", "6")),
    ("sd1", ("--noise_offset", "0.1", "--adaptive_noise_scale", "0.05")),
    ("sd1", RNG_ALL_NOISE),
    ("sdxl", ("--multires_noise_iterations", "3", "--multires_noise_discount", "0.5")),
    ("sdxl", ("--noise_offset", "0.1", "--noise_offset_random_strength")),
    ("sdxl", RNG_IP),
    ("sdxl", RNG_ALL_NOISE),
    ("flux", RNG_IP),
    ("flux", RNG_ALL_NOISE),
    ("lumina", RNG_IP),
    ("lumina", RNG_ALL_NOISE),
    ("sd3", RNG_ALL_NOISE),
]
RNG_IDS = [f"{arch}-{'-'.join(o.lstrip('-') for o in opts)}" for arch, opts in RNG_CASES]
RNG_MIXED = (0, 2, 6, 7, 9, 11)  # sd1 multires, sd1 all, sdxl all, flux ip, lumina ip, sd3: the mixed runs cost 12 real steps each
RNG_THIRD = {"sd1": (0.5, 0.75), "sdxl": (0.5, 0.75), "flux": (0.65, 0.85), "sd3": (0.37, 0.67), "lumina": (0.8, 0.9)}  # ~30 % of σ


def _rng_seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


@pytest.mark.parametrize(("arch", "options"), RNG_CASES, ids=RNG_IDS)
def test_rng_the_doubles_noise_paths_are_the_hosts_bit_for_bit(arch, options):
    """The doubles' noise + σ functions (tests/doubles/library) against the host's, same states in: same tensors, same states out."""
    with host_modules():  # the doubles' library, its own modules; the functions keep them after the swap back
        from library import flux_train_utils as double_flux
        from library import lumina_train_util as double_lumina
        from library import sd3_train_utils as double_sd3
        from library import train_util as double_train_util
    from library import flux_train_utils, lumina_train_util, sd3_train_utils, train_util

    script, cls = SCRIPTS[arch]
    module = importlib.import_module(script)
    args = module.setup_parser().parse_args(["--network_module", "downscale_plugin", *options])
    scheduler = getattr(module, cls)().get_noise_scheduler(args, torch.device("cpu"))
    latents = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(3))
    pairs = {
        "sd1": (
            train_util.get_noise_noisy_latents_and_timesteps,
            double_train_util.get_noise_noisy_latents_and_timesteps,
            (args, scheduler, latents),
        ),
        "flux": (flux_train_utils.get_noisy_model_input_and_timesteps, double_flux.get_noisy_model_input_and_timesteps, None),
        "lumina": (lumina_train_util.get_noisy_model_input_and_timesteps, double_lumina.get_noisy_model_input_and_timesteps, None),
        "sd3": (sd3_train_utils.get_noisy_model_input_and_timesteps, double_sd3.get_noisy_model_input_and_timesteps, None),
    }
    host_fn, double_fn, call = pairs["sd1" if arch == "sdxl" else arch]
    results = []
    for fn in (host_fn, double_fn):
        _rng_seed(9)
        noise = torch.randn_like(latents)
        if call is not None:
            out = fn(*call)
        elif arch == "sd3":
            out = fn(args, latents, noise, "cpu", torch.float32)
        else:
            out = fn(args, scheduler, latents, noise, "cpu", torch.float32)
        results.append((out, torch.get_rng_state(), random.getstate(), np.random.get_state()))
    assert rng_same(results[0], results[1])
    assert double_fn.__module__.startswith(("library.", "downscale_plugin.lab.")) and double_fn is not host_fn


@pytest.mark.parametrize(("arch", "options"), RNG_CASES, ids=RNG_IDS)
@pytest.mark.parametrize("config", ["never-hit", "not-eligible"])
def test_rng_real_trainer_whose_routes_cannot_fire_is_the_host_bit_for_bit(arch, options, config):
    routes = [{"scale": 0.5, "sigma_min": 0.0, "sigma_max": 0.001}] if config == "never-hit" else [{"route": "2048:1024", "sigma_min": 0.0}]
    setup = Setup(arch, {"routes": routes}, *options)
    for step in range(3):
        results = []
        for trainer in (setup.trainer, setup.plain):
            _rng_seed(20 + step)
            loss = setup.step(batch_for(arch, 2, step), trainer=trainer)
            results.append((loss.detach(), setup.model_input()[1], torch.get_rng_state(), random.getstate(), np.random.get_state()))
        assert rng_same(results[0], results[1]), f"step {step}"
    assert setup.network.downscale_run.accounting.demote_fraction() == 0.0


@pytest.mark.parametrize(("arch", "options"), [RNG_CASES[i] for i in RNG_MIXED], ids=[RNG_IDS[i] for i in RNG_MIXED])
@pytest.mark.parametrize("batch", [1, 2])
def test_rng_real_trainer_steps_left_to_the_host_are_the_hosts_bit_for_bit(arch, options, batch):
    low, high = RNG_THIRD[arch]
    setup = Setup(arch, {"routes": [{"scale": 0.5, "sigma_min": low, "sigma_max": high}]}, *options)
    _rng_seed(30)
    with NativeStepCheck() as check:
        for step in range(12):
            setup.step(batch_for(arch, batch, step))
    assert check.failures == []
    assert check.native > 0 and check.replayed > 0


@pytest.mark.parametrize("arch", ["sd1", "sdxl", "flux", "sd3", "lumina"])
def test_rng_real_trainer_steps_never_reseed_a_global_generator(arch):
    low, high = RNG_THIRD[arch]
    with RngTrap() as trap:
        noise = RNG_ALL_NOISE if arch in ("sd1", "sdxl") else RNG_IP
        setup = Setup(arch, {"routes": [{"scale": 0.5, "sigma_min": low, "sigma_max": high}]}, *noise)
        for step in range(8):
            setup.step(batch_for(arch, 2, step))
    assert trap.violations == [], trap.report()
    assert trap.restores >= 3 * 8  # CPU, Python and NumPy of every step's fork, each checked


@pytest.mark.parametrize(("arch", "mode"), [("flux", "train"), ("flux", "map-stop"), ("sd3", "train")])
def test_rng_real_training_script_never_reseeds_a_global_generator(arch, mode, tmp_path):
    """The real script's whole run (banner with the plan's Monte Carlo, every step, the in-run map) under the trap."""
    runner = (
        "import sys; from pathlib import Path; from rng_trap import RngTrap; import sd_scripts_e2e\n"
        "with RngTrap() as trap:\n"
        "    sd_scripts_e2e.main(sys.argv[1], Path(sys.argv[2]), sys.argv[3])\n"
        "print('TRAP', trap.restores, trap.seeded, len(trap.violations)); print(trap.report())\n"
        "sys.exit(1 if trap.violations or not trap.restores or not trap.seeded else 0)\n"
    )
    # the harness and the trap importable; `-c` puts the checkout (cwd) on sys.path
    pythonpath = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", runner, arch, str(tmp_path), mode], cwd=SD_SCRIPTS_DIR, env=env, capture_output=True, text=True
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "E2E OK" in log and "TRAP" in log and "no violations" in log, log[-4000:]


# -- resume: the absolute forward index on every resume path of the real loop; counts across states ---------------

RESUME_TOML = """
[plugins.downscale]
gate = "coupled"

[[plugins.downscale.routes]]
route = "128:64"
sigma_min = 0.0                  # every σ: at batch size 1 a forward routes exactly when its spread coin says so
span = "spread:0.5"
"""
# accumulation → (images = batches per epoch, max_train_steps, --save_every_n_steps); the run is A 2.
RESUME_RUNS = {2: (16, 12, 3), 1: (8, 16, 5)}
# (id, accumulation, argv, absolute index of forward 0, this run's forwards, forwards restored from the state)
REAL_RESUME_PATHS = [
    # the issue: state at step 3 (forward 6); S = 6, epoch_to_start 6 // 8 = 0, 6 batches skipped, global_step 6 (the
    # host counts forwards there, so it stops at forward 18 of the uninterrupted order): 12 forwards, absolute 7..18
    ("resume+skip, A 2", 2, ("--resume", "step3", "--skip_until_initial_step"), 6, 12, 6),
    ("resume, A 2", 2, ("--resume", "step3"), 6, 24, 6),  # epoch_to_start 0 from its first batch, global_step 0
    ("resume+skip, A 1", 1, ("--resume", "step10", "--skip_until_initial_step"), 10, 6, 10),  # epoch 2, 2 batches skipped
    ("resume, A 1", 1, ("--resume", "step10"), 10, 8, 10),  # epoch 2 from its first batch, global_step 0
    ("initial_step+skip, A 2", 2, ("--initial_step", "3", "--skip_until_initial_step"), 6, 12, 0),
    ("initial_epoch+skip, A 1", 1, ("--initial_epoch", "2", "--skip_until_initial_step"), 8, 8, 0),  # s = 1 × ⌈8 / 1 / 1⌉
    ("initial_step, A 1", 1, ("--initial_step", "5"), 5, 16, 0),  # without the skip: epoch 1, global_step 0
]


def recorded_run(work: Path, accumulation: int, *argv: str) -> tuple[dict, str]:
    """The real Flux script through ``tests/sd_scripts_e2e.py record``: (``record.json``, the log, whitespace collapsed)."""
    images, steps, _ = RESUME_RUNS[accumulation]
    env = {
        **os.environ,
        "COLUMNS": "1000",
        "E2E_ROUTES": RESUME_TOML,
        "E2E_IMAGES": str(images),
        "E2E_REPEATS": "1",
        "E2E_STEPS": str(steps),
    }
    argv = ("--gradient_accumulation_steps", str(accumulation), *argv)
    proc = subprocess.run(
        [sys.executable, str(HERE / "sd_scripts_e2e.py"), "flux", str(work), "record", *argv],
        cwd=SD_SCRIPTS_DIR,
        env=env,
        capture_output=True,
        text=True,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "E2E OK" in log, log[-4000:]
    return json.loads((work / "record.json").read_text()), " ".join(log.split())


@pytest.fixture(scope="module")
def uninterrupted_real(tmp_path_factory):
    """Per accumulation: the uninterrupted run's route per forward and its output dir (a state every few steps)."""
    runs = {}
    for accumulation, (_, steps, every) in RESUME_RUNS.items():
        work = tmp_path_factory.mktemp(f"uninterrupted{accumulation}")
        record, _ = recorded_run(work, accumulation, "--save_state", "--save_every_n_steps", str(every))
        assert len(record["steps"]) == steps * accumulation
        assert record["hooks"] and all(".NetworkTrainer.train.<locals>." in hook for hook in record["hooks"])
        runs[accumulation] = ([s["rule"] for s in record["steps"]], work / "out")
    return runs


@pytest.mark.parametrize(
    ("accumulation", "argv", "offset", "forwards", "restored"), [p[1:] for p in REAL_RESUME_PATHS], ids=[p[0] for p in REAL_RESUME_PATHS]
)
def test_real_resume_routes_by_the_absolute_forward_index(uninterrupted_real, tmp_path, accumulation, argv, offset, forwards, restored):
    """Each resume path of the real loop: forward n of the resumed run routes exactly as the uninterrupted run's
    forward offset + n (its spread coin), ``ss_downscale_counts`` covers the whole run (the state's counts and
    this run's), and the run's state hooks are off the accelerator at the end (only the host's own remain)."""
    reference, states = uninterrupted_real[accumulation]
    argv = tuple(str(states / f"lora-step{int(a[4:]):08d}-state") if a.startswith("step") else a for a in argv)
    record, log = recorded_run(tmp_path, accumulation, *argv)
    routes = [s["rule"] for s in record["steps"]]
    assert len(routes) == forwards and record["offset"] == [offset]
    overlap = min(forwards, len(reference) - offset)
    assert overlap >= 6 and routes[:overlap] == reference[offset : offset + overlap]
    assert f"absolute forward index = {offset // accumulation} × {accumulation} + n = {offset} + n" in log
    counts = json.loads(record["metadata"]["ss_downscale_counts"])
    history = reference[:restored] + routes
    assert counts["forwards"] == restored + forwards
    assert counts["routes"]["r0 128:64"] == pytest.approx(sum(rule == 0 for rule in history) / len(history))
    assert record["hooks"] and all(".NetworkTrainer.train.<locals>." in hook for hook in record["hooks"])
    if restored:
        assert f"restored the counts of {restored} earlier train forwards" in log and "resume (--resume" in log
