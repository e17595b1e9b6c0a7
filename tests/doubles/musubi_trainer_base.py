"""Double of musubi-tuner's ``training/trainer_base.py`` (main 30c658c4), for CI without musubi-tuner.

``NetworkTrainer`` keeps the host's method names and signatures, its σ sampler
(``get_noisy_model_input_and_timesteps``, the flow branch for ``uniform``/``sigmoid``/``shift``/
``flux_shift``/``flux2_shift``/``qwen_shift``/``logsnr`` and the scheduler-grid branch, with
``--min_timestep``/``--max_timestep``, ``--preserve_distribution_shape`` and timestep buckets, in the
host's order of RNG use), ``process_batch`` → ``call_dit`` → ``compute_loss`` (the elementwise
``torch.nn.functional.mse_loss`` × ``compute_loss_weighting_for_sd3``, then the mean), and ``train``'s call
order and loop arithmetic: ``_build_network`` (merging ``--base_weights`` through ``create_arch_network_from_weights``; with
``self``, ``args``, ``accelerator``,
``weight_dtype`` in its frame, called from ``train`` holding ``train_dataset_group`` and
``dit_dtype``) imports ``--network_module``, calls ``create_arch_network`` (else ``create_network``)
and ``network.prepare_network(args)`` only when the *module* has ``prepare_network``, then
``apply_to``; ``max_train_steps`` from ``--max_train_epochs`` after it; per batch
``scale_shift_latents`` → ``noise = torch.randn_like(latents)`` → ``process_batch`` → backward →
optimizer step (gradient accumulation as accelerate does it: ``TinyAccelerator``; on a sync under several
processes the gradients averaged with ``accelerator.reduce``); ``global_step`` +1 on each sync, with
``--save_every_n_steps`` the step's weights (and ``--save_state`` state) on the main process after
``wait_for_everyone``; ``generate_step_logs`` only with trackers (main process); break at ``max_train_steps``;
``wait_for_everyone`` at each epoch's end; ``accelerator.end_training()`` on every rank; then, on the main
process only, with ``--save_state`` the last state and the last ``save_weights``. ``--resume`` loads a state after ``accelerator.prepare`` and, as the host, restarts
``global_step`` at 0. The dataset serves
cached latents per bucket with the ``BucketBatchManager``'s stratified timestep pool
(dataset/bucket.py). Architectures live in ``musubi_trainers.py``.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import random
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

LAST_STATE_NAME = "{}-state"  # utils/train_utils.py
STEP_STATE_NAME = "{}-step{:08d}-state"
STEP_FILE_NAME = "{}-step{:08d}"


def get_lin_function(x1: float = 256, y1: float = 0.5, x2: float = 4096, y2: float = 1.15):
    m = (y2 - y1) / (x2 - x1)
    b = y1 - m * x1
    return lambda x: m * x + b


class FlowMatchDiscreteScheduler:
    """modules/scheduling_flow_match_discrete.py: the training grid (its shift is not applied to it)."""

    def __init__(self, num_train_timesteps: int = 1000, shift: float = 1.0, reverse: bool = True, solver: str = "euler"):
        sigmas = torch.linspace(1, 0, num_train_timesteps + 1)
        if not reverse:
            sigmas = sigmas.flip(0)
        self.sigmas = sigmas
        self.timesteps = (sigmas[:-1] * num_train_timesteps).to(dtype=torch.float32)
        self.config = SimpleNamespace(num_train_timesteps=num_train_timesteps, shift=shift)


def compute_density_for_timestep_sampling(weighting_scheme, batch_size, logit_mean=None, logit_std=None, mode_scale=None):
    if weighting_scheme == "logit_normal":
        u = torch.normal(mean=logit_mean, std=logit_std, size=(batch_size,), device="cpu")
        return torch.nn.functional.sigmoid(u)
    u = torch.rand(size=(batch_size,), device="cpu")
    if weighting_scheme == "mode":
        u = 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def get_sigmas(noise_scheduler, timesteps, device, n_dim=4, dtype=torch.float32):
    """training/timesteps.py: a timestep off the scheduler's grid (the flow branch's 1000·σ + 1) takes the nearest one."""
    sigmas = noise_scheduler.sigmas.to(device=device, dtype=dtype)
    schedule_timesteps = noise_scheduler.timesteps.to(device)
    timesteps = timesteps.to(device)
    if any([(schedule_timesteps == t).sum() == 0 for t in timesteps]):
        step_indices = [torch.argmin(torch.abs(schedule_timesteps - t)).item() for t in timesteps]
    else:
        step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]
    sigma = sigmas[step_indices].flatten()
    while len(sigma.shape) < n_dim:
        sigma = sigma.unsqueeze(-1)
    return sigma


def compute_loss_weighting_for_sd3(weighting_scheme: str, noise_scheduler, timesteps, device, dtype):
    """training/timesteps.py: ``sigma_sqrt`` and ``cosmap`` weight by the scheduler-grid σ of each timestep (B,1,1,1,1); else None."""
    if weighting_scheme == "sigma_sqrt" or weighting_scheme == "cosmap":
        sigmas = get_sigmas(noise_scheduler, timesteps, device, n_dim=5, dtype=dtype)
        if weighting_scheme == "sigma_sqrt":
            weighting = (sigmas**-2.0).float()
        else:
            bot = 1 - 2 * sigmas + 2 * sigmas**2
            weighting = 2 / (math.pi * bot)
    else:
        weighting = None
    return weighting


@dataclass
class DiTOutput:
    pred: torch.Tensor
    target: torch.Tensor
    extra: dict = field(default_factory=dict)


class _Handle:
    def __init__(self, hooks: list, hook: Any):
        self.hooks, self.hook = hooks, hook

    def remove(self) -> None:
        self.hooks.remove(self.hook)


class _AcceleratedOptimizer:
    """accelerate's ``AcceleratedOptimizer``: ``step`` and ``zero_grad`` act on the accumulation's last micro-batch only."""

    def __init__(self, optimizer, accelerator):
        self.optimizer, self.accelerator = optimizer, accelerator

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self):
        if self.accelerator.sync_gradients:
            self.optimizer.step()

    def zero_grad(self, set_to_none=True):
        if self.accelerator.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)


class _PreparedLoader:
    """accelerate's prepared dataloader: it tells the gradient state when its last batch is out."""

    def __init__(self, loader, accelerator):
        self.loader, self.accelerator = loader, accelerator

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        n = len(self.loader)
        for i, batch in enumerate(self.loader):
            self.accelerator.end_of_dataloader = i == n - 1
            yield batch


