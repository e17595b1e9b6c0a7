"""``mode = "auto"`` on sd-scripts: the kohya session (``hosts/kohya/auto.py``: timeline, budget,
refusals at start, the certify-and-write, the switch to the certified windows) with sd-scripts'
probes (``map.SdScriptsProbes``) and its σ sampler as ``plan`` draws it (``start.HostSampler``)."""

from __future__ import annotations

from typing import Any

import torch

from ..kohya.auto import AutoSession
from .map import SdScriptsProbes


class SdScriptsAutoSession(SdScriptsProbes, AutoSession):
    """One sd-scripts ``auto`` run."""

    def host_sampler(self) -> Any:
        """The host's σ sampler as ``plan`` draws it (``sample(n, latent_hw, generator)``)."""
        from .start import HostSampler

        ctx = self.ctx
        scheduler = ctx.trainer.get_noise_scheduler(ctx.args, torch.device("cpu"))
        return HostSampler(self.family, ctx.args, scheduler, ctx.weight_dtype or torch.float32)
