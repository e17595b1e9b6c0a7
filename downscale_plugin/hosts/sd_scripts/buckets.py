"""sd-scripts' buckets: the list ``--enable_bucket`` builds (``plan``), and a run's own (the start banner)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def sd_scripts_buckets(
    resolution: tuple[int, int], min_size: int = 256, max_size: int = 1024, divisible: int = 64
) -> list[tuple[int, int]]:
    """The bucket list sd-scripts builds for ``--enable_bucket`` (pixels, (W, H)), same arithmetic."""
    max_area = resolution[0] * resolution[1]
    side = int(math.sqrt(max_area) // divisible) * divisible
    resos = {(side, side)}
    width = min_size
    while width <= max_size:
        height = min(max_size, int((max_area // width) // divisible) * divisible)
        if height >= min_size:
            resos.add((width, height))
            resos.add((height, width))
        width += divisible
    return sorted(resos)


@dataclass(frozen=True)
class DatasetBuckets:
    """A run's own buckets, as its dataset built them: what the start banner's plan and the map's
    checks (``map.py``) read."""

    latent_buckets: list[tuple[int, int]]  # latent (h, w) of every non-empty bucket
    weights: list[float]  # each bucket's share of the steps
    batch_size: int  # the most common batch size
    images: int | None = None  # distinct images (a bucket lists an image once per repeat)


def dataset_buckets(group: Any, vae_factor: int) -> DatasetBuckets:
    """The non-empty buckets of the trainer's dataset group at the latent grid, weighted by their steps."""
    steps: dict[tuple[int, int], float] = {}
    images_by_batch: dict[int, int] = {}
    keys: set[Any] = set()
    for dataset in getattr(group, "datasets", None) or []:
        manager = getattr(dataset, "bucket_manager", None)
        batch = int(getattr(dataset, "batch_size", 1) or 1)
        for (width, height), bucket in zip(getattr(manager, "resos", ()), getattr(manager, "buckets", ()), strict=True):
            if len(bucket):
                hw = (height // vae_factor, width // vae_factor)
                steps[hw] = steps.get(hw, 0.0) + math.ceil(len(bucket) / batch)
                images_by_batch[batch] = images_by_batch.get(batch, 0) + len(bucket)
                keys.update((id(dataset), key) for key in bucket)
    batch_size = max(images_by_batch, key=images_by_batch.get) if images_by_batch else 1
    return DatasetBuckets(list(steps), list(steps.values()), batch_size, len(keys) or None)
