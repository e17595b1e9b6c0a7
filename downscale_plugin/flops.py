"""The FLOP model behind every predicted saving (``plan``, the start banner, ``ss_downscale_counts``).

Savings are ratios of per-sample costs, so only the relative cost of a smaller grid matters; the
per-architecture shapes live with their :class:`~downscale_plugin.arch.ArchSpec` record.

Two models. :class:`FlopModel` is the coarse a·N + b·N² of a plain stack of DiT blocks (the lab
DiT, HunyuanImage, the UNets). :class:`StepFlops` counts one LoRA training step of a real
architecture matmul by matmul: each stage's linears per image token, per text token and per
sample, its attention pairs at the real widths (joint, image-only, text-only, cross), and what the
step runs backward — frozen base weights only their input gradient, LoRA factors their weight and
input gradients, attention both its score and value products, gradient checkpointing the blocks'
forward once more. The per-architecture builders (:func:`flux_flops`, …) read the published
config; ``tests/test_flops.py`` checks them against a direct count of the blocks' matmuls
(``torch.utils.flop_counter``), and ``benchmarks/bench_production.py`` against measured step times.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class FlopModel:
    """Forward cost of one sample: a·N + b·N² in N = image + text tokens.

    a = 2·depth·hidden²·(4 + 2·mlp_ratio): q, k, v, o projections and the MLP, 2 flops per MAC;
    b = 4·depth·hidden: QKᵀ and AV. Norms, modulation and embedders are per-sample or O(N·hidden)
    and left out, and so is the backward pass, which weighs attention more than the frozen linears
    (:class:`StepFlops` counts it). ``attention=False`` keeps only the linear term: the UNet presets,
    which count latent pixels.
    """

    hidden: int
    depth: int
    mlp_ratio: float = 4.0
    text_tokens: int = 0
    attention: bool = True

    @property
    def a(self) -> float:
        return 2.0 * self.depth * self.hidden**2 * (4.0 + 2.0 * self.mlp_ratio)

    @property
    def b(self) -> float:
        return 4.0 * self.depth * self.hidden if self.attention else 0.0

    def flops(self, n_image_tokens: float) -> float:
        n = n_image_tokens + self.text_tokens
        return self.a * n + self.b * n * n

    def describe(self) -> str:
        """One line for ``plan`` and the banner: what the model assumes."""
        text = f"hidden {self.hidden}, depth {self.depth}, mlp {self.mlp_ratio:g}, text tokens {self.text_tokens}"
        return text + ("" if self.attention else ", linear only")


def predicted_saving(hist: Mapping[int, float], native: Mapping[int, float], flop_model: FlopModel | None = None) -> float:
    """1 − Σ hist·F(N_run) / Σ native·F(N_native) over token histograms (tokens → samples or weight).

    Without a model F(N) = N: the token saving.
    """
    cost = flop_model.flops if flop_model is not None else float
    spent = sum(w * cost(n) for n, w in hist.items())
    full = sum(w * cost(n) for n, w in native.items())
    return 1.0 - spent / full if full > 0 else 0.0


ROWS = ("image", "text", "joint", "aux", "sample")  # what one row of a matmul is; "joint": image and text tokens of a shared
# stream (Flux's single blocks, Lumina's joint layers); "aux": a second text stream (Anima's Qwen3 tokens)
PAIRS = ("joint", "image", "text", "aux")  # attention operands; "joint": image and text tokens in one sequence


@dataclass(frozen=True)
class Matmul:
    """One frozen linear: ``fan_in`` → ``fan_out`` per row of kind ``rows``.

    ``grad``: its input needs a gradient, so backward runs Wᵀ·dY (False for the embedders of the
    latents and cached text, and for per-sample modulation fed by the frozen timestep embedder).
    ``lora``: the inner network module adapts it (rank-r factors, trained).
    """

    rows: str
    fan_in: int
    fan_out: int
    lora: bool = True
    grad: bool = True

    def __post_init__(self) -> None:
        if self.rows not in ROWS:
            raise ValueError(f"Matmul rows: {self.rows!r} is not one of {', '.join(ROWS)}")

    def macs(self, rank: int) -> tuple[float, float]:
        """(forward, backward) MACs per row at LoRA rank ``rank``.

        Base: forward in·out, backward in·out if ``grad``. LoRA (down in→r, up r→out): forward
        r·(in+out); backward both weight gradients r·(in+out), up's input gradient r·out and down's
        input gradient r·in if ``grad``.
        """
        base = self.fan_in * self.fan_out
        fwd, bwd = float(base), float(base if self.grad else 0)
        if self.lora and rank:
            fwd += rank * (self.fan_in + self.fan_out)
            bwd += rank * (2 * self.fan_out + self.fan_in + (self.fan_in if self.grad else 0))
        return fwd, bwd


@dataclass(frozen=True)
class Attention:
    """Scaled dot-product attention of ``queries`` over ``keys`` (kinds in :data:`PAIRS`), ``width`` =
    query heads × head dim: QKᵀ and AV cost width MACs per pair each. Backward, when ``grad``: dP
    and dQ, plus dK and dV when the keys and values need a gradient too (``keys_grad``; not for
    cross-attention to a frozen text projection)."""

    queries: str
    keys: str
    width: int
    grad: bool = True
    keys_grad: bool = True

    def __post_init__(self) -> None:
        if self.queries not in PAIRS or self.keys not in PAIRS:
            raise ValueError(f"Attention operands: {self.queries!r}, {self.keys!r} must be in {', '.join(PAIRS)}")

    def macs(self) -> tuple[float, float]:
        products = (2.0 + (2.0 if self.keys_grad else 0.0)) if self.grad else 0.0
        return 2.0 * self.width, products * self.width


@dataclass(frozen=True)
class Stage:
    """``count`` identical blocks (or one group of embedders); ``blocks``: transformer blocks, which
    gradient checkpointing runs forward twice."""

    name: str
    count: int
    matmuls: tuple[Matmul, ...]
    attention: tuple[Attention, ...] = ()
    blocks: bool = True


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one sample's LoRA training step (forward + backward), counted stage by stage.

    ``text_tokens``: tokens in the text stream; ``aux_tokens``: a second text stream read only by
    cross-attention (Anima's Qwen3 states), default 0. ``lora_rank`` 0 leaves the adapter out;
    ``checkpointing``: ``--gradient_checkpointing`` (the blocks' forward runs again in backward).
    """

    name: str
    stages: tuple[Stage, ...]
    text_tokens: int
    aux_tokens: int = 0
    lora_rank: int = 16
    checkpointing: bool = False

    def _rows(self, kind: str, n_image: float) -> float:
        return {"image": n_image, "text": self.text_tokens, "aux": self.aux_tokens, "sample": 1.0, "joint": n_image + self.text_tokens}[
            kind
        ]

    def stage_flops(self, stage: Stage, n_image_tokens: float) -> float:
        """FLOPs (2 per MAC) of every block of ``stage`` for one sample."""
        again = 1.0 if self.checkpointing and stage.blocks else 0.0
        total = 0.0
        for m in stage.matmuls:
            fwd, bwd = m.macs(self.lora_rank)
            total += self._rows(m.rows, n_image_tokens) * (fwd * (1 + again) + bwd)
        for a in stage.attention:
            fwd, bwd = a.macs()
            total += self._rows(a.queries, n_image_tokens) * self._rows(a.keys, n_image_tokens) * (fwd * (1 + again) + bwd)
        return 2.0 * stage.count * total

    def flops(self, n_image_tokens: float) -> float:
        return sum(self.stage_flops(s, n_image_tokens) for s in self.stages)

    def block_share(self, n_image_tokens: float) -> float:
        """The transformer blocks' share of the step (the part that grows with depth)."""
        return sum(self.stage_flops(s, n_image_tokens) for s in self.stages if s.blocks) / self.flops(n_image_tokens)

    def describe(self) -> str:
        blocks = " + ".join(f"{s.count} {s.name}" for s in self.stages if s.blocks)
        aux = f" + {self.aux_tokens} adapter" if self.aux_tokens else ""
        run = f"LoRA rank {self.lora_rank}" + (", gradient checkpointing" if self.checkpointing else "")
        return f"{blocks} blocks; text tokens {self.text_tokens}{aux}; {run}"


