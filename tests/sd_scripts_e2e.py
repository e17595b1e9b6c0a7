"""Run a real sd-scripts LoRA training script end to end with ``--network_module downscale_plugin``, offline.

    python tests/sd_scripts_e2e.py {flux,sd3,anima,sdxl} WORK_DIR [train|map-stop|map-train|auto|record ARGS...]
    python tests/sd_scripts_e2e.py flux WORK_DIR ranks [ARGS...]
    (cwd: the sd-scripts checkout; the plugin installed, ``pip install -e``)

The script runs exactly as ``python flux_train_network.py --config_file train.toml`` does (``runpy``,
so the trainer class lives in ``__main__``: the duplicate-class trap the plugin must survive), over a
generated image folder, with a training TOML carrying ``[plugins.downscale]``.

Only the checkpoint *loaders* are replaced, because sd-scripts builds each model from a hard-coded
full-size config and then loads weights into it (FLUX.1 hidden 3072, T5-XXL 4.7 B, CLIP-L/G, the
SD3 VAE and Anima's 2 B DiT, Qwen-Image VAE, SDXL's 2.6 B UNet); random full-size models would need ~20 GB and
hours on a CPU. The replacements build tiny models from the same classes (sd-scripts' ``flux_models``,
``sd3_models``, ``anima_models``, ``qwen_image_autoencoder_kl``, ``sdxl_original_unet`` with its width constants
set small; transformers' CLIP/T5/Qwen3, diffusers' ``AutoencoderKL``), and
where the host derives the config from the checkpoint (SD3's MMDiT, Anima's Qwen3 directory) the
real loader reads a tiny checkpoint written here. Tokenizers are built locally (sd-scripts'
``--tokenizer_cache_dir`` is read before the hub) or ship with the checkout (Anima).

After training it checks the saved LoRA: the inner module loads it, and its metadata carries the
``ss_downscale_*`` keys. ``map-stop`` / ``map-train`` run the plugin with ``mode = "map"`` instead of
routes: the map's files must be written, ``stop`` must end the script with exit 0 and no weights,
``train`` must save a LoRA routed by the derived windows. The map reads its first ``E2E_MAP_IMAGES`` samples (2 by
default); a window needs at least 8 (the family-wise, heavy-tail calibrated safe read has no finite critical value
below that: ``mapping/safe_read.py``), so ``map-train`` wants ``E2E_MAP_IMAGES=8 E2E_IMAGES=8 E2E_REPEATS=1`` and
``E2E_STEPS`` well above 8: a repeat is no probe, and the host's data order can repeat an image within an epoch (at
seed 42 the eighth distinct image of the Flux run comes at batch 12). ``auto`` runs ``mode = "auto"`` (set
``E2E_STEPS`` ≥ 16: the certifier's probes are the first 16 samples): ``windows.toml`` and
``certify.json`` must be written, with the model's identity, and the LoRA routed by the certified
windows must record them (``ss_downscale_map``). ``record`` passes the arguments after it
to the script (``--gradient_accumulation_steps 2 --resume DIR ...``) and writes ``WORK/record.json``:
every train step's route decision in order, the saved LoRA's ``ss_downscale_*`` metadata and the
accelerator's state hooks left at the end, and for SDXL the source, crop and target sizes each UNet forward's size
embedding encodes (``unet_sizes``); the caller checks them (``E2E_IMAGES``, ``E2E_REPEATS``, ``E2E_IMAGE_WH``,
``E2E_STEPS`` and ``E2E_ROUTES`` set the dataset, ``max_train_steps`` and the plugin table). Prints
``E2E OK`` on success.

``ranks`` runs the Flux training as several CPU processes (``E2E_PROCESSES``, 2 by default) on ``RANKS``' dataset
(128² and 256² images, one dataset each, batch size 1), σ law (``flux_shift`` narrowed by ``sigmoid_scale``: the two
buckets' route odds differ by much) and routes; arguments after it go to the script (``--gradient_accumulation_steps
2``). This process writes the models, tokenizers, images and TOMLs, then launches the script through accelerate's
own launcher, ``python -m accelerate.commands.launch --multi_gpu --num_processes N --num_cpu_threads_per_process 1
... sd_scripts_e2e.py --rank flux WORK ...`` with ``ACCELERATE_USE_CPU=1`` and no visible GPU, so each rank's
Accelerator runs MULTI_CPU on gloo (``--num_processes N`` without ``--multi_gpu`` takes accelerate's simple
launcher: one process). Each rank installs the same loader replacements and recorders (every step's route
decision with its native and run grid, every Flux forward's latent grid and time input, every ``save_weights``),
trains with its own ``--seed`` (``RANKS["seed"]`` + rank, as an unseeded run draws one per process) and writes
``WORK/rank{R}.json`` (also its own and the cross-rank counts, its final LoRA weights) and ``WORK/rank{R}.log``
(its output). One shim, in the ranks only: accelerate's MULTI_CPU ``prepare_model`` wraps the trainer's frozen
Flux in DDP, which refuses a model with no trainable parameter (``RuntimeError: DistributedDataParallel is not
needed ...`` at ``accelerator.prepare(unet)``, train_network.py ``prepare_unet_with_accelerator``); the ranks get
accelerate's multi-GPU behaviour for it, no DDP (``frozen_modules_unwrapped``; the LoRA network is still wrapped).
sd-scripts' ``--ddp_timeout`` reaches the process group only with more than one CUDA device
(``train_util.prepare_accelerator``), so a hung collective ends at ``E2E_LAUNCH_TIMEOUT`` here instead. This
process then checks the saved LoRA (cross-rank ``forwards``, its load with the inner module) and writes
``record.json`` with one entry per rank (and what each printed: the plugin's start banner and end summary) and the
``downscale/*`` scalars the main process logged.
"""

