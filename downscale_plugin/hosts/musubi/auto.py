"""``mode = "auto"`` on musubi-tuner: the kohya session (``hosts/kohya/auto.py``: timeline, budget,
refusals at start, the certify-and-write of ``mapping/in_run.py``, the switch to the certified windows,
metadata, end summary, adopting a resumed state's windows) with musubi-tuner's probes and forced step
(``probes.MusubiProbes``); the σ mass is the trainer's own sampler's (``family.PlanSampler``, as the
start banner's plan)."""

from __future__ import annotations

import torch

from ..kohya.auto import AutoSession
from .family import PlanSampler
from .probes import MusubiProbes


class MusubiAutoSession(MusubiProbes, AutoSession):
    """One musubi-tuner ``auto`` run."""

    def host_sampler(self) -> PlanSampler:
        from .start import noise_scheduler

        ctx = self.ctx
        return PlanSampler(self.family, ctx.args, noise_scheduler(ctx.trainer, ctx.args), ctx.dit_dtype or torch.bfloat16)
