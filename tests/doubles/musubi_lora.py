"""Double of musubi-tuner's ``networks.lora_*`` modules: ``create_arch_network`` /
``create_arch_network_from_weights`` with the host's signatures, returning a small LoRA ``nn.Module``
with the network protocol ``NetworkTrainer`` calls (networks/lora.py ``LoRANetwork``). Like the
host's, this module has no module-level ``prepare_network``; the network has the method (a no-op)."""

from __future__ import annotations

import torch
from safetensors.torch import save_file
from torch import nn


class LoRAModule(nn.Module):
    def __init__(self, name: str, org: nn.Linear, dim: int, alpha: float):
        super().__init__()
        self.lora_name = name
        self.lora_down = nn.Linear(org.in_features, dim, bias=False)
        self.lora_up = nn.Linear(dim, org.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_down.weight, a=5**0.5)
        nn.init.zeros_(self.lora_up.weight)
        self.register_buffer("alpha", torch.tensor(float(alpha)))
        self.scale = alpha / dim
        self.org = [org]

    def apply_to(self) -> None:
        org = self.org[0]
        self.org_forward = org.forward
        org.forward = self.forward

    def forward(self, x):
        return self.org_forward(x) + self.lora_up(self.lora_down(x)) * self.scale


class LoRANetwork(nn.Module):
    def __init__(self, unet: nn.Module, dim: int, alpha: float, modules_dim=None, **kwargs):
        super().__init__()
        self.created_with = dict(kwargs)
        self.prepared_with = None
        self.merged = False
        self.unet_loras = []
        for name, module in unet.named_modules():
            if isinstance(module, nn.Linear):
                lora_name = "lora_unet_" + name.replace(".", "_")
                lora = LoRAModule(lora_name, module, (modules_dim or {}).get(lora_name, dim), alpha)
                self.unet_loras.append(lora)
                self.add_module(lora_name, lora)

    def prepare_network(self, args):
        self.prepared_with = args

    def apply_to(self, text_encoders, unet, apply_text_encoder=True, apply_unet=True):
        for lora in self.unet_loras:
            lora.apply_to()

    def merge_to(self, text_encoders, unet, weights_sd, dtype=None, device=None):
        self.merged = True

    def prepare_optimizer_params(self, unet_lr: float = 1e-4, **kwargs):
        return [{"params": [p for lora in self.unet_loras for p in lora.parameters()], "lr": unet_lr}], ["unet"]

    def prepare_grad_etc(self, unet):
        self.requires_grad_(True)

    def on_epoch_start(self, unet):
        self.train()

    def on_step_start(self):
        pass

    def get_trainable_params(self):
        return self.parameters()

    def save_weights(self, file, dtype, metadata):
        state = {k: v.detach().clone().to(dtype) for k, v in self.state_dict().items()}
        save_file(state, file, metadata)


def create_arch_network(multiplier, network_dim, network_alpha, vae, text_encoders, unet, neuron_dropout=None, **kwargs):
    return LoRANetwork(unet, network_dim or 4, network_alpha or 1.0, neuron_dropout=neuron_dropout, **kwargs)


def create_arch_network_from_weights(multiplier, weights_sd, text_encoders=None, unet=None, for_inference=False, **kwargs):
    dims = {k.split(".")[0]: v.shape[0] for k, v in weights_sd.items() if "lora_down" in k}
    network = LoRANetwork(unet, 4, 1.0, modules_dim=dims, for_inference=for_inference, **kwargs)
    network.load_state_dict(weights_sd, strict=False)
    return network
