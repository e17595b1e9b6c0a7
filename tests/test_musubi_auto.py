"""``mode = "auto"`` inside musubi-tuner's trainers, on the doubles (``tests/doubles/musubi_*.py``; CI, no musubi-tuner).

The certifier runs once, before the batch that completes its 16 probes, every draw the trainer's own
``process_batch`` through the plugin's forcing hook (the host's sampler at a forced σ, the step's
noise drawn as the loop or a routed step draws it); it spends at most ``certify_budget`` of the run's
native compute, writes ``windows.toml`` and ``certify.json`` to ``map_out``, and the run trains on
with what it certified (video F unchanged). Budget 0 is the plain run; a certification that opens
nothing leaves the run bitwise the host's (RNG, accumulated gradients, optimizer, the trainer's
bucket pool and Wan 2.2's expert flag untouched); what the run cannot certify is refused at start.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import toml
import torch
from test_musubi_doubles import ARCHS, doubles, pretend_processes, run, saved, trainers  # noqa: F401  # the doubles fixture

from downscale_plugin.config import load_config
from downscale_plugin.hosts.musubi.facts import HostError

pytestmark = pytest.mark.usefixtures("token_costs")

# One route (ratio 0.5: latent 8x8 → 4x4) over two σ bins; D = 2 paired draws: a look at one bin is
# 4 probes × 2 draws × (1 + 0.25) = 10 native-step equivalents, one on all 16 probes 40.
# a 192-pass run cannot pay back a window's evidence: "buy" certifies all the same (these tests are the mechanics)
QUICK = {"map_ratios": [0.5], "map_bins": "0,0.5,1", "certify_draws": 2, "certify_unpaid": "buy"}
# Wan 64x64, 5 frames (latent 2 × 8 × 8); 48 steps of 4 samples: 192 single-sample passes; the probes (16 distinct
# items) are in at batch 4.
# The tiny Wan DiT's time input is the 1000-scale timestep: a small learning rate keeps its loss finite.
WAN = [*ARCHS["wan"][1], "--learning_rate", "1e-7"]
ARGV = ("--batch_size", "4", "--items_per_bucket", "16", "--max_train_steps", "48", "--seed", "3")


def auto_config(tmp_path: Path, **extra) -> dict:
    return {"mode": "auto", "map_out": str(tmp_path / "auto"), "certify_budget": 0.5, **QUICK, **extra}


def plain_run(name: str, argv, tmp_path: Path):
    return run(name, *argv, tmp_path=tmp_path, module="musubi_lora", network_args=())


def same_weights(a: Path, b: Path) -> bool:
    (wa, _), (wb, _) = saved(a), saved(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_budget_zero_is_the_plain_run_bitwise(tmp_path):
    argv = [*WAN, *ARGV]
    plain = plain_run("WanNetworkTrainer", argv, tmp_path / "plain")
    plugin = run("WanNetworkTrainer", *argv, tmp_path=tmp_path / "plugin", downscale=auto_config(tmp_path, certify_budget=0.0))
    assert plugin.losses == plain.losses and len(plain.losses) == 48
    assert same_weights(tmp_path / "plain", tmp_path / "plugin")
    assert not (tmp_path / "auto").exists()


@pytest.mark.parametrize(
    ("name", "argv", "forwards"),
    [
        ("WanNetworkTrainer", [*WAN, "--batch_size", "2", "--items_per_bucket", "16", "--gradient_accumulation_steps", "2",
                               "--max_train_steps", "20"], 40),
        ("WanNetworkTrainer", [*WAN, "--batch_size", "2", "--items_per_bucket", "16", "--num_timestep_buckets", "5",
                               "--preserve_distribution_shape", "--gradient_accumulation_steps", "2", "--max_train_steps", "20"], 40),
        ("QwenImageNetworkTrainer", [*ARCHS["qwen_image"][1], "--batch_size", "4", "--items_per_bucket", "16", "--max_train_steps", "24"],
         24),
        ("WanNetworkTrainer", [*WAN, "--task", "t2v-A14B", "--dit_high_noise", "high.safetensors", "--timestep_sampling", "uniform",
                               "--items_per_bucket", "16", "--max_train_steps", "80"], 80),
    ],
    ids=["wan_accumulation", "wan_buckets_accumulation", "qwen_image", "wan22_two_experts"],
)  # fmt: skip
def test_a_certification_that_opens_nothing_leaves_training_bitwise_the_hosts(name, argv, forwards, tmp_path):
    """ε ≈ 0: nothing is certified. With accumulation 2 the certifier runs between two micro-batches of an
    update (probe 16 arrives with the 8th batch of 2), so the accumulated .grad, the RNG and the optimizer
    must survive it; the forced steps pop the trainer's bucket pool (--preserve_distribution_shape) and set
    Wan 2.2's expert flag (and swap its experts), and must leave the run as it was."""
    argv = [*argv, "--seed", "4"]
    plain = plain_run(name, argv, tmp_path / "plain")
    plugin = run(name, *argv, tmp_path=tmp_path / "plugin", downscale=auto_config(tmp_path, map_margin=1e-9))
    assert plugin.losses == plain.losses and len(plain.losses) == forwards
    assert same_weights(tmp_path / "plain", tmp_path / "plugin")
    state = plugin.last_network.downscale_run
    assert state.cfg.routes == () and state.accounting.total_steps == forwards
    blob = json.loads((tmp_path / "auto" / "certify.json").read_text())
    assert blob["cost"]["native_step_equivalents"] > 0 and not any(row["safe"] for row in blob["bins"])
    calls, theirs = plugin.last_transformer.calls, plain.last_transformer.calls
    k = 16 // int(argv[argv.index("--batch_size") + 1]) - 1 if "--batch_size" in argv else 15  # train forwards before the certifier
    forced = len(calls) - len(theirs)
    assert forced > 0 and all(c["tokens"][0] == 1 for c in calls[k : k + forced])
    assert all(torch.equal(a["t"], b["t"]) for a, b in zip(calls[:k] + calls[k + forced :], theirs, strict=True))
    if "--dit_high_noise" in argv:
        assert plugin.experts[:k] + plugin.experts[k + forced :] == plain.experts
        assert plugin.experts == [bool(c["t"][0] / 1000.0 >= 0.875) for c in calls]  # every forward on the expert its σ names
        assert len(set(plugin.experts[k : k + forced])) == 2


