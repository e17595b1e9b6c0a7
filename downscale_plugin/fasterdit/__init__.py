"""FasterDiT options (DESIGN §1.3, §6), each a pure function or a scoped replacement of one host handle.

- ``direction_loss``: λ·(1 − cos) added to the host's elementwise loss (``direction_loss_scope``)
- ``policies``: the σ a routed step runs at (``keep``, ``res_shift``, ``snr_match``; ``RunningStd``)
- ``positions``: ``positions = "interpolate"`` scopes per architecture (``positions_scope``)
- ``snr`` / ``latent_stds`` / ``snr_report`` / ``cli``: the extended log-SNR PDF diagnostic (``snr`` command)
They replace host handles with ``downscale_plugin.scope.swap_attr``, the primitive the σ replay uses.

Not wired yet (issue 5): config keys ``direction_loss_weight`` (float ≥ 0), ``direction_loss_only_routed``,
``sigma_policy`` (``POLICIES``), ``positions`` (``plain`` | ``interpolate``), and in ``hosts/hook.py``:
a ``process_batch`` instance wrap entering ``direction_loss_scope(library.train_util, λ, gate=...)``
for train calls (the lab trainer needs a module-level ``conditional_loss`` for this); for routed steps
``make_policy(...)(decision.sigmas)`` registered in ``sampler.drawn`` before ``sampler.replay`` (the
gate keeps reading the drawn σ; accounting records both); ``positions_scope(arch, native_hw, run_hw,
model=unwrap(unet), module=library.flux_utils | hunyuan_image_utils)`` around the routed call.
"""
