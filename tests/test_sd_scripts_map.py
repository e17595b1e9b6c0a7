"""``mode = "map"`` inside the sd-scripts trainers, on the host doubles (CI; no sd-scripts).

The map runs before the batch that completes its probes, every draw through the trainer's own
``process_batch`` at the arm's grid and the map's σ; it writes the lab map's files; ``stop`` ends
the run (exit 0, nothing saved), ``train`` continues with the derived windows as routes. A map that
finds no window leaves the run bitwise the host's (RNG, accumulated gradients, optimizer untouched).
"""

from __future__ import annotations

import json
import os
import random

import pytest
import toml
import torch
from host_modules import ARCHS, host_modules, run_double, trainer_class
from safetensors import safe_open
from test_hosts_doubles import model_sigma, small_input

from downscale_plugin.config import load_config
from downscale_plugin.grid import area_downsample
from downscale_plugin.hosts import sd_scripts_run
from downscale_plugin.hosts.sd_scripts import HostError
from downscale_plugin.mapping.arms import REENC, pixel_arm
from downscale_plugin.mapping.bins import parse_bins
from downscale_plugin.mapping.sd_scripts_backend import HostVae, SdScriptsBackend

RES = "128,128"  # latent 16x16 (4x4 for HunyuanImage): ratio 0.5 has a smaller grid on every architecture
QUICK = {"map_ratios": [0.5], "map_bins": "0,0.5,1", "map_draws": 2, "map_images": 2}  # 2 images × 3 bins × 3 arms × 2 draws


@pytest.fixture(scope="module", autouse=True)
def doubles():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with host_modules():
        yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def quick_plan(monkeypatch):
    monkeypatch.setattr(sd_scripts_run, "PLAN_MC_SAMPLES", 256)


