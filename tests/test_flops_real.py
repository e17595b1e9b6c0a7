"""The FLOP models against sd-scripts' own classes (skipped unless ``SD_SCRIPTS_DIR`` points at a checkout).

The whole LoRA step of the real trainer class — ``process_batch`` with the tiny denoisers of
``tests/test_sd_scripts_real.py`` (sd-scripts' Flux, MMDiT, NextDiT and Anima classes) and the
architecture's own inner LoRA module — runs forward and backward under ``torch.utils.flop_counter``
(math attention kernel) at three latent grids. The builder in ``downscale_plugin/flops.py`` at the
same tiny config must give each grid's cost relative to the native one within 1 % of the native
step, and the native step's count itself within 5 % (what it leaves out: the first block's input
gradients that no trainable factor below it needs).

Run: ``SD_SCRIPTS_DIR=/path/to/sd-scripts python -m pytest tests/test_flops_real.py``.
"""

from __future__ import annotations

import os

import pytest
import torch
from host_modules import host_modules
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from downscale_plugin.flops import anima_flops, flux_flops, lumina_flops, sd3_flops

SD_SCRIPTS_DIR = os.environ.get("SD_SCRIPTS_DIR")
pytestmark = pytest.mark.skipif(not SD_SCRIPTS_DIR, reason="set SD_SCRIPTS_DIR to an sd-scripts checkout (main 48d368fa)")

RANK = 4  # the network_dim test_sd_scripts_real.train gives the inner module
# The builders at the tiny configs of test_sd_scripts_real.tiny_model and the token counts of its text_conds.
TINY = {
    "flux": lambda: flux_flops(hidden=64, double=1, single=1, mlp_ratio=2.0, text_tokens=6, in_channels=16, context_dim=8,
                               vec_dim=8, lora_rank=RANK),
    "sd3": lambda: sd3_flops(depth=2, x_attn=0, clip_tokens=5, t5_tokens=6, in_channels=16, pooled_dim=8, lora_rank=RANK),
    "lumina": lambda: lumina_flops(dim=120, heads=4, kv_heads=2, layers=1, refiners=1, text_tokens=6, in_channels=16, cap_dim=32,
                                   lora_rank=RANK),
    "anima": lambda: anima_flops(channels=64, blocks=1, adaln_lora=16, context_dim=32, t5_tokens=6, qwen_tokens=6, adapter_layers=0,
                                 in_channels=20, out_channels=16, lora_rank=RANK),
}  # fmt: skip
SIDES = (16, 12, 8)  # latent grids: native, 0.75, 0.5


@pytest.fixture(scope="module", autouse=True)
def host():
    with host_modules(SD_SCRIPTS_DIR):
        yield


def step_flops(setup, side: int) -> float:
    """FLOPs of one train step of the plain trainer (no plugin) with the LoRA, on a side × side latent."""
    from test_sd_scripts_real import batch_for

    batch = batch_for(setup.arch, 1, 0)
    batch["latents"] = torch.randn(1, 4, side, side, generator=torch.Generator().manual_seed(side))
    torch.manual_seed(0)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        setup.step(batch, trainer=setup.plain).backward()
    return float(counter.get_total_flops())


@pytest.mark.parametrize("arch", list(TINY))
def test_relative_cost_of_each_grid_matches_the_real_step(arch):
    from test_sd_scripts_real import ALL_ROUTED, Setup

    setup = Setup(arch, ALL_ROUTED)
    setup.unet.requires_grad_(False)  # as NetworkTrainer.train freezes it: only the LoRA factors train
    model = TINY[arch]()
    counts = {side: step_flops(setup, side) for side in SIDES}
    tokens = {side: (side // 2) ** 2 for side in SIDES}
    native = SIDES[0]
    assert model.flops(tokens[native]) == pytest.approx(counts[native], rel=0.05)
    for side in SIDES[1:]:
        measured = counts[side] / counts[native]
        predicted = model.flops(tokens[side]) / model.flops(tokens[native])
        assert abs(predicted - measured) <= 0.01, (side, predicted, measured)
