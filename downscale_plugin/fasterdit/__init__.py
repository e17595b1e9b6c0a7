"""FasterDiT options (docs/ARCHITECTURE.md §2), each a pure function or a scoped replacement of one host handle.

- ``direction_loss``: λ·(1 − cos) added to the host's elementwise loss (``direction_loss_scope``)
- ``policies``: the σ a routed step runs at (``keep``, ``res_shift``, ``snr_match``; ``RunningStd``)
- ``positions``: ``positions = "interpolate"`` scopes per architecture (``positions_scope``)
- ``snr`` / ``latent_stds`` / ``snr_report`` / ``cli``: the extended log-SNR PDF diagnostic (``snr`` command)
They replace host handles with ``downscale_plugin.scope.swap_attr``, the primitive the σ replay uses.

Wiring (config keys ``direction_loss_weight`` ≥ 0, ``direction_loss_only_routed``, ``sigma_policy``,
``positions``; ``hosts.hook.StepOptions`` binds them to a host's handles, built by
``hosts.sd_scripts.step_options`` and ``hosts.lab.LabPlugin``): when λ > 0 the hook wraps the
trainer's ``process_batch`` and runs its train calls (``is_train``) inside
``direction_loss_scope(<module of its conditional_loss>, λ, gate=<step routed> if only routed)``
(``library.train_util``; the lab trainer's own module); on routed steps the σ policy maps the drawn σ,
the sampler family registers the mapped σ (flow hosts t = σ·T, DDPM the nearest integer t) and the
replay hands them to the host, while the gate has read the drawn σ and the accounting keeps both;
``snr_match`` uses a ``RunningStd`` of the step's own native and downsampled latents, pooled over the
run's routed steps per grid pair (per rank); ``positions_scope`` wraps the routed host call.
"""
