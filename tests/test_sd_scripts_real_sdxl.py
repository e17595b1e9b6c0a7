"""sd-scripts' real SDXL script (skipped unless ``SD_SCRIPTS_DIR`` points at an sd-scripts checkout;
``tests/sd_scripts_e2e.py`` runs it on tiny models built from its own classes).

Routed steps condition on the small grid's sizes: each UNet forward's size embedding encodes the target size of the
grid it runs at (the source size stays the image's), the size conditioning of the host's own ``call_unet``.
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


def test_every_unet_forward_is_conditioned_on_the_target_size_of_its_own_grid(tmp_path):
    record, _ = recorded(tmp_path / "run", tmp_path / "unused", table=ROUTES, steps=12, images=4, arch="sdxl")
    sizes = record["unet_sizes"]
    assert len(sizes) == len(record["steps"]) == 24  # 12 steps × accumulation 2, one forward each
    assert {tuple(s["hw"]) for s in sizes} == {(16, 16), (12, 12), (8, 8)}
    assert all(s["target"] == [8 * s["hw"][0], 8 * s["hw"][1]] for s in sizes), sizes
    assert [s["hw"] for s in sizes] == [step["run_hw"] for step in record["steps"]]
