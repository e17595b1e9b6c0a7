"""``attention = "proportional"`` (downscale_plugin/attention.py): the bias itself, the lab DiT's scope, and the hook.

The bias is checked against attention computed by hand (softmax of q·k/√d plus ln s on the image keys only) and
against its meaning (one image key biased by ln 2 is that key attended to twice); the lab scope against a reference
attention swapped into the same diffusers function; the hook: plain, or native steps, bitwise the plugin without
the option, a routed step different, everything restored after the step (also on an exception), and a checkpointed
forward's backward recomputing under the same bias.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from downscale_plugin.attention import biased_mask, log_size, routed_attention_scope
from downscale_plugin.config import ConfigError, FasterDitConfig, load_config
from downscale_plugin.hosts.lab import adapter as lab_adapter
from downscale_plugin.hosts.lab import attention as lab_attention
from downscale_plugin.hosts.lab.adapter import LabPlugin
from downscale_plugin.hosts.sd_scripts.hook import StepOptions
from downscale_plugin.lab.data import LabData, LabDataConfig
from downscale_plugin.lab.model import LabModelConfig, LabTextEncoder, build_model, image_tokens
from downscale_plugin.lab.trainer import LabAccelerator, LabTrainer, lab_args, make_noise_scheduler, train_lora

TINY = LabModelConfig(hidden_size=32, num_heads=2, double_layers=1, single_layers=1, latent_channels=4,
                      text_tokens=4, text_dim=16, pooled_dim=8)  # fmt: skip
ALL_ROUTED = {"scale": 0.5, "sigma_min": 0.0}  # 16x16 latents (64 tokens) run at 8x8 (16 tokens): s = 4
NEVER_ROUTED = {"scale": 0.5, "sigma_min": 0.999, "sigma_max": 0.9995}  # a window the tiny run's σ never hits


def by_hand(q, k, v, n_image, bias, keep=None):
    """softmax(q·kᵀ/√d + bias on the last n_image keys [+ −∞ on masked keys]) · v; q, k, v: B H L D."""
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    logits[..., k.shape[-2] - n_image :] += bias
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits.softmax(-1) @ v


def test_the_mask_adds_the_log_size_to_image_keys_only_and_keeps_a_boolean_mask():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    bias = log_size(64, 36)  # a 0.75 route: ln(1/0.75²)
    assert bias == pytest.approx(-2 * math.log(0.75))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=biased_mask(None, 9, 6, bias, q.dtype, q.device))
    assert torch.allclose(out, by_hand(q, k, v, 6, bias), atol=1e-12)
    assert not torch.allclose(out, by_hand(q, k, v, 9, bias), atol=1e-6)  # text keys get nothing
    keep = torch.ones(2, 3, 9, 9, dtype=torch.bool)
    keep[0, ..., 1:3] = False  # T5 padding of sample 0
    mask = biased_mask(keep, 9, 6, bias, q.dtype, q.device)
    assert mask.dtype == q.dtype and torch.isinf(mask[0, ..., 1:3]).all() and (mask[..., 3:] == bias).all()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.allclose(out, by_hand(q, k, v, 6, bias, keep), atol=1e-12)
    with pytest.raises(ValueError, match="do not fit"):
        biased_mask(None, 4, 6, bias, q.dtype, q.device)


def test_an_image_key_biased_by_ln2_is_that_key_attended_twice():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, 5, 4, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 1, 3, 4, generator=gen, dtype=torch.float64) for _ in range(2))  # 2 text keys, 1 image key
    biased = F.scaled_dot_product_attention(q, k, v, attn_mask=biased_mask(None, 3, 1, math.log(2.0), q.dtype, q.device))
    twice = F.scaled_dot_product_attention(q, torch.cat([k, k[..., 2:, :]], 2), torch.cat([v, v[..., 2:, :]], 2))
    assert torch.allclose(biased, twice, atol=1e-12)


@pytest.fixture(scope="module")
def model():
    return build_model(TINY, seed=0)


@pytest.fixture(scope="module")
def data() -> LabData:
    return LabData(LabDataConfig(buckets=((64, 64),), latent_channels=TINY.latent_channels))


def lab_inputs(hw: tuple[int, int]):
    gen = torch.Generator().manual_seed(2)
    n = image_tokens(*hw)
    rows, cols = torch.meshgrid(torch.arange(hw[0] // 2.0), torch.arange(hw[1] // 2.0), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(1, n, 3)
    return {
        "img": torch.randn(1, n, 4 * TINY.latent_channels, generator=gen),
        "img_ids": img_ids,
        "txt": torch.randn(1, TINY.text_tokens, TINY.text_dim, generator=gen),
        "txt_ids": torch.zeros(1, TINY.text_tokens, 3),
        "y": torch.randn(1, TINY.pooled_dim, generator=gen),
        "timesteps": torch.tensor([0.7]),
    }


def test_the_lab_scope_biases_every_joint_attention_of_the_dit_and_is_undone(monkeypatch, model):
    module = lab_attention.importlib.import_module(lab_attention.ATTENTION_MODULE)
    original = module.dispatch_attention_fn
    inputs = lab_inputs((8, 8))  # 16 image tokens after 4 text tokens
    n_image, bias = 16, math.log(4.0)
    plain = model(**inputs)
    with lab_attention.attention_scope()(n_image, bias):
        assert module.dispatch_attention_fn is not original
        proportional = model(**inputs)
    assert module.dispatch_attention_fn is original and torch.utils.checkpoint.checkpoint.__module__ == "torch.utils.checkpoint"
    calls = []

    def reference(query, key, value, attn_mask=None, **_):  # B L H D, as diffusers' processor passes them
        calls.append(key.shape[1])
        assert attn_mask is None
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        return by_hand(q, k, v, n_image, bias).transpose(1, 2)

    monkeypatch.setattr(module, "dispatch_attention_fn", reference)
    expected = model(**inputs)
    assert calls == [20] * (TINY.double_layers + TINY.single_layers)  # every block's joint sequence: 4 text + 16 image
    assert torch.allclose(proportional, expected, atol=1e-5)
    assert (proportional - plain).abs().max() > 1e-3


def test_the_scope_is_undone_on_an_exception(model):
    module = lab_attention.importlib.import_module(lab_attention.ATTENTION_MODULE)
    original, checkpoint = module.dispatch_attention_fn, torch.utils.checkpoint.checkpoint
    with pytest.raises(RuntimeError, match="boom"), lab_attention.attention_scope()(16, 1.0):
        raise RuntimeError("boom")
    assert module.dispatch_attention_fn is original and torch.utils.checkpoint.checkpoint is checkpoint


def test_a_checkpointed_forward_recomputes_under_the_bias_in_the_backward():
    """The backward runs after the routed forward's scope has closed; a checkpoint recomputes its blocks there."""
    grads = []
    for checkpointing in (False, True):
        model = build_model(TINY, seed=0).train()
        if checkpointing:
            model.transformer.enable_gradient_checkpointing()
        with torch.enable_grad():
            with lab_attention.attention_scope()(16, math.log(4.0)):
                out = model(**lab_inputs((8, 8)))
            out.square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_a_reentrant_checkpoint_inside_the_scope_is_refused():
    holder = type("Holder", (), {"attention": staticmethod(lambda x: x)})
    with routed_attention_scope(holder, "attention", lambda f: f), pytest.raises(RuntimeError, match="non-reentrant"):
        torch.utils.checkpoint.checkpoint(lambda x: x * 2, torch.ones(1, requires_grad=True), use_reentrant=True)


