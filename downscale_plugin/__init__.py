"""downscale-plugin: train diffusion LoRAs on area-downsampled latents inside validated σ windows."""

from .config import ConfigError, DownscaleConfig, RouteRule, load_config
from .router import RouteDecision, Router

__all__ = ["ConfigError", "DownscaleConfig", "RouteDecision", "RouteRule", "Router", "load_config"]