from __future__ import annotations

import csv
import importlib
import json
import os
import runpy
import string
import sys
from pathlib import Path

import numpy as np
import toml
import torch
from PIL import Image
from ranks_checks import RANKS_ROUTES, RANKS_SEED
from ranks_launch import frozen_modules_unwrapped, launch_ranks
from run_recorder import recorder
from safetensors import safe_open
from safetensors.torch import load_file, save_file

STEPS = int(os.environ.get("E2E_STEPS", 8))
IMAGES = int(os.environ.get("E2E_IMAGES", 2))
MAP_IMAGES = int(os.environ.get("E2E_MAP_IMAGES", 2))  # the map's probes (distinct images; batch size 1)
REPEATS = int(os.environ.get("E2E_REPEATS", 4))
IMAGE_WH = tuple(int(x) for x in os.environ.get("E2E_IMAGE_WH", "128x128").split("x"))  # the images' (W, H) in px
DEFAULT_ROUTES = """
[plugins.downscale]
gate = "coupled"

[[plugins.downscale.routes]]
route = "128:96"                  # the 128 px tier at 0.75: a 16x16 latent runs at 12x12
sigma_min = 0.6
sigma_max = 0.9

[[plugins.downscale.routes]]
route = "128:64"                  # ... and at 0.5 (8x8) for the rest of σ > 0.3
sigma_min = 0.3
"""
ROUTES = os.environ.get("E2E_ROUTES") or DEFAULT_ROUTES


MAP = """
[plugins.downscale]
mode = "map"
after_map = "{after}"
map_out = "{out}"
map_ratios = [0.5]                # 16x16 latents: the 8x8 route
map_bins = "0,0.5,1"              # two bins and σ = 1
map_draws = 4
map_images = {images}             # the run's first samples (MAP_IMAGES)
map_margin = 0.99                 # a loose margin, so that with 8 probes a window is found and after_map = "train" routes
map_reenc = true                  # the VAE arms, on the run's own AutoEncoder
map_pixel = true
"""

AUTO = """
[plugins.downscale]
mode = "auto"
map_out = "{out}"
map_ratios = [0.5]                # 16x16 latents: the 8x8 route
map_bins = "0,0.5,1"              # two bins and σ = 1
map_margin = 0.99                 # a loose margin, so that a window is certified and the run routes
certify_draws = 2                 # a safe verdict reads 16 distinct probes: 16 × 2 draws × (1 + 0.25) = 40 native-step
                                  # equivalents at the token fraction (E2E_TOKEN_COSTS; E2E_IMAGES = 16)
certify_budget = 0.5              # of the run's E2E_STEPS single-sample passes: ≥ 80 steps for a window to open
certify_unpaid = "buy"           # a run this short cannot pay a window back: certify all the same (the mechanics)
"""


def token_costs() -> None:
    """E2E_TOKEN_COSTS: an auto run's route passes at their token fraction, as the ``token_costs`` fixture of
    ``tests/conftest.py`` sets them (under the FLOP model the 16x16 latents are text-dominated: no window pays)."""
    from downscale_plugin.hosts.kohya.auto import AutoSession
    from downscale_plugin.mapping.certify import token_fraction

    AutoSession.pass_fraction = lambda self, small, native: token_fraction(small, native)


