"""musubi-tuner host: the ``--network_module downscale_plugin`` entry points (docs/ARCHITECTURE.md §3).

``NetworkTrainer._build_network`` (training/trainer_base.py) imports the module, calls
``create_arch_network(1.0, dim, alpha, vae, None, transformer, neuron_dropout=…, **net_kwargs)``
(``create_arch_network_from_weights(multiplier, weights_sd, unet=…, for_inference=True)`` per
``--base_weights``), and then, if the *module* has ``prepare_network``, calls the *network's*
``prepare_network(args)``. So this package exports a module-level :func:`prepare_network` and gives
the network a ``prepare_network`` method.

The entry points pop the plugin's keys, build the network with the inner module (``inner=`` or
auto-detected from the DiT's class name) and return **that object itself**. The inner network's own
``prepare_network`` runs first exactly when musubi-tuner would have called it: when the inner module
has a module-level ``prepare_network``. Outside a trainer, and for ``for_inference=True``, they only
delegate. What a training run installs (``start.py``) is imported only when a run starts.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..kohya.conventions import import_inner, inner_name, network_args_dict, split_network_args
from .facts import INNER_BY_DENOISER, KNOWN_INNERS, HostError
from .trainer import find_trainer

ENTRY = "create_arch_network"
FALLBACK = "create_network"  # LyCORIS' name, which musubi-tuner falls back to


def inner_module(name: str | None, transformer: Any) -> tuple[str, ModuleType]:
    """Import the inner module: ``name``, else the one for this DiT class."""
    return import_inner(name, transformer, INNER_BY_DENOISER, KNOWN_INNERS, ((ENTRY, FALLBACK),), HostError)


def create_arch_network(multiplier, network_dim, network_alpha, vae, text_encoders, unet, neuron_dropout=None, **kwargs):
    ctx = find_trainer()
    plugin_keys, inner_kwargs = split_network_args(kwargs)
    name, module = inner_module(inner_name(plugin_keys, ctx.args if ctx is not None else None), unet)
    if callable(getattr(module, ENTRY, None)):
        network = module.create_arch_network(
            multiplier, network_dim, network_alpha, vae, text_encoders, unet, neuron_dropout=neuron_dropout, **inner_kwargs
        )
    else:  # as musubi-tuner calls a LyCORIS-style module: no neuron_dropout
        network = module.create_network(multiplier, network_dim, network_alpha, vae, text_encoders, unet, **inner_kwargs)
    return network if ctx is None or network is None else _attach(network, name, module, plugin_keys)


def create_arch_network_from_weights(multiplier, weights_sd, text_encoders=None, unet=None, for_inference=False, **kwargs):
    """The inner module's network for these weights; a ``--base_weights`` merge (``for_inference``) gets no
    network_args from musubi-tuner, so the run's own ``inner=`` applies."""
    ctx = find_trainer()
    plugin_keys, inner_kwargs = split_network_args(kwargs)
    if ctx is not None and for_inference and not kwargs:
        plugin_keys = split_network_args(network_args_dict(getattr(ctx.args, "network_args", None)))[0]
    _, module = inner_module(inner_name(plugin_keys, ctx.args if ctx is not None else None), unet)
    if not callable(getattr(module, "create_arch_network_from_weights", None)):
        raise HostError(f"inner: {module.__name__} has no create_arch_network_from_weights for musubi-tuner's --base_weights")
    return module.create_arch_network_from_weights(
        multiplier, weights_sd, text_encoders=text_encoders, unet=unet, for_inference=for_inference, **inner_kwargs
    )


def prepare_network(network: Any, args: Any) -> None:
    """Start the run for a network built by :func:`create_arch_network` (what its ``prepare_network(args)`` does).

    musubi-tuner reads this name's presence on the module as the flag to call the network's method."""
    network.prepare_network(args)


def _attach(network: Any, inner_name: str, inner: ModuleType, plugin_keys: dict[str, str]) -> Any:
    """Give the inner network a ``prepare_network(args)`` (instance attribute; the inner's own runs first when
    musubi-tuner would have called it, i.e. when its module has a module-level ``prepare_network``)."""
    previous = getattr(network, "prepare_network", None) if hasattr(inner, "prepare_network") else None

    def prepare_network(args: Any) -> None:
        from .start import start  # the run's machinery (plan, accounting) only loads for training

        if previous is not None:
            previous(args)
        start(network, inner_name, plugin_keys, args)

    network.prepare_network = prepare_network
    return network
