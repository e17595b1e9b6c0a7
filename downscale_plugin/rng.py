"""The global generators a host draws from: fork them all, seed only what was forked.

The plugin runs the host's own σ sampler (and, for SD1/SDXL, its noise path) as dry runs and as
seeded candidate draws. Those draw from the host's global generators, so every such call must leave
them exactly as it found them, on every device the host draws on:

- ``torch.random.fork_rng`` saves the CPU generator and the CUDA devices it is given, but not Python's
  ``random`` (sd-scripts' ``pyramid_noise_like`` draws from it), NumPy's global state, or the MPS/XPU
  generators;
- ``torch.manual_seed`` seeds the CPU *and every CUDA device* (``torch.cuda.manual_seed_all``): inside
  a fork that restores only the CPU it resets the host's GPU noise stream to a constant, and the run is
  no longer a function of ``--seed``.

So :func:`forked` saves and restores all of them, and :func:`seed_forked` seeds exactly the CPU
generator and the devices that were forked, through the generator objects, never through a global
seeding function. The plugin's own randomness (plan Monte Carlo, map jitter) uses private
``torch.Generator`` / ``numpy.random.Generator`` objects instead.

Logging draws too: rich's console handler, which both kohya trainers install on the root logger,
draws ``random.randint`` for every record it renders (its styles' link ids), so a plugin log line in
the middle of a run would move Python's ``random`` and with it the host's later draws (sd-scripts'
``--flip_aug``, caption shuffling and dropout on the main process). Every plugin module logs through
:func:`plugin_logger`, whose records leave Python's ``random`` as they found it.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

Device = torch.device | str | int


def accelerator_devices(device: Device | None) -> tuple[torch.device, ...]:
    """The non-CPU device whose generator a host on ``device`` draws from (empty on CPU)."""
    if device is None:
        return ()
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cpu":
        return ()
    if device.type in ("cuda", "xpu") and device.index is None:  # the generator the host's "cuda"/"xpu" tensors draw from
        device = torch.device(device.type, getattr(torch, device.type).current_device())
    return (device,)


def _device_module(device: torch.device):
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "get_rng_state"):
        raise ValueError(f"device {device}: torch has no RNG state API for {device.type!r}")
    return module


_open_forks = 0  # forks entered and not yet left, in this process


def fork_depth() -> int:
    """How many :func:`forked` scopes are open: what runs deeper than a scope's entry depth is a dry run
    whose draws are thrown away (``mapping/paired.py`` hands its prepared noise to no such draw)."""
    return _open_forks


@contextmanager
def forked(devices: Sequence[torch.device] = ()) -> Iterator[None]:
    """Save torch's CPU generator, each device's generator, Python's ``random`` and NumPy's global
    state; restore all of them on exit, whatever ran inside."""
    global _open_forks
    cpu = torch.get_rng_state()
    device_states = [(d, _device_module(d).get_rng_state(d)) for d in devices]
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    _open_forks += 1
    try:
        yield
    finally:
        _open_forks -= 1
        torch.set_rng_state(cpu)
        for device, state in device_states:
            _device_module(device).set_rng_state(state, device)
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def seed_forked(value: int, devices: Sequence[torch.device] = ()) -> None:
    """Seed the CPU generator and ``devices`` (call only inside :func:`forked` over the same devices)."""
    torch.default_generator.manual_seed(value)
    for device in devices:
        if device.type == "cuda":
            torch.cuda.default_generators[device.index].manual_seed(value)
        elif device.type == "mps":
            torch.mps._get_default_mps_generator().manual_seed(value)
        elif device.type == "xpu":
            torch.xpu.default_generators[device.index or 0].manual_seed(value)
        else:
            raise ValueError(f"device {device}: cannot seed a {device.type!r} generator")


class RandomKeepingLogger(logging.LoggerAdapter):
    """A logger whose records leave the global generators (Python's ``random`` among them) as they found them,
    whatever the handlers draw: each record is handled inside :func:`forked`."""

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        if not self.isEnabledFor(level):
            return  # no record, no handler, nothing to fork
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1  # the record names the plugin's caller, not this frame
        with forked():
            super().log(level, msg, *args, **kwargs)


def plugin_logger(name: str) -> RandomKeepingLogger:
    """A plugin module's logger (``logging.getLogger(name)``, records keeping Python's ``random``)."""
    return RandomKeepingLogger(logging.getLogger(name), {})
