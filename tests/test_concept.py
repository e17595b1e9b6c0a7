"""The lab concept (lab/concept.py): new to the base model, held out for validation, and carrying
detail a half-resolution latent cannot hold; per-item native validation losses (lab/trainer.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft", reason="the lab needs the [lab] extra (a host's own environment has not)")

from downscale_plugin.grid import area_downsample
from downscale_plugin.lab.concept import HatchConfig, HatchData, hatched_poster, task_data
from downscale_plugin.lab.data import LabData, LabDataConfig
from downscale_plugin.lab.model import LabModelConfig, build_model
from downscale_plugin.lab.trainer import native_validation_loss, native_validation_losses

TINY = LabModelConfig(hidden_size=32, num_heads=2, double_layers=1, single_layers=1, latent_channels=4,
                      text_tokens=4, text_dim=16, pooled_dim=8)  # fmt: skip
BUCKETS = ((64, 64), (64, 96))


@pytest.fixture(scope="module")
def base() -> LabData:
    return LabData(LabDataConfig(buckets=BUCKETS, latent_channels=TINY.latent_channels))


@pytest.fixture(scope="module")
def concept(base: LabData) -> HatchData:
    return HatchData(base, HatchConfig(train_images=6, heldout_images=3, size=128))


def test_concept_is_new_and_validation_held_out(base: LabData, concept: HatchData) -> None:
    assert concept.codec is base.codec and concept.cfg.buckets == BUCKETS  # the pretraining codec and buckets
    train_images = {bytes(img[0].numpy()) for img in concept.train.images}
    heldout = {bytes(img[0].numpy()) for img in concept.validation_source.images}
    assert len(train_images) == 6 and len(heldout) == 3 and not train_images & heldout
    trigger = concept.concept.class_id
    assert trigger >= base.num_sources  # a text class no pretraining source is captioned with
    for step in range(6):
        batch = concept.batch(step, 2, seed=3)
        assert batch["class_ids"].tolist() == [trigger, trigger] and batch["sources"].max() < 6
        assert torch.equal(batch["latents"], concept.batch(step, 2, seed=3)["latents"])
    for val in concept.validation_set(per_bucket=2, seed=0):
        assert val["captions"][0].startswith("heldout_")
    assert task_data("corpus", base) is base and isinstance(task_data("concept", base), HatchData)
    with pytest.raises(ValueError, match="allowed: corpus, hatch, subject, style; old name: concept = hatch"):
        task_data("posters", base)


def half_grid_loss(data) -> float:
    """The share of the latents' variance that an exact 0.5 area downsample removes."""
    lost, total = 0.0, 0.0
    for step in range(24):
        z = data.batch(step, 2, 0)["latents"]
        h, w = z.shape[-2:]
        up = area_downsample(z, (h // 2, w // 2)).repeat_interleave(2, -2).repeat_interleave(2, -1)
        lost += ((z - up) ** 2).sum().item()
        total += ((z - z.mean(dim=(-2, -1), keepdim=True)) ** 2).sum().item()
    return lost / total


def test_concept_detail_is_lost_at_half_resolution() -> None:
    """Its hatch and marks repeat every two latent cells: half the grid averages them away, far more
    of the concept than of the pretraining corpus (the lab's 16-channel codec)."""
    base = LabData(LabDataConfig(buckets=BUCKETS, latent_channels=16))
    concept = HatchData(base, HatchConfig(train_images=6, heldout_images=3, size=128))
    concept_share, corpus_share = half_grid_loss(concept), half_grid_loss(base)
    assert concept_share > 0.5 and concept_share > corpus_share + 0.15
    poster = hatched_poster(64, seed=1)
    assert poster.shape == (64, 64, 3) and 0.0 <= poster.min() and poster.max() <= 1.0
    assert (poster == hatched_poster(64, seed=1)).all() and not (poster == hatched_poster(64, seed=2)).all()


def test_per_item_validation_losses(concept: HatchData) -> None:
    model = build_model(TINY, seed=0)
    val = concept.validation_set(per_bucket=2, seed=0)
    items = native_validation_losses(model, None, val, seed=0, sigmas=(0.2, 0.8), draws=2)
    assert items.shape == (4, 2, 2)  # 2 buckets × 2 crops, 2 σ, 2 draws
    assert not torch.equal(items[..., 0], items[..., 1])  # each draw its own noise
    assert native_validation_loss(model, None, val, seed=0, sigmas=(0.2, 0.8), draws=2) == pytest.approx(items.mean().item())
    assert torch.equal(items, native_validation_losses(model, None, val, seed=0, sigmas=(0.2, 0.8), draws=2))
    assert not torch.equal(items, native_validation_losses(model, None, val, seed=1, sigmas=(0.2, 0.8), draws=2))
    # One crop's loss does not depend on what else shares its batch.
    alone = [{**val[0], "latents": val[0]["latents"][:1], "class_ids": val[0]["class_ids"][:1]}]
    torch.testing.assert_close(native_validation_losses(model, None, alone, seed=0, sigmas=(0.2, 0.8), draws=2)[0], items[0])
    # A stratum appended at the end leaves the others' items as they were, in the study's chunked forward too: the
    # quality study's ε = 0.1 comparison validates its native twins at one more stratum and checks them against the
    # primary study's (benchmarks/bench_quality.py natives_match).
    chunked = native_validation_losses(model, None, val, seed=0, sigmas=(0.2, 0.8), draws=2, rows_per_forward=4)
    more = native_validation_losses(model, None, val, seed=0, sigmas=(0.2, 0.8, 0.95), draws=2, rows_per_forward=4)
    torch.testing.assert_close(more[:, :2], chunked, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="draws >= 1"):
        native_validation_losses(model, None, val, seed=0, draws=0)
