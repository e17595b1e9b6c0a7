"""``attention = "proportional"`` on sd-scripts (hosts/sd_scripts/attention.py), on the host doubles and, where
``SD_SCRIPTS_DIR`` names a checkout, on its own ``library/flux_models.py``.

FLUX.1's joint attention gets ln s on the image keys of a routed forward (double- and single-stream blocks, over
the T5 mask), restored after the step; plain or native steps are bitwise the plugin without the option; a
checkpointed backward recomputes under the bias (both of the host's checkpoint paths); every other architecture is
refused, by the run and before any model loads.
"""

from __future__ import annotations

import importlib
import math
import os

import pytest
import torch
from host_modules import ARCHS, host_modules, run_double

from downscale_plugin.config import load_config
from downscale_plugin.hosts.kohya.conventions import startup_report
from downscale_plugin.hosts.musubi.facts import HostError as MusubiHostError
from downscale_plugin.hosts.musubi.start import refuse_unsupported as musubi_refuse
from downscale_plugin.hosts.sd_scripts.attention import attention_scope
from downscale_plugin.hosts.sd_scripts.facts import HostError
from downscale_plugin.hosts.sd_scripts.startup import command_line_refusals

ALL_ROUTED = {"routes": [{"scale": 0.5, "sigma_min": 0.0}]}  # 16x16 latents (64 packed tokens) run at 8x8 (16): s = 4
NEVER_ROUTED = {"routes": [{"scale": 0.5, "sigma_min": 0.999, "sigma_max": 0.9995}]}
RES = "128,128"


def by_hand(q, k, v, n_image, bias, keep=None):
    """softmax(q·kᵀ/√d + bias on the last n_image keys, −∞ where ``keep`` is False) · v, heads merged."""
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    logits[..., k.shape[-2] - n_image :] += bias
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    return (logits.softmax(-1) @ v).transpose(1, 2).flatten(2)


def reference_attention(flux_models, n_image, bias, seen):
    def attention(q, k, v, pe, attn_mask=None):
        seen.append((k.shape[2], attn_mask is not None))
        q, k = flux_models.apply_rope(q, k, pe)
        return by_hand(q, k, v, n_image, bias, attn_mask)

    return attention


pytestmark = pytest.mark.usefixtures("host_doubles", "cheap_plan")


@pytest.fixture
def doubles():
    return importlib.import_module("library.flux_models"), importlib.import_module("library.tiny_models")


@pytest.fixture
def joint_flux(doubles, monkeypatch):
    monkeypatch.setattr(doubles[1].Flux, "joint_attention", True)
    return doubles


def flux_call(gen: torch.Generator, tokens: int) -> dict:
    side = int(math.isqrt(tokens))
    rows, cols = torch.meshgrid(torch.arange(side * 1.0), torch.arange(side * 1.0), indexing="ij")
    mask = torch.ones(2, 6)
    mask[0, 4:] = 0  # T5 padding of sample 0
    return {
        "img": torch.randn(2, tokens, 16, generator=gen),
        "img_ids": torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(1, tokens, 3).expand(2, -1, -1),
        "txt": torch.randn(2, 6, 8, generator=gen),
        "txt_ids": torch.zeros(2, 6, 3),
        "y": torch.randn(2, 8, generator=gen),
        "timesteps": torch.tensor([0.3, 0.8]),
        "txt_attention_mask": mask,
    }


def test_the_scope_biases_both_blocks_over_the_t5_mask_and_is_undone(joint_flux, monkeypatch):
    flux_models, tiny_models = joint_flux
    torch.manual_seed(0)
    model = tiny_models.Flux()
    call = flux_call(torch.Generator().manual_seed(1), 16)
    original = flux_models.attention
    plain = model(**call)
    with attention_scope(flux_models)(16, math.log(4.0)):
        proportional = model(**call)
    assert flux_models.attention is original
    seen = []
    monkeypatch.setattr(flux_models, "attention", reference_attention(flux_models, 16, math.log(4.0), seen))
    expected = model(**call)
    assert seen == [(22, True), (22, True)]  # the double block's and the single block's joint sequence: 6 text + 16 image
    assert torch.allclose(proportional, expected, atol=1e-5)
    assert (proportional - plain).abs().max() > 1e-3


def runs(arch: str, config: dict, *argv: str):
    base = ("--resolution", RES, "--train_batch_size", "2", "--max_train_steps", "3", "--seed", "5", "--apply_t5_attn_mask", *argv)
    return run_double(arch, *base, downscale=config).last_run


def same(a, b) -> bool:
    theirs = b.network.state_dict()
    return a.losses == b.losses and all(torch.equal(v, theirs[k]) for k, v in a.network.state_dict().items())


