"""Fixtures shared by the test modules that run the plugin inside the sd-scripts host doubles, and the run's torch threads.

Not autouse: a module opts in with ``pytestmark = pytest.mark.usefixtures("host_doubles", "cheap_plan")``; only the
windows cache is redirected for every test (:func:`windows_cache`).
"""

from __future__ import annotations

import pytest
import torch
from host_modules import host_modules

from downscale_plugin.hosts.sd_scripts import start as sd_scripts_start


def pytest_configure(config):
    """One torch thread for the whole run: every model here is tiny, and beside another CPU-bound job torch's threads
    spin waiting for each other (the lab's auto test took 277 s instead of 4 beside other jobs on 2 cores)."""
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def windows_cache(tmp_path_factory, monkeypatch):
    """``mode = "auto"`` stores certified windows in a user cache (mapping/reuse.py): every test gets its own, never
    the user's; subprocesses inherit it."""
    folder = tmp_path_factory.mktemp("windows_cache")
    monkeypatch.setenv("DOWNSCALE_PLUGIN_CACHE", str(folder))
    return folder


@pytest.fixture(scope="module")
def host_doubles():
    """The doubles' ``library``/``networks``/trainer modules importable for the whole test module, one torch thread
    (tiny tensors: threads only add contention)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with host_modules():
        yield
    torch.set_num_threads(threads)


@pytest.fixture
def cheap_plan(monkeypatch):
    """The start banner's Monte-Carlo plan is not under test here; keep it cheap."""
    monkeypatch.setattr(sd_scripts_start, "PLAN_MC_SAMPLES", 256)


@pytest.fixture
def token_costs(monkeypatch):
    """An auto run's route passes at their token fraction, not the run's FLOP model's: on the doubles' tiny grids
    text tokens dominate the FLOP model (Flux at 16x16: a 0.5 route pass costs 0.91 of a native one), a saving
    no window of a short test run could pay its evidence back with (``test_sd_scripts_auto.py`` tests the FLOP unit)."""
    from downscale_plugin.hosts.kohya.auto import AutoSession
    from downscale_plugin.mapping.certify import token_fraction

    monkeypatch.setattr(AutoSession, "pass_fraction", lambda self, small, native: token_fraction(small, native))


@pytest.fixture
def range_clipped_read(monkeypatch):
    """The safe read calibrated with its laws clipped at the estimator's range (``safe_read.SHAPE_MARGIN`` above every
    margin), the calibration before the shape was held: on a random double, whose per-image excess is 0.2-0.7 with
    an SD up to 0.5, ε = 0.99 then certifies, so a test of certify-then-train or of the windows cache gets windows
    to train with, cache and reuse. A test that measures the read itself never takes this fixture."""
    from downscale_plugin.mapping import safe_read

    monkeypatch.setattr(safe_read, "SHAPE_MARGIN", 1.0)


@pytest.fixture(scope="module")
def tiny_lab(request):
    """The lab map backend on a tiny random DiT (16x16 cells, 3 warm-up steps), built once per module:
    2 probe images, or the module's ``TINY_LAB_IMAGES``."""
    from downscale_plugin.hosts.lab.map_backend import LabBackend, LabMapConfig
    from downscale_plugin.lab.model import LabModelConfig

    tiny = LabModelConfig(hidden_size=32, num_heads=2, double_layers=1, single_layers=1)
    cfg = LabMapConfig(model=tiny, pretrained=False, native_hw=(16, 16), warm_steps=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model gains nothing from threads and loses a lot on a busy machine
    yield LabBackend(cfg, images=getattr(request.module, "TINY_LAB_IMAGES", 2), progress=False)
    torch.set_num_threads(threads)
