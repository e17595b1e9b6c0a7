"""The lab's image sampler and a sample metric a user would look at (docs/fidelity/quality/PROTOCOL.md §5).

Sampling: Euler on the flow x_σ = (1 − σ)·x₀ + σ·ε from σ = 1 to 0, the model predicting the velocity
ε − x₀ (what the lab trainer trains it to), over ``steps`` σ on the training sampler's shift
(σ = s·t / (1 + (s − 1)·t), t evenly spaced), the LoRA merged as in ``trainer.native_validation_losses``.
Each sample's start noise comes from its own seeded stream, so a sample is a pure function of the
adapter, the class, the size and its noise seed.

Metric: the radially averaged power spectrum of a decoded image's luminance, log10, compared (L2) with
the mean log spectrum of reference images passed through the same codec (encode, decode), so the
codec's own band limit is not held against the samples.
"""

from __future__ import annotations

import torch
from torch.func import functional_call

from . import flux_utils
from .data import LatentCodec
from .model import LabDiT, LabTextEncoder
from .trainer import lab_args, stream_seed

SAMPLE_STREAM = 0x5A3B1E  # the samples' start noise: (this, noise seed)


def flow_sigmas(steps: int, shift: float) -> torch.Tensor:
    """``steps + 1`` σ from 1 to 0 on the shift schedule (the lab trainer's ``shift`` sampler's map)."""
    if steps < 1 or shift <= 0:
        raise ValueError(f"flow_sigmas needs steps >= 1 and shift > 0 (got {steps}, {shift})")
    t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return (shift * t / (1 + (shift - 1) * t)).float()


@torch.no_grad()
def sample_latents(
    model: LabDiT,
    lora: dict[str, torch.Tensor] | None,
    class_id: int,
    noise_seeds: list[int],
    latent_hw: tuple[int, int],
    steps: int = 24,
    shift: float | None = None,
) -> torch.Tensor:
    """One sample per noise seed, ``[N, C, h, w]``, all seeds in one batch per Euler step (``shift``:
    the lab trainer's ``discrete_flow_shift`` by default)."""
    shift = lab_args().discrete_flow_shift if shift is None else shift
    h, w = latent_hw
    if h % 2 or w % 2:
        raise ValueError(f"latent_hw: {latent_hw} must be even (2x2 packing)")
    weights = {}
    if lora:
        params = dict(model.named_parameters())
        weights = {f"{name}.weight": params[f"{name}.weight"] + delta for name, delta in lora.items()}
    shape = (model.cfg.latent_channels, h, w)
    x = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(stream_seed(SAMPLE_STREAM, s))) for s in noise_seeds])
    n = len(noise_seeds)
    l_pooled, t5_out, txt_ids, _ = LabTextEncoder(model.cfg).encode(torch.full((n,), class_id, dtype=torch.long))
    img_ids = flux_utils.prepare_img_ids(n, h // 2, w // 2)
    sigmas = flow_sigmas(steps, shift)
    for sigma, following in zip(sigmas[:-1], sigmas[1:], strict=True):
        kwargs = dict(img=flux_utils.pack_latents(x), img_ids=img_ids, txt=t5_out, txt_ids=txt_ids, y=l_pooled,
                      timesteps=sigma.repeat(n))  # fmt: skip
        velocity = flux_utils.unpack_latents(functional_call(model, weights, args=(), kwargs=kwargs), h // 2, w // 2)
        x = x + (following - sigma) * velocity
    return x


def luminance(pixels: torch.Tensor) -> torch.Tensor:
    """[N, 3, H, W] RGB → [N, H, W] luma (Rec. 601 weights)."""
    return torch.einsum("c,nchw->nhw", torch.tensor([0.299, 0.587, 0.114], dtype=pixels.dtype), pixels)


def radial_log_spectrum(pixels: torch.Tensor) -> torch.Tensor:
    """[N, 3, H, W] (square) → [N, H // 2]: log10 of the luminance's power spectrum (its mean removed),
    averaged over rings of integer radius 1 … H/2 in frequency."""
    y = luminance(pixels.double())
    size = y.shape[-1]
    if y.shape[-2] != size:
        raise ValueError(f"radial_log_spectrum needs square images (got {tuple(pixels.shape)})")
    power = torch.fft.fft2(y - y.mean(dim=(-2, -1), keepdim=True)).abs() ** 2
    f = torch.fft.fftfreq(size, d=1.0 / size, dtype=torch.float64)
    radius = torch.sqrt(f[:, None] ** 2 + f[None, :] ** 2).round().long().flatten()
    keep = (radius >= 1) & (radius <= size // 2)
    rings = torch.zeros(power.shape[0], size // 2 + 1, dtype=torch.float64)
    rings.index_add_(1, radius[keep], power.flatten(1)[:, keep])
    counts = torch.bincount(radius[keep], minlength=size // 2 + 1).double()
    return torch.log10(rings[:, 1:] / counts[1:] + 1e-20)


def spectrum_distances(samples: torch.Tensor, reference: torch.Tensor) -> list[float]:
    """Per sample (decoded pixels), the L2 distance of its log spectrum from ``reference`` (a mean log spectrum)."""
    return (radial_log_spectrum(samples) - reference).norm(dim=-1).tolist()


def reference_spectrum(pixels: torch.Tensor, codec: LatentCodec) -> torch.Tensor:
    """The mean log spectrum of reference images through ``codec`` (encode, decode)."""
    return radial_log_spectrum(codec.decode(codec.encode(pixels))).mean(dim=0)
