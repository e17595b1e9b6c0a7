"""FasterDiT options wired through the hook, on the lab trainer (the sd-scripts contract, no host needed).

Direction loss: λ = 0 wraps nothing (losses and adapters bitwise), λ > 0 adds exactly λ·mean(1 − cos)
per sample to train calls only, and ``direction_loss_only_routed`` limits it to routed steps. σ
policies: the host receives the mapped σ, the accounting keeps both. Positions: the routed forward
sees ids spanning the native extent, restored afterwards.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from downscale_plugin.arch import get_arch
from downscale_plugin.config import SIGMA_POLICIES, FasterDitConfig, load_config
from downscale_plugin.fasterdit.policies import shift_sigma
from downscale_plugin.flops import FlopModel
from downscale_plugin.grid import area_downsample
from downscale_plugin.hosts.lab.adapter import LabPlugin
from downscale_plugin.hosts.sd_scripts.hook import DownscaleHook, StepOptions
from downscale_plugin.lab import flux_utils
from downscale_plugin.lab import trainer as lab_trainer
from downscale_plugin.lab.data import LabData, LabDataConfig
from downscale_plugin.lab.model import LabModelConfig, LabTextEncoder, build_model
from downscale_plugin.lab.trainer import LabAccelerator, LabTrainer, lab_args, make_noise_scheduler, train_lora
from downscale_plugin.scope import Patches

TINY = LabModelConfig(hidden_size=32, num_heads=2, double_layers=1, single_layers=1, latent_channels=4,
                      text_tokens=4, text_dim=16, pooled_dim=8)  # fmt: skip
ALL_ROUTED = {"scale": 0.5, "sigma_min": 0.0}  # 16x16 latents (8x8 tokens) run at 8x8 (4x4 tokens)
UPPER = {"scale": 0.5, "sigma_min": 0.7}  # some steps routed, some native


@pytest.fixture(scope="module")
def data() -> LabData:
    return LabData(LabDataConfig(buckets=((64, 64),), latent_channels=TINY.latent_channels))


@pytest.fixture(scope="module")
def model():
    return build_model(TINY, seed=0)


class Spy(torch.nn.Module):
    """The denoiser, recording the keyword inputs of every forward."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.calls: list[dict] = []

    def forward(self, **kwargs):
        self.calls.append({k: v.detach().clone() for k, v in kwargs.items() if torch.is_tensor(v)})
        return self.model(**kwargs)


def plugin_for(table: dict, data: LabData, batch_size: int = 1) -> LabPlugin:
    return LabPlugin.for_lab(load_config(table=table), TINY, data, batch_size)


def process(trainer: LabTrainer, unet, batch: dict, args, is_train: bool = True) -> torch.Tensor:
    return trainer.process_batch(
        batch, LabTextEncoder(TINY), unet, None, make_noise_scheduler(args), torch.float32, LabAccelerator(), args, is_train=is_train
    )


def test_lab_loss_is_the_module_conditional_loss_and_unchanged(monkeypatch, model, data):
    args, batch = lab_args(), data.batch(0, 2, seed=0)
    torch.manual_seed(1)
    loss = process(LabTrainer(), model, batch, args)
    torch.manual_seed(1)
    pred, target, _, weighting = LabTrainer().get_noise_pred_and_target(
        args, LabAccelerator(), make_noise_scheduler(args), batch["latents"], batch,
        LabTextEncoder(TINY).encode(batch["class_ids"]), model, None, torch.float32, True,
    )  # fmt: skip
    assert weighting is None
    before = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=[1, 2, 3]) * batch["loss_weights"]
    assert torch.equal(loss, before.mean())  # the pre-refactor formula, bit for bit
    seen = []
    original = lab_trainer.conditional_loss
    monkeypatch.setattr(lab_trainer, "conditional_loss", lambda *a, **k: seen.append(a[2:4]) or original(*a, **k))
    process(LabTrainer(), model, batch, args)
    assert seen == [("l2", "none")]  # looked up at call time with the host's signature


