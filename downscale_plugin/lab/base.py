"""The shipped lab base: the lab DiT pretrained over a range of sizes, shipped as weights.

Production DiTs are pretrained over many resolutions, so a routed step's smaller grid is in their
training distribution. The default pretrain (``lab/pretrain.py``) sees one size (960–1024 packed
tokens); a base in :data:`BASES` sees every size in ``BaseSettings.sizes``: the native grids the
token-count map measures up to 384 px (192, 256, 384 px = 576, 1024, 2304 tokens) and every grid a
route of them trains at (ratios 0.875, 0.75, 0.5 on the flux grid: 96 … 336 px), square, 4 px per
latent cell. 512 px (4096 tokens; its routes 448, 384, 256 px) is left out: a step there (batch 1)
costs ~5x the mean of the others, so with it a run and its bit-for-bit rerun did not fit the time
this base was built in on a shared 2-core CPU (the ~10 min run below would take ~25 min).

- Data: the lab corpus (``lab/data.py``), each source resized per size to a short side of
  ``size · scale`` (so a small size sees the whole picture at low resolution, as a downscaled image
  does, not a close-up crop of a large one), through the default corpus' codec (the same latent space
  as the single-size base). The sources named in ``held_out`` are never trained on.
- Captions: each source its own class (as in the corpus), and a ``caption_dropout`` fraction of the
  training crops gets the null class :data:`NULL_CLASS` instead, as production bases train for
  classifier-free guidance. The held-out images are scored under the null caption: their own classes
  are new to the model, and a first run that scored them under those unseen captions saw the held-out
  loss rise while the training loss fell (1.24 at step 100, 1.42 at 200; the model learns its
  per-image captions, which says nothing about how it denoises an unseen image).
- Sizes: every block of ``len(sizes)`` steps visits each size once, in a seeded order, so each size
  gets the same number of steps: each is a grid the map trains at, equally, and weighting by cost
  would starve the largest. Batch: ``max_batch`` crops, fewer (at least 1) where that would exceed
  ``batch_tokens`` packed tokens, so a large-size step costs about what a small one does.
- Training: the whole model with AdamW, exactly the default pretrain's step (``full_model_step``).
- Held-out loss: ``held_out_per_size`` crops per size of the held-out images, at the fixed σ of
  ``held_out_sigmas`` with fixed noise (``trainer.native_validation_losses``), per size and their mean,
  at step 0 and every ``eval_every`` steps.
- Stopping rule (fixed before the run): after each evaluation, stop when the mean held-out loss
  improved by less than ``min_improvement`` (relative) over the last ``patience`` evaluations;
  otherwise stop at ``max_steps``. The lr follows the default pretrain's curve over ``max_steps``.

``python -m downscale_plugin lab pretrain`` reruns it (deterministic at the recorded thread count on
the same torch build) and compares the digest with the shipped one; :func:`load_base` loads the
shipped file, no pretraining and no cache, after checking its sha256 against ``<name>.json``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .data import CropSet, LabData, LabDataConfig, corpus_sources, pyramid
from .model import LabDiT, LabModelConfig, build_model, image_tokens
from .pretrain import full_model_step
from .trainer import native_validation_losses

WEIGHTS_DIR = Path(__file__).parent / "weights"
SIZE_STREAM = 0x512E5  # the size order's RNG stream
CAPTION_STREAM = 0xCA9  # the caption dropout's RNG stream
NULL_CLASS = -1  # the null caption's class id (LabTextEncoder gives it a fixed context like any class)
HELD_OUT_STREAM = 0x4E1D  # the held-out crops' RNG stream


@dataclass(frozen=True)
class BaseSettings:
    """A base's data, schedule and stopping rule (see the module docstring)."""

    sizes: tuple[int, ...] = (96, 128, 144, 168, 192, 224, 256, 288, 336, 384)  # square sides, px
    scales: tuple[float, ...] = (1.0, 1.5)
    held_out: tuple[str, ...] = ("chelsea", "gravel", "pink_noise_1")
    caption_dropout: float = 0.1
    packaged: bool = True
    generated: int = 4
    max_batch: int = 4
    batch_tokens: int = 2304
    lr: float = 1e-3
    warmup: int = 20
    max_steps: int = 600
    eval_every: int = 100
    patience: int = 2
    min_improvement: float = 0.03
    held_out_per_size: int = 2
    held_out_sigmas: tuple[float, ...] = (0.3, 0.7)
    seed: int = 0
    threads: int = 1

    def __post_init__(self) -> None:
        if not self.sizes or any(s <= 0 or s % 8 for s in self.sizes):
            raise ValueError(f"sizes: {self.sizes} must be positive multiples of 8 px (even latent sides, for 2x2 packing)")
        if not 0.0 <= self.caption_dropout < 1.0:
            raise ValueError(f"caption_dropout: {self.caption_dropout} must be in [0, 1)")
        if self.eval_every < 1 or self.max_steps < 1 or self.patience < 1 or self.threads < 1:
            raise ValueError("eval_every, max_steps, patience and threads must be >= 1")

    def batch_size(self, size: int) -> int:
        tokens = image_tokens(size // 4, size // 4)
        return max(1, min(self.max_batch, self.batch_tokens // tokens))


@dataclass(frozen=True)
class LabBase:
    """A named base: the model shape and how it is pretrained."""

    name: str
    model: LabModelConfig
    settings: BaseSettings

    @property
    def weights_path(self) -> Path:
        return WEIGHTS_DIR / f"{self.name}.safetensors"

    @property
    def record_path(self) -> Path:
        return WEIGHTS_DIR / f"{self.name}.json"


BASES = {"multires": LabBase("multires", LabModelConfig(), BaseSettings())}


class MultiSizeData:
    """Per size, a training and a held-out crop set (disjoint source images), over one codec.

    Class ids are the sources' indices in the whole corpus, as in :class:`~.data.LabData`.
    """

    def __init__(self, settings: BaseSettings, latent_channels: int) -> None:
        cfg = LabDataConfig(latent_channels=latent_channels, packaged=settings.packaged, generated=settings.generated)
        self.codec = LabData(cfg).codec  # the default corpus' latent space
        sources = corpus_sources(cfg, int(max(settings.sizes) * max(settings.scales)))
        names = [name for name, _ in sources]
        unknown = sorted(set(settings.held_out) - set(names))
        if unknown:
            raise ValueError(f"held_out: {unknown} are not corpus sources (sources: {', '.join(names)})")
        held = [i for i, name in enumerate(names) if name in settings.held_out]
        train = [i for i in range(len(names)) if i not in held]
        if not held or not train:
            raise ValueError(f"held_out: {settings.held_out} must leave at least one training and one held-out source")
        self.settings = settings
        self.train_names = [names[i] for i in train]
        self.held_out_names = [names[i] for i in held]
        self.train: dict[int, CropSet] = {}
        self.held_out: dict[int, CropSet] = {}
        for size in settings.sizes:
            images = [pyramid(img, size, settings.scales) for _, img in sources]
            self.train[size] = CropSet([images[i] for i in train], self.train_names, train, self.codec)
            self.held_out[size] = CropSet([images[i] for i in held], self.held_out_names, held, self.codec)

    def size_at(self, step: int) -> int:
        """The size of ``step``: each block of ``len(sizes)`` steps is a seeded permutation of the sizes."""
        sizes = self.settings.sizes
        block, pos = divmod(step, len(sizes))
        order = np.random.default_rng([self.settings.seed, SIZE_STREAM, block]).permutation(len(sizes))
        return sizes[int(order[pos])]

    def batch(self, step: int) -> dict:
        """Training batch ``step``, a ``caption_dropout`` share of its crops captioned with the null
        class: a pure function of (seed, step)."""
        s, size = self.settings, self.size_at(step)
        batch = self.train[size].crops(np.random.default_rng([s.seed, step]), (size, size), s.batch_size(size))
        dropped = np.random.default_rng([s.seed, CAPTION_STREAM, step]).random(len(batch["captions"])) < s.caption_dropout
        return _captioned(batch, torch.from_numpy(dropped))

    def held_out_set(self) -> list[dict]:
        """One batch of ``held_out_per_size`` held-out crops per size, in ``sizes`` order (fixed draw),
        every crop under the null caption."""
        s = self.settings
        return [
            _captioned(
                self.held_out[size].crops(np.random.default_rng([s.seed, HELD_OUT_STREAM, i]), (size, size), s.held_out_per_size),
                torch.ones(s.held_out_per_size, dtype=torch.bool),
            )
            for i, size in enumerate(s.sizes)
        ]


def _captioned(batch: dict, null: torch.Tensor) -> dict:
    """``batch`` with the crops where ``null`` is set captioned with the null class."""
    class_ids = torch.where(null, torch.full_like(batch["class_ids"], NULL_CLASS), batch["class_ids"])
    captions = ["" if n else c for n, c in zip(null.tolist(), batch["captions"], strict=True)]
    return {**batch, "class_ids": class_ids, "captions": captions}


def should_stop(curve: list[float], patience: int, min_improvement: float) -> bool:
    """The stopping rule: the last ``patience`` evaluations improved the loss by less than
    ``min_improvement`` (relative to the value ``patience`` evaluations ago)."""
    if len(curve) <= patience:
        return False
    before, now = curve[-1 - patience], curve[-1]
    return (before - now) / before < min_improvement


def held_out_losses(model: LabDiT, held_out_set: list[dict], settings: BaseSettings) -> list[float]:
    """Per size, the mean velocity MSE over its held-out crops and the fixed σ (fixed noise)."""
    with torch.no_grad():
        per_item = native_validation_losses(model, None, held_out_set, settings.seed, settings.held_out_sigmas)
    return [chunk.mean().item() for chunk in per_item.split(settings.held_out_per_size)]


def pretrain_base(base: LabBase, log: Callable[[str], None] = print) -> tuple[LabDiT, dict]:
    """Pretrain ``base`` from its seeded init under its stopping rule; returns the frozen model and the
    training record (steps, losses, held-out curve, wall time). Runs at ``settings.threads`` threads."""
    s = base.settings
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        t0 = time.perf_counter()
        data = MultiSizeData(s, base.model.latent_channels)
        held_out_set = data.held_out_set()
        model = build_model(base.model, s.seed).train()
        step_fn = full_model_step(model, s.lr, s.warmup, s.max_steps, s.seed)
        losses: list[float] = []
        curve: list[dict] = []

        def evaluate(step: int) -> None:
            model.eval()
            per_size = held_out_losses(model, held_out_set, s)
            model.train()
            curve.append({"step": step, "mean": sum(per_size) / len(per_size), "per_size": per_size})
            recent = losses[-s.eval_every :]
            train = f", train loss (last {len(recent)}) {sum(recent) / len(recent):.4f}" if recent else ""
            log(f"step {step}: held-out {curve[-1]['mean']:.4f}{train}, {time.perf_counter() - t0:.0f} s")

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(s.seed)
            evaluate(0)
            for step in range(s.max_steps):
                losses.append(step_fn(data.batch(step)))
                done = step + 1
                if done % s.eval_every == 0 or done == s.max_steps:
                    evaluate(done)
                    if should_stop([c["mean"] for c in curve], s.patience, s.min_improvement):
                        log(f"stopping rule met at step {done}")
                        break
        model.eval().requires_grad_(False)
        model.pretrain_losses = losses
        record = {
            "name": base.name,
            "model": dataclasses.asdict(base.model),
            "settings": dataclasses.asdict(s),
            "train_sources": data.train_names,
            "held_out_sources": data.held_out_names,
            "batch_sizes": {str(size): s.batch_size(size) for size in s.sizes},
            "steps": len(losses),
            "stopped_by": "rule" if len(losses) < s.max_steps else "max_steps",
            "held_out_curve": curve,
            "train_losses": losses,
            "wall_s": round(time.perf_counter() - t0, 1),
            "torch": torch.__version__,
            "threads": s.threads,
        }
        return model, record
    finally:
        torch.set_num_threads(threads)


def state_bytes(model: LabDiT) -> bytes:
    """The safetensors file of the model's weights (deterministic bytes for given tensors)."""
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in model.state_dict().items()})


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def shipped_record(base: LabBase) -> dict:
    if not base.record_path.is_file():
        raise FileNotFoundError(f"lab base {base.name!r}: no record {base.record_path}; run: python -m downscale_plugin lab pretrain")
    return json.loads(base.record_path.read_text(encoding="utf-8"))


def get_base(name: str) -> LabBase:
    if name not in BASES:
        raise ValueError(f"lab base: {name!r} is not a shipped base (allowed: {', '.join(BASES)})")
    return BASES[name]


def load_base(name: str = "multires") -> LabDiT:
    """The shipped base, frozen, its digest checked against its record; no pretraining, no cache."""
    from safetensors.torch import load

    base = get_base(name)
    record = shipped_record(base)
    if not base.weights_path.is_file():
        raise FileNotFoundError(f"lab base {name!r}: the weights file {base.weights_path} is missing; reinstall the package")
    blob = base.weights_path.read_bytes()
    digest = sha256(blob)
    if digest != record["sha256"]:
        raise ValueError(
            f"lab base {name!r}: {base.weights_path} has sha256 {digest}, its record says {record['sha256']}; "
            "the file is damaged or from another version: reinstall, or rerun python -m downscale_plugin lab pretrain"
        )
    model = build_model(LabModelConfig(**record["model"]), base.settings.seed)
    model.load_state_dict(load(blob))
    model.eval().requires_grad_(False)
    model.pretrain_losses = list(record["train_losses"])
    return model
