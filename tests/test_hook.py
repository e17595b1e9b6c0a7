"""The hook over many consecutive steps: the host's σ stream must stay a fresh i.i.d. stream."""

from __future__ import annotations

import argparse
import types

import numpy as np
import pytest
import torch
from scipy import stats

from downscale_plugin.config import load_config
from downscale_plugin.hosts.sd_scripts.families import FlowFamily
from downscale_plugin.hosts.sd_scripts.hook import DownscaleHook
from downscale_plugin.lab import flux_train_utils
from downscale_plugin.router import Router
from downscale_plugin.scope import Patches
from downscale_plugin.sigma import SigmaSampler


class _Trainer:
    """The two host methods the hook wraps; the step draws noise, then σ, like sd-scripts' Flux trainer."""

    def __init__(self):
        self.seen: list[torch.Tensor] = []

    def get_noise_pred_and_target(
        self, args, accelerator, noise_scheduler, latents, batch, conds, unet, network, dtype, train_unet, is_train=True
    ):
        noise = torch.randn_like(latents)
        noisy, timesteps, sigmas = flux_train_utils.get_noisy_model_input_and_timesteps(args, noise_scheduler, latents, noise, "cpu", dtype)
        self.seen.append(sigmas.flatten().clone())
        return noisy, noise - latents, timesteps, None

    def generate_step_logs(self, args, current_loss, *rest):
        return {"loss/current": current_loss}


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("window", [(0.0, None), (0.5, None)], ids=["every-step-routed", "half-routed"])
def test_consecutive_steps_draw_fresh_sigma(batch_size, window):
    # A replay that skipped the host's σ draw left torch's cached Box-Muller normal in place, so
    # every routed step after the first drew the same σ. Over many steps σ must follow the sampler.
    args = argparse.Namespace(timestep_sampling="sigmoid", sigmoid_scale=1.0, ip_noise_gamma=None, ip_noise_gamma_random_strength=False)
    scheduler = types.SimpleNamespace(config=types.SimpleNamespace(num_train_timesteps=1000))
    route = {"scale": 0.5, "sigma_min": window[0]}
    router = Router.from_config(load_config(table={"routes": [route]}), "flux", seed=3, total_forwards=0)
    trainer = _Trainer()
    DownscaleHook(router, FlowFamily(flux_train_utils, "flux")).install(trainer, Patches())
    torch.manual_seed(0)
    latents = torch.zeros(batch_size, 4, 16, 16)
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))
    for _ in range(2000 // batch_size):
        trainer.get_noise_pred_and_target(args, accelerator, scheduler, latents, {}, None, None, None, torch.float32, True)
    sigmas = torch.cat(trainer.seen).numpy()
    assert len(np.unique(sigmas)) > 0.99 * len(sigmas)
    cdf = np.vectorize(lambda x: SigmaSampler("sigmoid").cdf(float(x), (16, 16)))
    assert stats.kstest(sigmas, cdf).pvalue > 1e-3
