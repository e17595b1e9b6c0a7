"""Host packages, one per trainer: the only code that knows a host's names.

- ``sd_scripts``: kohya-ss sd-scripts (the ``--network_module downscale_plugin`` entry points)
- ``musubi``: kohya-ss musubi-tuner (its ``create_arch_network`` entry points; video and image DiTs)
- ``lab``: the built-in lab trainer (``downscale_plugin.lab``), the demo and the lab map backend
- ``kohya``: configuration conventions both kohya trainers share (training TOML, ``network_args``)
"""
