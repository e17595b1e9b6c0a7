"""Short rectified-flow pretraining of the lab DiT, so the base model really denoises before a LoRA
is trained on it (gradients of an untrained model say little about a downscaled step).

Target = noise − latents, σ ~ logit-normal(0, 1) (the host's ``sigmoid`` sampler), the full model
trained with AdamW (warmup, cosine decay, grad-norm clip 1), through the lab trainer's own
``process_batch``. The result is cached under ``$DOWNSCALE_PLUGIN_CACHE/lab/<hash>.pt`` (default
``~/.cache/downscale_plugin``), keyed by model, data and schedule, so it runs once per machine.

    python -m downscale_plugin.lab.pretrain [--quick] [--force]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import diffusers
import torch
from tqdm.auto import tqdm

from .data import LabData, LabDataConfig
from .model import LabDiT, LabModelConfig, LabTextEncoder, build_model
from .trainer import LabAccelerator, LabTrainer, lab_args, make_noise_scheduler

CACHE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class PretrainSettings:
    """Schedule. The default takes ~5 min on 2 CPU cores for the default model (loss 2.2 -> 0.6);
    quick, seconds."""

    steps: int = 400
    batch_size: int = 4
    lr: float = 1e-3
    warmup: int = 20
    seed: int = 0


DEFAULT = PretrainSettings()
QUICK = PretrainSettings(steps=40, batch_size=2, warmup=4)


def cache_dir() -> Path:
    root = os.environ.get("DOWNSCALE_PLUGIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "downscale_plugin"
    )
    return Path(root) / "lab"


def cache_key(cfg: LabModelConfig, settings: PretrainSettings, data: LabData) -> str:
    """Hash of everything the weights depend on (including which packaged images were found)."""
    blob = json.dumps(
        {
            "version": CACHE_VERSION,
            "diffusers": diffusers.__version__,
            "model": dataclasses.asdict(cfg),
            "data": dataclasses.asdict(data.cfg),
            "sources": data.names,
            "settings": dataclasses.asdict(settings),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def lr_factor(step: int, warmup: int, steps: int) -> float:
    """Linear warmup over ``warmup`` steps, then a cosine from 1 to 0.1 at ``steps``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def full_model_step(model: LabDiT, lr: float, warmup: int, steps: int, seed: int) -> Callable[[dict], float]:
    """One AdamW step of the whole model per call (lr schedule :func:`lr_factor`, grad-norm clip 1),
    through the lab trainer's own ``process_batch`` with the host's ``sigmoid`` σ sampler; returns the
    loss. Noise and σ come from the global RNG, so callers seed it (forked) once before the first step."""
    args = lab_args(timestep_sampling="sigmoid", sigmoid_scale=1.0, model_prediction_type="raw", seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, warmup, steps))
    trainer, accelerator = LabTrainer(), LabAccelerator()
    noise_scheduler = make_noise_scheduler(args)
    text_encoder = LabTextEncoder(model.cfg)

    def step(batch: dict) -> float:
        loss = trainer.process_batch(batch, text_encoder, model, None, noise_scheduler, torch.float32, accelerator, args)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def pretrain(cfg: LabModelConfig, settings: PretrainSettings, data: LabData, progress: bool = True) -> LabDiT:
    """Train the whole DiT from a seeded init; returns it frozen, with ``pretrain_losses`` filled."""
    if data.cfg.latent_channels != cfg.latent_channels:
        raise ValueError("data and model disagree on latent_channels")
    model = build_model(cfg, settings.seed).train()
    step_fn = full_model_step(model, settings.lr, settings.warmup, settings.steps, settings.seed)
    losses: list[float] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        bar = tqdm(range(settings.steps), desc="lab pretrain", disable=not progress)
        for step in bar:
            losses.append(step_fn(data.batch(step, settings.batch_size, settings.seed)))
            bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.4f}")
    model.eval().requires_grad_(False)
    model.pretrain_losses = losses
    return model


def load_or_pretrain(
    cfg: LabModelConfig | None = None,
    quick: bool = False,
    progress: bool = True,
    *,
    data: LabData | None = None,
    force: bool = False,
) -> LabDiT:
    """The pretrained lab DiT from the cache, pretraining (and caching) it first if needed."""
    cfg = cfg or LabModelConfig()
    data = data or LabData(LabDataConfig(latent_channels=cfg.latent_channels))
    settings = QUICK if quick else DEFAULT
    path = cache_dir() / f"{cache_key(cfg, settings, data)}.pt"
    if path.is_file() and not force:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        model = build_model(cfg, settings.seed)
        model.load_state_dict(blob["state_dict"])
        model.eval().requires_grad_(False)
        model.pretrain_losses = list(blob["losses"])
        return model
    model = pretrain(cfg, settings, data, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save({"state_dict": model.state_dict(), "losses": model.pretrain_losses}, tmp)
    os.replace(tmp, path)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m downscale_plugin.lab.pretrain", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="seconds-long schedule (for tests and smoke runs)")
    parser.add_argument("--force", action="store_true", help="retrain even if a cached result exists")
    parser.add_argument("--no-progress", action="store_true")
    ns = parser.parse_args(argv)
    t0 = time.perf_counter()
    model = load_or_pretrain(quick=ns.quick, progress=not ns.no_progress, force=ns.force)
    losses = model.pretrain_losses
    k = max(1, min(10, len(losses) // 4))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"lab DiT ready in {time.perf_counter() - t0:.1f} s (cache: {cache_dir()})")
    print(f"pretrain loss: first-{k} mean {first:.4f} -> last-{k} mean {last:.4f} ({last / first:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
