"""The plugin inside musubi-tuner's trainers, on the doubles (``tests/doubles/musubi_*.py``; CI, no musubi-tuner).

Per architecture: a run whose routes never fire (and a plugin-off run) is bitwise the host's, also
with timestep buckets, ``--preserve_distribution_shape`` and Wan 2.2's two experts; a routed step
runs the DiT at the small grid with F unchanged, its own small noise and the small latents in the
batch the DiT reads, and σ reaches the DiT as the host pairs it; Wan 2.2 runs each step on the expert
its σ names; every sample's σ keeps the host's marginal under the coupled gate; the FLOP model counts
every latent frame; counts and the forward index go on across ``--save_state``/``--resume``;
``--base_weights`` merge through the run's inner module; runs and batches the plugin would mis-train,
changed hook points and bad configs are refused before a step runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from scipy import stats

from downscale_plugin.config import ConfigError, load_config
from downscale_plugin.hosts.musubi.facts import BY_ARCH, HostError
from downscale_plugin.hosts.musubi.family import MusubiFamily, flow_law, grid_law
from downscale_plugin.router import Router

DOUBLES = str(Path(__file__).parent / "doubles")
ALL_ROUTED = {"routes": [{"scale": 0.5, "sigma_min": 0.0}]}
NEVER = {"routes": [{"route": "1024:768", "sigma_min": 0.0}]}  # no bucket of these runs is in the 1024 px tier
# arch → (trainer class name, argv)
ARCHS = {
    "wan": ("WanNetworkTrainer", ["--buckets", "64x64x5", "--timestep_sampling", "shift", "--discrete_flow_shift", "3"]),
    "qwen_image": ("QwenImageNetworkTrainer", ["--timestep_sampling", "qwen_shift"]),
    "flux_2": ("Flux2NetworkTrainer", ["--timestep_sampling", "flux2_shift", "--buckets", "128x128"]),
    "z_image": ("ZImageNetworkTrainer", ["--weighting_scheme", "logit_normal"]),  # the default "sigma" grid
    "hunyuan_video": ("HunyuanVideoNetworkTrainer", ["--buckets", "64x64x9", "--timestep_sampling", "shift", "--discrete_flow_shift", "7"]),
    "hunyuan_video_1_5": ("HunyuanVideo15NetworkTrainer", ["--buckets", "128x128x5", "--timestep_sampling", "sigmoid"]),
}


@pytest.fixture(scope="module", autouse=True)
def doubles():
    """``tests/doubles`` importable (the ``musubi_*`` names are the doubles' own), one torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    sys.path.insert(0, DOUBLES)
    yield
    sys.path.remove(DOUBLES)
    torch.set_num_threads(threads)


def trainers():
    import musubi_trainers

    return musubi_trainers


def parse(*argv: str, module: str = "downscale_plugin", network_args: tuple[str, ...] = ("inner=musubi_lora",), downscale=None):
    from musubi_trainer_base import setup_parser

    extra = ["--network_args", *network_args] if network_args else []
    args = setup_parser().parse_args(["--network_module", module, *extra, *argv])
    if downscale is not None:
        args.downscale = downscale
    return args


def run(name: str, *argv: str, tmp_path: Path, trainer=None, **kwargs):
    trainer = trainer if trainer is not None else getattr(trainers(), name)()
    trainer.train(parse(*argv, "--output_dir", str(tmp_path), **kwargs))
    return trainer


def pretend_processes(monkeypatch, n: int) -> None:
    """Every TinyAccelerator made from now on says it is one of ``n`` processes (what prepare_network refuses)."""
    import musubi_trainer_base

    init = musubi_trainer_base.TinyAccelerator.__init__

    def processes(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.num_processes = n

    monkeypatch.setattr(musubi_trainer_base.TinyAccelerator, "__init__", processes)


def saved(tmp_path: Path) -> tuple[dict, dict]:
    with safe_open(str(tmp_path / "last.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def plain_and_plugin(name: str, argv: list[str], tmp_path: Path, downscale: dict):
    plain = run(name, *argv, tmp_path=tmp_path / "plain", module="musubi_lora", network_args=())
    plugin = run(name, *argv, tmp_path=tmp_path / "plugin", downscale=downscale)
    return plain, plugin


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_run_whose_routes_never_fire_is_bitwise_the_hosts(arch, tmp_path):
    name, argv = ARCHS[arch]
    argv = [*argv, "--seed", "5", "--batch_size", "2", "--max_train_steps", "3"]
    plain, plugin = plain_and_plugin(name, argv, tmp_path, NEVER)
    assert plugin.losses == plain.losses and len(plain.losses) == 3
    assert all(torch.equal(a["t"], b["t"]) for a, b in zip(plain.last_transformer.calls, plugin.last_transformer.calls, strict=True))
    weights, meta = saved(tmp_path / "plugin")
    reference, _ = saved(tmp_path / "plain")
    assert weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in weights)
    assert meta["ss_downscale_arch"] == arch and meta["ss_downscale_inner"] == "musubi_lora"
    assert "process_batch" not in vars(plugin) and "get_noisy_model_input_and_timesteps" not in vars(plugin)  # the run's patches came off


@pytest.mark.parametrize(
    "argv",
    [
        ["--num_timestep_buckets", "4", "--timestep_sampling", "sigmoid"],
        ["--num_timestep_buckets", "3", "--preserve_distribution_shape", "--min_timestep", "300", "--timestep_sampling", "shift"],
        ["--task", "t2v-A14B", "--dit_high_noise", "high.safetensors", "--num_timestep_buckets", "5", "--timestep_sampling", "shift"],
    ],
    ids=["buckets", "preserve_shape", "wan22_two_experts"],
)
def test_dry_runs_leave_the_buckets_and_the_expert_flag_as_the_host_has_them(argv, tmp_path):
    """Coupled at batch size 1 with a route that is eligible but never fires in the window (σ > 1 − 1e-9):
    every step's dry runs pop the bucket pool and set the expert flag, and must put both back."""
    common = ["--buckets", "64x64x5", "--seed", "11", "--max_train_steps", "4", "--items_per_bucket", "4", *argv]
    plain, plugin = plain_and_plugin("WanNetworkTrainer", common, tmp_path, {"routes": [{"scale": 0.5, "sigma_min": 1 - 1e-9}]})
    assert plugin.losses == plain.losses
    assert plugin.experts == plain.experts
    assert all(torch.equal(a["t"], b["t"]) for a, b in zip(plain.last_transformer.calls, plugin.last_transformer.calls, strict=True))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_routed_step_runs_the_dit_at_the_small_grid(arch, tmp_path):
    name, argv = ARCHS[arch]
    trainer = run(name, *argv, "--seed", "3", "--batch_size", "2", tmp_path=tmp_path, downscale=ALL_ROUTED)
    run_ = trainer.last_network.downscale_run
    calls = trainer.last_transformer.calls
    assert len(calls) == 4 and run_.totals.total_steps == 4
    small = {
        "wan": (2, 2 * 4 * 4, 4),
        "qwen_image": (2, 2 * 2, 16),
        "flux_2": (2, 4 * 4, 8),
        "z_image": (2, 4 * 4, 4),
        "hunyuan_video": (2, 3 * 4 * 4, 4),  # 9 frames: 3 latent frames
        "hunyuan_video_1_5": (2, 2 * 4 * 4, 8),  # 128 px at the 16× VAE: 8 × 8 latents, 2 latent frames
    }[arch]
    assert all(c["tokens"] == small for c in calls)
    if arch == "wan":
        assert all(c["grid"] == (2, 4, 4) and c["seq_len"] == 2 * 4 * 4 // 4 for c in calls)  # F = 2 latent frames, unchanged
    if arch == "qwen_image":
        assert all(c["img_shapes"] == [[(1, 2, 2)]] for c in calls)  # from the batch's (small) latents
    if arch == "hunyuan_video":
        assert set(trainer.pos_embed_cache.values()) == {(3, 4, 4)}  # positions cached for the small shape
    saving = run_.totals.token_saving()
    assert saving == pytest.approx(0.75)


def test_a_routed_step_draws_its_own_small_noise_and_gets_the_routers_sigma_as_the_host_pairs_it(tmp_path):
    """call_dit gets the small latents in the batch too, fresh unit noise at the small grid, and per sample the σ the
    router chose (host draws, coupled redraws and law fills alike) paired the host's way: timesteps = 1000·σ + 1 in float32."""
    seen = []

    class Recording(trainers().QwenImageNetworkTrainer):
        def call_dit(self, args, accelerator, transformer, latents, batch, noise, noisy_model_input, timesteps, network_dtype, **kw):
            decision = self.last_network.downscale_run.hook.last
            seen.append((latents, batch["latents"], noise, noisy_model_input, timesteps, decision))
            return super().call_dit(
                args, accelerator, transformer, latents, batch, noise, noisy_model_input, timesteps, network_dtype, **kw
            )

    argv = ("--seed", "4", "--timestep_sampling", "sigmoid", "--batch_size", "3", "--max_train_steps", "6")
    route = {"routes": [{"scale": 0.5, "sigma_min": 0.4, "sigma_max": 0.8}]}
    run("QwenImageNetworkTrainer", *argv, tmp_path=tmp_path, trainer=Recording(), downscale=route)
    assert len(seen) == 6 and any(d.routed for *_, d in seen) and any(d.resampled for *_, d in seen)
    for latents, batch_latents, noise, noisy, timesteps, decision in seen:
        grid = (4, 4) if decision.routed else (8, 8)
        assert latents.shape[-2:] == batch_latents.shape[-2:] == noise.shape[-2:] == grid
        assert torch.equal(timesteps, decision.sigmas.float() * 1000.0 + 1)
        sigma = decision.sigmas.float().view(-1, 1, 1, 1, 1)
        assert torch.equal(noisy, (1 - sigma) * latents + sigma * noise)
    small_noise = torch.cat([n.flatten() for *_, n, _, _, d in seen if d.routed])
    assert abs(float(small_noise.std()) - 1.0) < 0.35  # unit-variance noise, not a downsampled one (std 1/2 at ratio 0.5)


def test_wan22_routed_steps_run_the_expert_of_their_own_sigma(tmp_path):
    """A route above the boundary: every routed step must run the high-noise expert (the flag set from the replayed σ)."""
    argv = ["--task", "t2v-A14B", "--dit_high_noise", "high.safetensors", "--buckets", "64x64x5", "--seed", "9", "--max_train_steps", "12"]
    trainer = run(
        "WanNetworkTrainer",
        *argv,
        "--timestep_sampling",
        "uniform",
        tmp_path=tmp_path,
        downscale={"routes": [{"scale": 0.5, "sigma_min": 0.9}]},
    )
    calls = trainer.last_transformer.calls
    routed = [c["tokens"][1] == 2 * 16 for c in calls]
    high = [bool(t[0] / 1000.0 >= 0.875) for t in (c["t"] for c in calls)]
    assert any(routed) and not all(routed)
    assert trainer.experts == high  # every forward ran the expert its own timestep names
    assert all(h for r, h in zip(routed, high, strict=True) if r)


def _family(name: str, *argv: str):
    trainer = getattr(trainers(), name)()
    args = parse(*argv)
    trainer.handle_model_specific_args(args)
    trainer.load_transformer(None, args, None, None, None, None, None)
    trainer.num_timestep_buckets = args.num_timestep_buckets
    from musubi_trainer_base import FlowMatchDiscreteScheduler

    return trainer, args, MusubiFamily(trainer, BY_ARCH["wan" if name.startswith("Wan") else "qwen_image"]), FlowMatchDiscreteScheduler()


@pytest.mark.parametrize(
    ("argv", "use_law"),
    [
        (["--timestep_sampling", "shift", "--discrete_flow_shift", "3", "--min_timestep", "100"], True),
        (["--timestep_sampling", "sigmoid", "--num_timestep_buckets", "4"], False),
    ],
    ids=["law", "buckets"],
)
def test_every_samples_sigma_keeps_the_hosts_marginal(argv, use_law):
    """Coupled gate, B = 4, a window holding ~10 % of the host's mass: each batch position's σ over the steps
    against the host's own sampler (its exact law, or 40 000 of its own draws), and the routed-step rate."""
    trainer, args, family, scheduler = _family("WanNetworkTrainer", *argv)
    latents = torch.zeros(4, 4, 2, 8, 8)
    lo = 0.85
    router = Router.from_config(load_config(table={"routes": [{"scale": 0.5, "sigma_min": lo}]}), "wan", seed=1, total_forwards=0)
    torch.manual_seed(0)
    positions, routed = [], 0
    steps = 1500
    for step in range(1, steps + 1):
        timesteps = torch.rand(4, dtype=torch.float64).tolist() if args.num_timestep_buckets else None
        bound = family.bind(args, scheduler, latents, "cpu", torch.float32, timesteps=timesteps)
        assert (bound.law is not None) is use_law
        decision = router.route(bound.draw, 4, (8, 8), step, first=bound.first, law=bound.law)
        positions.append(decision.sigmas.double())
        routed += decision.routed
        trainer.get_noisy_model_input_and_timesteps(
            args, latents, latents, timesteps, scheduler, "cpu", torch.float32
        )  # the host's own draw
    sigmas = torch.stack(positions)
    if use_law:
        law = flow_law(args, (8, 8))
        reference = np.vectorize(law.cdf)
        mass = 1.0 - law.cdf(lo)
    else:
        torch.manual_seed(1)
        host = torch.cat([family.bind(args, scheduler, latents, "cpu", torch.float32).draw(4000) for _ in range(10)]).numpy()
        reference = host
        mass = float((host > lo).mean())
    for b in range(4):
        assert stats.kstest(sigmas[:, b].numpy(), reference).pvalue > 1e-3
    assert stats.binomtest(routed, steps, mass).pvalue > 1e-3
    assert bool(((sigmas > lo).all(1) | (sigmas <= lo).all(1)).all())  # a step's σ share its category


def test_the_grid_law_is_the_hosts_scheduler_draw():
    trainer, args, family, scheduler = _family("QwenImageNetworkTrainer", "--weighting_scheme", "logit_normal", "--max_timestep", "900")
    law = grid_law(args, scheduler, torch.bfloat16)
    torch.manual_seed(3)
    _, t = trainer.get_noisy_model_input_and_timesteps(
        args, torch.ones(20000, 1, 1, 1), torch.zeros(20000, 1, 1, 1), None, scheduler, "cpu", torch.bfloat16
    )
    counts = torch.bincount((1000 - t).long(), minlength=1000).double()[:900]  # timestep 1000 − k is atom k
    expected = law.probs * t.numel()
    assert float(law.probs.sum()) == pytest.approx(1.0) and law.values.numel() == 900
    assert stats.chisquare(counts.view(30, 30).sum(1), expected.view(30, 30).sum(1)).pvalue > 1e-4  # 30 atoms a cell


@pytest.mark.parametrize(
    ("name", "argv", "downscale", "message"),
    [
        ("FramePackNetworkTrainer", [], ALL_ROUTED, "FramePack"),
        ("WanNetworkTrainer", ["--task", "i2v-14B"], ALL_ROUTED, "image-to-video"),
        ("WanNetworkTrainer", ["--task", "t2v-A14B", "--dit_high_noise", "h", "--batch_size", "2"], ALL_ROUTED, "one expert's side"),
        ("QwenImageNetworkTrainer", [], {"mode": "map", "map_out": "m", "map_reenc": True}, r"map_reenc: the VAE arms are not supported"),
        ("QwenImageNetworkTrainer", [], {**ALL_ROUTED, "positions": "interpolate"}, "positions: 'interpolate' is not available"),
        ("QwenImageNetworkTrainer", [], {**ALL_ROUTED, "arch": "wan"}, "the config says 'wan'"),
    ],
)
def test_runs_the_plugin_would_mis_train_are_refused_at_start(name, argv, downscale, message, tmp_path):
    trainer = getattr(trainers(), name)()
    with pytest.raises(HostError, match=message):
        run(name, *argv, tmp_path=tmp_path, trainer=trainer, downscale=downscale)
    assert trainer.last_transformer is not None and not trainer.losses  # refused before any step


def test_an_edit_run_and_a_control_dataset_are_refused(tmp_path):
    class Edit(trainers().QwenImageNetworkTrainer):
        def handle_model_specific_args(self, args):
            super().handle_model_specific_args(args)
            self.is_edit = True

    with pytest.raises(HostError, match="Edit"):
        run("QwenImageNetworkTrainer", tmp_path=tmp_path, trainer=Edit(), downscale=ALL_ROUTED)


def test_a_changed_hook_point_is_refused(tmp_path):
    class Overrides(trainers().QwenImageNetworkTrainer):
        def process_batch(self, *args):
            return super().process_batch(*args)

    class Renamed(trainers().QwenImageNetworkTrainer):
        def get_noisy_model_input_and_timesteps(self, args, noise, latents, timesteps, noise_scheduler, device, dtype, extra=None):
            return super().get_noisy_model_input_and_timesteps(args, noise, latents, timesteps, noise_scheduler, device, dtype)

    with pytest.raises(HostError, match="overrides process_batch"):
        run("QwenImageNetworkTrainer", tmp_path=tmp_path, trainer=Overrides(), downscale=ALL_ROUTED)
    with pytest.raises(HostError, match="changed the hook point"):
        run("QwenImageNetworkTrainer", tmp_path=tmp_path, trainer=Renamed(), downscale=ALL_ROUTED)


def test_a_bad_config_is_refused_when_the_network_is_built(tmp_path):
    trainer = trainers().QwenImageNetworkTrainer()
    with pytest.raises(ConfigError, match="ds_gate"):
        run(
            "QwenImageNetworkTrainer",
            tmp_path=tmp_path,
            trainer=trainer,
            network_args=("inner=musubi_lora", "ds_gate=sometimes"),
            downscale=ALL_ROUTED,
        )
    assert trainer.last_network is None


def test_the_inner_module_is_detected_from_the_dit(tmp_path, monkeypatch):
    import musubi_lora

    monkeypatch.setitem(sys.modules, "networks.lora_qwen_image", musubi_lora)
    trainer = run("QwenImageNetworkTrainer", tmp_path=tmp_path, network_args=(), downscale=NEVER)
    assert trainer.last_network.downscale_run.inner == "networks.lora_qwen_image"
    assert trainer.last_network.prepared_with is None  # the inner module has no module-level prepare_network: not called, as in the host


def test_plugin_off_is_the_inner_network(tmp_path):
    plain, plugin = plain_and_plugin("QwenImageNetworkTrainer", ["--seed", "1"], tmp_path, {**ALL_ROUTED, "enable": False})
    assert plugin.losses == plain.losses and not hasattr(plugin.last_network, "downscale_run")


def test_the_flop_model_counts_every_latent_frame_and_the_banner_plans_the_run(tmp_path, caplog):
    """Wan 64×64, 5 pixel frames = 2 latent frames: the run's FLOP saving is the model's at 2 × the tokens of a
    frame (attention is over all frames at once), which the per-frame model underestimates; the banner has the plan."""
    from downscale_plugin.flops import arch_flops

    with caplog.at_level("INFO", logger="downscale_plugin"):
        trainer = run("WanNetworkTrainer", *ARCHS["wan"][1], "--seed", "3", tmp_path=tmp_path, downscale=ALL_ROUTED)
    model = arch_flops("wan", lora_rank=4)  # the per-block Wan model at the run's rank (no --network_dim: musubi's default 4)
    totals = trainer.last_network.downscale_run.totals
    assert totals.flop_saving() == pytest.approx(1 - model.flops(2 * 4) / model.flops(2 * 16))  # 16 tokens a frame, 4 routed
    assert totals.flop_saving() > 1 - model.flops(4) / model.flops(16)
    banner = next(r.getMessage() for r in caplog.records if "WanNetworkTrainer" in r.getMessage())
    assert "latent frames 2 per bucket" in banner and "fires" in banner and "timestep_sampling=shift" in banner


def test_the_counts_survive_save_state_and_resume(tmp_path):
    """``--save_state`` writes the plugin's counts beside the host's state, ``--resume`` restores them: the resumed
    run's saved LoRA counts both runs' forwards (musubi-tuner restarts global_step, the plugin's forward index too)."""
    first = run("QwenImageNetworkTrainer", "--seed", "2", "--save_state", tmp_path=tmp_path / "a", downscale=ALL_ROUTED)
    assert first.last_network.downscale_run.totals.total_steps == 4
    second = run(
        "QwenImageNetworkTrainer",
        "--seed",
        "2",
        "--resume",
        str(tmp_path / "a" / "last-state"),
        tmp_path=tmp_path / "b",
        downscale=ALL_ROUTED,
    )
    assert second.last_network.downscale_run.hook.step == 4
    _, meta = saved(tmp_path / "b")
    assert json.loads(meta["ss_downscale_counts"])["forwards"] == 8


def test_a_resumed_run_routes_on_where_the_saved_run_stopped(tmp_path):
    """Coupled at batch size 2 with an exact law: a step's route is a function of (seed, absolute forward index);
    the resumed run's forwards 1–4 are absolute 5–8, so they route as the uninterrupted run's 5–8."""
    routes = []

    class Recording(trainers().QwenImageNetworkTrainer):
        def call_dit(self, *args, **kwargs):
            routes.append(self.last_network.downscale_run.hook.last.rule_index)
            return super().call_dit(*args, **kwargs)

    argv = ("--seed", "2", "--batch_size", "2", "--timestep_sampling", "sigmoid")
    half = {"routes": [{"scale": 0.5, "sigma_min": 0.5}]}
    run("QwenImageNetworkTrainer", *argv, "--max_train_steps", "8", tmp_path=tmp_path / "whole", trainer=Recording(), downscale=half)
    whole, routes[:] = list(routes), []
    run("QwenImageNetworkTrainer", *argv, "--save_state", tmp_path=tmp_path / "a", trainer=Recording(), downscale=half)
    resumed = run(
        "QwenImageNetworkTrainer", *argv, "--resume", str(tmp_path / "a" / "last-state"),
        tmp_path=tmp_path / "b", trainer=Recording(), downscale=half,
    )  # fmt: skip
    assert resumed.last_network.downscale_run.router.resume_offset == 4
    assert routes == whole and len(set(whole)) == 2


def test_a_resumed_run_over_another_total_warns_that_its_spans_move(tmp_path, caplog):
    """The counts file records the saving run's T: a resumed run whose T differs (--max_train_epochs on another number
    of processes gives another max_train_steps; here given) warns that its early/late spans end elsewhere."""
    early = {"routes": [{"scale": 0.5, "sigma_min": 0.0, "span": "early:0.5"}]}
    run("QwenImageNetworkTrainer", "--seed", "2", "--save_state", tmp_path=tmp_path / "a", downscale=early)
    state = str(tmp_path / "a" / "last-state")
    with caplog.at_level("WARNING", logger="downscale_plugin"):
        run("QwenImageNetworkTrainer", "--seed", "2", "--resume", state, tmp_path=tmp_path / "b", downscale=early)
        assert "spans" not in caplog.text  # the same T
        run("QwenImageNetworkTrainer", "--seed", "2", "--resume", state, "--max_train_steps", "8", tmp_path=tmp_path / "c", downscale=early)
    assert "counted its early/late spans (x0.5) over T = 4 train forwards per process, this run over T = 8" in caplog.text


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (("--compile", "--compile_cache_size_limit", "2"), "3 grid shapes in all"),
        (("--compile", "--compile_dynamic", "false"), "within torch._dynamo.config.cache_size_limit = 8"),
        (("--compile", "--compile_dynamic", "true"), None),  # dynamic shapes: nothing to recompile per grid
        ((), None),
    ],
)
def test_compile_warns_with_the_grids_the_routes_add(tmp_path, caplog, argv, expected):
    """Buckets 64² and 128² (latent 8² and 16²) at ratio 0.5: the routes run 4² and 8², and 8² is a bucket's own grid,
    so they add one shape to two; the warning names it, the total and dynamo's limit (given, or torch's own)."""
    with caplog.at_level("WARNING", logger="downscale_plugin"):
        run("QwenImageNetworkTrainer", "--buckets", "64x64", "128x128", *argv, tmp_path=tmp_path, downscale=ALL_ROUTED)
    warned = [r.getMessage() for r in caplog.records if "--compile" in r.getMessage()]
    if expected is None:
        assert not warned
        return
    assert len(warned) == 1 and expected in warned[0], warned
    assert "the routes add 1 latent grid(s) (4x4) to the buckets' 2" in warned[0]
    if "2" in argv:
        assert "more than --compile_cache_size_limit = 2: past it dynamo runs the blocks eagerly" in warned[0]


def test_an_in_run_measurement_adds_every_measured_ratios_grid():
    """``mode = "map"`` / ``"auto"`` draw at each ``map_ratios`` grid of every bucket before any route exists."""
    from downscale_plugin.hosts.musubi.buckets import MusubiBuckets
    from downscale_plugin.hosts.musubi.compile import routed_grids

    cfg = load_config(table={"mode": "map", "map_out": "out", "map_ratios": [0.75, 0.5]})
    buckets = MusubiBuckets([(8, 8), (16, 16)], [1.0, 1.0], 1, [1.0, 1.0])
    assert routed_grids(cfg, "qwen_image", buckets, measured=True) == [(4, 4), (6, 6), (12, 12)]  # 8² is a bucket's own
    assert routed_grids(cfg, "qwen_image", buckets, measured=False) == []


def test_the_resumed_forwards_divide_by_the_processes_that_saved_the_counts(tmp_path, caplog):
    """The counts are sums over the saving run's processes: forwards per rank divide by that number, not this run's
    (saved on 1, resumed on 2: 6 forwards, not 3); a file from an older plugin, without it, is read as this run's
    number, with a warning when that is more than one (tests/test_musubi_ranks.py resumes a two-rank state on one)."""
    from downscale_plugin.hosts.kohya.run import COUNTS_FILE
    from downscale_plugin.hosts.musubi.start import ResumedForwards

    def resumed(payload: dict) -> int:
        (tmp_path / COUNTS_FILE).write_text(json.dumps({"counts": {"steps": [2, 4]}, **payload}))
        forwards = ResumedForwards(world_size=2)
        forwards.load(None, str(tmp_path))
        return forwards.forwards

    with caplog.at_level("WARNING", logger="downscale_plugin"):
        assert resumed({"processes": 1}) == 6 and not caplog.records
        assert resumed({}) == 3
    assert "does not say how many processes saved it" in caplog.text


def test_the_startup_check_reads_a_musubi_command_line():
    """The kohya conventions are musubi-tuner's too: a bad key stops the script before any model loads."""
    from downscale_plugin.hosts.kohya.conventions import startup_report

    script = "src/musubi_tuner/wan_train_network.py"
    config = str(Path(__file__).parent.parent / "example_configs" / "musubi_wan22_high_noise.toml")
    assert startup_report([script, "--config_file", config]) is None
    report = startup_report([script, "--config_file", config, "--network_args", "ds_gate=sometimes"])
    assert "ds_gate: 'sometimes' is not allowed" in report


def test_base_weights_are_merged_through_the_runs_inner_module(tmp_path, monkeypatch):
    """musubi-tuner merges ``--base_weights`` with ``create_arch_network_from_weights(…, for_inference=True)`` and no
    network_args: the plugin builds that network with the run's own ``inner=`` and returns the inner's object."""
    import musubi_lora

    made = []
    monkeypatch.setattr(
        musubi_lora, "create_arch_network_from_weights", lambda *a, **kw: made.append(kw) or musubi_lora.LoRANetwork(kw["unet"], 4, 1.0)
    )
    first = run("QwenImageNetworkTrainer", "--seed", "1", tmp_path=tmp_path / "a", downscale=NEVER)
    assert first.losses
    run(
        "QwenImageNetworkTrainer",
        "--seed",
        "1",
        "--base_weights",
        str(tmp_path / "a" / "last.safetensors"),
        tmp_path=tmp_path / "b",
        downscale=NEVER,
    )
    assert len(made) == 1 and made[0]["for_inference"] is True


def test_a_batch_with_conditioning_latents_is_refused_before_its_step(tmp_path):
    """HunyuanVideo 1.5 concatenates ``latents_image`` whenever the cache has it, also when training t2v."""
    trainer = trainers().HunyuanVideo15NetworkTrainer()
    trainer.image_latents = True
    with pytest.raises(HostError, match="the batch carries latents_image"):
        run("HunyuanVideo15NetworkTrainer", "--buckets", "128x128x5", tmp_path=tmp_path, trainer=trainer, downscale=ALL_ROUTED)
    assert not trainer.last_transformer.calls


def test_bucket_frames_come_from_the_items_not_the_key():
    """Wan's image datasets key their buckets (W, H, latent window size), its video datasets (W, H, frames)."""
    from types import SimpleNamespace

    from downscale_plugin.hosts.musubi.buckets import musubi_buckets

    image, video = SimpleNamespace(frame_count=None), SimpleNamespace(frame_count=81)
    manager = SimpleNamespace(buckets={(832, 480, 9): [image] * 4, (640, 640, 81): [video] * 2, (512, 512, 9): []})
    found = musubi_buckets(SimpleNamespace(datasets=[SimpleNamespace(batch_manager=manager, batch_size=2)]), 8, frame_stride=4)
    assert found.latent_buckets == [(60, 104), (80, 80)] and found.weights == [2.0, 1.0] and found.frames == [1.0, 21.0]