# The multi-process run (``ranks``: E2E_PROCESSES ranks, 2 by default): two datasets, 128² and 256² images, batch size
# 1, so the ranks are on different buckets on some steps (the ranks' data comes from one shuffled order, sharded by
# accelerate), under a σ law that depends on the bucket (flux_shift: μ from the packed latent's tokens) and is narrow
# (sigmoid_scale), so the two buckets' route odds differ by much: logit σ ~ N(μ, 0.0225²) with μ 0.4675 at 128² (a
# 16×16 latent, 64 tokens) and 0.5 at 256² (32×32, 256 tokens). The two windows' edges sit at the two median σ
# (0.6148, 0.6225): per bucket native / r0 / r1 ≈ 0.50 / 0.43 / 0.07 at 128² and 0.07 / 0.43 / 0.50 at 256², so
# ranks on one bucket must route together where independent draws would often split, and ranks on different buckets
# disagree on about 85 % of such steps (one shared uniform through each rank's own odds).
RANKS = {
    "sizes": {"small": (128, 4), "large": (256, 4)},  # folder: (side in px, images); one dataset, one bucket each
    "sampling": 'timestep_sampling = "flux_shift"\nsigmoid_scale = 0.0225\n',
    "routes": RANKS_ROUTES,
    "seed": RANKS_SEED,
}
PROCESSES = int(os.environ.get("E2E_PROCESSES", 2))  # ranks of the ``ranks`` mode
LAUNCH_TIMEOUT = int(os.environ.get("E2E_LAUNCH_TIMEOUT", 300))  # s; a hung collective ends the launch here


def write_images(root: Path) -> Path:
    images = root / "img" / "4_tiny"
    images.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(IMAGES):
        pixels = (rng.random((IMAGE_WH[1], IMAGE_WH[0], 3)) * 255).astype(np.uint8)
        Image.fromarray(pixels).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text(f"a tiny test image number {i}")
    return root / "img"


def write_rank_images(root: Path) -> Path:
    """``RANKS``' folders of square images (each with a caption), one per resolution."""
    rng = np.random.default_rng(0)
    for folder, (side, count) in RANKS["sizes"].items():
        images = root / "img" / folder
        images.mkdir(parents=True)
        for i in range(count):
            Image.fromarray((rng.random((side, side, 3)) * 255).astype(np.uint8)).save(images / f"{i}.png")
            (images / f"{i}.txt").write_text(f"a tiny {folder} test image number {i}")
    return root / "img"


def ranks_dataset(images: Path) -> str:
    """The dataset TOML of ``RANKS``: one dataset per folder at its own resolution (no bucketing: one bucket each)."""
    text = '[general]\ncaption_extension = ".txt"\nbatch_size = 1\n'
    for folder, (side, _) in RANKS["sizes"].items():
        text += f'\n[[datasets]]\nresolution = {side}\n[[datasets.subsets]]\nimage_dir = "{images / folder}"\nnum_repeats = 1\n'
    return text


def clip_tokenizer(path: Path, eos: str = "<|endoftext|>", write: bool = True) -> int:
    """A byte-level CLIP BPE tokenizer with no merges (one token per character); returns the vocab size
    (``write=False``: only that, for a rank reading what the launching process wrote)."""
    from transformers import CLIPTokenizer
    from transformers.models.clip.tokenization_clip import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars + [c + "</w>" for c in chars] + ["<|startoftext|>", eos])}
    if not write:
        return len(vocab)
    path.mkdir(parents=True)
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    CLIPTokenizer(str(path / "vocab.json"), str(path / "merges.txt"), model_max_length=77).save_pretrained(str(path))  # as CLIP-L/G
    return len(vocab)


def t5_tokenizer(path: Path, write: bool = True) -> int:
    """A character-level Unigram tokenizer with T5's specials ("</s>" appended); returns the vocab size
    (``write=False``: only that)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)] + [(c, -2.0) for c in string.printable.strip()]
    if not write:
        return len(pieces)
    tok = Tokenizer(models.Unigram(pieces, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
    T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>", extra_ids=0).save_pretrained(str(path))
    return len(pieces)


def tiny_clip(vocab: int, width: int, projection: bool = False, layers: int = 1, projection_dim: int | None = None):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers, num_attention_heads=2,
        max_position_embeddings=77, projection_dim=projection_dim or width, eos_token_id=vocab - 1,
    )  # fmt: skip
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def tiny_t5(vocab: int, width: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab, d_model=width, d_kv=width // 2, d_ff=2 * width, num_layers=1, num_heads=2, feed_forward_proj="gated-gelu"
    )
    return T5EncoderModel(config).eval()


def training_toml(
    work: Path, model: str, images: Path, extra: str, *, dataset: str | None = None, routes: str | None = None, write: bool = True
) -> Path:
    """``WORK/train.toml`` (and its ``dataset.toml``: ``dataset``, else one 128 px folder); ``write=False``: the path only."""
    path = work / "train.toml"
    if not write:
        return path
    (work / "dataset.toml").write_text(
        dataset
        or f'[general]\ncaption_extension = ".txt"\nresolution = 128\nbatch_size = 1\n\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = "{images / "4_tiny"}"\nnum_repeats = {REPEATS}\n'
    )
    path.write_text(
        f"""[model]