def _embed(rows: str, fan_in: int, hidden: int) -> Matmul:
    """An input embedder: frozen, not adapted, fed by data without a gradient."""
    return Matmul(rows, fan_in, hidden, lora=False, grad=False)


def _timestep_mlp(fan_in: int, hidden: int) -> tuple[Matmul, Matmul]:
    """A per-sample embedding MLP (timestep, pooled text, guidance): frozen, no gradient reaches it."""
    return Matmul("sample", fan_in, hidden, lora=False, grad=False), Matmul("sample", hidden, hidden, lora=False, grad=False)


def flux_flops(
    *, hidden: int = 3072, double: int = 19, single: int = 38, mlp_ratio: float = 4.0, text_tokens: int = 512,
    in_channels: int = 64, context_dim: int = 4096, vec_dim: int = 768, guidance: bool = True, **run: int | bool,
) -> StepFlops:  # fmt: skip
    """FLUX.1 (``library/flux_models.py``): double blocks run each stream through its own weights,
    single blocks fuse qkv with the MLP's first layer; joint attention over image + text tokens at
    width heads × head dim = hidden.
    ``networks.lora_flux`` adapts every linear of both block kinds."""
    h, f = hidden, int(hidden * mlp_ratio)
    stream = lambda rows: (Matmul(rows, h, 3 * h), Matmul(rows, h, h), Matmul(rows, h, f), Matmul(rows, f, h))  # noqa: E731
    mod = lambda n: Matmul("sample", h, n * h, grad=False)  # noqa: E731
    embed = (_embed("image", in_channels, h), _embed("text", context_dim, h), *_timestep_mlp(256, h), *_timestep_mlp(vec_dim, h))
    if guidance:
        embed += _timestep_mlp(256, h)
    return StepFlops(
        "flux",
        (
            Stage("embedders", 1, embed, blocks=False),
            Stage("double", double, (mod(6), *stream("image"), mod(6), *stream("text")), (Attention("joint", "joint", h),)),
            Stage("single", single, (Matmul("joint", h, 3 * h + f), Matmul("joint", h + f, h), mod(3)), (Attention("joint", "joint", h),)),
            Stage(
                "final", 1, (Matmul("image", h, in_channels, lora=False), Matmul("sample", h, 2 * h, lora=False, grad=False)), blocks=False
            ),
        ),
        text_tokens,
        **run,
    )