@pytest.mark.parametrize("arch", ["wan", "qwen_image"])
@pytest.mark.usefixtures("range_clipped_read")
def test_auto_certifies_then_trains_with_the_windows_and_records_them(arch, tmp_path, caplog):
    name, argv = ARCHS[arch]
    argv = [*(WAN if arch == "wan" else argv), *ARGV]
    with caplog.at_level("INFO", logger="downscale_plugin"):
        trainer = run(name, *argv, tmp_path=tmp_path / "out", downscale=auto_config(tmp_path, map_margin=0.99))
    state = trainer.last_network.downscale_run
    windows = toml.load(tmp_path / "auto" / "windows.toml")
    derived = load_config(plugin_toml=windows)
    assert derived.routes and state.cfg.routes == derived.routes and all(r.ratio == 0.5 for r in derived.routes)
    assert windows["windows_arch"] == arch and windows["windows_native"] == "8x8" and windows["windows_method"].startswith("certify")
    assert windows["windows_margin"] == 0.99 and "windows_model" not in windows  # the doubles' --dit is no file to hash
    blob = json.loads((tmp_path / "auto" / "certify.json").read_text())
    spent = blob["cost"]["native_step_equivalents"]
    assert 0 < spent <= 0.5 * 192 and blob["cost"]["budget"] == pytest.approx(96.0) and any(row["safe"] for row in blob["bins"])
    assert blob["provenance"]["backend"]["arch"] == arch and blob["provenance"]["backend"]["trainer"] == name
    calls = trainer.last_transformer.calls
    train = [c for c in calls if c["tokens"][0] == 4]  # the certifier's draws run one probe at a time
    probes = [c for c in calls if c["tokens"][0] == 1]
    native, small = {"wan": (2 * 8 * 8, 2 * 4 * 4), "qwen_image": (4 * 4, 2 * 2)}[arch]  # Wan: F = 2 latent frames kept
    assert len(train) == 48 and {c["tokens"][1] for c in train[:3]} == {native} and small in {c["tokens"][1] for c in train[3:]}
    assert probes and {c["tokens"][1] for c in probes} == {native, small}
    if arch == "wan":
        assert {c["grid"] for c in probes} == {(2, 8, 8), (2, 4, 4)} and {c["grid"] for c in train[3:]} <= {(2, 8, 8), (2, 4, 4)}
    else:
        assert {str(c["img_shapes"]) for c in probes} == {"[[(1, 4, 4)]]", "[[(1, 2, 2)]]"}  # call_dit re-reads the batch's latents
    assert state.accounting.total_steps == 48 and state.accounting.routed_samples > 0
    _, meta = saved(tmp_path / "out")
    recorded = json.loads(meta["ss_downscale_map"])
    assert recorded["method"] == "certify" and recorded["before_train_batch"] == 4 and recorded["probes"] == 16
    assert recorded["native_step_equivalents"] == pytest.approx(spent, abs=1e-3) and recorded["windows"]
    assert json.loads(meta["ss_downscale_routes"]) == windows["routes"]
    assert "certification: " in caplog.text and "native-step equivalents (" in caplog.text and "net (native-step" in caplog.text
    assert 'mode = "auto": the certifier runs when the first 16 training samples are in' in caplog.text  # the start banner


