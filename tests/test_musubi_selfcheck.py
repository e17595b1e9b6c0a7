"""musubi-tuner's drift self-check on the doubles (``hosts/musubi/selfcheck.py``): a host function that drifts from
what the plugin re-implements stops the run at ``prepare_network``, before its first step, naming the function and
the revision the plugin was checked against; where a routed step calls the host's own function, a changed function
is followed instead. The real host's own functions pass, and ``check --host musubi --`` reports a drift the same way
(``tests/test_musubi_cli.py``)."""

from __future__ import annotations

import pytest
import torch
from test_musubi_doubles import ALL_ROUTED, doubles, run, trainers  # noqa: F401  # the doubles fixture

from downscale_plugin.hosts.kohya.selfcheck import drift_problems
from downscale_plugin.hosts.musubi.facts import BY_ARCH, HostError
from downscale_plugin.hosts.musubi.selfcheck import CHECKED_AGAINST, pieces


def test_the_doubles_agree_with_every_piece():
    """Every piece on the doubles' NetworkTrainer (they follow musubi-tuner), and Wan 2.2's expert override."""
    wan = trainers().WanNetworkTrainer()
    wan.high_low_training, wan.timestep_boundary, wan.next_model_is_high_noise = True, 0.875, False
    import musubi_trainer_base

    checks = pieces(wan, BY_ARCH["wan"], musubi_trainer_base.setup_parser().parse_args([]))  # the options at their defaults
    assert len(checks) == 15 and "expert" in checks[-1].what
    assert drift_problems(checks, CHECKED_AGAINST) == []
    assert wan.next_model_is_high_noise is False and wan.timestep_range_pool == []  # the check left the trainer as it was


def test_a_drifted_mu_table_stops_the_run_before_its_first_step(tmp_path, monkeypatch):
    """qwen_shift's μ line moves (y2 0.9 → 0.95): the exact law the coupled gate fills from would no longer be the
    host's; the run stops at prepare_network, naming the host function, the mode and the revision."""
    import musubi_trainer_base

    host = musubi_trainer_base.get_lin_function

    def drifted(x1=256, y1=0.5, x2=4096, y2=1.15):
        return host(x1, y1, x2, 0.95 if x2 == 8192 else y2)

    monkeypatch.setattr(musubi_trainer_base, "get_lin_function", drifted)
    trainer = trainers().QwenImageNetworkTrainer()
    with pytest.raises(HostError) as err:
        run("QwenImageNetworkTrainer", "--timestep_sampling", "qwen_shift", tmp_path=tmp_path, trainer=trainer, downscale=ALL_ROUTED)
    text = str(err.value)
    assert "NetworkTrainer.get_noisy_model_input_and_timesteps no longer matches the exact σ law of timestep_sampling=qwen_shift" in text
    assert "the plugin was checked against musubi-tuner 30c658c4" in text and "max |host − plugin|" in text
    assert "flux_shift" not in text  # only the drifted piece is named
    assert trainer.last_transformer is None or not trainer.last_transformer.calls  # no step ran


def test_a_drifted_scheduler_grid_rebuild_stops_the_run(tmp_path, monkeypatch):
    """The scheduler branch's noisy input changes (σ·noise + (1 − σ)·latents → + 0.1·latents): the plugin still builds
    that step itself for a replayed σ, so the run refuses, naming the replay piece."""
    drift_noisy_input(monkeypatch, lambda args: args.timestep_sampling == "sigma")
    with pytest.raises(HostError, match=r"a replayed σ's step, timestep_sampling=sigma .*noisy input: max"):
        run("ZImageNetworkTrainer", tmp_path=tmp_path, downscale=ALL_ROUTED)


def drift_noisy_input(monkeypatch, where) -> None:
    """The doubles' NetworkTrainer sampler returns noisy input + 0.1·latents where ``where(args)`` (invisible on the
    self-check's σ stand-ins, latents 0)."""
    base = trainers().NetworkTrainer
    host = base.get_noisy_model_input_and_timesteps

    def get_noisy_model_input_and_timesteps(self, args, noise, latents, timesteps, noise_scheduler, device, dtype):
        noisy, t = host(self, args, noise, latents, timesteps, noise_scheduler, device, dtype)
        return (noisy + 0.1 * latents if where(args) else noisy), t

    monkeypatch.setattr(base, "get_noisy_model_input_and_timesteps", get_noisy_model_input_and_timesteps)


