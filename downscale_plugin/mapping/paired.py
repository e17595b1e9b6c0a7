"""Paired noise: a route's small-grid noise coupled to a native arm's noise, exact in distribution.

Why: the certifier compares a routed step's gradient with the native one. Two independent noise
draws make the two gradients differ mostly by noise; coupling the noises (the small grid sees the
native noise's own coarse content) removes that shared part from their difference, so fewer draws
settle a bin (docs/FIDELITY.md, "Certification at a tenth of the cost").

Construction, at any ratio: let D = W_h ⊗ W_w be the exact area filter of ``grid.area_weights``
(rows overlap at a fractional ratio, so D·Dᵀ is not a multiple of the identity) and
M = (D·Dᵀ)^(−1/2)·D, whose rows are orthonormal (M·Mᵀ = I). The native noise ε ~ N(0, I) is drawn
first, and each route's noise is ε_r = M·ε. Then

- ε_r ~ N(0, M·Mᵀ) = N(0, I): the unit-variance noise the host draws at the small grid, exactly;
- given ε_r, ε ~ N(Mᵀ·ε_r, I − Mᵀ·M): the conditional Gaussian of the native noise given its
  whitened coarse part, so "draw ε_r, then ε conditionally" is the same joint law;
- D·ε = (D·Dᵀ)^(1/2)·ε_r: the exact area-downsample of the native noise is the small-grid noise
  scaled to the downsample's own covariance (at an integer ratio 1/k that is ε_r / k).

One native draw couples every route at once (each pair has the law above), so routes measured in
the same bin share their native arm.

The host draws its noise itself (``torch.randn_like(latents)`` in every trainer contract the plugin
supports, docs/ARCHITECTURE.md §2), so :func:`injected_noise` hands it the prepared tensor for the
step's first such call and checks the host made it: a host that drew its noise
another way fails loudly instead of silently measuring unpaired noise. A call inside a fork opened
within the scope (``rng.forked``: the plugin's own dry runs, e.g. the step hook's ``sampler.first()``,
which mimics the host's noise draw to advance the RNG) is not the step's noise and gets torch's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import torch

from ..grid import area_weights
from ..rng import fork_depth


@lru_cache(maxsize=64)
def whitened_filter(n_in: int, n_out: int) -> torch.Tensor:
    """(n_out, n_in) float64 M₁ = (W·Wᵀ)^(−1/2)·W for one axis's area weights W: orthonormal rows."""
    w = area_weights(n_in, n_out)
    evals, evecs = torch.linalg.eigh(w @ w.T)
    inv_sqrt = evecs @ torch.diag(evals.rsqrt()) @ evecs.T
    return inv_sqrt @ w


def coupled_small_noise(native_noise: torch.Tensor, small_hw: tuple[int, int]) -> torch.Tensor:
    """ε_r = M·ε over the last two dims (separable: M_h·ε·M_wᵀ), in the native noise's dtype."""
    h, w = native_noise.shape[-2:]
    rows, cols = whitened_filter(h, small_hw[0]), whitened_filter(w, small_hw[1])
    small = rows.to(native_noise.device) @ native_noise.double() @ cols.to(native_noise.device).T
    return small.to(native_noise.dtype)


def downsample_covariance_sqrt(n_in: int, n_out: int) -> torch.Tensor:
    """(W·Wᵀ)^(1/2) of one axis: D·ε = S_h·ε_r·S_wᵀ for coupled noise (the identity the tests check)."""
    w = area_weights(n_in, n_out)
    evals, evecs = torch.linalg.eigh(w @ w.T)
    return evecs @ torch.diag(evals.sqrt()) @ evecs.T


class NoiseNotDrawn(RuntimeError):
    """The host did not draw the injected noise the way paired noise needs."""


@contextmanager
def injected_noise(make: Callable[[tuple[int, ...]], torch.Tensor]) -> Iterator[None]:
    """Within the scope, the first ``torch.randn_like(x)`` outside a dry-run fork returns ``make(x.shape)``
    (in x's dtype and device, or the call's own); every other call is torch's own. Raises
    :class:`NoiseNotDrawn` when the step drew no such ``randn_like`` noise."""
    original = torch.randn_like
    used: list[tuple[int, ...]] = []
    depth = fork_depth()

    def randn_like(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if used or fork_depth() > depth:
            return original(x, *args, **kwargs)
        used.append(tuple(x.shape))
        noise = make(tuple(x.shape))
        if tuple(noise.shape) != tuple(x.shape):
            raise NoiseNotDrawn(f"paired noise: prepared noise {tuple(noise.shape)} for a draw of shape {tuple(x.shape)}")
        return noise.to(device=kwargs.get("device") or x.device, dtype=kwargs.get("dtype") or x.dtype)

    torch.randn_like = randn_like
    try:
        yield
    finally:
        torch.randn_like = original
    if not used:
        raise NoiseNotDrawn(
            "paired noise: the step drew no torch.randn_like noise; this host draws its noise another way and cannot be paired"
        )
