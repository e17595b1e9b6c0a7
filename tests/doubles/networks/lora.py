"""Double of ``networks.lora``: a small LoRA network with the host's network protocol.

``LoRANetwork`` is what every ``networks.lora_*`` double returns: one LoRA per ``nn.Linear`` of the
denoiser, an ``alpha`` buffer per module (the host saves it), and the methods the trainer calls
(tn:690-1476). ``created_with`` keeps the kwargs the factory got, so tests can see what reached it.
"""

import os

import torch
from safetensors.torch import load_file, save_file
from torch import nn


class LoRAModule(nn.Module):
    def __init__(self, name: str, org: nn.Linear, multiplier: float, dim: int, alpha: float):
        super().__init__()
        self.lora_name = name
        self.lora_down = nn.Linear(org.in_features, dim, bias=False)
        self.lora_up = nn.Linear(dim, org.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_down.weight, a=5**0.5)
        nn.init.zeros_(self.lora_up.weight)
        self.register_buffer("alpha", torch.tensor(float(alpha)))
        self.scale = alpha / dim
        self.multiplier = multiplier
        self.org = [org]  # not a submodule: the denoiser's weights are not the network's

    def apply_to(self) -> None:
        org = self.org[0]
        self.org_forward = org.forward
        org.forward = self.forward

    def forward(self, x):
        return self.org_forward(x) + self.lora_up(self.lora_down(x)) * self.multiplier * self.scale


class LoRANetwork(nn.Module):
    def __init__(self, unet: nn.Module, multiplier: float = 1.0, lora_dim: int = 4, alpha: float = 1.0, modules_dim=None, **kwargs):
        super().__init__()
        self.multiplier = multiplier
        self.train_t5xxl = False
        self.created_with = dict(kwargs)
        loras = []
        for name, module in unet.named_modules():
            if isinstance(module, nn.Linear):
                lora_name = "lora_unet_" + name.replace(".", "_")
                dim = modules_dim.get(lora_name, lora_dim) if modules_dim else lora_dim
                loras.append(LoRAModule(lora_name, module, multiplier, dim, alpha))
        self.unet_loras = loras  # a plain list; each LoRA is registered under its own name, as in the host
        self.text_encoder_loras = []
        for lora in loras:
            self.add_module(lora.lora_name, lora)

    def set_multiplier(self, multiplier: float) -> None:
        self.multiplier = multiplier
        for lora in self.unet_loras:
            lora.multiplier = multiplier

    def apply_to(self, text_encoder, unet, apply_text_encoder=True, apply_unet=True) -> None:
        if apply_unet:
            for lora in self.unet_loras:
                lora.apply_to()

    def load_weights(self, file: str):
        return self.load_state_dict(load_file(file), strict=False)

    def merge_to(self, text_encoder, unet, weights_sd, dtype=None, device=None) -> None:
        self.load_state_dict(weights_sd, strict=False)
        with torch.no_grad():
            for lora in self.unet_loras:
                org = lora.org[0]
                org.weight += (lora.lora_up.weight @ lora.lora_down.weight) * lora.multiplier * lora.scale

    def prepare_optimizer_params(self, text_encoder_lr, unet_lr, default_lr=None):
        params = [p for lora in self.unet_loras for p in lora.parameters()]
        return [{"params": params, "lr": unet_lr or default_lr}], ["unet"]

    def enable_gradient_checkpointing(self) -> None:
        pass

    def prepare_grad_etc(self, text_encoder, unet) -> None:
        self.requires_grad_(True)

    def on_epoch_start(self, text_encoder, unet) -> None:
        self.train()

    def get_trainable_params(self):
        return self.parameters()

    def save_weights(self, file: str, dtype, metadata) -> None:
        if metadata is not None and len(metadata) == 0:
            metadata = None
        state_dict = {k: v.detach().clone().to("cpu", dtype=dtype or v.dtype) for k, v in self.state_dict().items()}
        if os.path.splitext(file)[1] == ".safetensors":
            save_file(state_dict, file, metadata)
        else:
            torch.save(state_dict, file)


def create_network(multiplier, network_dim, network_alpha, vae, text_encoder, unet, neuron_dropout=None, **kwargs):
    return LoRANetwork(unet, multiplier, network_dim or 4, network_alpha or 1.0, neuron_dropout=neuron_dropout, **kwargs)


def create_network_from_weights(multiplier, file, vae, text_encoder, unet, weights_sd=None, for_inference=False, **kwargs):
    if weights_sd is None:
        weights_sd = load_file(file) if file.endswith(".safetensors") else torch.load(file, map_location="cpu")
    dims = {k.split(".")[0]: v.shape[0] for k, v in weights_sd.items() if k.endswith("lora_down.weight")}
    network = LoRANetwork(unet, multiplier, 4, 1.0, modules_dim=dims, for_inference=for_inference, **kwargs)
    return network, weights_sd
