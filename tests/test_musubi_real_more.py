"""The plugin inside more real musubi-tuner trainers: FLUX.2, Z-Image, HunyuanVideo 1.0 and 1.5 (skipped unless ``MUSUBI_DIR`` is set).

As tests/test_musubi_real.py does for Wan and Qwen-Image: tiny DiTs built from musubi-tuner's own classes
(``Flux2``, ``ZImageTransformer2DModel``, ``HYVideoDiffusionTransformer``, ``HunyuanVideo_1_5_DiffusionTransformer``;
only the sizes shrunk, no checkpoint) go through the real trainers' ``_build_network`` with ``--network_module
downscale_plugin`` (the real ``networks.lora_flux_2`` / ``networks.lora_zimage`` / ``networks.lora`` /
``networks.lora_hv_1_5`` auto-detected), then step by step as ``_run_training_loop`` does, the real
``process_batch`` → sampler → ``call_dit`` → ``compute_loss``. Checked: routed steps run the DiT's patch embedding
at the small grid (HunyuanVideo 1.0 and 1.5: F kept, RoPE built for the small grid), on the noisy input the
router's σ (inside the route's window) makes of the small latents; a run whose routes never fire is bitwise the
plain inner network's run; the family's dry draw is the σ the host draws next and leaves torch's and Python's RNG
and the timestep-bucket pool as the host's own draw would.
HunyuanVideo's ``get_cu_seqlens`` allocates on "cuda" (only flash attention reads it): a CPU copy stands in.
``HunyuanVideo_1_5_DiffusionTransformer.__init__`` takes no widths (it hard-codes the 8.3 B model's): it is built
with its building blocks called at tiny widths for the duration of the construction (``_tiny_hv15``). Its batches
are text-to-video ones, without ``latents_image`` (its ``call_dit`` concatenates them whenever present, and the
plugin refuses such batches), so ``call_dit`` concatenates its zero conditioning at the latents' own grid.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import toml
import torch
from test_musubi_real import MUSUBI_DIR, NEVER, Setup, musubi  # noqa: F401  (musubi: the fixture)

pytestmark = pytest.mark.skipif(not MUSUBI_DIR, reason="MUSUBI_DIR (a musubi-tuner checkout) is not set")

INNER = {
    "flux_2": "networks.lora_flux_2",
    "z_image": "networks.lora_zimage",
    "hunyuan_video": "networks.lora",
    "hunyuan_video_1_5": "networks.lora_hv_1_5",
}
ARGV = {
    "flux_2": ("--timestep_sampling", "flux2_shift"),
    "z_image": ("--timestep_sampling", "shift", "--discrete_flow_shift", "3"),
    "hunyuan_video": ("--timestep_sampling", "shift", "--discrete_flow_shift", "3"),
    # musubi-tuner's docs/hunyuan_video_1_5.md suggests shift 2; its handle_model_specific_args would default dit_dtype to bf16
    "hunyuan_video_1_5": ("--timestep_sampling", "shift", "--discrete_flow_shift", "2", "--dit_dtype", "float32"),
}
LATENTS = {  # FLUX.2's already at 1/16; HunyuanVideo 1.5's VAE has 32 channels
    "flux_2": (2, 16, 8, 8),
    "z_image": (2, 16, 8, 8),
    "hunyuan_video": (2, 16, 2, 8, 8),
    "hunyuan_video_1_5": (2, 32, 2, 8, 8),
}
# the patch embedding's input: FLUX.2 packs B,C,H,W to B,HW,C; Z-Image patchifies 2×2 to B,HW/4,4C; HunyuanVideo's
# PatchEmbed takes B,C,F,H,W (F = 2 latent frames kept); HunyuanVideo 1.5's takes the noisy latents and the t2v zero
# conditioning (32 latent channels + 1 mask channel) concatenated on C, at the latents' grid
NATIVE = {"flux_2": (2, 64, 16), "z_image": (2, 16, 64), "hunyuan_video": (2, 16, 2, 8, 8), "hunyuan_video_1_5": (2, 65, 2, 8, 8)}
SMALL = {"flux_2": (2, 16, 16), "z_image": (2, 4, 64), "hunyuan_video": (2, 16, 2, 4, 4), "hunyuan_video_1_5": (2, 65, 2, 4, 4)}
TRAINERS = {  # arch: (the parser setup and the trainer class of its training script)
    "flux_2": ("flux2_setup_parser", "Flux2NetworkTrainer"),
    "z_image": ("zimage_setup_parser", "ZImageNetworkTrainer"),
    "hunyuan_video": ("hv_setup_parser", "HunyuanVideoNetworkTrainer"),
    "hunyuan_video_1_5": ("hv1_5_setup_parser", "HunyuanVideo15NetworkTrainer"),
}
# HunyuanVideo 1.5's __init__ passes its hard-coded widths to its building blocks: hidden 2048, Qwen2.5-VL text 3584,
# ByT5 1472, SigLIP 1152, 16 heads. Each block class it builds gets these int arguments shrunk (head dim 32 / 2 = 16).
HV15_SIZES = {2048: 32, 3584: 32, 1472: 16, 1152: 16, 16: 2}
HV15_BLOCKS = "ByT5Mapper PatchEmbed VisionProjection SingleTokenRefiner TimestepEmbedder MMDoubleStreamBlock FinalLayer".split()


def _cpu_cu_seqlens(text_mask: torch.Tensor, img_len: int) -> torch.Tensor:
    """``hunyuan_model.attention.get_cu_seqlens`` on the mask's device (it allocates on "cuda"; only flash attention reads it)."""
    batch, text_len, max_len = text_mask.shape[0], text_mask.sum(dim=1), text_mask.shape[1] + img_len
    cu = torch.zeros([2 * batch + 1], dtype=torch.int32, device=text_mask.device)
    for i in range(batch):
        cu[2 * i + 1] = i * max_len + text_len[i] + img_len
        cu[2 * i + 2] = (i + 1) * max_len
    return cu