pretrained_model_name_or_path = "{model}"
{extra}
[training]
dataset_config = "{work / "dataset.toml"}"
output_dir = "{work / "out"}"
output_name = "lora"
save_model_as = "safetensors"
network_module = "downscale_plugin"
network_dim = 4
network_alpha = 4
network_train_unet_only = true
max_train_steps = {STEPS}
learning_rate = 1e-3
optimizer_type = "AdamW"
mixed_precision = "no"
cache_latents = true
cache_text_encoder_outputs = true
seed = 42
logging_dir = "{work / "logs"}"
log_with = "tensorboard"
max_data_loader_n_workers = 0
{ROUTES if routes is None else routes}"""
    )
    return path


def setup_flux(work: Path, images: Path, *, ranks: bool = False, write: bool = True) -> tuple:
    """``ranks``: the multi-process run's two-resolution dataset, σ law and routes (``RANKS``); ``write=False``: a
    rank of that run, which installs the loaders and reads the files the launching process wrote."""
    from library import flux_models, flux_utils

    cache = work / "tokenizers"
    clip_vocab = clip_tokenizer(cache / "openai_clip-vit-large-patch14", write=write)
    t5_vocab = t5_tokenizer(cache / "google_t5-v1_1-xxl", write=write)
    params = flux_models.FluxParams(
        in_channels=16, vec_in_dim=8, context_in_dim=8, hidden_size=64, mlp_ratio=2.0, num_heads=2, depth=1,
        depth_single_blocks=1, axes_dim=[8, 12, 12], theta=10_000, qkv_bias=True, guidance_embed=True,
    )  # fmt: skip
    checkpoint = work / "flux_tiny.safetensors"
    if write:
        save_file(flux_models.Flux(params).state_dict(), str(checkpoint))  # analyze_checkpoint_state reads its keys

    def load_flow_model(ckpt_path, dtype, device, disable_mmap=False, model_type="flux"):
        model = flux_models.Flux(params)
        model.load_state_dict(load_file(ckpt_path))
        return False, model.to(dtype) if dtype is not None else model

    ae_params = flux_models.AutoEncoderParams(
        resolution=128,
        in_channels=3,
        ch=32,
        out_ch=3,
        ch_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        z_channels=4,
        scale_factor=1.0,
        shift_factor=0.0,
    )
    flux_utils.load_flow_model = load_flow_model
    flux_utils.load_clip_l = lambda *a, **k: tiny_clip(clip_vocab, 8)
    flux_utils.load_t5xxl = lambda *a, **k: tiny_t5(t5_vocab, 8)
    flux_utils.load_ae = lambda *a, **k: flux_models.AutoEncoder(ae_params).eval()
    encoders = {name: work / f"{name}.bin" for name in ("clip_l", "t5xxl", "ae")}  # the loaders above are stubbed; the
    for name, path in encoders.items():  # windows cache keys the files (their sha256), so they are real, fixed bytes
        if write:
            path.write_bytes(name.encode() * 64)
    extra = f"""clip_l = "{encoders["clip_l"]}"
t5xxl = "{encoders["t5xxl"]}"
ae = "{encoders["ae"]}"
tokenizer_cache_dir = "{cache}"
t5xxl_max_token_length = 8
guidance_scale = 1.0
model_prediction_type = "raw"
""" + (RANKS["sampling"] if ranks else 'timestep_sampling = "sigmoid"\n')

    def models():
        return flux_utils.load_ae(), [flux_utils.load_clip_l(), flux_utils.load_t5xxl()], load_flow_model(str(checkpoint), None, "cpu")[1]

    dataset, routes = (ranks_dataset(images), RANKS["routes"]) if ranks else (None, None)
    config = training_toml(work, str(checkpoint), images, extra, dataset=dataset, routes=routes, write=write)
    return "flux_train_network.py", config, "networks.lora_flux", models


def setup_sd3(work: Path, images: Path) -> tuple:
    from library import sd3_models, sd3_utils

    cache = work / "tokenizers"
    vocab = clip_tokenizer(cache / "openai_clip-vit-large-patch14")
    clip_tokenizer(cache / "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k")
    t5_vocab = t5_tokenizer(cache / "google_t5-v1_1-xxl")
    # The real loader derives the MMDiT config from this checkpoint (depth 1: hidden 64, one head).
    mmdit = sd3_models.MMDiT(
        input_size=None, pos_embed_max_size=16, patch_size=2, in_channels=16, adm_in_channels=16, depth=1, num_patches=256,
        context_embedder_in_features=4096, context_embedder_out_features=64, model_type="sd3m",
    )  # fmt: skip
    mmdit.initialize_weights()
    for module in mmdit.modules():  # a trained MMDiT's adaLN and output layers are not the init's zeros (they leave a LoRA no gradient)
        if isinstance(module, torch.nn.Linear) and not module.weight.any():
            torch.nn.init.normal_(module.weight, std=0.02)
    checkpoint = work / "sd3_tiny.safetensors"
    save_file({f"model.diffusion_model.{k}": v.contiguous() for k, v in mmdit.state_dict().items()}, str(checkpoint))
    torch.manual_seed(1)
    vae = sd3_models.SDVAE().eval()  # the real 16-channel SD3 VAE class (fixed size, 84 M), random weights
    sd3_utils.load_clip_l = lambda *a, **k: tiny_clip(vocab, 8, projection=True)
    sd3_utils.load_clip_g = lambda *a, **k: tiny_clip(vocab, 8, projection=True)
    sd3_utils.load_t5xxl = lambda *a, **k: tiny_t5(t5_vocab, 4096)  # SD3 concatenates T5 and padded CLIP outputs at width 4096
    sd3_utils.load_vae = lambda *a, **k: vae
    extra = f"""clip_l = "unused"
