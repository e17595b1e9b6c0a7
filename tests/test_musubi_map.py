"""``mode = "map"`` inside musubi-tuner's trainers, on the doubles (``tests/doubles/musubi_*.py``; CI, no musubi-tuner).

The map runs before the batch that completes its probes, every draw the trainer's own ``process_batch``
through the plugin's forcing hook at the arm's grid (spatial axes only: a video's F is kept) and the
map's σ; it writes the map's files to ``map_out``; ``after_map = "stop"`` ends the run (exit 0, nothing
saved), ``"train"`` trains on with the derived windows as the routes and records the map in the saved
LoRA. A map that finds no window leaves the run bitwise the host's (RNG, accumulated gradients,
optimizer, the trainer's bucket pool and Wan 2.2's expert flag untouched); a resumed run saved after
the map routes by its windows without mapping again; what the run cannot map is refused at start.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import toml
import torch
from test_musubi_doubles import ARCHS, doubles, pretend_processes, run, saved, trainers  # noqa: F401  # the doubles fixture

from downscale_plugin.bins import parse_bins
from downscale_plugin.config import load_config
from downscale_plugin.grid import area_downsample
from downscale_plugin.hosts.musubi import start as musubi_start
from downscale_plugin.hosts.musubi.facts import HostError

# One route (ratio 0.5: latent 8x8 → 4x4) over two σ bins and the σ = 1 endpoint; D = 2 draws; 4 probes:
# 4 images × 3 bins × 3 arms (native_a, native_b, latent_0.5) × 2 draws = 72 forced single-sample steps.
QUICK = {"map_ratios": [0.5], "map_bins": "0,0.5,1", "map_draws": 2, "map_images": 4}
BINS = parse_bins(QUICK["map_bins"])
ARMS, DRAWS, IMAGES = 3, 2, 4
FORCED = IMAGES * len(BINS) * ARMS * DRAWS
# Wan 64x64, 5 frames: latent 2 × 8 × 8. The tiny Wan DiT's time input is the 1000-scale timestep: a small
# learning rate keeps its loss finite.
WAN = [*ARCHS["wan"][1], "--learning_rate", "1e-7"]
BATCH2 = ("--batch_size", "2", "--items_per_bucket", "4", "--seed", "3")  # the 4 probes are in at train batch 2
NATIVE = {"wan": (2, 8, 8), "qwen_image": (1, 4, 4), "z_image": 64}  # what the DiT ran (Qwen-Image: packed 2x2; Z-Image: tokens)
SMALL = {"wan": (2, 4, 4), "qwen_image": (1, 2, 2), "z_image": 16}
EXACT = {"wan": 1e-6, "qwen_image": 1e-6, "z_image": 1e-3}  # Z-Image's default "sigma" sampling: σ on the scheduler's grid


def map_config(tmp_path: Path, **extra) -> dict:
    return {"mode": "map", "map_out": str(tmp_path / "map"), **QUICK, **extra}


def arch_argv(arch: str) -> list[str]:
    return WAN if arch == "wan" else ARCHS[arch][1]


def plain_run(name: str, argv, tmp_path: Path, trainer=None):
    return run(name, *argv, tmp_path=tmp_path, trainer=trainer, module="musubi_lora", network_args=())


def same_weights(a: Path, b: Path) -> bool:
    (wa, _), (wb, _) = saved(a), saved(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def grid_of(arch: str, call: dict):
    """What a DiT forward ran: Wan records (F, H, W); Qwen-Image's img_shapes come from the batch's latents; Z-Image's tokens."""
    if arch == "wan":
        return call["grid"]
    if arch == "z_image":
        return call["tokens"][1]
    ((shape,),) = call["img_shapes"]
    return shape


def sigma_of(arch: str, t: torch.Tensor) -> torch.Tensor:
    """σ from the DiT's time input: the flow branch's timesteps = 1000·σ + 1 (Qwen-Image's call_dit divides by 1000);
    the scheduler branch's timesteps = 1000·σ, which Z-Image's call_dit reverses to (1000 − timesteps) / 1000."""
    return {"wan": (t - 1.0) / 1000.0, "qwen_image": t - 1e-3, "z_image": 1.0 - t}[arch]


