"""Run musubi-tuner's real caching and LoRA training scripts end to end with ``--network_module downscale_plugin``, offline.

    python tests/musubi_e2e.py {wan,wan22,qwen_image} WORK_DIR [TRAINING ARGS...]
    (musubi-tuner importable: installed, or ``MUSUBI_DIR`` set to a checkout, main 30c658c4)

Over a generated dataset (Wan: five-frame 128² and 160×96 clips, Qwen-Image: 128² and 160×96 images, each
with a caption file) and a dataset TOML, the script runs, each through ``runpy`` as ``python SCRIPT ...``
runs it, musubi-tuner's own

1. latent caching (``wan_cache_latents.py`` / ``qwen_image_cache_latents.py``, ``--device cpu``),
2. text-encoder caching (``wan_cache_text_encoder_outputs.py`` / ``qwen_image_cache_text_encoder_outputs.py``),
3. training (``wan_train_network.py`` / ``qwen_image_train_network.py``) from a training TOML with
   ``network_module = "downscale_plugin"`` and a ``[plugins.downscale]`` table (the trainer class lives
   in ``__main__``, as in a real launch).

``wan`` trains Wan 2.1 (``--task t2v-1.3B``); ``wan22`` Wan 2.2's two experts (``t2v-A14B`` with a second tiny
DiT as ``dit_high_noise``): each forward must run the expert its own σ names against ``timestep_boundary``.

Only the checkpoint *loaders* are changed, because musubi-tuner builds every model at a hard-coded full
size before loading weights into it (Wan's ``load_wan_model`` from ``WAN_CONFIGS`` with ``text_dim`` 4096,
T5 ``umt5_xxl``, VAE ``_video_vae`` at ``dim=96``; Qwen-Image's ``create_model`` at 20 B, ``load_qwen2_5_vl``
from the 7 B JSON, ``load_vae`` at ``base_dim=96``): random full-size models would need tens of GB and hours
on a CPU. Each real loader still runs; only the kwargs it passes to the class it builds (musubi-tuner's
``WanModel``, ``_t5``, ``WanVAE_``, ``QwenImageTransformer2DModel``, ``AutoencoderKLQwenImage``;
transformers' ``Qwen2_5_VLConfig``) get tiny widths and depths for the duration of the call (``shrink``),
and it reads a checkpoint written here from the same class and kwargs (captured from the loader itself,
``captured``) in the layout it expects, so its key conversions and strict loads run as they do. The
UMT5 and Qwen2 tokenizers are byte-level stand-ins laid out as hub-cache entries (``HF_HUB_OFFLINE=1``),
which musubi-tuner's ``from_pretrained(repo_id, subfolder=...)`` resolves. The tiny DiTs' zero-initialised
output/modulation layers get small random weights, as a trained model's are (else no LoRA gets a gradient).

Checked, and written to ``WORK/record.json`` for the caller: every train step's route decision (as
``tests/sd_scripts_e2e.py``'s ``record`` mode does) with the grid the DiT actually ran (its patch
embedding's input: a routed step at the route's small grid, a video's latent frames unchanged); the
routed share and token saving measured against the prediction of ``downscale_plugin.plan`` (the
plan the run's start banner printed, from the host's own sampler over the run's buckets, and an
independent ``plan_table`` over the recorded buckets with the exact σ law, and ``python -m downscale_plugin
plan --host musubi`` on the run's training TOML and buckets); the saved LoRA's
``ss_downscale_*`` metadata; and that the LoRA loads with musubi-tuner's own ``networks.lora_wan`` /
``networks.lora_qwen_image`` (``create_arch_network_from_weights`` + ``merge_to`` as the generate
scripts merge it, agreeing with the loaders' own merge-at-load ``lora_weights_list`` path). Prints
``E2E OK``. ``E2E_STEPS`` sets ``max_train_steps``, ``E2E_BATCH`` the dataset's batch size; arguments after
WORK_DIR go to the training script (``--gradient_accumulation_steps 2``, ``--num_timestep_buckets 4`` ...).

Several processes (``E2E_PROCESSES``; ``wan_ranks``: 2 by default, Wan 2.1 on ``RANKS``' two-resolution dataset
and bucket-dependent σ law, and with ``E2E_PROCESSES=1`` that dataset on one process, e.g. to resume a state its
ranks saved; ``wan``, ``wan22`` take it too): after the caching, this process launches the training
as that many CPU ranks through accelerate's own launcher, ``python -m accelerate.commands.launch --multi_gpu
--num_processes N --num_cpu_threads_per_process 1 ... musubi_e2e.py --rank NAME WORK`` with ``ACCELERATE_USE_CPU=1``
and no visible GPU, so each rank's Accelerator runs MULTI_CPU on gloo (``--num_processes N`` without ``--multi_gpu``,
or with ``--cpu``, takes accelerate's simple launcher: one process). Each rank installs the same loader shrinks and
recorders, trains with its own ``--seed`` (``RANKS["seed"]`` + rank, as an unseeded run draws one per process) and
writes ``WORK/rank{R}.json`` (its steps, DiT inputs and timesteps, its own and the cross-rank counts, its final LoRA
weights) and ``WORK/rank{R}.log`` (its output). One shim: accelerate's MULTI_CPU ``prepare_model`` wraps the
trainer's frozen DiT in DDP, which refuses a model with no trainable parameter; the ranks get accelerate's
multi-GPU behaviour for it, no DDP (``frozen_modules_unwrapped``). musubi-tuner's ``--ddp_timeout`` only reaches the
process group with more than one CUDA device, so a hung collective ends at ``E2E_LAUNCH_TIMEOUT`` here. This process
then checks every rank's grids, the saved LoRA's cross-rank counts and its load in musubi-tuner, and writes
``record.json`` with one entry per rank (and what each printed: the plugin's start banner and end summary).
"""

