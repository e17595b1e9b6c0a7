"""Double of ``library.train_util``: the SD/SDXL noise + timestep path, the loss, the accelerator.

``get_noise_noisy_latents_and_timesteps`` draws in the host's order (noise, optional noise offset,
then ``get_timesteps`` looked up as a module global, on the CPU RNG, then optional ip-noise).
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F


def get_timesteps(min_timestep: int, max_timestep: int, b_size: int, device) -> torch.Tensor:
    if min_timestep < max_timestep:
        timesteps = torch.randint(min_timestep, max_timestep, (b_size,), device="cpu")
    else:
        timesteps = torch.full((b_size,), max_timestep, device="cpu")
    return timesteps.long().to(device)


def get_noise_noisy_latents_and_timesteps(args, noise_scheduler, latents):
    noise = torch.randn_like(latents, device=latents.device)
    if args.noise_offset:
        offset = args.noise_offset
        if args.noise_offset_random_strength:
            offset = torch.rand(1, device=latents.device) * args.noise_offset
        noise = noise + offset * torch.randn((latents.shape[0], latents.shape[1], 1, 1), device=latents.device)
    min_timestep = 0 if args.min_timestep is None else args.min_timestep
    max_timestep = noise_scheduler.config.num_train_timesteps if args.max_timestep is None else args.max_timestep
    timesteps = get_timesteps(min_timestep, max_timestep, latents.shape[0], latents.device)
    if args.ip_noise_gamma:
        strength = args.ip_noise_gamma
        if args.ip_noise_gamma_random_strength:
            strength = torch.rand(1, device=latents.device) * args.ip_noise_gamma
        noisy_latents = noise_scheduler.add_noise(latents, noise + strength * torch.randn_like(latents), timesteps)
    else:
        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
    noise_scheduler.alphas_cumprod = noise_scheduler.alphas_cumprod.cpu()
    return noise, noisy_latents, timesteps


def get_huber_threshold_if_needed(args, timesteps, noise_scheduler):
    return None


def conditional_loss(model_pred, target, loss_type: str, reduction: str, huber_c=None):
    assert loss_type == "l2", "the double implements the default l2 loss only"
    return F.mse_loss(model_pred, target, reduction=reduction)


class RecordingTracker:
    """Stands in for a TensorBoard tracker: keeps every (step, logs) it is given."""

    name = "recording"

    def __init__(self):
        self.records: list[tuple[int, dict]] = []

    def log(self, values: dict, step: int) -> None:
        self.records.append((step, dict(values)))


class TinyAccelerator:
    """The part of ``accelerate.Accelerator`` the trainers use; ranks from ``torch.distributed``."""

    def __init__(self):
        self.device = torch.device("cpu")
        distributed = dist.is_available() and dist.is_initialized()
        self.process_index = dist.get_rank() if distributed else 0
        self.num_processes = dist.get_world_size() if distributed else 1
        self.is_main_process = self.is_local_main_process = self.process_index == 0
        self.trackers = [RecordingTracker()] if self.is_main_process else []  # init_trackers runs on main only
        self.ended = False

    def autocast(self):
        return contextlib.nullcontext()

    def unwrap_model(self, model):
        return model

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        out = tensor.clone()
        if self.num_processes > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
            if reduction == "mean":
                out /= self.num_processes
        return out

    def wait_for_everyone(self) -> None:
        if self.num_processes > 1:
            dist.barrier()

    def log(self, values: dict, step: int | None = None) -> None:
        for tracker in self.trackers:
            tracker.log(values, step)

    def print(self, *args) -> None:
        if self.is_main_process:
            print(*args)

    def end_training(self) -> None:
        self.ended = True


def prepare_accelerator(args) -> TinyAccelerator:
    return TinyAccelerator()
