import re

from setuptools import find_packages, setup

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
        # mode = "map" inside an sd-scripts run (numpy and tqdm come with sd-scripts).
        "map": ["scipy>=1.10", "matplotlib>=3.7"],
        "dev": ["pytest>=8", "ruff>=0.6"],
    },
    entry_points={"console_scripts": ["downscale-plugin=downscale_plugin.cli:main"]},
    classifiers=["License :: OSI Approved :: Apache Software License", "Programming Language :: Python :: 3"],
)
