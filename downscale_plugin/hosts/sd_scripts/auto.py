"""``mode = "auto"`` on sd-scripts: the kohya session (``hosts/kohya/auto.py``: timeline, budget,
refusals at start, the certify-and-write, the switch to the certified windows) with sd-scripts'
probes (``map.SdScriptsProbes``) and its σ sampler as ``plan`` draws it (``trainer.plan_sampler``)."""

from __future__ import annotations

from typing import Any

from ..kohya.auto import AutoSession
from .map import SdScriptsProbes
from .trainer import plan_sampler


class SdScriptsAutoSession(SdScriptsProbes, AutoSession):
    """One sd-scripts ``auto`` run."""

    host = "sd-scripts"

    def host_sampler(self) -> Any:
        """The host's σ sampler as ``plan`` draws it (``sample(n, latent_hw, generator)``)."""
        return plan_sampler(self.ctx, self.family)
