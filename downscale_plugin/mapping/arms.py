"""Arms of a map and the backend contract that runs them.

An *arm* is one way of presenting an image to a training step: the native latent (two independent
noise-draw sets, A and B, whose disagreement is the redraw floor), a route's latent-area
downsample (what the plugin trains on), and, for a backend that has a VAE, a re-encode control
(decode, encode at native size: prices the VAE round trip) and a "downscale pixels, then encode"
arm (the seed paper's construction, to compare with latent-area). The estimator is model-agnostic:
it only asks a :class:`MapBackend` for each arm's input once per image and for one draw's loss.

A small-grid arm (``latent``/``pixel``) may also run its step at a σ policy's σ (fasterdit/policies.py:
``keep``/``res_shift``/``snr_match``; the map's bin σ is the drawn σ, as the window gate reads it)
with position ids interpolated to the native span (``plain``/``interpolate``) and with proportional
attention (``plain``/``proportional``, downscale_plugin/attention.py). The plugin applies one
``sigma_policy``/``positions``/``attention`` setting to every routed step, so the latent arms of each
measured setting make one windows TOML (``windows.toml`` for keep/plain/plain, ``windows@res_shift+interp.toml``,
``windows+prop.toml`` ...); pixel and reenc arms are comparisons the plugin cannot run, never routes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..config import ATTENTIONS, POSITIONS
from ..config import SIGMA_POLICIES as POLICIES

NATIVE_A = "native_a"
NATIVE_B = "native_b"
ARM_KINDS = ("native", "latent", "reenc", "pixel")
SMALL_KINDS = ("latent", "pixel")  # arms on a route's smaller grid: they take a ratio, a policy, positions and attention
SETTING_KEYS = ("sigma_policy", "positions", "attention")  # the config keys of an arm's setting, in order
PLAIN = ("keep", "plain", "plain")  # the (sigma_policy, positions, attention) setting of the plugin's defaults
Setting = tuple[str, str, str]


def setting_suffix(setting: Setting) -> str:
    """``""`` for keep/plain/plain, else ``@res_shift``, ``+interp``, ``+prop``, ``@snr_match+interp+prop``: arm names and
    TOML file names (a map stored before the attention axis re-reads with the same names)."""
    policy, positions, attention = setting
    return (
        (f"@{policy}" if policy != "keep" else "")
        + ("+interp" if positions == "interpolate" else "")
        + ("+prop" if attention == "proportional" else "")
    )


def setting_text(setting: Setting) -> str:
    """``sigma_policy = keep, positions = plain, attention = proportional``: the keys a setting's windows TOML sets."""
    return ", ".join(f"{key} = {value}" for key, value in zip(SETTING_KEYS, setting, strict=True))


@dataclass(frozen=True)
class Arm:
    """``kind`` in :data:`ARM_KINDS`; ``ratio`` is the linear downscale for ``latent``/``pixel``;
    ``policy`` (the config's ``SIGMA_POLICIES``), ``positions`` (``POSITIONS``) and ``attention`` (``ATTENTIONS``) apply to
    those two kinds only."""

    name: str
    kind: str
    ratio: float | None = None
    policy: str = "keep"
    positions: str = "plain"
    attention: str = "plain"

    def __post_init__(self) -> None:
        if self.kind not in ARM_KINDS:
            raise ValueError(f"arm {self.name}: kind {self.kind!r} is not allowed (allowed: {', '.join(ARM_KINDS)})")
        if self.policy not in POLICIES:
            raise ValueError(f"arm {self.name}: policy {self.policy!r} is not allowed (allowed: {', '.join(POLICIES)})")
        if self.positions not in POSITIONS:
            raise ValueError(f"arm {self.name}: positions {self.positions!r} is not allowed (allowed: {', '.join(POSITIONS)})")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"arm {self.name}: attention {self.attention!r} is not allowed (allowed: {', '.join(ATTENTIONS)})")
        if (self.ratio is not None) != (self.kind in SMALL_KINDS):
            raise ValueError(f"arm {self.name}: a ratio is required for kinds {', '.join(SMALL_KINDS)} and only for them")
        if self.kind not in SMALL_KINDS and self.setting != PLAIN:
            raise ValueError(
                f"arm {self.name}: a σ policy, interpolated positions or proportional attention apply to small-grid arms "
                f"({', '.join(SMALL_KINDS)}) only"
            )

    @property
    def compared(self) -> bool:
        """Whether the map reports a row for this arm (everything but the two native arms)."""
        return self.kind != "native"

    @property
    def setting(self) -> Setting:
        """(sigma_policy, positions, attention): the plugin setting a latent arm's windows are valid under."""
        return self.policy, self.positions, self.attention

    @property
    def routable(self) -> bool:
        """A latent arm under the plugin's default setting (keep, plain, plain): a route of ``windows.toml``."""
        return self.kind == "latent" and self.setting == PLAIN