def test_routed_flow_steps_follow_a_changed_host_noisy_input(tmp_path, monkeypatch):
    """The flow branch's noisy input changes the same way: a routed step's is built by the host's own function for its
    σ, so it has the change too, at the small grid (no refusal: nothing the plugin re-implements drifted)."""
    drift_noisy_input(monkeypatch, lambda args: args.timestep_sampling != "sigma")
    seen = []

    class Recording(trainers().QwenImageNetworkTrainer):
        def call_dit(self, args, accelerator, transformer, latents, batch, noise, noisy_model_input, timesteps, *rest, **kw):
            seen.append((latents.clone(), noise.clone(), noisy_model_input.clone(), timesteps.clone()))
            return super().call_dit(args, accelerator, transformer, latents, batch, noise, noisy_model_input, timesteps, *rest, **kw)

    run("QwenImageNetworkTrainer", "--timestep_sampling", "sigmoid", tmp_path=tmp_path, trainer=Recording(), downscale=ALL_ROUTED)
    assert len(seen) == 4
    for latents, noise, noisy, t in seen:
        assert latents.shape[-2:] == (4, 4)  # routed: the 8×8 bucket at ratio 0.5
        sigma = ((t - 1) / 1000).view(-1, 1, 1, 1, 1)
        assert torch.allclose(noisy, (1 - sigma) * latents + sigma * noise + 0.1 * latents, atol=1e-5)


def test_a_drifted_expert_choice_stops_a_wan22_run(tmp_path, monkeypatch):
    """Wan 2.2's override picks the other expert than its first timestep names: a replayed σ's expert, which the plugin
    sets by the override's rule, would no longer be the host's."""
    wan = trainers().WanNetworkTrainer
    host = wan.get_noisy_model_input_and_timesteps

    def get_noisy_model_input_and_timesteps(self, args, noise, latents, timesteps, noise_scheduler, device, dtype):
        out = host(self, args, noise, latents, timesteps, noise_scheduler, device, dtype)
        if self.high_low_training:
            self.next_model_is_high_noise = not self.next_model_is_high_noise
        return out

    monkeypatch.setattr(wan, "get_noisy_model_input_and_timesteps", get_noisy_model_input_and_timesteps)
    argv = ("--task", "t2v-A14B", "--buckets", "64x64x5", "--dit_high_noise", "high.safetensors", "--timestep_sampling", "sigmoid")
    with pytest.raises(HostError, match="WanNetworkTrainer.get_noisy_model_input_and_timesteps no longer matches Wan 2.2's expert"):
        run("WanNetworkTrainer", *argv, tmp_path=tmp_path, downscale=ALL_ROUTED)


def test_the_startup_check_finds_the_scripts_musubi_tuner(tmp_path):
    """The wrapper scripts at a checkout's root and the package's own scripts both import ``musubi_tuner`` from the
    checkout's ``src``; ``-m`` runs it as installed; another script, or a launcher's own, is not musubi-tuner's."""
    from downscale_plugin.hosts.musubi.startup import command_line_drift, script_checkout

    (tmp_path / "src" / "musubi_tuner").mkdir(parents=True)
    src = str(tmp_path / "src")
    wan, qwen = BY_ARCH["wan"], BY_ARCH["qwen_image"]
    assert script_checkout(["accelerate", "launch", str(tmp_path / "wan_train_network.py"), "--dit", "x"]) == (wan, src)
    assert script_checkout([str(tmp_path / "src" / "musubi_tuner" / "qwen_image_train_network.py")]) == (qwen, src)
    assert script_checkout(["python", "-m", "musubi_tuner.wan_train_network"]) == (wan, None)
    assert script_checkout(["launch.py", "flux_train_network.py"]) is None
    assert command_line_drift([str(tmp_path / "wan_train_network.py")]) == []  # its musubi_tuner holds no trainer_base