clip_g = "unused"
t5xxl = "unused"
tokenizer_cache_dir = "{cache}"
t5xxl_max_token_length = 8
weighting_scheme = "logit_normal"
"""

    def models():
        net = sd3_utils.load_mmdit(load_file(str(checkpoint)), None, "cpu")
        return vae, [sd3_utils.load_clip_l(), sd3_utils.load_clip_g(), sd3_utils.load_t5xxl()], net

    return "sd3_train_network.py", training_toml(work, str(checkpoint), images, extra), "networks.lora_sd3", models


def setup_anima(work: Path, images: Path) -> tuple:
    import shutil

    from library import anima_models, anima_utils, qwen_image_autoencoder_kl
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # A Qwen3 directory the real loader reads (tokenizer files from the checkout's configs/qwen3_06b).
    qwen3 = work / "qwen3_tiny"
    tokenizer_dir = Path(anima_utils.__file__).parent.parent / "configs" / "qwen3_06b"
    config = Qwen3Config(
        vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, max_position_embeddings=512,
    )  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(str(qwen3))
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, qwen3 / name)

    def load_vae(*args, **kwargs):
        return qwen_image_autoencoder_kl.AutoencoderKLQwenImage(
            base_dim=32, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, latents_mean=[0.0] * 4, latents_std=[1.0] * 4
        )

    def load_anima_model(*args, **kwargs):
        torch.manual_seed(2)
        model = anima_models.Anima(
            max_img_h=64, max_img_w=64, max_frames=1, in_channels=4, out_channels=4, patch_spatial=2, patch_temporal=1,
            model_channels=64, num_blocks=1, num_heads=2, crossattn_emb_channels=32, pos_emb_cls="rope3d", pos_emb_learnable=True,
            use_adaln_lora=True, adaln_lora_dim=16, rope_h_extrapolation_ratio=4.0, rope_w_extrapolation_ratio=4.0,
            rope_enable_fps_modulation=False, use_llm_adapter=False,
        )  # fmt: skip
        model.llm_adapter = anima_models.LLMAdapter(32, 32, 32, num_layers=1, num_heads=2, self_attn=True)  # Qwen3 width 32 -> 32
        return model

    qwen_image_autoencoder_kl.load_vae = load_vae
    anima_utils.load_anima_model = load_anima_model
    extra = f"""qwen3 = "{qwen3}"
vae = "unused"
qwen3_max_token_length = 16
t5_max_token_length = 16
timestep_sampling = "sigmoid"
discrete_flow_shift = 1.0
"""

    def models():
        return load_vae(), [anima_utils.load_qwen3_text_encoder(str(qwen3), dtype=torch.float32)[0]], load_anima_model()

    return "anima_train_network.py", training_toml(work, "unused", images, extra), "networks.lora_anima", models


def setup_sdxl(work: Path, images: Path) -> tuple:
    """SDXL's UNet takes its widths from module constants (320 channels, a 1 280 time embedding, 2 816 size-and-pool
    inputs), set small here before it is built; its cross-attention width is a literal 2 048, so the two text encoders'
    hidden states (CLIP-L's 12th layer, CLIP-G's penultimate) are 8 + 2 040 wide, and CLIP-G's pooled projection 1 280
    wide (+ 6 × 256 size embeddings = 2 816). The VAE is diffusers' ``AutoencoderKL`` at 8× downsampling."""
    from diffusers import AutoencoderKL
    from library import sdxl_original_unet, sdxl_train_util

    cache = work / "tokenizers"
    vocab = clip_tokenizer(cache / "openai_clip-vit-large-patch14")
    clip_tokenizer(cache / "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k")
    sdxl_original_unet.MODEL_CHANNELS, sdxl_original_unet.TIME_EMBED_DIM = 32, 128

    def unet():
        torch.manual_seed(3)
        return sdxl_original_unet.SdxlUNet2DConditionModel()

    def text_encoders():
        torch.manual_seed(4)
        return [tiny_clip(vocab, 8, layers=11), tiny_clip(vocab, 2040, projection=True, projection_dim=1280)]

    def vae():
        torch.manual_seed(5)
        blocks = dict(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)
        return AutoencoderKL(block_out_channels=(32,) * 4, layers_per_block=1, latent_channels=4, sample_size=128, **blocks).eval()

    def load_target_model(name_or_path, vae_path, model_version, weight_dtype, device="cpu", model_dtype=None, disable_mmap=False):
        return True, *text_encoders(), vae(), unet(), None, None  # (SD format, TE1, TE2, VAE, UNet, logit_scale, ckpt_info)

    sdxl_train_util._load_target_model = load_target_model
    extra = f'tokenizer_cache_dir = "{cache}"\n'

    def models():
        return vae(), text_encoders(), unet()

    return "sdxl_train_network.py", training_toml(work, "unused.safetensors", images, extra), "networks.lora", models