class TinyAccelerator:
    """The accelerate surface the loop and the plugin use, on CPU; gradient accumulation as accelerate does it
    (``accumulate`` syncs every ``gradient_accumulation_steps``-th micro-batch and at the dataloader's end,
    ``backward`` divides the loss, the prepared optimizer steps and zeroes on syncs only). Under an initialized
    ``torch.distributed`` group (gloo), as accelerate: ``process_index``/``num_processes`` from it, ``reduce``
    all-reduces (sum, or mean), ``wait_for_everyone`` is a barrier, ``prepare`` broadcasts a model's weights from rank 0
    (DDP's wrap), trackers exist on the main process only.
    The dataloader is not sharded: each rank serves its own dataset (``--data_seed``)."""

    def __init__(self, trackers: bool = False, gradient_accumulation_steps: int = 1):
        self.device = torch.device("cpu")
        self._distributed = dist.is_available() and dist.is_initialized()  # ranks from torch.distributed, as accelerate
        self.process_index = dist.get_rank() if self._distributed else 0
        self.num_processes = dist.get_world_size() if self._distributed else 1
        self.is_main_process = self.is_local_main_process = self.process_index == 0
        self.sync_gradients = True
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.end_of_dataloader = False
        self._micro = 0
        self.trackers = ["tracker"] if trackers and self.is_main_process else []  # init_trackers runs on main only
        self.logged: list[dict] = []
        self.save_hooks: list = []
        self.load_hooks: list = []
        self.ended = 0

    def prepare(self, *objects):
        objects = tuple(
            _AcceleratedOptimizer(o, self) if isinstance(o, torch.optim.Optimizer) else _PreparedLoader(o, self)
            if isinstance(o, TinyDatasetGroup) else o
            for o in objects
        )  # fmt: skip
        for o in objects:
            if isinstance(o, torch.nn.Module) and self._distributed and self.num_processes > 1:
                with torch.no_grad():  # DDP's wrap: every rank starts from rank 0's weights
                    for tensor in o.state_dict().values():
                        dist.broadcast(tensor, 0)
        return objects[0] if len(objects) == 1 else objects

    def unwrap_model(self, model):
        return model

    @contextmanager
    def accumulate(self, model):
        if self.end_of_dataloader:
            self._micro, self.sync_gradients = 0, True
        else:
            self._micro += 1
            self.sync_gradients = self._micro % self.gradient_accumulation_steps == 0
        yield

    def autocast(self):
        return nullcontext()

    def backward(self, loss):
        (loss / self.gradient_accumulation_steps if self.gradient_accumulation_steps > 1 else loss).backward()

    def reduce(self, tensor, reduction="sum"):
        if not self._distributed or self.num_processes == 1:
            return tensor
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out / self.num_processes if reduction == "mean" else out

    def log(self, logs, step=None):
        self.logged.append(dict(logs))

    def print(self, *args):
        pass

    def wait_for_everyone(self):
        if self._distributed and self.num_processes > 1:
            dist.barrier()

    def end_training(self):
        self.ended += 1

    def save_state(self, output_dir):
        os.makedirs(output_dir, exist_ok=True)
        for hook in list(self.save_hooks):
            hook([], [], output_dir)

    def load_state(self, input_dir):
        for hook in list(self.load_hooks):
            hook([], input_dir)

    def register_save_state_pre_hook(self, hook):
        self.save_hooks.append(hook)
        return _Handle(self.save_hooks, hook)

    def register_load_state_pre_hook(self, hook):
        self.load_hooks.append(hook)
        return _Handle(self.load_hooks, hook)


