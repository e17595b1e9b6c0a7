"""``mode = "auto"`` in sd-scripts' real Anima script with ``--unsloth_offload_checkpointing`` (skipped unless
``SD_SCRIPTS_DIR`` points at an sd-scripts checkout; ``tests/sd_scripts_e2e.py`` runs the script on tiny models).

That checkpointer runs each block under ``no_grad`` and calls ``torch.autograd.backward`` itself, so a measurement by
``autograd.grad`` answered zeros for every adapter inside the blocks (here: all of them), and the certifier compared
nothing: every per-image estimate was the clip value, and the run stayed bitwise only because the blocks' backward,
pruned from ``autograd.grad``'s graph, never ran to write ``.grad``. The
measurement is now a backward with every ``.grad`` set aside and put back: the certifier's estimates are real
numbers, and at ε ≈ 0 (nothing certified) the run stays bitwise the plain ``networks.lora_anima`` run.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from test_certify_real import OPENS_NOTHING, recorded

SD_SCRIPTS_DIR = os.environ.get("SD_SCRIPTS_DIR")
pytestmark = pytest.mark.skipif(not SD_SCRIPTS_DIR, reason="set SD_SCRIPTS_DIR to an sd-scripts checkout (main 48d368fa)")


def test_unsloth_offload_checkpointing_is_measured_and_leaves_the_run_bitwise_the_hosts(tmp_path):
    import torch
    from safetensors.torch import load_file

    from downscale_plugin.mapping.sequential import TRIM

    argv = ("--unsloth_offload_checkpointing",)
    plain, _ = recorded(
        tmp_path / "plain", tmp_path / "certify_plain", "--network_module", "networks.lora_anima", *argv, table=OPENS_NOTHING, arch="anima"
    )
    mine, log = recorded(tmp_path / "plugin", tmp_path / "certify", *argv, table=OPENS_NOTHING, arch="anima")
    assert "certified before train batch " in log and "no route has a certified window" in log, log[-3000:]
    assert plain["metadata"]["ss_gradient_checkpointing"] == "True"  # --unsloth_offload_checkpointing turns it on
    blob = json.loads((tmp_path / "certify" / "certify.json").read_text())
    values = [v for b in blob["bins"] for v in b["evidence"]["excess"]]
    # autograd.grad's zeros made every per-image estimate the clip value TRIM (sequential.excess_of: no positive norm)
    assert values and all(math.isfinite(v) for v in values) and any(abs(v) < TRIM for v in values), values
    theirs = load_file(str(tmp_path / "plain" / "out" / "lora.safetensors"))
    weights = load_file(str(tmp_path / "plugin" / "out" / "lora.safetensors"))
    assert weights.keys() == theirs.keys()
    differ = [k for k in theirs if not torch.equal(weights[k], theirs[k])]
    assert not differ, f"{len(differ)} of {len(theirs)} tensors differ: {differ[:4]}"