def plain_sibling(arm: Arm, arms: Sequence[Arm]) -> Arm | None:
    """The keep/plain/plain latent arm of ``arm``'s ratio, which a variant (a latent arm under another
    setting, or a pixel arm) is read against; None for that arm itself, non-small arms, or when absent."""
    if arm.kind not in SMALL_KINDS or arm.routable:
        return None
    return next((a for a in arms if a.routable and a.ratio == arm.ratio), None)


def small_arm(kind: str, ratio: float, policy: str = "keep", positions: str = "plain", attention: str = "plain") -> Arm:
    """``latent_0.75``, ``latent_0.75@res_shift``, ``latent_0.75+interp``, ``latent_0.75+prop``, ``pixel_0.75@snr_match+interp``."""
    return Arm(f"{kind}_{ratio:g}{setting_suffix((policy, positions, attention))}", kind, ratio, policy, positions, attention)


def latent_arm(ratio: float, policy: str = "keep", positions: str = "plain", attention: str = "plain") -> Arm:
    return small_arm("latent", ratio, policy, positions, attention)


def pixel_arm(ratio: float) -> Arm:
    return small_arm("pixel", ratio)


REENC = Arm("reenc", "reenc")


def _choices(key: str, values: Sequence[str], allowed: Sequence[str]) -> list[str]:
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ValueError(f"{key}: {bad} not allowed (allowed: {', '.join(allowed)})")
    if len(set(values)) != len(values):
        raise ValueError(f"{key}: {list(values)} has duplicates")
    return list(values)


def build_arms(
    ratios: Sequence[float],
    pixel: bool = False,
    reenc: bool = False,
    policies: Sequence[str] = ("keep",),
    positions: Sequence[str] = ("plain",),
    attentions: Sequence[str] = ("plain",),
) -> tuple[Arm, ...]:
    """Native A, native B, per ratio (deepest first) one latent-area arm per (policy, positions, attention),
    then the optional VAE arms. The plain ``keep`` arm of each ratio is always included: it runs under
    the plugin's default setting and is the baseline its variants are read against."""
    if not ratios:
        raise ValueError("ratios: at least one route ratio is required (e.g. 0.875,0.75,0.5)")
    bad = [r for r in ratios if not 0.0 < r < 1.0]
    if bad:
        raise ValueError(f"ratios: {bad} must be strictly between 0 and 1 (a linear downscale)")
    if len(set(ratios)) != len(ratios):
        raise ValueError(f"ratios: {list(ratios)} has duplicates")
    policies = ["keep", *(p for p in _choices("policies", policies, POLICIES) if p != "keep")]
    positions = ["plain", *(p for p in _choices("positions", positions, POSITIONS) if p != "plain")]
    attentions = ["plain", *(a for a in _choices("attention", attentions, ATTENTIONS) if a != "plain")]
    ordered = sorted(ratios)
    arms = [Arm(NATIVE_A, "native"), Arm(NATIVE_B, "native")]
    arms += [latent_arm(r, pol, pos, att) for r in ordered for pol in policies for pos in positions for att in attentions]
    if pixel:
        arms += [pixel_arm(r) for r in ordered]
    if reenc:
        arms.append(REENC)
    return tuple(arms)


class MapBackend(Protocol):
    """What the estimator needs from a model + adapter + probe set.

    ``loss`` must draw its noise from torch's global RNG (the estimator seeds it per
    (image, bin, arm, draw) inside a fork) and return the training loss of exactly one draw at the
    given (drawn) σ, built by the trainer's own step code; the estimator differentiates it w.r.t.
    ``trainable_parameters()`` only. An arm's σ policy, positions and attention travel in its ``arm_input``.
    """

    rng_devices: Sequence[torch.device]

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
