"""Double of sd-scripts' ``train_network.py``: ``NetworkTrainer`` (SD 1.x/2.x) and the shared loop.

``train(args)`` keeps the host's order of the calls a network module sees (tn:491-1727): datasets,
``current_step`` Value, accelerator, models, ``importlib.import_module(args.network_module)``,
``--base_weights`` merges via ``create_network_from_weights(..., for_inference=True)``,
``create_network``/``create_network_from_weights`` called from ``train`` itself, ``prepare_network(args)``,
``apply_to``, the optimizer, ``max_train_steps`` from epochs, ``accelerator.prepare``, the host's
state hooks (``train_state.json``) and ``--resume``, its initial-step / epoch / skip arithmetic
(``--initial_step``, ``--initial_epoch``, ``--skip_until_initial_step``, the state's step; the same
locals: ``train_dataloader``, ``epoch_to_start``, ``global_step``), per batch ``current_step.value =
global_step`` → ``process_batch`` → backward → step on accelerate's sync, ``--save_every_n_steps``
weights and ``--save_state`` states, ``generate_step_logs`` on the main process only,
``accelerator.end_training()``, the last state, then the last ``save_weights``. Data are cached
latents drawn from a private generator, so the global RNG is the trainer's alone, as in a
cached-latents host run.
"""

import argparse
import importlib
import json
import math
import os
from multiprocessing import Value
from types import SimpleNamespace

import torch
from library import custom_train_functions, tiny_models, train_util

from downscale_plugin.sigma import ddpm_alphas_cumprod


class TinyDDPMScheduler:
    """The training surface of diffusers' ``DDPMScheduler(scaled_linear, 0.00085, 0.012, 1000)``."""

    def __init__(self):
        self.config = SimpleNamespace(num_train_timesteps=1000)
        self.alphas_cumprod = ddpm_alphas_cumprod().float()

    def _coefficients(self, timesteps, like):
        a = self.alphas_cumprod.to(like.device)[timesteps].view(-1, *([1] * (like.ndim - 1)))
        return a.sqrt(), (1 - a).sqrt()

    def add_noise(self, latents, noise, timesteps):
        signal, sigma = self._coefficients(timesteps, latents)
        return signal * latents + sigma * noise

    def get_velocity(self, latents, noise, timesteps):
        signal, sigma = self._coefficients(timesteps, latents)
        return signal * noise - sigma * latents


