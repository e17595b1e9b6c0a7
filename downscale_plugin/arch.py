"""The architecture registry: one record per denoiser architecture, the only per-arch table in core.

A host maps its trainers to these names (``hosts/<host>/facts.py``); core and features read the
record: the grid rule (latent multiple, patch, VAE factor), the FLOP model (``plan``, accounting)
and the kind of position handle ``positions = "interpolate"`` scales (``fasterdit/positions.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .flops import FlopModel

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
    flops: FlopModel | None = None
    positions: str | None = None


# FLOP shapes from the public model configs, as the hosts build them.
# - flux/chroma: FLUX.1 hidden 3072, 19 double + 38 single blocks. A double block runs each token
#   through its own stream's weights once, so per token it costs one block: depth 57. T5 context
#   512 tokens (sd-scripts' t5xxl_max_token_length for dev and Chroma).
# - sd3: SD3/3.5-Medium MMDiT depth 24, hidden 64·24 = 1536. Context = 77 CLIP-L/G + 256 T5 tokens.
#   MMDiT-X's extra image self-attention in the first 13 Medium blocks is left out.
# - lumina: Lumina-Image-2.0 NextDiT 2B, hidden 2304, 26 layers, SwiGLU 6144 (= mlp_ratio 4 in
#   MACs); Gemma-2 caption 256 tokens in the same sequence. GQA (8 of 24 kv heads) and the 2+2
#   refiner layers are left out (they roughly cancel).
# - anima: Cosmos-Predict2 2B MiniTrainDIT, model_channels 2048, 28 blocks, mlp_ratio 4, text by
#   cross-attention (no text in the self-attention sequence); mlp_ratio 5 absorbs the
#   cross-attention's q and o projections.
# - hunyuan_image: HunyuanImage-2.1, hidden 3584, 20 double + 40 single blocks, mlp_ratio 4; text is
#   trimmed to the batch's valid Qwen2.5-VL + ByT5 tokens, 256 is a typical caption.
# - sdxl/sd1: UNets, modelled linear in latent pixels (conv and attention cost there is dominated
#   by per-pixel work at 1/1, 1/2, 1/4 resolution). The scale is nominal (one 320-wide layer per
#   latent pixel): only ratios are meaningful, and a linear model's saving is the pixel saving.
ARCHS: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in (
        ArchSpec("flux", 2, 2, 8, FlopModel(3072, 19 + 38, text_tokens=512), "img_ids"),
        ArchSpec("chroma", 2, 2, 8, FlopModel(3072, 19 + 38, text_tokens=512), "img_ids"),
        ArchSpec("sd3", 2, 2, 8, FlopModel(1536, 24, text_tokens=77 + 256)),
        ArchSpec("lumina", 2, 2, 8, FlopModel(2304, 26, text_tokens=256), "rope_embedder"),
        ArchSpec("anima", 2, 2, 8, FlopModel(2048, 28, mlp_ratio=5.0), "rope_angles"),
        ArchSpec("hunyuan_image", 1, 1, 32, FlopModel(3584, 20 + 40, text_tokens=256), "meshgrid"),
        ArchSpec("sdxl", 4, 1, 8, FlopModel(320, 1, attention=False)),
        ArchSpec("sd1", 1, 1, 8, FlopModel(320, 1, attention=False)),
    )
}
ARCH_NAMES = tuple(ARCHS)


def get_arch(name: str) -> ArchSpec:
    try:
        return ARCHS[name]
    except KeyError:
        raise ValueError(f"arch: {name!r} is not a known architecture (allowed: {', '.join(ARCHS)})") from None
