"""The plugin inside the seven sd-scripts LoRA trainers, on the host doubles (CI; no sd-scripts).

Per architecture: a routed step gives the host small latents and the host builds noise, noisy input,
ids/masks and target at that grid; σ reaches the model exactly as the host drew it; steps that stay
native (and a plugin-off run) are bitwise the host's; validation is untouched and draws no RNG; the
sampler slot is restored when the host raises. Then the explicit call points of the sd-scripts
patch, and a two-process gloo run whose ranks route identically every step.
"""

from __future__ import annotations

import importlib
import json
import os

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import join_group, spawn_ranks
from host_modules import ARCHS, explicit_hook_class, host_modules, run_double, trainer_class
from safetensors import safe_open

from downscale_plugin.fasterdit.policies import shift_sigma
from downscale_plugin.hosts.sd_scripts import start as sd_scripts_start
from downscale_plugin.hosts.sd_scripts.facts import BY_ARCH, HostError
from downscale_plugin.sigma import ddpm_alphas_cumprod, ddpm_t_to_sigma, sigma_to_ddpm_t

ALL_ROUTED = {"routes": [{"scale": 0.5, "sigma_min": 0.0}]}  # every σ > 0: every step runs at half size
NARROW = {"routes": [{"scale": 0.5, "sigma_min": 0.5, "sigma_max": 0.8}]}  # some steps native, some routed
RES = "128,128"  # latent 16x16 (4x4 for HunyuanImage's 32x VAE); half size is valid on every architecture


pytestmark = pytest.mark.usefixtures("host_doubles", "cheap_plan")


