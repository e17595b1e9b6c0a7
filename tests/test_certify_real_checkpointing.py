"""``mode = "auto"`` in sd-scripts' real training scripts with their gradient checkpointing (skipped unless
``SD_SCRIPTS_DIR`` points at an sd-scripts checkout; ``tests/sd_scripts_e2e.py`` runs each script on tiny models).

- Anima with ``--unsloth_offload_checkpointing``: that checkpointer runs each block under ``no_grad`` and calls
  ``torch.autograd.backward`` itself, so a measurement by ``autograd.grad`` answered zeros for every adapter inside
  the blocks (here: all of them), and the certifier compared nothing: every per-image estimate was the clip value,
  and the run stayed bitwise only because the blocks' backward, pruned from ``autograd.grad``'s graph, never ran to
  write ``.grad``.
- SDXL with ``--gradient_checkpointing``: its UNet checkpoints each block reentrantly (``USE_REENTRANT = True`` in
  ``library/sdxl_original_unet.py``), which ``torch.autograd.grad`` refuses: a measurement by it ended the run at
  the first probe, after the models had loaded.

The measurement is a backward with every ``.grad`` set aside and put back, which both support: the certifier's
estimates are real numbers, and at ε ≈ 0 (nothing certified) the run stays bitwise the plain inner module's run.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from test_certify_real import OPENS_NOTHING, recorded

SD_SCRIPTS_DIR = os.environ.get("SD_SCRIPTS_DIR")
pytestmark = pytest.mark.skipif(not SD_SCRIPTS_DIR, reason="set SD_SCRIPTS_DIR to an sd-scripts checkout (main 48d368fa)")


@pytest.mark.parametrize(
    ("arch", "inner", "option"),
    [("anima", "networks.lora_anima", "--unsloth_offload_checkpointing"), ("sdxl", "networks.lora", "--gradient_checkpointing")],
)
def test_checkpointing_is_measured_and_leaves_the_run_bitwise_the_hosts(arch, inner, option, tmp_path):
    import torch
    from safetensors.torch import load_file

    from downscale_plugin.mapping.sequential import TRIM

    plain, _ = recorded(tmp_path / "plain", tmp_path / "certify_plain", "--network_module", inner, option, table=OPENS_NOTHING, arch=arch)
    mine, log = recorded(tmp_path / "plugin", tmp_path / "certify", option, table=OPENS_NOTHING, arch=arch)
    assert "certified before train batch " in log and "no route has a certified window" in log, log[-3000:]
    assert plain["metadata"]["ss_gradient_checkpointing"] == "True"  # Anima's unsloth option turns it on too
    blob = json.loads((tmp_path / "certify" / "certify.json").read_text())
    values = [v for b in blob["bins"] for v in b["evidence"]["excess"]]
    # autograd.grad's zeros made every per-image estimate the clip value TRIM (sequential.excess_of: no positive norm)
    assert values and all(math.isfinite(v) for v in values) and any(abs(v) < TRIM for v in values), values
    theirs = load_file(str(tmp_path / "plain" / "out" / "lora.safetensors"))
    weights = load_file(str(tmp_path / "plugin" / "out" / "lora.safetensors"))
    assert weights.keys() == theirs.keys()
    differ = [k for k in theirs if not torch.equal(weights[k], theirs[k])]
    assert not differ, f"{len(differ)} of {len(theirs)} tensors differ: {differ[:4]}"