def sd3_flops(
    *, depth: int = 24, blocks: int | None = None, x_attn: int = 13, clip_tokens: int = 77, t5_tokens: int = 256,
    in_channels: int = 64, context_dim: int = 4096, pooled_dim: int = 2048, **run: int | bool,
) -> StepFlops:  # fmt: skip
    """SD3 / SD3.5 MMDiT (``library/sd3_models.py``): hidden = 64·depth, joint attention over the
    77 CLIP + T5 context tokens and the image; MMDiT-X (3.5 Medium) adds an image-only attention
    to its first ``x_attn`` blocks; the last block's context stream stops after its qkv.
    ``blocks`` (default ``depth``) keeps that many joint blocks at the width of ``depth``:
    ``x_attn`` of them with the extra attention, then plain ones, then the last.
    ``networks.lora_sd3`` adapts every linear of the blocks."""
    h = 64 * depth
    kept = depth if blocks is None else blocks
    stream = lambda rows: (Matmul(rows, h, 3 * h), Matmul(rows, h, h), Matmul(rows, h, 4 * h), Matmul(rows, 4 * h, h))  # noqa: E731
    mod = lambda n: Matmul("sample", h, n * h, grad=False)  # noqa: E731
    joint = (Attention("joint", "joint", h),)
    plain = (mod(6), *stream("text"), mod(6), *stream("image"))
    with_x = (mod(6), *stream("text"), mod(9), *stream("image"), Matmul("image", h, 3 * h), Matmul("image", h, h))
    last = (mod(2), Matmul("text", h, 3 * h), mod(6), *stream("image"))
    embed = (_embed("image", in_channels, h), _embed("text", context_dim, h), *_timestep_mlp(256, h), *_timestep_mlp(pooled_dim, h))
    return StepFlops(
        "sd3",
        (
            Stage("embedders", 1, embed, blocks=False),
            Stage("joint+x", x_attn, with_x, (*joint, Attention("image", "image", h))),
            Stage("joint", kept - 1 - x_attn, plain, joint),
            Stage("last", 1, last, joint),
            Stage(
                "final", 1, (Matmul("image", h, in_channels, lora=False), Matmul("sample", h, 2 * h, lora=False, grad=False)), blocks=False
            ),
        ),
        clip_tokens + t5_tokens,
        **run,
    )