def test_the_probes_are_the_steps_own_samples():
    """A probe is one sample of the call: its scale-shifted latents, per-sample tensors, varlen lists and timesteps."""
    from downscale_plugin.hosts.musubi.probes import split_step

    batch = {"latents": torch.randn(3, 4, 2, 8, 8), "t5": [torch.randn(5 + i, 8) for i in range(3)], "timesteps": [0.1, 0.2, 0.3]}
    scaled = batch["latents"] * 0.5
    probes = split_step(batch, scaled)
    assert len(probes) == 3
    for i, probe in enumerate(probes):
        assert torch.equal(probe["latents"], scaled[i : i + 1]) and torch.equal(probe["batch"]["latents"], batch["latents"][i : i + 1])
        assert len(probe["batch"]["t5"]) == 1 and torch.equal(probe["batch"]["t5"][0], batch["t5"][i])
        assert probe["batch"]["timesteps"] == [batch["timesteps"][i]]
    assert split_step({"latents": batch["latents"], "timesteps": None}, scaled)[0]["batch"]["timesteps"] is None


def test_a_resumed_auto_run_routes_by_the_certified_windows_without_certifying_again(tmp_path):
    first = run("WanNetworkTrainer", *WAN, *ARGV, "--save_state", tmp_path=tmp_path / "a", downscale=auto_config(tmp_path, map_margin=0.99))
    certified = first.last_network.downscale_run.cfg.routes
    assert certified
    resumed = run(
        "WanNetworkTrainer", *WAN, *ARGV, "--resume", str(tmp_path / "a" / "last-state"),
        tmp_path=tmp_path / "b", downscale=auto_config(tmp_path / "again", map_margin=0.99),
    )  # fmt: skip
    assert resumed.last_network.downscale_run.cfg.routes == certified
    assert all(c["tokens"][0] == 4 for c in resumed.last_transformer.calls) and not (tmp_path / "again").exists()  # no probe draw
    _, meta = saved(tmp_path / "b")
    assert json.loads(meta["ss_downscale_map"])["method"] == "certify" and json.loads(meta["ss_downscale_counts"])["forwards"] == 96


@pytest.mark.parametrize(
    ("config", "argv", "message"),
    [
        ({"certify_budget": 0.04}, (), r"costs 40.0 native-step equivalents; certify_budget 0.04 of the run's 192 passes is 7.7"),
        ({}, ("--items_per_bucket", "12"), "probes: the dataset has 12 distinct images; 16 probes must be 16 distinct images"),
        ({}, ("--max_train_steps", "3"), "probes: 16 probes need 4 train batches of 4, but the run has 3"),
        ({"map_ratios": [0.95]}, (), "map_ratios: 0.95 give no strictly smaller wan grid"),
        ({"certify_resume": "/no/such/certify.json"}, (), "certify_resume: cannot read /no/such/certify.json"),
    ],
)
def test_a_certification_the_run_cannot_do_fails_at_prepare_network(tmp_path, config, argv, message):
    trainer = trainers().WanNetworkTrainer()
    config = auto_config(tmp_path, **config)
    with pytest.raises(HostError, match=message):
        run("WanNetworkTrainer", *WAN, *ARGV, *argv, tmp_path=tmp_path / "out", trainer=trainer, downscale=config)
    assert not trainer.losses and not trainer.last_transformer.calls and not (tmp_path / "auto").exists()


