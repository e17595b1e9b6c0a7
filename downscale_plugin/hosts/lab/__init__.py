"""The lab host: the built-in tiny DiT's trainer (``downscale_plugin.lab``) with the plugin attached.

- ``adapter``: ``LabPlugin``, the plugin attached to the lab trainer the way sd-scripts' ``prepare_network`` attaches it
- ``demo``: the ``demo`` command (native vs plugin LoRA on the lab DiT)
- ``map_backend``: ``LabBackend``, the gradient map on the lab DiT
- ``cli``: registers ``demo``, ``map --lab`` and ``snr --lab``
"""