def test_zero_weight_wraps_nothing_and_is_bitwise(model, data):
    explicit = {"direction_loss_weight": 0.0, "direction_loss_only_routed": True, "sigma_policy": "keep", "positions": "plain"}
    runs = []
    for table in ({"routes": [UPPER]}, {"routes": [UPPER], **explicit}):
        plugin = plugin_for(table, data)
        runs.append(train_lora(model, data, steps=4, lr=1e-2, rank=2, seed=3, hook_installer=plugin.installer))
    assert runs[0].losses == runs[1].losses
    assert all(torch.equal(runs[0].deltas[k], runs[1].deltas[k]) for k in runs[0].deltas)
    trainer, original = LabTrainer(), lab_trainer.conditional_loss
    with plugin_for({"routes": [UPPER], **explicit}, data).installer(trainer, lab_args()):
        assert "process_batch" not in vars(trainer) and lab_trainer.conditional_loss is original


class KnownTrainer(LabTrainer):
    """A fixed prediction and target: half the positions orthogonal (1 − cos = 1), half aligned (0)."""

    def get_noise_pred_and_target(self, args, accelerator, noise_scheduler, latents, *rest, is_train=True):
        pred = torch.zeros_like(latents)
        pred[:, 0] = 1.0
        target = torch.zeros_like(latents)
        target[:, 1, :, 0] = 3.0  # column 0: orthogonal to pred
        target[:, 0, :, 1] = 3.0  # column 1: aligned with pred
        return pred, target, None, None


def test_direction_loss_adds_exactly_lambda_mean_one_minus_cos_to_train_calls(model):
    batch = {"latents": torch.zeros(2, 4, 2, 2), "loss_weights": torch.ones(2), "text_encoder_outputs_list": [None] * 4}
    args = lab_args(max_train_steps=1)
    plain = [process(KnownTrainer(), model, batch, args, is_train) for is_train in (True, False)]
    assert plain[0].item() == 1.75  # (2·(1 + 9) + 2·4) / 16 per sample
    trainer = KnownTrainer()
    plugin = LabPlugin(load_config(table={"direction_loss_weight": 0.25}), FlopModel(32, 1), [(2, 2)])
    with plugin.installer(trainer, args):  # no routes: the direction loss alone
        assert "process_batch" in vars(trainer)
        train, val = (process(trainer, model, batch, args, is_train) for is_train in (True, False))
    assert train.item() == 1.75 + 0.25 * 0.5  # λ · mean over positions of (1 − cos)
    assert torch.equal(val, plain[1])  # validation: the host's loss
    assert "process_batch" not in vars(trainer) and lab_trainer.conditional_loss.__module__ == lab_trainer.__name__


def test_only_routed_gates_the_term_by_the_steps_route(model, data):
    def run(table):
        plugin = plugin_for({"routes": [UPPER], **table}, data)
        result = train_lora(model, data, steps=10, lr=0.0, rank=2, seed=4, hook_installer=plugin.installer)  # lr 0: comparable steps
        return result.losses, [t.rule_index >= 0 for t in plugin.trace]

    base, routed = run({})
    always, _ = run({"direction_loss_weight": 0.5})
    gated, again = run({"direction_loss_weight": 0.5, "direction_loss_only_routed": True})
    assert again == routed and any(routed) and not all(routed)
    for r, b, a, g in zip(routed, base, always, gated, strict=True):
        assert a > b and g == (a if r else b)


def test_direction_loss_alone_through_train_lora(model, data):
    plugin = plugin_for({"direction_loss_weight": 0.5}, data)
    with_term = train_lora(model, data, steps=3, lr=0.0, rank=2, seed=2, hook_installer=plugin.installer)
    native = train_lora(model, data, steps=3, lr=0.0, rank=2, seed=2)
    assert all(a > b for a, b in zip(with_term.losses, native.losses, strict=True))  # same σ and noise, plus the term
    assert plugin.accounting.total_steps == 3 and plugin.accounting.demote_fraction() == 0.0


