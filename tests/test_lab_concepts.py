"""The lab's concepts (lab/concept.py): hatch, subject and style build over the pretraining corpus'
buckets and codec, hold out disjoint images, are deterministic, carry new trigger classes, and span
fine detail to low frequency; the task names (and the old name ``concept``) reach the map."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("peft", reason="the lab needs the [lab] extra (a host's own environment has not)")

from downscale_plugin.grid import area_downsample
from downscale_plugin.lab.base import NULL_CLASS, BaseSettings
from downscale_plugin.lab.concept import (
    TASK_KINDS,
    TASKS,
    ConceptData,
    HatchConfig,
    HatchData,
    StyleConfig,
    StyleData,
    grade,
    halftone_screen,
    heldout_power_above,
    luma,
    photo,
    power_above_nyquist,
    stylize,
    task_data,
)
from downscale_plugin.lab.data import LabData, LabDataConfig, _resize_short_side

BUCKETS = ((64, 64), (64, 96))
SMALL_HATCH = HatchConfig(train_images=4, heldout_images=2, size=128)


@pytest.fixture(scope="module")
def base() -> LabData:
    return LabData(LabDataConfig(buckets=BUCKETS))


def build(task: str, base: LabData) -> ConceptData:
    """A concept at test size (the posters small; the photographs' size follows the buckets)."""
    return HatchData(base, SMALL_HATCH) if task == "hatch" else task_data(task, base)


@pytest.fixture(scope="module")
def concepts(base: LabData) -> dict[str, ConceptData]:
    return {task: build(task, base) for task in ("hatch", "subject", "style")}


def image_bytes(crop_set) -> set[bytes]:
    return {bytes(img.numpy()) for per_scale in crop_set.images for img in per_scale}


def test_tasks_build_with_their_kinds(base: LabData, concepts: dict[str, ConceptData]) -> None:
    assert TASKS == ("corpus", "hatch", "subject", "style")
    assert TASK_KINDS == {"corpus": None, "hatch": "fine_detail", "subject": "subject", "style": "style"}
    assert task_data("corpus", base) is base
    for task, data in concepts.items():
        assert data.kind == TASK_KINDS[task] and data.codec is base.codec and data.cfg.buckets == BUCKETS
        batch = data.batch(0, 3, seed=1)
        assert batch["latents"].shape[:2] == (3, base.cfg.latent_channels) and set(batch["class_ids"].tolist()) == {data.class_id}
        assert len(data.validation_set(per_bucket=2, seed=0)) == len(BUCKETS)
    assert concepts["subject"].names == ["motorcycle_left"] and concepts["subject"].validation_source.names == ["motorcycle_right"]
    assert len(concepts["subject"].train.images[0]) == 3  # whole subject to close-up: three scales


def test_training_and_held_out_are_disjoint(concepts: dict[str, ConceptData]) -> None:
    for data in concepts.values():
        assert not set(data.names) & set(data.validation_source.names)
        assert not image_bytes(data.train) & image_bytes(data.validation_source)
        train = {bytes(z.numpy()) for step in range(8) for z in data.batch(step, 2, seed=0)["latents"]}
        held = {bytes(z.numpy()) for batch in data.validation_set(per_bucket=2, seed=0) for z in batch["latents"]}
        assert not train & held


def test_concepts_are_deterministic(base: LabData, concepts: dict[str, ConceptData]) -> None:
    for task, data in concepts.items():
        again = build(task, base)
        for a, b in ((data.train, again.train), (data.validation_source, again.validation_source)):
            assert a.names == b.names and all(
                torch.equal(x, y) for pa, pb in zip(a.images, b.images, strict=True) for x, y in zip(pa, pb, strict=True)
            )
        assert torch.equal(data.batch(3, 2, seed=5)["latents"], again.batch(3, 2, seed=5)["latents"])
    other = StyleData(base, StyleConfig(seed=1))  # the screens' phases follow the seed
    assert not torch.equal(other.train.images[0][0], concepts["style"].train.images[0][0])


def test_triggers_are_new_classes_and_photographs_new_to_the_multires_base(base: LabData, concepts: dict[str, ConceptData]) -> None:
    pretraining = set(range(base.num_sources)) | {NULL_CLASS}  # the corpus' classes: one per source, and the null caption
    triggers = [data.class_id for data in concepts.values()]
    assert triggers[0] == 1000 and len(set(triggers)) == 3 and not set(triggers) & pretraining
    corpus = set(base.names)
    subject = concepts["subject"]
    assert not (set(subject.names) | set(subject.validation_source.names)) & corpus
    style = concepts["style"]
    assert all(name not in corpus or name in BaseSettings().held_out for name in style.validation_source.names)
    assert not set(style.validation_source.names) & set(style.names)


def test_old_task_name_and_unknown_task(base: LabData) -> None:
    old, new = task_data("concept", base), task_data("hatch", base)
    assert type(old) is HatchData and old.names == new.names and image_bytes(old.train) == image_bytes(new.train)
    with pytest.raises(
        ValueError, match=r"'posters' is not a lab task \(allowed: corpus, hatch, subject, style; old name: concept = hatch\)"
    ):
        task_data("posters", base)


def test_map_accepts_the_tasks(capsys) -> None:
    import downscale_plugin.mapping.cli  # noqa: F401  (registers the command)
    from downscale_plugin.__main__ import main
    from downscale_plugin.hosts.lab.map_backend import LabMapConfig, lab_problems

    for task in (*TASKS, "concept"):
        assert lab_problems(LabMapConfig(task=task), ()) == []
    assert lab_problems(LabMapConfig(task="posters"), ())[0].startswith("task: 'posters' is not a lab task (allowed: corpus, hatch")
    # Through the command line: the only problem reported is the impossible ratio, not the task.
    assert main(["map", "--lab", "--task", "subject", "--ratios", "0.9", "--native_size", "8x8"]) == 2
    err = capsys.readouterr().err
    assert "no strictly smaller" in err and "task" not in err
    assert main(["map", "--lab", "--task", "posters", "--native_size", "8x8"]) == 2
    assert "allowed: corpus, hatch, subject, style" in capsys.readouterr().err


def radial_power(img: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Radially averaged power spectrum of a [H, W] image (about its mean): (periods in px, power)."""
    h, w = img.shape
    power = np.abs(np.fft.fft2(img - img.mean())) ** 2
    f = np.hypot(*np.meshgrid(np.fft.fftfreq(h), np.fft.fftfreq(w), indexing="ij"))
    rings = np.round(f * h).astype(int)  # 1/h-wide rings
    totals = np.bincount(rings.ravel(), power.ravel()) / np.maximum(np.bincount(rings.ravel()), 1)
    k = np.arange(1, len(totals))
    return h / k, totals[1:]


def test_style_texture_has_its_energy_at_the_period() -> None:
    """Styled minus graded (the texture alone) of a photograph peaks at 24 px, and most of its power is
    at 16–32 px (4–8 latent cells)."""
    cfg = StyleConfig()
    img = _resize_short_side(photo("astronaut"), 256)[:256, :256]
    texture = luma(stylize(img, cfg, np.array([0.4, 1.9])) - grade(img))
    periods, power = radial_power(texture)
    assert 22 <= periods[np.argmax(power)] <= 26
    ring_power = power * np.arange(1, len(power) + 1)  # each ring's total (its mean times its circumference)
    assert ring_power[(periods >= 16) & (periods <= 32)].sum() > 0.6 * ring_power.sum()


def test_style_screen_survives_a_routed_grid(base: LabData) -> None:
    """An exact area downsample to 0.75 or 0.875 keeps about 80 % of the screen's latent power (its
    period is 6 cells; lab/concept.py's docstring)."""
    screen = 0.5 + 0.1 * halftone_screen((256, 256), StyleConfig().period, np.zeros(2))
    latent = base.codec.encode(torch.from_numpy(screen).float().expand(1, 3, 256, 256)) - base.codec.encode(
        torch.full((1, 3, 256, 256), 0.5)
    )
    for ratio in (0.75, 0.875):
        n = round(latent.shape[-1] * ratio)
        small = area_downsample(latent, (n, n))
        kept = (small - small.mean(dim=(-2, -1), keepdim=True)).square().mean() / (
            latent - latent.mean(dim=(-2, -1), keepdim=True)
        ).square().mean()
        assert 0.75 < kept.item() < 0.85


def test_power_above_nyquist() -> None:
    x = torch.arange(64.0)
    for period, share in ((2.0, 1.0), (2.5, 1.0), (8.0, 0.0)):  # 2 and 2.5 cells: above 0.75's Nyquist (8/3 cells); 8 cells: below
        z = torch.cos(2 * math.pi * x / period)[None, None, None, :].expand(1, 2, 64, 64)
        above, total = power_above_nyquist(z, 0.75)
        assert above / total == pytest.approx(share, abs=0.02)
    with pytest.raises(ValueError, match="ratio"):
        power_above_nyquist(z, 1.0)


def test_concepts_span_fine_detail_to_low_frequency(concepts: dict[str, ConceptData]) -> None:
    shares = {task: heldout_power_above(data, 0.75, per_bucket=2) for task, data in concepts.items()}
    assert shares["hatch"] > 0.5 and shares["hatch"] > 2 * max(shares["subject"], shares["style"])


def test_a_native_size_past_every_default_bucket_gets_one_square_bucket_that_holds_it() -> None:
    from downscale_plugin.hosts.lab.map_backend import data_holding

    defaults = LabDataConfig()
    assert data_holding(defaults, (256, 256)) is defaults and data_holding(defaults, (192, 320)) is defaults
    assert data_holding(defaults, (384, 384)).buckets == ((384, 384),)  # the 2 304-token map (96 x 96 latent)
    assert data_holding(defaults, (200, 300)).buckets == ((320, 320),)  # the longer side rounded up to 32 px
    assert data_holding(defaults, (384, 384)).scales == defaults.scales


@pytest.fixture(scope="module")
def base_384() -> LabData:
    from downscale_plugin.hosts.lab.map_backend import data_holding

    return LabData(data_holding(LabDataConfig(), (384, 384)))


@pytest.mark.parametrize("task", TASKS)
def test_every_task_gives_probes_at_a_native_size_past_the_default_buckets(task, base_384: LabData) -> None:
    """The token-count map at 96 x 96 latent cells (384 px, 2 304 tokens), as ``LabBackend`` builds its data;
    with the default buckets no crop that large exists."""
    from downscale_plugin.hosts.lab.map_backend import select_probes

    probes = select_probes(task_data(task, base_384), 2, (96, 96), seed=0)
    assert [p["latents"].shape[-2:] for p in probes] == [(96, 96)] * 2
    assert [p["pixels"].shape[-2:] for p in probes] == [(384, 384)] * 2
    if task == "corpus":
        with pytest.raises(ValueError, match="no bucket that large"):
            select_probes(LabData(LabDataConfig()), 1, (96, 96), seed=0)
