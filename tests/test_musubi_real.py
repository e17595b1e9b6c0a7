"""The plugin inside the real musubi-tuner trainers (skipped unless ``MUSUBI_DIR`` points at a checkout, main 30c658c4).

Tiny Wan and Qwen-Image DiTs built from musubi-tuner's own classes (``WanModel``,
``QwenImageTransformer2DModel``) go through the real trainers' ``_build_network`` (``--network_module
downscale_plugin``, the real ``networks.lora_wan`` / ``networks.lora_qwen_image`` auto-detected) and
then, step by step as ``_run_training_loop`` does (``scale_shift_latents``, ``torch.randn_like``, then
``process_batch``, backward, optimizer step), the real ``process_batch`` → sampler → ``call_dit`` →
``compute_loss``. Checked: routed steps run the DiT at the small grid with F unchanged; a run whose
routes never fire is bitwise the plain inner network's run; Wan 2.2's two experts each run on the
expert their σ names; the family's dry draw and exact laws are the real sampler's; the example config
reaches the plugin through musubi-tuner's TOML reader. And the whole ``NetworkTrainer.train`` of
Qwen-Image on items written by musubi-tuner's own cache writers (only the DiT loader replaced):
routing, the saved LoRA's metadata and loading, and the counts across ``--save_state``/``--resume``;
and Wan's whole ``NetworkTrainer.train`` on clips cached by its own writers: video routed at the small
grid with every frame, and ``mode = "auto"`` certifying in the run and routing by its windows (and,
when it opens nothing, the run bitwise the plain ``networks.lora_wan`` run's). And the drift self-check: a μ line of
musubi-tuner's that moved stops the run at ``prepare_network``; a routed step follows a changed noisy input of its
flow branch (``hosts/musubi/selfcheck.py``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from host_copies import host_copy, startup_env

MUSUBI_DIR = os.environ.get("MUSUBI_DIR")
pytestmark = pytest.mark.skipif(not MUSUBI_DIR, reason="MUSUBI_DIR (a musubi-tuner checkout) is not set")

HERE = Path(__file__).parent
ROUTED = "ds_routes=x0.5@0.0-"
NEVER = "ds_routes=1024:768@0.0-"  # no bucket of these runs is in the 1024 px tier


def _host_names() -> list[str]:
    return [n for n in sys.modules if n.split(".")[0] in ("networks", "musubi_tuner")]


@pytest.fixture(scope="module")
def musubi() -> Iterator[dict]:
    """musubi-tuner's trainer modules, imported from ``$MUSUBI_DIR/src`` (``networks`` as musubi-tuner resolves it).

    ``wan/modules/t5.py`` evaluates ``torch.cuda.current_device()`` as a default argument at import, which
    fails on a machine without a GPU; every caller passes ``device=``, so the import runs with it stubbed."""
    saved = {n: sys.modules.pop(n) for n in _host_names()}
    src = os.path.join(MUSUBI_DIR, "src")
    sys.path.insert(0, src)
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0
    try:
        from musubi_tuner import qwen_image_train_network, wan_train_network
        from musubi_tuner.dataset import cache_io
        from musubi_tuner.dataset.image_video_dataset import ItemInfo
        from musubi_tuner.modules.scheduling_flow_match_discrete import FlowMatchDiscreteScheduler
        from musubi_tuner.qwen_image import qwen_image_utils
        from musubi_tuner.qwen_image.qwen_image_model import QwenImageTransformer2DModel
        from musubi_tuner.training.accelerator_setup import prepare_accelerator
        from musubi_tuner.training.parser_common import setup_parser_common
        from musubi_tuner.wan.modules.model import WanModel
    finally:
        torch.cuda.current_device = current_device
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield dict(
        wan=wan_train_network, qwen=qwen_image_train_network, qwen_utils=qwen_image_utils, WanModel=WanModel,
        QwenModel=QwenImageTransformer2DModel, Scheduler=FlowMatchDiscreteScheduler, accelerator=prepare_accelerator,
        parser=setup_parser_common, cache_io=cache_io, ItemInfo=ItemInfo,
    )  # fmt: skip
    torch.set_num_threads(threads)
    for name in _host_names():
        del sys.modules[name]
    sys.modules.update(saved)
    sys.path.remove(src)


class Setup:
    """One real trainer with a tiny DiT and its network built by ``_build_network``, driven the loop's way."""

    def __init__(self, m: dict, arch: str, tmp_path, *argv: str, module: str = "downscale_plugin", network_args: tuple[str, ...] = ()):
        self.m, self.arch = m, arch
        host = m["wan"] if arch == "wan" else m["qwen"]
        parser = (host.wan_setup_parser if arch == "wan" else host.qwen_image_setup_parser)(m["parser"]())
        dit = str(tmp_path / "dit.safetensors")
        common = ["--dit", dit, "--dataset_config", "unused", "--network_module", module, "--network_dim", "4", "--sdpa"]
        extra = ["--network_args", *network_args] if network_args else []
        self.args = parser.parse_args([*common, "--mixed_precision", "no", "--seed", "1", *extra, *argv])
        torch.manual_seed(0)
        self.model = self._model(dit)
        self.trainer = host.WanNetworkTrainer() if arch == "wan" else host.QwenImageNetworkTrainer()
        if arch == "qwen_image":
            m["qwen_utils"].resolve_model_version_args(self.args)
        self.trainer.handle_model_specific_args(self.args)
        self._as_load_transformer()
        self._train_parts()
        embed = self.model.patch_embedding if arch == "wan" else self.model.img_in
        embed.register_forward_hook(lambda mod, i, o: self.inputs.append(tuple(i[0].shape)))

    def _train_parts(self) -> None:
        """The accelerator, the network through the trainer's ``_build_network``, an SGD optimizer over its parameters,
        the loop's scheduler, and the list the DiT's patch-embedding hook fills."""
        self.accelerator = self.m["accelerator"](self.args)
        self.network = self._build()
        self.network.prepare_grad_etc(self.model)
        params, _ = self.network.prepare_optimizer_params(unet_lr=1e-2)
        self.optimizer = torch.optim.SGD(params, lr=1e-2)
        self.scheduler = self.m["Scheduler"](shift=self.args.discrete_flow_shift, reverse=True, solver="euler")
        self.inputs: list[tuple[int, ...]] = []

    def _model(self, dit: str):
        from safetensors.torch import save_file

        if self.arch == "wan":
            model = self.m["WanModel"](dim=48, ffn_dim=64, num_heads=2, num_layers=1, text_len=8, text_dim=32, attn_mode="torch")
        else:
            model = self.m["QwenModel"](
                num_layers=1, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(8, 12, 12)
            )
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, dit)  # the trainer reads the DiT's dtype from it
        return model.requires_grad_(False)

    def _as_load_transformer(self) -> None:
        """What the trainers' ``load_transformer`` and ``_load_dit_and_swap`` set besides the model (their loaders build full sizes)."""
        self.trainer.blocks_to_swap = 0
        self.trainer.num_timestep_buckets = self.args.num_timestep_buckets
        if self.arch == "wan":
            self.trainer.current_model_is_high_noise = self.trainer.next_model_is_high_noise = False
            inactive = self.m["WanModel"](dim=48, ffn_dim=64, num_heads=2, num_layers=1, text_len=8, text_dim=32, attn_mode="torch")
            self.trainer.dit_inactive_state_dict = inactive.state_dict() if self.trainer.high_low_training else None

    def _build(self):
        def train():  # _build_network's caller, as NetworkTrainer.train holds these
            train_dataset_group = None  # noqa: F841
            dit_dtype = torch.float32  # noqa: F841
            return self.trainer._build_network(self.args, self.accelerator, self.model, None, torch.float32)

        return train()

    def batch(self, gen: torch.Generator) -> dict:
        if self.arch == "wan":
            return {"latents": torch.randn(1, 16, 2, 8, 8, generator=gen), "t5": [torch.randn(5, 32, generator=gen)], "timesteps": None}
        texts = [torch.randn(5, 32, generator=gen), torch.randn(3, 32, generator=gen)]
        return {"latents": torch.randn(2, 16, 1, 8, 8, generator=gen), "vl_embed": texts, "timesteps": None}

    def steps(self, n: int) -> list[float]:
        gen, losses = torch.Generator().manual_seed(3), []
        torch.manual_seed(5)  # the run's noise and σ stream (set_seed at the start of a real run)
        for step in range(n):
            batch = self.batch(gen)
            latents = self.trainer.scale_shift_latents(batch["latents"])
            noise = torch.randn_like(latents)
            loss, _ = self.trainer.process_batch(
                self.args, self.accelerator, self.model, self.network, batch, latents, noise, self.scheduler,
                torch.float32, torch.float32, None, step,
            )  # fmt: skip
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses


ARGV = {"wan": ("--timestep_sampling", "shift", "--discrete_flow_shift", "3"), "qwen_image": ("--timestep_sampling", "qwen_shift")}
SMALL = {"wan": (1, 16, 2, 4, 4), "qwen_image": (2, 4, 64)}  # Wan: F = 2 latent frames kept; Qwen-Image: 2×2-packed tokens


@pytest.mark.parametrize("arch", list(ARGV))
def test_routed_steps_run_the_real_dit_at_the_small_grid(musubi, arch, tmp_path):
    setup = Setup(musubi, arch, tmp_path, *ARGV[arch], network_args=(ROUTED,))
    losses = setup.steps(3)
    assert setup.inputs == [SMALL[arch]] * 3 and all(torch.isfinite(torch.tensor(losses)))
    run = setup.network.downscale_run
    assert run.inner == {"wan": "networks.lora_wan", "qwen_image": "networks.lora_qwen_image"}[arch]
    assert run.totals.total_steps == 3 and run.totals.token_saving() == pytest.approx(0.75)


def test_a_drifted_mu_table_stops_the_real_run_at_prepare_network(musubi, tmp_path, monkeypatch):
    """musubi-tuner's own μ line for qwen_shift moves (``train_utils.get_lin_function``, y2 + 0.05): the run stops in
    ``prepare_network``, before its first step, naming the host function and the revision it was checked against."""
    from downscale_plugin.hosts.musubi.facts import HostError

    train_utils = sys.modules["musubi_tuner.utils.train_utils"]
    host = train_utils.get_lin_function
    monkeypatch.setattr(train_utils, "get_lin_function", lambda x1=256, y1=0.5, x2=4096, y2=1.15: host(x1, y1, x2, y2 + 0.05))
    with pytest.raises(HostError) as err:
        Setup(musubi, "qwen_image", tmp_path, *ARGV["qwen_image"], network_args=(ROUTED,))
    assert "NetworkTrainer.get_noisy_model_input_and_timesteps no longer matches the exact σ law of timestep_sampling=qwen_shift" in str(
        err.value
    )
    assert "checked against musubi-tuner 30c658c4" in str(err.value)


