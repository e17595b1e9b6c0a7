"""The certifier's memory does not grow with the probes and bins: each draw is reduced as it is taken
(``sequential.PairedSums``), and the streamed estimate is the (D, p) matrix estimate of the same draws."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode

from downscale_plugin.bins import parse_bins
from downscale_plugin.mapping.arms import Arm, latent_arm
from downscale_plugin.mapping.certify import COST, CertifySettings, run_certify
from downscale_plugin.mapping.sequential import Looks, PairedSums, paired_excess

P = 50_000  # parameters of the counting source's adapter: a tensor this large is a per-parameter buffer


class LiveBuffers(TorchFunctionMode):
    """Weak references to every tensor of at least P elements that a torch call returns while active
    (the draws, the certifier's sums, caches, copies); :meth:`live_bytes` counts those still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []
        self.peak = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= P:
                self.refs.append(weakref.ref(t))
        return out

    def record(self) -> None:
        alive = [t for t in (r() for r in self.refs) if t is not None]
        self.refs = [weakref.ref(t) for t in alive]
        self.peak = max(self.peak, sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}.values()))


class CountingDraws:
    """Draws of a P-parameter adapter, generated from their seeds (the source keeps nothing per image):
    a shared mean, per-draw noise, a route draw close to its native one (every bin ends safe, so the
    search visits them all). It records the live per-parameter bytes (``LiveBuffers``) whenever a route draw is taken,
    through either protocol (``draw_pairs``, or the ``native``/``route`` matrices of the code before it)."""

    def __init__(self, images: int, live: LiveBuffers, draws: int = 2):
        self.images, self.live, self.n_draws = images, live, draws
        self.mean = torch.ones(P, dtype=torch.float64)

    def num_images(self) -> int:
        return self.images

    def cost(self, arm: Arm | None) -> float:
        return 1.0 if arm is None else arm.ratio**2

    def _draw(self, image: int, b: int, d: int, arm: Arm | None) -> torch.Tensor:
        gen = torch.Generator().manual_seed(hash((image, b, d, -1.0 if arm is None else arm.ratio)) & 0xFFFFFFFF)
        scale = 0.1 if arm is None else 0.01
        return self.mean + scale * torch.randn(P, generator=gen, dtype=torch.float64)

    def draw_pairs(self, image: int, b: int, routes, sink) -> None:
        for d in range(self.n_draws):
            sink(None, [self._draw(image, b, d, None)])
            for arm in routes:
                sink(arm.name, [self._draw(image, b, d, arm)])
                self.live.record()

    def native(self, image: int, b: int) -> torch.Tensor:
        return torch.stack([self._draw(image, b, d, None) for d in range(self.n_draws)])

    def route(self, image: int, b: int, arm: Arm) -> torch.Tensor:
        rows = torch.stack([self._draw(image, b, d, arm) for d in range(self.n_draws)])
        self.live.record()
        return rows


def _certify_peak(images: int, bins: int) -> tuple[float, int]:
    live = LiveBuffers()
    source = CountingDraws(images, live)
    looks = Looks((images // 2, images))
    with live:
        result = run_certify(
            source,
            [latent_arm(0.875), latent_arm(0.75)],
            parse_bins(f"0,1,{bins}", endpoint=False),
            CertifySettings(draws=2, looks=looks, budget=1e6, spot_checks=0),
            mass=lambda lo, hi: hi - lo,
        )
    # every bin certified for the deeper route; the milder route's windows there could never fire and are not sought
    assert [t.route for t in result.tests if t.safe] == ["latent_0.75"] * bins and all(
        t.verdict == COST for t in result.tests if not t.safe
    )
    return live.peak / P, sum(len(t.values) for t in result.tests)


def test_certify_memory_does_not_grow_with_probes_and_bins():
    small, small_cells = _certify_peak(images=4, bins=2)
    large, large_cells = _certify_peak(images=8, bins=4)
    assert large_cells == 4 * small_cells
    print(f"peak live bytes/param: {small:.0f} at 4 probes x 2 bins, {large:.0f} at 8 probes x 4 bins")
    assert large == small  # the same state per group of draws, however many groups came before
    assert small <= 6 * 8  # float64 draws: the native and the route sum, the native draw and the draw being taken, plus slack


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_streamed_sums_give_the_matrix_estimate(dtype):
    gen = torch.Generator().manual_seed(0)
    mean = torch.randn(2, 300, generator=gen, dtype=torch.float64)
    native = mean[0] + 0.5 * torch.randn(5, 300, generator=gen, dtype=torch.float64)
    routes = {name: 0.9 * mean[0] + 0.3 * mean[1] + 0.5 * torch.randn(5, 300, generator=gen, dtype=torch.float64) for name in ("a", "b")}
    native, routes = native.to(dtype), {k: v.to(dtype) for k, v in routes.items()}
    sums = PairedSums()
    for d in range(5):
        sums.add(None, [native[d, :100], native[d, 100:].reshape(20, 10)])  # per-parameter tensors of any shape
        for name, rows in routes.items():
            sums.add(name, [rows[d, :100], rows[d, 100:].reshape(20, 10)])
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    for name, rows in routes.items():
        assert sums.excess(name) == pytest.approx(paired_excess(native, rows), abs=tol)
    with pytest.raises(ValueError, match="no native draw to pair with"):
        sums.add("a", [native[0, :100], native[0, 100:].reshape(20, 10)])
