"""FasterDiT's options inside musubi-tuner's trainers, on the doubles (``tests/doubles/musubi_*.py``; CI, no musubi-tuner).

The sd-scripts counterpart is ``tests/test_fasterdit_hook.py``. Direction loss: λ = 0 (and ``keep``) is bitwise the
plain plugin run; λ > 0 adds exactly λ·mean over positions of (1 − cos over channels) of the step's prediction and
target to the host's loss, under the host's ``weighting_scheme``, and reaches the gradient;
``direction_loss_only_routed`` limits it to routed steps. σ policies: a routed step replays the policy's map of the
drawn σ (the flow branch at the host's rounding, the scheduler grid at its nearest atom), the window gate read the
drawn σ and the accounting keeps both. What the host cannot do is refused at start, naming the key.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_musubi_doubles import ARCHS, doubles, run, saved, trainers  # noqa: F401  # the doubles fixture

from downscale_plugin.config import SIGMA_POLICIES, load_config
from downscale_plugin.fasterdit.policies import shift_sigma
from downscale_plugin.grid import area_downsample
from downscale_plugin.hosts.kohya.run import DownscaleRun
from downscale_plugin.hosts.musubi.facts import HostError
from downscale_plugin.hosts.musubi.hook import direction_loss_scope
from downscale_plugin.hosts.musubi.start import refuse_unsupported

UPPER = {"routes": [{"scale": 0.5, "sigma_min": 0.7, "sigma_max": 0.97}]}  # some steps routed (8x8 → 4x4 latents), some native
# The tiny video DiTs' time input is the 1000-scale timestep: a small learning rate keeps their losses finite.
LR = ("--learning_rate", "1e-7")
# Their MSE is then ~1e4 to 1e5: a λ whose term still shows at the tests' relative tolerance (1e-6) on every arch.
LAMBDA = 50.0
HOST_MSE = F.mse_loss


def recording(name: str):
    """The arch's trainer class, recording each step's scale-shifted latents and what ``call_dit`` returned."""

    class Recording(getattr(trainers(), name)):
        def scale_shift_latents(self, latents):
            out = super().scale_shift_latents(latents)
            self.native.append(out.detach().clone())
            return out

        def call_dit(self, args, accelerator, transformer, latents, batch, noise, noisy_model_input, timesteps, network_dtype, **kw):
            out = super().call_dit(args, accelerator, transformer, latents, batch, noise, noisy_model_input, timesteps, network_dtype, **kw)
            self.outputs.append((out.pred.detach().clone(), out.target.detach().clone(), timesteps.detach().clone()))
            return out

    trainer = Recording()
    trainer.native, trainer.outputs = [], []
    return trainer


def one_minus_cos(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per sample and position, 1 − cos over the channels (dim 1), by hand: (B, *S)."""
    p, t = pred.double(), target.double()
    return 1.0 - (p * t).sum(1) / (p.pow(2).sum(1).sqrt() * t.pow(2).sum(1).sqrt())


def routed_steps(trainer) -> list[bool]:
    """Per forward, whether it ran below the native token count of its latents (the tiny DiTs record every forward's tokens)."""
    native = {"wan": 2 * 8 * 8, "hunyuan_video": 3 * 8 * 8, "hunyuan_video_1_5": 2 * 8 * 8, "qwen_image": 4 * 4, "flux_2": 8 * 8}
    tokens = native.get(trainer.last_network.downscale_run.arch, 8 * 8)  # Z-Image: 8 × 8 latents, one token each
    return [c["tokens"][1] < tokens for c in trainer.last_transformer.calls]


@pytest.fixture
def steps(monkeypatch):
    """Every step the run's accounting sees: (decision, native_hw, run_hw, run_sigmas), through ``DownscaleRun.on_step``."""
    seen = []
    original = DownscaleRun.on_step

    def on_step(self, step, decision, native_hw, run_hw, run_sigmas):
        seen.append((decision, native_hw, run_hw, run_sigmas))
        return original(self, step, decision, native_hw, run_hw, run_sigmas)

    monkeypatch.setattr(DownscaleRun, "on_step", on_step)
    return seen


