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
from dataclasses import replace
from types import SimpleNamespace

import pytest
import toml
import torch
from host_modules import ARCHS, run_double, trainer_class
from safetensors import safe_open
from test_hosts_doubles import model_sigma, small_input

from downscale_plugin.bins import parse_bins
from downscale_plugin.config import load_config
from downscale_plugin.grid import area_downsample
from downscale_plugin.hosts.kohya.backend import ProbeBackend
from downscale_plugin.hosts.sd_scripts import start as sd_scripts_start
from downscale_plugin.hosts.sd_scripts.facts import BY_ARCH, HostError
from downscale_plugin.hosts.sd_scripts.map_backend import VAE_CALLS, HostVae, VaeCalls
from downscale_plugin.mapping.arms import REENC, pixel_arm

RES = "128,128"  # latent 16x16 (4x4 for HunyuanImage): ratio 0.5 has a smaller grid on every architecture
QUICK = {"map_ratios": [0.5], "map_bins": "0,0.5,1", "map_draws": 2, "map_images": 2}  # 2 images × 3 bins × 3 arms × 2 draws


pytestmark = pytest.mark.usefixtures("host_doubles", "cheap_plan")


@pytest.fixture
def runs(monkeypatch):
    """Every plugin run ``prepare_network`` starts (a stopped run never reaches ``trainer.last_run``)."""
    seen = []
    start = sd_scripts_start.start

    def spy(*args, **kwargs):
        seen.append(start(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(sd_scripts_start, "start", spy)
    return seen


@pytest.fixture
def steps(monkeypatch):
    """Per host ``get_noise_pred_and_target`` call: the latents' shape and the denoiser it ran."""
    seen = []

    def install(arch):
        cls = trainer_class(arch)
        original = cls.get_noise_pred_and_target

        def spy(self, args, accelerator, noise_scheduler, latents, batch, text_conds, unet, *rest, is_train=True):
            if unet is not None:  # not the start's drift self-check, which stops at the σ draw (hosts/sd_scripts/selfcheck.py)
                seen.append((tuple(latents.shape), unet))
            return original(self, args, accelerator, noise_scheduler, latents, batch, text_conds, unet, *rest, is_train=is_train)

        monkeypatch.setattr(cls, "get_noise_pred_and_target", spy)
        return seen

    return install


def map_config(tmp_path, **extra) -> dict:
    return {"mode": "map", "map_out": str(tmp_path / "map"), **QUICK, **extra}


class TinyAE(torch.nn.Module):
    """A stand-in for sd-scripts' ``flux_models.AutoEncoder`` (``encode``/``decode``, ``device``/``dtype``):
    an orthonormal linear codec whose latent is (2·P·pixel_unshuffle(x) + noise) / ``scale`` + ``shift``, so
    encode(decode(z)) = z up to the small posterior draw it samples from torch's RNG, as the real one does
    (``DiagonalGaussian``). Subclasses give the latent another host's scale and shift and call convention.
    ``cache`` / ``image`` are the host's own calls: its latent cache's encode, its sample code's decode of
    that (unscaled) latent; the tests state them apart from the plugin's ``VAE_CALLS``."""

    scale, shift = 1.0, 0.0

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

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        z = 2 * torch.einsum("ck,bkhw->bchw", self.proj, torch.nn.functional.pixel_unshuffle(x, self.factor))
        return (z + self.noise * torch.randn_like(z)) / self.scale + self.shift

    def _decode(self, z: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pixel_shuffle(torch.einsum("ck,bchw->bkhw", self.proj, (z - self.shift) * self.scale / 2), self.factor)

    encode, decode = _encode, _decode
    cache, image = _encode, _decode  # the latent caches' vae.encode(img); the sample codes' vae.decode of the raw latent


class TinySDVAE(TinyAE):
    """sd-scripts' ``sd3_models.SDVAE``: ``encode``/``decode`` on raw latents; the trainer's ``shift_scale_latents``
    is ``process_in`` (the real factors); the sample code decodes ``process_out`` of the model's latent, the raw one."""

    scale, shift = 1.5305, 0.0609

    @staticmethod
    def process_in(latent: torch.Tensor) -> torch.Tensor:
        return (latent - TinySDVAE.shift) * TinySDVAE.scale

    @staticmethod
    def process_out(latent: torch.Tensor) -> torch.Tensor:
        return latent / TinySDVAE.scale + TinySDVAE.shift


class TinyKL(TinyAE):
    """diffusers' ``AutoencoderKL`` (SD1/SDXL): ``encode(x).latent_dist.sample()``, ``decode(z).sample``, unscaled
    latents (the trainer multiplies by ``config.scaling_factor``: ``vae_scale_factor``)."""

    def __init__(self, channels: int, factor: int, scaling_factor: float, noise: float = 1e-4):
        super().__init__(channels, factor, noise)
        self.scale, self.config = scaling_factor, SimpleNamespace(scaling_factor=scaling_factor)

    def encode(self, x: torch.Tensor, return_dict: bool = True) -> SimpleNamespace:
        return SimpleNamespace(latent_dist=SimpleNamespace(sample=lambda generator=None: self._encode(x)))

    def decode(self, z: torch.Tensor, return_dict: bool = True, generator=None) -> SimpleNamespace:
        return SimpleNamespace(sample=self._decode(z))

    def cache(self, x: torch.Tensor) -> torch.Tensor:  # SdSdxlLatentsCachingStrategy
        return self.encode(x).latent_dist.sample()

    def image(self, z: torch.Tensor) -> torch.Tensor:  # the SD/SDXL pipelines' vae.decode(latents / scaling_factor).sample
        return self.decode(z).sample


CODECS = {
    "flux": lambda c, f: TinyAE(c, f),
    "sd3": lambda c, f: TinySDVAE(c, f),
    "sdxl": lambda c, f: TinyKL(c, f, 0.13025),
    "sd1": lambda c, f: TinyKL(c, f, 0.18215),
}


@pytest.fixture
def with_vae(monkeypatch):
    """``with_vae(arch)``: that double's ``load_target_model`` returns the arch's codec double as its VAE (the doubles have none)."""

    def install(arch: str) -> None:
        cls = trainer_class(arch)
        load = cls.load_target_model

        def load_with_ae(self, args, weight_dtype, accelerator):
            version, text_encoders, _, unet = load(self, args, weight_dtype, accelerator)
            self.ae = CODECS[arch](self.latent_channels, self.vae_factor)
            return version, text_encoders, self.ae, unet

        monkeypatch.setattr(cls, "load_target_model", load_with_ae)

    return install


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
    argv = ("--resolution", RES, "--train_batch_size", "2", "--max_train_steps", "8", "--seed", "3", "--output_dir", str(tmp_path / "out"),
            "--dataset_size", "8")  # fmt: skip
    config = map_config(tmp_path, after_map="train", map_margin=0.99, map_draws=4, map_images=8)  # 4 probes certify nothing
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
    assert recorded["before_train_batch"] == 4 and recorded["probes"] == 8 and recorded["windows"]


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
    from downscale_plugin import config

    monkeypatch.setitem(config.MODE_PACKAGES, "map", ("scipy", "no_such_package_for_the_map"))
    with pytest.raises(HostError, match=r'needs no_such_package_for_the_map, not installed: pip install "downscale-plugin\[map\]"'):
        run_double("flux", "--resolution", RES, downscale=map_config(tmp_path))


def test_a_run_that_ends_before_its_map_says_so(tmp_path, caplog, monkeypatch):
    """--max_train_epochs shortens the run after prepare_network (4 batches here), below the 8 probes. The dataset's
    4 distinct images are refused at start; a dataset that does not say how many it has runs and says so at its end."""
    argv = ("--resolution", RES, "--max_train_steps", "100", "--max_train_epochs", "1", "--dataset_size", "4")
    with pytest.raises(HostError, match="map_images: the dataset has 4 distinct images; 8 probes must be 8 distinct images"):
        run_double("flux", *argv, downscale=map_config(tmp_path, map_images=8))
    counted = sd_scripts_start.dataset_buckets
    monkeypatch.setattr(sd_scripts_start, "dataset_buckets", lambda group, factor: replace(counted(group, factor), images=None))
    run = run_double("flux", *argv, downscale=map_config(tmp_path, map_images=8)).last_run
    assert len(run.losses) == 4 and not (tmp_path / "map").exists()
    assert 'mode = "map": the run ended after 4 of the 8 probe samples it needs; nothing was measured' in caplog.text


@pytest.mark.parametrize("arch", ["flux", "sd3", "sdxl"])
def test_vae_arms_run_through_the_host_step_on_the_decoded_and_reencoded_latents(arch, tmp_path, monkeypatch, with_vae):
    """map_reenc / map_pixel: reenc = encode(decode(z)) at the native grid (≈ z with a near-identity codec),
    pixel_0.5 = encode(area-downsample(decode(z)) to 8x8 latents × 8 px); both replace the cached (raw) latent,
    so the trainer's own shift_scale_latents follows, and run as given. Compared where the trainer uses them."""
    cls, seen = trainer_class(arch), []
    original = cls.shift_scale_latents

    def spy(self, args, latents):
        seen.append((latents.detach().clone(), original(self, args, latents)))
        return seen[-1][1]

    monkeypatch.setattr(cls, "shift_scale_latents", spy)
    with_vae(arch)
    argv = ("--resolution", RES, "--train_batch_size", "1", "--max_train_steps", "4", "--seed", "3")
    trainer = cls()
    with pytest.raises(SystemExit):
        run_double(arch, *argv, downscale=map_config(tmp_path, map_reenc=True, map_pixel=True), trainer=trainer)
    (raw, z), ae = seen[0], trainer.ae
    cell = [used for _, used in seen[1:11]]  # image 0, bin 0: native_a, native_b, latent_0.5, pixel_0.5, reenc; 2 draws each
    assert all(torch.equal(x, z) for x in cell[:6]) and [tuple(x.shape) for x in cell[6:8]] == [(1, 4, 8, 8)] * 2  # latent_0.5: the hook's
    pixel = trainer.shift_scale_latents(None, ae.cache(area_downsample(ae.image(raw).clamp(-1, 1), (64, 64))))
    assert torch.allclose(cell[6], pixel, atol=1e-3) and torch.equal(cell[6], cell[7])  # one input per image, reused
    assert not torch.allclose(cell[6], area_downsample(z, (8, 8)), atol=1e-2)  # pixels averaged, not latents
    assert torch.allclose(cell[8], z, atol=1e-3) and not torch.equal(cell[8], z)  # the round trip ran: z up to the posterior draw
    rows = (tmp_path / "map" / "map.csv").read_text()
    assert "pixel_0.5" in rows and "reenc" in rows


def vae_errors(arch: str) -> tuple[float, float]:
    """On the arch's codec double, for a latent its host caches (``cache``): the largest pixel error of
    HostVae's decode of it, and of its reenc arm's latent where the trainer uses it (after shift_scale_latents)."""
    ae, shift_scale = CODECS[arch](4, 8), trainer_class(arch)().shift_scale_latents
    x = ae.image(ae.cache(torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(1)) * 1.8 - 0.9))  # pixels the codec holds
    cached = ae.cache(x)
    assert x.abs().max() < 1  # inside HostVae's clamp
    vae = HostVae(ae, BY_ARCH[arch].vae_calls, "cpu", [])
    backend = ProbeBackend([{"latents": cached, "loss_weights": torch.ones(1)}], lambda p: None, None, [], arch, [], {}, vae, seed=5)
    reenc = backend.arm_input(0, REENC)[1]
    return float((vae.decode(cached) - x).abs().max()), float((shift_scale(None, reenc) - shift_scale(None, cached)).abs().max())


@pytest.mark.parametrize("arch", list(CODECS))
def test_the_vae_is_called_as_the_hosts_latent_cache_calls_it(arch):
    """Flux/SD3 ``vae.encode(x)`` / ``vae.decode(z)`` (SD3's raw latent: process_in comes in the trainer),
    SD1/SDXL ``encode(x).latent_dist.sample()`` / ``decode(z).sample`` (unscaled: × vae_scale_factor in the trainer):
    the cached latent decodes to its pixels, and reenc of it is the same latent up to the VAE's error."""
    pixel_error, latent_error = vae_errors(arch)
    assert pixel_error < 1e-3 and latent_error < 1e-3


@pytest.mark.parametrize(
    ("arch", "wrong"),
    [  # the sample code's model-space latents (scaled / process_in'd) taken for the cached ones; a scale applied twice
        ("sdxl", VaeCalls(lambda v, x: v.encode(x).latent_dist.sample() * 0.13025, lambda v, z: v.decode(z / 0.13025).sample, "")),
        ("sd1", VaeCalls(lambda v, x: v.encode(x).latent_dist.sample(), lambda v, z: v.decode(z / 0.18215).sample, "")),
        ("sd3", VaeCalls(lambda v, x: v.process_in(v.encode(x)), lambda v, z: v.decode(v.process_out(z)), "")),
    ],
)
def test_a_wrong_latent_scale_or_shift_is_caught(arch, wrong, monkeypatch):
    monkeypatch.setitem(VAE_CALLS, BY_ARCH[arch].vae_calls, wrong)
    assert vae_errors(arch)[0] > 1e-2


def test_the_sd1_sdxl_calls_drive_diffusers_own_autoencoderkl():
    """The class sd-scripts loads for SD1/SDXL (tiny, random): HostVae's encode is its cache's seeded
    ``encode(x).latent_dist.sample()``, bit for bit, and its decode ``decode(z).sample`` (clamped)."""
    diffusers = pytest.importorskip("diffusers")
    blocks = {"down_block_types": ("DownEncoderBlock2D",) * 4, "up_block_types": ("UpDecoderBlock2D",) * 4}
    vae = diffusers.AutoencoderKL(**blocks, block_out_channels=(8,) * 4, layers_per_block=1, norm_num_groups=8, latent_channels=4).eval()
    x = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    host = HostVae(vae, BY_ARCH["sdxl"].vae_calls, "cpu", [])
    z = host.encode(x, 7)
    torch.manual_seed(7)
    with torch.no_grad():
        assert z.shape == (1, 4, 4, 4) and torch.equal(z, vae.encode(x).latent_dist.sample())
        assert torch.equal(host.decode(z), vae.decode(z).sample.clamp(-1, 1))


def test_vae_arms_on_an_architecture_without_a_driven_vae_fail_at_prepare_network(tmp_path, steps):
    calls = steps("anima")
    supported = "lumina, chroma, flux, sd3, sdxl, sd1"
    with pytest.raises(HostError, match=rf"map_pixel: the VAE arms are not supported for anima \(supported: {supported}\)"):
        run_double("anima", "--resolution", RES, downscale=map_config(tmp_path, map_pixel=True))
    assert calls == [] and not (tmp_path / "map").exists()


def test_vae_arms_without_a_vae_at_map_time_are_named(tmp_path):
    with pytest.raises(HostError, match="map_reenc / map_pixel: the trainer passed no VAE to process_batch"):
        run_double("flux", "--resolution", RES, "--max_train_steps", "4", downscale=map_config(tmp_path, map_reenc=True))


def test_vae_arms_of_a_probe_of_images_start_from_its_encoded_latent():
    """Without cached latents a probe holds images (in [-1, 1]): z is their (seeded) encode, the arms build on it."""
    ae, images = TinyAE(4, 8), torch.rand(1, 3, 128, 128, generator=torch.Generator().manual_seed(1)) - 0.5
    probe = {"images": images, "loss_weights": torch.ones(1)}
    backend = ProbeBackend([probe], lambda p: None, None, [], "flux", [], {}, HostVae(ae, "direct", "cpu", []), seed=5)
    z = ae.encode(images)
    (grid, reenc), (_, pixel) = backend.arm_input(0, REENC), backend.arm_input(0, pixel_arm(0.5))
    assert grid is None and torch.allclose(reenc, z, atol=1e-3)
    assert torch.allclose(pixel, ae.encode(area_downsample(ae.decode(z), (64, 64))), atol=1e-3)
    assert torch.equal(backend.arm_input(0, REENC)[1], reenc)  # seeded: the same arm input every time
    assert "TinyAE" in backend.describe()["vae"]


def test_every_vae_arch_names_a_known_calling_convention():
    assert {r.vae_calls for r in BY_ARCH.values() if r.vae_calls} <= set(VAE_CALLS)
    with pytest.raises(ValueError, match="allowed: direct, diffusers"):
        HostVae(torch.nn.Identity(), "lanczos", "cpu", [])