def run(table: dict, model, data, steps: int = 3):
    plugin = LabPlugin.for_lab(load_config(table=table), TINY, data)
    return train_lora(model, data, steps=steps, lr=1e-2, rank=2, seed=3, hook_installer=plugin.installer)


@pytest.mark.parametrize("route", [ALL_ROUTED, NEVER_ROUTED])
def test_plain_is_bitwise_the_plugin_without_the_option_and_proportional_changes_routed_steps_only(route, model, data):
    without = run({"routes": [route]}, model, data)
    plain = run({"routes": [route], "attention": "plain"}, model, data)
    proportional = run({"routes": [route], "attention": "proportional"}, model, data)
    assert plain.losses == without.losses and all(torch.equal(plain.deltas[k], without.deltas[k]) for k in without.deltas)
    same = proportional.losses == without.losses and all(torch.equal(proportional.deltas[k], without.deltas[k]) for k in without.deltas)
    assert same == (route is NEVER_ROUTED)  # native steps: bitwise; routed: the bias changed the step


def test_the_hook_biases_the_routed_forward_by_the_token_ratio_and_removes_it_after(monkeypatch, model, data):
    plugin = LabPlugin.for_lab(load_config(table={"routes": [ALL_ROUTED], "attention": "proportional"}), TINY, data)
    module = lab_attention.importlib.import_module(lab_attention.ATTENTION_MODULE)
    original = module.dispatch_attention_fn
    seen = []

    def spy(n_image, bias):
        seen.append((n_image, bias))
        return scope(n_image, bias)

    scope = lab_attention.attention_scope()
    monkeypatch.setattr(lab_adapter, "attention_scope", lambda: spy)
    trainer, args, batch = LabTrainer(), lab_args(max_train_steps=1), data.batch(0, 1, seed=0)
    call = (batch, LabTextEncoder(TINY), model, None, make_noise_scheduler(args), torch.float32, LabAccelerator(), args)
    with plugin.installer(trainer, args):
        trainer.process_batch(*call)
        assert module.dispatch_attention_fn is original
        trainer.process_batch(*call, is_train=False)  # validation: never routed
    assert seen == [(16, pytest.approx(math.log(4.0)))]  # 64 native tokens, 16 small: ln(1/0.5²)


def test_the_config_refuses_an_unknown_value_and_step_options_need_a_scope():
    with pytest.raises(ConfigError, match=r"attention: 'ToMe' is not allowed \(allowed: plain, proportional\)"):
        load_config(table={"routes": [ALL_ROUTED], "attention": "ToMe"})
    with pytest.raises(ConfigError, match=r"ds_attention: 'x' is not allowed"):
        load_config(network_args={"routes": "x0.5@0.0-", "attention": "x"})
    with pytest.raises(ValueError, match="attention"):
        FasterDitConfig(attention="proportionally")
    with pytest.raises(ValueError, match="attention_scope"):
        StepOptions(FasterDitConfig(attention="proportional"))
    with pytest.raises(ConfigError, match='attention: .proportional. is not allowed with mode = "map"'):
        load_config(table={"mode": "map", "map_out": "x", "attention": "proportional"})