def same_weights(a: Path, b: Path) -> bool:
    (wa, _), (wb, _) = saved(a), saved(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("arch", ["wan", "flux_2"])
def test_zero_weight_and_keep_are_bitwise_the_plain_plugin_run(arch, tmp_path):
    name, argv = ARCHS[arch]
    argv = [*argv, "--seed", "6", "--batch_size", "2", "--max_train_steps", "6", *LR]
    explicit = {"direction_loss_weight": 0.0, "direction_loss_only_routed": True, "sigma_policy": "keep", "positions": "plain"}
    plain = run(name, *argv, tmp_path=tmp_path / "plain", downscale=UPPER)
    options = run(name, *argv, tmp_path=tmp_path / "options", downscale={**UPPER, **explicit})
    assert plain.losses == options.losses and len(plain.losses) == 6
    routed = routed_steps(options)
    assert any(routed) and not all(routed)
    calls = zip(plain.last_transformer.calls, options.last_transformer.calls, strict=True)
    assert all(a["tokens"] == b["tokens"] and torch.equal(a["t"], b["t"]) for a, b in calls)
    assert same_weights(tmp_path / "plain", tmp_path / "options")
    assert "compute_loss" not in vars(options) and F.mse_loss is HOST_MSE


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_direction_loss_adds_exactly_lambda_mean_one_minus_cos(arch, tmp_path):
    """Every step, routed (small grid) and native: the host's loss of that step's pred and target + λ·mean(1 − cos)."""
    name, argv = ARCHS[arch]
    argv = [*argv, "--seed", "2", "--batch_size", "2", "--max_train_steps", "6", *LR]
    lam = LAMBDA
    trainer = run(name, *argv, tmp_path=tmp_path / "term", trainer=recording(name), downscale={**UPPER, "direction_loss_weight": lam})
    routed = routed_steps(trainer)
    assert len(trainer.outputs) == len(trainer.losses) == 6 and any(routed) and not all(routed)
    for (pred, target, _), loss in zip(trainer.outputs, trainer.losses, strict=True):
        assert pred.shape == target.shape and pred.ndim == (5 if arch not in ("flux_2", "z_image") else 4)  # channels at dim 1
        mse = (pred.double() - target.double()).pow(2).mean()
        assert loss == pytest.approx(float(mse + lam * one_minus_cos(pred, target).mean()), rel=1e-6)
    assert "compute_loss" not in vars(trainer) and F.mse_loss is HOST_MSE  # scoped to each step's call
    run(name, *argv, tmp_path=tmp_path / "plain", downscale=UPPER)
    assert not same_weights(tmp_path / "term", tmp_path / "plain")  # the term reaches the gradient


@pytest.mark.parametrize("arch", ["wan", "flux_2"])
def test_the_direction_term_goes_through_the_hosts_weighting(arch, tmp_path):
    """``--weighting_scheme cosmap``: compute_loss multiplies the elementwise loss, term included, by the host's weighting of
    each sample's timestep (B,1,1,1,1) before the mean. On Wan's B,C,F,H,W that is λ·mean_b(w_b·mean_S(1 − cos)) on top of
    the weighted MSE; on FLUX.2's B,C,H,W the host's (B,1,1,1,1) weighting broadcasts against every sample, and the term with it."""
    from musubi_trainer_base import FlowMatchDiscreteScheduler, compute_loss_weighting_for_sd3

    name, argv = ARCHS[arch]
    argv = [*argv, "--weighting_scheme", "cosmap", "--seed", "8", "--batch_size", "2", "--max_train_steps", "4", *LR]
    lam = LAMBDA
    trainer = run(name, *argv, tmp_path=tmp_path, trainer=recording(name), downscale={**UPPER, "direction_loss_weight": lam})
    scheduler = FlowMatchDiscreteScheduler()
    for (pred, target, timesteps), loss in zip(trainer.outputs, trainer.losses, strict=True):
        w = compute_loss_weighting_for_sd3("cosmap", scheduler, timesteps, "cpu", torch.float32).double()  # (B, 1, 1, 1, 1)
        assert not torch.allclose(w, torch.ones_like(w))
        mse = (pred.double() - target.double()).pow(2)
        d = one_minus_cos(pred, target)
        if arch == "wan":
            expected = (mse * w).mean() + lam * (w.view(-1) * d.flatten(1).mean(1)).mean()
        else:
            expected = w.mean() * (mse.mean() + lam * d.mean())
        assert loss == pytest.approx(float(expected), rel=1e-6)


def test_only_routed_gates_the_term_by_the_steps_route(tmp_path):
    name, argv = ARCHS["wan"]
    argv = [*argv, "--seed", "4", "--max_train_steps", "10", "--learning_rate", "0"]  # lr 0: the three runs' steps compare

    def losses(table: dict, out: str) -> tuple[list[float], list[bool]]:
        trainer = run(name, *argv, tmp_path=tmp_path / out, downscale={**UPPER, **table})
        return trainer.losses, routed_steps(trainer)

    base, routed = losses({}, "base")
    always, _ = losses({"direction_loss_weight": 0.5}, "always")
    gated, again = losses({"direction_loss_weight": 0.5, "direction_loss_only_routed": True}, "gated")
    assert again == routed and any(routed) and not all(routed)
    for r, b, a, g in zip(routed, base, always, gated, strict=True):
        assert a > b and g == (a if r else b)


def test_the_direction_loss_alone_runs_every_step_native_with_the_term(tmp_path):
    """No routes: FasterDiT's term on its own (the config allows it when λ > 0); every step is the host's, plus the term."""
    name, argv = ARCHS["qwen_image"]
    argv = [*argv, "--seed", "3", "--batch_size", "2", "--max_train_steps", "4", "--learning_rate", "0"]
    term = run(name, *argv, tmp_path=tmp_path / "term", trainer=recording(name), downscale={"direction_loss_weight": 1.0})
    host = run(name, *argv, tmp_path=tmp_path / "host", module="musubi_lora", network_args=())
    assert not any(routed_steps(term)) and term.last_network.downscale_run.accounting.total_steps == 4
    for (pred, target, _), with_term, without in zip(term.outputs, term.losses, host.losses, strict=True):
        assert with_term == pytest.approx(without + float(one_minus_cos(pred, target).mean()), rel=1e-6)


@pytest.mark.parametrize("policy", SIGMA_POLICIES)
@pytest.mark.parametrize("arch", ["wan", "z_image"])
def test_a_routed_step_replays_the_policys_map_of_the_drawn_sigma(arch, policy, steps, tmp_path):
    """Wan: the flow branch (σ as the host rounds it, t = 1000·σ + 1 in float32); Z-Image: the scheduler grid (the nearest
    atom). ``snr_match``'s k is the pooled std of the run's small latents over its native ones, routed steps so far."""
    name, argv = ARCHS[arch]
    extra = ["--timestep_sampling", "uniform"] if arch == "wan" else []
    fresh = ("--items_per_bucket", "8")  # new latents every step: snr_match's pooled stds differ from one step's
    argv = [*argv, *extra, *fresh, "--seed", "5", "--batch_size", "2", "--max_train_steps", "8", *LR]
    lo = 0.5
    trainer = run(
        name, *argv, tmp_path=tmp_path, trainer=recording(name),
        downscale={"routes": [{"scale": 0.5, "sigma_min": lo}], "sigma_policy": policy},
    )  # fmt: skip
    from musubi_trainer_base import FlowMatchDiscreteScheduler

    grid = FlowMatchDiscreteScheduler().sigmas[:1000].double()
    calls = trainer.last_transformer.calls
    assert len(steps) == len(calls) == 8
    native_seen, small_seen = [], []
    drawn_sum = run_sum = 0.0
    below = False
    for (decision, native_hw, run_hw, run_sigmas), latents, call in zip(steps, trainer.native, calls, strict=True):
        if not decision.routed:
            assert run_sigmas is decision.sigmas
            continue
        drawn = decision.sigmas
        assert bool((drawn > lo).all())  # the window gate read the drawn σ
        small = area_downsample(latents, run_hw)
        native_seen.append(latents.flatten())
        small_seen.append(small.flatten())
        k = {
            "keep": 1.0,
            "res_shift": math.sqrt((run_hw[0] // 2) * (run_hw[1] // 2) / ((native_hw[0] // 2) * (native_hw[1] // 2))),
            "snr_match": float(torch.cat(small_seen).double().std(unbiased=False) / torch.cat(native_seen).double().std(unbiased=False)),
        }[policy]
        mapped = shift_sigma(drawn, k)
        if policy == "keep":
            assert run_sigmas is drawn
        elif arch == "wan":
            assert torch.equal(run_sigmas, mapped.float().double())  # the host's σ rounding
        else:  # the scheduler grid's atoms 1 − i/1000: the nearest one
            assert bool(((run_sigmas - mapped).abs() <= 0.0005 + 1e-6).all())
            assert bool((run_sigmas.view(-1, 1) - grid.view(1, -1)).abs().min(1).values.max() < 1e-7)
        if arch == "wan":  # the DiT's time input is the host's timesteps, t = 1000·σ + 1
            torch.testing.assert_close(call["t"], run_sigmas * 1000 + 1, atol=1e-3, rtol=0)
        else:  # Z-Image's DiT gets (1000 − t)/1000 with t = 1000·σ of the grid atom
            torch.testing.assert_close(call["t"], 1.0 - run_sigmas, atol=1e-6, rtol=0)
        if policy != "keep":
            assert bool((run_sigmas < drawn).all())  # both shifts lower σ for a smaller latent (white latents: k ≈ 1/2)
            below |= bool((run_sigmas < lo).any())
        drawn_sum += float(drawn.sum())
        run_sum += float(run_sigmas.sum())
    assert native_seen, "no routed step"
    acc = trainer.last_network.downscale_run.accounting
    assert acc.sigma_policy == policy and f"σ policy {policy}" in acc.summary_text()
    assert acc.counts.sigma_drawn == pytest.approx(drawn_sum) and acc.counts.sigma_run == pytest.approx(run_sum)
    if policy == "keep":
        assert acc.counts.sigma_run == acc.counts.sigma_drawn
    else:
        assert below  # a routed step ran below the window it was gated into
        assert acc.scalars()["downscale/sigma_run_routed_mean"] < acc.scalars()["downscale/sigma_drawn_routed_mean"]


def test_interpolated_positions_are_refused_at_start_naming_the_key(tmp_path):
    trainer = trainers().QwenImageNetworkTrainer()
    with pytest.raises(HostError, match=r"positions: 'interpolate' is not available on musubi-tuner \(allowed: 'plain'\)"):
        run("QwenImageNetworkTrainer", tmp_path=tmp_path, trainer=trainer, downscale={**UPPER, "positions": "interpolate"})
    assert trainer.last_transformer is not None and not trainer.losses  # refused before any step
    ok = {"sigma_policy": "snr_match", "direction_loss_weight": 0.5, "direction_loss_only_routed": True}
    refuse_unsupported(load_config(table={**UPPER, **ok}))  # what `check --host musubi` runs: the rest is available


def test_a_trainer_whose_compute_loss_the_term_cannot_reach_is_refused_at_start(tmp_path):
    """HiDream-O1 and Ideogram 4 override compute_loss; so does this subclass: the term would be lost or misplaced."""

    class OwnLoss(trainers().QwenImageNetworkTrainer):
        def compute_loss(self, args, output, timesteps, noise_scheduler, dit_dtype, network_dtype, global_step):
            return (output.pred - output.target).abs().mean(), {}

    trainer = OwnLoss()
    with pytest.raises(HostError, match=r"direction_loss_weight: OwnLoss overrides compute_loss"):
        run("QwenImageNetworkTrainer", tmp_path=tmp_path / "a", trainer=trainer, downscale={**UPPER, "direction_loss_weight": 0.1})
    assert not trainer.losses and "process_batch" not in vars(trainer) and "compute_loss" not in vars(trainer)
    fine = run("QwenImageNetworkTrainer", tmp_path=tmp_path / "b", trainer=OwnLoss(), downscale={**UPPER, "sigma_policy": "res_shift"})
    assert len(fine.losses) == 4  # λ = 0: its own loss is no obstacle


@pytest.mark.parametrize("calls", [0, 2])
def test_a_compute_loss_that_does_not_call_mse_loss_once_is_an_error(calls):
    class Host:
        def compute_loss(self, pred, target):
            loss = (pred - target).pow(2)
            for _ in range(calls):
                loss = F.mse_loss(pred, target, reduction="none")
            return loss.mean(), {}

    host = Host()
    pred, target = torch.randn(1, 3, 2, 2), torch.randn(1, 3, 2, 2)
    with direction_loss_scope(host, 0.5), pytest.raises(HostError, match=f"called torch.nn.functional.mse_loss {calls} times"):
        host.compute_loss(pred, target)
    assert "compute_loss" not in vars(host) and F.mse_loss is HOST_MSE