@pytest.fixture
def runs(monkeypatch):
    """Every plugin run ``prepare_network`` starts (a stopped run never reaches ``trainer.last_run``)."""
    seen = []
    start = sd_scripts_run.start

    def spy(*args, **kwargs):
        seen.append(start(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(sd_scripts_run, "start", spy)
    return seen


@pytest.fixture
def steps(monkeypatch):
    """Per host ``get_noise_pred_and_target`` call: the latents' shape and the denoiser it ran."""
    seen = []

    def install(arch):
        cls = trainer_class(arch)
        original = cls.get_noise_pred_and_target

        def spy(self, args, accelerator, noise_scheduler, latents, batch, text_conds, unet, *rest, is_train=True):
            seen.append((tuple(latents.shape), unet))
            return original(self, args, accelerator, noise_scheduler, latents, batch, text_conds, unet, *rest, is_train=is_train)

        monkeypatch.setattr(cls, "get_noise_pred_and_target", spy)
        return seen

    return install


def map_config(tmp_path, **extra) -> dict:
    return {"mode": "map", "map_out": str(tmp_path / "map"), **QUICK, **extra}


class TinyAE(torch.nn.Module):
    """A stand-in for sd-scripts' ``flux_models.AutoEncoder`` (``encode``/``decode``, ``device``/``dtype``):
    an orthonormal linear codec, pixels = pixel_shuffle(Pᵀz / 2) (inside [-1, 1] for the double's latents),
    so encode(decode(z)) = z up to the small posterior draw its ``encode`` samples from torch's RNG, as the
    real one does (``DiagonalGaussian``)."""

    def __init__(self, channels: int, factor: int, noise: float = 1e-4):
        super().__init__()
        rows, _ = torch.linalg.qr(torch.randn(3 * factor * factor, channels, generator=torch.Generator().manual_seed(0)))
        self.proj = torch.nn.Parameter(rows.T.contiguous(), requires_grad=False)  # channels × 3f², orthonormal rows
        self.factor, self.noise = factor, noise

    @property
    def device(self) -> torch.device:
        return self.proj.device

    @property
    def dtype(self) -> torch.dtype:
        return self.proj.dtype

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        z = 2 * torch.einsum("ck,bkhw->bchw", self.proj, torch.nn.functional.pixel_unshuffle(x, self.factor))
        return z + self.noise * torch.randn_like(z)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pixel_shuffle(torch.einsum("ck,bchw->bkhw", self.proj, z / 2), self.factor)


@pytest.fixture
def with_vae(monkeypatch):
    """The Flux double's ``load_target_model`` returns a :class:`TinyAE` as its VAE (the double has none)."""
    cls = trainer_class("flux")
    load = cls.load_target_model

    def load_with_ae(self, args, weight_dtype, accelerator):
        version, text_encoders, _, unet = load(self, args, weight_dtype, accelerator)
        self.ae = TinyAE(self.latent_channels, self.vae_factor)
        return version, text_encoders, self.ae, unet

    monkeypatch.setattr(cls, "load_target_model", load_with_ae)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_map_runs_every_draw_through_the_host_step_at_the_arm_grid_and_sigma_then_stops(arch, tmp_path, runs, steps):
    calls = steps(arch)
    argv = ("--resolution", RES, "--train_batch_size", "1", "--max_train_steps", "4", "--seed", "3", "--output_dir", str(tmp_path / "out"))
    with pytest.raises(SystemExit) as stop:
        run_double(arch, *argv, downscale=map_config(tmp_path))
    assert stop.value.code == 0
    run = runs[0]
    assert run.accounting.total_steps == 1 and run.accelerator.ended  # one native step collected probe 1; the end ran
    assert not (tmp_path / "out").exists()  # stopped before training: nothing saved
    native, small = calls[0][0], (1, 4, 2, 2) if arch == "hunyuan_image" else (1, 4, 8, 8)
    bins, passes = parse_bins(QUICK["map_bins"]), 2 * 3 * 2  # images × bins × draws, per arm
    assert [shape for shape, _ in calls[1:]].count(native) == 2 * passes and [s for s, _ in calls[1:]].count(small) == passes
    unet = calls[0][1]
    assert [c["shape"] for c in unet.calls[1:]].count(small_input(arch, 1)) == passes
    sigmas = torch.cat([model_sigma(arch, c["t"]) for c in unet.calls[1:]])
    if arch in ("sd1", "sdxl"):  # DDPM: the top timestep (σ 0.936) stands for every σ above it
        assert (torch.cat([c["t"] for c in unet.calls[1:]]) == 999).sum() >= 3 * 2 * 2
    else:  # the σ = 1 endpoint bin (3 arms × 2 images × 2 draws) reached the model exactly: replayed, not drawn
        assert ((sigmas - 1.0).abs() < 1e-6).sum() == 3 * 2 * 2
    exact = 2e-3 if arch in ("sd1", "sdxl", "hunyuan_image") else 1e-6  # hosts with integer timesteps quantize σ
    assert all(any(lo - exact <= s <= hi + exact for lo, hi in map(bins.bounds, range(len(bins)))) for s in sigmas.tolist())
    written = sorted(os.listdir(tmp_path / "map"))
    assert written == ["map.csv", "map.json", "map.png", "windows.toml"]
    derived = load_config(plugin_toml=toml.load(tmp_path / "map" / "windows.toml"))  # the router reads it as is
    assert derived.arch == arch and all(r.ratio == 0.5 for r in derived.routes)
    provenance = json.loads((tmp_path / "map" / "map.json").read_text())["provenance"]
    assert provenance["backend"]["native_latent_hw"] == list(native[-2:]) and "before train batch 2" in provenance["command"]


@pytest.mark.parametrize("arch", ["flux", "anima"])
def test_a_map_without_windows_leaves_training_bitwise_the_hosts(arch, tmp_path, monkeypatch):
    """Margin ~0: no window, so after_map = "train" trains native. With gradient accumulation the map
    runs between the two micro-batches of an update, so accumulated .grad, RNG and optimizer must survive;
    Anima's caption dropout (at rate 0.5 here) draws from Python's RNG in every step, the map's too."""
    if arch == "anima":
        cls = trainer_class("anima")
        conds = cls.text_conds
        monkeypatch.setattr(cls, "text_conds", lambda self, bsz, gen: [*conds(self, bsz, gen)[:-1], torch.full((bsz,), 0.5)])
    argv = ("--resolution", RES, "--train_batch_size", "2", "--max_train_steps", "3", "--gradient_accumulation_steps", "2", "--seed", "4")
    random.seed(0)
    plain = run_double(arch, *argv, network_module=ARCHS[arch][2]).last_run
    config = map_config(tmp_path, after_map="train", map_margin=1e-9, map_images=4)  # probes complete at batch 2
    random.seed(0)
    run = run_double(arch, *argv, downscale=config).last_run
    assert run.losses == plain.losses and len(run.losses) == 6
    theirs = plain.network.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in run.network.state_dict().items())
    state = run.network.downscale_run
    assert state.cfg.routes == () and state.accounting.total_steps == 6  # the native steps before the map are counted


def test_map_then_train_routes_with_the_derived_windows_and_says_so_in_the_metadata(tmp_path, steps):
    calls = steps("flux")
    argv = ("--resolution", RES, "--train_batch_size", "2", "--max_train_steps", "8", "--seed", "3", "--output_dir", str(tmp_path / "out"))
    config = map_config(tmp_path, after_map="train", map_margin=0.99, map_draws=4, map_images=4)
    run = run_double("flux", *argv, downscale=config).last_run
    state = run.network.downscale_run
    derived = load_config(plugin_toml=toml.load(tmp_path / "map" / "windows.toml"))
    assert derived.routes and state.cfg.routes == derived.routes
    train_shapes = [shape for shape, _ in calls if shape[0] == 2]  # the map's draws run one probe at a time
    assert len(train_shapes) == 8 and train_shapes[0] == (2, 4, 16, 16) and (2, 4, 8, 8) in train_shapes[1:]
    assert state.accounting.total_steps == 8 and state.accounting.routed_samples > 0
    with safe_open(str(tmp_path / "out" / "last.safetensors"), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["ss_downscale_routes"]) == toml.load(tmp_path / "map" / "windows.toml")["routes"]
    recorded = json.loads(meta["ss_downscale_map"])
    assert recorded["before_train_batch"] == 2 and recorded["probes"] == 4 and recorded["windows"]


@pytest.mark.parametrize(
    ("config", "argv", "message"),
    [
        ({"map_ratios": [0.95]}, (), "map_ratios: 0.95 give no strictly smaller flux grid"),
        ({"map_images": 8}, ("--max_train_steps", "3"), "map_images: 8 probes need 8 train batches of 1"),
    ],
)
def test_a_map_the_run_cannot_do_fails_at_prepare_network(tmp_path, steps, config, argv, message):
    calls = steps("flux")
    with pytest.raises(HostError, match=message):
        run_double("flux", "--resolution", RES, *argv, downscale=map_config(tmp_path, **config))
    assert calls == [] and not (tmp_path / "map").exists()


def test_a_missing_map_package_is_named_at_prepare_network(tmp_path, monkeypatch):
    from downscale_plugin.hosts import sd_scripts_map

    monkeypatch.setattr(sd_scripts_map, "MAP_PACKAGES", ("scipy", "no_such_package_for_the_map"))
    with pytest.raises(HostError, match=r'no_such_package_for_the_map not installed.*pip install "downscale-plugin\[map\]"'):
        run_double("flux", "--resolution", RES, downscale=map_config(tmp_path))


def test_a_run_that_ends_before_its_map_says_so(tmp_path, caplog):
    """--max_train_epochs shortens the run after prepare_network (4 batches here), below the 8 probes."""
    argv = ("--resolution", RES, "--max_train_steps", "100", "--max_train_epochs", "1", "--dataset_size", "4")
    run = run_double("flux", *argv, downscale=map_config(tmp_path, map_images=8)).last_run
    assert len(run.losses) == 4 and not (tmp_path / "map").exists()
    assert "the run ended after 4 of the 8 probe samples the map needs; no map was made" in caplog.text


def test_vae_arms_run_through_the_host_step_on_the_decoded_and_reencoded_latents(tmp_path, monkeypatch, with_vae):
    """map_reenc / map_pixel on Flux: reenc = encode(decode(z)) at the native grid (≈ z with a near-identity
    codec), pixel_0.5 = encode(area-downsample(decode(z)) to 8x8 latents × 8 px); both run as given."""
    cls, seen = trainer_class("flux"), []
    original = cls.get_noise_pred_and_target

    def spy(self, args, accelerator, noise_scheduler, latents, *rest, **kwargs):
        seen.append(latents.detach().clone())
        return original(self, args, accelerator, noise_scheduler, latents, *rest, **kwargs)

    monkeypatch.setattr(cls, "get_noise_pred_and_target", spy)
    argv = ("--resolution", RES, "--train_batch_size", "1", "--max_train_steps", "4", "--seed", "3")
    trainer = cls()
    with pytest.raises(SystemExit):
        run_double("flux", *argv, downscale=map_config(tmp_path, map_reenc=True, map_pixel=True), trainer=trainer)
    z, ae = seen[0], trainer.ae
    cell = seen[1:11]  # image 0, bin 0: native_a, native_b, latent_0.5, pixel_0.5, reenc; 2 draws each
    assert all(torch.equal(x, z) for x in cell[:4]) and [tuple(x.shape) for x in cell[4:8]] == [(1, 4, 8, 8)] * 4
    pixel = ae.encode(area_downsample(ae.decode(z).clamp(-1, 1), (64, 64)))
    assert torch.allclose(cell[6], pixel, atol=1e-3) and torch.equal(cell[6], cell[7])  # one input per image, reused
    assert not torch.allclose(cell[6], area_downsample(z, (8, 8)), atol=1e-2)  # pixels averaged, not latents
    assert torch.allclose(cell[8], z, atol=1e-3) and not torch.equal(cell[8], z)  # the round trip ran: z up to the posterior draw
    rows = (tmp_path / "map" / "map.csv").read_text()
    assert "pixel_0.5" in rows and "reenc" in rows


def test_vae_arms_on_an_architecture_without_a_driven_vae_fail_at_prepare_network(tmp_path, steps):
    calls = steps("sd3")
    with pytest.raises(HostError, match=r"map_pixel: the VAE arms are not supported for sd3 \(supported: flux, chroma, lumina\)"):
        run_double("sd3", "--resolution", RES, downscale=map_config(tmp_path, map_pixel=True))
    assert calls == [] and not (tmp_path / "map").exists()


def test_vae_arms_without_a_vae_at_map_time_are_named(tmp_path):
    with pytest.raises(HostError, match="map_reenc / map_pixel: the trainer passed no VAE to process_batch"):
        run_double("flux", "--resolution", RES, "--max_train_steps", "4", downscale=map_config(tmp_path, map_reenc=True))


def test_vae_arms_of_a_probe_of_images_start_from_its_encoded_latent():
    """Without cached latents a probe holds images (in [-1, 1]): z is their (seeded) encode, the arms build on it."""
    ae, images = TinyAE(4, 8), torch.rand(1, 3, 128, 128, generator=torch.Generator().manual_seed(1)) - 0.5
    probe = {"images": images, "loss_weights": torch.ones(1)}
    backend = SdScriptsBackend([probe], lambda p: None, None, [], "flux", [], {}, HostVae(ae, "cpu", []), seed=5)
    z = ae.encode(images)
    (grid, reenc), (_, pixel) = backend.arm_input(0, REENC), backend.arm_input(0, pixel_arm(0.5))
    assert grid is None and torch.allclose(reenc, z, atol=1e-3)
    assert torch.allclose(pixel, ae.encode(area_downsample(ae.decode(z), (64, 64))), atol=1e-3)
    assert torch.equal(backend.arm_input(0, REENC)[1], reenc)  # seeded: the same arm input every time
    assert "TinyAE" in backend.describe()["vae"]