def test_real_routed_steps_follow_a_changed_host_noisy_input(musubi, tmp_path, monkeypatch):
    """musubi-tuner's flow branch builds its noisy input another way (+ 0.1·latents): a routed step hands σ to the host's
    own sampler, so its noisy input has the change too, at the small grid, and nothing is refused."""
    base = sys.modules["musubi_tuner.training.trainer_base"].NetworkTrainer
    host = base.get_noisy_model_input_and_timesteps

    def get_noisy_model_input_and_timesteps(self, args, noise, latents, timesteps, noise_scheduler, device, dtype):
        noisy, t = host(self, args, noise, latents, timesteps, noise_scheduler, device, dtype)
        return (noisy + 0.1 * latents if args.timestep_sampling != "sigma" else noisy), t

    monkeypatch.setattr(base, "get_noisy_model_input_and_timesteps", get_noisy_model_input_and_timesteps)
    setup = Setup(musubi, "qwen_image", tmp_path, *ARGV["qwen_image"], network_args=(ROUTED,))
    seen, call_dit = [], setup.trainer.call_dit

    def recording(args, accelerator, transformer, latents, batch, noise, noisy_model_input, timesteps, *rest, **kw):
        seen.append((latents.clone(), noise.clone(), noisy_model_input.clone(), timesteps.clone()))
        return call_dit(args, accelerator, transformer, latents, batch, noise, noisy_model_input, timesteps, *rest, **kw)

    setup.trainer.call_dit = recording
    setup.steps(2)
    assert setup.inputs == [SMALL["qwen_image"]] * 2 and len(seen) == 2
    for latents, noise, noisy, t in seen:
        sigma = ((t - 1) / 1000).view(-1, 1, 1, 1, 1)
        assert latents.shape[-2:] == (4, 4)
        assert torch.allclose(noisy, (1 - sigma) * latents + sigma * noise + 0.1 * latents, atol=1e-5)


@pytest.mark.parametrize("arch", list(ARGV))
def test_a_run_whose_routes_never_fire_is_bitwise_the_real_hosts(musubi, arch, tmp_path):
    inner = {"wan": "networks.lora_wan", "qwen_image": "networks.lora_qwen_image"}[arch]
    plain = Setup(musubi, arch, tmp_path, *ARGV[arch], module=inner)
    plugin = Setup(musubi, arch, tmp_path, *ARGV[arch], network_args=(NEVER,))
    assert plugin.steps(3) == plain.steps(3)
    assert plugin.inputs == plain.inputs
    mine, theirs = plugin.network.state_dict(), plain.network.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.parametrize("arch", list(ARGV))
def test_fasterdit_options_in_the_real_step(musubi, arch, tmp_path):
    """``direction_loss_weight`` and ``sigma_policy = "res_shift"`` through the real ``process_batch`` → ``call_dit`` →
    ``compute_loss``: every step's loss is the MSE of its prediction and target + λ·mean(1 − cos over channels), and a
    routed step's timesteps are 1000·shift(σ drawn, k = ½) + 1 (4 × 4 of 8 × 8 latents: a quarter of the tokens)."""
    from downscale_plugin.fasterdit.policies import shift_sigma

    lam = 0.5
    args = ("ds_routes=x0.5@0.5-", f"ds_direction_loss_weight={lam}", "ds_sigma_policy=res_shift")
    setup = Setup(musubi, arch, tmp_path, *ARGV[arch], network_args=args)
    seen, call_dit = [], setup.trainer.call_dit

    def recording(*args, **kwargs):
        out = call_dit(*args, **kwargs)
        seen.append((out.pred.detach().double(), out.target.detach().double(), args[7].detach(), setup.network.downscale_run.hook.last))
        return out

    setup.trainer.call_dit = recording
    losses = setup.steps(6)
    routed = [decision.routed for *_, decision in seen]
    assert len(seen) == 6 and any(routed) and not all(routed)
    for (pred, target, timesteps, decision), loss in zip(seen, losses, strict=True):
        cos = (pred * target).sum(1) / (pred.norm(dim=1).clamp_min(1e-8) * target.norm(dim=1).clamp_min(1e-8))  # Wan's head starts at 0
        assert loss == pytest.approx(float((pred - target).pow(2).mean() + lam * (1 - cos).mean()), rel=1e-5)
        if decision.routed:
            expected = shift_sigma(decision.sigmas, 0.5).float().double() * 1000 + 1
            torch.testing.assert_close(timesteps.double(), expected, atol=1e-3, rtol=0)
    run = setup.network.downscale_run
    assert run.accounting.counts.sigma_run < run.accounting.counts.sigma_drawn


def test_wan22_two_experts_each_step_runs_the_expert_its_sigma_names(musubi, tmp_path):
    argv = ("--task", "t2v-A14B", "--dit_high_noise", "high.safetensors", "--timestep_sampling", "uniform")
    setup = Setup(musubi, "wan", tmp_path, *argv, network_args=("ds_routes=x0.5@0.9-",))
    experts = []
    call_dit = setup.trainer.call_dit

    def recording(*args, **kwargs):
        out = call_dit(*args, **kwargs)
        experts.append((bool(setup.trainer.current_model_is_high_noise), float(args[7][0]) / 1000.0))
        return out

    setup.trainer.call_dit = recording
    setup.steps(10)
    routed = [shape == SMALL["wan"] for shape in setup.inputs]
    assert any(routed) and not all(routed)
    assert all(high == (t >= 0.875) for high, t in experts)
    assert all(t >= 0.9 for (_, t), r in zip(experts, routed, strict=True) if r)