from __future__ import annotations

import functools
import json
import math
import os
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from ranks_checks import RANKS_ROUTES, RANKS_SEED
from ranks_launch import frozen_modules_unwrapped, launch_ranks
from run_recorder import recorder

STEPS = int(os.environ.get("E2E_STEPS", 160))
BATCH = int(os.environ.get("E2E_BATCH", 1))
FRAMES = 5  # pixel frames of a clip: Wan's causal VAE keeps the first and compresses 4 -> 2 latent frames
SIZES = [(128, 128), (128, 128), (160, 96), (160, 96)]  # (W, H): two buckets at musubi-tuner's 16 px steps
ROUTES = """
[plugins.downscale]
gate = "coupled"

[[plugins.downscale.routes]]
scale = 0.5                       # every bucket at half its sides inside 0.9 < σ < 1 ...
sigma_min = 0.9
sigma_max = 1.0

[[plugins.downscale.routes]]
scale = 0.75                      # ... and at 0.75 inside 0.5 < σ < 0.8 (the rest runs native)
sigma_min = 0.5
sigma_max = 0.8
"""
# σ samplers: Wan's shift (k = 3), Qwen-Image's qwen_shift (k from each bucket's packed tokens; the shift unused)
SAMPLING = {
    "wan": {"timestep_sampling": "shift", "discrete_flow_shift": 3.0},
    "qwen_image": {"timestep_sampling": "qwen_shift", "discrete_flow_shift": 1.0},
}
SNAPSHOT = "0" * 40
DIT_INPUTS: list[tuple[int, ...]] = []  # the patch embedding's input of every DiT forward while training
DIT_WEIGHTS: list[float] = []  # ... and its first weight (which expert ran)
DIT_TIMESTEPS: list[list[float]] = []  # ... and the timesteps it was called with (Wan)

# The multi-process run (``wan_ranks``, launched as E2E_PROCESSES ranks): clips at two resolutions, so the ranks are
# on different buckets on some steps, under a σ law that depends on the bucket (flux_shift: μ from the latent's
# size) and is narrow (sigmoid_scale), so the two buckets' route odds differ by much: logit σ ~ N(μ, 0.0225²) with
# μ 0.4675 at 128² (16×16 latent) and 0.5 at 256² (32×32). The two windows' edges sit at the two median σ
# (0.6148, 0.6225): per bucket native / r0 / r1 ≈ 0.50 / 0.43 / 0.07 at 128² and 0.07 / 0.43 / 0.50 at 256², so
# ranks on the same bucket must route together where independent draws would often split, and ranks on different
# buckets disagree on about 85 % of such steps (one shared uniform through each rank's own odds).
RANKS = {
    "sizes": {"small": ((128, 128), 4), "large": ((256, 256), 4)},  # (W, H), clips
    "sampling": {"timestep_sampling": "flux_shift", "discrete_flow_shift": 1.0, "sigmoid_scale": 0.0225},
    "routes": RANKS_ROUTES,
    "frames": 1,  # pixel frames per clip (Wan's VAE: one latent frame; a video's cost without its VAE time)
    "seed": RANKS_SEED,
}


# ---- tiny models from the real loaders ----------------------------------------------------------------------------


def shrink(module, loader: str, name: str, resize) -> None:
    """Run ``module.loader`` (the real checkpoint loader) with ``module.name`` (the class or config it builds)
    called on ``resize(kwargs)`` instead of its hard-coded full-size kwargs, for the duration of each call."""
    real_loader, real = getattr(module, loader), getattr(module, name)

    def tiny(*args, **kwargs):
        return real(*args, **resize(dict(kwargs)))

    @functools.wraps(real_loader)
    def loading(*args, **kwargs):
        setattr(module, name, tiny)
        try:
            return real_loader(*args, **kwargs)
        finally:
            setattr(module, name, real)

    setattr(module, loader, loading)


class _Captured(Exception):
    pass


def captured(module, loader: str, name: str, *args, **kwargs) -> dict:
    """The kwargs the real ``module.loader(*args, **kwargs)`` passes to ``module.name`` (the call stops there)."""
    real = getattr(module, name)

    def capture(**kw):
        raise _Captured(kw)

    setattr(module, name, capture)
    try:
        getattr(module, loader)(*args, **kwargs)
    except _Captured as found:
        return found.args[0]
    finally:
        setattr(module, name, real)
    raise AssertionError(f"{module.__name__}.{loader} did not build {name}")


def sized(**sizes):
    return lambda kwargs: {**kwargs, **sizes}


def record_inputs(model: torch.nn.Module, embed: str) -> torch.nn.Module:
    """Record each forward's input shape at the DiT's patch embedding, and which weights ran it (their first value:
    Wan 2.2's trainer swaps the experts' state dicts into the one model)."""

    def hook(module, inputs, out):
        DIT_INPUTS.append(tuple(inputs[0].shape))
        DIT_WEIGHTS.append(float(module.weight.reshape(-1)[0]))

    getattr(model, embed).register_forward_hook(hook)
    return model


