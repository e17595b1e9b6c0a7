"""The gradient-map estimator: per (image, σ bin, arm), the adapter gradient summed over D draws,
debiased cosines against the native redraw floor, and per-bin paired statistics.

Why sums over draws: the map compares population-mean gradients (what a training run averages
over many steps), not single-draw gradients, so each arm's gradient is summed over D noise draws.

Why debias: a D-draw sum still carries noise, which pulls every cosine below the cosine of the
means, and more so on coarse grids (fewer tokens, noisier per-draw gradients). That fakes a floor.
Each arm's D draws are split into two interleaved halves; the cosine of the halves estimates the
reliability of a half-sum, Spearman–Brown lifts it to the full sum (ρ = 2r/(1+r)), and Spearman's
attenuation correction divides every cross-arm cosine by √(ρ_x·ρ_y) (anchor study §2.1).

The reported estimand (per image, per bin): the debiased excess of a route over the native
redraw floor, ĉ(A,B) − ½[ĉ(A,R) + ĉ(B,R)], paired on the image, averaged over images with its
standard error and one-sided (1−α) t upper bound. Images whose excess is non-finite (a
non-positive self-floor) or beyond ±1.5 are trimmed and counted, as in the anchor study.

With a ``reenc`` arm every other compared arm also gets the anchor paper's reported estimand, the
paired per-image excess over the re-encode control (excess_arm − excess_reenc, same trimming, SE and
bound): a VAE round trip alone already moves the gradient, and that part is not the route's fault.
Verdicts and windows stay on the excess over the native floor (conservative when reenc ≥ 0).

Every variant of a ratio (a latent arm under a σ policy or interpolated positions, a pixel arm) also
gets its paired per-image difference from the plain keep latent arm of that ratio (excess_arm −
excess_plain on the same images, bins and native arms) with a two-sided (1−α) t interval: whether
the variant is closer to native (negative) is a question about the difference, which the two
arms' separate bounds answer badly (the image-to-image spread and the shared floor cancel in the pair).
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch
from scipy import stats
from tqdm.auto import tqdm

from ..bins import SigmaBins
from ..certify_config import DEFAULT_MARGIN
from ..provenance import code_revision
from ..rng import forked, seed_forked
from .arms import NATIVE_A, NATIVE_B, PLAIN, Arm, MapBackend, plain_sibling
from .safe_read import TRIM, Family, safe_quantile


class MapInputError(ValueError):
    """Bad map inputs, all listed at once, raised before any model is built or run."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("map:\n  - " + "\n  - ".join(self.problems))


@dataclass(frozen=True)
class MapSettings:
    """Sample sizes and the verdict: a bin is safe when its safe read's upper bound < ``margin`` (cosine-distance
    units), false-safe ≤ ``alpha`` family-wise over every arm and bin (:func:`map_family`); ``simultaneous``:
    Bonferroni over them all instead of the chains from both ends."""

    margin: float = DEFAULT_MARGIN
    draws: int = 8
    images: int = 8
    seed: int = 0
    alpha: float = 0.05
    simultaneous: bool = False


def settings_problems(settings: MapSettings) -> list[str]:
    problems = []
    if settings.draws < 2 or settings.draws % 2:
        problems.append(f"draws: {settings.draws} must be an even number >= 2 (the self-floor splits the D draws into two equal halves)")
    if settings.images < 2:
        problems.append(f"images: {settings.images} must be >= 2 (the verdict needs a standard error over images)")
    if not 0.0 < settings.margin < 1.0:
        problems.append(f"margin: {settings.margin} must be strictly between 0 and 1 (cosine-distance units)")
    if not 0.0 < settings.alpha < 0.5:
        problems.append(f"alpha: {settings.alpha} must be strictly between 0 and 0.5")
    return problems


