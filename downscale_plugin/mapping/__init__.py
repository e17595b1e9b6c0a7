"""The map tool (the certifier; method and lab study in docs/FIDELITY.md): measure how far a downscaled step's adapter gradient is from
the native one per (route, σ bin), against the native redraw floor, and derive router windows.

- ``arms``: ``Arm``, ``build_arms``, the ``MapBackend`` protocol (model-agnostic)
- ``estimator``: ``MapSettings``, ``collect``, ``summarize``, ``run_map`` → ``MapResult``
- ``windows``: ``stack_windows``, ``windows_toml`` (a plugin TOML ``load_config`` reads as is),
  one TOML per measured (sigma_policy, positions, attention) setting; ``other_windows`` (the rest, reported)
- ``report``: console table, CSV, JSON, heatmap PNG (``write_outputs``)
- ``cli``: ``python -m downscale_plugin map`` over the backends host packages register
- ``certify``, ``paired``, ``sequential``: the budgeted certifier (paired noise, an anytime-valid
  bound per bin, a plan by σ mass × saving per cost, a stake in a run); ``certify_cli``: ``certify``

The σ bins are core (``downscale_plugin.bins``); the backends live with their hosts
(``hosts/lab/map_backend.py``; inside a training run ``hosts/sd_scripts/map_backend.py``).
"""
