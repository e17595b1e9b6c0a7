"""Concepts the lab DiT never saw in pretraining, for LoRA studies that can see a quality loss.

A LoRA teaches its base model something new; the lab corpus (``data.LabData``) is what the base
was pretrained on, so a fine-tune on it has almost nothing to learn and every arm difference is noise
around a fitted model. Each concept here is captioned with one text class the base never saw (a
trigger word, outside every pretraining class id: those are the corpus sources' indices), encoded
with the pretraining corpus' own codec (4 px per latent cell), cropped to its buckets; training and
held-out images are disjoint, and validation crops come from the held-out images only. The three
span where a concept's content sits relative to a routed step's smaller grid (a route to ratio r
trains on an exact area downsample: a box average over 4/r px, then a grid whose Nyquist period is
8/r px; 10.7 px at 0.75, 9.1 px at 0.875; :func:`power_above_nyquist` measures the share beyond it):

- ``hatch`` (kind ``fine_detail``; the old task name ``concept``): procedurally generated "hatched
  posters", unlike any lab source. Low-frequency content, which high-σ steps learn: a teal→orange
  gradient at a random angle and 3–5 large cream ellipses (the layout). Fine detail at the native
  grid's scale, which low-σ steps learn: a 45° hatch of 2 px dark lines inside the ellipses and a
  lattice of 2 px marks on the background, both with a period of 8 px = two latent cells, the native
  grid's Nyquist period. An area downsample to a smaller grid averages each period to its mean (at 0.5
  exactly; at 0.75 and 0.875 mostly, aliasing the rest), so a step at any smaller grid cannot train
  it, and a LoRA trained only at low resolution cannot reach native quality: the worst case.
- ``subject`` (kind ``subject``): one motorcycle, from scikit-image's stereo pair (not in the
  corpus), as a subject LoRA is trained: the left view at several short-side scales (whole subject to
  close-up), held out the right view, a disjoint photograph of the same subject from a viewpoint beside
  the first (the only other photograph of it that ships: held-out crops test the subject in a new
  photograph, at a near-identical pose). Its identity (shape, the red tank, the black seat) is low
  and middle frequency, which a smaller grid carries; its spokes, engine fins and lettering are
  photographic fine detail at the native grid's scale, which it loses, as any photograph's.
- ``style`` (kind ``style``): photographs under one colour grade and a texture at a middle scale,
  as a style LoRA is trained: the style is the same on every image, the content varies. The grade
  (faded blacks, lowered saturation, cool shadows, warm highlights) is per-pixel, so it lives at the
  content's own (mostly low) frequencies; the texture is a soft 45° halftone dot screen with a
  24 px = 6 latent cell period, its depth largest in the mid-tones, added after each image is resized
  to its scale, so the period is the same 24 px in every crop. A smaller grid holds it: at 0.75 the
  period is 4.5 small cells (over twice the small grid's Nyquist period), and the exact area
  downsample (a box over 1/r cells of a piecewise-constant grid) only attenuates it: the screen keeps
  about 80 % of its latent power at 0.75 and 0.875 (75 % at 0.5); what a route loses of this concept
  is the photographs' fine detail, not the style. Held out: ``chelsea`` and ``grace_hopper``
  (matplotlib's sample), photographs the shipped multi-size base never trained on (chelsea is in
  ``BaseSettings.held_out``; the single-size pretrain did see it); chelsea's short side is 300 px,
  so its crops are upsampled (×1.07 and ×1.6) and softer than the others. Training: ``motorcycle_left``,
  the one other colour photograph that ships and that no lab base saw, and five corpus photographs
  (astronaut, coffee, rocket, china, flower): the base has seen those, but a style set of one scene
  would teach the scene as much as the style, and the style is new on every one of them.

Everything is a pure function of the configs' seeds, generated at construction; nothing is downloaded
(the photographs are read from files inside the installed scikit-image, matplotlib and scikit-learn).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from .data import BucketedData, CropSet, LabData, _resize_short_side, _to_rgb01, to_uint8_chw

PERIOD = 8  # px: two latent cells of the lab codec (data.FACTOR = 4), the native grid's Nyquist period
LINE = 2  # px: width of a hatch line and side of a lattice mark
HELDOUT_SEED0 = 1_000_000  # held-out posters' seeds start here, far from any training seed
STYLE_STREAM = 0x57E1E  # the style screens' phases' RNG stream

Image = tuple[str, list[torch.Tensor]]  # a name and the image at one or more scales, uint8 [3, H, W] each

# Photographs that ship inside installed wheels: name -> (package, file).
PHOTOS = {
    "motorcycle_left": ("skimage", "motorcycle_left.png"),
    "motorcycle_right": ("skimage", "motorcycle_right.png"),
    "grace_hopper": ("matplotlib", "grace_hopper.jpg"),
    "astronaut": ("skimage", "astronaut.png"),
    "coffee": ("skimage", "coffee.png"),
    "rocket": ("skimage", "rocket.jpg"),
    "chelsea": ("skimage", "chelsea.png"),
    "china": ("sklearn", "china.jpg"),
    "flower": ("sklearn", "flower.jpg"),
}


def photo(name: str) -> np.ndarray:
    """A photograph of :data:`PHOTOS`, [H, W, 3] float32 in [0, 1], read from its package's files."""
    if name not in PHOTOS:
        raise ValueError(f"photo: {name!r} is not a packaged photograph (allowed: {', '.join(PHOTOS)})")
    package, file = PHOTOS[name]
    if package == "sklearn":
        from sklearn.datasets import load_sample_image

        return _to_rgb01(load_sample_image(file))
    import skimage.io

    if package == "skimage":
        import skimage.data

        folder = os.path.dirname(skimage.data.__file__)
    else:
        import matplotlib

        folder = os.path.join(matplotlib.get_data_path(), "sample_data")
    path = os.path.join(folder, file)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"photo {name!r}: {path} is missing from the installed {package}; reinstall it (the [lab] extra)")
    return _to_rgb01(skimage.io.imread(path))


