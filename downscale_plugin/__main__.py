"""``python -m downscale_plugin``: see :mod:`downscale_plugin.cli`."""

from .cli import main

raise SystemExit(main())