def lumina_flops(
    *, dim: int = 2304, heads: int = 24, kv_heads: int = 8, layers: int = 26, refiners: int = 2, ffn: int | None = None,
    text_tokens: int = 256, in_channels: int = 64, cap_dim: int = 2304, **run: int | bool,
) -> StepFlops:  # fmt: skip
    """Lumina-Image 2.0's NextDiT (``library/lumina_models.py``): the caption runs through its own
    refiner blocks (text-only attention, no modulation), the image through the noise refiner
    (image-only attention), then both through the joint layers. Grouped-query attention: the qkv
    projection has ``heads + 2·kv_heads`` heads, scores run at all query heads; SwiGLU FFN of
    ``ffn`` (default sd-scripts' rule: 8·dim/3 rounded up to 256). ``networks.lora_lumina`` adapts
    every linear of the blocks and the final layer."""
    h, d = dim, dim // heads
    f = ffn if ffn is not None else 256 * -(-int(8 * dim / 3) // 256)
    t = min(dim, 1024)  # the timestep embedding width feeding every modulation

    def block(rows: str) -> tuple[Matmul, ...]:  # GQA qkv, output, SwiGLU w1, w2, w3
        return (Matmul(rows, h, (heads + 2 * kv_heads) * d), Matmul(rows, h, h), Matmul(rows, h, f), Matmul(rows, f, h), Matmul(rows, h, f))

    mod = Matmul("sample", t, 4 * h, grad=False)
    embed = (_embed("image", in_channels, h), _embed("text", cap_dim, h), *_timestep_mlp(256, t))
    final = (Matmul("image", h, in_channels), Matmul("sample", t, h, grad=False))
    return StepFlops(
        "lumina",
        (
            Stage("embedders", 1, embed, blocks=False),
            Stage("context refiner", refiners, block("text"), (Attention("text", "text", h),)),
            Stage("noise refiner", refiners, (*block("image"), mod), (Attention("image", "image", h),)),
            Stage("joint", layers, (*block("joint"), mod), (Attention("joint", "joint", h),)),
            Stage("final", 1, final, blocks=False),
        ),
        text_tokens,
        **run,
    )


def anima_flops(
    *, channels: int = 2048, blocks: int = 28, mlp_ratio: float = 4.0, adaln_lora: int = 256, context_dim: int = 1024,
    t5_tokens: int = 512, qwen_tokens: int = 512, adapter_dim: int = 1024, adapter_layers: int = 6, in_channels: int = 68,
    out_channels: int = 64, lora_rank: int = 16, checkpointing: bool = False,
) -> StepFlops:  # fmt: skip
    """Anima (``library/anima_models.py``, Cosmos-Predict2's MiniTrainDIT): image-only self-attention,
    cross-attention from the image to the LLM adapter's T5-token outputs, a GELU MLP, three
    adaLN-LoRA modulations per block; text never enters the self-attention. The LLM adapter (T5-token
    self-attention, cross-attention to the Qwen3 states) runs once per sample, frozen unless
    ``train_llm_adapter``. ``networks.lora_anima`` adapts the blocks' attention and MLP linears,
    not the modulations, embedders or final layer."""
    h, f, a = channels, int(channels * mlp_ratio), adapter_dim
    mod = (Matmul("sample", h, adaln_lora, lora=False, grad=False), Matmul("sample", adaln_lora, 3 * h, lora=False, grad=False))
    rest = (
        Matmul("image", h, h),  # self-attention output
        Matmul("image", h, h), Matmul("text", context_dim, h, grad=False), Matmul("text", context_dim, h, grad=False), Matmul("image", h, h),
        Matmul("image", h, f), Matmul("image", f, h),
        *mod, *mod, *mod,
    )  # fmt: skip
    qkv = lambda grad: tuple(Matmul("image", h, h, grad=grad) for _ in range(3))  # noqa: E731
    attention = (Attention("image", "image", h), Attention("image", "text", h, keys_grad=lora_rank > 0))
    frozen = lambda rows, i, o: Matmul(rows, i, o, lora=False, grad=False)  # noqa: E731
    adapter = (
        *(frozen("text", a, a) for _ in range(4)), frozen("text", a, a), frozen("aux", context_dim, a), frozen("aux", context_dim, a),
        frozen("text", a, a), frozen("text", a, 4 * a), frozen("text", 4 * a, a),
    )  # fmt: skip
    no_grad = (Attention("text", "text", a, grad=False), Attention("text", "aux", a, grad=False))
    embed = (_embed("image", in_channels, h), *_timestep_mlp(h, h)[:1], Matmul("sample", h, 3 * h, lora=False, grad=False))
    final = (Matmul("image", h, out_channels, lora=False), *mod[:1], Matmul("sample", adaln_lora, 2 * h, lora=False, grad=False))
    return StepFlops(
        "anima",
        (
            Stage("embedders", 1, embed, blocks=False),
            Stage("LLM adapter", adapter_layers, adapter, no_grad, blocks=False),
            Stage("adapter out", 1 if adapter_layers else 0, (frozen("text", a, context_dim),), blocks=False),
            # Nothing below the first block trains (embedders and modulations are not adapted), so its
            # q, k, v get no input gradient; the cross-attention's keys and values carry one only
            # through their LoRA factors.
            Stage("first", 1, (*qkv(False), *rest), attention),
            Stage("other", blocks - 1, (*qkv(True), *rest), attention),
            Stage("final", 1, final, blocks=False),
        ),
        t5_tokens,
        qwen_tokens,
        lora_rank,
        checkpointing,
    )


def wan_flops(
    *, dim: int = 5120, ffn: int = 13824, layers: int = 40, text_tokens: int = 512, text_dim: int = 4096, in_channels: int = 16,
    patch: int = 4, freq_dim: int = 256, time_per_token: bool = True, lora_rank: int = 16, checkpointing: bool = False,
) -> StepFlops:  # fmt: skip
    """Wan 2.1/2.2 text-to-video (musubi-tuner ``wan/modules/model.py`` ``WanModel``; 14B: dim 5120, 40 layers,
    40 heads, FFN 13824): per block self-attention over all F·H·W/4 video tokens (q, k, v, o), cross-attention
    from the video tokens to the T5 context padded to ``text_len`` = 512 (q, o on the video, k, v on the text
    embedding), a GELU FFN; modulation adds a learned table to the time embedding (no matmul). The time
    embedding and its 6·dim projection run per token in Wan 2.2 (``time_per_token``, default), per sample in
    2.1 and with ``--force_v2_1_time_embedding``. ``patch``: latent cells per token (1×2×2). ``networks.lora_wan``
    adapts every linear of the blocks, not the embeddings, norms or head; nothing below the first block
    trains, so its q, k, v get no input gradient, and the cross-attention's k, v (on the frozen text
    embedding) carry one only through their LoRA factors."""
    h, p = dim, in_channels * patch
    frozen = lambda rows, i, o: Matmul(rows, i, o, lora=False, grad=False)  # noqa: E731
    per = "image" if time_per_token else "sample"
    embed = (
        _embed("image", p, h), frozen("text", text_dim, h), frozen("text", h, h),
        frozen(per, freq_dim, h), frozen(per, h, h), frozen(per, h, 6 * h),
    )  # fmt: skip
    rest = (
        Matmul("image", h, h),  # self-attention output
        Matmul("image", h, h), Matmul("text", h, h, grad=False), Matmul("text", h, h, grad=False), Matmul("image", h, h),
        Matmul("image", h, ffn), Matmul("image", ffn, h),
    )  # fmt: skip
    qkv = lambda grad: tuple(Matmul("image", h, h, grad=grad) for _ in range(3))  # noqa: E731
    attention = (Attention("image", "image", h), Attention("image", "text", h, keys_grad=lora_rank > 0))
    return StepFlops(
        "wan",
        (
            Stage("embedders", 1, embed, blocks=False),
            Stage("first", 1, (*qkv(False), *rest), attention),
            Stage("other", layers - 1, (*qkv(True), *rest), attention),
            Stage("final", 1, (Matmul("image", h, p, lora=False),), blocks=False),
        ),
        text_tokens,
        lora_rank=lora_rank,
        checkpointing=checkpointing,
    )


# Published configs, and the benchmark's reduced depth (benchmarks/bench_production.py: two blocks of each kind).
BUILDERS = {"flux": flux_flops, "chroma": flux_flops, "sd3": sd3_flops, "lumina": lumina_flops, "anima": anima_flops, "wan": wan_flops}
REDUCED = {
    "flux": {"double": 2, "single": 2},
    "chroma": {"double": 2, "single": 2},
    "sd3": {"blocks": 5, "x_attn": 2},
    "lumina": {"layers": 2},
    "anima": {"blocks": 2},
    "wan": {"layers": 2},
}


def arch_flops(arch: str, *, reduced: bool = False, **shape: int | bool) -> StepFlops:
    """The :class:`StepFlops` of ``arch`` at its published config; ``reduced``: the benchmark's depth;
    ``shape``: builder keywords (text token counts, ``lora_rank``, ``checkpointing``)."""
    return BUILDERS[arch](**(REDUCED[arch] if reduced else {}), **shape)
