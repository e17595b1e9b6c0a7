"""Double of ``library.train_util``: the SD/SDXL noise + timestep path, the loss, the accelerator.

``get_noise_noisy_latents_and_timesteps`` draws in the host's order (tu:6071-6107): noise; with
``--noise_offset`` the random strength (``torch.rand``) and then ``apply_noise_offset`` (adaptive
term, one normal per sample and channel); with ``--multires_noise_iterations`` ``pyramid_noise_like``
(Python's ``random`` and CPU normals); then ``get_timesteps``, looked up as a module global, on the
CPU RNG; then ip-noise's random strength before its normal.
"""

import contextlib
import os
import random
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F

from library import custom_train_functions


def get_timesteps(min_timestep: int, max_timestep: int, b_size: int, device) -> torch.Tensor:
    if min_timestep < max_timestep:
        timesteps = torch.randint(min_timestep, max_timestep, (b_size,), device="cpu")
    else:
        timesteps = torch.full((b_size,), max_timestep, device="cpu")
    return timesteps.long().to(device)


def get_noise_noisy_latents_and_timesteps(args, noise_scheduler, latents):
    noise = torch.randn_like(latents, device=latents.device)
    if args.noise_offset:
        offset = torch.rand(1, device=latents.device) * args.noise_offset if args.noise_offset_random_strength else args.noise_offset
        noise = custom_train_functions.apply_noise_offset(latents, noise, offset, args.adaptive_noise_scale)
    if args.multires_noise_iterations:
        noise = custom_train_functions.pyramid_noise_like(
            noise, latents.device, args.multires_noise_iterations, args.multires_noise_discount
        )
    min_timestep = 0 if args.min_timestep is None else args.min_timestep
    max_timestep = noise_scheduler.config.num_train_timesteps if args.max_timestep is None else args.max_timestep
    timesteps = get_timesteps(min_timestep, max_timestep, latents.shape[0], latents.device)
    if args.ip_noise_gamma:
        strength = (
            torch.rand(1, device=latents.device) * args.ip_noise_gamma if args.ip_noise_gamma_random_strength else args.ip_noise_gamma
        )
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
        self._models: list = []
        self._optimizers: list = []
        self._save_model_state_pre_hook: OrderedDict = OrderedDict()
        self._load_model_state_pre_hook: OrderedDict = OrderedDict()
        self.gradient_accumulation_steps = 1
        self.step = 0
        self.sync_gradients = True
        self.end_of_dataloader = False

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

    # region state and accumulation (accelerate's contracts: prepare, accumulate, skip_first_batches,
    # save_state/load_state with their pre-hooks; the state holds the models, optimizers and RNG states)

    def prepare(self, *objects):
        out = []
        for obj in objects:
            if isinstance(obj, torch.nn.Module):
                self._models.append(obj)
            elif isinstance(obj, torch.optim.Optimizer):
                self._optimizers.append(obj)
            elif isinstance(obj, list):
                obj = TinyDataLoader(self, obj)
            out.append(obj)
        return out[0] if len(out) == 1 else tuple(out)

    @contextlib.contextmanager
    def accumulate(self, *models):
        """``Accelerator._do_sync``: sync at the end of the dataloader (counter reset) or every ``num_steps``."""
        if self.end_of_dataloader:
            self.step = 0
            self.sync_gradients = True
        else:
            self.step += 1
            self.sync_gradients = self.step % self.gradient_accumulation_steps == 0
        yield

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        return TinyDataLoader(self, dataloader.batches[num_batches:])

    def register_save_state_pre_hook(self, hook):
        return _register(self._save_model_state_pre_hook, hook)

    def register_load_state_pre_hook(self, hook):
        return _register(self._load_model_state_pre_hook, hook)

    def save_state(self, output_dir: str) -> None:
        os.makedirs(output_dir, exist_ok=True)
        weights = [m.state_dict() for m in self._models]
        for hook in self._save_model_state_pre_hook.values():
            hook(self._models, weights, output_dir)
        rng = {"torch": torch.get_rng_state(), "random": random.getstate()}
        optimizers = [o.state_dict() for o in self._optimizers]
        torch.save({"weights": weights, "optimizers": optimizers, "rng": rng}, os.path.join(output_dir, "tiny_state.pt"))

    def load_state(self, input_dir: str) -> None:
        models = list(self._models)
        for hook in self._load_model_state_pre_hook.values():
            hook(models, input_dir)
        state = torch.load(os.path.join(input_dir, "tiny_state.pt"), weights_only=False)
        for model, weights in zip(self._models, state["weights"], strict=True):
            model.load_state_dict(weights)
        for optimizer, saved in zip(self._optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(saved)
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["random"])

    # endregion


class _Handle:
    """``torch.utils.hooks.RemovableHandle``'s contract, as accelerate returns it."""

    def __init__(self, hooks: OrderedDict, key: int):
        self.hooks, self.key = hooks, key

    def remove(self) -> None:
        self.hooks.pop(self.key, None)


def _register(hooks: OrderedDict, hook) -> _Handle:
    key = max(hooks, default=-1) + 1
    hooks[key] = hook
    return _Handle(hooks, key)


class TinyDataLoader:
    """A prepared dataloader: iterating it tells the accelerator when its last batch comes (``end_of_dataloader``)."""

    def __init__(self, accelerator: TinyAccelerator, batches: list):
        self.accelerator, self.batches = accelerator, list(batches)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for i, batch in enumerate(self.batches):
            self.accelerator.end_of_dataloader = i == len(self.batches) - 1
            yield batch


def prepare_accelerator(args) -> TinyAccelerator:
    accelerator = TinyAccelerator()
    accelerator.gradient_accumulation_steps = int(args.gradient_accumulation_steps)
    return accelerator


# region state dirs and resume (tu:4772-4782, tu:5938-5999)

EPOCH_STATE_NAME = "{}-{:06d}-state"
LAST_STATE_NAME = "{}-state"
DEFAULT_LAST_OUTPUT_NAME = "last"
DEFAULT_STEP_NAME = "at"
STEP_STATE_NAME = "{}-step{:08d}-state"


def default_if_none(value, default):
    return default if value is None else value


def resume_from_local_or_hf_if_specified(accelerator, args):
    if not args.resume:
        return
    accelerator.load_state(args.resume)


def save_and_remove_state_stepwise(args, accelerator, step_no):
    model_name = default_if_none(args.output_name, DEFAULT_STEP_NAME)
    os.makedirs(args.output_dir, exist_ok=True)
    accelerator.save_state(os.path.join(args.output_dir, STEP_STATE_NAME.format(model_name, step_no)))


def save_state_on_train_end(args, accelerator):
    model_name = default_if_none(args.output_name, DEFAULT_LAST_OUTPUT_NAME)
    os.makedirs(args.output_dir, exist_ok=True)
    accelerator.save_state(os.path.join(args.output_dir, LAST_STATE_NAME.format(model_name)))


# endregion
