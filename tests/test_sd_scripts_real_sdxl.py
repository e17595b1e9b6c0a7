"""sd-scripts' real SDXL script (skipped unless ``SD_SCRIPTS_DIR`` points at an sd-scripts checkout;
``tests/sd_scripts_e2e.py`` runs it on tiny models built from its own classes).

Routed steps condition on the small grid's sizes: each UNet forward's size embedding encodes the target size of the
grid it runs at, and the crop's top-left scaled to it, per axis and rounded (the source size stays the image's): what
the host gives the same image trained in a bucket of the small grid's size, through its own ``call_unet``.
(``mode = "auto"`` with SDXL's reentrant ``--gradient_checkpointing``: ``tests/test_certify_real_checkpointing.py``.)
"""

from __future__ import annotations

import os

import pytest
from test_certify_real import recorded

SD_SCRIPTS_DIR = os.environ.get("SD_SCRIPTS_DIR")
pytestmark = pytest.mark.skipif(not SD_SCRIPTS_DIR, reason="set SD_SCRIPTS_DIR to an sd-scripts checkout (main 48d368fa)")


ROUTES = """
[plugins.downscale]
[[plugins.downscale.routes]]
route = "128:96"                  # a 16x16 latent at 12x12
sigma_min = 0.6
sigma_max = 0.9

[[plugins.downscale.routes]]
route = "128:64"                  # ... and at 8x8
sigma_min = 0.3
"""


FRACTIONAL = """
[plugins.downscale]
[[plugins.downscale.routes]]
scale = 0.75                      # a 16x16 latent at 12x12 (0.875 has no grid on 16: SDXL's multiple is 4)
sigma_min = 0.5
"""


def test_every_unet_forward_is_conditioned_on_the_target_size_of_its_own_grid(tmp_path):
    record, _ = recorded(tmp_path / "run", tmp_path / "unused", table=ROUTES, steps=12, images=4, arch="sdxl")
    sizes = record["unet_sizes"]
    assert len(sizes) == len(record["steps"]) == 24  # 12 steps × accumulation 2, one forward each
    assert {tuple(s["hw"]) for s in sizes} == {(16, 16), (12, 12), (8, 8)}
    assert all(s["embedded"] and s["target"] == [8 * s["hw"][0], 8 * s["hw"][1]] for s in sizes), sizes
    assert all(s["original"] == [128, 128] and s["crop"] == [0, 0] for s in sizes), sizes
    assert [s["hw"] for s in sizes] == [step["run_hw"] for step in record["steps"]]


def test_a_cropped_source_at_fractional_ratios_is_conditioned_as_a_bucket_of_the_small_grid(tmp_path, monkeypatch):
    """200 px high, 128 wide images in the 128 px square (no bucketing): the host's crop of the source's aspect into
    the square is 23 px from the left (``BucketManager.get_crop_ltrb``), 17.25 px at 0.75. A routed forward conditions
    on the crop rounded (17), the small grid's target (96²) and the source's own size (200 × 128), all in the
    embedding that reaches the UNet; a native forward on the host's own sizes."""
    monkeypatch.setenv("E2E_IMAGE_WH", "128x200")
    record, _ = recorded(tmp_path / "run", tmp_path / "unused", table=FRACTIONAL, steps=8, images=4, arch="sdxl")
    sizes = record["unet_sizes"]
    assert [s["hw"] for s in sizes] == [step["run_hw"] for step in record["steps"]] and len(sizes) == 16
    assert all(s["embedded"] and s["original"] == [200, 128] for s in sizes), sizes
    native = [s for s in sizes if s["hw"] == [16, 16]]
    routed = [s for s in sizes if s["hw"] == [12, 12]]
    assert native and routed and len(native) + len(routed) == len(sizes), sizes
    assert all(s["crop"] == [0, 23] and s["target"] == [128, 128] for s in native), native
    assert all(s["crop"] == [0, 17] and s["target"] == [96, 96] for s in routed), routed