class TinyDataset:
    """One bucket of cached latents (``resolution`` in pixels, W,H), with a bucket manager."""

    def __init__(self, args, vae_factor: int, channels: int, text_conds):
        width, height = (int(v) for v in str(args.resolution).split(","))
        self.batch_size = args.train_batch_size
        self.bucket_manager = SimpleNamespace(resos=[(width, height)], buckets=[list(range(args.dataset_size))])
        gen = torch.Generator().manual_seed(args.data_seed)
        self.batches = []
        for _ in range(math.ceil(args.dataset_size / self.batch_size)):
            latents = torch.randn(self.batch_size, channels, height // vae_factor, width // vae_factor, generator=gen)
            self.batches.append(
                {
                    "latents": latents,
                    "text_encoder_outputs_list": text_conds(self.batch_size, gen),
                    "loss_weights": torch.ones(self.batch_size),
                    "alpha_masks": None,
                    # sd-scripts' size conditioning (library/train_util.py): each image's source size, its crop's
                    # top-left in the bucket's pixels, the bucket (the cached latent's size × 8)
                    "original_sizes_hw": torch.tensor([[height * 3 // 2, width * 2]] * self.batch_size),
                    "crop_top_lefts": torch.tensor([[height // 4, 0]] * self.batch_size),
                    "target_sizes_hw": torch.tensor([[height, width]] * self.batch_size),
                }
            )
        if args.distinct_images is not None:  # the rest repeat them: one picture in the dataset under several names
            samples = [latent for batch in self.batches for latent in batch["latents"]]
            for i in range(args.distinct_images, len(samples)):
                samples[i].copy_(samples[i % args.distinct_images])


class TinyDatasetGroup:
    def __init__(self, datasets):
        self.datasets = datasets

    def __len__(self):
        return sum(len(d.batches) for d in self.datasets)

    def __iter__(self):
        for dataset in self.datasets:
            yield from dataset.batches


class NetworkTrainer:
    denoiser = tiny_models.UNet2DConditionModel
    vae_factor = 8
    latent_channels = 4

    def __init__(self):
        self.vae_scale_factor = 0.18215
        self.is_sdxl = False

    # region model-specific (the host's subclass overrides)

    def load_target_model(self, args, weight_dtype, accelerator):
        with torch.random.fork_rng(devices=[]):  # the "checkpoint": fixed weights, the run's RNG untouched
            torch.manual_seed(args.model_seed)
            return "tiny", [torch.nn.Identity()], None, self.denoiser(self.latent_channels)

    def text_conds(self, bsz: int, gen: torch.Generator) -> list:
        return [torch.randn(bsz, 7, 8, generator=gen)]

    def get_noise_scheduler(self, args, device):
        return TinyDDPMScheduler()

    def shift_scale_latents(self, args, latents):
        return latents * self.vae_scale_factor

    def call_unet(self, args, accelerator, unet, noisy_latents, timesteps, text_conds, batch, weight_dtype, indices=None):
        return unet(noisy_latents, timesteps, text_conds[0]).sample

    def get_noise_pred_and_target(
        self, args, accelerator, noise_scheduler, latents, batch, text_encoder_conds, unet, network, weight_dtype, train_unet, is_train=True
    ):
        noise, noisy_latents, timesteps = train_util.get_noise_noisy_latents_and_timesteps(args, noise_scheduler, latents)
        if args.gradient_checkpointing:  # the host's "ensure the hidden state will require grad"
            for t in text_encoder_conds:
                t.requires_grad_(True)
        with torch.set_grad_enabled(is_train), accelerator.autocast():
            noise_pred = self.call_unet(
                args, accelerator, unet, noisy_latents.requires_grad_(train_unet), timesteps, text_encoder_conds, batch, weight_dtype
            )
        target = noise_scheduler.get_velocity(latents, noise, timesteps) if args.v_parameterization else noise
        return noise_pred, target, timesteps, None

    def prepare_unet_with_accelerator(self, args, accelerator, unet):
        return unet

    def post_process_loss(self, loss, args, timesteps, noise_scheduler):
        return loss

    # endregion

    def process_batch(
        self,
        batch,
        text_encoders,
        unet,
        network,
        vae,
        noise_scheduler,
        vae_dtype,
        weight_dtype,
        accelerator,
        args,
        text_encoding_strategy,
        tokenize_strategy,
        is_train=True,
        train_text_encoder=True,
        train_unet=True,
    ) -> torch.Tensor:
        with torch.no_grad():
            latents = self.shift_scale_latents(args, batch["latents"].to(accelerator.device))
        text_encoder_conds = batch.get("text_encoder_outputs_list")
        noise_pred, target, timesteps, weighting = self.get_noise_pred_and_target(
            args,
            accelerator,
            noise_scheduler,
            latents,
            batch,
            text_encoder_conds,
            unet,
            network,
            weight_dtype,
            train_unet,
            is_train=is_train,
        )
        huber_c = train_util.get_huber_threshold_if_needed(args, timesteps, noise_scheduler)
        loss = train_util.conditional_loss(noise_pred.float(), target.float(), args.loss_type, "none", huber_c)
        if weighting is not None:
            loss = loss * weighting
        if args.masked_loss or batch.get("alpha_masks") is not None:
            loss = custom_train_functions.apply_masked_loss(loss, batch)
        loss = loss.mean(dim=list(range(1, loss.ndim))) * batch["loss_weights"]
        return self.post_process_loss(loss, args, timesteps, noise_scheduler).mean()

    def generate_step_logs(
        self,
        args,
        current_loss,
        avr_loss,
        lr_scheduler,
        lr_descriptions,
        optimizer=None,
        keys_scaled=None,
        mean_norm=None,
        maximum_norm=None,
        mean_grad_norm=None,
        mean_combined_norm=None,
    ):
        return {"loss/current": current_loss, "loss/average": avr_loss}

    def step_logging(self, accelerator, logs, global_step, epoch):
        accelerator.log(logs, step=global_step)

    def save_model(self, args, network, name, global_step):
        if args.output_dir is None:
            return
        os.makedirs(args.output_dir, exist_ok=True)
        metadata = {"ss_network_module": args.network_module, "ss_steps": str(global_step)}
        path = os.path.join(args.output_dir, f"{name}.{args.save_model_as}")
        network.save_weights(path, None, {} if args.no_metadata else metadata)

    def all_reduce_network(self, accelerator, network):
        for param in network.parameters():
            if param.grad is not None:
                param.grad = accelerator.reduce(param.grad, reduction="mean")

    def train(self, args):
        if args.seed is None:
            args.seed = 0
        torch.manual_seed(args.seed)
        train_dataset_group = TinyDatasetGroup([TinyDataset(args, self.vae_factor, self.latent_channels, self.text_conds)])
        current_epoch = Value("i", 0)
        current_step = Value("i", 0)
        accelerator = train_util.prepare_accelerator(args)
        weight_dtype = vae_dtype = torch.float32
        _, text_encoder, vae, unet = self.load_target_model(args, weight_dtype, accelerator)
        text_encoders = text_encoder
        network_module = importlib.import_module(args.network_module)
        for weight_path in args.base_weights or []:
            module, weights_sd = network_module.create_network_from_weights(1.0, weight_path, vae, text_encoder, unet, for_inference=True)
            module.merge_to(text_encoder, unet, weights_sd, weight_dtype, "cpu")
        net_kwargs = {}
        for net_arg in args.network_args or []:
            key, value = net_arg.split("=", 1)
            net_kwargs[key] = value
        if args.dim_from_weights:
            network, _ = network_module.create_network_from_weights(1, args.network_weights, vae, text_encoder, unet, **net_kwargs)
        else:
            if "dropout" not in net_kwargs:
                net_kwargs["dropout"] = args.network_dropout
            network = network_module.create_network(
                1.0, args.network_dim, args.network_alpha, vae, text_encoder, unet, neuron_dropout=args.network_dropout, **net_kwargs
            )
        if network is None:
            return
        if hasattr(network, "prepare_network"):
            network.prepare_network(args)
        network.apply_to(text_encoder, unet, False, True)
        if args.network_weights is not None:
            network.load_weights(args.network_weights)
        if args.gradient_checkpointing:
            if args.cpu_offload_checkpointing:
                unet.enable_gradient_checkpointing(cpu_offload=True)
            else:
                unet.enable_gradient_checkpointing()
        unet = self.prepare_unet_with_accelerator(args, accelerator, unet)
        if args.gradient_checkpointing:
            unet.train()
        params, lr_descriptions = network.prepare_optimizer_params(None, args.unet_lr, args.learning_rate)
        optimizer = torch.optim.SGD(params, lr=args.learning_rate)
        train_dataloader = list(train_dataset_group)
        if args.max_train_epochs is not None:
            args.max_train_steps = args.max_train_epochs * math.ceil(
                len(train_dataloader) / accelerator.num_processes / args.gradient_accumulation_steps
            )
        network, optimizer, train_dataloader = accelerator.prepare(network, optimizer, train_dataloader)

        # the host's resume and skip arithmetic, verbatim in effect (tn:930-975, 1232-1273, 1340-1344, 1401-1418)
        def save_model_hook(models, weights, output_dir):
            with open(os.path.join(output_dir, "train_state.json"), "w", encoding="utf-8") as f:
                json.dump({"current_epoch": current_epoch.value, "current_step": current_step.value + 1}, f)

        steps_from_state = None

        def load_model_hook(models, input_dir):
            nonlocal steps_from_state
            train_state_file = os.path.join(input_dir, "train_state.json")
            if os.path.exists(train_state_file):
                with open(train_state_file, encoding="utf-8") as f:
                    steps_from_state = json.load(f)["current_step"]

        accelerator.register_save_state_pre_hook(save_model_hook)
        accelerator.register_load_state_pre_hook(load_model_hook)
        train_util.resume_from_local_or_hf_if_specified(accelerator, args)

        num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
        num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
        noise_scheduler = self.get_noise_scheduler(args, accelerator.device)
        del train_dataset_group
        network.prepare_grad_etc(text_encoder, unet)

        initial_step = 0
        if args.initial_epoch is not None or args.initial_step is not None:
            if args.initial_step is not None:
                initial_step = args.initial_step
            else:
                initial_step = (args.initial_epoch - 1) * math.ceil(
                    len(train_dataloader) / accelerator.num_processes / args.gradient_accumulation_steps
                )
        elif steps_from_state is not None:
            initial_step = steps_from_state
            steps_from_state = None
        if initial_step > 0:
            assert args.max_train_steps > initial_step, f"max_train_steps {args.max_train_steps} vs initial step {initial_step}"
        epoch_to_start = 0
        if initial_step > 0:
            if args.skip_until_initial_step:
                initial_step *= args.gradient_accumulation_steps
                epoch_to_start = initial_step // math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
            else:
                epoch_to_start = initial_step // math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
                initial_step = 0
        global_step = 0
        if initial_step > 0:
            for _ in range(epoch_to_start):
                initial_step -= len(train_dataloader)
            global_step = initial_step

        is_tracking = len(accelerator.trackers) > 0
        losses = []
        for epoch in range(epoch_to_start, num_train_epochs):
            current_epoch.value = epoch + 1
            network.on_epoch_start(text_encoder, unet)
            skipped_dataloader = None
            if initial_step > 0:
                skipped_dataloader = accelerator.skip_first_batches(train_dataloader, initial_step - 1)
                initial_step = 1
            for batch in skipped_dataloader or train_dataloader:
                current_step.value = global_step
                if initial_step > 0:
                    initial_step -= 1
                    continue
                with accelerator.accumulate(network):
                    loss = self.process_batch(
                        batch, text_encoders, unet, network, vae, noise_scheduler, vae_dtype, weight_dtype, accelerator, args, None, None
                    )
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        self.all_reduce_network(accelerator, network)
                        optimizer.step()  # accelerate's optimizer steps only on a sync
                        optimizer.zero_grad(set_to_none=True)
                if accelerator.sync_gradients:
                    global_step += 1
                    if args.save_every_n_steps is not None and global_step % args.save_every_n_steps == 0:
                        accelerator.wait_for_everyone()
                        if accelerator.is_main_process:
                            self.save_model(args, network, f"{args.output_name}-step{global_step:08d}", global_step)
                            if args.save_state:
                                train_util.save_and_remove_state_stepwise(args, accelerator, global_step)
                losses.append(loss.detach().item())
                if is_tracking:
                    logs = self.generate_step_logs(args, losses[-1], sum(losses) / len(losses), None, lr_descriptions, optimizer)
                    self.step_logging(accelerator, logs, global_step, epoch + 1)
                if global_step >= args.max_train_steps:
                    break
        accelerator.end_training()
        if accelerator.is_main_process and (args.save_state or args.save_state_on_train_end):
            train_util.save_state_on_train_end(args, accelerator)
        if accelerator.is_main_process and args.output_dir is not None:
            self.save_model(args, network, args.output_name, global_step)
        self.last_run = SimpleNamespace(
            args=args, network=network, unet=unet, accelerator=accelerator, losses=losses, global_step=global_step
        )


def setup_parser() -> argparse.ArgumentParser:
    """The subset of the host's options the doubles and the plugin read, with the host's defaults."""
    p = argparse.ArgumentParser()
    for name, default in {
        "network_module": None,
        "network_dim": None,
        "network_alpha": 1.0,
        "network_dropout": None,
        "network_weights": None,
        "output_dir": None,
        "output_name": "last",
        "config_file": None,
        "resume": None,
        "dynamo_backend": "no",
        "deepspeed": None,
        "resolution": "64,64",
    }.items():
        p.add_argument(f"--{name}", default=default)
    for name, default in {
        "max_train_steps": 1600,
        "max_train_epochs": None,
        "gradient_accumulation_steps": 1,
        "seed": None,
        "min_timestep": None,
        "max_timestep": None,
        "train_batch_size": 1,
        "initial_step": None,
        "initial_epoch": None,
        "save_every_n_steps": None,
        "blocks_to_swap": None,
        "dataset_size": 4,
        "data_seed": 1234,
        "distinct_images": None,
        "model_seed": 42,
        "multires_noise_iterations": None,
    }.items():
        p.add_argument(f"--{name}", type=int, default=default)
    for name, default in {
        "learning_rate": 1e-2,
        "unet_lr": None,
        "noise_offset": None,
        "ip_noise_gamma": None,
        "multires_noise_discount": 0.3,
        "adaptive_noise_scale": None,
        "sigmoid_scale": 1.0,
        "discrete_flow_shift": 3.0,
        "logit_mean": 0.0,
        "logit_std": 1.0,
        "mode_scale": 1.29,
        "guidance_scale": 3.5,
        "training_shift": 1.0,
    }.items():
        p.add_argument(f"--{name}", type=float, default=default)
    for flag in (
        "dim_from_weights",
        "no_metadata",
        "masked_loss",
        "v_parameterization",
        "noise_offset_random_strength",
        "ip_noise_gamma_random_strength",
        "torch_compile",
        "apply_t5_attn_mask",
        "enable_scaled_pos_embed",
        "gradient_checkpointing",
        "cpu_offload_checkpointing",
        "skip_until_initial_step",
        "save_state",
        "save_state_on_train_end",
        "resume_from_huggingface",
    ):
        p.add_argument(f"--{flag}", action="store_true")
    p.add_argument("--network_args", nargs="*")
    p.add_argument("--base_weights", nargs="*")
    p.add_argument("--save_model_as", default="safetensors")
    p.add_argument("--loss_type", default="l2")
    p.add_argument("--timestep_sampling", default="sigma")
    p.add_argument("--weighting_scheme", default="uniform")
    p.add_argument("--model_prediction_type", default="sigma_scaled")
    p.add_argument("--model_type", default="flux")
    return p


if __name__ == "__main__":
    NetworkTrainer().train(setup_parser().parse_args())