def record_timesteps(model: torch.nn.Module, key: str = "t") -> torch.nn.Module:
    """Record the timesteps each DiT forward is called with (Wan: ``model(x, t=timesteps, ...)``)."""

    def hook(module, args, kwargs):
        DIT_TIMESTEPS.append(kwargs[key].detach().float().reshape(-1).tolist())

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def trained(model: torch.nn.Module) -> torch.nn.Module:
    """A trained DiT's output and modulation layers are not the init's zeros, which would leave a LoRA no gradient."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv3d)) and weight is not None and not weight.any():
            torch.nn.init.normal_(weight, std=0.02)
    return model


def save_state(model: torch.nn.Module, path: Path, rename=lambda k: k) -> str:
    from safetensors.torch import save_file

    save_file({rename(k): v.detach().contiguous() for k, v in model.state_dict().items()}, str(path))
    return str(path)


def hub_entry(hub: Path, repo: str, subfolder: str) -> Path:
    """The snapshot folder ``from_pretrained(repo, subfolder=...)`` resolves offline from the hub cache."""
    root = hub / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(SNAPSHOT)
    path = root / "snapshots" / SNAPSHOT / subfolder
    path.mkdir(parents=True, exist_ok=True)
    return path


def qwen2_tokenizer(path: Path) -> int:
    """A byte-level Qwen2 BPE tokenizer with no merges (one token per byte) and Qwen's chat specials; the vocab size."""
    from transformers import Qwen2Tokenizer
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    vocab = {c: i for i, c in enumerate([*bytes_to_unicode().values(), "<|endoftext|>", "<|im_start|>", "<|im_end|>"])}
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    Qwen2Tokenizer(str(path / "vocab.json"), str(path / "merges.txt")).save_pretrained(str(path))
    return len(vocab)


# ---- datasets ---------------------------------------------------------------------------------------------------


