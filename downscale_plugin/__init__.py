"""downscale-plugin: train diffusion LoRAs on area-downsampled latents inside validated σ windows."""

from .config import ConfigError, DownscaleConfig, RouteRule, load_config
from .router import RouteDecision, Router

__all__ = [
    "ConfigError",
    "DownscaleConfig",
    "RouteDecision",
    "RouteRule",
    "Router",
    "create_network",
    "create_network_from_weights",
    "load_config",
]

_NETWORK_MODULE = ("create_network", "create_network_from_weights")


def __getattr__(name: str):
    """sd-scripts' ``--network_module downscale_plugin`` entry points, imported on first use."""
    if name in _NETWORK_MODULE:
        from .hosts import sd_scripts

        return getattr(sd_scripts, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