def _tiny_hv15(models) -> torch.nn.Module:
    """musubi-tuner's ``HunyuanVideo_1_5_DiffusionTransformer`` (t2v, torch attention) at tiny widths: built by its own
    ``__init__`` with the block classes of ``hunyuan_video_1_5_models`` called on ``HV15_SIZES``-shrunk widths for the
    duration of the construction; then what ``__init__`` sizes itself is matched: its 54 double blocks cut to 1, its
    ``cond_type_embedding`` (an ``nn.Embedding(3, 2048)``) rebuilt at 32, RoPE's axis dims (16, 56, 56) to the head dim 16."""
    real = {name: getattr(models, name) for name in HV15_BLOCKS}

    def size(value):
        return HV15_SIZES.get(value, value) if type(value) is int else value

    def tiny(cls):
        def build(*args, **kwargs):
            return cls(*map(size, args), **{k: size(v) for k, v in kwargs.items()})

        return build

    for name, cls in real.items():
        setattr(models, name, tiny(cls))
    try:
        model = models.HunyuanVideo_1_5_DiffusionTransformer(task_type="t2v", attn_mode="torch")
    finally:
        for name, cls in real.items():
            setattr(models, name, cls)
    del model.double_blocks[1:]
    model.num_double_blocks = 1
    model.cond_type_embedding = torch.nn.Embedding(3, 32)
    model.hidden_size, model.heads_num, model.rope_dim_list = 32, 2, [4, 6, 6]
    assert sum(p.numel() for p in model.parameters()) < 200_000  # nothing left at the full widths
    return model


@pytest.fixture(scope="module")
def hosts(musubi):  # noqa: F811
    """The FLUX.2, Z-Image, HunyuanVideo 1.0 and 1.5 trainer modules and DiT classes (1.5's models module), from the ``musubi`` checkout."""
    from musubi_tuner import flux_2_train_network, hv_1_5_train_network, hv_train_network, zimage_train_network
    from musubi_tuner.flux_2.flux2_models import Flux2, Flux2Params
    from musubi_tuner.hunyuan_model import models as hv_models
    from musubi_tuner.hunyuan_video_1_5 import hunyuan_video_1_5_models as hv15_models
    from musubi_tuner.zimage.zimage_model import ZImageTransformer2DModel

    cu_seqlens = hv_models.get_cu_seqlens
    hv_models.get_cu_seqlens = _cpu_cu_seqlens
    yield dict(musubi, flux_2=flux_2_train_network, z_image=zimage_train_network, hunyuan_video=hv_train_network,
               hunyuan_video_1_5=hv_1_5_train_network, Flux2=Flux2, Flux2Params=Flux2Params, ZImage=ZImageTransformer2DModel,
               HunyuanVideo=hv_models.HYVideoDiffusionTransformer, hv15_models=hv15_models)  # fmt: skip
    hv_models.get_cu_seqlens = cu_seqlens