def write_clips(folder: Path, sizes=SIZES, first: int = 0) -> None:
    """Five-frame clips ``clip{first + i}.mp4`` of ``sizes`` (W, H), each with its caption."""
    import av

    folder.mkdir(parents=True)
    rng = np.random.default_rng(first)
    for i, (w, h) in enumerate(sizes, start=first):
        container = av.open(str(folder / f"clip{i}.mp4"), mode="w")
        stream = container.add_stream("mpeg4", rate=16)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        base = rng.random((h, w, 3)) * 255
        for f in range(FRAMES):
            pixels = np.clip(base + 8 * f, 0, 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        container.close()
        (folder / f"clip{i}.txt").write_text(f"a tiny test clip number {i}")


def write_images(folder: Path) -> None:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i, (w, h) in enumerate(SIZES):
        Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(f"a tiny test image number {i}")


def dataset_toml(work: Path, media: str, write: bool = True) -> Path:
    extra = f'video_directory = "{work / "media"}"\ntarget_frames = [{FRAMES}]\nframe_extraction = "head"\n'
    if media == "images":
        extra = f'image_directory = "{work / "media"}"\n'
    path = work / "dataset.toml"
    if not write:
        return path
    path.write_text(
        f'[general]\nresolution = [128, 128]\ncaption_extension = ".txt"\nbatch_size = {BATCH}\nenable_bucket = true\n\n'
        f'[[datasets]]\n{extra}cache_directory = "{work / "cache"}"\nnum_repeats = 1\n'
    )
    return path


def ranks_dataset(work: Path, write: bool = True) -> tuple[Path, list[Path], int]:
    """The multi-process run's dataset TOML: one dataset per resolution of ``RANKS["sizes"]`` (its own clips and cache
    folder; no upscaling, so each keeps its own bucket); its cache folders and item count."""
    path, sections, dirs, first = work / "dataset.toml", [], [], 0
    for name, (size, count) in RANKS["sizes"].items():
        media, cache = work / f"media_{name}", work / f"cache_{name}"
        if write:
            write_clips(media, [size] * count, first)
        sections.append(
            f'[[datasets]]\nresolution = [{size[0]}, {size[1]}]\nvideo_directory = "{media}"\ntarget_frames = [{RANKS["frames"]}]\n'
            f'frame_extraction = "head"\ncache_directory = "{cache}"\nnum_repeats = 1\n'
        )
        dirs.append(cache)
        first += count
    if write:
        general = f'[general]\ncaption_extension = ".txt"\nbatch_size = {BATCH}\nenable_bucket = true\n\n'
        path.write_text(general + "\n".join(sections))
    return path, dirs, first


def training_toml(work: Path, model: str, sampling: dict, routes: str = ROUTES, write: bool = True) -> Path:
    path = work / "train.toml"
    if not write:  # a rank of a multi-process run: the launching process wrote it
        return path
    sampler = "\n".join(f"{key} = {json.dumps(value)}" for key, value in sampling.items())  # TOML strings and floats
    path.write_text(
        f"""[model]
{model}
sdpa = true

[training]
dataset_config = "{work / "dataset.toml"}"
output_dir = "{work / "out"}"
output_name = "lora"
network_module = "downscale_plugin"
network_dim = 4
network_alpha = 4
max_train_steps = {STEPS}
learning_rate = 1e-3
optimizer_type = "AdamW"
seed = 42
max_data_loader_n_workers = 0
{sampler}
{routes}"""
    )
    return path


def caches(prefix: str, dataset: Path, vae: str, *encoder: str, latent_args: Sequence[str] = ()) -> list[tuple[str, list[str]]]:
    """musubi-tuner's two caching scripts of an architecture and their command lines (CPU, one worker)."""
    common = ["--dataset_config", str(dataset), "--device", "cpu", "--num_workers", "1"]
    latents = (f"{prefix}_cache_latents.py", [*common, "--vae", vae, *latent_args])
    return [latents, (f"{prefix}_cache_text_encoder_outputs.py", [*common, *encoder, "--batch_size", "4"])]


# ---- the two architectures ------------------------------------------------------------------------------------------


def setup_wan(work: Path, hub: Path, task: str = "t2v-1.3B", ranks: bool = False, write: bool = True) -> dict:
    """Wan 2.1 (``t2v-1.3B``), or Wan 2.2's two experts (``t2v-A14B``: a second DiT as ``dit_high_noise``).

    ``ranks``: the two-resolution dataset, σ sampler and routes of the multi-process run (``RANKS``). ``write=False``
    (a rank of a multi-process run, in the folder the launching process set up): only install the loaders' shrinks and
    the DiT's recording; the checkpoints, clips, caches and TOMLs are the launcher's (the trainer loads no T5: the text
    encoder outputs are cached)."""
    from sd_scripts_e2e import t5_tokenizer  # a character-level Unigram T5 tokenizer (T5's specials)

    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0  # wan/modules/t5.py evaluates it as a default argument at import
    try:
        from musubi_tuner.wan.configs import WAN_CONFIGS
        from musubi_tuner.wan.modules import model as wan_model
        from musubi_tuner.wan.modules import t5, vae
    finally:
        torch.cuda.current_device = current_device

    tiny_vae = dict(dim=8, num_res_blocks=1)
    tiny_dit = dict(dim=48, ffn_dim=64, num_heads=2, num_layers=1, text_dim=32)  # text_dim: the tiny T5's width
    config = WAN_CONFIGS[task]
    t5_path, vae_path, dit_path = (str(work / f"{name}.safetensors") for name in ("t5", "vae", "dit"))
    experts = None
    if write:
        vocab = t5_tokenizer(hub_entry(hub, "Wan-AI/Wan2.1-T2V-14B", "google/umt5-xxl"))
        tiny_t5 = dict(vocab_size=vocab, dim=32, dim_attn=32, dim_ffn=64, num_heads=2, encoder_layers=1, num_buckets=8)
        dit_kwargs = captured(wan_model, "load_wan_model", "WanModel", config, "cpu", None, "torch", False, "cpu", torch.float32)
        vae_kwargs = captured(vae, "_video_vae", "WanVAE_", None, 16)
        torch.manual_seed(1)
        save_state(t5.umt5_xxl(encoder_only=True, return_tokenizer=False, **tiny_t5), Path(t5_path))
        save_state(vae.WanVAE_(**{**vae_kwargs, **tiny_vae}), Path(vae_path))
        low = trained(wan_model.WanModel(**{**dit_kwargs, **tiny_dit}))
        save_state(low, Path(dit_path))  # float32 (CPU autocast rejects Wan's float32 time embedding block)
        if config.v2_2:  # Wan 2.2: the high-noise expert, other random weights (each forward's first weight says which ran)
            high = trained(wan_model.WanModel(**{**dit_kwargs, **tiny_dit}))
            experts = {"boundary": config.boundary, "path": save_state(high, work / "dit_high.safetensors")}
            experts |= {name: float(m.patch_embedding.weight.reshape(-1)[0]) for name, m in (("low", low), ("high", high))}
            assert experts["low"] != experts["high"]
        shrink(t5, "umt5_xxl", "_t5", sized(**tiny_t5))  # T5EncoderModel's umt5_xxl(encoder_only=True) -> _t5("umt5-xxl", **cfg)
    elif config.v2_2:
        experts = {"boundary": config.boundary, "path": str(work / "dit_high.safetensors")}

    shrink(vae, "_video_vae", "WanVAE_", sized(**tiny_vae))
    shrink(wan_model, "load_wan_model", "WanModel", sized(**tiny_dit))

    real_load = wan_model.load_wan_model

    def load_wan_model(*args, **kwargs):  # the trainer's: record what its DiT's patch embedding sees, and its timesteps
        model = real_load(*args, **kwargs)
        return record_timesteps(record_inputs(model, "patch_embedding"))

    wan_model.load_wan_model = load_wan_model
    if ranks:
        dataset, cache_dirs, items = ranks_dataset(work, write)
    else:
        if write:
            write_clips(work / "media")
        dataset, cache_dirs, items = dataset_toml(work, "videos", write), [work / "cache"], len(SIZES)
    model = f'task = "{task}"\ndit = "{dit_path}"\nvae = "{vae_path}"\nt5 = "{t5_path}"\nmixed_precision = "no"'
    if experts is not None:
        model += f'\ndit_high_noise = "{experts["path"]}"'

    def load_dit(lora: dict | None = None):
        return real_load(
            config, "cpu", dit_path, "torch", False, "cpu", torch.float32,
            lora_weights_list=None if lora is None else [lora], lora_multipliers=None if lora is None else [1.0],
        )  # fmt: skip

    sampling, routes = (RANKS["sampling"], RANKS["routes"]) if ranks else (SAMPLING["wan"], ROUTES)
    return dict(
        # the ranks' larger clips: a float32 VAE (its bfloat16 default convolves about 5× slower on a CPU)
        caches=caches("wan", dataset, vae_path, "--t5", t5_path, latent_args=("--vae_dtype", "float32") if ranks else ()),
        train="wan_train_network.py",
        config=training_toml(work, model, sampling, routes, write),
        inner="networks.lora_wan",
        load_dit=load_dit,
        frames=1 if ranks else 2,
        experts=experts,
        cache_dirs=cache_dirs,
        items=items,
    )


def setup_qwen_image(work: Path, hub: Path) -> dict:
    from musubi_tuner.qwen_image import qwen_image_model, qwen_image_utils
    from musubi_tuner.qwen_image.qwen_image_autoencoder_kl import AutoencoderKLQwenImage
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vocab = qwen2_tokenizer(hub_entry(hub, qwen_image_utils.QWEN_IMAGE_ID, "tokenizer"))
    text = dict(
        hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1, max_window_layers=1,
        vocab_size=vocab, rope_scaling={"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"},
    )  # fmt: skip
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, fullatt_block_indexes=[0])

    def tiny_vl(kwargs: dict) -> dict:  # the 7 B JSON's top level and its text_config, with tiny widths and one layer
        kwargs = {**kwargs, **text, "vision_config": {**kwargs["vision_config"], **vision}}
        kwargs["text_config"] = {**kwargs["text_config"], **text, "layer_types": ["full_attention"]}
        return kwargs

    tiny_vae = dict(base_dim=8, num_res_blocks=1)
    tiny_dit = dict(num_layers=1, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(8, 12, 12))
    vl_kwargs = captured(qwen_image_utils, "load_qwen2_5_vl", "Qwen2_5_VLConfig", None, torch.bfloat16, "cpu")
    vae_kwargs = captured(qwen_image_utils, "load_vae", "AutoencoderKLQwenImage", None)
    flags = (False, False, False, False)  # split_attn, zero_cond_t, use_additional_t_cond, use_layer3d_rope
    dit_kwargs = captured(
        qwen_image_model, "load_qwen_image_model", "QwenImageTransformer2DModel", "cpu", None, "torch", *flags, "cpu", torch.float32
    )
    torch.manual_seed(1)
    # The text encoder in the layout of its single-file checkpoints (model.* / visual.*, which the loader renames).
    vl = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**tiny_vl(vl_kwargs)))
    te_path = save_state(
        vl, work / "qwen_vl.safetensors", lambda k: k.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1)
    )
    vae_path = save_state(AutoencoderKLQwenImage(**{**vae_kwargs, **tiny_vae}), work / "vae.safetensors")
    dit = trained(qwen_image_model.QwenImageTransformer2DModel(**{**dit_kwargs, **tiny_dit}))
    dit_path = save_state(dit, work / "dit.safetensors")
    shrink(qwen_image_utils, "load_qwen2_5_vl", "Qwen2_5_VLConfig", tiny_vl)
    shrink(qwen_image_utils, "load_vae", "AutoencoderKLQwenImage", sized(**tiny_vae))
    shrink(qwen_image_model, "load_qwen_image_model", "QwenImageTransformer2DModel", sized(**tiny_dit))

    real_load = qwen_image_model.load_qwen_image_model

    def load_qwen_image_model(*args, **kwargs):
        model = real_load(*args, **kwargs)
        return record_inputs(model, "img_in")

    qwen_image_model.load_qwen_image_model = load_qwen_image_model
    write_images(work / "media")
    dataset = dataset_toml(work, "images")
    # main() sets a bfloat16 DiT, so the run is bf16 mixed precision (CPU autocast takes bf16)
    model = f'dit = "{dit_path}"\nvae = "{vae_path}"\ntext_encoder = "{te_path}"\nnum_layers = 1\nmixed_precision = "bf16"'

    def load_dit(lora: dict | None = None):
        return real_load(
            "cpu", dit_path, "torch", *flags, "cpu", torch.float32, num_layers=1,
            lora_weights_list=None if lora is None else [lora], lora_multipliers=None if lora is None else [1.0],
        )  # fmt: skip

    return dict(
        caches=caches("qwen_image", dataset, vae_path, "--text_encoder", te_path),
        train="qwen_image_train_network.py",
        config=training_toml(work, model, SAMPLING["qwen_image"]),
        inner="networks.lora_qwen_image",
        load_dit=load_dit,
        frames=1,
        experts=None,
        cache_dirs=[work / "cache"],
        items=len(SIZES),
    )


