"""``mode = "auto"`` on musubi-tuner: the kohya session (``hosts/kohya/auto.py``: timeline, budget,
refusals at start, the certify-and-write of ``mapping/in_run.py``, the switch to the certified windows,
metadata, end summary, adopting a resumed state's windows) with musubi-tuner's probes and forced step
(``probes.MusubiProbes``); the σ mass is the trainer's own sampler's (``family.run_sampler``, as the
start banner's plan)."""

from __future__ import annotations

from ..kohya.auto import AutoSession
from .family import PlanSampler, run_sampler
from .probes import MusubiProbes


class MusubiAutoSession(MusubiProbes, AutoSession):
    """One musubi-tuner ``auto`` run."""

    host = "musubi-tuner"

    def host_sampler(self) -> PlanSampler:
        return run_sampler(self.family, self.ctx.args, self.ctx.dit_dtype)