SETUPS = {"flux": setup_flux, "sd3": setup_sd3, "anima": setup_anima, "sdxl": setup_sdxl}


def tracked_scalars(logs: Path) -> dict[str, list[float]]:
    """The ``downscale/*`` scalars the run sent to TensorBoard (through the host's step logs)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, list[float]] = {}
    for events in logs.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            if tag.startswith("downscale/"):
                found[tag] = [e.value for e in acc.Scalars(tag)]
    return found


def check_map(work: Path) -> dict:
    """The map's files are there and its windows TOML is a plugin config; returns that TOML."""
    from downscale_plugin.config import load_config

    written = sorted(p.name for p in (work / "map").iterdir())
    assert written == ["map.csv", "map.json", "map.png", "windows.toml"], written
    arms = {row["arm"] for row in csv.DictReader((work / "map" / "map.csv").open())}
    assert {"latent_0.5", "pixel_0.5", "reenc"} <= arms, arms
    windows = toml.load(work / "map" / "windows.toml")
    print("windows:", windows, "->", load_config(plugin_toml=windows).routes)
    return windows


def check_auto(work: Path, meta: dict) -> None:
    """The certifier's files are there, its windows carry the run's provenance and are the saved routes."""
    written = sorted(p.name for p in (work / "map").iterdir())
    assert written == ["certify.json", "windows.toml"], written
    windows = toml.load(work / "map" / "windows.toml")
    blob = json.loads((work / "map" / "certify.json").read_text())
    print("windows:", windows, "cost:", blob["cost"])
    assert windows["windows_model"] and windows["windows_arch"] and windows["windows_native"] == "16x16", windows
    assert 0 < blob["cost"]["native_step_equivalents"] <= 0.5 * STEPS, blob["cost"]
    recorded = json.loads(meta["ss_downscale_map"])
    assert recorded["method"] == "certify" and recorded["probes"] == 16, recorded
    assert json.loads(meta["ss_downscale_routes"]) == windows["routes"], meta


def sdxl_size_recorder() -> list:
    """Per forward of SDXL's UNet (batch size 1): its latent grid, the source size, crop top-left and target size (px,
    (h, w) each) that the host's ``call_unet`` passed to ``get_size_embeddings`` for it, and whether the UNet's input
    ``y`` carries exactly those sizes' embedding."""
    from library import sdxl_original_unet, sdxl_train_util

    seen: list = []
    last: dict = {}
    embed = sdxl_train_util.get_size_embeddings
    forward = sdxl_original_unet.SdxlUNet2DConditionModel.forward

    def size_embeddings(orig_size, crop_size, target_size, device):
        last.update(original=orig_size.tolist()[0], crop=crop_size.tolist()[0], target=target_size.tolist()[0])
        last["embedding"] = embed(orig_size, crop_size, target_size, device)
        return last["embedding"]

    def recorded(self, x, timesteps=None, context=None, y=None, **kwargs):
        assert x.shape[0] == 1, x.shape
        sizes = y[:, -6 * 256 :]  # after CLIP-G's pooled output: source, crop and target sizes (h, w), 256 each
        embedded = torch.equal(sizes, last.pop("embedding").to(sizes.dtype))
        seen.append({"hw": list(x.shape[-2:]), **last, "embedded": embedded})
        return forward(self, x, timesteps, context, y, **kwargs)

    sdxl_train_util.get_size_embeddings = size_embeddings
    sdxl_original_unet.SdxlUNet2DConditionModel.forward = recorded
    return seen


def write_record(work: Path, steps: list, runs: list, **extra: list) -> None:
    """``WORK/record.json``: the decisions, the saved LoRA's ``ss_downscale_*`` keys, the hooks left on the accelerator
    (and ``extra``: SDXL's size conditioning per UNet forward)."""
    lora = work / "out" / "lora.safetensors"
    with safe_open(str(lora), "pt") as f:
        meta = {k: v for k, v in (f.metadata() or {}).items() if k.startswith("ss_")}
    left = []
    for run in runs:
        for name in ("_save_model_state_pre_hook", "_load_model_state_pre_hook"):
            left += [f"{name}:{h.__module__}.{h.__qualname__}" for h in getattr(run.accelerator, name, {}).values()]
    record = {"steps": steps, "metadata": meta, "hooks": left, "offset": [run.router.resume_offset for run in runs], **extra}
    (work / "record.json").write_text(json.dumps(record))


