"""downscale-plugin: train diffusion LoRAs on area-downsampled latents inside validated σ windows."""
