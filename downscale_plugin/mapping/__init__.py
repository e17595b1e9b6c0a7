"""The map tool (certifier, DESIGN §5): measure how far a downscaled step's adapter gradient is from
the native one per (route, σ bin), against the native redraw floor, and derive router windows.

- ``bins``: ``SigmaBins``, ``parse_bins`` (segmented bins over (0, 1] + the σ = 1 endpoint bin)
- ``arms``: ``Arm``, ``build_arms``, the ``MapBackend`` protocol (model-agnostic)
- ``estimator``: ``MapSettings``, ``collect``, ``summarize``, ``run_map`` → ``MapResult``
- ``windows``: ``stack_windows``, ``windows_toml`` (a plugin TOML ``load_config`` reads as is),
  one TOML per measured (sigma_policy, positions) setting; ``other_windows`` (the rest, reported)
- ``report``: console table, CSV, JSON, heatmap PNG (``write_outputs``)
- ``lab_backend``: ``LabBackend`` on the lab DiT; ``cli``: ``python -m downscale_plugin map``
- ``sd_scripts_backend``: ``SdScriptsBackend`` inside a real sd-scripts run (``mode = "map"``; its
  session, the step hook and what follows the map are in ``hosts/sd_scripts_map``)

Submodules are imported on use (the lab backend pulls in diffusers and peft).
"""