SETUPS = {
    "wan": setup_wan, "wan22": functools.partial(setup_wan, task="t2v-A14B"), "qwen_image": setup_qwen_image,
    "wan_ranks": functools.partial(setup_wan, ranks=True),
}  # fmt: skip
ARCHS = {"wan": "wan", "wan22": "wan", "qwen_image": "qwen_image", "wan_ranks": "wan"}  # the plugin's arch of each setup
MULTI = {"wan", "wan22", "wan_ranks"}  # the setups a multi-process launch can run (their setup takes write=False)


# ---- recording and checks ---------------------------------------------------------------------------------------------


def run_script(name: str, argv: list[str]) -> None:
    import musubi_tuner

    path = os.path.join(os.path.dirname(musubi_tuner.__file__), name)
    print(f"== {name} {' '.join(argv)}", flush=True)
    sys.argv = [path, *argv]
    runpy.run_path(path, run_name="__main__")


def plan_figures(plan, steps: list) -> dict:
    """A plan's overall figures, and its prediction for the buckets the run's steps drew (per step, its bucket's row)
    with the spread of that prediction (``*_sd``): what the measured routed share and token saving should match."""
    rows = {tuple(row.latent_hw): row for row in plan.buckets}
    share = share_var = run_tokens = run_var = native = 0.0
    rules = {i: [0.0, 0.0] for i in plan.probs}  # per rule (−1 native): Σ p, Σ p(1 − p) over the steps
    for step in steps:
        row = rows[tuple(step["native_hw"])]
        for i, p in row.probs.items():
            rules[i][0] += p
            rules[i][1] += p * (1.0 - p)
        routed = 1.0 - row.probs[-1]
        mean = sum(p * row.tokens[i] for i, p in row.probs.items())
        share, share_var = share + routed, share_var + routed * (1.0 - routed)
        run_tokens, run_var = run_tokens + mean, run_var + sum(p * row.tokens[i] ** 2 for i, p in row.probs.items()) - mean**2
        native += row.tokens[-1]
    n = len(steps)
    return {
        "routed": 1.0 - plan.probs[-1], "probs": {str(k): v for k, v in plan.probs.items()}, "token_saving": plan.token_saving,
        "flop_saving": plan.flop_saving,
        "buckets": [
            {"latent_hw": list(row.latent_hw), "weight": row.weight, "targets": {str(i): list(t) for i, t in row.targets.items()}}
            for row in plan.buckets
        ],
        "given_buckets": {
            "routed": share / n, "routed_sd": math.sqrt(share_var) / n,
            "token_saving": 1.0 - run_tokens / native, "token_saving_sd": math.sqrt(max(run_var, 0.0)) / native,
            "probs": {str(i): v[0] / n for i, v in rules.items()}, "probs_sd": {str(i): math.sqrt(v[1]) / n for i, v in rules.items()},
        },
    }  # fmt: skip