def check_inputs(arms: Sequence[Arm], bins: SigmaBins, settings: MapSettings) -> None:
    """Everything that can be checked without a model; raises :class:`MapInputError`."""
    problems = settings_problems(settings)
    names = [a.name for a in arms]
    if NATIVE_A not in names or NATIVE_B not in names:
        problems.append(f"arms: both native arms ({NATIVE_A}, {NATIVE_B}) are required: they are the redraw floor")
    if not any(a.compared for a in arms):
        problems.append("routes: no route to measure (give at least one ratio, e.g. --ratios 0.75)")
    if len(set(names)) != len(names):
        problems.append(f"arms: duplicate names in {names}")
    if not isinstance(bins, SigmaBins):
        problems.append(f"bins: {bins!r} is not a SigmaBins grid")
    if problems:
        raise MapInputError(problems)


def check_backend(backend: MapBackend, arms: Sequence[Arm], settings: MapSettings) -> list[torch.nn.Parameter]:
    """Backend-side checks; returns the trainable parameters the gradient is taken w.r.t."""
    problems = []
    params = [p for p in backend.trainable_parameters() if p.requires_grad]
    if not params:
        problems.append("model: no trainable parameters (the map measures the adapter's gradient; attach a trainable adapter)")
    for arm in arms:
        reason = backend.unsupported(arm)
        if reason:
            problems.append(reason)
    if backend.num_images() < settings.images:
        problems.append(f"images: {settings.images} requested but the backend has {backend.num_images()} probe images")
    if problems:
        raise MapInputError(problems)
    return params


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([p & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


def arm_key(arm: Arm) -> int:
    """Stable per-arm stream id: an arm's noise does not depend on which other arms are measured."""
    return zlib.crc32(arm.name.encode())


Grads = Sequence[torch.Tensor]  # one draw's gradient: a tensor per adapter parameter, on that parameter's device


def grad_dot(xs: Grads, ys: Grads) -> float:
    """Σ_k ⟨x_k, y_k⟩ over per-parameter tensors, each summed in float64 on its own device (products in
    float32 or wider); one host sync per device, no copy of a gradient leaves its device."""
    per_device: dict[torch.device, list[torch.Tensor]] = {}
    for x, y in zip(xs, ys, strict=True):
        wide = torch.promote_types(x.dtype, torch.float32)
        per_device.setdefault(x.device, []).append((x.to(wide) * y.to(wide)).sum(dtype=torch.float64))
    return math.fsum(float(torch.stack(parts).sum()) for parts in per_device.values())


def _cos(xx: float, yy: float, xy: float) -> float:
    """⟨x, y⟩ / (‖x‖·‖y‖) from the three inner products; NaN when a norm is 0."""
    den = math.sqrt(xx * yy)
    return xy / den if den > 0 else math.nan


@dataclass
class Cell:
    """One (image, bin): what the statistics need, the gradient vectors themselves are dropped."""

    image: int
    bin: int
    half_cos: dict[str, float]  # arm -> cos(even-draw sum, odd-draw sum)
    cos: dict[str, float]  # "native_a|arm" / "native_b|arm" -> cos of the full D-draw sums
    norm: dict[str, float]  # arm -> ‖D-draw sum‖ / D


def reliability(half_cos: float) -> float:
    """Spearman–Brown: reliability of the full sum from the cosine of its two halves (NaN if ≤ 0)."""
    if not half_cos > 0.0:
        return math.nan
    return 2.0 * half_cos / (1.0 + half_cos)


def excess(cell: Cell, arm: str, debias: bool = True) -> float:
    """ĉ(A,B) − ½[ĉ(A,arm) + ĉ(B,arm)]: the arm's gap over the redraw floor, paired on the image."""
    c_ab, c_ax, c_bx = cell.cos[f"{NATIVE_A}|{NATIVE_B}"], cell.cos[f"{NATIVE_A}|{arm}"], cell.cos[f"{NATIVE_B}|{arm}"]
    if debias:
        ra, rb, rx = (reliability(cell.half_cos[n]) for n in (NATIVE_A, NATIVE_B, arm))
        c_ab /= math.sqrt(ra * rb)
        c_ax /= math.sqrt(ra * rx)
        c_bx /= math.sqrt(rb * rx)
    return c_ab - 0.5 * (c_ax + c_bx)


def debiased_floor(cell: Cell) -> float:
    """ĉ(A,B): should be ≈ 1 when debiasing works (the anchor's native self-floor was 1.005)."""
    ra, rb = reliability(cell.half_cos[NATIVE_A]), reliability(cell.half_cos[NATIVE_B])
    return cell.cos[f"{NATIVE_A}|{NATIVE_B}"] / math.sqrt(ra * rb)


def _other_leaves(loss: torch.Tensor, params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    """The leaves of ``loss``'s graph, outside ``params``, that a backward accumulates into (a host that sets
    ``requires_grad`` on its inputs for checkpointing, train_network.py ``get_noise_pred_and_target``)."""
    mine = {id(p) for p in params}
    seen, stack, leaves = set(), [loss.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: its leaf
        if isinstance(variable, torch.Tensor) and id(variable) not in mine:
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def param_grads(loss: torch.Tensor, params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    """d loss / d params, one tensor per parameter in its dtype on its device (zeros where unused); every
    ``.grad`` is as it was before (the model stays clean).

    Measured with ``loss.backward()``, every parameter's ``.grad`` (and that of the graph's other leaves) set
    aside as None before and put back after, not with ``torch.autograd.grad``: a reentrant checkpoint
    (``torch.utils.checkpoint(use_reentrant=True)``, sd-scripts' SDXL UNet) refuses ``autograd.grad``, and a
    checkpointer that runs its block under ``no_grad`` and calls ``torch.autograd.backward`` itself (Anima's
    ``--unsloth_offload_checkpointing``) leaves its block's adapters out of ``autograd.grad``'s answer (zeros)
    and writes their gradient into ``.grad``. A backward reaches every parameter through either. The leaves'
    own ``.grad`` tensors are never written (None during the backward), so accumulated micro-batch gradients
    come back bitwise. A DDP-wrapped model's gradient hooks would fire on this backward: the in-run
    measurements run on one process only (``hosts/kohya/probes.py`` refuses more).
    """
    params = list(params)
    if any(getattr(p, "_post_accumulate_grad_hooks", None) for p in params):
        raise RuntimeError(
            "measurement: an adapter parameter has a post-accumulate-grad hook (a fused backward pass steps the optimizer "
            "there): the measurement's backward would run it"
        )
    leaves = params + _other_leaves(loss, params)
    saved = [leaf.grad for leaf in leaves]
    try:
        for leaf in leaves:
            leaf.grad = None
        loss.backward()
        grads = [p.grad for p in params]
    finally:
        for leaf, grad in zip(leaves, saved, strict=True):
            leaf.grad = grad
    return [(g if g is not None else torch.zeros_like(p)).detach() for g, p in zip(grads, params, strict=True)]


def collect(
    backend: MapBackend,
    arms: Sequence[Arm],
    bins: SigmaBins,
    settings: MapSettings,
    progress: bool = True,
    done: Sequence[Cell] = (),
    on_cell: Callable[[Cell], None] | None = None,
) -> list[Cell]:
    """Run every (image, bin, arm, draw) once; deterministic given ``settings.seed``.

    ``done`` are cells already measured (a resumed map, ``journal.py``): they are kept, not measured
    again; ``on_cell`` sees every newly finished cell (the journal appends it).

    Noise is seeded per (image, bin, arm, draw) and σ per (image, bin, draw): all arms of a cell
    see the same σ values, each with its own noise (arms on different grids cannot share noise).
    Memory: each draw is added to its arm's half-sum as it is taken (:func:`half_sums`); a cell keeps the two
    native arms' full sums and the current arm's two half-sums, whatever the number of arms, images and bins.
    """
    check_inputs(arms, bins, settings)
    params = check_backend(backend, arms, settings)
    ordered = sorted(arms, key=lambda a: a.kind != "native")  # the natives first: every other arm is compared with them
    kept = {(c.image, c.bin): c for c in done}
    cells: list[Cell] = []
    bar = tqdm(total=settings.images * len(bins), initial=len(kept), desc="map", unit="cell", disable=not progress)
    for image in range(settings.images):
        if all((image, b) in kept for b in range(len(bins))):
            cells += [kept[(image, b)] for b in range(len(bins))]
            continue
        inputs = {arm.name: backend.arm_input(image, arm) for arm in arms}
        for b in range(len(bins)):
            if (image, b) in kept:
                cells.append(kept[(image, b)])
                continue
            bar.set_postfix(image=image, bin=bins.label(b))
            jitter = [float(np.random.default_rng(_seed(settings.seed, image, b, d, 0x51)).random()) for d in range(settings.draws)]
            sigmas = bins.sigmas(b, jitter)
            natives: dict[str, tuple[list[torch.Tensor], float]] = {}  # native arm -> (its full sum, its squared norm)
            cell = Cell(image, b, {}, {}, {})
            for arm in ordered:
                draws = _draws(backend, params, settings, image, b, arm, inputs[arm.name], sigmas)
                full, square = half_sums(cell, arm.name, draws, settings.draws)
                for ref, (ref_full, ref_square) in natives.items():
                    cell.cos[f"{ref}|{arm.name}"] = _cos(ref_square, square, grad_dot(ref_full, full))
                if arm.kind == "native":
                    natives[arm.name] = (full, square)
                del full  # a route's sum is not alive while the next arm draws
            cells.append(cell)
            if on_cell is not None:
                on_cell(cell)
            bar.update(1)
    bar.close()
    return cells


def _draws(
    backend: MapBackend, params: Sequence[torch.nn.Parameter], settings: MapSettings, image: int, bin_: int, arm: Arm, arm_input: Any,
    sigmas: Sequence[float],
) -> Iterator[Grads]:  # fmt: skip
    """One arm's D draws of one (image, bin), one at a time, each in a forked RNG seeded per (image, bin, arm, draw)."""
    for d, sigma in enumerate(sigmas):
        with forked(backend.rng_devices):
            seed_forked(_seed(settings.seed, image, bin_, arm_key(arm), d), backend.rng_devices)
            loss = backend.loss(image, arm_input, sigma)
        yield param_grads(loss, params)


def half_sums(cell: Cell, arm: str, draws: Iterable[Grads], count: int) -> tuple[list[torch.Tensor], float]:
    """Reduce one arm's draws as they come (a generator: one draw alive at a time) to the two interleaved
    half-sums (per parameter, float32 or wider, on the gradients' devices); record the half-sum cosine and
    the mean norm in ``cell``; return the full sum (made in place of the even half) and its squared norm."""
    halves: list[list[torch.Tensor]] = []
    for d, grads in enumerate(draws):
        if d < 2:
            halves.append([g.to(torch.promote_types(g.dtype, torch.float32), copy=True) for g in grads])
        else:
            for total, g in zip(halves[d % 2], grads, strict=True):
                total.add_(g)
        del grads  # not alive while the next draw is taken
    even, odd = halves
    ee, oo, eo = grad_dot(even, even), grad_dot(odd, odd), grad_dot(even, odd)
    cell.half_cos[arm] = _cos(ee, oo, eo)
    for total, g in zip(even, odd, strict=True):
        total.add_(g)
    square = ee + oo + 2.0 * eo
    cell.norm[arm] = math.sqrt(max(square, 0.0)) / count
    return even, square


@dataclass(frozen=True)
class BinResult:
    """One (arm, bin) row of the map. ``excess``/``se``/``ub`` are debiased; ``raw_*`` are not."""

    arm: str
    kind: str
    ratio: float | None
    bin: int
    lo: float
    hi: float
    center: float
    endpoint: bool
    n: int
    trimmed: int
    excess: float
    se: float
    ub: float
    raw_excess: float
    raw_se: float
    floor_cos: float
    floor_debiased: float
    rel_native: float
    rel_arm: float
    norm_native: float
    norm_arm: float
    safe: bool
    over_reenc: float = math.nan  # paired excess over the reenc arm (NaN when the map has none)
    over_reenc_se: float = math.nan
    over_reenc_ub: float = math.nan
    over_reenc_n: int = 0
    vs_plain: float = math.nan  # paired excess minus the plain keep latent arm's of the ratio (NaN: no sibling)
    vs_plain_se: float = math.nan
    vs_plain_lo: float = math.nan  # two-sided (1−α) t interval
    vs_plain_hi: float = math.nan
    vs_plain_n: int = 0
    level: float = math.nan  # the false-safe level ``ub`` was read at (its share of the map's α)


def _mean_se(values: Sequence[float]) -> tuple[float, float, int, int]:
    kept = [v for v in values if math.isfinite(v) and abs(v) <= TRIM]
    n = len(kept)
    if n == 0:
        return math.nan, math.nan, 0, len(values)
    mean = float(np.mean(kept))
    se = float(np.std(kept, ddof=1) / math.sqrt(n)) if n > 1 else math.nan
    return mean, se, n, len(values) - n


def _nanmean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.mean(finite)) if finite else math.nan


def _t_half_width(se: float, n: int, tail: float) -> float:
    """t(1−tail; n−1)·SE; +inf when it cannot be formed (n < 2)."""
    if n < 2 or not math.isfinite(se):
        return math.inf
    return float(stats.t.ppf(1.0 - tail, n - 1)) * se


def upper_bound(mean: float, se: float, n: int, alpha: float) -> float:
    """One-sided (1−α) t upper bound of a mean; +inf when it cannot be formed (n < 2)."""
    return mean + _t_half_width(se, n, alpha)


def interval(mean: float, se: float, n: int, alpha: float) -> tuple[float, float]:
    """Two-sided (1−α) t interval of a mean; NaN without a mean, unbounded when it cannot be formed (n < 2)."""
    if n == 0:
        return math.nan, math.nan
    half = _t_half_width(se, n, alpha / 2)
    return mean - half, mean + half


NO_PAIR = (math.nan, math.nan, 0, 0)


def paired(group: Sequence[Cell], arm: str, ref: str | None) -> tuple[float, float, int, int]:
    """Mean, SE, kept and trimmed n of the per-image excess(arm) − excess(ref) over one bin's cells
    (trimmed like the excess); :data:`NO_PAIR` without a reference or against itself."""
    if ref is None or ref == arm:
        return NO_PAIR
    return _mean_se([excess(c, arm) - excess(c, ref) for c in group])


def summarize(cells: Sequence[Cell], arms: Sequence[Arm], bins: SigmaBins, settings: MapSettings) -> list[BinResult]:
    """Per compared arm and bin: paired excess statistics and the verdict ``ub < margin``, ``ub`` the safe read
    (``sequential.read``'s) at the test's level of :func:`map_family`: false-safe ≤ α over every arm and bin."""
    alpha = settings.alpha
    safe_reads = read_family(cells, map_family(arms, bins, settings), settings.margin)
    by_bin: dict[int, list[Cell]] = {}
    for cell in cells:
        by_bin.setdefault(cell.bin, []).append(cell)
    reenc = next((a.name for a in arms if a.kind == "reenc"), None)
    plains = {a.name: sibling.name for a in arms if (sibling := plain_sibling(a, arms))}
    rows = []
    for arm in (a for a in arms if a.compared):
        for b in range(len(bins)):
            group = by_bin.get(b, [])
            mean, se, n, trimmed = _mean_se([excess(c, arm.name) for c in group])
            raw_mean, raw_se, _, _ = _mean_se([excess(c, arm.name, debias=False) for c in group])
            ub, level = safe_reads[arm.name, b]
            over = paired(group, arm.name, reenc)
            vs = paired(group, arm.name, plains.get(arm.name))
            vs_lo, vs_hi = interval(*vs[:3], alpha)
            lo, hi = bins.bounds(b)
            rows.append(
                BinResult(
                    arm=arm.name,
                    kind=arm.kind,
                    ratio=arm.ratio,
                    bin=b,
                    lo=lo,
                    hi=hi,
                    center=bins.center(b),
                    endpoint=bins.is_endpoint(b),
                    n=n,
                    trimmed=trimmed,
                    excess=mean,
                    se=se,
                    ub=ub,
                    level=level,
                    raw_excess=raw_mean,
                    raw_se=raw_se,
                    floor_cos=_nanmean([c.cos[f"{NATIVE_A}|{NATIVE_B}"] for c in group]),
                    floor_debiased=_nanmean([debiased_floor(c) for c in group]),
                    rel_native=_nanmean([reliability(c.half_cos[k]) for c in group for k in (NATIVE_A, NATIVE_B)]),
                    rel_arm=_nanmean([reliability(c.half_cos[arm.name]) for c in group]),
                    norm_native=_nanmean([c.norm[k] for c in group for k in (NATIVE_A, NATIVE_B)]),
                    norm_arm=_nanmean([c.norm[arm.name] for c in group]),
                    safe=ub < settings.margin,
                    over_reenc=over[0],
                    over_reenc_se=over[1],
                    over_reenc_ub=upper_bound(*over[:3], alpha) if over[2] else math.nan,
                    over_reenc_n=over[2],
                    vs_plain=vs[0],
                    vs_plain_se=vs[1],
                    vs_plain_lo=vs_lo,
                    vs_plain_hi=vs_hi,
                    vs_plain_n=vs[2],
                )
            )
    return rows


def read_family(cells: Sequence[Cell], family: Family, margin: float) -> dict[tuple[str, int], tuple[float, float]]:
    """Every (arm, bin) key's safe read, (upper bound, level): the map has all its evidence at once, so each key is
    read at the level it has once nothing more can settle safe (rounds over the keys until no new safe read; a
    key's level only grows as others settle safe, ``safe_read.Family``), its bound read at that level."""
    stats_of = {key: _mean_se([excess(c, key[0]) for c in cells if c.bin == key[1]])[:3] for key in family.keys}

    def safe_read(key: tuple[str, int]) -> tuple[float, float]:
        (mean, se, n), level = stats_of[key], family.level(key)
        c = safe_quantile(level, n, margin)
        return (mean + c * se if n >= 2 and math.isfinite(se) and math.isfinite(c) else math.inf), level

    reads: dict[tuple[str, int], tuple[float, float]] = {}
    settled = True
    while settled:
        settled = False
        for key in (k for k in family.keys if k not in family.settled):
            reads[key] = safe_read(key)
            if reads[key][0] < margin:
                family.settle(key, True)
                settled = True
    for key in (k for k in family.keys if k not in family.settled):
        family.settle(key, False)
    return reads


def family_chains(arms: Sequence[Arm], bins: SigmaBins) -> list[tuple[list[tuple[str, int]], list[tuple[str, int]]]]:
    """Two chains per compared arm through its (arm, bin) tests: from σ = 1 down (the endpoint bin first), and
    from the lowest bin up (the endpoint last)."""
    order = ([bins.n_segmented] if bins.endpoint else []) + list(range(bins.n_segmented - 1, -1, -1))
    return [([(a.name, b) for b in order], [(a.name, b) for b in reversed(order)]) for a in arms if a.compared]


def map_family(arms: Sequence[Arm], bins: SigmaBins, settings: MapSettings) -> Family:
    """The map's family of safe reads: per compared arm a chain from σ = 1 down and one from its lowest bin up
    (``safe_read.Family.both_ends``: windows at either end keep most of the arm's α), or with ``simultaneous``
    Bonferroni over every (arm, bin) (no order: α/K each)."""
    pairs = family_chains(arms, bins)
    if settings.simultaneous:
        return Family.bonferroni([key for down, _ in pairs for key in down], settings.alpha)
    return Family.both_ends(pairs, settings.alpha)


@dataclass
class MapResult:
    """Everything a map run produced; ``provenance`` goes into every output file."""

    bins: SigmaBins
    arms: tuple[Arm, ...]
    settings: MapSettings
    rows: list[BinResult]
    cells: list[Cell]
    provenance: dict[str, Any] = field(default_factory=dict)

    def routes(self, setting: tuple[str, str] = PLAIN) -> list[Arm]:
        """The latent arms measured under one (sigma_policy, positions, attention) setting: one windows TOML's routes."""
        return [a for a in self.arms if a.kind == "latent" and a.setting == setting]

    def route_settings(self) -> list[tuple[str, str]]:
        """Every (sigma_policy, positions, attention) setting the latent arms were measured under, first seen first."""
        return list(dict.fromkeys(a.setting for a in self.arms if a.kind == "latent"))

    def row(self, arm: str, bin_: int) -> BinResult:
        return next(r for r in self.rows if r.arm == arm and r.bin == bin_)

    def to_json(self) -> dict[str, Any]:
        return {
            "provenance": self.provenance,
            "settings": asdict(self.settings),
            "bins": {"edges": list(self.bins.edges), "endpoint": self.bins.endpoint},
            "arms": [asdict(a) for a in self.arms],
            "rows": [asdict(r) for r in self.rows],
            "cells": [asdict(c) for c in self.cells],
        }

    @classmethod
    def from_json(cls, blob: dict[str, Any], **verdict: Any) -> MapResult:
        """Rebuild a result from :meth:`to_json` output (nulls are NaN again). ``verdict`` overrides
        ``margin``/``alpha``/``simultaneous``: every verdict is re-derived, no gradient recomputed."""

        def nan(d: dict[str, Any]) -> dict[str, float]:
            return {k: math.nan if v is None else float(v) for k, v in d.items()}

        bins = SigmaBins(tuple(blob["bins"]["edges"]), blob["bins"]["endpoint"])
        arms = tuple(Arm(**a) for a in blob["arms"])
        settings = replace(MapSettings(**blob["settings"]), **verdict)
        cells = [Cell(c["image"], c["bin"], nan(c["half_cos"]), nan(c["cos"]), nan(c["norm"])) for c in blob["cells"]]
        return cls(bins, arms, settings, summarize(cells, arms, bins, settings), cells, dict(blob["provenance"]))


def run_map(
    backend: MapBackend,
    arms: Sequence[Arm],
    bins: SigmaBins,
    settings: MapSettings,
    progress: bool = True,
    provenance: dict[str, Any] | None = None,
    done: Sequence[Cell] = (),
    on_cell: Callable[[Cell], None] | None = None,
) -> MapResult:
    """Collect and summarize; records wall time and the backend's description in the provenance
    (``wall_s``: this process's collection; ``done`` and ``on_cell`` as :func:`collect`)."""
    t0 = time.perf_counter()
    cells = collect(backend, arms, bins, settings, progress, done, on_cell)
    prov = {
        **(provenance or {}),
        "backend": backend.describe(),
        "wall_s": round(time.perf_counter() - t0, 2),
        "code_revision": code_revision(),
    }
    return MapResult(bins, tuple(arms), settings, summarize(cells, arms, bins, settings), cells, prov)
