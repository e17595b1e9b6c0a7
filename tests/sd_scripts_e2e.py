"""Run a real sd-scripts LoRA training script end to end with ``--network_module downscale_plugin``, offline.

    python tests/sd_scripts_e2e.py {flux,sd3,anima} WORK_DIR [train|map-stop|map-train|auto]
    (cwd: the sd-scripts checkout on sys.path)

The script runs exactly as ``python flux_train_network.py --config_file train.toml`` does (``runpy``,
so the trainer class lives in ``__main__``: the duplicate-class trap the plugin must survive), over a
generated image folder, with a training TOML carrying ``[plugins.downscale]``.

Only the checkpoint *loaders* are replaced, because sd-scripts builds each model from a hard-coded
full-size config and then loads weights into it (FLUX.1 hidden 3072, T5-XXL 4.7 B, CLIP-L/G, the
SD3 VAE and Anima's 2 B DiT, Qwen-Image VAE); random full-size models would need ~20 GB and hours
on a CPU. The replacements build tiny models from the same classes (sd-scripts' ``flux_models``,
``sd3_models``, ``anima_models``, ``qwen_image_autoencoder_kl``; transformers' CLIP/T5/Qwen3), and
where the host derives the config from the checkpoint (SD3's MMDiT, Anima's Qwen3 directory) the
real loader reads a tiny checkpoint written here. Tokenizers are built locally (sd-scripts'
``--tokenizer_cache_dir`` is read before the hub) or ship with the checkout (Anima).

After training it checks the saved LoRA: the inner module loads it, and its metadata carries the
``ss_downscale_*`` keys. ``map-stop`` / ``map-train`` run the plugin with ``mode = "map"`` instead of
routes: the map's files must be written, ``stop`` must end the script with exit 0 and no weights,
``train`` must save a LoRA routed by the derived windows. ``auto`` runs ``mode = "auto"`` (set
``E2E_STEPS`` ≥ 16: the certifier's probes are the first 16 samples): ``windows.toml`` and
``certify.json`` must be written, with the model's identity, and the LoRA routed by the certified
windows must record them (``ss_downscale_map``). ``record`` passes the arguments after it
to the script (``--gradient_accumulation_steps 2 --resume DIR ...``) and writes ``WORK/record.json``:
every train step's route decision in order, the saved LoRA's ``ss_downscale_*`` metadata and the
accelerator's state hooks left at the end; the caller checks them (``E2E_IMAGES``, ``E2E_REPEATS``,
``E2E_STEPS`` and ``E2E_ROUTES`` set the dataset, ``max_train_steps`` and the plugin table). Prints
``E2E OK`` on success.
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
from safetensors import safe_open
from safetensors.torch import load_file, save_file

STEPS = int(os.environ.get("E2E_STEPS", 8))
IMAGES = int(os.environ.get("E2E_IMAGES", 2))
REPEATS = int(os.environ.get("E2E_REPEATS", 4))
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
map_images = 2                    # the run's first two samples (batch size 1: the map runs before batch 2)
map_margin = 0.99                 # a loose margin, so that a window is found and after_map = "train" routes
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
certify_draws = 2                 # a look at one bin: 4 probes × 2 draws × (1 + 0.25) = 10 native-step equivalents
certify_budget = 0.5              # of the run's E2E_STEPS single-sample passes
"""


def write_images(root: Path) -> Path:
    images = root / "img" / "4_tiny"
    images.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(IMAGES):
        pixels = (rng.random((128, 128, 3)) * 255).astype(np.uint8)
        Image.fromarray(pixels).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text(f"a tiny test image number {i}")
    return root / "img"


def clip_tokenizer(path: Path, eos: str = "<|endoftext|>") -> int:
    """A byte-level CLIP BPE tokenizer with no merges (one token per character); returns the vocab size."""
    from transformers import CLIPTokenizer
    from transformers.models.clip.tokenization_clip import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars + [c + "</w>" for c in chars] + ["<|startoftext|>", eos])}
    path.mkdir(parents=True)
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    CLIPTokenizer(str(path / "vocab.json"), str(path / "merges.txt")).save_pretrained(str(path))
    return len(vocab)


def t5_tokenizer(path: Path) -> int:
    """A character-level Unigram tokenizer with T5's specials ("</s>" appended); returns the vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)] + [(c, -2.0) for c in string.printable.strip()]
    tok = Tokenizer(models.Unigram(pieces, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
    T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>", extra_ids=0).save_pretrained(str(path))
    return len(pieces)


def tiny_clip(vocab: int, width: int, projection: bool = False):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=77, projection_dim=width, eos_token_id=vocab - 1,
    )  # fmt: skip
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def tiny_t5(vocab: int, width: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab, d_model=width, d_kv=width // 2, d_ff=2 * width, num_layers=1, num_heads=2, feed_forward_proj="gated-gelu"
    )
    return T5EncoderModel(config).eval()


def training_toml(work: Path, model: str, images: Path, extra: str) -> Path:
    (work / "dataset.toml").write_text(
        f'[general]\ncaption_extension = ".txt"\nresolution = 128\nbatch_size = 1\n\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = "{images / "4_tiny"}"\nnum_repeats = {REPEATS}\n'
    )
    path = work / "train.toml"
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
{ROUTES}"""
    )
    return path


