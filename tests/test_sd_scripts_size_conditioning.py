"""SDXL's size conditioning on routed steps (``hook.at_grid_batch``), on the sd-scripts doubles.

A routed step conditions on what sd-scripts gives the same image trained in a bucket of the small grid's
size: target and crop scaled to the small grid, the source's original size kept; native steps and the
host's batch are untouched.
"""

from __future__ import annotations

import pytest
import torch
from host_modules import ARCHS, run_double

from downscale_plugin.hosts.sd_scripts.hook import at_grid_batch

pytestmark = pytest.mark.usefixtures("host_doubles", "cheap_plan")

ARGV = ("--resolution", "128,192", "--max_train_steps", "3", "--seed", "2")  # latent 24x16: bucket 192 px high, 128 wide


def sizes(call: dict) -> torch.Tensor:
    """The (original h, w, crop top, left, target h, w) pixels the SDXL double's call_unet put in the vector."""
    return (call["y"][:, -6:] * 1024).round().long()


def test_a_routed_sdxl_step_conditions_on_the_small_buckets_sizes():
    run = run_double("sdxl", *ARGV, downscale={"routes": [{"scale": 0.5, "sigma_min": 0.0}]}).last_run
    plain = run_double("sdxl", *ARGV, network_module=ARCHS["sdxl"][2]).last_run
    native = torch.tensor([[288, 256, 48, 0, 192, 128]])  # the dataset's: source 1.5 h × 2 w, crop top h/4, the bucket
    for routed, host in zip(run.unet.calls, plain.unet.calls, strict=True):
        assert routed["shape"][-2:] == (12, 8) and host["shape"][-2:] == (24, 16)
        assert torch.equal(sizes(host), native)
        assert torch.equal(sizes(routed), torch.tensor([[288, 256, 24, 0, 96, 64]]))  # target and crop at 0.5


def test_native_sdxl_steps_keep_the_hosts_conditioning_bit_for_bit():
    run = run_double("sdxl", *ARGV, downscale={"routes": [{"scale": 0.5, "sigma_min": 0.999, "sigma_max": 0.9999}]}).last_run
    plain = run_double("sdxl", *ARGV, network_module=ARCHS["sdxl"][2]).last_run
    assert all(call["shape"][-2:] == (24, 16) for call in run.unet.calls)  # nothing routed
    assert all(torch.equal(a["y"], b["y"]) for a, b in zip(run.unet.calls, plain.unet.calls, strict=True))
    assert run.losses == plain.losses


def test_the_hosts_batch_is_never_changed_and_fractional_ratios_round_per_axis():
    batch = {
        "original_sizes_hw": torch.tensor([[1500, 2000]]),
        "crop_top_lefts": torch.tensor([[37, 0]]),
        "target_sizes_hw": torch.tensor([[1024, 1024]]),
        "latents": torch.zeros(1),
    }
    frozen = {k: v.clone() for k, v in batch.items()}
    small = at_grid_batch(batch, (128, 128), (96, 112))  # 0.75 high, 0.875 wide
    assert all(torch.equal(batch[k], frozen[k]) for k in batch) and small is not batch
    assert small["original_sizes_hw"] is batch["original_sizes_hw"] and small["latents"] is batch["latents"]
    assert small["target_sizes_hw"].tolist() == [[768, 896]] and small["crop_top_lefts"].tolist() == [[28, 0]]
    assert small["target_sizes_hw"].dtype == torch.long
    assert at_grid_batch(batch, (128, 128), (128, 128)) is batch
