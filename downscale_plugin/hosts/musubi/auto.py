"""``mode = "auto"`` on musubi-tuner: the kohya session (``hosts/kohya/auto.py``: timeline, budget,
refusals at start, the certify-and-write of ``mapping/in_run.py``, the switch to the certified windows,
metadata, end summary, adopting a resumed state's windows) with musubi-tuner's probes and forced step
(``probes.MusubiProbes``); the σ mass is the trainer's own sampler's (``family.run_sampler``, as the
start banner's plan).

What the windows cache keys of a musubi-tuner run (``mapping/reuse.py``), as musubi-tuner 30c658c4's parsers name it:
the args that change the gradient a step takes (:data:`LOSS_ARGS`) and the source of the trainer's methods a step and
its σ draw go through (:data:`TRAINER_METHODS`) and of its base module's loss and σ functions (:data:`BASE_FUNCTIONS`).
No text encoder or VAE file: musubi-tuner trains from the latents and text-encoder outputs its caching scripts wrote
(the training script's ``--vae``, ``--t5``, ``--text_encoder*`` serve sample images only), so, like the data, they are
not keyed."""

from __future__ import annotations

import sys
from typing import Any

from ..kohya.auto import AutoSession
from .facts import BASE_TRAINER
from .family import PlanSampler, run_sampler
from .probes import MusubiProbes

# parser_common's guidance and loss weighting, the flow shift the weighting's scheduler uses, Wan's task, one-frame
# and time-embedding options and expert boundary, Qwen-Image's layered target.
LOSS_ARGS = (
    "guidance_scale", "weighting_scheme", "logit_mean", "logit_std", "mode_scale", "discrete_flow_shift", "task",
    "one_frame", "force_v2_1_time_embedding", "timestep_boundary", "remove_first_image_from_target", "num_layers",
)  # fmt: skip
TRAINER_METHODS = ("process_batch", "call_dit", "compute_loss", "get_noisy_model_input_and_timesteps", "get_noise_scheduler")
BASE_FUNCTIONS = ("compute_loss_weighting_for_sd3", "get_sigmas", "compute_density_for_timestep_sampling", "get_lin_function")


class MusubiAutoSession(MusubiProbes, AutoSession):
    """One musubi-tuner ``auto`` run."""

    host = "musubi-tuner"
    code_modules = (
        *AutoSession.code_modules,
        "downscale_plugin.hosts.musubi.probes",  # the probes and their forced step
        "downscale_plugin.hosts.musubi.hook",  # the forced step a draw takes
        "downscale_plugin.hosts.musubi.family",  # the σ a draw is given
    )
    loss_args = LOSS_ARGS
    no_encoders = "none: trained from cached latents and text-encoder outputs (not keyed, like the data)"

    def host_sampler(self) -> PlanSampler:
        return run_sampler(self.family, self.ctx.args, self.ctx.dit_dtype)

    def host_functions(self) -> list[Any]:
        trainer = type(self.ctx.trainer)
        found = [getattr(trainer, name) for name in TRAINER_METHODS if hasattr(trainer, name)]
        base = next((cls for cls in trainer.__mro__ if cls.__name__ == BASE_TRAINER), None)
        module = sys.modules.get(base.__module__) if base is not None else None
        return found + [getattr(module, name) for name in BASE_FUNCTIONS if module is not None and hasattr(module, name)]
