"""``positions = "interpolate"``: a routed step's tokens get positions scaled to the native span.

Convention: position interpolation (Chen et al. 2023, "PI"), id' = id · N_native / N_small per axis.
Integer ids are top-left anchored: native token j is the cell [j, j + 1). Small token i stands
for the native span [i·k, (i + 1)·k) with k = N_native / N_small, so i·k is the anchor of the area
it stands for and the small cells tile [0, N_native) like the native ones (``grid.area_downsample``
averages exactly that span, at integer and fractional k alike). The token pitch is then k, the true spacing of
the averaged areas: RoPE attention depends on position differences, which are now the native
ones. The endpoint convention id·(N_native − 1)/(N_small − 1) would stretch every difference by
(N_native − 1)/(N_small − 1) ≠ k. PI is also purely multiplicative, so tokens at 0 on the spatial
axes (Flux's text ids, Lumina's caption tokens) keep their positions.

Handles, by the position-handle kind of the architecture's record (``arch.ArchSpec.positions``),
each replaced only for the routed forward:

- ``img_ids`` (Flux / Chroma, the lab): a module function ``prepare_img_ids(batch, h, w)`` →
  (B, h·w, 3) ids, channel 1 row, 2 col → :func:`img_ids_scope`.
- ``rope_embedder`` (Lumina): the ``NextDiT.rope_embedder`` instance attribute, called with int ids
  (B, L, 3) (axis 0 caption index, 1 row, 2 col) and gathering from an integer table, so scaled
  (fractional) ids need RoPE evaluated at real positions with the embedder's own
  ``theta``/``axes_dims`` → :func:`rope_embedder_scope`.
- ``rope_angles`` (Anima): ``pos_embedder.generate_embeddings(B_T_H_W_C, fps)`` returns RoPE *angles*
  laid out over (T, H, W); angles are linear in position, so each angle column is scaled by the
  factor of the axis it varies along → :func:`rope_angles_scope`.
- ``meshgrid`` (HunyuanImage): ``get_rotary_pos_embed((th, tw))`` builds its positions with the
  module function ``get_meshgrid_nd`` ([2, th, tw]) → :func:`meshgrid_scope`. (The trainer does not
  pass the model's ``rotary_pos_emb_cache``; if a host revision does, its entries are keyed by grid
  size only and a routed step would poison it for native buckets of that size.)
- None (SD3's fixed sin-cos table centre-cropped to the grid, the UNets without positions): not
  supported (``positions = "plain"`` only).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from ..arch import ARCHS, ArchSpec
from ..config import POSITIONS as POSITIONS  # re-exported: the allowed values live with the config schema
from ..scope import swap_attr

Factors = tuple[float, float]


def token_grid(latent_hw: tuple[int, int], arch: ArchSpec) -> tuple[int, int]:
    """Token rows and columns a DiT sees for a latent grid (patchify / Flux 2×2 packing)."""
    return latent_hw[0] // arch.patch, latent_hw[1] // arch.patch


def pi_factors(native_tokens_hw: tuple[int, int], small_tokens_hw: tuple[int, int]) -> Factors:
    """Per-axis PI factors (rows, cols) = N_native / N_small: the small grid's pitch in native tokens."""
    return native_tokens_hw[0] / small_tokens_hw[0], native_tokens_hw[1] / small_tokens_hw[1]


def interpolate_ids(ids: torch.Tensor, factors: Factors, axes: tuple[int, int] = (1, 2)) -> torch.Tensor:
    """Scale the row/col channels (last dim) of position ids; any leading dims; dtype kept."""
    scale = torch.ones(ids.shape[-1], dtype=torch.float64)
    scale[axes[0]], scale[axes[1]] = factors
    return (ids.double() * scale.to(ids.device)).to(ids.dtype)


def img_ids_scope(module: Any, native_tokens_hw: tuple[int, int], attr: str = "prepare_img_ids") -> AbstractContextManager:
    """Flux-family: ``module.prepare_img_ids(batch, h, w)`` returns ids interpolated to the native grid.

    The factors come from the (h, w) of each call, so a call at the native grid is unchanged.
    """
    original = getattr(module, attr)

    def prepare_img_ids(batch_size: int, packed_latent_height: int, packed_latent_width: int) -> torch.Tensor:
        ids = original(batch_size, packed_latent_height, packed_latent_width)
        return interpolate_ids(ids, pi_factors(native_tokens_hw, (packed_latent_height, packed_latent_width)))

    return swap_attr(module, attr, prepare_img_ids)


def continuous_rope(axes_dims: Sequence[int], theta: float, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """Complex RoPE factors e^{i·p·θ^(−2j/d)} per axis, concatenated, at real-valued positions p.

    Equals a table of the same constants gathered at integer positions, and is defined between them.
    """

    def rope(ids: torch.Tensor) -> torch.Tensor:
        parts = []
        for axis, dim in enumerate(axes_dims):
            freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=ids.device) / dim))
            angles = ids[..., axis : axis + 1].double() * freqs
            parts.append(torch.polar(torch.ones_like(angles), angles))
        return torch.cat(parts, dim=-1).to(dtype)

    return rope