def setup_flux(work: Path, images: Path) -> tuple:
    from library import flux_models, flux_utils

    cache = work / "tokenizers"
    clip_vocab = clip_tokenizer(cache / "openai_clip-vit-large-patch14")
    t5_vocab = t5_tokenizer(cache / "google_t5-v1_1-xxl")
    params = flux_models.FluxParams(
        in_channels=16, vec_in_dim=8, context_in_dim=8, hidden_size=64, mlp_ratio=2.0, num_heads=2, depth=1,
        depth_single_blocks=1, axes_dim=[8, 12, 12], theta=10_000, qkv_bias=True, guidance_embed=True,
    )  # fmt: skip
    checkpoint = work / "flux_tiny.safetensors"
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
    extra = f"""clip_l = "unused"
t5xxl = "unused"
ae = "unused"
tokenizer_cache_dir = "{cache}"
t5xxl_max_token_length = 8
guidance_scale = 1.0
model_prediction_type = "raw"
timestep_sampling = "sigmoid"
"""

    def models():
        return flux_utils.load_ae(), [flux_utils.load_clip_l(), flux_utils.load_t5xxl()], load_flow_model(str(checkpoint), None, "cpu")[1]

    return "flux_train_network.py", training_toml(work, str(checkpoint), images, extra), "networks.lora_flux", models


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


SETUPS = {"flux": setup_flux, "sd3": setup_sd3, "anima": setup_anima}


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


def recorder() -> tuple[list, list]:
    """Every train step's decision (rule index, lead, drawn σ) in order, and the run objects seen."""
    from downscale_plugin.hosts.kohya.run import DownscaleRun

    steps: list = []
    runs: list = []
    on_step = DownscaleRun.on_step

    def record(self, step, decision, *rest, **kw):
        if not runs or runs[-1] is not self:
            runs.append(self)
        steps.append({"step": step, "rule": decision.rule_index, "lead": decision.lead, "sigmas": decision.sigmas.reshape(-1).tolist()})
        return on_step(self, step, decision, *rest, **kw)

    DownscaleRun.on_step = record
    return steps, runs


def write_record(work: Path, steps: list, runs: list) -> None:
    """``WORK/record.json``: the decisions, the saved LoRA's ``ss_downscale_*`` keys, the hooks left on the accelerator."""
    lora = work / "out" / "lora.safetensors"
    with safe_open(str(lora), "pt") as f:
        meta = {k: v for k, v in (f.metadata() or {}).items() if k.startswith("ss_")}
    left = []
    for run in runs:
        for name in ("_save_model_state_pre_hook", "_load_model_state_pre_hook"):
            left += [f"{name}:{h.__module__}.{h.__qualname__}" for h in getattr(run.accelerator, name, {}).values()]
    record = {"steps": steps, "metadata": meta, "hooks": left, "offset": [run.router.resume_offset for run in runs]}
    (work / "record.json").write_text(json.dumps(record))


def main(arch: str, work: Path, mode: str = "train", *host_argv: str) -> None:
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    script, config, inner, models = SETUPS[arch](work, write_images(work))
    if mode.startswith("map-"):
        config.write_text(config.read_text().replace(ROUTES, MAP.format(after=mode.removeprefix("map-"), out=work / "map")))
    if mode == "auto":
        config.write_text(config.read_text().replace(ROUTES, AUTO.format(out=work / "map")))
    sys.argv = [script, "--config_file", str(config), *host_argv]
    if mode == "record":
        steps, runs = recorder()
        runpy.run_path(script, run_name="__main__")
        write_record(work, steps, runs)
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
        assert json.loads(meta["ss_downscale_routes"]) == windows["routes"], meta
        assert json.loads(meta["ss_downscale_map"])["before_train_batch"] == 2, meta
    if mode == "auto":
        check_auto(work, meta)
    assert meta["ss_network_module"] == "downscale_plugin" and meta["ss_downscale_inner"] == inner, meta
    assert counts["forwards"] == STEPS and counts["routes"]["native"] < 1.0, counts
    scalars = tracked_scalars(work / "logs")
    print("tracked:", {tag: values[-1] for tag, values in sorted(scalars.items())})
    assert len(scalars["downscale/steps"]) == STEPS and scalars["downscale/steps"][-1] == STEPS

    vae, text_encoders, unet = models()  # fresh base models: the LoRA must load with the inner module alone
    module = importlib.import_module(inner)
    network, weights = module.create_network_from_weights(1.0, str(lora), vae, text_encoders, unet)
    network.apply_to(text_encoders, unet, True, True)
    info = network.load_state_dict(weights, strict=True)
    print(f"{inner}.create_network_from_weights: {len(weights)} tensors, {info}")
    print("E2E OK")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])