class TinySetup(Setup):
    """``Setup`` of tests/test_musubi_real.py for FLUX.2, Z-Image, HunyuanVideo 1.0, 1.5: the same trainer, network and loop, tiny DiTs."""

    def __init__(self, m: dict, arch: str, tmp_path, *argv: str, module: str = "downscale_plugin", network_args: tuple[str, ...] = ()):
        self.m, self.arch = m, arch
        host = m[arch]
        setup_parser, trainer_class = TRAINERS[arch]
        parser = getattr(host, setup_parser)(m["parser"]())
        dit = str(tmp_path / "dit.safetensors")
        common = ["--dit", dit, "--dataset_config", "unused", "--network_module", module, "--network_dim", "4", "--sdpa"]
        extra = ["--network_args", *network_args] if network_args else []
        self.args = parser.parse_args([*common, "--mixed_precision", "no", "--seed", "1", *extra, *argv])
        torch.manual_seed(0)
        self.model = self._model(dit)
        self.trainer = getattr(host, trainer_class)()
        self.trainer.handle_model_specific_args(self.args)
        self.trainer.blocks_to_swap = 0
        self.trainer.num_timestep_buckets = self.args.num_timestep_buckets
        self._train_parts()
        embed = self.model.all_x_embedder["2-1"] if arch == "z_image" else self.model.img_in
        embed.register_forward_hook(lambda mod, i, o: self.inputs.append(tuple(i[0].shape)))
        self.ropes: list[tuple[tuple[int, ...], int]] = []  # HunyuanVideo 1.5: (F, H, W) of each RoPE built, its tokens
        if arch == "hunyuan_video_1_5":  # its call_dit passes no rotary_pos_emb_cache: forward builds RoPE per call
            rope = self.model.get_rotary_pos_embed

            def recording_rope(sizes):
                cos, sin = rope(sizes)
                self.ropes.append((tuple(sizes), cos.shape[0]))
                return cos, sin

            self.model.get_rotary_pos_embed = recording_rope
        self.calls: list[tuple[torch.Tensor, ...]] = []  # call_dit's (latents, noise, noisy_model_input, timesteps)
        call_dit = self.trainer.call_dit

        def recording(args, accelerator, transformer, latents, batch, noise, noisy, timesteps, *rest, **kwargs):
            self.calls.append((latents.detach().clone(), noise.clone(), noisy.detach().clone(), timesteps.clone()))
            return call_dit(args, accelerator, transformer, latents, batch, noise, noisy, timesteps, *rest, **kwargs)

        self.trainer.call_dit = recording

    def _model(self, dit: str):
        from safetensors.torch import save_file

        if self.arch == "flux_2":
            params = self.m["Flux2Params"](
                in_channels=16, context_in_dim=32, hidden_size=32, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[4, 4, 4, 4]
            )
            model = self.m["Flux2"](params, attn_mode="torch")
        elif self.arch == "hunyuan_video_1_5":
            model = _tiny_hv15(self.m["hv15_models"])
        elif self.arch == "hunyuan_video":
            model = self.m["HunyuanVideo"](
                text_states_dim=32, text_states_dim_2=16, in_channels=16, hidden_size=48, heads_num=2, mm_double_blocks_depth=1,
                mm_single_blocks_depth=1, rope_dim_list=[8, 8, 8], attn_mode="torch",
            )  # fmt: skip
        else:
            model = self.m["ZImage"](
                dim=32, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[4, 6, 6], attn_mode="torch"
            )
        with torch.no_grad():  # a zero-initialised output layer would leave the LoRA without gradient; Z-Image's
            for name, p in model.named_parameters():  # pad tokens are torch.empty (a checkpoint fills them)
                if name in ("x_pad_token", "cap_pad_token") or not p.any():
                    p.normal_(std=0.05)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, dit)
        return model.requires_grad_(False)

    def batch(self, gen: torch.Generator) -> dict:
        latents = torch.randn(*LATENTS[self.arch], generator=gen)
        if self.arch == "flux_2":
            return {"latents": latents, "ctx_vec": torch.randn(2, 5, 32, generator=gen), "timesteps": None}
        if self.arch == "hunyuan_video":
            mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
            llm = torch.randn(2, 5, 32, generator=gen) * mask[..., None]
            return {"latents": latents, "llm": llm, "llm_mask": mask, "clipL": torch.randn(2, 16, generator=gen), "timesteps": None}
        if self.arch == "hunyuan_video_1_5":  # t2v: Qwen2.5-VL and ByT5 embeddings of two lengths, no latents_image, no siglip
            vl = [torch.randn(5, 32, generator=gen), torch.randn(3, 32, generator=gen)]
            byt5 = [torch.randn(4, 16, generator=gen), torch.randn(2, 16, generator=gen)]
            return {"latents": latents, "vl_embed": vl, "byt5_embed": byt5, "timesteps": None}
        return {"latents": latents, "llm_embed": [torch.randn(5, 32, generator=gen), torch.randn(3, 32, generator=gen)], "timesteps": None}


