"""The lab's part of ``certify``: the σ mass of the lab trainer's own sampler at the probes' grid.

``certify --lab`` measures on the ``map --lab`` backend (``cli.py``); what a window is worth is the
share of steps whose σ falls in it, under the sampler the lab trainer draws from (``lab_args``'
``timestep_sampling``, the same formulas as ``plan``). Nothing here imports the lab's dependencies.
"""

from __future__ import annotations

from typing import Any

from ...mapping.certify_cli import Mass, register_sigma_mass


def lab_sigma_mass(backend: Any) -> tuple[Mass, str]:
    """P(lo < σ ≤ hi) for the lab trainer's sampler on the backend's native grid (a point bin: 0, the laws are continuous)."""
    from .sampler import lab_sampler

    sampler, hw = lab_sampler(backend.args), backend.cfg.native_hw
    args = backend.args
    text = (
        f"lab trainer: timestep_sampling {args.timestep_sampling}, discrete_flow_shift {args.discrete_flow_shift:g}, native {hw[0]}x{hw[1]}"
    )
    return (lambda lo, hi: sampler.mass(lo, hi, hw) if hi > lo else 0.0), text


register_sigma_mass("lab", lab_sigma_mass)