@pytest.mark.parametrize("config", [ALL_ROUTED, NEVER_ROUTED])
def test_plain_and_native_steps_are_bitwise_and_routed_steps_change(joint_flux, config):
    without = runs("flux", config)
    assert same(runs("flux", {**config, "attention": "plain"}), without)
    assert same(runs("flux", {**config, "attention": "proportional"}), without) == (config is NEVER_ROUTED)


@pytest.mark.parametrize("offload", [False, True])
def test_a_checkpointed_backward_recomputes_under_the_bias(joint_flux, offload):
    config = {**ALL_ROUTED, "attention": "proportional"}
    plain = runs("flux", config)
    checkpointed = runs("flux", config, "--gradient_checkpointing", *(["--cpu_offload_checkpointing"] if offload else []))
    assert checkpointed.losses == pytest.approx(plain.losses, abs=1e-6)
    theirs = plain.network.state_dict()
    assert all(torch.allclose(v, theirs[k], atol=1e-6) for k, v in checkpointed.network.state_dict().items())
    flux_models = joint_flux[0]
    assert flux_models.attention.__module__ == "library.flux_models"
    assert flux_models.checkpoint is torch.utils.checkpoint.checkpoint


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "flux"])
def test_every_other_architecture_is_refused_by_the_run(doubles, arch):
    with pytest.raises(HostError, match=rf"attention: 'proportional' is not available for {arch} on sd-scripts \(supported: flux"):
        runs(arch, {**ALL_ROUTED, "attention": "proportional"})


def command(script: str, *extra: str) -> list[str]:
    return [f"/x/{script}.py", "--network_module", "downscale_plugin", "--network_args", "ds_routes=x0.5@0.0-", *extra]


@pytest.mark.parametrize(
    ("script", "extra", "refused"),
    [
        ("sd3_train_network", (), "sd3"),
        ("flux_train_network", ("--model_type", "chroma"), "chroma"),
        ("flux_train_network", ("--model_type=chroma",), "chroma"),
        ("flux_train_network", (), None),
        ("flux_train_network", ("--model_type", "flux"), None),
    ],
)
def test_the_startup_check_refuses_before_any_model_loads(script, extra, refused):
    argv = command(script, "ds_attention=proportional", *extra)
    cfg = load_config(network_args={"routes": "x0.5@0.0-", "attention": "proportional"})
    problems = command_line_refusals(argv, cfg, {})
    report = startup_report(argv, None, command_line_refusals)
    if refused is None:
        assert problems == [] and report is None
    else:
        assert problems == [
            f"attention: 'proportional' is not available for {refused} on sd-scripts (supported: flux; the lab DiT takes it too); "
            "use attention = 'plain'"
        ]
        assert problems[0] in report and "stopped before the trainer loads any model" in report
    plain = load_config(network_args={"routes": "x0.5@0.0-"})
    assert command_line_refusals(command(script, *extra), plain, {}) == []


def test_musubi_refuses_it_naming_the_architecture():
    cfg = load_config(table={**ALL_ROUTED, "attention": "proportional"})
    with pytest.raises(
        MusubiHostError, match=r"attention: 'proportional' is not available for wan on musubi-tuner \(supported: none; sd-scripts' flux"
    ):
        musubi_refuse(cfg, "wan")


@pytest.mark.skipif(not os.environ.get("SD_SCRIPTS_DIR"), reason="real sd-scripts: set SD_SCRIPTS_DIR")
def test_the_real_flux_blocks_get_the_bias_and_are_restored(monkeypatch):
    with host_modules(os.environ["SD_SCRIPTS_DIR"]):
        flux_models = importlib.import_module("library.flux_models")
        torch.manual_seed(0)
        double = flux_models.DoubleStreamBlock(32, 2, 4.0)
        single = flux_models.SingleStreamBlock(32, 2)
        gen = torch.Generator().manual_seed(1)
        img, txt, vec = torch.randn(2, 16, 32, generator=gen), torch.randn(2, 6, 32, generator=gen), torch.randn(2, 32, generator=gen)
        ids = torch.zeros(2, 22, 3)
        ids[:, 6:, 1], ids[:, 6:, 2] = torch.arange(16.0) // 4, torch.arange(16.0) % 4
        pe = flux_models.EmbedND(16, 10000, [4, 6, 6])(ids)
        mask = torch.ones(2, 6)
        mask[0, 4:] = 0

        def forward():
            i, t = double(img=img, txt=txt, vec=vec, pe=pe, txt_attention_mask=mask)
            return single(torch.cat((t, i), 1), vec=vec, pe=pe, txt_attention_mask=mask)

        original = flux_models.attention
        with attention_scope(flux_models)(16, math.log(4.0)):
            proportional = forward()
        assert flux_models.attention is original
        seen = []
        monkeypatch.setattr(flux_models, "attention", reference_attention(flux_models, 16, math.log(4.0), seen))
        expected = forward()
        assert seen == [(22, True), (22, True)]
        assert torch.allclose(proportional, expected, atol=1e-5)
