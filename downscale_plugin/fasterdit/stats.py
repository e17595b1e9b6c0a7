"""Pooled data std of latents: FasterDiT's s_d, measured the same way online and offline."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Moments:
    """Count, sum and sum of squares over every element seen (float64, so large corpora pool exactly).

    The std is over all elements together (channels and positions), FasterDiT's scalar data std:
    the spread of the signal the noise is mixed with.
    """

    n: float = 0.0
    total: float = 0.0
    squares: float = 0.0

    def add(self, x: torch.Tensor) -> Moments:
        x = x.detach().double()
        self.n += x.numel()
        self.total += float(x.sum())
        self.squares += float((x * x).sum())
        return self

    @property
    def std(self) -> float:
        if self.n == 0:
            raise ValueError("no latents measured")
        mean = self.total / self.n
        return math.sqrt(max(self.squares / self.n - mean * mean, 0.0))
