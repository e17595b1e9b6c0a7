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
import subprocess
import sys
from pathlib import Path

import pytest

SD_SCRIPTS_DIR = os.environ.get("SD_SCRIPTS_DIR")
pytestmark = pytest.mark.skipif(not SD_SCRIPTS_DIR, reason="set SD_SCRIPTS_DIR to an sd-scripts checkout (main 48d368fa)")
HERE = Path(__file__).parent

OPENS_NOTHING = """
[plugins.downscale]
mode = "auto"
map_out = "{out}"
map_ratios = [0.5]
map_bins = "0,0.5,1"
map_margin = 1e-9                 # ε ≈ 0: no bin can be certified; the certifier spends its looks and opens nothing
certify_draws = 2                 # a look: 4 probes × 2 draws × (1 + 0.25) = 10 native-step equivalents
certify_budget = 0.5              # of 40 steps × accumulation 2: 40, one safe verdict (the least a run may give)
"""


def recorded(work: Path, out: Path, *argv: str) -> tuple[dict, str]:
    """The real Anima script through ``sd_scripts_e2e.py record``: 16 images, batch 1, accumulation 2, 40 steps; route
    passes at their token fraction (``E2E_TOKEN_COSTS``: see ``tests/test_certify_real.py``)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([SD_SCRIPTS_DIR, str(HERE.parent)]),
        "COLUMNS": "1000",
        "E2E_ROUTES": OPENS_NOTHING.format(out=out),
        "E2E_IMAGES": "16",
        "E2E_REPEATS": "1",
        "E2E_STEPS": "40",
        "E2E_TOKEN_COSTS": "1",
    }
    proc = subprocess.run(
        [sys.executable, str(HERE / "sd_scripts_e2e.py"), "anima", str(work), "record", "--gradient_accumulation_steps", "2", *argv],
        cwd=SD_SCRIPTS_DIR,
        env=env,
        capture_output=True,
        text=True,
    )
    log = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 0 and "E2E OK" in log, log[-4000:]
    return json.loads((work / "record.json").read_text()), log


def test_unsloth_offload_checkpointing_is_measured_and_leaves_the_run_bitwise_the_hosts(tmp_path):
    import torch
    from safetensors.torch import load_file

    from downscale_plugin.mapping.sequential import TRIM

    argv = ("--unsloth_offload_checkpointing",)
    plain, _ = recorded(tmp_path / "plain", tmp_path / "certify_plain", "--network_module", "networks.lora_anima", *argv)
    mine, log = recorded(tmp_path / "plugin", tmp_path / "certify", *argv)
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