class ConceptData(BucketedData):
    """A concept as a LoRA data set over the pretraining corpus' buckets and codec: ``batch`` crops the
    ``train`` images, ``validation_set`` the held-out ones, every crop captioned with ``class_id``.
    Subclasses make the images and name the concept's ``kind``."""

    kind: str

    def __init__(self, base: LabData, train: list[Image], heldout: list[Image], class_id: int) -> None:
        self.cfg, self.codec, self.class_id = base.cfg, base.codec, class_id
        side = max(max(b) for b in base.cfg.buckets)
        small = [name for name, per_scale in train + heldout if min(min(t.shape[1:]) for t in per_scale) < side]
        if small:
            raise ValueError(f"{self.kind}: images {small} have a side under the largest bucket side {side} px ({base.cfg.buckets})")
        self.train, self.validation_source = self._crop_set(train), self._crop_set(heldout)

    def _crop_set(self, images: list[Image]) -> CropSet:
        return CropSet([per_scale for _, per_scale in images], [name for name, _ in images], [self.class_id] * len(images), self.codec)


@dataclass(frozen=True)
class HatchConfig:
    """``train_images`` is a typical LoRA data set's size; ``size`` (px a side) must cover the largest bucket."""

    train_images: int = 24
    heldout_images: int = 8
    size: int = 384
    seed: int = 0
    class_id: int = 1000  # the trigger's text class

    def __post_init__(self) -> None:
        if self.train_images < 2 or self.heldout_images < 1:
            raise ValueError(f"hatch: train_images must be >= 2 and heldout_images >= 1 (got {self.train_images}, {self.heldout_images})")


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


class HatchData(ConceptData):
    """The hatched posters: training posters and held-out posters from disjoint seeds."""

    kind = "fine_detail"

    def __init__(self, base: LabData, cfg: HatchConfig | None = None) -> None:
        self.concept = cfg = cfg or HatchConfig()
        train = range(cfg.seed * cfg.train_images, (cfg.seed + 1) * cfg.train_images)
        heldout = range(HELDOUT_SEED0 + cfg.seed * cfg.heldout_images, HELDOUT_SEED0 + (cfg.seed + 1) * cfg.heldout_images)
        super().__init__(base, self._posters("poster", train), self._posters("heldout", heldout), cfg.class_id)

    def _posters(self, prefix: str, seeds: range) -> list[Image]:
        return [(f"{prefix}_{s}", [to_uint8_chw(hatched_poster(self.concept.size, s))]) for s in seeds]