def exact_plan(run, steps: list, timestep_sampling: str, discrete_flow_shift: float) -> dict:
    """``plan_table`` over the buckets the run trained on (weighted by its steps) with the exact σ law of the host's
    sampler (the family's ``flow_law``), independent of the banner's Monte Carlo through the host's draws."""
    from types import SimpleNamespace

    from downscale_plugin.hosts.musubi.family import flow_law
    from downscale_plugin.plan import plan_table

    args = SimpleNamespace(
        timestep_sampling=timestep_sampling, sigmoid_scale=1.0, discrete_flow_shift=discrete_flow_shift, min_timestep=None,
        max_timestep=None,
    )  # fmt: skip

    class Exact:
        has_closed_form = True

        def mass(self, lo, hi, latent_hw):
            law = flow_law(args, latent_hw)
            return (1.0 if hi is None else law.cdf(hi)) - law.cdf(lo)

    seen: dict[tuple[int, int], int] = {}
    for step in steps:
        seen[tuple(step["native_hw"])] = seen.get(tuple(step["native_hw"]), 0) + 1
    plan = plan_table(
        run.cfg, run.arch, Exact(), list(seen), BATCH, list(seen.values()), flop_model=run.plan.flop_model, total_forwards=len(steps)
    )
    return plan_figures(plan, steps)


def cli_plan(setup: dict, steps: list, arch: str) -> dict:
    """``python -m downscale_plugin plan --host musubi`` on the run's own training TOML and buckets (in process; its
    overall line parsed), or why it could not run (the command is newer than this script's first version)."""
    import contextlib
    import io
    import re

    from downscale_plugin.arch import get_arch

    factor = get_arch(arch).vae_factor
    buckets = sorted({tuple(s["native_hw"]) for s in steps})
    frames = f"x{FRAMES}" if arch == "wan" else ""
    argv = ["plan", "--host", "musubi", "--config_file", str(setup["config"]), "--script", setup["train"]]
    for h, w in buckets:
        argv += ["--bucket", f"{w * factor}x{h * factor}{frames}"]
    out = io.StringIO()
    try:
        from downscale_plugin.__main__ import main as plugin_main

        with contextlib.redirect_stdout(out):
            code = plugin_main(argv)
    except (ImportError, SystemExit) as err:
        return {"error": repr(err), "argv": argv}
    text = out.getvalue()
    found = re.search(r"routed ([\d.]+) % of steps, tokens saved ([\d.]+) %", text)
    if code != 0 or found is None:
        return {"error": f"exit {code}", "argv": argv, "text": text[-2000:]}
    return {"argv": argv, "routed": float(found[1]) / 100, "token_saving": float(found[2]) / 100, "text": text}


def measured(steps: list, run) -> dict:
    from downscale_plugin.arch import get_arch
    from downscale_plugin.grid import tokens

    spec = get_arch(run.arch)
    routed = [s for s in steps if s["rule"] >= 0]
    run_tokens = sum(tokens(tuple(s["run_hw"]), spec) for s in steps)
    native_tokens = sum(tokens(tuple(s["native_hw"]), spec) for s in steps)
    shares = {str(i): sum(s["rule"] == i for s in steps) / len(steps) for i in [*range(len(run.cfg.routes)), -1]}
    return {"routed": len(routed) / len(steps), "probs": shares, "token_saving": 1.0 - run_tokens / native_tokens,
            "totals_token_saving": run.totals.token_saving(), "flop_saving": run.totals.flop_saving()}  # fmt: skip


def first_match(sigma: float, routes) -> int:
    for i, rule in enumerate(routes):
        if sigma > rule.sigma_min and (rule.sigma_max is None or sigma < rule.sigma_max):
            return i
    return -1