@dataclass
class BucketBatchManager:
    """dataset/bucket.py: batches per bucket key, and the epoch's stratified timestep pool (Python's ``random``)."""

    buckets: dict
    batch_size: int
    num_timestep_buckets: int | None = None
    timestep_pool: list | None = None
    bucket_batch_indices: list = field(default_factory=list)

    def __post_init__(self):
        for reso in sorted(self.buckets):
            for i in range(math.ceil(len(self.buckets[reso]) / self.batch_size)):
                self.bucket_batch_indices.append((reso, i))

    def shuffle(self):
        for bucket in self.buckets.values():
            random.shuffle(bucket)
        random.shuffle(self.bucket_batch_indices)
        if self.num_timestep_buckets is not None and self.num_timestep_buckets > 1:
            num_batches = len(self.bucket_batch_indices)
            needed = num_batches * self.batch_size
            per_bucket = math.ceil(needed / self.num_timestep_buckets)
            pool = [
                random.uniform(i / self.num_timestep_buckets, (i + 1) / self.num_timestep_buckets)
                for i in range(self.num_timestep_buckets)
                for _ in range(per_bucket)
            ]
            random.shuffle(pool)
            pool = pool[:needed]
            self.timestep_pool = [pool[i * self.batch_size : (i + 1) * self.batch_size] for i in range(num_batches)]

    def __len__(self):
        return len(self.bucket_batch_indices)

    def __getitem__(self, idx):
        reso, batch_idx = self.bucket_batch_indices[idx]
        items = self.buckets[reso][batch_idx * self.batch_size : (batch_idx + 1) * self.batch_size]
        batch = {key: torch.stack([item.data[key] for item in items]) for key in items[0].data if key != "text"}
        batch["text"] = [item.data["text"] for item in items]  # varlen: a list, as the host's varlen_ keys
        batch["timesteps"] = self.timestep_pool[idx][: len(items)] if self.timestep_pool is not None else None
        return batch


class TinyDataset:
    """Cached items per bucket: latents of the trainer's layout and a variable-length text embedding."""

    def __init__(self, args, trainer: NetworkTrainer, num_timestep_buckets):
        gen = torch.Generator().manual_seed(int(args.data_seed))
        self.batch_size = int(args.batch_size)
        self.has_control = False
        buckets = {}
        for key in args.buckets:
            w, h = key[0] // trainer.vae_factor, key[1] // trainer.vae_factor
            frames = key[2] if len(key) > 2 else None
            items = []
            for i in range(int(args.items_per_bucket)):
                latents = trainer.make_latents(frames, h, w, gen)
                data = {"latents": latents, "text": torch.randn(3 + i, 8, generator=gen), **trainer.extra_items(latents)}
                items.append(SimpleNamespace(item_key=f"{key}/{i}", frame_count=frames, data=data))  # an ItemInfo with its cached tensors
            buckets[tuple(key)] = items
        self.batch_manager = BucketBatchManager(buckets, self.batch_size, num_timestep_buckets)