def recording(name: str):
    """The trainer with ``call_dit`` recording the latents it was handed and those in the batch it reads."""

    class Recording(getattr(trainers(), name)):
        def call_dit(self, args, accelerator, transformer, latents, batch, noise, noisy_model_input, timesteps, network_dtype, **kw):
            self.seen = getattr(self, "seen", [])
            self.seen.append((latents.detach().clone(), batch["latents"].detach().clone(), noise.detach().clone()))
            return super().call_dit(
                args, accelerator, transformer, latents, batch, noise, noisy_model_input, timesteps, network_dtype, **kw
            )

    return Recording()


@pytest.mark.parametrize("arch", ["wan", "qwen_image", "z_image"])
def test_map_runs_every_draw_through_the_trainers_step_at_the_arm_grid_and_sigma_then_stops(arch, tmp_path):
    name = ARCHS[arch][0]
    argv = [*arch_argv(arch), *BATCH2, "--max_train_steps", "4"]
    plain = plain_run(name, argv, tmp_path / "plain", trainer=recording(name))
    samples = torch.cat([latents for latents, _, _ in plain.seen[:2]])  # the run's first 4 samples (batches 1 and 2)
    raw = torch.cat([batch for _, batch, _ in plain.seen[:2]])
    trainer = recording(name)
    with pytest.raises(SystemExit) as stop:
        run(name, *argv, tmp_path=tmp_path / "out", trainer=trainer, downscale=map_config(tmp_path))
    assert stop.value.code == 0
    state = trainer.last_network.downscale_run
    assert trainer.losses == plain.losses[:1] and state.accounting.total_steps == 1  # batch 1 trained; batch 2's step never ran
    assert state.accelerator.ended == 1 and state.finished  # the end summary and the host's end_training ran
    assert not (tmp_path / "out").exists()  # stopped before any save: no weights
    assert "process_batch" not in vars(trainer)  # the run's patches came off

    calls = trainer.last_transformer.calls
    assert len(calls) == 1 + FORCED and calls[0]["tokens"][0] == 2 and all(c["tokens"][0] == 1 for c in calls[1:])
    assert grid_of(arch, calls[0]) == NATIVE[arch]
    forced = calls[1:]
    sigmas = torch.cat([sigma_of(arch, c["t"]) for c in forced])
    per_cell = ARMS * DRAWS
    for j in range(0, FORCED, per_cell):  # the estimator's order: image, bin, arm, draw
        image, b = divmod(j // per_cell, len(BINS))
        cell = forced[j : j + per_cell]
        assert [grid_of(arch, c) for c in cell] == [NATIVE[arch]] * 4 + [SMALL[arch]] * 2  # native_a, native_b, latent_0.5
        cell_sigmas, exact = sigmas[j : j + per_cell].view(ARMS, DRAWS), EXACT[arch]
        assert torch.allclose(cell_sigmas, cell_sigmas[0].expand(ARMS, DRAWS), atol=1e-6)  # every arm of a cell sees the same σ
        lo, hi = BINS.bounds(b)
        if BINS.is_endpoint(b):
            assert torch.allclose(cell_sigmas, torch.ones_like(cell_sigmas), atol=1e-6)  # replayed, not drawn
        else:
            assert bool(((cell_sigmas > lo - exact) & (cell_sigmas <= hi + exact)).all())
            assert float(cell_sigmas[0, 0]) <= (lo + hi) / 2 + exact and (lo + hi) / 2 <= float(cell_sigmas[0, 1]) + exact  # stratified
        seen = trainer.seen[1 + j : 1 + j + per_cell]
        for latents, batch, noise in seen[:4]:  # the probe is the run's own sample, scale-shifted as the loop hands it
            assert torch.equal(latents, samples[image : image + 1]) and torch.equal(batch, raw[image : image + 1])
            assert noise.shape == latents.shape
        for latents, batch, noise in seen[4:]:  # the route's arm: area-downsampled on H, W (F kept), its own small noise
            assert torch.equal(latents, area_downsample(samples[image : image + 1], (4, 4)))
            assert torch.equal(batch, area_downsample(raw[image : image + 1], (4, 4)))  # what Qwen-Image's call_dit re-reads
            assert noise.shape == latents.shape and latents.shape[1:-2] == samples.shape[1:-2]
    for arm in (slice(0, 4), slice(4, 6)):  # fresh unit-variance noise per draw: drawn at the arm's grid, never downsampled
        noises = [trainer.seen[1 + j + i][2] for j in range(0, FORCED, per_cell) for i in range(per_cell)[arm]]
        assert abs(float(torch.cat([n.flatten() for n in noises]).std()) - 1.0) < 0.2
        assert not any(torch.equal(a, b) for a, b in zip(noises[::2], noises[1::2], strict=True))  # each draw its own

    written = sorted(os.listdir(tmp_path / "map"))
    assert written == ["map.csv", "map.json", "map.png", "windows.toml"]
    derived = load_config(plugin_toml=toml.load(tmp_path / "map" / "windows.toml"))  # the router reads it as is
    assert derived.arch == arch and all(r.ratio == 0.5 for r in derived.routes)
    provenance = json.loads((tmp_path / "map" / "map.json").read_text())["provenance"]
    assert provenance["backend"]["native_latent_hw"] == [8, 8] and "before train batch 2" in provenance["command"]
    assert provenance["backend"]["arch"] == arch and provenance["backend"]["trainer"] == type(trainer).__name__


@pytest.mark.parametrize(
    ("name", "argv"),
    [
        ("WanNetworkTrainer", [*WAN, "--batch_size", "2", "--items_per_bucket", "8", "--gradient_accumulation_steps", "2",
                               "--max_train_steps", "4"]),
        ("WanNetworkTrainer", [*WAN, "--batch_size", "2", "--items_per_bucket", "8", "--num_timestep_buckets", "5",
                               "--preserve_distribution_shape", "--gradient_accumulation_steps", "2", "--max_train_steps", "4"]),
        ("QwenImageNetworkTrainer", [*ARCHS["qwen_image"][1], "--batch_size", "2", "--items_per_bucket", "8",
                                     "--gradient_accumulation_steps", "2", "--max_train_steps", "4"]),
        ("WanNetworkTrainer", [*WAN, "--task", "t2v-A14B", "--dit_high_noise", "high.safetensors", "--timestep_sampling", "uniform",
                               "--items_per_bucket", "8", "--max_train_steps", "8"]),
    ],
    ids=["wan_accumulation", "wan_buckets_accumulation", "qwen_image_accumulation", "wan22_two_experts"],
)  # fmt: skip
def test_a_map_without_windows_leaves_training_bitwise_the_hosts(name, argv, tmp_path, caplog):
    """ε ≈ 0: no window, so after_map = "train" trains native. With accumulation 2 the map runs between the two
    micro-batches of the first update (probe 4 arrives with the 2nd batch of 2), so the accumulated .grad, the RNG
    and the optimizer must survive it; the forced steps pop the trainer's bucket pool (--preserve_distribution_shape)
    and set Wan 2.2's expert flag, and must leave the run as it was (5 timestep buckets: the map's 72 pops would leave
    the pool at another length)."""
    argv = [*argv, "--seed", "4"]
    plain = plain_run(name, argv, tmp_path / "plain")
    plugin = run(name, *argv, tmp_path=tmp_path / "plugin", downscale=map_config(tmp_path, after_map="train", map_margin=1e-9))
    assert plugin.losses == plain.losses and len(plain.losses) == 8
    assert same_weights(tmp_path / "plain", tmp_path / "plugin")
    state = plugin.last_network.downscale_run
    assert state.cfg.routes == () and state.accounting.total_steps == 8  # the native steps before the map are counted
    assert sorted(os.listdir(tmp_path / "map")) == ["map.csv", "map.json", "map.png", "windows.toml"]
    assert load_config(plugin_toml=toml.load(tmp_path / "map" / "windows.toml")).routes == ()
    assert 'after_map = "train": no route has a safe window at margin 1e-09; training continues native' in caplog.text
    batch = int(argv[argv.index("--batch_size") + 1]) if "--batch_size" in argv else 1
    k = IMAGES // batch - 1  # train forwards before the map
    calls, theirs = plugin.last_transformer.calls, plain.last_transformer.calls
    assert len(calls) - len(theirs) == FORCED and all(c["tokens"][0] == 1 for c in calls[k : k + FORCED])
    assert all(c["tokens"][0] == batch for c in calls[:k] + calls[k + FORCED :])
    assert all(torch.equal(a["t"], b["t"]) for a, b in zip(calls[:k] + calls[k + FORCED :], theirs, strict=True))
    _, meta = saved(tmp_path / "plugin")
    assert json.loads(meta["ss_downscale_routes"]) == [] and json.loads(meta["ss_downscale_map"])["windows"] == []
    if "--dit_high_noise" in argv:
        assert plugin.experts[:k] + plugin.experts[k + FORCED :] == plain.experts
        assert plugin.experts == [bool(c["t"][0] / 1000.0 >= 0.875) for c in calls]  # every forward on the expert its σ names
        assert len(set(plugin.experts[k : k + FORCED])) == 2


def test_map_then_train_routes_with_the_derived_windows_and_records_them(tmp_path, caplog):
    argv = [*WAN, *BATCH2, "--max_train_steps", "6"]
    config = map_config(tmp_path, after_map="train", map_margin=0.99)
    with caplog.at_level("INFO", logger="downscale_plugin"):
        trainer = run("WanNetworkTrainer", *argv, tmp_path=tmp_path / "out", downscale=config)
    state = trainer.last_network.downscale_run
    windows_path = tmp_path / "map" / "windows.toml"
    windows = toml.load(windows_path)
    derived = load_config(plugin_toml=windows)
    # ε = 0.99: every bin of the route is safe, one window over all of (0, 1]: every step from batch 2 on is routed
    assert derived.routes and state.cfg.routes == derived.routes and all(r.ratio == 0.5 for r in derived.routes)
    assert windows["windows_arch"] == "wan" and windows["windows_native"] == "8x8" and windows["windows_margin"] == 0.99
    assert windows["windows_method"].startswith("map") and windows["windows_images"] == 4
    assert "windows_model" not in windows  # the doubles' --dit is no file to hash
    calls = trainer.last_transformer.calls
    train = [c for c in calls if c["tokens"][0] == 2]  # the map's draws run one probe at a time
    assert len(train) == 6 and len(calls) == 6 + FORCED
    assert [c["grid"] for c in train] == [(2, 8, 8)] + [(2, 4, 4)] * 5  # routed from the batch that completed the probes; F kept
    assert state.accounting.total_steps == 6 and state.accounting.routed_samples == 10
    assert len(trainer.losses) == 6 and all(map(torch.isfinite, map(torch.tensor, trainer.losses)))

    _, meta = saved(tmp_path / "out")
    assert json.loads(meta["ss_downscale_routes"]) == windows["routes"]
    recorded = json.loads(meta["ss_downscale_map"])
    assert recorded["windows_toml"] == str(windows_path) and recorded["windows"] == ["latent_0.5 (0, 1]"]
    assert recorded["before_train_batch"] == 2 and recorded["probes"] == 4 and recorded["draws"] == 2 and recorded["margin"] == 0.99
    assert recorded["ratios"] == [0.5] and recorded["bins"] == BINS.spec()
    counts = json.loads(meta["ss_downscale_counts"])
    assert counts["forwards"] == 6 and counts["routes"]["native"] == pytest.approx(1 / 6) and counts["token_saving"] > 0
    assert 'mode = "map": the gradient map runs when the first 4 training samples are in (batch 2' in caplog.text  # the banner
    assert 'after_map = "train": training continues from batch 2 with the derived windows' in caplog.text


def test_a_resumed_map_run_routes_by_the_saved_windows_without_mapping_again(tmp_path):
    argv = [*WAN, *BATCH2, "--max_train_steps", "6"]
    config = map_config(tmp_path, after_map="train", map_margin=0.99)
    first = run("WanNetworkTrainer", *argv, "--save_state", tmp_path=tmp_path / "a", downscale=config)
    mapped = first.last_network.downscale_run.cfg.routes
    assert mapped
    _, first_meta = saved(tmp_path / "a")
    resumed = run(
        "WanNetworkTrainer", *argv, "--resume", str(tmp_path / "a" / "last-state"),
        tmp_path=tmp_path / "b", downscale=map_config(tmp_path / "again", after_map="train", map_margin=0.99),
    )  # fmt: skip
    state = resumed.last_network.downscale_run
    assert state.cfg.routes == mapped
    calls = resumed.last_transformer.calls
    assert len(calls) == 6 and all(c["tokens"][0] == 2 and c["grid"] == (2, 4, 4) for c in calls)  # no probe draw; routed from step 1
    assert not (tmp_path / "again").exists()
    _, meta = saved(tmp_path / "b")
    assert meta["ss_downscale_map"] == first_meta["ss_downscale_map"] and meta["ss_downscale_routes"] == first_meta["ss_downscale_routes"]
    assert json.loads(meta["ss_downscale_counts"])["forwards"] == 12  # both runs' forwards


@pytest.mark.parametrize(
    ("config", "argv", "message"),
    [
        ({"map_reenc": True}, (), r"map_reenc: the VAE arms are not supported for wan \(supported: none on this host\); set map_reenc = false"),
        ({"map_pixel": True}, (), r"map_pixel: the VAE arms are not supported for wan \(supported: none on this host\); set map_pixel = false"),
        ({"map_images": 8}, ("--max_train_steps", "3"), "map_images: 8 probes need 4 train batches of 2, but the run has 3; lower map_images"),
        ({"map_ratios": [0.95]}, (), r"map_ratios: 0.95 give no strictly smaller wan grid \(multiple \d+\) for the 8x8 latent bucket"),
    ],
    ids=["map_reenc", "map_pixel", "too_short", "no_smaller_grid"],
)  # fmt: skip
def test_a_map_the_run_cannot_do_fails_at_prepare_network(tmp_path, config, argv, message):
    trainer = trainers().WanNetworkTrainer()
    with pytest.raises(HostError, match=message):
        run("WanNetworkTrainer", *WAN, *BATCH2, *argv, tmp_path=tmp_path / "out", trainer=trainer, downscale=map_config(tmp_path, **config))
    assert trainer.last_transformer is not None and not trainer.last_transformer.calls and not trainer.losses
    assert not (tmp_path / "map").exists() and not (tmp_path / "out").exists()


def test_every_problem_is_named_at_once(tmp_path):
    trainer = trainers().WanNetworkTrainer()
    with pytest.raises(HostError) as err:
        config = map_config(tmp_path, map_reenc=True, map_pixel=True, map_ratios=[0.95])
        run("WanNetworkTrainer", *WAN, *BATCH2, "--max_train_steps", "1", tmp_path=tmp_path / "out", trainer=trainer, downscale=config)
    text = str(err.value)
    assert all(key in text for key in ("map_reenc: ", "map_pixel: ", "map_ratios: 0.95", "map_images: 4 probes need 2 train batches"))
    assert not trainer.losses


def test_several_processes_are_refused_at_prepare_network(tmp_path, monkeypatch):
    pretend_processes(monkeypatch, 2)
    trainer = trainers().WanNetworkTrainer()
    with pytest.raises(HostError, match=r"2 processes: the map runs on one process \(launch with --num_processes 1\)"):
        run("WanNetworkTrainer", *WAN, *BATCH2, tmp_path=tmp_path, trainer=trainer, downscale=map_config(tmp_path))
    assert not trainer.losses and not trainer.last_transformer.calls


def test_a_run_that_ends_before_its_map_says_so(tmp_path, caplog, monkeypatch):
    """--max_train_epochs shortens the run after prepare_network (2 batches of 1 here), below the 4 probes. The
    dataset's 2 distinct items are refused at start; a dataset whose items name no key runs and says so at its end."""
    argv = (*WAN, "--max_train_steps", "100", "--max_train_epochs", "1", "--seed", "3")
    with pytest.raises(HostError, match="map_images: the dataset has 2 distinct images; 4 probes must be 4 distinct images"):
        run("WanNetworkTrainer", *argv, tmp_path=tmp_path / "refused", downscale=map_config(tmp_path))
    counted = musubi_start.musubi_buckets
    monkeypatch.setattr(musubi_start, "musubi_buckets", lambda *args: replace(counted(*args), images=None))
    trainer = run("WanNetworkTrainer", *argv, tmp_path=tmp_path / "out", downscale=map_config(tmp_path))
    assert len(trainer.losses) == 2 and not (tmp_path / "map").exists() and (tmp_path / "out" / "last.safetensors").exists()
    assert 'mode = "map": the run ended after 2 of the 4 probe samples it needs; nothing was measured' in caplog.text
