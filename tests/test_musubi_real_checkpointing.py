"""``mode = "auto"`` in musubi-tuner's real Wan loop with ``--gradient_checkpointing --gradient_checkpointing_cpu_offload``
(skipped unless ``MUSUBI_DIR`` points at a musubi-tuner checkout): the checkpoint (non-reentrant, around
``utils/model_utils.create_cpu_offloading_wrapper``) reaches every adapter in the measurement's backward, and at
ε ≈ 0 the saved LoRA is bitwise the plain ``networks.lora_wan`` run's with the same options."""

from __future__ import annotations

import json

import pytest
import torch
from test_musubi_real import MUSUBI_DIR, _train_wan, musubi  # noqa: F401  # the fixture: musubi-tuner's modules

from downscale_plugin.mapping.sequential import TRIM

pytestmark = pytest.mark.skipif(not MUSUBI_DIR, reason="MUSUBI_DIR (a musubi-tuner checkout) is not set")


@pytest.mark.usefixtures("token_costs")
def test_cpu_offloaded_checkpointing_is_measured_and_leaves_the_run_bitwise(musubi, tmp_path):  # noqa: F811
    from safetensors.torch import load_file

    out = tmp_path / "plugin" / "auto"
    keys = ["ds_mode=auto", f"ds_map_out={out}", "ds_certify_budget=0.5", "ds_certify_unpaid=buy", "ds_map_ratios=0.5", "ds_map_bins=0,0.5,1",
            "ds_certify_draws=2", "ds_map_margin=1e-9"]  # fmt: skip
    argv = ("--gradient_checkpointing", "--gradient_checkpointing_cpu_offload")
    plain = _train_wan(musubi, tmp_path / "plain", [], 80, *argv, module="networks.lora_wan", clips=16)  # budget 40: one safe verdict
    plugin = _train_wan(musubi, tmp_path / "plugin", keys, 80, *argv, clips=16)  # 16 distinct probes
    blob = json.loads((out / "certify.json").read_text())
    values = [v for row in blob["bins"] for v in row["evidence"]["excess"]]
    assert values and any(abs(v) < TRIM for v in values), values  # real estimates: the adapters' gradients reached
    assert len(plugin) > len(plain) == 80 and plugin[:15] + plugin[len(plugin) - 65 :] == plain
    theirs, ours = (load_file(str(tmp_path / run / "out" / "w.safetensors")) for run in ("plain", "plugin"))
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)