@pytest.fixture
def decisions(monkeypatch):
    """Every router decision of the test, in order."""
    seen = []
    route = sd_scripts_start.HostRouter.route

    def spy(self, *args, **kwargs):
        seen.append(route(self, *args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(sd_scripts_start.HostRouter, "route", spy)
    return seen


@pytest.fixture
def installed(monkeypatch):
    """``installed(arch)``: the trainer's instance attributes at every step's logs, while the run's patches are
    on (the run's end takes them off)."""
    seen = []

    def install(arch):
        cls = trainer_class(arch)
        logs = cls.generate_step_logs

        def spy(self, *args, **kwargs):
            seen.append(set(vars(self)))
            return logs(self, *args, **kwargs)

        monkeypatch.setattr(cls, "generate_step_logs", spy)
        return seen

    return install


@pytest.fixture
def host_calls(monkeypatch):
    """What each trainer class's own ``get_noise_pred_and_target`` got and returned (the hook calls it)."""
    seen = []

    def install(arch):
        cls = trainer_class(arch)
        original = cls.get_noise_pred_and_target

        def spy(self, args, accelerator, noise_scheduler, latents, batch, *rest, is_train=True):
            out = original(self, args, accelerator, noise_scheduler, latents, batch, *rest, is_train=is_train)
            seen.append({"latents": tuple(latents.shape), "pred": tuple(out[0].shape), "target": tuple(out[1].shape), "is_train": is_train})
            return out

        monkeypatch.setattr(cls, "get_noise_pred_and_target", spy)
        return seen

    return install


def small_input(arch: str, batch: int) -> tuple[int, ...]:
    """The denoiser input shape of a half-size step (channels 4)."""
    return {
        "flux": (batch, 16, 16),  # packed: (8/2)·(8/2) tokens of 4·4 features
        "chroma": (batch, 16, 16),
        "anima": (batch, 4, 1, 8, 8),
        "hunyuan_image": (batch, 4, 2, 2),
    }.get(arch, (batch, 4, 8, 8))


def model_sigma(arch: str, t: torch.Tensor) -> torch.Tensor:
    """The flow σ the stand-in denoiser's time input stands for."""
    t = t.double()
    if arch == "lumina":
        return 1.0 - t  # Lumina feeds 1 − t/1000
    if arch in ("sd3", "hunyuan_image"):
        return t / 1000
    if arch in ("sd1", "sdxl"):
        return ddpm_t_to_sigma(t.long(), ddpm_alphas_cumprod()).double()
    return t  # Flux, Chroma, Anima feed t/1000


@pytest.mark.parametrize("arch", list(ARCHS))
def test_routed_step_runs_the_host_at_the_small_grid(arch, host_calls, decisions):
    calls = host_calls(arch)
    trainer = run_double(
        arch, "--resolution", RES, "--train_batch_size", "2", "--max_train_steps", "3", "--seed", "3", downscale=ALL_ROUTED
    )
    unet = trainer.last_run.unet
    assert all(d.routed for d in decisions) and len(decisions) == 3
    small = (2, 4, 2, 2) if arch == "hunyuan_image" else (2, 4, 8, 8)
    assert [c["latents"] for c in calls] == [small] * 3  # the host got small latents ...
    assert all(c["pred"] == small and c["target"] == small for c in calls)  # ... and built noise/target there
    assert [c["shape"] for c in unet.calls] == [small_input(arch, 2)] * 3
    if arch in ("flux", "chroma"):
        assert all(c["img_ids"].shape == (2, 16, 3) and c["img_ids"][..., 1].max() == 3 for c in unet.calls)
    if arch == "anima":
        assert all(c["padding_mask"] == (2, 1, 8, 8) for c in unet.calls)
    for decision, call in zip(decisions, unet.calls, strict=True):  # σ per sample, coupled redraws included
        if arch == "hunyuan_image":
            assert torch.equal(call["t"], (decision.sigmas.float() * 1000).long())
        else:
            assert torch.allclose(model_sigma(arch, call["t"]), decision.sigmas.double(), atol=1e-6)


MODES = [(arch, ()) for arch in ARCHS] + [
    ("flux", ("--timestep_sampling", "flux_shift")),  # σ depends on the native grid's token count
    ("flux", ("--timestep_sampling", "uniform")),
    ("lumina", ("--timestep_sampling", "nextdit_shift")),
    ("sd3", ("--weighting_scheme", "logit_normal")),
]


@pytest.mark.parametrize(("arch", "mode"), MODES)
def test_native_steps_are_the_host_and_routed_sigma_is_the_host_draw(arch, mode, decisions):
    for seed in range(10, 30):  # a seed whose run starts native and routes later
        decisions.clear()
        argv = ("--resolution", RES, "--max_train_steps", "8", "--seed", str(seed), *mode)
        run = run_double(arch, *argv, downscale=NARROW).last_run
        routed = [d.routed for d in decisions]
        if not routed[0] and any(routed):
            break
    k = routed.index(True)
    plain = run_double(arch, *argv, network_module=ARCHS[arch][2]).last_run
    assert run.losses[:k] == plain.losses[:k]  # bitwise: the dry run left the host's RNG untouched
    for ours, theirs in zip(run.unet.calls[: k + 1], plain.unet.calls[: k + 1], strict=True):
        assert torch.equal(ours["t"], theirs["t"])  # ... and step k runs at exactly the σ the host drew
    assert run.unet.calls[k]["shape"] == small_input(arch, 1) != plain.unet.calls[k]["shape"]


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("config", [{"enable": False, **ALL_ROUTED}, {"routes": [{"route": "2048:1024", "sigma_min": 0.0}]}])
def test_plugin_off_or_never_eligible_is_bitwise_the_host(arch, config):
    argv = ("--resolution", RES, "--train_batch_size", "2", "--max_train_steps", "4", "--seed", "5")
    plain = run_double(arch, *argv, network_module=ARCHS[arch][2]).last_run
    run = run_double(arch, *argv, downscale=config).last_run
    assert run.losses == plain.losses
    assert all(torch.equal(a["t"], b["t"]) for a, b in zip(run.unet.calls, plain.unet.calls, strict=True))
    theirs = plain.network.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in run.network.state_dict().items())


def _batch(trainer, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    side = 128 // trainer.vae_factor
    return {
        "latents": torch.randn(2, 4, side, side, generator=gen),
        "text_encoder_outputs_list": trainer.text_conds(2, gen),
        "loss_weights": torch.ones(2),
        "alpha_masks": None,
        "original_sizes_hw": torch.tensor([[128, 128]] * 2),
        "crop_top_lefts": torch.tensor([[0, 0]] * 2),
        "target_sizes_hw": torch.tensor([[128, 128]] * 2),
    }


def _process(trainer, run, batch, is_train):
    args = run.args
    scheduler = trainer.get_noise_scheduler(args, "cpu")
    return trainer.process_batch(
        batch,
        [],
        run.unet,
        run.network,
        None,
        scheduler,
        torch.float32,
        torch.float32,
        run.accelerator,
        args,
        None,
        None,
        is_train=is_train,
    )


@pytest.mark.parametrize("arch", list(ARCHS))
def test_validation_is_untouched_and_draws_no_rng(arch):
    trainer = run_double(
        arch, "--resolution", RES, "--train_batch_size", "2", "--max_train_steps", "2", "--seed", "2", downscale=ALL_ROUTED
    )
    run = trainer.last_run
    steps = run.network.downscale_run.accounting.total_steps
    plain = type(trainer)()  # the class's own methods: no plugin on this instance
    results = []
    for who in (trainer, plain):
        torch.manual_seed(7)
        loss = _process(who, run, _batch(trainer, 1), is_train=False)
        results.append((loss, torch.get_rng_state()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert run.network.downscale_run.accounting.total_steps == steps  # validation is not a train step


@pytest.mark.parametrize("arch", list(ARCHS))
def test_sampler_slot_is_restored_when_the_host_raises(arch):
    trainer = run_double(arch, "--resolution", RES, "--max_train_steps", "1", "--seed", "2", downscale=ALL_ROUTED)
    run = trainer.last_run
    module_name, contract = BY_ARCH[arch].sampler
    module = importlib.import_module(module_name)
    name = "get_timesteps" if contract == "ddpm" else "get_noisy_model_input_and_timesteps"
    original = getattr(module, name)

    def boom(*args, **kwargs):
        assert getattr(module, name) is not original  # the replay is in place during the host call
        raise RuntimeError("host failure")

    run.unet.forward = boom
    with pytest.raises(RuntimeError, match="host failure"):
        _process(trainer, run, _batch(trainer, 3), is_train=True)
    assert getattr(module, name) is original
    del run.unet.forward
    assert torch.isfinite(_process(trainer, run, _batch(trainer, 3), is_train=True))


def test_explicit_call_points_of_the_patched_host_are_used_instead_of_wrapping(installed):
    during = installed("flux")
    downscale = {**ALL_ROUTED, "direction_loss_weight": 0.5}
    trainer = run_double("flux", "--resolution", RES, "--max_train_steps", "2", downscale=downscale, trainer=explicit_hook_class("flux")())
    assert {"noise_pred_and_target_hook", "step_logs_hook"} <= during[0]
    assert "get_noise_pred_and_target" not in during[0] and "generate_step_logs" not in during[0]
    assert "process_batch" in during[0]  # the patch has no call point around the loss: the direction loss wraps it
    assert [c["shape"] for c in trainer.last_run.unet.calls] == [small_input("flux", 1)] * 2
    records = trainer.last_run.accelerator.trackers[0].records
    assert records[-1][1]["downscale/steps"] == 2.0


# -- FasterDiT options ------------------------------------------------------------------------

FASTERDIT = ("ds_sigma_policy=res_shift", "ds_positions=interpolate")


def test_fasterdit_keys_reach_the_flux_step_through_network_args(decisions, installed):
    during = installed("flux")
    argv = ("--resolution", RES, "--train_batch_size", "2", "--max_train_steps", "2", "--seed", "3")
    trainer = run_double("flux", *argv, "--network_args", "ds_direction_loss_weight=0.5", *FASTERDIT, downscale=ALL_ROUTED)
    run, state = trainer.last_run, trainer.last_run.network.downscale_run
    assert (state.cfg.fasterdit.direction_loss_weight, state.cfg.fasterdit.sigma_policy, state.cfg.fasterdit.positions) == (
        0.5,
        "res_shift",
        "interpolate",
    )
    assert all("process_batch" in attributes for attributes in during)
    assert len(decisions) == len(run.unet.calls) == 2
    for decision, call in zip(decisions, run.unet.calls, strict=True):  # 16 of 64 tokens: k = √(16/64)
        torch.testing.assert_close(call["t"].double(), shift_sigma(decision.sigmas.double(), 0.5), atol=1e-6, rtol=0)
        assert sorted(set(call["img_ids"][..., 1].flatten().tolist())) == [0.0, 2.0, 4.0, 6.0]  # 4 rows at the native pitch
    assert state.accounting.counts.sigma_run < state.accounting.counts.sigma_drawn
    meta = json.loads(state.metadata()["ss_downscale_fasterdit"])
    assert meta == {
        "direction_loss_weight": 0.5,
        "direction_loss_only_routed": False,
        "sigma_policy": "res_shift",
        "positions": "interpolate",
        "attention": "plain",
    }
    during.clear()
    without = run_double("flux", *argv, "--network_args", *FASTERDIT, downscale=ALL_ROUTED)
    assert during and not any("process_batch" in attributes for attributes in during)
    assert run.losses[0] > without.last_run.losses[0]  # step 1: same σ, noise and weights, plus λ·mean(1 − cos)


@pytest.mark.parametrize("arch", ["sd3", "lumina", "anima", "hunyuan_image", "sdxl"])
def test_res_shift_sigma_reaches_the_model_in_every_sampler_family(arch, decisions):
    argv = ("--resolution", RES, "--max_train_steps", "3", "--seed", "3", "--network_args", "ds_sigma_policy=res_shift")
    run = run_double(arch, *argv, downscale=ALL_ROUTED).last_run
    alphas = ddpm_alphas_cumprod()
    for decision, call in zip(decisions, run.unet.calls, strict=True):
        expected = shift_sigma(decision.sigmas.double(), 0.5)  # half the side: a quarter of the tokens on every arch
        if arch == "sdxl":  # integer DDPM timesteps: the nearest one
            expected = ddpm_t_to_sigma(sigma_to_ddpm_t(expected, alphas), alphas).double()
        atol = 1e-3 if arch == "hunyuan_image" else 1e-6  # HunyuanImage feeds integer t/1000
        torch.testing.assert_close(model_sigma(arch, call["t"]), expected, atol=atol, rtol=0)
        assert (expected < decision.sigmas.double()).all()


def test_direction_loss_alone_needs_no_routes_and_leaves_sigma_alone():
    argv = ("--resolution", RES, "--max_train_steps", "3", "--seed", "5")
    plain = run_double("flux", *argv, network_module=ARCHS["flux"][2]).last_run
    run = run_double("flux", *argv, downscale={"direction_loss_weight": 0.5}).last_run
    assert run.losses[0] > plain.losses[0]
    assert all(torch.equal(a["t"], b["t"]) and a["shape"] == b["shape"] for a, b in zip(run.unet.calls, plain.unet.calls, strict=True))
    assert run.network.downscale_run.accounting.demote_fraction() == 0.0


def test_positions_interpolate_is_refused_where_there_are_no_position_ids():
    with pytest.raises(HostError, match="positions: 'interpolate' is not available for sd3"):
        run_double("sd3", "--resolution", RES, "--network_args", "ds_positions=interpolate", downscale=ALL_ROUTED)


# -- two processes, gloo ------------------------------------------------------------------------


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    join_group(rank, world, port)
    try:
        with host_modules():
            # Each rank: its own seed (as an unseeded sd-scripts run draws per process) and its own data.
            trainer = run_double(
                "flux",
                *("--resolution", RES, "--train_batch_size", "2", "--max_train_steps", "50", "--dataset_size", "8"),
                *("--seed", str(100 + rank), "--data_seed", str(7 + rank), "--output_dir", os.path.join(out_dir, f"rank{rank}")),
                downscale={"routes": [{"scale": 0.5, "sigma_min": 0.55, "sigma_max": 0.9}]},
            )
            run = trainer.last_run
            state = run.network.downscale_run
            torch.save(
                {
                    "shapes": [c["shape"] for c in run.unet.calls],
                    "t": [c["t"] for c in run.unet.calls],
                    "local": state.accounting.total_steps,
                    "total": state.totals.total_steps,
                    "resampled": (state.accounting.counts.resampled, state.totals.counts.resampled),
                    "tracked": [r[1] for r in run.accelerator.trackers[0].records] if run.accelerator.trackers else None,
                },
                os.path.join(out_dir, f"rank{rank}.pt"),
            )
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_route_identically_every_step(tmp_path):
    spawn_ranks(_rank_main, 2, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert len(r0["shapes"]) == 50 and r0["shapes"] == r1["shapes"]  # the same grid on both ranks, every step
    assert {s[1] for s in r0["shapes"]} == {64, 16}  # both routes happened (native 8x8 packed tokens, routed 4x4)
    assert not all(torch.equal(a, b) for a, b in zip(r0["t"], r1["t"], strict=True))  # per-sample σ stay per rank
    assert r0["local"] == r1["local"] == 50 and r0["total"] == r1["total"] == 100  # counts summed over ranks
    assert r0["resampled"][1] == r1["resampled"][1] == r0["resampled"][0] + r1["resampled"][0]
    assert r1["tracked"] is None and r0["tracked"][-1]["downscale/steps"] == 100.0  # only the main process logs
    assert os.listdir(tmp_path / "rank0") and not (tmp_path / "rank1").exists()  # ... and saves


def _resume_rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """Two ranks: a run that saves its state at step 4 (main process), then both ranks resume from it."""
    join_group(rank, world, port)
    try:
        with host_modules():
            common = ("--resolution", RES, "--train_batch_size", "2", "--max_train_steps", "8", "--dataset_size", "16")
            mine = ("--seed", str(100 + rank), "--data_seed", str(7 + rank))
            downscale = {"routes": [{"scale": 0.5, "sigma_min": 0.55, "span": "spread:0.5"}]}
            first = os.path.join(out_dir, f"first{rank}")
            run_double("flux", *common, *mine, "--save_state", "--save_every_n_steps", "4", "--output_dir", first, downscale=downscale)
            dist.barrier()
            state = os.path.join(out_dir, "first0", "last-step00000004-state")  # the main process saved it
            resumed = os.path.join(out_dir, f"resumed{rank}")
            argv = ("--resume", state, "--skip_until_initial_step", "--output_dir", resumed)
            downscale_run = run_double("flux", *common, *mine, *argv, downscale=downscale).last_run.network.downscale_run
            torch.save(
                {
                    "offset": downscale_run.router.resume_offset,
                    "local": downscale_run.accounting.total_steps,
                    "total": downscale_run.totals.total_steps,
                },
                os.path.join(out_dir, f"rank{rank}.pt"),
            )
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_resume_with_the_whole_runs_counts(tmp_path):
    """The main process saves the cross-rank totals with its state; on resume only it adds them back, so the
    totals (and ``ss_downscale_counts``) are the whole run's on every rank, not doubled."""
    spawn_ranks(_resume_rank_main, 2, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["offset"] == r1["offset"] == 4  # step 4 × accumulation 1
    assert r0["local"] == 4 + 8 and r1["local"] == 4  # rank 0 carries the saved totals (4 forwards × 2 ranks)
    assert r0["total"] == r1["total"] == 16
    with safe_open(str(tmp_path / "resumed0" / "last.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["ss_downscale_counts"])["forwards"] == 16
    assert not (tmp_path / "resumed1").exists()