def test_the_example_config_reaches_the_plugin_through_musubis_own_toml_reader(musubi, monkeypatch):
    from pathlib import Path

    from downscale_plugin.hosts.kohya.conventions import plugin_config

    parser = musubi["wan"].wan_setup_parser(musubi["parser"]())
    path = Path(__file__).parent.parent / "example_configs" / "musubi_wan22_high_noise.toml"
    monkeypatch.setattr(sys, "argv", ["wan_train_network.py", "--config_file", str(path)])  # its reader parses sys.argv again
    args = parser.parse_args()
    args = musubi["wan"].read_config_from_file(args, parser)
    cfg = plugin_config({}, args)
    assert (args.network_module, args.min_timestep, args.timestep_sampling) == ("downscale_plugin", 875, "shift")
    assert [(r.scale, r.sigma_min, r.sigma_max) for r in cfg.routes] == [(0.75, 0.95, 1.0), (0.875, 0.9, None)]


@pytest.mark.parametrize("sampling", [("shift", "--discrete_flow_shift", "12", "--min_timestep", "875"), ("qwen_shift",), ("sigma",)])
def test_the_sigma_law_and_the_dry_run_are_the_real_samplers(musubi, sampling, tmp_path):
    """The family's first dry draw is the σ the real sampler draws next; its exact law (closed form with
    --min_timestep, the μ-shift of the grid, the scheduler grid's bf16 atoms) is the law of the real sampler's draws."""
    from downscale_plugin.hosts.musubi.facts import BY_ARCH
    from downscale_plugin.hosts.musubi.family import MusubiFamily

    setup = Setup(musubi, "wan", tmp_path, "--timestep_sampling", *sampling, network_args=(NEVER,))
    family = MusubiFamily(setup.trainer, BY_ARCH["wan"])
    latents = torch.zeros(3, 16, 2, 32, 52)  # a 256×416 latent grid, 2 frames (qwen_shift reads its tokens)
    bound = family.bind(setup.args, setup.scheduler, latents, "cpu", torch.bfloat16)
    state = torch.get_rng_state()
    dry = bound.first()
    torch.set_rng_state(state)
    noisy, t = setup.trainer.get_noisy_model_input_and_timesteps(
        setup.args, torch.ones_like(latents), torch.zeros_like(latents), None, setup.scheduler, "cpu", torch.bfloat16
    )
    assert torch.equal(dry, noisy[:, 0, 0, 0, 0].double())
    torch.manual_seed(0)
    draws = torch.sort(bound.draw(8000)).values
    law = bound.law.law
    grid = torch.linspace(0.0, 1.0, 401, dtype=torch.float64)
    ecdf = torch.searchsorted(draws, grid, right=True).double() / draws.numel()
    gap = max(abs(float(e) - law.cdf(float(x))) for e, x in zip(ecdf, grid, strict=True))
    assert gap < math.sqrt(math.log(2 / 1e-4) / (2 * draws.numel()))  # DKW at α = 1e-4


def _qwen_cache(m: dict, root) -> str:
    """Four 64² items cached by musubi-tuner's own cache writers (random latents and text states in place of
    the VAE and Qwen2.5-VL), and the dataset TOML over them."""
    cache, images = root / "cache", root / "images"
    images.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    for i in range(4):
        item = m["ItemInfo"](f"img{i}", "", (64, 64), (64, 64), latent_cache_path=str(cache / f"img{i}_0064x0064_qi.safetensors"))
        item.text_encoder_output_cache_path = str(cache / f"img{i}_qi_te.safetensors")
        m["cache_io"].save_latent_cache_qwen_image(item, torch.randn(16, 1, 8, 8, generator=gen), None)
        m["cache_io"].save_text_encoder_output_cache_qwen_image(item, torch.randn(3 + i, 32, generator=gen))
    toml = root / "dataset.toml"
    toml.write_text(
        f"[general]\nresolution = [64, 64]\nbatch_size = 2\nenable_bucket = false\n\n"
        f'[[datasets]]\nimage_directory = "{images}"\ncache_directory = "{cache}"\n'
    )
    return str(toml)


def _train_qwen(m: dict, dataset: str, out, *argv: str):
    """musubi-tuner's whole ``NetworkTrainer.train`` (dataset, accelerator, network, loop, end, state, save) with
    only the checkpoint loader replaced: its ``load_transformer`` builds the full 20B DiT."""
    host = m["qwen"]

    class TinyQwenImageNetworkTrainer(host.QwenImageNetworkTrainer):
        def load_transformer(self, accelerator, args, dit_path, attn_mode, split_attn, loading_device, dit_weight_dtype):
            torch.manual_seed(0)
            return m["QwenModel"](
                num_layers=1, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(8, 12, 12)
            )

    parser = host.qwen_image_setup_parser(m["parser"]())
    args = parser.parse_args([
        "--dit", "unused", "--dataset_config", dataset, "--network_module", "downscale_plugin", "--network_dim", "4", "--sdpa",
        "--mixed_precision", "no", "--seed", "1", "--timestep_sampling", "qwen_shift", "--network_args", "ds_routes=x0.5@0.5-",
        "--max_train_steps", "4", "--output_dir", str(out), "--output_name", "t", "--optimizer_type", "AdamW",
        "--learning_rate", "1e-3", "--max_data_loader_n_workers", "0", *argv,
    ])  # fmt: skip
    m["qwen_utils"].resolve_model_version_args(args)
    args.dit_dtype = "float32"  # main() sets bfloat16; the tiny DiT stays float32 on CPU
    trainer = TinyQwenImageNetworkTrainer()
    trainer.train(args)
    return trainer


