"""A concept the lab DiT never saw in pretraining, for LoRA studies that can see a quality loss.

A LoRA teaches its base model something new; the lab corpus (``data.LabData``) is what the base
was pretrained on, so a fine-tune on it has almost nothing to learn and every arm difference is noise
around a fitted model. The "hatched posters" here are procedurally generated and unlike any lab
source (photographs, dead leaves, 1/f noise), captioned with one text class the base never saw (a
trigger word), encoded with the pretraining corpus' own codec. Each poster has:

- low-frequency content, which high-σ steps learn: a teal→orange gradient at a random angle and 3–5
  large cream ellipses (the layout);
- fine detail at the native latent grid's scale, which low-σ steps learn: a 45° hatch of 2 px dark
  lines inside the ellipses and a lattice of 2 px marks on the background, both with a period of
  8 px. The codec packs 4×4 px into a latent cell, so the period is two cells: the native grid's
  Nyquist frequency. An exact area downsample to a smaller grid averages each period to its mean
  (at 0.5 exactly; at 0.75 and 0.875 mostly, aliasing the rest), so a step at any smaller grid
  cannot train it, and a LoRA trained only at low resolution cannot reach native quality.

Training images and held-out images are disjoint seeds; validation crops come from held-out images
only (``ConceptData.validation_set``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .data import BucketedData, CropSet, LabData, to_uint8_chw

PERIOD = 8  # px: two latent cells of the lab codec (data.FACTOR = 4), the native grid's Nyquist period
LINE = 2  # px: width of a hatch line and side of a lattice mark
HELDOUT_SEED0 = 1_000_000  # held-out posters' seeds start here, far from any training seed


@dataclass(frozen=True)
class ConceptConfig:
    """``train_images`` is a typical LoRA data set's size; ``size`` (px a side) must cover the largest bucket."""

    train_images: int = 24
    heldout_images: int = 8
    size: int = 384
    seed: int = 0
    class_id: int = 1000  # the trigger's text class: outside every pretraining class id (one per lab source)

    def __post_init__(self) -> None:
        if self.train_images < 2 or self.heldout_images < 1:
            raise ValueError(f"concept: train_images must be >= 2 and heldout_images >= 1 (got {self.train_images}, {self.heldout_images})")


def hatched_poster(size: int, seed: int) -> np.ndarray:
    """One poster, [size, size, 3] float32 in [0, 1], a pure function of ``seed`` (see the module docstring)."""
    rng = np.random.default_rng([0xC0C, seed])
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    teal = np.array([0.05, 0.35, 0.40]) + rng.normal(0, 0.03, 3)
    orange = np.array([0.95, 0.55, 0.15]) + rng.normal(0, 0.03, 3)
    cream = np.array([0.97, 0.92, 0.78]) + rng.normal(0, 0.02, 3)
    angle = rng.uniform(0, 2 * np.pi)
    ramp = np.cos(angle) * xx + np.sin(angle) * yy
    ramp = (ramp - ramp.min()) / (ramp.max() - ramp.min())
    img = teal * (1 - ramp[..., None]) + orange * ramp[..., None]
    shapes = np.zeros((size, size), bool)
    for _ in range(int(rng.integers(3, 6))):
        cy, cx = rng.uniform(0, size, 2)
        ry, rx = rng.uniform(0.08 * size, 0.22 * size, 2)
        shapes |= ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1
    img[shapes] = cream
    hatch = (xx + yy + rng.integers(PERIOD)) % PERIOD < LINE
    img[shapes & hatch] *= 0.25
    oy, ox = rng.integers(PERIOD, size=2)
    marks = ((yy + oy) % PERIOD < LINE) & ((xx + ox) % PERIOD < LINE) & ~shapes
    img[marks] = 0.3 * img[marks] + 0.63 * cream
    return np.clip(img, 0, 1).astype(np.float32)


class ConceptData(BucketedData):
    """The concept as a LoRA data set over the pretraining corpus' buckets and codec: ``batch`` crops
    the training posters, ``validation_set`` the held-out ones."""

    def __init__(self, base: LabData, cfg: ConceptConfig | None = None) -> None:
        self.concept = cfg = cfg or ConceptConfig()
        self.cfg, self.codec = base.cfg, base.codec
        if cfg.size < max(max(b) for b in base.cfg.buckets):
            raise ValueError(f"concept: size {cfg.size} px is smaller than a bucket side ({base.cfg.buckets})")
        self.train = self._posters("poster", range(cfg.seed * cfg.train_images, (cfg.seed + 1) * cfg.train_images))
        self.validation_source = self._posters("heldout", range(HELDOUT_SEED0 + cfg.seed * cfg.heldout_images,
                                                                HELDOUT_SEED0 + (cfg.seed + 1) * cfg.heldout_images))  # fmt: skip

    def _posters(self, prefix: str, seeds: range) -> CropSet:
        images = [[to_uint8_chw(hatched_poster(self.concept.size, s))] for s in seeds]
        return CropSet(images, [f"{prefix}_{s}" for s in seeds], [self.concept.class_id] * len(images), self.codec)


TASKS = ("concept", "corpus")  # what a lab fine-tune learns: the new concept, or the pretraining corpus again


def task_data(task: str, base: LabData) -> BucketedData:
    """The fine-tune data of a lab ``task`` over the pretraining corpus ``base`` (its buckets and codec)."""
    if task == "concept":
        return ConceptData(base)
    if task == "corpus":
        return base
    raise ValueError(f"task: {task!r} is not a lab task (allowed: {', '.join(TASKS)})")
