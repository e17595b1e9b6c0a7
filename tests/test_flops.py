"""The FLOP presets against a direct count of each block's matmuls (``downscale_plugin/flops.py``).

Every block kind a preset describes is built tiny from diffusers' implementation of the same
architecture (the lab's dependency; the real sd-scripts classes are ``tests/test_flops_real.py``),
run forward and backward with frozen weights and inputs that need a gradient — what a LoRA step
asks of the blocks it passes — under ``torch.utils.flop_counter`` with the math attention kernel
(whose products the counter sees). The builder's per-block count at the same tiny config must equal
it exactly, for two token counts, so a preset cannot drift from the architecture it describes.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from downscale_plugin.arch import ARCHS
from downscale_plugin.flops import FlopModel, Matmul, StepFlops, anima_flops, arch_flops, flux_flops, lumina_flops, sd3_flops, wan_flops
from downscale_plugin.hosts.sd_scripts.flop_args import run_flops

pytest.importorskip("diffusers")
TOKENS = ((12, 5), (30, 7))  # (image, text) tokens per case


def counted(run) -> float:
    """FLOPs of ``run()``'s forward and of the backward of its outputs, as the flop counter sees them."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        outs = run()
        outs = outs if isinstance(outs, tuple) else (outs,)
        sum(o.float().square().mean() for o in outs if o is not None).backward()
    return float(counter.get_total_flops())


def stage(model: StepFlops, name: str, n_image: int) -> float:
    """The model's FLOPs of one block of stage ``name`` (LoRA off: the diffusers blocks carry none)."""
    s = next(s for s in model.stages if s.name == name)
    return model.stage_flops(s, n_image) / s.count


def grad_input(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).requires_grad_(True)


