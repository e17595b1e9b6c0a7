"""FasterDiT options (DESIGN §1.3, §6), each a pure function or a scoped replacement of one host handle.

- ``direction_loss``: λ·(1 − cos) added to the host's elementwise loss (``direction_loss_scope``)
- ``policies``: the σ a routed step runs at (``keep``, ``res_shift``, ``snr_match``; ``RunningStd``)
- ``positions``: ``positions = "interpolate"`` scopes per architecture (``positions_scope``)
- ``snr`` / ``latent_stds`` / ``snr_report`` / ``cli``: the extended log-SNR PDF diagnostic (``snr`` command)
- ``scope``: ``swap_attr``, the one attribute-replacement primitive they share
"""