@pytest.mark.parametrize("arch", list(ARGV))
@pytest.mark.parametrize("gate", ["strict", "coupled"])
def test_routed_steps_run_the_real_dit_at_the_small_grid_with_the_routers_sigma(hosts, arch, gate, tmp_path):
    setup = TinySetup(hosts, arch, tmp_path, *ARGV[arch], network_args=("ds_routes=x0.5@0.6-", f"ds_gate={gate}"))
    run = setup.network.downscale_run
    assert run.inner == INNER[arch] and run.arch == arch
    decisions = []
    step = setup.trainer.process_batch

    def recording(*args, **kwargs):
        out = step(*args, **kwargs)
        decisions.append(run.hook.last)
        return out

    setup.trainer.process_batch = recording
    losses = setup.steps(8)
    assert all(torch.isfinite(torch.tensor(losses)))
    routed = [d.routed for d in decisions]
    assert any(routed) and not all(routed), routed
    for decision, shape, (latents, noise, noisy, timesteps) in zip(decisions, setup.inputs, setup.calls, strict=True):
        assert shape == (SMALL if decision.routed else NATIVE)[arch]
        assert tuple(latents.shape) == (LATENTS[arch][:-2] + ((4, 4) if decision.routed else (8, 8))) == tuple(noisy.shape)
        sigma = ((timesteps.double() - 1) / 1000).view(-1, *[1] * (latents.ndim - 1))  # the flow branch's timesteps = 1000·σ + 1
        assert torch.allclose(noisy.double(), (1 - sigma) * latents.double() + sigma * noise.double(), atol=1e-5)
        if decision.routed:  # the router's σ, inside the route's window, made the small grid's noisy input
            assert torch.allclose(sigma.view(-1), decision.sigmas.double().view(-1), atol=1e-6)
            assert bool((sigma >= 0.6 - 1e-6).all())
    assert run.totals.total_steps == 8
    if arch == "hunyuan_video":  # its call_dit builds RoPE per latents.shape[1:]: the small grid's were built and used
        assert set(setup.trainer.pos_embed_cache) == {torch.Size((16, 2, 8, 8)), torch.Size((16, 2, 4, 4))}
    if arch == "hunyuan_video_1_5":  # its forward builds RoPE from each call's latent shape: the small grid's on routed steps
        assert setup.ropes == [((2, 4, 4), 32) if d.routed else ((2, 8, 8), 128) for d in decisions]


@pytest.mark.parametrize("arch", list(ARGV))
def test_a_run_whose_routes_never_fire_is_bitwise_the_real_hosts(hosts, arch, tmp_path):
    plain = TinySetup(hosts, arch, tmp_path, *ARGV[arch], module=INNER[arch])
    plugin = TinySetup(hosts, arch, tmp_path, *ARGV[arch], network_args=(NEVER,))
    start = {k: v.clone() for k, v in plain.network.state_dict().items()}
    assert plugin.steps(3) == plain.steps(3)
    assert plugin.inputs == plain.inputs == [NATIVE[arch]] * 3
    mine, theirs = plugin.network.state_dict(), plain.network.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert any(not torch.equal(theirs[k], start[k]) for k in theirs)  # the LoRA trained: the equality is not of two idle runs
    assert plugin.network.downscale_run.totals.total_steps == 3


POOL = ("--num_timestep_buckets", "3", "--preserve_distribution_shape", "--min_timestep", "100")  # pops the bucket pool