class TinyDatasetGroup:
    def __init__(self, datasets):
        self.datasets = datasets
        self.num_train_items = sum(len(b) for d in datasets for b in d.batch_manager.buckets.values())

    def __len__(self):
        return sum(len(d.batch_manager) for d in self.datasets)

    def __iter__(self):
        for d in self.datasets:
            d.batch_manager.shuffle()
        for d in self.datasets:
            for i in range(len(d.batch_manager)):
                yield d.batch_manager[i]


class NetworkTrainer:
    vae_factor = 8

    def __init__(self):
        self.blocks_to_swap = None
        self.timestep_range_pool = []
        self.num_timestep_buckets = None
        self.calls: list[dict] = []  # what reached call_dit, per train step (not in the host)
        self.losses: list[float] = []
        self.last_network = None
        self.last_transformer = None

    # region model specific (the host's subclasses override these)

    @property
    def i2v_training(self) -> bool:
        return self._i2v_training

    @property
    def control_training(self) -> bool:
        return self._control_training

    def handle_model_specific_args(self, args):
        self._i2v_training = False
        self._control_training = False

    def load_transformer(self, accelerator, args, dit_path, attn_mode, split_attn, loading_device, dit_weight_dtype):
        raise NotImplementedError

    def make_latents(self, frames, h, w, generator):
        raise NotImplementedError

    def scale_shift_latents(self, latents):
        return latents

    def extra_items(self, latents):
        """Further cached tensors of an item, by key (not in the host: its caches hold what its caching script wrote)."""
        return {}

    def call_dit(self, args, accelerator, transformer_arg, latents, batch, noise, noisy_model_input, timesteps, network_dtype, **kwargs):
        raise NotImplementedError

    # endregion

    def get_bucketed_timestep(self) -> float:
        if self.num_timestep_buckets is None or self.num_timestep_buckets <= 1:
            return random.random()
        if len(self.timestep_range_pool) == 0:
            bucket_size = 1.0 / self.num_timestep_buckets
            for i in range(self.num_timestep_buckets):
                self.timestep_range_pool.append((i * bucket_size, (i + 1) * bucket_size))
            random.shuffle(self.timestep_range_pool)
        a, b = self.timestep_range_pool.pop()
        return random.uniform(a, b)

    def get_noisy_model_input_and_timesteps(self, args, noise, latents, timesteps, noise_scheduler, device, dtype):
        batch_size = noise.shape[0]
        if timesteps is not None:
            timesteps = torch.tensor(timesteps, device=device)

        def uniform_to_normal_ppF(t_uniform):
            t_uniform = torch.clamp(t_uniform, 1e-7, 1.0 - 1e-7)
            return math.sqrt(2.0) * torch.erfinv(2.0 * t_uniform - 1.0)

        if args.timestep_sampling in ("uniform", "sigmoid", "shift", "flux_shift", "qwen_shift", "krea2_shift", "logsnr", "flux2_shift"):

            def compute_sampling_timesteps(org_timesteps):
                def rand(bs, org_ts=None):
                    return torch.rand((bs,), device=device) if org_ts is None else org_ts

                def randn(bs, org_ts=None):
                    return uniform_to_normal_ppF(org_ts) if org_ts is not None else torch.randn((bs,), device=device)

                if args.timestep_sampling == "uniform" or args.timestep_sampling == "sigmoid":
                    if args.timestep_sampling == "sigmoid":
                        t = torch.sigmoid(args.sigmoid_scale * randn(batch_size, org_timesteps))
                    else:
                        t = rand(batch_size, org_timesteps)
                elif args.timestep_sampling.endswith("shift"):
                    if args.timestep_sampling == "shift":
                        shift = args.discrete_flow_shift
                    else:
                        h, w = latents.shape[-2:]
                        if args.timestep_sampling == "flux_shift":
                            mu = get_lin_function(y1=0.5, y2=1.15)((h // 2) * (w // 2))
                        elif args.timestep_sampling == "flux2_shift":
                            mu = get_lin_function(y1=0.5, y2=1.15)(h * w)
                        elif args.timestep_sampling == "krea2_shift":
                            mu = get_lin_function(x1=256, y1=0.5, x2=6400, y2=1.15)((h // 2) * (w // 2))
                        else:
                            mu = get_lin_function(x1=256, y1=0.5, x2=8192, y2=0.9)((h // 2) * (w // 2))
                        shift = math.exp(mu)
                    logits_norm = randn(batch_size, org_timesteps) * args.sigmoid_scale
                    t = logits_norm.sigmoid()
                    t = (t * shift) / (1 + (shift - 1) * t)
                else:  # logsnr
                    logsnr = torch.normal(mean=args.logit_mean, std=args.logit_std, size=(batch_size,), device=device)
                    t = torch.sigmoid(-logsnr / 2)
                return t

            t_min = (args.min_timestep if args.min_timestep is not None else 0) / 1000.0
            t_max = (args.max_timestep if args.max_timestep is not None else 1000.0) / 1000.0
            if not args.preserve_distribution_shape:
                t = compute_sampling_timesteps(timesteps)
                t = t * (t_max - t_min) + t_min
            else:
                available_t = []
                for _ in range(1000):
                    t = None
                    if self.num_timestep_buckets is not None:
                        t = torch.tensor([self.get_bucketed_timestep() for _ in range(batch_size)], device=device)
                    t = compute_sampling_timesteps(t)
                    for t_i in t:
                        if t_min <= t_i <= t_max:
                            available_t.append(t_i)
                        if len(available_t) == batch_size:
                            break
                    if len(available_t) == batch_size:
                        break
                t = torch.stack(available_t, dim=0)
            timesteps = t * 1000.0
            t = t.view(-1, 1, 1, 1, 1) if latents.ndim == 5 else t.view(-1, 1, 1, 1)
            noisy_model_input = (1 - t) * latents + t * noise
            timesteps += 1
        else:
            u = compute_density_for_timestep_sampling(args.weighting_scheme, batch_size, args.logit_mean, args.logit_std, args.mode_scale)
            t_min = args.min_timestep if args.min_timestep is not None else 0
            t_max = args.max_timestep if args.max_timestep is not None else 1000
            indices = (u * (t_max - t_min) + t_min).long()
            timesteps = noise_scheduler.timesteps[indices].to(device=device)
            sigmas = get_sigmas(noise_scheduler, timesteps, device, n_dim=latents.ndim, dtype=dtype)
            noisy_model_input = sigmas * noise + (1.0 - sigmas) * latents
        return noisy_model_input, timesteps

    def process_batch(
        self, args, accelerator, transformer, network, batch, latents, noise, noise_scheduler, dit_dtype, network_dtype, vae, global_step
    ):
        noisy_model_input, timesteps = self.get_noisy_model_input_and_timesteps(
            args, noise, latents, batch["timesteps"], noise_scheduler, accelerator.device, dit_dtype
        )
        output = self.call_dit(args, accelerator, transformer, latents, batch, noise, noisy_model_input, timesteps, network_dtype)
        return self.compute_loss(args, output, timesteps, noise_scheduler, dit_dtype, network_dtype, global_step)

    def compute_loss(self, args, output, timesteps, noise_scheduler, dit_dtype, network_dtype, global_step):
        weighting = compute_loss_weighting_for_sd3(args.weighting_scheme, noise_scheduler, timesteps, timesteps.device, dit_dtype)
        loss = torch.nn.functional.mse_loss(output.pred.to(network_dtype), output.target, reduction="none")
        if weighting is not None:
            loss = loss * weighting
        return loss.mean(), {}

    def generate_step_logs(self, args, current_loss, avr_loss, lr_scheduler, lr_descriptions, optimizer=None, *rest):
        return {"loss/current": current_loss, "loss/average": avr_loss}

    # region train (trainer_base.py's call order)

    def train(self, args):
        self.handle_model_specific_args(args)
        if args.seed is None:
            args.seed = random.randint(0, 2**32)
        random.seed(args.seed)
        torch.manual_seed(args.seed)  # accelerate's set_seed: random, NumPy, torch (CPU here)
        self.num_timestep_buckets = args.num_timestep_buckets
        train_dataset_group = TinyDatasetGroup([TinyDataset(args, self, self.num_timestep_buckets)])
        accelerator = TinyAccelerator(trackers=args.log_with is not None, gradient_accumulation_steps=args.gradient_accumulation_steps)
        weight_dtype = torch.float32
        dit_dtype = torch.float32 if args.dit_dtype is None else getattr(torch, args.dit_dtype)
        transformer = self.load_transformer(accelerator, args, args.dit, "torch", False, "cpu", dit_dtype)
        transformer.requires_grad_(False)
        self.last_transformer = transformer
        network = self._build_network(args, accelerator, transformer, None, weight_dtype)
        if network is None:
            return
        self.last_network = network
        trainable_params, _ = network.prepare_optimizer_params(unet_lr=args.learning_rate)
        optimizer = torch.optim.SGD(trainable_params, lr=args.learning_rate)
        train_dataloader = train_dataset_group
        if args.max_train_epochs is not None:
            args.max_train_steps = args.max_train_epochs * math.ceil(
                len(train_dataloader) / accelerator.num_processes / args.gradient_accumulation_steps
            )
        network, optimizer, train_dataloader = accelerator.prepare(network, optimizer, train_dataloader)
        network.prepare_grad_etc(transformer)
        if args.resume:  # resume_from_local_or_hf_if_specified: global_step still starts at 0
            accelerator.load_state(args.resume)
        self._run_training_loop(args, accelerator, train_dataloader, transformer, network, optimizer, dit_dtype)

    def _build_network(self, args, accelerator, transformer, vae, weight_dtype):
        network_module = importlib.import_module(args.network_module)
        for weight_path in args.base_weights or []:  # merged into the DiT before the network is built
            weights_sd = load_file(weight_path)
            module = network_module.create_arch_network_from_weights(1.0, weights_sd, unet=transformer, for_inference=True)
            module.merge_to(None, transformer, weights_sd, weight_dtype, "cpu")
        net_kwargs = {}
        if args.network_args is not None:
            for net_arg in args.network_args:
                key, value = net_arg.split("=")
                net_kwargs[key] = value
        if hasattr(network_module, "create_arch_network"):
            network = network_module.create_arch_network(
                1.0, args.network_dim, args.network_alpha, vae, None, transformer, neuron_dropout=args.network_dropout, **net_kwargs
            )
        else:
            network = network_module.create_network(1.0, args.network_dim, args.network_alpha, vae, None, transformer, **net_kwargs)
        if network is None:
            return None
        if hasattr(network_module, "prepare_network"):
            network.prepare_network(args)
        network.apply_to(None, transformer, apply_text_encoder=False, apply_unet=True)
        return network

    def _run_training_loop(self, args, accelerator, train_dataloader, transformer, network, optimizer, dit_dtype):
        num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
        num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
        global_step = 0
        noise_scheduler = FlowMatchDiscreteScheduler(shift=args.discrete_flow_shift, reverse=True, solver="euler")
        network_dtype = torch.float32
        for _ in range(num_train_epochs):
            network.on_epoch_start(transformer)
            for batch in train_dataloader:
                latents = batch["latents"]
                with accelerator.accumulate(network):
                    network.on_step_start()
                    latents = self.scale_shift_latents(latents)
                    noise = torch.randn_like(latents)
                    loss, loss_metrics = self.process_batch(
                        args,
                        accelerator,
                        transformer,
                        network,
                        batch,
                        latents,
                        noise,
                        noise_scheduler,
                        dit_dtype,
                        network_dtype,
                        None,
                        global_step,
                    )
                    accelerator.backward(loss)
                    if accelerator.sync_gradients and accelerator.num_processes > 1:  # the host's manual DDP sync
                        for param in network.parameters():
                            if param.grad is not None:
                                param.grad = accelerator.reduce(param.grad, reduction="mean")
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                if accelerator.sync_gradients:
                    global_step += 1
                    if args.save_every_n_steps is not None and global_step % args.save_every_n_steps == 0:
                        accelerator.wait_for_everyone()
                        if accelerator.is_main_process:
                            self._save_model(args, network, STEP_FILE_NAME.format(args.output_name, global_step) + ".safetensors")
                            if args.save_state:  # train_utils.save_and_remove_state_stepwise
                                accelerator.save_state(os.path.join(args.output_dir, STEP_STATE_NAME.format(args.output_name, global_step)))
                current_loss = loss.detach().item()
                self.losses.append(current_loss)
                if len(accelerator.trackers) > 0:
                    logs = self.generate_step_logs(args, current_loss, current_loss, None, None, optimizer, None, None, None)
                    logs.update(loss_metrics)
                    accelerator.log(logs, step=global_step)
                if global_step >= args.max_train_steps:
                    break
            accelerator.wait_for_everyone()
        accelerator.end_training()
        if accelerator.is_main_process and args.save_state:  # save_state_on_train_end, before the last weights
            accelerator.save_state(os.path.join(args.output_dir, LAST_STATE_NAME.format(args.output_name)))
        if accelerator.is_main_process:
            self._save_model(args, network, args.output_name + ".safetensors")

    def _save_model(self, args, network, ckpt_name):
        """The loop's ``save_model`` closure (main process): into ``--output_dir``, with the run's metadata."""
        os.makedirs(args.output_dir, exist_ok=True)
        network.save_weights(os.path.join(args.output_dir, ckpt_name), torch.float32, {"ss_seed": str(args.seed)})

    # endregion


def setup_parser() -> argparse.ArgumentParser:
    """trainer_base's options the double reads, with the host's defaults; ``--buckets`` and ``--items_per_bucket``
    stand in for the dataset config."""
    p = argparse.ArgumentParser()
    p.add_argument("--network_module", default=None)
    p.add_argument("--network_dim", type=int, default=None)
    p.add_argument("--network_alpha", type=float, default=1)
    p.add_argument("--network_dropout", type=float, default=None)
    p.add_argument("--network_args", nargs="*", default=None)
    p.add_argument("--dit", default="tiny.safetensors")
    p.add_argument("--dit_dtype", default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--learning_rate", type=float, default=1e-2)
    p.add_argument("--max_train_steps", type=int, default=4)
    p.add_argument("--max_train_epochs", type=int, default=None)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--timestep_sampling", default="sigma")
    p.add_argument("--discrete_flow_shift", type=float, default=1.0)
    p.add_argument("--sigmoid_scale", type=float, default=1.0)
    p.add_argument("--weighting_scheme", default="none")
    p.add_argument("--logit_mean", type=float, default=0.0)
    p.add_argument("--logit_std", type=float, default=1.0)
    p.add_argument("--mode_scale", type=float, default=1.29)
    p.add_argument("--min_timestep", type=int, default=None)
    p.add_argument("--max_timestep", type=int, default=None)
    p.add_argument("--preserve_distribution_shape", action="store_true")
    p.add_argument("--num_timestep_buckets", type=int, default=None)
    p.add_argument("--output_dir", default="out")
    p.add_argument("--output_name", default="last")
    p.add_argument("--save_every_n_steps", type=int, default=None)
    p.add_argument("--no_metadata", action="store_true")
    p.add_argument("--save_state", action="store_true")
    p.add_argument("--resume", default=None)
    p.add_argument("--base_weights", nargs="*", default=None)
    p.add_argument("--log_with", default=None)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--items_per_bucket", type=int, default=2)
    p.add_argument("--data_seed", type=int, default=1234)
    p.add_argument("--buckets", type=lambda s: tuple(int(x) for x in s.split("x")), nargs="+", default=[(64, 64)])
    # training/parser_common.py's --compile options, parsed and not applied: the tiny DiT is never compiled
    p.add_argument("--compile", action="store_true")
    p.add_argument("--compile_backend", type=str, default="inductor")
    p.add_argument("--compile_dynamic", type=str, default=None, choices=["true", "false", "auto"])
    p.add_argument("--compile_cache_size_limit", type=int, default=None)
    p.add_argument("--task", default="t2v-14B")
    p.add_argument("--dit_high_noise", default=None)
    p.add_argument("--timestep_boundary", type=int, default=None)
    return p


setup_parser_common = setup_parser  # training/parser_common.py's name: the double keeps the common options in one parser