def frozen(block: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    return block.requires_grad_(False)


@pytest.mark.parametrize(("n", "t"), TOKENS)
def test_flux_blocks_match_their_count(n, t):
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock

    h = 32
    model = flux_flops(hidden=h, double=1, single=1, text_tokens=t, lora_rank=0)
    double = frozen(FluxTransformerBlock(h, 2, h // 2))
    single = frozen(FluxSingleTransformerBlock(h, 2, h // 2))
    temb = torch.randn(1, h)
    assert counted(lambda: double(grad_input(1, n, h), grad_input(1, t, h), temb)) == stage(model, "double", n)
    assert counted(lambda: single(grad_input(1, n, h), grad_input(1, t, h), temb)) == stage(model, "single", n)


@pytest.mark.parametrize(("n", "t"), TOKENS)
def test_sd3_blocks_match_their_count(n, t):
    from diffusers.models.attention import JointTransformerBlock

    depth = 1  # hidden 64·depth, heads = depth
    h = 64 * depth
    model = sd3_flops(depth=depth, blocks=3, x_attn=1, clip_tokens=t, t5_tokens=0, lora_rank=0)
    temb = torch.randn(1, h)
    blocks = {
        "joint+x": JointTransformerBlock(h, depth, 64, use_dual_attention=True),
        "joint": JointTransformerBlock(h, depth, 64),
        "last": JointTransformerBlock(h, depth, 64, context_pre_only=True),
    }
    for name, block in blocks.items():
        block = frozen(block)
        assert counted(lambda b=block: b(grad_input(1, n, h), grad_input(1, t, h), temb)) == stage(model, name, n), name


@pytest.mark.parametrize(("n", "t"), TOKENS)
def test_lumina_blocks_match_their_count(n, t):
    from diffusers.models.transformers.transformer_lumina2 import Lumina2TransformerBlock

    h, heads, kv = 48, 4, 2
    model = lumina_flops(dim=h, heads=heads, kv_heads=kv, layers=1, refiners=1, text_tokens=t, lora_rank=0)
    temb = torch.randn(1, min(h, 1024))
    make = lambda modulation: frozen(Lumina2TransformerBlock(h, heads, kv, 256, None, 1e-5, modulation=modulation))  # noqa: E731
    context, noise, joint = make(False), make(True), make(True)
    assert counted(lambda: context(grad_input(1, t, h), None, None)) == stage(model, "context refiner", n)
    assert counted(lambda: noise(grad_input(1, n, h), None, None, temb)) == stage(model, "noise refiner", n)
    assert counted(lambda: joint(grad_input(1, n + t, h), None, None, temb)) == stage(model, "joint", n)


@pytest.mark.parametrize(("n", "t"), TOKENS)
def test_anima_block_matches_its_count(n, t):
    from diffusers.models.transformers.transformer_cosmos import CosmosTransformerBlock

    heads, d, context, lora = 2, 16, 24, 8
    h = heads * d
    model = anima_flops(channels=h, blocks=2, adaln_lora=lora, context_dim=context, t5_tokens=t, lora_rank=0)  # "other": all but the first
    block = frozen(CosmosTransformerBlock(heads, d, context, adaln_lora_dim=lora))
    text, embedded, temb = torch.randn(1, t, context), torch.randn(1, h), torch.randn(1, 3 * h)
    assert counted(lambda: block(grad_input(1, n, h), text, embedded, temb)) == stage(model, "other", n)


@pytest.fixture(scope="module")
def musubi_wan():
    """musubi-tuner's ``WanModel`` and ``networks.lora_wan`` (its ``wan/modules/t5.py`` evaluates
    ``torch.cuda.current_device()`` at import, stubbed here for a machine without a GPU)."""
    pytest.importorskip("musubi_tuner", reason="musubi-tuner is not importable")
    current = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0
    try:
        from musubi_tuner.networks import lora_wan
        from musubi_tuner.wan.modules.model import WanModel
    finally:
        torch.cuda.current_device = current
    return WanModel, lora_wan


@pytest.mark.parametrize("version", ["2.1", "2.2"])
@pytest.mark.parametrize(("frames", "height", "width", "t"), [(2, 4, 6, 5), (1, 6, 10, 7)])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_wan_lora_step_matches_its_count(musubi_wan, version, frames, height, width, t, checkpointing):
    """A whole tiny musubi-tuner WanModel with networks.lora_wan at rank 4: embedders, F·H·W/4 video tokens
    through self-attention, cross-attention to the padded text, FFN, head; Wan 2.2's per-token time embedding."""
    wan_model, lora_wan = musubi_wan
    rank, tokens = 4, frames * (height // 2) * (width // 2)
    torch.manual_seed(0)
    model = wan_model(
        model_version=version, dim=32, ffn_dim=48, num_heads=2, num_layers=2, text_len=t, text_dim=24, attn_mode="torch"
    ).requires_grad_(False)
    network = lora_wan.create_arch_network(1.0, rank, rank, None, None, model)
    network.apply_to(None, model, apply_text_encoder=False, apply_unet=True)
    if checkpointing:
        model.enable_gradient_checkpointing()
    latents, context = [torch.randn(16, frames, height, width)], [torch.randn(t - 2, 24)]  # the context is padded to text_len
    got = counted(lambda: tuple(model(latents, torch.tensor([500.0]), context, tokens)))
    counts = wan_flops(
        dim=32, ffn=48, layers=2, text_tokens=t, text_dim=24, lora_rank=rank, checkpointing=checkpointing, time_per_token=version == "2.2"
    )
    assert got == counts.flops(tokens)


def test_wan_preset_is_the_14b_config():
    wan = arch_flops("wan")
    assert wan.text_tokens == 512 and [s.count for s in wan.stages] == [1, 1, 39, 1]
    assert wan.stages[2].matmuls[0].fan_in == 5120 and wan.stages[2].matmuls[-1].fan_in == 13824
    assert 1 - wan.flops(21 * 880) / wan.flops(21 * 1560) > 1 - 880 / 1560  # attention over F·N tokens: more saved than tokens


def test_lora_factors_cost_their_forward_and_both_gradients():
    """A rank-r adapter on a linear with a gradient-carrying input, counted on a plain LoRA pair."""
    base, down, up = (torch.nn.Linear(*shape, bias=False) for shape in ((20, 36), (20, 4), (4, 36)))
    base.requires_grad_(False)
    x = grad_input(1, 9, 20)
    assert counted(lambda: base(x) + up(down(x))) == 2 * 9 * sum(Matmul("image", 20, 36).macs(4))


def test_presets_are_the_builders_at_the_published_configs():
    for arch in ("flux", "chroma", "sd3", "lumina", "anima"):
        assert ARCHS[arch].flops == arch_flops(arch)
    assert isinstance(ARCHS["sdxl"].flops, FlopModel) and ARCHS["sdxl"].flops.b == 0
    flux = ARCHS["flux"].flops
    assert flux.text_tokens == 512 and [s.count for s in flux.stages] == [1, 19, 38, 1]
    sd3 = ARCHS["sd3"].flops
    assert sd3.text_tokens == 77 + 256 and [s.count for s in sd3.stages if s.blocks] == [13, 10, 1]
    assert 1 - flux.flops(2304) / flux.flops(4096) > 1 - 2304 / 4096  # attention: more FLOPs saved than tokens


def test_the_run_text_lengths_replace_the_preset_ones():
    """``--t5xxl_max_token_length 32`` on a Flux run: 32 text tokens, and a larger routed saving than 512."""
    args = argparse.Namespace(t5xxl_max_token_length=32, network_dim=16, gradient_checkpointing=True)
    run = run_flops("flux", args)
    assert run.text_tokens == 32 and run.lora_rank == 16 and run.checkpointing
    assert run_flops("flux", argparse.Namespace(t5xxl_max_token_length=None)).text_tokens == 512
    assert run_flops("flux", argparse.Namespace(t5xxl_max_token_length=None), argparse.Namespace(is_schnell=True)).text_tokens == 256
    assert run_flops("sd3", argparse.Namespace(t5xxl_max_token_length=64)).text_tokens == 77 + 64
    assert run_flops("anima", argparse.Namespace(t5_max_token_length=128, qwen3_max_token_length=64)).aux_tokens == 64
    assert run_flops("sdxl", args) is ARCHS["sdxl"].flops
    preset = ARCHS["flux"].flops
    assert 1 - run.flops(2304) / run.flops(4096) > 1 - preset.flops(2304) / preset.flops(4096)
