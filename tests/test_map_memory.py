"""The full map's memory does not grow with its arms: each draw is added to its arm's half-sum as it is taken
(``estimator.half_sums``), and a cell holds the two native arms' full sums and one arm's half-sums, in the
gradients' own dtype (float32 here), never a float64 copy per arm (docs/FIDELITY.md §9.2)."""

from __future__ import annotations

import torch
from test_certify_memory import LiveBuffers, P

from downscale_plugin.bins import parse_bins
from downscale_plugin.mapping.arms import Arm, build_arms
from downscale_plugin.mapping.estimator import MapSettings, collect


class CountingBackend:
    """A P-parameter float32 adapter whose gradient is a seeded noise draw around a per-arm mean; it records the live
    per-parameter bytes (``LiveBuffers``) before every draw, when the previous draws' reductions are what is alive."""

    rng_devices = ()

    def __init__(self, live: LiveBuffers):
        self.live = live
        self.theta = torch.nn.Parameter(torch.zeros(P))
        self.mean = torch.ones(P)

    def describe(self) -> dict:
        return {"model": "counting"}

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [self.theta]

    def num_images(self) -> int:
        return 2

    def unsupported(self, arm: Arm) -> str | None:
        return None

    def arm_input(self, image: int, arm: Arm) -> float:
        return 1.0 if arm.ratio is None else arm.ratio

    def loss(self, image: int, arm_input: float, sigma: float) -> torch.Tensor:
        self.live.record()
        return self.theta @ (arm_input * self.mean + 0.1 * torch.randn(P))


def _map_peak(ratios: list[float]) -> float:
    live = LiveBuffers()
    backend = CountingBackend(live)
    with live:
        cells = collect(backend, build_arms(ratios), parse_bins("0,1,2", endpoint=False), MapSettings(draws=4, images=2), progress=False)
    assert len(cells) == 4 and all(len(c.half_cos) == 2 + len(ratios) for c in cells)
    return live.peak / P


def test_map_memory_does_not_grow_with_its_arms():
    one, four = _map_peak([0.75]), _map_peak([0.875, 0.75, 0.625, 0.5])
    print(f"peak live bytes/param: {one:.0f} with 1 route, {four:.0f} with 4 routes")
    assert four == one  # the same state whatever the number of arms
    assert one <= 5 * 4  # float32: two native sums, one arm's two half-sums and the draw being added