def main(arch: str, work: Path, mode: str = "train", *host_argv: str) -> None:
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if os.environ.get("E2E_TOKEN_COSTS"):
        token_costs()
    if mode == "ranks":
        if arch != "flux" or PROCESSES < 2:
            raise SystemExit(f"ranks: a multi-process run of flux (E2E_PROCESSES ≥ 2), not {arch} on {PROCESSES}")
        _, _, inner, models = setup_flux(work, write_rank_images(work), ranks=True)
        return main_ranks(work, inner, models, host_argv)
    script, config, inner, models = SETUPS[arch](work, write_images(work))
    if mode.startswith("map-"):
        config.write_text(
            config.read_text().replace(ROUTES, MAP.format(after=mode.removeprefix("map-"), out=work / "map", images=MAP_IMAGES))
        )
        if mode == "map-train":
            # The map's mechanics need a window to train with: on this random tiny model (per-image excess up to 0.7,
            # 8 probes) ε = 0.99 certifies one only with the range-clipped calibration, as conftest.range_clipped_read.
            from downscale_plugin.mapping import safe_read

            safe_read.SHAPE_MARGIN = 1.0
    if mode == "auto":
        config.write_text(config.read_text().replace(ROUTES, AUTO.format(out=work / "map")))
    sys.argv = [script, "--config_file", str(config), *host_argv]
    if mode == "record":
        steps, runs = recorder()
        extra = {"unet_sizes": sdxl_size_recorder()} if arch == "sdxl" else {}
        runpy.run_path(script, run_name="__main__")
        write_record(work, steps, runs, **extra)
        print(f"E2E OK: {len(steps)} train forwards recorded")
        return
    try:
        runpy.run_path(script, run_name="__main__")  # the script's own __main__ block
    except SystemExit as stop:
        assert mode == "map-stop" and stop.code in (0, None), f"{mode}: the script exited with {stop.code}"
        check_map(work)
        assert not (work / "out" / "lora.safetensors").exists(), "after_map = stop saved weights"
        print("E2E OK")
        return
    assert mode != "map-stop", 'after_map = "stop": the script trained to the end'

    lora = work / "out" / "lora.safetensors"
    with safe_open(str(lora), "pt") as f:
        meta = f.metadata()
    print("metadata:", {k: v for k, v in meta.items() if k.startswith("ss_downscale")})
    counts = json.loads(meta["ss_downscale_counts"])
    if mode == "map-train":
        windows = check_map(work)
        assert "routes" in windows, f"the map certified no window, the run trained native: {windows}"
        assert json.loads(meta["ss_downscale_routes"]) == windows["routes"], meta
        assert MAP_IMAGES <= json.loads(meta["ss_downscale_map"])["before_train_batch"] < STEPS, meta  # routed steps follow
    if mode == "auto":
        check_auto(work, meta)
    assert meta["ss_network_module"] == "downscale_plugin" and meta["ss_downscale_inner"] == inner, meta
    assert counts["forwards"] == STEPS and counts["routes"]["native"] < 1.0, counts
    scalars = tracked_scalars(work / "logs")
    print("tracked:", {tag: values[-1] for tag, values in sorted(scalars.items())})
    assert len(scalars["downscale/steps"]) == STEPS and scalars["downscale/steps"][-1] == STEPS

    load_lora(lora, inner, models)
    print("E2E OK")


def load_lora(lora: Path, inner: str, models) -> int:
    """The saved LoRA loads into fresh base models with the inner module alone (strict); returns its tensor count."""
    vae, text_encoders, unet = models()
    module = importlib.import_module(inner)
    network, weights = module.create_network_from_weights(1.0, str(lora), vae, text_encoders, unet)
    network.apply_to(text_encoders, unet, True, True)
    info = network.load_state_dict(weights, strict=True)
    print(f"{inner}.create_network_from_weights: {len(weights)} tensors, {info}")
    return len(weights)


# ---- several processes (``ranks``) -----------------------------------------------------------------------------------


def main_ranks(work: Path, inner: str, models, train_argv: tuple[str, ...]) -> None:
    """Launch the training script as ``PROCESSES`` CPU ranks (each ``--rank`` below), then check and record what each
    rank recorded, the saved LoRA and what each rank printed (``record.json``: ``ranks``, one entry per rank)."""
    ranks = launch_ranks(__file__, work, PROCESSES, ["flux", str(work.resolve()), *train_argv], LAUNCH_TIMEOUT)
    for r, rank in enumerate(ranks):
        assert len(rank["steps"]) == len(rank["dit"]) == rank["forwards"], (r, len(rank["steps"]), len(rank["dit"]), rank["forwards"])
    lora = work / "out" / "lora.safetensors"
    with safe_open(str(lora), "pt") as f:
        meta = {k: v for k, v in (f.metadata() or {}).items() if k.startswith("ss_")}
    counts = json.loads(meta["ss_downscale_counts"])
    forwards = sum(rank["forwards"] for rank in ranks)
    assert meta["ss_network_module"] == "downscale_plugin" and meta["ss_downscale_inner"] == inner, meta
    assert counts["forwards"] == forwards, (counts, forwards)
    record = {
        "processes": PROCESSES, "ranks": ranks, "metadata": {k: v for k, v in meta.items() if k.startswith("ss_downscale")},
        "saved_sums": {k: float(v.double().sum()) for k, v in load_file(str(lora)).items()},
        "outputs": sorted(p.name for p in (work / "out").iterdir()), "loaded_tensors": load_lora(lora, inner, models),
        "event_files": len(list((work / "logs").rglob("events.out.tfevents.*"))), "scalars": tracked_scalars(work / "logs"),
    }  # fmt: skip
    (work / "record.json").write_text(json.dumps(record, indent=1))
    print(f"ranks: {PROCESSES} processes × {ranks[0]['forwards']} forwards; ranks disagreed on {ranks[0]['totals']['disagreed']:.0f}")
    print("E2E OK")