@pytest.mark.parametrize("arch", list(ARGV))
@pytest.mark.parametrize("extra", [(), POOL, ("--timestep_sampling", "sigma")], ids=["flow", "bucket_pool", "sigma_grid"])
def test_the_dry_draw_is_the_hosts_next_draw_and_leaves_its_state(hosts, arch, extra, tmp_path):
    """The family's first dry draw is the σ the trainer's sampler draws next (latents 0, noise 1: its noisy input
    is σ); run as the router runs it (RNG forked), it and further candidate draws leave torch's and Python's RNG
    and the trainer's timestep-bucket pool as they were, so the host's next draws are those of a run without it;
    unforked, it consumes the RNG exactly as the host's own draw does and still leaves the pool as it was."""
    import random

    from downscale_plugin.hosts.musubi.facts import BY_ARCH
    from downscale_plugin.hosts.musubi.family import MusubiFamily
    from downscale_plugin.rng import forked

    setup = TinySetup(hosts, arch, tmp_path, *ARGV[arch], *extra, network_args=(NEVER,))
    trainer = setup.trainer
    family = MusubiFamily(trainer, BY_ARCH[arch])
    latents = torch.randn(*LATENTS[arch])  # (the μ-shift of flux2_shift reads its h·w)

    def host_sigma() -> torch.Tensor:
        noisy, _ = trainer.get_noisy_model_input_and_timesteps(
            setup.args, torch.ones_like(latents), torch.zeros_like(latents), None, setup.scheduler, "cpu", torch.float32
        )
        return noisy.reshape(noisy.shape[0], -1)[:, 0].double()

    def snapshot():
        return torch.get_rng_state(), random.getstate(), list(trainer.timestep_range_pool)

    def restore(state) -> None:
        torch.set_rng_state(state[0])
        random.setstate(state[1])
        trainer.timestep_range_pool = list(state[2])

    def same(a, b) -> bool:
        return torch.equal(a[0], b[0]) and a[1] == b[1] and a[2] == b[2]

    torch.manual_seed(11)
    random.seed(11)
    host_sigma()  # a first host draw (with the bucket pool: fills it, then pops)
    before = snapshot()
    assert (extra == POOL) == bool(before[2])  # the pool is in play
    reference = [host_sigma(), host_sigma()]  # the host's next two draws, no dry run
    after_host = snapshot()
    restore(before)
    with forked():
        bound = family.bind(setup.args, setup.scheduler, latents, "cpu", torch.float32)
        dry = bound.first()
        bound.draw(16)
    assert same(snapshot(), before) and torch.equal(dry, reference[0])
    assert torch.equal(host_sigma(), reference[0]) and torch.equal(host_sigma(), reference[1])
    assert same(snapshot(), after_host)
    restore(before)
    family.bind(setup.args, setup.scheduler, latents, "cpu", torch.float32).first()  # unforked
    dry_left = snapshot()
    restore(before)
    host_sigma()
    host_left = snapshot()
    assert torch.equal(dry_left[0], host_left[0]) and dry_left[1] == host_left[1] and dry_left[2] == before[2]


# every musubi-tuner example config: (its training script's module key in ``hosts``, the script's parser setup)
EXAMPLES = {
    "musubi_flux2": ("flux_2", "flux2_setup_parser"),
    "musubi_zimage": ("z_image", "zimage_setup_parser"),
    "musubi_hunyuan_video": ("hunyuan_video", "hv_setup_parser"),
    "musubi_hunyuan_video_1_5": ("hunyuan_video_1_5", "hv1_5_setup_parser"),
    "musubi_qwen_image": ("qwen", "qwen_image_setup_parser"),
    "musubi_wan21_auto": ("wan", "wan_setup_parser"),
    "musubi_wan22_high_noise": ("wan", "wan_setup_parser"),
}


def test_every_musubi_example_config_is_listed():
    assert set(EXAMPLES) == {p.stem for p in (Path(__file__).parent.parent / "example_configs").glob("musubi_*.toml")}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_musubi_example_config_reaches_the_plugin_through_its_scripts_own_parser_and_toml_reader(hosts, name, monkeypatch):
    """Every key of the TOML is an option of the script's own parser (common + its arch's; its reader would take
    any name silently), and ``[plugins.downscale]`` arrives as ``args.downscale``, read by the plugin exactly as
    the plugin's own reader reads the file."""
    from downscale_plugin.hosts.kohya.conventions import config_from_training_toml, flatten_training_toml, plugin_config

    module_key, setup = EXAMPLES[name]
    module = hosts[module_key]
    parser = getattr(module, setup)(hosts["parser"]())
    path = Path(__file__).parent.parent / "example_configs" / f"{name}.toml"
    monkeypatch.setattr(sys, "argv", [f"{module.__name__.rpartition('.')[2]}.py", "--config_file", str(path)])
    options = {action.dest for action in parser._actions}
    unknown = set(flatten_training_toml(toml.load(path))) - options - {"downscale"}
    assert not unknown, f"{name}: not options of {module.__name__}: {sorted(unknown)}"
    args = module.read_config_from_file(parser.parse_args(), parser)
    assert args.network_module == "downscale_plugin" and isinstance(args.downscale, dict)
    expected, _ = config_from_training_toml(str(path))
    assert plugin_config({}, args) == expected and (expected.routes or expected.mode == "auto")