def rope_embedder_scope(model: Any, factors: Factors, attr: str = "rope_embedder") -> AbstractContextManager:
    """Lumina: ``model.rope_embedder(ids)`` evaluated at PI-scaled (real) row/col positions.

    The replacement reads ``theta``, ``axes_dims`` and the table dtype from the model's own
    embedder, so it equals the host's at factor 1.
    """
    embedder = getattr(model, attr)
    rope = continuous_rope(embedder.axes_dims, embedder.theta, embedder.freqs_cis[0].dtype)
    return swap_attr(model, attr, lambda ids: rope(interpolate_ids(ids.double(), factors)))


def rope_angles_scope(pos_embedder: Any, factors: Factors, attr: str = "generate_embeddings") -> AbstractContextManager:
    """Anima: scale the angles ``pos_embedder.generate_embeddings(B_T_H_W_C, ...)`` returns.

    The output is angles over a (T, H, W) token grid, flattened ``(t h w) … d``. A column that varies
    along H is a row-frequency column and is multiplied by the row factor, likewise W; columns that
    vary along neither (time, or an axis of length 1) are left alone.
    """
    original = getattr(pos_embedder, attr)

    def generate_embeddings(B_T_H_W_C: Sequence[int], *args: Any, **kwargs: Any) -> torch.Tensor:
        out = original(B_T_H_W_C, *args, **kwargs)
        _, t, h, w, _ = B_T_H_W_C
        grid = out.reshape(t, h, w, out.shape[-1])
        along_h = (grid.diff(dim=1) != 0).flatten(0, 2).any(0) if h > 1 else torch.zeros(out.shape[-1], dtype=torch.bool, device=out.device)
        along_w = (grid.diff(dim=2) != 0).flatten(0, 2).any(0) if w > 1 else torch.zeros_like(along_h)
        if bool((along_h & along_w).any()):
            raise ValueError("positions=interpolate: an angle column varies along both H and W; not an axis-separable RoPE")
        scale = torch.ones(out.shape[-1], dtype=out.dtype, device=out.device)
        scale[along_h], scale[along_w] = factors
        return out * scale

    return swap_attr(pos_embedder, attr, generate_embeddings)


def meshgrid_scope(module: Any, factors: Factors, attr: str = "get_meshgrid_nd") -> AbstractContextManager:
    """HunyuanImage: ``module.get_meshgrid_nd(sizes, dim)`` returns a [dim, H, W] grid scaled per axis."""
    original = getattr(module, attr)

    def get_meshgrid_nd(start: Any, dim: int = 2) -> torch.Tensor:
        grid = original(start, dim=dim)
        scale = torch.tensor(factors, dtype=torch.float64).view(-1, *([1] * (grid.ndim - 1)))
        return (grid.double() * scale).to(grid.dtype)

    return swap_attr(module, attr, get_meshgrid_nd)


def require_interpolate(arch: ArchSpec) -> None:
    """Raise unless ``arch`` has a position handle ``positions = "interpolate"`` can scale."""
    if arch.positions is None:
        allowed = ", ".join(name for name, spec in ARCHS.items() if spec.positions is not None)
        raise ValueError(
            f"positions: 'interpolate' is not available for {arch.name} (allowed: {allowed}; its positions are a fixed table "
            "or it has none); use positions = 'plain'"
        )


def positions_scope(
    arch: ArchSpec, native_latent_hw: tuple[int, int], small_latent_hw: tuple[int, int], *, model: Any = None, module: Any = None
) -> AbstractContextManager:
    """The interpolate scope for one routed forward of ``arch``.

    ``module``: the module holding an ``img_ids`` or ``meshgrid`` handle; ``model``: the unwrapped
    denoiser holding a ``rope_embedder`` or ``rope_angles`` handle. A null context when the grids
    are the same.
    """
    require_interpolate(arch)
    native = token_grid(native_latent_hw, arch)
    small = token_grid(small_latent_hw, arch)
    factors = pi_factors(native, small)
    if all(math.isclose(f, 1.0) for f in factors):
        return nullcontext()
    if arch.positions == "img_ids":
        return img_ids_scope(_need(module, "module", arch), native)
    if arch.positions == "rope_embedder":
        return rope_embedder_scope(_need(model, "model", arch), factors)
    if arch.positions == "rope_angles":
        return rope_angles_scope(_need(model, "model", arch).pos_embedder, factors)
    return meshgrid_scope(_need(module, "module", arch), factors)


def _need(value: Any, name: str, arch: ArchSpec) -> Any:
    if value is None:
        raise ValueError(f"positions_scope: {arch.name} needs {name}=")
    return value
