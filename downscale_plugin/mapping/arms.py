"""Arms of a map and the backend contract that runs them.

An *arm* is one way of presenting an image to a training step: the native latent (two independent
noise-draw sets, A and B, whose disagreement is the redraw floor), a route's latent-area
downsample (what the plugin trains on), and, for a backend that has a VAE, a re-encode control
(decode, encode at native size: prices the VAE round trip) and a "downscale pixels, then encode"
arm (the seed paper's construction, to compare with latent-area). The estimator is model-agnostic:
it only asks a :class:`MapBackend` for each arm's input once per image and for one draw's loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

NATIVE_A = "native_a"
NATIVE_B = "native_b"
ARM_KINDS = ("native", "latent", "reenc", "pixel")


@dataclass(frozen=True)
class Arm:
    """``kind`` in :data:`ARM_KINDS`; ``ratio`` is the linear downscale for ``latent``/``pixel``."""

    name: str
    kind: str
    ratio: float | None = None

    @property
    def compared(self) -> bool:
        """Whether the map reports a row for this arm (everything but the two native arms)."""
        return self.kind != "native"


def latent_arm(ratio: float) -> Arm:
    return Arm(f"latent_{ratio:g}", "latent", ratio)


def pixel_arm(ratio: float) -> Arm:
    return Arm(f"pixel_{ratio:g}", "pixel", ratio)


REENC = Arm("reenc", "reenc")


def build_arms(ratios: Sequence[float], pixel: bool = False, reenc: bool = False) -> tuple[Arm, ...]:
    """Native A, native B, one latent-area arm per ratio (deepest first), optional VAE arms."""
    if not ratios:
        raise ValueError("ratios: at least one route ratio is required (e.g. 0.875,0.75,0.5)")
    bad = [r for r in ratios if not 0.0 < r < 1.0]
    if bad:
        raise ValueError(f"ratios: {bad} must be strictly between 0 and 1 (a linear downscale)")
    if len(set(ratios)) != len(ratios):
        raise ValueError(f"ratios: {list(ratios)} has duplicates")
    ordered = sorted(ratios)
    arms = [Arm(NATIVE_A, "native"), Arm(NATIVE_B, "native"), *(latent_arm(r) for r in ordered)]
    if pixel:
        arms += [pixel_arm(r) for r in ordered]
    if reenc:
        arms.append(REENC)
    return tuple(arms)


class MapBackend(Protocol):
    """What the estimator needs from a model + adapter + probe set.

    ``loss`` must draw its noise from torch's global RNG (the estimator seeds it per
    (image, bin, arm, draw) inside a fork) and return the training loss of exactly one draw at the
    given σ, built by the trainer's own step code; the estimator differentiates it w.r.t.
    ``trainable_parameters()`` only.
    """

    rng_devices: Sequence[int]

    def describe(self) -> dict[str, Any]:
        """Provenance: model, adapter, data, native grid (goes into every output file)."""
        ...

    def trainable_parameters(self) -> list[torch.nn.Parameter]: ...

    def num_images(self) -> int: ...

    def unsupported(self, arm: Arm) -> str | None:
        """Why this backend cannot run ``arm``, naming it (e.g. no VAE for ``reenc``/``pixel``), else None."""
        ...

    def arm_input(self, image: int, arm: Arm) -> Any:
        """The arm's data for one probe image, prepared once and reused for every bin and draw."""
        ...

    def loss(self, image: int, arm_input: Any, sigma: float) -> torch.Tensor: ...