def test_several_processes_are_refused_at_prepare_network(tmp_path, monkeypatch):
    pretend_processes(monkeypatch, 2)
    trainer = trainers().WanNetworkTrainer()
    with pytest.raises(HostError, match="2 processes: the auto runs on one process"):
        run("WanNetworkTrainer", *WAN, *ARGV, tmp_path=tmp_path, trainer=trainer, downscale=auto_config(tmp_path))
    assert not trainer.losses


def test_evidence_for_other_settings_is_refused_at_prepare_network(tmp_path):
    run("WanNetworkTrainer", *WAN, *ARGV, tmp_path=tmp_path / "a", downscale=auto_config(tmp_path, map_margin=0.99))
    evidence = tmp_path / "saved.json"
    evidence.write_text((tmp_path / "auto" / "certify.json").read_text())
    trainer = trainers().WanNetworkTrainer()
    with pytest.raises(HostError, match=r"certify_resume: margin is 0.99 in the saved result, 0.5 now"):
        run(
            "WanNetworkTrainer", *WAN, *ARGV, tmp_path=tmp_path / "b", trainer=trainer,
            downscale=auto_config(tmp_path, map_margin=0.5, certify_resume=str(evidence)),
        )  # fmt: skip
    assert not trainer.losses


def test_paired_noise_couples_each_frame_of_a_video_latent():
    """The certifier's coupled small noise on B,C,F,H,W noise works over H, W only: frame by frame it is the
    image case, and the area-downsampled native noise is the small noise scaled by the filter's covariance root."""
    from downscale_plugin.grid import area_downsample
    from downscale_plugin.mapping.paired import coupled_small_noise, downsample_covariance_sqrt

    noise = torch.randn(1, 4, 3, 8, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    small = coupled_small_noise(noise, (4, 6))
    assert small.shape == (1, 4, 3, 4, 6)
    for f in range(3):
        assert torch.allclose(small[:, :, f], coupled_small_noise(noise[:, :, f], (4, 6)))
    rows, cols = downsample_covariance_sqrt(8, 4), downsample_covariance_sqrt(12, 6)
    assert torch.allclose(area_downsample(noise, (4, 6)), rows @ small @ cols.T, atol=1e-10)


def test_windows_serve_only_the_tiers_of_the_buckets_the_probes_came_from(tmp_path):
    """Two buckets (Qwen-Image 64² and 128²: latents 8x8 and 16x16): the certified windows are tier rules for the
    buckets the probes were measured on, never a scale rule for every bucket, and the run routes only those tiers."""
    name, argv = ARCHS["qwen_image"]
    argv = [*argv, "--buckets", "64x64", "128x128", *ARGV]
    trainer = run(name, *argv, tmp_path=tmp_path / "out", downscale=auto_config(tmp_path, map_margin=0.99))
    blob = json.loads((tmp_path / "auto" / "certify.json").read_text())
    windows = toml.load(tmp_path / "auto" / "windows.toml")
    measured = {tuple(g) for g in blob["provenance"]["backend"]["probe_grids"]}
    tiers = {f"{8 * h}:{4 * h}" for h, _ in measured}  # VAE factor 8: the 8x8 latent is the 64 px tier, routed at 32 px
    assert windows["routes"] and all("scale" not in r for r in windows["routes"]) and {r["route"] for r in windows["routes"]} == tiers
    assert blob["scope"].startswith("measured on buckets: ") and "serves: buckets within the run's tier_tolerance of" in blob["scope"]
    routed = {c["tokens"][1] for c in trainer.last_transformer.calls if c["tokens"][0] == 4} - {h * w // 4 for h, w in measured}
    assert routed <= {h * w // 16 for h, w in measured}  # every train forward at a measured grid or its route's small grid