def check_grids(steps: list, frames: int, arch: str, inputs: list | None = None) -> None:
    """Each forward ran the DiT at its step's grid: Wan's patch embedding sees (1, 16, F, h, w) per sample, F the
    clip's latent frames; Qwen-Image's img_in sees (B, h/2 · w/2, 64) packed tokens. ``inputs``: the patch embedding's
    inputs (default: this process's ``DIT_INPUTS``)."""
    inputs = [tuple(shape) for shape in (DIT_INPUTS if inputs is None else inputs)]
    expected = []
    for s in steps:
        h, w = s["run_hw"]
        batch = len(s["sigmas"])
        expected += [(1, 16, frames, h, w)] * batch if arch == "wan" else [(batch, (h // 2) * (w // 2), 64)]
        assert (s["rule"] >= 0) == (s["run_hw"] != s["native_hw"]), s
    assert len(inputs) == len(expected), (len(inputs), len(expected))
    wrong = [(i, seen, want) for i, (seen, want) in enumerate(zip(inputs, expected, strict=True)) if seen != want]
    assert not wrong, wrong[:5]


def check_lora(lora: Path, setup: dict) -> dict:
    """The saved LoRA loads with musubi-tuner's own module: create_arch_network_from_weights + merge_to (the generate
    scripts' merge) gives the weights the loader's own merge-at-load (lora_weights_list) gives, and they moved."""
    import importlib

    from safetensors.torch import load_file

    module = importlib.import_module(setup["inner"])  # musubi-tuner's, on sys.path since _build_network
    weights = load_file(str(lora))
    base = setup["load_dit"]()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    network = module.create_arch_network_from_weights(1.0, weights, unet=base, for_inference=True)
    network.merge_to(None, base, weights, dtype=torch.float32, device="cpu")
    merged = base.state_dict()
    at_load = setup["load_dit"](weights).state_dict()
    moved = [k for k in merged if not torch.equal(merged[k], before[k])]
    # Qwen-Image's last block's text-stream outputs never reach the loss: those LoRA modules keep their zero lora_up
    trained_modules = sum(bool(v.any()) for k, v in weights.items() if k.endswith("lora_up.weight"))
    assert len(moved) == trained_modules > 0, (len(moved), trained_modules, len(network.unet_loras))
    assert all(torch.allclose(merged[k], at_load[k].float(), atol=1e-5) for k in merged), "merge_to and merge-at-load differ"
    return {"tensors": len(weights), "modules": len(network.unet_loras), "trained": trained_modules, "merged": len(moved)}


def check_experts(steps: list, experts: dict, weights: list | None = None) -> None:
    """Wan 2.2: each forward ran the expert its own σ names against timestep_boundary (the host's t = 1000·σ + 1),
    a routed one included (the plugin replays σ and sets the trainer's next-expert flag from it)."""
    for step, weight in zip(steps, DIT_WEIGHTS if weights is None else weights, strict=True):
        t = step["sigmas"][0] * 1000.0 + 1.0
        assert weight in (experts["low"], experts["high"]), weight
        step["expert"] = "high" if weight == experts["high"] else "low"
        if abs(t / 1000.0 - experts["boundary"]) > 1e-4:
            assert step["expert"] == ("high" if t / 1000.0 >= experts["boundary"] else "low"), step


def main(name: str, work: Path, *train_argv: str) -> None:
    arch = ARCHS[name]
    processes = int(os.environ.get("E2E_PROCESSES", 2 if name == "wan_ranks" else 1))
    if processes > 1 and name not in MULTI:
        raise SystemExit(f"E2E_PROCESSES={processes}: a multi-process launch runs {sorted(MULTI)} only, not {name}")
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    setup = SETUPS[name](work, Path(os.environ["HF_HUB_CACHE"]))
    for script, argv in setup["caches"]:
        run_script(script, argv)
    cached = sorted(p.name for folder in setup["cache_dirs"] for p in folder.iterdir())
    assert len(cached) == 2 * setup["items"], cached  # one latent and one text-encoder cache per item
    if processes > 1:
        return main_ranks(name, work, setup, processes, train_argv)
    DIT_INPUTS.clear()
    DIT_WEIGHTS.clear()
    DIT_TIMESTEPS.clear()
    steps, runs = recorder()
    run_script(setup["train"], ["--config_file", str(setup["config"]), *train_argv])
    assert len(runs) == 1, runs
    run = runs[0]
    forwards = STEPS * int(run.accelerator.gradient_accumulation_steps)
    assert len(steps) == forwards, (len(steps), forwards)

    check_grids(steps, setup["frames"], arch)
    if setup["experts"] is not None:
        check_experts(steps, setup["experts"])
    # the coupled gate: every sample's σ lies in its step's category (the first window holding it), unless the step fell back
    assert all(first_match(x, run.cfg.routes) == s["rule"] for s in steps if s["fallback"] != "other" for x in s["sigmas"])
    lora = work / "out" / "lora.safetensors"
    from safetensors import safe_open

    with safe_open(str(lora), "pt") as f:
        meta = {k: v for k, v in (f.metadata() or {}).items() if k.startswith("ss_")}
    counts = json.loads(meta["ss_downscale_counts"])
    assert meta["ss_network_module"] == "downscale_plugin" and meta["ss_downscale_inner"] == setup["inner"], meta
    assert meta["ss_downscale_arch"] == arch, meta
    assert counts["forwards"] == forwards or "--resume" in train_argv, meta  # a resumed run's add the saved run's (the caller checks)
    loaded = check_lora(lora, setup)
    record = {
        "arch": arch,
        "setup": name,
        "experts": setup["experts"],
        "steps": steps,
        "dit_inputs": DIT_INPUTS,
        "frames": setup["frames"],
        "metadata": {k: v for k, v in meta.items() if k.startswith("ss_downscale")},
        "measured": measured(steps, run),
        "plan": plan_figures(run.plan, steps),
        "plan_exact": exact_plan(run, steps, **SAMPLING[arch]),
        "plan_cli": cli_plan(setup, steps, arch),
        "lora": loaded,
        "resume_offset": run.router.resume_offset,
        "counts": counts,
    }
    (work / "record.json").write_text(json.dumps(record, indent=1))
    m, p, e = record["measured"], record["plan"]["given_buckets"], record["plan_exact"]["given_buckets"]
    c = record["plan_cli"]
    print("plan --host musubi:", f"routed {c['routed']:.3f}, token saving {c['token_saving']:.3f}" if "error" not in c else c)
    print(
        f"{name}: {forwards} forwards; routed {m['routed']:.3f} (plan {p['routed']:.3f} ± {p['routed_sd']:.3f}, exact law "
        f"{e['routed']:.3f}); token saving {m['token_saving']:.3f} (plan {p['token_saving']:.3f} ± {p['token_saving_sd']:.3f}, "
        f"exact law {e['token_saving']:.3f}); LoRA {loaded}"
    )
    print("E2E OK")


# ---- several processes -----------------------------------------------------------------------------------------------

LAUNCH_TIMEOUT = int(os.environ.get("E2E_LAUNCH_TIMEOUT", 420))  # s; a hung collective ends the launch here


def main_ranks(name: str, work: Path, setup: dict, processes: int, train_argv: Sequence[str]) -> None:
    """Launch the training script as ``processes`` CPU ranks (each ``--rank`` below), then check and record what each
    rank recorded, the saved LoRA and what each rank printed (``record.json``: ``ranks``, one entry per rank)."""
    ranks = launch_ranks(__file__, work, processes, [name, str(work), *train_argv], LAUNCH_TIMEOUT)
    arch = ARCHS[name]
    for r, rank in enumerate(ranks):
        assert len(rank["steps"]) == rank["forwards"], (r, len(rank["steps"]), rank["forwards"])
        check_grids(rank["steps"], setup["frames"], arch, rank["dit_inputs"])
        if setup["experts"] is not None:
            check_experts(rank["steps"], setup["experts"], rank["dit_weights"])
    from safetensors import safe_open
    from safetensors.torch import load_file

    lora = work / "out" / "lora.safetensors"
    with safe_open(str(lora), "pt") as f:
        meta = {k: v for k, v in (f.metadata() or {}).items() if k.startswith("ss_")}
    counts = json.loads(meta["ss_downscale_counts"])
    forwards = sum(rank["forwards"] for rank in ranks)
    assert meta["ss_network_module"] == "downscale_plugin" and meta["ss_downscale_inner"] == setup["inner"], meta
    assert meta["ss_downscale_arch"] == arch, meta
    assert counts["forwards"] == forwards or "--resume" in train_argv, (counts, forwards)  # a resumed run's add the saved run's
    saved = {k: float(v.double().sum()) for k, v in load_file(str(lora)).items()}
    import musubi_tuner

    sys.path.append(os.path.dirname(musubi_tuner.__file__))  # its networks package, as the trainer's _build_network has it
    record = {
        "arch": arch, "setup": name, "processes": processes, "frames": setup["frames"], "experts": setup["experts"],
        "ranks": ranks, "metadata": {k: v for k, v in meta.items() if k.startswith("ss_downscale")},
        "saved_sums": saved, "outputs": sorted(p.name for p in (work / "out").iterdir()), "lora": check_lora(lora, setup),
    }  # fmt: skip
    (work / "record.json").write_text(json.dumps(record, indent=1))
    disagreed = ranks[0]["totals"]["disagreed"]
    print(f"{name}: {processes} processes × {ranks[0]['forwards']} forwards; ranks disagreed on {disagreed:.0f}; LoRA {record['lora']}")
    print("E2E OK")


def rank_main(name: str, work: Path, *train_argv: str) -> None:
    """One rank of ``main_ranks``' launch: the loaders' shrinks and the recorders (nothing written but this rank's
    files), the training script with this rank's own ``--seed``, and ``WORK/rank{R}.json``; its output goes to
    ``WORK/rank{R}.log``."""
    rank = int(os.environ["RANK"])
    log = open(work / f"rank{rank}.log", "w", buffering=1)  # noqa: SIM115 (the process's stdout and stderr until it exits)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    torch.set_num_threads(1)
    setup = SETUPS[name](work, Path(os.environ["HF_HUB_CACHE"]), write=False)
    frozen_modules_unwrapped()
    seen: dict = {}
    steps, runs = recorder(seen)
    run_script(setup["train"], ["--config_file", str(setup["config"]), "--seed", str(RANKS["seed"] + rank), *train_argv])
    assert len(runs) == 1 and len(seen["networks"]) == 1, (runs, seen)
    run, network = runs[0], seen["networks"][0]
    plan = plan_figures(run.plan, steps)["buckets"] if run.plan is not None else None  # the main process's only
    local, totals = run.accounting, run.totals
    record = {
        "rank": run.rank, "world_size": run.world_size, "own_seed": RANKS["seed"] + rank, "seed": run.seed,
        "backend": seen["backend"], "distributed_type": str(run.accelerator.distributed_type),
        "forwards": STEPS * int(run.accelerator.gradient_accumulation_steps), "resume_offset": run.router.resume_offset,
        "routes": [r.label for r in run.cfg.routes], "sigma_windows": [[r.sigma_min, r.sigma_max] for r in run.cfg.routes],
        "steps": steps, "dit_inputs": DIT_INPUTS, "dit_weights": DIT_WEIGHTS, "dit_timesteps": DIT_TIMESTEPS,
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
    ranked = sys.argv[1] == "--rank"  # a rank of main_ranks' launch: --rank NAME WORK [TRAINING ARGS...]
    if ranked:
        del sys.argv[1]
    work_dir = Path(sys.argv[2]).resolve()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["HF_HUB_CACHE"] = str(work_dir / "hub")  # read when huggingface_hub is first imported (below)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if os.environ.get("MUSUBI_DIR"):
        sys.path.insert(0, os.path.join(os.environ["MUSUBI_DIR"], "src"))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sd_scripts_e2e's tokenizer helper
    (rank_main if ranked else main)(sys.argv[1], work_dir, *sys.argv[3:])
