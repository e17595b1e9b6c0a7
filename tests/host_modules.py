"""Swap which sd-scripts (the doubles or a real checkout) the tests import, without leaking.

The host's modules have generic top-level names (``library``, ``networks``, ``train_network``…), so
the doubles and a real checkout cannot both be imported in one process. ``host_modules(root)`` puts
``root`` first on ``sys.path`` with those names unloaded, and restores the previous state after.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DOUBLES = str(Path(__file__).parent / "doubles")
TRAINER_SCRIPTS = (
    "train_network",
    "sdxl_train_network",
    "sd3_train_network",
    "flux_train_network",
    "lumina_train_network",
    "anima_train_network",
    "hunyuan_image_train_network",
)
_PACKAGES = ("library", "networks", "lycoris")


def _is_host(name: str) -> bool:
    return name in TRAINER_SCRIPTS or name.split(".")[0] in _PACKAGES


@contextmanager
def host_modules(root: str = DOUBLES) -> Iterator[None]:
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if _is_host(name)}
    sys.path.insert(0, root)
    importlib.invalidate_caches()
    try:
        yield
    finally:
        for name in [n for n in sys.modules if _is_host(n)]:
            del sys.modules[name]
        sys.modules.update(saved)
        sys.path.remove(root)


# arch → (trainer script, trainer class, the inner module auto-detection must pick, extra argv)
ARCHS = {
    "sd1": ("train_network", "NetworkTrainer", "networks.lora", ()),
    "sdxl": ("sdxl_train_network", "SdxlNetworkTrainer", "networks.lora", ()),
    "sd3": ("sd3_train_network", "Sd3NetworkTrainer", "networks.lora_sd3", ()),
    "flux": ("flux_train_network", "FluxNetworkTrainer", "networks.lora_flux", ()),
    "chroma": ("flux_train_network", "FluxNetworkTrainer", "networks.lora_flux", ("--model_type", "chroma")),
    "lumina": ("lumina_train_network", "LuminaNetworkTrainer", "networks.lora_lumina", ()),
    "anima": ("anima_train_network", "AnimaNetworkTrainer", "networks.lora_anima", ()),
    "hunyuan_image": ("hunyuan_image_train_network", "HunyuanImageNetworkTrainer", "networks.lora_hunyuan_image", ()),
}


def trainer_class(arch: str):
    script, cls, _, _ = ARCHS[arch]
    return getattr(importlib.import_module(script), cls)


def double_args(arch: str, *argv: str, network_module: str = "downscale_plugin", downscale: dict | None = None):
    """The double trainer's parsed args for ``arch`` (its script's defaults), plus ``args.downscale``."""
    script, _, _, extra = ARCHS[arch]
    args = importlib.import_module(script).setup_parser().parse_args(["--network_module", network_module, *extra, *argv])
    if downscale is not None:
        args.downscale = downscale
    return args


def run_double(arch: str, *argv: str, network_module: str = "downscale_plugin", downscale: dict | None = None, trainer=None):
    """Train the double of ``arch`` in-process; returns the trainer (``trainer.last_run`` holds the run)."""
    trainer = trainer if trainer is not None else trainer_class(arch)()
    trainer.train(double_args(arch, *argv, network_module=network_module, downscale=downscale))
    return trainer


def explicit_hook_class(arch: str):
    """``arch``'s trainer class with the explicit call points that patches/sd-scripts-48d368fa-explicit-hook.patch
    adds to ``NetworkTrainer``: the plugin sets the two hooks instead of wrapping the instance's methods."""

    class Patched(trainer_class(arch)):
        noise_pred_and_target_hook = None
        step_logs_hook = None

        def get_noise_pred_and_target(self, *call, is_train=True):
            own = super().get_noise_pred_and_target
            if self.noise_pred_and_target_hook is None:
                return own(*call, is_train=is_train)
            return self.noise_pred_and_target_hook(own, *call, is_train=is_train)

        def generate_step_logs(self, *args):
            logs = super().generate_step_logs(*args)
            if self.step_logs_hook is not None:
                self.step_logs_hook(logs, args[1])
            return logs

    return Patched
