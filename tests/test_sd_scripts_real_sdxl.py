"""sd-scripts' real SDXL script (skipped unless ``SD_SCRIPTS_DIR`` points at an sd-scripts checkout;
``tests/sd_scripts_e2e.py`` runs it on tiny models built from its own classes).

Routed steps condition on the small grid's sizes: each UNet forward's size embedding encodes the target size of the
grid it runs at (the source size stays the image's), the size conditioning of the host's own ``call_unet``.

``mode = "auto"`` with ``--gradient_checkpointing``: SDXL's UNet checkpoints each block reentrantly (``USE_REENTRANT = True`` in ``library/sdxl_original_unet.py``), which
``torch.autograd.grad`` refuses: a measurement by it ended the run at the first probe, after the models had loaded.
The measurement is a backward with every ``.grad`` set aside and put back, which a reentrant checkpoint supports: the
certifier's estimates are real numbers, and at ε ≈ 0 (nothing certified) the run stays bitwise the plain
``networks.lora`` run.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from test_certify_real import OPENS_NOTHING, recorded

SD_SCRIPTS_DIR = os.environ.get("SD_SCRIPTS_DIR")
pytestmark = pytest.mark.skipif(not SD_SCRIPTS_DIR, reason="set SD_SCRIPTS_DIR to an sd-scripts checkout (main 48d368fa)")


def test_reentrant_checkpointing_is_measured_and_leaves_the_run_bitwise_the_hosts(tmp_path):
    import torch
    from safetensors.torch import load_file

    from downscale_plugin.mapping.sequential import TRIM

    argv = ("--gradient_checkpointing",)
    plain, _ = recorded(
        tmp_path / "plain", tmp_path / "certify_plain", "--network_module", "networks.lora", *argv, table=OPENS_NOTHING, arch="sdxl"
    )
    mine, log = recorded(tmp_path / "plugin", tmp_path / "certify", *argv, table=OPENS_NOTHING, arch="sdxl")
    assert "certified before train batch " in log and "no route has a certified window" in log, log[-3000:]
    assert plain["metadata"]["ss_gradient_checkpointing"] == "True"
    blob = json.loads((tmp_path / "certify" / "certify.json").read_text())
    values = [v for b in blob["bins"] for v in b["evidence"]["excess"]]
    assert values and all(math.isfinite(v) for v in values) and any(abs(v) < TRIM for v in values), values
    theirs = load_file(str(tmp_path / "plain" / "out" / "lora.safetensors"))
    weights = load_file(str(tmp_path / "plugin" / "out" / "lora.safetensors"))
    assert weights.keys() == theirs.keys()
    differ = [k for k in theirs if not torch.equal(weights[k], theirs[k])]
    assert not differ, f"{len(differ)} of {len(theirs)} tensors differ: {differ[:4]}"


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
