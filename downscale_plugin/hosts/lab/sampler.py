"""The lab trainer's σ sampler as a ``plan`` sampler, for the adapter's plan, the in-run certifier's σ mass
and ``certify --lab`` (``adapter.py``, ``auto.py``, ``certify.py``): one place all three import."""

from __future__ import annotations

import argparse

from ...sigma import SigmaSampler


def lab_sampler(args: argparse.Namespace) -> SigmaSampler:
    """The lab trainer's σ sampler as a ``plan`` sampler (same formulas as its sampler module)."""
    return SigmaSampler(
        mode=args.timestep_sampling,
        sigmoid_scale=args.sigmoid_scale,
        discrete_flow_shift=args.discrete_flow_shift,
        weighting_scheme=args.weighting_scheme,
        logit_mean=args.logit_mean,
        logit_std=args.logit_std,
        mode_scale=args.mode_scale,
    )
