"""sd-scripts host: the ``--network_module downscale_plugin`` entry points (host-sd-scripts contract in
``docs/ARCHITECTURE.md``).

``create_network`` / ``create_network_from_weights`` have the host's exact signatures. They pop the
plugin's keys, build the network with the inner module (``inner=`` or auto-detected from the
denoiser's class name) and return **that object itself**: the host type-checks it on save/resume,
DDP and DeepSpeed wrap it, and several inner modules override ``state_dict``. In a training run
they attach ``prepare_network(args)`` to it (chaining one the inner has). Outside a trainer, and
for ``for_inference=True`` (``--base_weights`` merges, ``gen_img.py``), they only delegate.

What a training run installs (``start.py``) is imported only when a run starts, so inference tools
that import this module only delegate; importing the package itself loads no torch (the startup check
imports ``startup.py`` from it).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..kohya.conventions import import_inner, inner_name, network_args_dict, split_network_args
from .facts import INNER_BY_DENOISER, KNOWN_INNERS, HostError

ENTRIES = (("create_network",), ("create_network_from_weights",))  # what sd-scripts' trainers call


def inner_module(name: str | None, unet: Any) -> tuple[str, ModuleType]:
    """Import the inner module: ``name``, else the one for this denoiser class (both entries sd-scripts calls)."""
    return import_inner(name, unet, INNER_BY_DENOISER, KNOWN_INNERS, ENTRIES, HostError)


def create_network(multiplier, network_dim, network_alpha, vae, text_encoder, unet, neuron_dropout=None, **kwargs):
    from .trainer import find_trainer  # torch and the run's machinery load with a network, not with the package

    ctx = find_trainer()
    plugin_keys, inner_kwargs = split_network_args(kwargs)
    name, module = inner_module(inner_name(plugin_keys, ctx.args if ctx is not None else None), unet)
    network = module.create_network(
        multiplier, network_dim, network_alpha, vae, text_encoder, unet, neuron_dropout=neuron_dropout, **inner_kwargs
    )
    return network if ctx is None or network is None else _attach(network, name, plugin_keys)


def create_network_from_weights(multiplier, file, vae, text_encoder, unet, weights_sd=None, for_inference=False, **kwargs):
    from .trainer import find_trainer

    ctx = find_trainer()
    plugin_keys, inner_kwargs = split_network_args(kwargs)
    config_keys = plugin_keys
    if ctx is not None and for_inference and not kwargs:
        # A --base_weights merge gets no network_args (train_network.py merges --base_weights before it parses them); the run's own inner= still applies.
        config_keys = split_network_args(network_args_dict(getattr(ctx.args, "network_args", None)))[0]
    name, module = inner_module(inner_name(config_keys, ctx.args if ctx is not None else None), unet)
    network, weights_sd = module.create_network_from_weights(
        multiplier, file, vae, text_encoder, unet, weights_sd=weights_sd, for_inference=for_inference, **inner_kwargs
    )
    if (
        ctx is not None and not for_inference
    ):  # --dim_from_weights: this is the training network (train_network.py builds it from the weights file)
        network = _attach(network, name, plugin_keys)
    return network, weights_sd


def _attach(network: Any, inner_name: str, plugin_keys: dict[str, str]) -> Any:
    """Give the inner network a ``prepare_network(args)`` (instance attribute; an inner one runs first)."""
    previous = getattr(network, "prepare_network", None)

    def prepare_network(args: Any) -> None:
        from .start import start  # the run's machinery (plan, accounting) only loads for training

        if previous is not None:
            previous(args)
        start(network, inner_name, plugin_keys, args)

    network.prepare_network = prepare_network
    return network
