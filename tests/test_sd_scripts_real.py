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
import math
import os
import shutil
import subprocess
import sys
from multiprocessing import Value
from pathlib import Path
from unittest.mock import MagicMock

import pytest
import torch
from host_modules import host_modules

import downscale_plugin
from downscale_plugin.fasterdit.policies import shift_sigma
from downscale_plugin.hosts.kohya import plugin_config
from downscale_plugin.hosts.sd_scripts import start as sd_scripts_start
from downscale_plugin.hosts.sd_scripts.facts import BY_ARCH
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
    assert accounting.sigma_run == pytest.approx(float(routed_sigma), abs=1e-6)
    assert accounting.sigma_drawn == pytest.approx(float(setup.sigma()), abs=1e-6)


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


def end_to_end(arch: str, work: Path, mode: str = "train") -> str:
    """Run ``tests/sd_scripts_e2e.py`` (the real script's ``__main__`` path); its log, whitespace collapsed
    (the host logs through rich, which pads lines)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SD_SCRIPTS_DIR, str(HERE.parent)]), "COLUMNS": "1000"}  # unwrapped log lines
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
    log = end_to_end(arch, tmp_path, f"map-{after_map}")
    assert "gradient map before train batch 2" in log and (tmp_path / "map" / "windows.toml").is_file()
    rows = list(csv.DictReader((tmp_path / "map" / "map.csv").open()))
    assert sorted({r["arm"] for r in rows}) == ["latent_0.5", "pixel_0.5", "reenc"] and all(math.isfinite(float(r["excess"])) for r in rows)
    done = "ending the run before training batch 2 (no weights saved)" if after_map == "stop" else "training continues from batch 2"
    assert done in log
