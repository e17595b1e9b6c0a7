"""Lab images with a natural spectrum, from files that ship inside installed packages, plus generated
ones, turned into a VAE-like latent space. Nothing is downloaded.

Sources: photographs bundled in the scikit-image wheel (read from the wheel's own files, never through
its fetcher, so no download can start), scikit-learn's two sample images, and procedurally generated
images (dead leaves and 1/f colour noise; both have the power-law spectrum of natural images), so a
corpus exists even when the packaged files are missing.

Latent space ("the VAE"): pixel-unshuffle RGB by 4 (48 values per 4×4 patch), project each patch with
a fixed seeded random orthogonal 48→C map, normalise each channel to zero mean / unit variance over the
corpus. It is linear, deterministic and local, so the latent keeps the images' power-law spectrum and
area-downsampling it behaves like downscaling the image.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

FACTOR = 4  # pixels per latent cell, each side
SKIMAGE_FILES = (
    "astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg", "camera.png", "hubble_deep_field.jpg",
    "ihc.png", "retina.jpg", "moon.png", "brick.png", "grass.png", "gravel.png", "coins.png",
)  # fmt: skip


@dataclass(frozen=True)
class LabDataConfig:
    """Buckets are (height, width) in pixels, multiples of 32 so latents are multiples of 8 (packed: 4).

    ``scales`` set the short side of each source, as multiples of the largest bucket side, from which
    crops are taken (several scales = scale augmentation).
    """

    buckets: tuple[tuple[int, int], ...] = ((256, 256), (224, 288), (288, 224), (192, 320), (320, 192))
    latent_channels: int = 16
    scales: tuple[float, ...] = (1.0, 1.5)
    projection_seed: int = 0
    generated: int = 4
    packaged: bool = True

    def __post_init__(self) -> None:
        if any(h % 32 or w % 32 for h, w in self.buckets):
            raise ValueError(f"bucket sides must be multiples of 32 px: {self.buckets}")
        if not self.packaged and self.generated < 1:
            raise ValueError("no image source enabled")

    def latent_hw(self, bucket: tuple[int, int]) -> tuple[int, int]:
        return bucket[0] // FACTOR, bucket[1] // FACTOR


def _to_rgb01(img: np.ndarray) -> np.ndarray:
    img = np.asarray(img)
    if img.dtype == np.uint8:
        img = img.astype(np.float32) / 255.0
    img = img.astype(np.float32)
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, axis=2)
    return np.clip(img[..., :3], 0.0, 1.0)


def _packaged_images() -> list[tuple[str, np.ndarray]]:
    """Images bundled in installed wheels; each one that is absent or unreadable is skipped."""
    out: list[tuple[str, np.ndarray]] = []
    try:
        import skimage.data
        import skimage.io
    except ImportError:
        skimage = None
    if skimage is not None:
        root = os.path.dirname(skimage.data.__file__)
        for name in SKIMAGE_FILES:
            path = os.path.join(root, name)
            if os.path.isfile(path):
                try:
                    out.append((name.split(".")[0], _to_rgb01(skimage.io.imread(path))))
                except (OSError, ValueError):
                    continue
    try:
        from sklearn.datasets import load_sample_images

        bunch = load_sample_images()
        out += [(os.path.basename(f).split(".")[0], _to_rgb01(im)) for f, im in zip(bunch.filenames, bunch.images, strict=True)]
    except (ImportError, OSError, ValueError):
        pass
    return out


def dead_leaves(size: int, seed: int, n_discs: int = 4000) -> np.ndarray:
    """Occluding discs with radius density ∝ r⁻³: the classic scale-invariant (1/f²) image model."""
    rng = np.random.default_rng(seed)
    img = np.zeros((size, size, 3), np.float32)
    rmin, rmax = 2.0, size / 4
    u = rng.random(n_discs)
    radii = (rmin**-2 - u * (rmin**-2 - rmax**-2)) ** -0.5
    centres = rng.random((n_discs, 2)) * size
    colours = rng.random((n_discs, 3)).astype(np.float32)
    for (cy, cx), r, col in zip(centres, radii, colours, strict=True):
        y0, y1 = int(max(cy - r, 0)), int(min(cy + r + 1, size))
        x0, x1 = int(max(cx - r, 0)), int(min(cx + r + 1, size))
        yy, xx = np.ogrid[y0:y1, x0:x1]
        img[y0:y1, x0:x1][(yy - cy) ** 2 + (xx - cx) ** 2 <= r * r] = col
    return img


def pink_noise(size: int, seed: int) -> np.ndarray:
    """Colour noise with amplitude ∝ 1/f (power ∝ 1/f²) and correlated channels."""
    rng = np.random.default_rng(seed)
    f = np.hypot(*np.meshgrid(np.fft.fftfreq(size), np.fft.fftfreq(size), indexing="ij"))
    f[0, 0] = 1.0
    spec = np.fft.fft2(rng.standard_normal((3, size, size))) / f
    field = np.real(np.fft.ifft2(spec))
    field = np.einsum("ck,khw->hwc", rng.standard_normal((3, 3)) + 2 * np.eye(3), field)
    lo, hi = np.percentile(field, [1, 99])
    return np.clip((field - lo) / (hi - lo), 0, 1).astype(np.float32)


def _resize_short_side(img: np.ndarray, short: int) -> np.ndarray:
    from skimage.transform import resize

    h, w = img.shape[:2]
    s = short / min(h, w)
    shape = (max(short, round(h * s)), max(short, round(w * s)))
    return resize(img, shape, order=1, anti_aliasing=s < 1, preserve_range=True).astype(np.float32)


class LatentCodec:
    """The lab's linear "VAE": pixel-unshuffle by 4, orthogonal 48→C projection, per-channel norm."""

    def __init__(self, channels: int, seed: int) -> None:
        if not 1 <= channels <= 3 * FACTOR * FACTOR:
            raise ValueError(f"latent_channels must be in 1..{3 * FACTOR * FACTOR}")
        gen = torch.Generator().manual_seed(seed)
        q, _ = torch.linalg.qr(torch.randn(3 * FACTOR * FACTOR, 3 * FACTOR * FACTOR, generator=gen))
        self.projection = q[:channels].contiguous()  # [C, 48], orthonormal rows
        self.mean = torch.zeros(channels)
        self.std = torch.ones(channels)

    def project(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in [0, 1] -> un-normalised [B, C, H/4, W/4]."""
        return torch.einsum("ck,bkhw->bchw", self.projection, F.pixel_unshuffle(pixels, FACTOR))

    def fit(self, images: list[torch.Tensor]) -> None:
        """Per-channel mean/std over every latent cell of the corpus (pixel-weighted)."""
        total, sq, n = 0.0, 0.0, 0
        for img in images:
            h, w = img.shape[-2] // FACTOR * FACTOR, img.shape[-1] // FACTOR * FACTOR
            z = self.project(img[None, :, :h, :w].float() / 255.0).double()
            total = total + z.sum(dim=(0, 2, 3))
            sq = sq + (z**2).sum(dim=(0, 2, 3))
            n += z.shape[2] * z.shape[3]
        mean = total / n
        self.mean = mean.float()
        self.std = (sq / n - mean**2).clamp_min(1e-12).sqrt().float()

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        z = self.project(pixels)
        return (z - self.mean[:, None, None]) / self.std[:, None, None]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """The pseudo-inverse of :meth:`encode`: un-normalise, projection transpose, pixel-shuffle.

        [B, C, h, w] -> [B, 3, 4h, 4w]. The rows are orthonormal, so ``encode(decode(z)) == z`` for
        every latent (up to float rounding), and ``decode(encode(x))`` is the per-patch orthogonal
        projection of x onto the C kept directions: the 48 − C discarded ones come back as zero, and
        the result is no image in [0, 1] (the random rows keep only part of each patch's mean).
        """
        z = latents * self.std[:, None, None] + self.mean[:, None, None]
        return F.pixel_shuffle(torch.einsum("ck,bchw->bkhw", self.projection, z), FACTOR)


class CropSet:
    """Random crops of a fixed list of images, encoded by a codec.

    ``images[i]`` holds source i at one or more scales (uint8 [3, H, W] each: 8-bit like real
    training images, and compact); a crop picks a source, a scale, a position and a horizontal flip.
    ``class_ids[i]`` is the text class source i is captioned with (the lab corpus: one per source;
    a concept: one trigger class for all of them).
    """

    def __init__(self, images: list[list[torch.Tensor]], names: list[str], class_ids: list[int], codec: LatentCodec) -> None:
        if not (len(images) == len(names) == len(class_ids)) or not images:
            raise ValueError("a crop set needs one name and one class id per image, and at least one image")
        self.images, self.names, self.class_ids, self.codec = images, names, class_ids, codec

    def crops(self, rng: np.random.Generator, bucket: tuple[int, int], batch_size: int, pixels: bool = False) -> dict:
        """``batch_size`` crops of ``bucket`` (pixels); see :meth:`BucketedData.batch` for the keys."""
        h, w = bucket
        crops, sources = [], []
        for _ in range(batch_size):
            src = int(rng.integers(len(self.images)))
            per_scale = self.images[src]
            img = per_scale[int(rng.integers(len(per_scale)))]
            y = int(rng.integers(img.shape[1] - h + 1))
            x = int(rng.integers(img.shape[2] - w + 1))
            crop = img[:, y : y + h, x : x + w]
            crops.append(crop.flip(-1) if rng.random() < 0.5 else crop)
            sources.append(src)
        images = torch.stack(crops).float() / 255.0
        batch = {
            "latents": self.codec.encode(images),
            "loss_weights": torch.ones(batch_size),
            "captions": [self.names[s] for s in sources],
            "class_ids": torch.tensor([self.class_ids[s] for s in sources], dtype=torch.long),
            "sources": torch.tensor(sources, dtype=torch.long),
            "bucket": bucket,
        }
        return {**batch, "pixels": images} if pixels else batch


def to_uint8_chw(img: np.ndarray) -> torch.Tensor:
    """[H, W, 3] float in [0, 1] -> uint8 [3, H, W]."""
    return torch.from_numpy(np.round(np.clip(img, 0.0, 1.0) * 255).astype(np.uint8)).permute(2, 0, 1).contiguous()


class BucketedData:
    """A training set and a validation source over the same buckets and codec; batch ``step`` of a
    run is a pure function of (seed, step), and the validation set a pure function of its seed."""

    cfg: LabDataConfig
    codec: LatentCodec
    train: CropSet
    validation_source: CropSet

    @property
    def names(self) -> list[str]:
        """The training images' names."""
        return self.train.names

    @property
    def num_sources(self) -> int:
        return len(self.train.images)

    def batch(self, step: int, batch_size: int, seed: int, pixels: bool = False) -> dict:
        """One bucket per batch, chosen uniformly; random source, scale, crop and horizontal flip.

        Returns ``latents`` [B, C, h, w], ``loss_weights`` [B], ``captions``, ``class_ids`` [B] (the
        text class), ``sources`` [B] (the training image each crop is from) and ``bucket`` (pixels),
        the keys the lab trainer reads (``latents``/``loss_weights`` as in sd-scripts); with ``pixels``
        also the RGB crops the latents encode, ``pixels`` [B, 3, H, W] in [0, 1].
        """
        rng = np.random.default_rng([seed, step])
        bucket = self.cfg.buckets[int(rng.integers(len(self.cfg.buckets)))]
        return self.train.crops(rng, bucket, batch_size, pixels)

    def validation_set(self, per_bucket: int = 2, seed: int = 0) -> list[dict]:
        """A fixed draw from the validation source: one batch of ``per_bucket`` crops per bucket (its own RNG stream)."""
        return [
            self.validation_source.crops(np.random.default_rng([seed, 0x7FFF_FFFF, i]), bucket, per_bucket)
            for i, bucket in enumerate(self.cfg.buckets)
        ]


def corpus_sources(cfg: LabDataConfig, generated_size: int) -> list[tuple[str, np.ndarray]]:
    """The corpus' (name, float RGB image) pairs: the packaged images (when ``cfg.packaged``), then
    ``cfg.generated`` generated ones of ``generated_size`` px, alternating dead leaves and pink noise."""
    sources = _packaged_images() if cfg.packaged else []
    for i in range(cfg.generated):
        maker = dead_leaves if i % 2 == 0 else pink_noise
        sources.append((f"{maker.__name__}_{i // 2}", maker(generated_size, seed=1000 + i)))
    return sources


def pyramid(img: np.ndarray, side: int, scales: tuple[float, ...]) -> list[torch.Tensor]:
    """``img`` at each scale, its short side ``ceil(side · scale)`` px, as uint8 [3, H, W]."""
    return [to_uint8_chw(_resize_short_side(img, int(np.ceil(side * s)))) for s in scales]


class LabData(BucketedData):
    """The pretraining corpus. Its validation set is a separate draw of crops of the same images
    (held-out crops, not held-out images: the corpus is what the base model was trained on)."""

    def __init__(self, cfg: LabDataConfig | None = None) -> None:
        self.cfg = cfg = cfg or LabDataConfig()
        side = max(max(b) for b in cfg.buckets)
        sources = corpus_sources(cfg, int(side * max(cfg.scales)))
        images = [pyramid(img, side, cfg.scales) for _, img in sources]
        self.codec = LatentCodec(cfg.latent_channels, cfg.projection_seed)
        self.codec.fit([per_scale[0] for per_scale in images])
        names = [name for name, _ in sources]
        self.train = self.validation_source = CropSet(images, names, list(range(len(images))), self.codec)
