"""downscale-plugin: train diffusion LoRAs on area-downsampled latents inside validated σ windows.

Every name is imported on first use, so importing the package (a trainer importing its
``--network_module``, the startup check) loads neither torch nor a host module until it is needed.
"""

from __future__ import annotations

import importlib

__version__ = "0.2.0"

# Public name → the module that defines it.
_EXPORTS = {
    "ConfigError": ".config",
    "DownscaleConfig": ".config",
    "RouteRule": ".config",
    "load_config": ".config",
    "RouteDecision": ".router",
    "Router": ".router",
    # sd-scripts' --network_module entry points
    "create_network": ".hosts.sd_scripts",
    "create_network_from_weights": ".hosts.sd_scripts",
    # musubi-tuner's (it calls create_arch_network, and prepare_network when the module has one)
    "create_arch_network": ".hosts.musubi",
    "create_arch_network_from_weights": ".hosts.musubi",
    "prepare_network": ".hosts.musubi",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