def _scaled(img: np.ndarray, side: int, scales: tuple[float, ...]) -> list[np.ndarray]:
    """``img`` at each scale, its short side ``ceil(side · scale)`` px (as ``data.pyramid``), float RGB."""
    return [_resize_short_side(img, math.ceil(side * s)) for s in scales]


def _check_scales(name: str, scales: tuple[float, ...]) -> None:
    if not scales or min(scales) < 1.0:
        raise ValueError(f"{name}: scales {scales} must be >= 1 (multiples of the largest bucket side, which every crop needs)")


@dataclass(frozen=True)
class SubjectConfig:
    """``scales``: each photograph's short side as multiples of the largest bucket side (1.0: the whole
    subject in view, 1.5: close-ups; the motorcycle's photographs have a 500 px short side)."""

    train: tuple[str, ...] = ("motorcycle_left",)
    heldout: tuple[str, ...] = ("motorcycle_right",)
    scales: tuple[float, ...] = (1.0, 1.25, 1.5)
    class_id: int = 1001  # the trigger's text class

    def __post_init__(self) -> None:
        _check_scales("subject", self.scales)
        if not self.train or not self.heldout or set(self.train) & set(self.heldout):
            raise ValueError(f"subject: train {self.train} and heldout {self.heldout} must be non-empty and disjoint")


class SubjectData(ConceptData):
    """One subject's photographs, each at several scales; held-out crops from disjoint photographs."""

    kind = "subject"

    def __init__(self, base: LabData, cfg: SubjectConfig | None = None) -> None:
        self.concept = cfg = cfg or SubjectConfig()
        side = max(max(b) for b in base.cfg.buckets)

        def images(names: tuple[str, ...]) -> list[Image]:
            return [(n, [to_uint8_chw(im) for im in _scaled(photo(n), side, cfg.scales)]) for n in names]

        super().__init__(base, images(cfg.train), images(cfg.heldout), cfg.class_id)


@dataclass(frozen=True)
class StyleConfig:
    """``period`` (px) of the halftone screen: 16–32 px = 4–8 latent cells, a middle scale;
    ``depth``: its amplitude at mid-grey; ``seed``: the screens' phases."""

    train: tuple[str, ...] = ("motorcycle_left", "astronaut", "coffee", "rocket", "china", "flower")
    heldout: tuple[str, ...] = ("chelsea", "grace_hopper")
    scales: tuple[float, ...] = (1.0, 1.5)
    period: float = 24.0
    depth: float = 0.12
    seed: int = 0
    class_id: int = 1002  # the trigger's text class

    def __post_init__(self) -> None:
        _check_scales("style", self.scales)
        if not self.train or not self.heldout or set(self.train) & set(self.heldout):
            raise ValueError(f"style: train {self.train} and heldout {self.heldout} must be non-empty and disjoint")
        if not 16 <= self.period <= 32 or not 0 < self.depth <= 0.25:
            raise ValueError(f"style: period {self.period} must be in [16, 32] px and depth {self.depth} in (0, 0.25]")


def luma(img: np.ndarray) -> np.ndarray:
    return img @ np.array([0.299, 0.587, 0.114], np.float32)


def grade(img: np.ndarray) -> np.ndarray:
    """The style's colour grade, per pixel: saturation down, blacks lifted and whites lowered (faded),
    cool shadows and warm highlights. [H, W, 3] in [0, 1] -> the same."""
    y = luma(img)[..., None]
    faded = 0.08 + 0.84 * (y + 0.6 * (img - y))
    toned = faded + (1 - y) * np.array([-0.03, 0.0, 0.05]) + y * np.array([0.06, 0.02, -0.05])
    return np.clip(toned, 0, 1).astype(np.float32)


def halftone_screen(shape: tuple[int, int], period: float, phase: np.ndarray) -> np.ndarray:
    """A soft 45° dot screen in [-1, 1]: the mean of two cosines of ``period`` px along the diagonals,
    so all its energy is at that period (radially)."""
    yy, xx = np.mgrid[0 : shape[0], 0 : shape[1]].astype(np.float32)
    u, v = (xx + yy) / math.sqrt(2), (xx - yy) / math.sqrt(2)
    return 0.5 * (np.cos(2 * np.pi * u / period + phase[0]) + np.cos(2 * np.pi * v / period + phase[1]))


