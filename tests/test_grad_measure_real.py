"""The measurement's gradient (``estimator.param_grads``) through sd-scripts' own checkpointing code (skipped unless
``SD_SCRIPTS_DIR`` points at an sd-scripts checkout, main 48d368fa): SDXL's ``ResnetBlock2D`` under
``--gradient_checkpointing`` (``torch.utils.checkpoint`` at ``USE_REENTRANT = True``, library/sdxl_original_unet.py), with
an adapter outside the checkpoints upstream of them (as the Transformer2DModel's ``proj_in`` is), and Anima's ``unsloth_checkpoint`` (library/anima_models.py), each around sd-scripts' ``networks.lora.LoRAModule``.
The measured gradient is every adapter parameter's, equal to the one without checkpointing, and ``.grad`` comes
back as it was; ``autograd.grad``, what the measurement used before, raises on the first and answers zeros for the
adapters inside the second."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

from downscale_plugin.mapping.estimator import param_grads

SD_SCRIPTS_DIR = os.environ.get("SD_SCRIPTS_DIR")
pytestmark = pytest.mark.skipif(not SD_SCRIPTS_DIR, reason="set SD_SCRIPTS_DIR to an sd-scripts checkout (main 48d368fa)")


def flat_grad(loss, params):
    """The measured gradient as one float64 CPU vector (``param_grads`` per parameter, concatenated)."""
    return torch.cat([g.reshape(-1) for g in param_grads(loss, params)]).to("cpu", torch.float64)


@pytest.fixture(scope="module")
def host():
    sys.path.insert(0, SD_SCRIPTS_DIR)
    try:
        from library import anima_models, sdxl_original_unet
        from networks import lora

        yield sdxl_original_unet, anima_models, lora
    finally:
        sys.path.remove(SD_SCRIPTS_DIR)


def _adapt(lora, modules: dict[str, nn.Module]) -> list[nn.Parameter]:
    """sd-scripts' LoRA on each module (``apply_to``: it replaces the module's forward), lora_up away from its zero init."""
    params = []
    for name, module in modules.items():
        adapter = lora.LoRAModule(name, module, 1.0, 4, 1)
        adapter.apply_to()
        with torch.no_grad():
            adapter.lora_up.weight.normal_(0, 0.1)
        module.adapter = adapter  # keep it alive, in the module tree
        params += [p for p in adapter.parameters() if p.requires_grad]
    return params


def _sdxl(host, checkpointing: bool):
    sdxl, _, lora = host
    torch.manual_seed(0)
    blocks = nn.ModuleList([sdxl.ResnetBlock2D(32, 32) for _ in range(2)]).requires_grad_(False)
    for block in blocks:
        block.gradient_checkpointing = checkpointing
    blocks.train()
    time = nn.Linear(sdxl.TIME_EMBED_DIM, sdxl.TIME_EMBED_DIM).requires_grad_(False)  # outside the checkpoints, as proj_in is
    params = _adapt(lora, {"lora_time": time, **{f"lora_block{i}_emb": block.emb_layers[1] for i, block in enumerate(blocks)}})

    def loss() -> torch.Tensor:
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(1, 32, 4, 4, generator=gen).requires_grad_(True)  # the host's "ensure the hidden state will require grad"
        emb = time(torch.randn(1, sdxl.TIME_EMBED_DIM, generator=gen))
        for block in blocks:
            x = block(x, emb)
        return (x**2).mean()

    return params, loss


def _anima(host, checkpointing: bool):
    _, anima, lora = host
    torch.manual_seed(0)
    inner, outer = nn.Linear(8, 8).requires_grad_(False), nn.Linear(8, 8).requires_grad_(False)
    params = _adapt(lora, {"lora_outer": outer, "lora_inner": inner})

    def block(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.tanh(inner(x)) * scale

    def loss() -> torch.Tensor:
        gen = torch.Generator().manual_seed(1)
        x = outer(torch.randn(3, 8, generator=gen).requires_grad_(True))
        scale = torch.tensor(1.5)
        y = anima.unsloth_checkpoint(block, x, scale) if checkpointing else block(x, scale)
        return (y**2).mean()

    return params, loss


@pytest.mark.parametrize("model", [_sdxl, _anima], ids=["sdxl-reentrant", "anima-unsloth"])
def test_the_measured_gradient_through_the_hosts_checkpointing_is_every_adapters(model, host):
    params, loss = model(host, checkpointing=False)
    reference = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss(), params)]).double()
    params, loss = model(host, checkpointing=True)
    loss().backward()  # a micro-batch before: its gradient in .grad
    kept = [p.grad.clone() for p in params]
    measured = flat_grad(loss(), params)
    assert torch.allclose(measured, reference, rtol=1e-6, atol=1e-9), (measured - reference).abs().max()
    assert all(g.abs().sum() > 0 for g in torch.split(measured, [p.numel() for p in params]))  # every adapter tensor seen
    assert all(torch.equal(p.grad, k) for p, k in zip(params, kept, strict=True))


def test_what_autograd_grad_did_there(host):
    params, loss = _sdxl(host, checkpointing=True)
    with pytest.raises(RuntimeError, match="incompatible with .grad"):
        torch.autograd.grad(loss(), params, allow_unused=True)
    params, loss = _anima(host, checkpointing=True)
    grads = torch.autograd.grad(loss(), params, allow_unused=True)
    assert [g is None for g in grads] == [False, False, True, True]  # lora_outer seen; lora_inner (in the checkpoint) not
    assert params[2].grad is not None and params[3].grad is not None  # its gradient went to .grad instead