def dit_recorder() -> list:
    """Every Flux forward's batch, latent grid (twice the packed grid its ``img_ids`` index) and time input."""
    import functools
    import inspect

    from library import flux_models

    calls: list = []
    forward = flux_models.Flux.forward
    signature = inspect.signature(forward)

    @functools.wraps(forward)
    def recorded(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs).arguments
        ids = bound["img_ids"][0]
        packed = (int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1)
        assert bound["img"].shape[1] == packed[0] * packed[1], (bound["img"].shape, packed)
        calls.append({
            "batch": int(bound["img"].shape[0]), "latent_hw": [2 * packed[0], 2 * packed[1]],
            "timesteps": bound["timesteps"].reshape(-1).tolist(),
        })  # fmt: skip
        return forward(self, *args, **kwargs)

    flux_models.Flux.forward = recorded
    return calls


def save_recorder() -> list:
    """The file name of every ``save_weights`` of the inner network class (the plugin's wrap calls it)."""
    from networks import lora_flux

    saves: list = []
    save = lora_flux.LoRANetwork.save_weights

    def recorded(self, file, *args, **kwargs):
        saves.append(os.path.basename(file))
        return save(self, file, *args, **kwargs)

    lora_flux.LoRANetwork.save_weights = recorded
    return saves


def rank_main(work: Path, *train_argv: str) -> None:
    """One rank of ``main_ranks``' launch: the loaders' replacements and the recorders (nothing written but this
    rank's files), the training script with this rank's own ``--seed``, and ``WORK/rank{R}.json``; its output goes to
    ``WORK/rank{R}.log``."""
    rank = int(os.environ["RANK"])
    log = open(work / f"rank{rank}.log", "w", buffering=1)  # noqa: SIM115 (the process's stdout and stderr until it exits)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    torch.set_num_threads(1)
    script, config, _, _ = setup_flux(work, work / "img", ranks=True, write=False)
    prepared = frozen_modules_unwrapped()
    seen: dict = {}
    steps, runs = recorder(seen)
    dit, saves = dit_recorder(), save_recorder()
    sys.argv = [script, "--config_file", str(config), "--seed", str(RANKS["seed"] + rank), *train_argv]
    runpy.run_path(script, run_name="__main__")
    assert len(runs) == 1 and len(seen["networks"]) == 1, (runs, seen)
    run, network = runs[0], seen["networks"][0]
    plan = None
    if run.plan is not None:  # the main process's only
        plan = [{"latent_hw": list(b.latent_hw), "targets": {str(i): list(t) for i, t in b.targets.items()}} for b in run.plan.buckets]
    local, totals = run.accounting, run.totals
    record = {
        "rank": run.rank, "world_size": run.world_size, "own_seed": RANKS["seed"] + rank, "seed": run.seed,
        "backend": seen["backend"], "distributed_type": str(run.accelerator.distributed_type),
        "prepared": prepared,
        "forwards": int(run.router.total_forwards), "accumulation": int(run.accelerator.gradient_accumulation_steps),
        "routes": [r.label for r in run.cfg.routes], "sigma_windows": [[r.sigma_min, r.sigma_max] for r in run.cfg.routes],
        "steps": steps, "dit": dit, "saves": saves,
        "local": {**local.counts.state(), "hist_run": local.hist_run, "hist_native": local.hist_native},
        "totals": {
            **totals.counts.state(), "hist_run": totals.hist_run, "hist_native": totals.hist_native,
            "compared": totals.compared, "disagreed": totals.disagreed, "summary": totals.summary_text(),
        },
        "metadata_calls": seen["metadata_calls"], "plan_buckets": plan,
        "weights": {k: float(v.detach().double().sum()) for k, v in network.state_dict().items()},
    }  # fmt: skip
    (work / f"rank{rank}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())  # the checkout, as `python flux_train_network.py` run there has it (the plugin: installed)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if sys.argv[1] == "--rank":  # a rank of main_ranks' launch: --rank flux WORK [TRAINING ARGS...]
        rank_main(Path(sys.argv[3]), *sys.argv[4:])
    else:
        main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])