def stylize(img: np.ndarray, cfg: StyleConfig, phase: np.ndarray) -> np.ndarray:
    """``img`` graded, plus the halftone screen with depth ``cfg.depth · 4y(1 − y)`` (y: the graded luma),
    so the dots show in the mid-tones, as a halftone's do."""
    graded = grade(img)
    y = luma(graded)
    texture = cfg.depth * 4 * y * (1 - y) * halftone_screen(img.shape[:2], cfg.period, phase)
    return np.clip(graded + texture[..., None], 0, 1).astype(np.float32)


class StyleData(ConceptData):
    """Photographs in one style (grade + halftone), each stylized after it is resized to each scale;
    held-out crops from disjoint photographs."""

    kind = "style"

    def __init__(self, base: LabData, cfg: StyleConfig | None = None) -> None:
        self.concept = cfg = cfg or StyleConfig()
        side = max(max(b) for b in base.cfg.buckets)
        rng = np.random.default_rng([STYLE_STREAM, cfg.seed])

        def images(names: tuple[str, ...]) -> list[Image]:
            scaled = [(n, _scaled(photo(n), side, cfg.scales)) for n in names]
            return [(n, [to_uint8_chw(stylize(im, cfg, rng.uniform(0, 2 * np.pi, 2))) for im in ims]) for n, ims in scaled]

        super().__init__(base, images(cfg.train), images(cfg.heldout), cfg.class_id)


CONCEPTS: dict[str, type[ConceptData]] = {"hatch": HatchData, "subject": SubjectData, "style": StyleData}
TASKS = ("corpus", *CONCEPTS)  # what a lab fine-tune learns: the pretraining corpus again, or a new concept
ALIASES = {"concept": "hatch"}  # old task names (stored maps' commands say --task concept)
TASK_KINDS: dict[str, str | None] = {"corpus": None, **{task: data.kind for task, data in CONCEPTS.items()}}


def task_problem(task: str) -> str | None:
    """Why ``task`` is no lab task (None: it is one, or an old name of one)."""
    if task in TASKS or task in ALIASES:
        return None
    old = ", ".join(f"{old} = {new}" for old, new in ALIASES.items())
    return f"task: {task!r} is not a lab task (allowed: {', '.join(TASKS)}; old name: {old})"


def task_data(task: str, base: LabData) -> BucketedData:
    """The fine-tune data of a lab ``task`` over the pretraining corpus ``base`` (its buckets and codec)."""
    problem = task_problem(task)
    if problem:
        raise ValueError(problem)
    task = ALIASES.get(task, task)
    return base if task == "corpus" else CONCEPTS[task](base)


def power_above_nyquist(latents: torch.Tensor, ratio: float) -> tuple[float, float]:
    """(power above, total power) of latents [B, C, h, w] about each map's mean, where "above" is a
    spatial frequency a grid of ``ratio`` × the native side cannot hold: over ratio/2 cycles per native
    cell on either axis (the smaller grid's Nyquist). A Hann window keeps the crops' edges from
    leaking power to high frequencies."""
    if not 0 < ratio < 1:
        raise ValueError(f"ratio: {ratio} must be in (0, 1)")
    h, w = latents.shape[-2:]
    z = latents.double() - latents.double().mean(dim=(-2, -1), keepdim=True)
    window = torch.hann_window(h, periodic=False, dtype=torch.float64)[:, None] * torch.hann_window(w, periodic=False, dtype=torch.float64)
    power = torch.fft.fft2(z * window).abs() ** 2
    fy, fx = torch.fft.fftfreq(h, dtype=torch.float64).abs(), torch.fft.fftfreq(w, dtype=torch.float64).abs()
    above = (fy[:, None] > ratio / 2) | (fx[None, :] > ratio / 2)
    return (power * above).sum().item(), power.sum().item()


def heldout_power_above(data: BucketedData, ratio: float, per_bucket: int = 4, seed: int = 0) -> float:
    """The share of the held-out crops' latent power a grid of ``ratio`` cannot hold (pooled over buckets)."""
    sums = [power_above_nyquist(batch["latents"], ratio) for batch in data.validation_set(per_bucket, seed)]
    return sum(a for a, _ in sums) / sum(t for _, t in sums)
