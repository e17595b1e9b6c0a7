import os
import re

from setuptools import Command, find_packages, setup
from setuptools.command.build import build

# The startup check (downscale_plugin_startup.py): a .pth file in site-packages imports it at every
# interpreter start; it does nothing unless the command line names downscale_plugin, then it fails a
# bad plugin config before the trainer loads a model. The line is guarded, so a half-removed install
# never prints an error at Python startup.
PTH_NAME = "downscale_plugin_startup.pth"
PTH_LINE = "import sys; exec('try:\\n import downscale_plugin_startup\\nexcept ImportError:\\n pass')\n"


class build_pth(Command):
    """Write the .pth file next to the packages: into the wheel's root (purelib) for ``pip install .``,
    and into the editable wheel's root for ``pip install -e .`` (setuptools installs the editable
    wheel's root files into site-packages, as it does with its own ``__editable__`` .pth)."""

    description = "write downscale_plugin_startup.pth into the installation root"
    user_options = []

    def initialize_options(self):
        self.build_lib = None
        self.editable_mode = False

    def finalize_options(self):
        self.set_undefined_options("build", ("build_lib", "build_lib"))

    def _target(self):
        if self.editable_mode:
            return self.get_finalized_command("install").install_lib  # editable_wheel: the unpacked wheel
        return self.build_lib

    def run(self):
        target = self._target()
        os.makedirs(target, exist_ok=True)
        with open(os.path.join(target, PTH_NAME), "w", encoding="utf-8") as f:
            f.write(PTH_LINE)

    def get_outputs(self):
        return [os.path.join(self._target(), PTH_NAME)]


class build_with_pth(build):
    sub_commands = [*build.sub_commands, ("build_pth", None)]


VERSION = re.search(r'^__version__ = "([^"]+)"', open("downscale_plugin/__init__.py", encoding="utf-8").read(), re.M).group(1)

setup(
    name="downscale-plugin",
    version=VERSION,
    description="sd-scripts network module that trains diffusion LoRAs on area-downsampled latents inside validated σ windows",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["downscale_plugin", "downscale_plugin.*"]),
    # The shipped lab base (lab/base.py): its weights and their digest and training record.
    package_data={"downscale_plugin.lab": ["weights/*.safetensors", "weights/*.json"]},
    py_modules=["downscale_plugin_startup"],
    cmdclass={"build": build_with_pth, "build_pth": build_pth},
    # torch and toml are in every sd-scripts environment; users bring their own torch build.
    install_requires=["torch>=2.1", "toml>=0.10"],
    extras_require={
        # Ranges admit sd-scripts' pins (diffusers 0.32.1, transformers 4.54.1, accelerate 1.6.0) and current releases.
        "lab": [
            "diffusers>=0.32.1",
            "peft>=0.14",
            "numpy>=1.24",
            "scikit-image>=0.21",
            "scikit-learn>=1.3",
            "matplotlib>=3.7",
            "scipy>=1.10",
            "tqdm>=4.60",
        ],
        # mode = "map" and "auto" inside a training run (config.MODE_PACKAGES; numpy comes with both hosts).
        "map": ["scipy>=1.10", "matplotlib>=3.7", "tqdm>=4.60"],
        "dev": ["pytest>=8", "ruff>=0.6", "tensorboard>=2.10"],  # tensorboard: the ttq command's tests write event files
    },
    entry_points={"console_scripts": ["downscale-plugin=downscale_plugin.__main__:main"]},
    classifiers=["License :: OSI Approved :: Apache Software License", "Programming Language :: Python :: 3"],
)