@pytest.mark.parametrize("policy", SIGMA_POLICIES)
def test_routed_step_runs_at_the_policy_sigma_and_accounting_keeps_both(policy, model, data):
    plugin = plugin_for({"routes": [ALL_ROUTED], "sigma_policy": policy}, data, batch_size=2)
    trainer, spy, args = LabTrainer(), Spy(model), lab_args(max_train_steps=1)
    batch = data.batch(0, 2, seed=0)
    with plugin.installer(trainer, args):
        torch.manual_seed(0)
        process(trainer, spy, batch, args)
    drawn = torch.tensor(plugin.trace[-1].sigmas, dtype=torch.float64)
    native = batch["latents"].double()
    small = area_downsample(batch["latents"], (8, 8)).double()
    k = {"keep": 1.0, "res_shift": math.sqrt(16 / 64), "snr_match": (small.std(unbiased=False) / native.std(unbiased=False)).item()}[policy]
    ran = spy.calls[-1]["timesteps"].double()  # the trainer feeds σ = t/1000
    assert spy.calls[-1]["img"].shape[1] == 16  # the routed grid
    torch.testing.assert_close(ran, shift_sigma(drawn, k), atol=1e-6, rtol=0)
    acc = plugin.accounting
    assert acc.counts.sigma_drawn == pytest.approx(drawn.sum().item()) and acc.counts.sigma_run == pytest.approx(
        shift_sigma(drawn, k).sum().item()
    )
    assert f"σ policy {policy}" in acc.summary_text()
    if policy == "keep":
        assert acc.counts.sigma_run == acc.counts.sigma_drawn
        assert torch.equal(ran.float(), drawn.float())
    else:
        assert (ran < drawn).all()  # both shifts lower σ for a smaller latent
        assert acc.scalars()["downscale/sigma_run_routed_mean"] < acc.scalars()["downscale/sigma_drawn_routed_mean"]


@pytest.mark.parametrize("positions", ["plain", "interpolate"])
def test_interpolated_ids_span_the_native_extent_in_the_routed_forward_only(positions, model, data):
    plugin = plugin_for({"routes": [ALL_ROUTED], "positions": positions}, data)
    trainer, spy, args = LabTrainer(), Spy(model), lab_args(max_train_steps=1)
    original = flux_utils.prepare_img_ids
    batch = data.batch(0, 1, seed=0)
    with plugin.installer(trainer, args):
        process(trainer, spy, batch, args)
        assert flux_utils.prepare_img_ids is original  # restored right after the routed forward
        process(trainer, spy, batch, args, is_train=False)  # validation: native grid, plain ids
    routed, native = spy.calls[-2]["img_ids"], spy.calls[-1]["img_ids"]
    assert routed.shape == (1, 16, 3) and native.shape == (1, 64, 3)
    rows = sorted(set(routed[0, :, 1].tolist()))
    assert rows == ([0.0, 2.0, 4.0, 6.0] if positions == "interpolate" else [0.0, 1.0, 2.0, 3.0])
    assert sorted(set(native[0, :, 1].tolist())) == [float(i) for i in range(8)]
    if positions == "interpolate":  # the 4 small rows tile the 8 native rows: pitch 2, anchored at 0
        assert rows[-1] + 2.0 == 8.0 and sorted(set(routed[0, :, 2].tolist())) == rows


def test_step_options_reject_what_they_cannot_do():
    with pytest.raises(ValueError, match="loss_module"):
        StepOptions(FasterDitConfig(direction_loss_weight=0.1))
    with pytest.raises(ValueError, match="direction_loss_weight: -1.0 must be a finite number >= 0"):
        StepOptions(FasterDitConfig(direction_loss_weight=-1.0), loss_module=lab_trainer)
    with pytest.raises(ValueError, match=r"sigma_policy: 'shift' is not allowed \(allowed: keep, res_shift, snr_match\)"):
        StepOptions(FasterDitConfig(sigma_policy="shift"))
    with pytest.raises(ValueError, match="not available for sd3"):
        StepOptions.from_config(load_config(table={"routes": [ALL_ROUTED], "positions": "interpolate"}), positions_arch=get_arch("sd3"))


def test_hook_without_process_batch_is_refused_when_the_term_is_on():
    class Bare:
        def get_noise_pred_and_target(self, *a, is_train=True): ...

        def generate_step_logs(self, *a): ...

    hook = DownscaleHook(None, None, options=StepOptions(FasterDitConfig(direction_loss_weight=0.1), loss_module=lab_trainer))
    with pytest.raises(AttributeError, match="process_batch"):
        hook.install(Bare(), Patches())