def test_the_real_training_loop_routes_saves_and_resumes(musubi, tmp_path):
    """The real loop end to end: routed steps, the end summary's counts in the saved LoRA's metadata, the patches
    off the trainer after the last save, the LoRA loading back into networks.lora_qwen_image, and the counts
    going on through musubi-tuner's own --save_state / --resume."""
    from safetensors import safe_open

    dataset = _qwen_cache(musubi, tmp_path)
    trainer = _train_qwen(musubi, dataset, tmp_path / "a", "--save_state")
    assert "process_batch" not in vars(trainer) and "get_noisy_model_input_and_timesteps" not in vars(trainer)
    with safe_open(str(tmp_path / "a" / "t.safetensors"), "pt") as f:
        meta, weights = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    counts = json.loads(meta["ss_downscale_counts"])
    assert meta["ss_downscale_arch"] == "qwen_image" and meta["ss_downscale_inner"] == "networks.lora_qwen_image"
    assert counts["forwards"] == 4 and 0 < counts["routes"]["r0 x0.5"] < 1
    from networks import lora_qwen_image  # musubi-tuner's own module, as _build_network put it on sys.path

    model = musubi["QwenModel"](
        num_layers=1, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(8, 12, 12)
    )
    network = lora_qwen_image.create_arch_network(1.0, 4, 1.0, None, None, model)
    network.apply_to(None, model, apply_text_encoder=False, apply_unet=True)
    info = network.load_weights(str(tmp_path / "a" / "t.safetensors"))  # --network_weights' path
    assert (
        not info.missing_keys
        and not info.unexpected_keys
        and any(k.endswith("lora_up.weight") and v.abs().sum() > 0 for k, v in weights.items())
    )
    _train_qwen(musubi, dataset, tmp_path / "b", "--resume", str(tmp_path / "a" / "t-state"))
    with safe_open(str(tmp_path / "b" / "t.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["ss_downscale_counts"])["forwards"] == 8


def _wan_cache(m: dict, root, clips: int) -> str:
    """``clips`` 64² five-frame clips cached by musubi-tuner's own Wan cache writers, and the dataset TOML over them."""
    cache, videos = root / "cache", root / "videos"
    videos.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    for i in range(clips):
        path = cache / f"clip{i}_00000-005_0064x0064_wan.safetensors"
        item = m["ItemInfo"](f"clip{i}", "", (64, 64), (64, 64, 5), frame_count=5, latent_cache_path=str(path))
        item.text_encoder_output_cache_path = str(cache / f"clip{i}_wan_te.safetensors")
        m["cache_io"].save_latent_cache_wan(item, torch.randn(16, 2, 8, 8, generator=gen), None, None, None)
        m["cache_io"].save_text_encoder_output_cache_wan(item, torch.randn(4 + i % 4, 32, generator=gen))  # within text_len 8
    toml = root / "dataset.toml"
    toml.write_text(
        f"[general]\nresolution = [64, 64]\nbatch_size = 1\nenable_bucket = false\n\n"
        f'[[datasets]]\nvideo_directory = "{videos}"\ncache_directory = "{cache}"\ntarget_frames = [5]\n'
    )
    return str(toml)


def _train_wan(
    m: dict,
    tmp_path,
    network_args: list[str],
    steps: int,
    *argv: str,
    module: str = "downscale_plugin",
    experts: list | None = None,
    inputs: list | None = None,
    clips: int = 4,
) -> list[tuple[int, ...]]:
    """Wan's whole ``NetworkTrainer.train`` on ``clips`` cached clips (only the checkpoint loader replaced: a tiny
    ``WanModel``, and with ``--dit_high_noise`` a second one as the inactive expert); returns the DiT's input shape
    of every forward, in order (also appended to ``inputs``, for a run that ends in SystemExit); ``experts`` gets
    (high-noise expert ran, timestep) of every forward."""
    from safetensors.torch import save_file

    host = m["wan"]
    inputs = [] if inputs is None else inputs

    def tiny(seed: int = 0):
        torch.manual_seed(seed)
        model = m["WanModel"](dim=48, ffn_dim=64, num_heads=2, num_layers=1, text_len=8, text_dim=32, attn_mode="torch")
        with torch.no_grad():  # WanModel.init_weights zeroes the head: no gradient would reach the LoRA
            model.head.head.weight.normal_(std=0.05)
        return model

    class TinyWanNetworkTrainer(host.WanNetworkTrainer):
        def load_transformer(self, accelerator, args, dit_path, attn_mode, split_attn, loading_device, dit_weight_dtype):
            self.current_model_is_high_noise = self.next_model_is_high_noise = False
            self.dit_inactive_state_dict = tiny(1).state_dict() if self.high_low_training else None
            model = tiny()
            model.patch_embedding.register_forward_hook(lambda mod, i, o: inputs.append(tuple(i[0].shape)))
            return model

        def _call_dit(self, args, accelerator, transformer, latents, batch, noise, noisy_model_input, timesteps, network_dtype, **kw):
            if experts is not None:  # after call_dit's swap_high_low_weights
                experts.append((bool(self.current_model_is_high_noise), float(timesteps[0])))
            return super()._call_dit(
                args, accelerator, transformer, latents, batch, noise, noisy_model_input, timesteps, network_dtype, **kw
            )

    tmp_path.mkdir(parents=True, exist_ok=True)
    dit = tmp_path / "dit.safetensors"
    save_file({k: v.contiguous() for k, v in tiny().state_dict().items()}, str(dit))  # the trainer reads the DiT's dtype from it
    parser = host.wan_setup_parser(m["parser"]())
    args = parser.parse_args([
        *([] if "--task" in argv else ["--task", "t2v-14B"]), "--dit", str(dit), "--dataset_config", _wan_cache(m, tmp_path, clips), "--network_module", module,
        "--network_dim", "4", "--sdpa", "--mixed_precision", "no", "--seed", "1", "--timestep_sampling", "shift",
        "--discrete_flow_shift", "3", *(["--network_args", *network_args] if network_args else []), "--max_train_steps", str(steps), "--output_dir",
        str(tmp_path / "out"), "--output_name", "w", "--optimizer_type", "AdamW", "--learning_rate", "1e-3",
        "--max_data_loader_n_workers", "0", *argv,
    ])  # fmt: skip
    TinyWanNetworkTrainer().train(args)
    return inputs


def test_the_real_wan_loop_trains_video_at_the_small_grid_with_every_frame(musubi, tmp_path):
    """Wan's whole NetworkTrainer.train on cached clips: every routed forward keeps the 2 latent frames and halves
    H and W, and the saved FLOP saving is the model's at F × the tokens of a frame."""
    from safetensors import safe_open

    from downscale_plugin.flops import arch_flops

    inputs = _train_wan(musubi, tmp_path, ["ds_routes=x0.5@0.0-"], 3)
    assert inputs == [(1, 16, 2, 4, 4)] * 3
    with safe_open(str(tmp_path / "out" / "w.safetensors"), "pt") as f:
        counts = json.loads(f.metadata()["ss_downscale_counts"])
    model = arch_flops("wan", lora_rank=4)  # the per-block Wan model at the run's --network_dim
    assert counts["forwards"] == 3 and counts["flop_saving"] == pytest.approx(1 - model.flops(2 * 4) / model.flops(2 * 16))


@pytest.mark.usefixtures("token_costs", "range_clipped_read")
def test_the_real_wan_loop_certifies_in_the_run_and_trains_with_the_windows(musubi, tmp_path):
    """``mode = "auto"`` in Wan's whole NetworkTrainer.train: 168 steps, D = 4, so the budget (0.5 × 168 = 84) covers one
    bin read on all 16 probes (16 × 4 × 1.25 = 80). The probes are in at batch 16 (16 clips, batch 1); before its
    step the certifier runs every draw through the real ``process_batch`` (one probe, F = 2 latent frames kept at
    both grids), writes windows.toml / certify.json, and the run's later steps route by them. The random model's
    excess is certified at ε = 0.99 only under the range-clipped calibration (conftest.range_clipped_read, as every
    certify-then-train test on a random model): with the shape-held one the first look at 2 probes stops it futile."""
    from safetensors import safe_open

    out = tmp_path / "auto"
    keys = ["ds_mode=auto", f"ds_map_out={out}", "ds_certify_budget=0.5", "ds_certify_unpaid=buy", "ds_map_ratios=0.5", "ds_map_bins=0,0.5,1",
            "ds_certify_draws=4", "ds_map_margin=0.99"]  # fmt: skip
    inputs = _train_wan(
        musubi, tmp_path, keys, 168, "--gradient_checkpointing", clips=16
    )  # the measurement's backward through its checkpoints
    windows = (out / "windows.toml").read_text()
    blob = json.loads((out / "certify.json").read_text())
    assert 'windows_arch = "wan"' in windows and 'windows_native = "8x8"' in windows and "[[routes]]" in windows
    assert 0 < blob["cost"]["native_step_equivalents"] <= 0.5 * 168 and any(row["safe"] for row in blob["bins"])
    assert blob["provenance"]["backend"]["trainer"] == "TinyWanNetworkTrainer"
    forced = inputs[15 : len(inputs) - 153]  # 15 native train forwards, the certifier's draws, then batches 16-168
    assert forced and set(forced) == {(1, 16, 2, 8, 8), (1, 16, 2, 4, 4)}
    assert set(inputs[:15]) == {(1, 16, 2, 8, 8)} and (1, 16, 2, 4, 4) in inputs[len(inputs) - 153 :]
    with safe_open(str(tmp_path / "out" / "w.safetensors"), "pt") as f:
        meta = f.metadata()
    recorded, counts = json.loads(meta["ss_downscale_map"]), json.loads(meta["ss_downscale_counts"])
    assert recorded["method"] == "certify" and recorded["before_train_batch"] == 16 and recorded["probes"] == 16
    assert counts["forwards"] == 168 and counts["routes"].get("native", 1.0) < 1.0


@pytest.mark.usefixtures("token_costs")
def test_a_real_wan_certification_that_opens_nothing_leaves_the_run_bitwise_the_hosts(musubi, tmp_path):
    """ε ≈ 0 in the real Wan loop: the certifier's draws (real process_batch, real sampler, real loss) leave the
    run's RNG, gradients, optimizer and the trainer's timestep-bucket pool (which --preserve_distribution_shape
    pops in every σ draw) as they were: the saved LoRA is bitwise the plain networks.lora_wan run's."""
    from safetensors.torch import load_file

    out = tmp_path / "plugin" / "auto"
    keys = ["ds_mode=auto", f"ds_map_out={out}", "ds_certify_budget=0.5", "ds_certify_unpaid=buy", "ds_map_ratios=0.5", "ds_map_bins=0,0.5,1",
            "ds_certify_draws=2", "ds_map_margin=1e-9"]  # fmt: skip
    argv = ("--num_timestep_buckets", "3", "--preserve_distribution_shape", "--min_timestep", "100")
    plain = _train_wan(musubi, tmp_path / "plain", [], 80, *argv, module="networks.lora_wan", clips=16)  # budget 40: one safe verdict
    plugin = _train_wan(musubi, tmp_path / "plugin", keys, 80, *argv, clips=16)
    blob = json.loads((out / "certify.json").read_text())
    assert blob["cost"]["native_step_equivalents"] > 0 and not any(row["safe"] for row in blob["bins"])
    assert len(plugin) > len(plain) == 80 and plugin[:15] + plugin[len(plugin) - 65 :] == plain
    theirs, ours = (load_file(str(tmp_path / run / "out" / "w.safetensors")) for run in ("plain", "plugin"))
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)


@pytest.mark.usefixtures("token_costs")
def test_real_wan22_certifier_draws_run_the_expert_their_sigma_names_and_leave_the_run_bitwise(musubi, tmp_path):
    """Wan 2.2 with both experts (the real swap_high_low_weights, the real two-expert sampler): every forward, the
    certifier's included, runs on the expert its timestep names against timestep_boundary, the forced draws use
    both, and with ε ≈ 0 the saved LoRA is bitwise the plain run's (the expert flag and swapped weights as the host has them)."""
    from safetensors.torch import load_file

    out = tmp_path / "plugin" / "auto"
    keys = ["ds_mode=auto", f"ds_map_out={out}", "ds_certify_budget=0.5", "ds_certify_unpaid=buy", "ds_map_ratios=0.5", "ds_map_bins=0,0.5,1",
            "ds_certify_draws=2", "ds_map_margin=1e-9"]  # fmt: skip
    argv = ("--task", "t2v-A14B", "--dit_high_noise", str(tmp_path / "high.safetensors"))
    theirs, ours = [], []
    plain = _train_wan(musubi, tmp_path / "plain", [], 80, *argv, module="networks.lora_wan", experts=theirs, clips=16)
    plugin = _train_wan(musubi, tmp_path / "plugin", keys, 80, *argv, experts=ours, clips=16)
    forced = len(plugin) - len(plain)
    assert forced > 0 and ours[:15] + ours[15 + forced :] == theirs
    assert all(high == (t / 1000.0 >= 0.875) for high, t in ours) and {high for high, _ in ours[15 : 15 + forced]} == {False, True}
    a, b = (load_file(str(tmp_path / run / "out" / "w.safetensors")) for run in ("plain", "plugin"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_real_wan_loop_maps_in_the_run_then_stops_without_weights(musubi, tmp_path):
    """``mode = "map"``, ``after_map = "stop"`` in Wan's whole NetworkTrainer.train: the probes are in at batch 4 (batch 1);
    before its step the map runs 4 probes × 3 σ bins × D = 2 × (native, native, route) forced draws through the real
    ``process_batch`` (F = 2 latent frames kept at both grids), writes its files, and the script ends (SystemExit 0)
    before batch 4's step, saving no weights."""
    out = tmp_path / "map"
    keys = ["ds_mode=map", f"ds_map_out={out}", "ds_after_map=stop", "ds_map_ratios=0.5", "ds_map_bins=0,0.5,1",
            "ds_map_draws=2", "ds_map_images=4"]  # fmt: skip
    inputs = []
    with pytest.raises(SystemExit) as ended:
        _train_wan(musubi, tmp_path, keys, 24, inputs=inputs)
    assert ended.value.code == 0
    assert len(inputs) == 3 + 4 * 3 * 2 * 3  # 3 native train steps, then the map's draws
    assert set(inputs[:3]) == {(1, 16, 2, 8, 8)} and set(inputs[3:]) == {(1, 16, 2, 8, 8), (1, 16, 2, 4, 4)}
    assert (out / "windows.toml").is_file() and 'windows_arch = "wan"' in (out / "windows.toml").read_text()
    assert not (tmp_path / "out" / "w.safetensors").exists()


def test_a_real_wan_map_without_windows_leaves_the_run_bitwise_the_hosts(musubi, tmp_path):
    """``mode = "map"`` with ε ≈ 0 and ``after_map = "train"`` in the real Wan loop with --preserve_distribution_shape and
    timestep buckets (every σ draw pops the trainer's bucket pool): the map's forced draws leave the run's RNG,
    gradients, optimizer and bucket pool as they were: the saved LoRA is bitwise the plain networks.lora_wan run's."""
    from safetensors.torch import load_file

    out = tmp_path / "plugin" / "map"
    keys = ["ds_mode=map", f"ds_map_out={out}", "ds_after_map=train", "ds_map_ratios=0.5", "ds_map_bins=0,0.5,1",
            "ds_map_draws=2", "ds_map_images=4", "ds_map_margin=1e-9"]  # fmt: skip
    argv = ("--num_timestep_buckets", "5", "--preserve_distribution_shape", "--min_timestep", "100")
    plain = _train_wan(musubi, tmp_path / "plain", [], 12, *argv, module="networks.lora_wan")
    plugin = _train_wan(musubi, tmp_path / "plugin", keys, 12, *argv)
    assert len(plugin) == len(plain) + 4 * 3 * 2 * 3 and plugin[:3] + plugin[3 + 72 :] == plain
    assert "[[routes]]" not in (out / "windows.toml").read_text()
    theirs, ours = (load_file(str(tmp_path / run / "out" / "w.safetensors")) for run in ("plain", "plugin"))
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)


# -- drift on copies of the real checkout: an added option passes, a changed formula stops the script ----------

SAMPLER_DRAW = ("src/musubi_tuner/training/trainer_base.py", "        batch_size = noise.shape[0]")  # NetworkTrainer's sampler
MUSUBI_ADDED_OPTION = (
    ("src/musubi_tuner/training/parser_common.py", "    parser = argparse.ArgumentParser()",
     '    parser.add_argument("--noise_scale", type=float, default=1.0)'),
    (*SAMPLER_DRAW, "        noise = noise * args.noise_scale"),
)  # fmt: skip
MUSUBI_CHANGED_FORMULA = ((*SAMPLER_DRAW, "        noise = noise * 1.01"),)
MUSUBI_SAMPLER = "musubi_tuner.training.trainer_base.NetworkTrainer.get_noisy_model_input_and_timesteps"
QWEN_TOML = """network_module = "downscale_plugin"
[training]
timestep_sampling = "qwen_shift"
max_train_steps = 100

[[plugins.downscale.routes]]
route = "1024:768"
sigma_min = 0.65
"""


def musubi_run(work: Path, checkout: Path | str) -> dict:
    """Qwen-Image's real caching and training scripts of ``checkout`` through ``tests/musubi_e2e.py`` (8 steps): its
    ``record.json``."""
    env = {**os.environ, "MUSUBI_DIR": str(checkout), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "E2E_STEPS": "8"}
    work.parent.mkdir(parents=True)
    proc = subprocess.run(
        [sys.executable, str(HERE / "musubi_e2e.py"), "qwen_image", str(work)], cwd=work.parent, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0 and "E2E OK" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((work / "record.json").read_text())


def test_a_real_musubi_copy_that_added_an_option_trains_exactly_as_the_unchanged_host(tmp_path):
    """A newer musubi-tuner with one more option (neutral default) that ``NetworkTrainer``'s sampler reads as
    ``args.noise_scale``: the check calls it with the run's own args, so the run is not refused, and its routed steps and
    saved LoRA are the unchanged host's, bit for bit. Before the model loads, the same check on the command line passes it
    at the default and refuses ``--noise_scale 1.01``, the run's own value, as a changed result."""
    from safetensors.torch import load_file

    copy = host_copy(MUSUBI_DIR, tmp_path / "musubi-tuner", MUSUBI_ADDED_OPTION)
    reference = musubi_run(tmp_path / "unchanged" / "work", MUSUBI_DIR)
    record = musubi_run(tmp_path / "added" / "work", copy)
    assert sum(step["rule"] >= 0 for step in record["steps"]) >= 2  # routed steps
    assert record["steps"] == reference["steps"] and "ss_downscale_host_check" not in record["metadata"]
    ours, theirs = (load_file(str(tmp_path / run / "work" / "out" / "lora.safetensors")) for run in ("added", "unchanged"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    check = [sys.executable, "-m", "downscale_plugin", "check", "--host", "musubi", "--", str(copy / "qwen_image_train_network.py")]
    check += ["--config_file", str(tmp_path / "added" / "work" / "train.toml")]
    passed = subprocess.run(check, cwd=tmp_path, env=startup_env(), capture_output=True, text=True, timeout=300)
    assert passed.returncode == 0 and "config OK" in passed.stdout, (passed.stdout + passed.stderr)[-3000:]
    refused = subprocess.run(
        [*check, "--noise_scale", "1.01"], cwd=tmp_path, env=startup_env(), capture_output=True, text=True, timeout=300
    )
    assert refused.returncode == 2, (refused.stdout + refused.stderr)[-3000:]
    assert f"{MUSUBI_SAMPLER} no longer matches" in refused.stderr
    assert "the host's result differs" in refused.stderr and "could not call" not in refused.stderr


def test_a_real_musubi_copy_with_a_changed_noise_formula_is_refused_before_the_script_loads_a_model(tmp_path):
    """The copy's ``NetworkTrainer`` sampler scales its noise by 1.01: its real training script, started as a user starts
    it, stops in the startup check before it reads its settings; ``host_check = "warn"`` logs it and goes on."""
    copy = host_copy(MUSUBI_DIR, tmp_path / "musubi-tuner", MUSUBI_CHANGED_FORMULA)
    config = tmp_path / "train.toml"
    config.write_text(QWEN_TOML)  # no model files: a run past the check fails on them
    script = [sys.executable, str(copy / "qwen_image_train_network.py"), "--config_file", str(config)]
    env = startup_env(PYTHONPATH=os.pathsep.join([str(copy / "src"), os.environ.get("PYTHONPATH", "")]))  # the script runs the copy
    proc = subprocess.run(script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log[-3000:]
    assert f"{MUSUBI_SAMPLER} no longer matches the exact σ law of timestep_sampling=" in log and "the host's result differs" in log
    assert "the plugin was checked against musubi-tuner 30c658c4" in log and "stopped before the trainer loads any model" in log
    assert "Loading settings from" not in log, log[-3000:]
    warned = subprocess.run(
        [*script, "--network_args", "ds_host_check=warn"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    log = warned.stdout + warned.stderr
    assert f"{MUSUBI_SAMPLER} no longer matches" in log and 'host_check = "warn": training on' in log, log[-3000:]
    assert "stopped before the trainer loads any model" not in log and "Loading settings from" in log, log[-3000:]
