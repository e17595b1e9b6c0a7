"""downscale-plugin's startup check: a bad plugin config fails before the trainer loads a model.

sd-scripts imports ``--network_module downscale_plugin`` only after it has loaded and cached every
model, so the network module's own validation comes minutes into a run. The installed
``downscale_plugin_startup.pth`` (site-packages) imports this module at every interpreter start. It
does nothing, and imports nothing beyond ``os`` and ``sys``, unless the command line names
``downscale_plugin`` (``--network_module downscale_plugin``, or a ``--config_file`` TOML that
mentions it). Then ``downscale_plugin.hosts.kohya.conventions.startup_report`` reads the run's command line as
the trainer will and validates what the network module will read (``--network_args``, the training
TOML's ``[plugins.downscale]``, a ``downscale_config=`` plugin TOML); on a problem it prints every
problem and the process exits 2, before the training script runs. ``DOWNSCALE_PLUGIN_NO_STARTUP_CHECK=1``
turns it off. It never raises: whatever goes wrong in it, the command runs on.
"""

import os
import sys

DISABLE = "DOWNSCALE_PLUGIN_NO_STARTUP_CHECK"
NAME = "downscale_plugin"
# Each host's self-check of the checkout a command line runs (``command_line_drift(argv)`` → problems; nothing
# for another host's script or a checkout not importable here): its functions against what the plugin re-implements.
DRIFT_CHECKS = ("downscale_plugin.hosts.sd_scripts.startup", "downscale_plugin.hosts.musubi.startup")


def _mentions_plugin(argv):
    """Cheap: the plugin's name in an argument, or in a --config_file TOML (the trainer appends .toml)."""
    for i, arg in enumerate(argv):
        if NAME in arg:
            return True
        if arg.startswith("--config"):
            path = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            path = path if path.endswith(".toml") else path + ".toml"
            try:
                if os.path.getsize(path) < (1 << 22):
                    with open(path, "rb") as f:
                        if NAME.encode() in f.read():
                            return True
            except (OSError, ValueError):
                pass
    return False


def _own_command():
    """``python -m downscale_plugin ...`` and the ``downscale-plugin`` script check what they are asked to."""
    orig = [str(a) for a in getattr(sys, "orig_argv", None) or []]
    if "-m" in orig[:-1] and orig[orig.index("-m") + 1].split(".")[0] == NAME:
        return True
    return bool(sys.argv) and os.path.basename(str(sys.argv[0])).startswith("downscale-plugin")


def report(argv):
    """The startup check's report for a command line (None: nothing to say). Imports the package only
    when ``argv`` mentions the plugin, and leaves none of it imported."""
    if not _mentions_plugin(argv):
        return None
    before = set(sys.modules)
    try:
        import importlib

        from downscale_plugin.hosts.kohya.conventions import startup_report

        def drift(args):
            return [p for name in DRIFT_CHECKS for p in importlib.import_module(name).command_line_drift(args)]

        def refusals(args, cfg, host_args):
            modules = [importlib.import_module(name) for name in DRIFT_CHECKS]
            return [p for m in modules if hasattr(m, "command_line_refusals") for p in m.command_line_refusals(args, cfg, host_args)]

        return startup_report(argv, drift, refusals)
    finally:
        # The trainer imports the network module itself, from its own sys.path; nothing stays from here.
        for name in [m for m in sys.modules if m not in before and (m == NAME or m.startswith(NAME + "."))]:
            del sys.modules[name]


def main():
    if os.environ.get(DISABLE, "").strip() not in ("", "0"):
        return
    attempted = False
    try:
        argv = [str(a) for a in (getattr(sys, "argv", None) or [])]
        if _own_command() or not _mentions_plugin(argv):
            return
        attempted = True
        text = report(argv)
    except Exception as err:  # never break a command over the check itself
        if attempted:
            sys.stderr.write(f"{NAME}: the startup check did not run ({type(err).__name__}: {err}); the network module checks later\n")
        return
    if text:
        sys.stdout.flush()
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        os._exit(2)  # a SystemExit raised while site imports .pth lines is a fatal error, exit status 1


main()
