"""``mode = "map"`` on musubi-tuner: the kohya gradient map (``hosts/kohya/map.py``) on the run's own DiT,
adapter and cached latents, with musubi-tuner's probes and forced step (``probes.MusubiProbes``). The
latent arms only: the run hands ``process_batch`` no VAE to drive (``map_reenc`` / ``map_pixel`` are refused)."""

from __future__ import annotations

from ..kohya.map import MapSession
from .probes import MusubiProbes


class MusubiMapSession(MusubiProbes, MapSession):
    """One musubi-tuner ``map`` run."""
