"""musubi-tuner's buckets, as a run's dataset group built them (the start banner's plan).

Each dataset's ``batch_manager.buckets`` maps a bucket key, (W, H, …) in pixels, to its items
(dataset/bucket.py ``BucketBatchManager``). What follows W, H in a key depends on the dataset
(a video's frame count; Wan's and FramePack's image datasets append their latent window size, any
dataset its control shapes), so a bucket's frames come from its items' ``frame_count`` (None for
images; dataset/image_video_dataset.py ``ItemInfo``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MusubiBuckets:
    """The run's non-empty buckets at the latent grid, weighted by their batches."""

    latent_buckets: list[tuple[int, int]]  # latent (h, w)
    weights: list[float]  # each bucket's share of the steps
    batch_size: int  # the most common batch size
    frames: list[float]  # each bucket's latent frames (1 for images; their mean over the keys sharing its grid)
    images: int | None = None  # distinct items (by ``item_key``; None when the items carry none)


def latent_frames(pixel_frames: int, stride: int | None) -> int:
    """Latent frames of a video bucket: the causal video VAEs keep the first frame and compress the rest by ``stride``."""
    return 1 if stride is None else (pixel_frames - 1) // stride + 1


def musubi_buckets(group: Any, vae_factor: int, frame_stride: int | None = None) -> MusubiBuckets:
    """The non-empty buckets of the trainer's dataset group, spatial axes at the latent grid (a bucket's
    latent frames are averaged over its keys when several frame counts share one spatial grid)."""
    steps: dict[tuple[int, int], float] = {}
    frame_sum: dict[tuple[int, int], float] = {}
    items_by_batch: dict[int, int] = {}
    keys: set[Any] = set()
    for dataset in getattr(group, "datasets", None) or []:
        manager = getattr(dataset, "batch_manager", None)
        batch = int(getattr(dataset, "batch_size", 1) or 1)
        for key, items in (getattr(manager, "buckets", None) or {}).items():
            if not len(items):
                continue
            hw = (key[1] // vae_factor, key[0] // vae_factor)
            n = math.ceil(len(items) / batch)
            steps[hw] = steps.get(hw, 0.0) + n
            frames = getattr(items[0], "frame_count", None) or 1
            frame_sum[hw] = frame_sum.get(hw, 0.0) + n * latent_frames(int(frames), frame_stride)
            items_by_batch[batch] = items_by_batch.get(batch, 0) + len(items)
            keys.update((id(dataset), item.item_key) for item in items if getattr(item, "item_key", None) is not None)
    batch_size = max(items_by_batch, key=items_by_batch.get) if items_by_batch else 1
    frames = [frame_sum[hw] / steps[hw] for hw in steps]
    return MusubiBuckets(list(steps), list(steps.values()), batch_size, frames, len(keys) or None)
