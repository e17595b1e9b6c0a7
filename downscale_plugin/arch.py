"""The architecture registry: one record per denoiser architecture, the only per-arch table in core.

A host maps its trainers to these names (``hosts/<host>/facts.py``); core and features read the
record: the grid rule (latent multiple, patch, VAE factor), the FLOP model (``plan``, accounting)
and the kind of position handle ``positions = "interpolate"`` scales (``fasterdit/positions.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .flops import FlopModel, StepFlops, arch_flops

# Kinds of position handle (fasterdit/positions.py dispatches on them):
# - "img_ids": a module function ``prepare_img_ids(batch, h, w)`` returning (B, h·w, 3) ids (Flux family)
# - "rope_embedder": the DiT's ``rope_embedder(ids)`` instance attribute over an integer table (Lumina)
# - "rope_angles": ``pos_embedder.generate_embeddings(B_T_H_W_C)`` returning RoPE angles (Anima)
# - "meshgrid": a module function ``get_meshgrid_nd(sizes, dim)`` building the positions (HunyuanImage)
POSITION_KINDS = ("img_ids", "rope_embedder", "rope_angles", "meshgrid")


@dataclass(frozen=True)
class ArchSpec:
    """What core code knows about an architecture, in latent pixels.

    ``multiple``: a routed grid's h and w are multiples of it; ``patch``: latent pixels per token
    side (DiT patchify, Flux 2×2 packing); ``vae_factor``: image pixels per latent pixel;
    ``flops``: the per-sample cost model (None: the caller supplies one, e.g. the lab DiT's own);
    ``positions``: the position-handle kind (None: no handle, ``positions = "interpolate"`` refused).
    """

    name: str
    multiple: int
    patch: int
    vae_factor: int
    flops: FlopModel | StepFlops | None = None
    positions: str | None = None


# FLOP models from the public model configs, as the hosts build them (flops.py counts each block's
# matmuls, forward and backward of a LoRA step; tests/test_flops.py checks them against a direct
# count, benchmarks/RESULTS.md against measured steps). Text tokens are the trainers' defaults; a
# host replaces them with the run's own lengths (hosts/sd_scripts/flop_args.py).
# - flux: FLUX.1-dev, hidden 3072, 24 heads, 19 double + 38 single blocks, T5 512 tokens. chroma:
#   the same blocks (its per-sample modulation comes from an approximator instead; per-sample cost
#   does not scale with the grid).
# - sd3: SD3.5-Medium MMDiT-X, depth 24 (hidden 1536), the extra image attention in its first 13
#   blocks; context 77 CLIP-L/G + 256 T5 tokens.
# - lumina: Lumina-Image-2.0 NextDiT 2B, dim 2304, 24 heads (8 kv), 26 layers + 2 + 2 refiners,
#   SwiGLU 6144; Gemma-2 caption 256 tokens (the padded length; NextDiT runs the batch's valid ones).
# - anima: model_channels 2048, 28 blocks, text by cross-attention from 512 T5-token outputs of the
#   6-layer LLM adapter (which reads 512 Qwen3 tokens).
# - hunyuan_image: HunyuanImage-2.1, hidden 3584, 20 double + 40 single blocks, mlp_ratio 4; text is
#   trimmed to the batch's valid Qwen2.5-VL + ByT5 tokens, 256 is a typical caption (the coarse model).
# - sdxl/sd1: UNets, modelled linear in latent pixels (conv and attention cost there is dominated
#   by per-pixel work at 1/1, 1/2, 1/4 resolution). The scale is nominal (one 320-wide layer per
#   latent pixel): only ratios are meaningful, and a linear model's saving is the pixel saving.
ARCHS: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in (
        ArchSpec("flux", 2, 2, 8, arch_flops("flux"), "img_ids"),
        ArchSpec("chroma", 2, 2, 8, arch_flops("chroma"), "img_ids"),
        ArchSpec("sd3", 2, 2, 8, arch_flops("sd3")),
        ArchSpec("lumina", 2, 2, 8, arch_flops("lumina"), "rope_embedder"),
        ArchSpec("anima", 2, 2, 8, arch_flops("anima"), "rope_angles"),
        ArchSpec("hunyuan_image", 1, 1, 32, FlopModel(3584, 20 + 40, text_tokens=256), "meshgrid"),
        ArchSpec("sdxl", 4, 1, 8, FlopModel(320, 1, attention=False)),
        ArchSpec("sd1", 1, 1, 8, FlopModel(320, 1, attention=False)),
        # musubi-tuner's (hosts/musubi/start.py runs each at F × a frame's tokens): wan: Wan 2.1/2.2 14B per block
        # (flops.wan_flops: dim 5120, 40 blocks, FFN 13824, cross-attention to 512 T5 tokens), patch 1×2×2; the
        # others coarse a·N + b·N²: hunyuan_video: 13B, hidden 3072, 20 double + 40 single
        # blocks, 256 text tokens in the sequence; hunyuan_video_1_5: hidden 2048, 54 double blocks, patch 1 on
        # its 16× VAE; qwen_image: 60 dual-stream blocks of 3072, Qwen2.5-VL text in the joint attention;
        # flux_2: FLUX.2 dev, hidden 6144, 8 double + 48 single blocks, mlp 3, latents already packed to 1/16;
        # z_image: dim 3840, 30 layers, SwiGLU 10240 (mlp_ratio 4 in MACs), caption tokens in the sequence.
        ArchSpec("wan", 2, 2, 8, arch_flops("wan")),
        ArchSpec("hunyuan_video", 2, 2, 8, FlopModel(3072, 20 + 40, text_tokens=256)),
        ArchSpec("hunyuan_video_1_5", 1, 1, 16, FlopModel(2048, 54, text_tokens=256)),
        ArchSpec("qwen_image", 2, 2, 8, FlopModel(3072, 60, text_tokens=256)),
        ArchSpec("flux_2", 1, 1, 16, FlopModel(6144, 8 + 48, mlp_ratio=3.0, text_tokens=512)),
        ArchSpec("z_image", 2, 2, 8, FlopModel(3840, 30, text_tokens=256)),
    )
}
ARCH_NAMES = tuple(ARCHS)


def get_arch(name: str) -> ArchSpec:
    try:
        return ARCHS[name]
    except KeyError:
        raise ValueError(f"arch: {name!r} is not a known architecture (allowed: {', '.join(ARCHS)})") from None
