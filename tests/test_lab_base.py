"""The shipped lab base (lab/base.py): digest-checked loading, bit-for-bit pretraining, the size
sampler, the stopping rule, the held-out split and the ``lab pretrain`` command."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch

pytest.importorskip("peft", reason="the lab needs the [lab] extra (a host's own environment has not)")  # before the lab imports it

from downscale_plugin.__main__ import main
from downscale_plugin.lab import base as lab_base
from downscale_plugin.lab.base import (
    BASES,
    NULL_CLASS,
    BaseSettings,
    LabBase,
    MultiSizeData,
    load_base,
    pretrain_base,
    sha256,
    should_stop,
    state_bytes,
)
from downscale_plugin.lab.model import LabDiT, LabModelConfig

TINY = LabModelConfig(hidden_size=32, num_heads=2, double_layers=1, single_layers=1, latent_channels=4,
                      text_tokens=4, text_dim=16, pooled_dim=8)  # fmt: skip
TINY_SETTINGS = BaseSettings(
    sizes=(32, 48, 64), held_out=("pink_noise_0",), packaged=False, generated=3, max_steps=6, eval_every=3, held_out_per_size=1
)
TINY_BASE = LabBase("tiny", TINY, TINY_SETTINGS)


@pytest.fixture(scope="module")
def tiny_data() -> MultiSizeData:
    return MultiSizeData(TINY_SETTINGS, TINY.latent_channels)


def test_shipped_base_loads_and_its_digest_matches() -> None:
    base = BASES["multires"]
    record = json.loads(base.record_path.read_text(encoding="utf-8"))
    blob = base.weights_path.read_bytes()
    assert sha256(blob) == record["sha256"] and len(blob) == record["bytes"]
    model = load_base("multires")
    assert isinstance(model, LabDiT) and not any(p.requires_grad for p in model.parameters())
    assert sha256(state_bytes(model)) == record["sha256"]
    assert record["steps"] == len(model.pretrain_losses) and record["held_out_curve"][0]["step"] == 0


def test_a_damaged_shipped_file_is_a_clear_error(tmp_path, monkeypatch) -> None:
    base = BASES["multires"]
    shutil.copy(base.record_path, tmp_path / base.record_path.name)
    blob = bytearray(base.weights_path.read_bytes())
    blob[-1] ^= 1
    (tmp_path / base.weights_path.name).write_bytes(bytes(blob))
    monkeypatch.setattr(lab_base, "WEIGHTS_DIR", tmp_path)
    with pytest.raises(ValueError, match="has sha256 .* its record says"):
        load_base("multires")
    with pytest.raises(ValueError, match="allowed: multires"):
        load_base("nope")


def test_pretraining_is_bit_for_bit_reproducible() -> None:
    first, record = pretrain_base(TINY_BASE, log=lambda line: None)
    again, _ = pretrain_base(TINY_BASE, log=lambda line: None)
    assert state_bytes(first) == state_bytes(again)
    assert record["steps"] == 6 and [c["step"] for c in record["held_out_curve"]] == [0, 3, 6]
    assert all(len(c["per_size"]) == len(TINY_SETTINGS.sizes) for c in record["held_out_curve"])
    assert record["held_out_curve"][-1]["mean"] < record["held_out_curve"][0]["mean"]


def test_every_size_gets_the_same_number_of_steps(tiny_data: MultiSizeData) -> None:
    sizes = TINY_SETTINGS.sizes
    for block in range(4):
        assert sorted(tiny_data.size_at(block * len(sizes) + i) for i in range(len(sizes))) == sorted(sizes)
    assert [tiny_data.size_at(i) for i in range(12)] != [sizes[i % 3] for i in range(12)]  # shuffled, not cyclic
    for step in range(6):
        batch, size = tiny_data.batch(step), tiny_data.size_at(step)
        assert batch["latents"].shape == (TINY_SETTINGS.batch_size(size), TINY.latent_channels, size // 4, size // 4)
    assert Counter(BaseSettings().batch_size(s) for s in (96, 192, 256, 288, 512)) == Counter({4: 2, 2: 1, 1: 2})


def test_stopping_rule_on_a_synthetic_curve() -> None:
    assert not should_stop([1.0, 0.9], patience=2, min_improvement=0.03)  # too few evaluations
    assert not should_stop([1.0, 0.9, 0.8, 0.78], patience=2, min_improvement=0.03)  # 13 % over the last two
    assert should_stop([1.0, 0.9, 0.89, 0.885], patience=2, min_improvement=0.03)  # 1.7 %
    assert should_stop([1.0, 0.9, 0.95, 0.91], patience=2, min_improvement=0.03)  # worse
    _, record = pretrain_base(
        LabBase("tiny", TINY, BaseSettings(**{**TINY_SETTINGS.__dict__, "patience": 1, "min_improvement": 1.0})), log=lambda line: None
    )
    assert record["steps"] == 3 and record["stopped_by"] == "rule"  # a 100 % improvement is never met: stop at the first chance


def test_held_out_images_are_never_trained_on(tiny_data: MultiSizeData) -> None:
    assert tiny_data.held_out_names == ["pink_noise_0"] and "pink_noise_0" not in tiny_data.train_names
    held = {tiny_data.held_out[b["bucket"][0]].names[int(i)] for b in tiny_data.held_out_set() for i in b["sources"]}
    batches = [tiny_data.batch(step) for step in range(40)]
    trained = {tiny_data.train[b["bucket"][0]].names[int(i)] for b in batches for i in b["sources"]}
    assert held == {"pink_noise_0"} and trained == {"dead_leaves_0", "dead_leaves_1"}
    # Own classes are the corpus indices (dead_leaves_0, pink_noise_0, dead_leaves_1); the held-out crops are
    # scored under the null caption, and about caption_dropout of the training crops are trained under it.
    assert all(b["class_ids"].tolist() == [NULL_CLASS] * TINY_SETTINGS.held_out_per_size for b in tiny_data.held_out_set())
    class_ids = torch.cat([b["class_ids"] for b in batches])
    assert set(class_ids.tolist()) == {0, 2, NULL_CLASS} and 0.03 < (class_ids == NULL_CLASS).float().mean() < 0.25
    assert all((b["class_ids"] == NULL_CLASS).tolist() == [c == "" for c in b["captions"]] for b in batches)
    assert [b["bucket"] for b in tiny_data.held_out_set()] == [(s, s) for s in TINY_SETTINGS.sizes]
    assert all(torch.equal(a["latents"], b["latents"]) for a, b in zip(tiny_data.held_out_set(), tiny_data.held_out_set(), strict=True))
    with pytest.raises(ValueError, match="held_out: .*'astronaut'.* not corpus sources"):
        MultiSizeData(BaseSettings(**{**TINY_SETTINGS.__dict__, "held_out": ("astronaut",)}), 4)


def test_lab_pretrain_command_writes_and_compares(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(BASES, "tiny", TINY_BASE)
    monkeypatch.setattr(lab_base, "WEIGHTS_DIR", tmp_path / "shipped")
    assert main(["lab", "pretrain", "--base", "tiny", "--out", str(tmp_path / "shipped")]) == 0
    assert "no shipped base to compare with" in capsys.readouterr().out
    assert main(["lab", "pretrain", "--base", "tiny", "--check"]) == 0
    assert main(["lab", "pretrain", "--base", "tiny", "--out", str(tmp_path / "again")]) == 0
    assert "matches the shipped base bit for bit" in capsys.readouterr().out
    record = json.loads((tmp_path / "shipped" / "tiny.json").read_text(encoding="utf-8"))
    assert record["threads"] == 1 and record["command"] == "python -m downscale_plugin lab pretrain --base tiny" and record["revision"]
    with monkeypatch.context() as m:
        m.setitem(BASES, "tiny", LabBase("tiny", TINY, BaseSettings(**{**TINY_SETTINGS.__dict__, "seed": 1})))
        assert main(["lab", "pretrain", "--base", "tiny", "--out", str(tmp_path / "other")]) == 1
    assert "differs from the shipped base" in capsys.readouterr().out
    assert main(["lab", "pretrain", "--base", "nope"]) == 2


def test_the_lab_map_measures_on_a_shipped_base_when_asked() -> None:
    from downscale_plugin.hosts.lab.map_backend import LabBackend, LabMapConfig, lab_problems

    assert lab_problems(LabMapConfig(base="nope"), ()) == ["lab_base: 'nope' is not a shipped lab base (allowed: multires)"]
    assert lab_problems(LabMapConfig(base="multires", quick=True), ())[0].startswith("lab_base: a shipped base has its own model")
    backend = LabBackend(LabMapConfig(base="multires", native_hw=(16, 16), warm_steps=0), images=1, progress=False)
    shipped = load_base("multires")
    measured = {k.replace(".base_layer", ""): v for k, v in backend.model.state_dict().items() if "lora_" not in k}  # peft wraps layers
    assert measured.keys() == shipped.state_dict().keys()
    assert all(torch.equal(v, measured[k]) for k, v in shipped.state_dict().items())
    record = json.loads(BASES["multires"].record_path.read_text(encoding="utf-8"))
    assert backend.identity == f"lab:base:multires:{record['sha256'][:16]}"
    assert "shipped multi-size base 'multires'" in backend.describe()["model"]
