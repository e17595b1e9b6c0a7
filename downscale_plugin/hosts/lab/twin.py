"""Twin runs: two lab fine-tunes that differ only by routing.

A plain A/B on one seed shares the adapter init and the data order, but not the noise: the first
routed step draws its noise at a smaller grid, so every later step's noise and σ differ from the
native twin's, and the paired difference carries a noise lottery as large as the seed lottery
(docs/FIDELITY.md §6). Twin mode removes it. Each micro-step starts from its own seeded state of
torch's generator (:func:`step_seed`, the same in both runs whatever the steps before consumed), so
both twins draw the same σ (the router's dry run replays the host's draw from that state); and the
step's noise is one native draw ε ~ N(0, I): a native step gets ε itself, a routed step gets the
paired transform M·ε of ``mapping/paired.py`` (exactly N(0, I) at the small grid: the noise the
host would draw there, the native draw's own coarse content). A twin whose router routes nothing
is therefore bitwise its native twin (``tests/test_quality.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ...mapping.paired import coupled_small_noise, injected_noise


def step_seed(seed: int, micro_step: int) -> int:
    """The global generator's seed for one micro-step of a twin run (distinct per (seed, step))."""
    if seed < 0 or micro_step < 0:
        raise ValueError(f"seed and micro_step must be >= 0 (got {seed}, {micro_step})")
    return (seed << 32) + micro_step


@contextmanager
def twin_step(seed: int, micro_step: int, batch: dict) -> Iterator[None]:
    """A ``train_lora`` ``step_scope``: reseed for this micro-step and hand the host's noise draw the
    native draw, or its paired transform when the step runs at a smaller grid."""
    torch.manual_seed(step_seed(seed, micro_step))
    native_shape = tuple(batch["latents"].shape)

    def noise(shape: tuple[int, ...]) -> torch.Tensor:
        native = torch.randn(native_shape)  # what the native twin's randn_like(latents) draws from this state
        return native if shape == native_shape else coupled_small_noise(native, shape[-2:])

    with injected_noise(noise):
        yield


def twin_scope(seed: int):
    """The ``step_scope`` of a twin run with training seed ``seed``."""
    return lambda micro_step, batch: twin_step(seed, micro_step, batch)
