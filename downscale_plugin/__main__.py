"""``python -m downscale_plugin`` and the ``downscale-plugin`` script: every command, then the parser.

The front door is the one place that names every layer: importing a command module registers its
command (or a host's parts of ``check``/``plan``/``snr``) with :mod:`downscale_plugin.cli`. Their heavy
dependencies (the lab extra, scipy) load when a command runs, which then says what to install.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from . import cli

COMMAND_MODULES = (
    "downscale_plugin.hosts.sd_scripts.cli",
    "downscale_plugin.hosts.musubi.cli",
    "downscale_plugin.hosts.lab.cli",
    "downscale_plugin.hosts.kohya.ttq",
    "downscale_plugin.mapping.cli",
    "downscale_plugin.mapping.certify_cli",
    "downscale_plugin.mapping.reuse_cli",
    "downscale_plugin.hosts.lab.certify",
    "downscale_plugin.fasterdit.cli",
)


def load_commands() -> None:
    for module in COMMAND_MODULES:
        importlib.import_module(module)


def main(argv: Sequence[str] | None = None) -> int:
    load_commands()
    return cli.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
