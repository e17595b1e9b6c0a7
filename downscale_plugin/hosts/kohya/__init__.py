"""What the two kohya trainers' hosts (``hosts/sd_scripts``, ``hosts/musubi``) share (docs/ARCHITECTURE.md §1, §3).

- ``conventions``: the training TOML, ``--network_args``, the command line, the inner module (no torch:
  the startup check imports it at every interpreter start);
- ``run``: one run's plugin state (accounting, cross-rank totals, save/resume of the counts, metadata,
  the end summary);
- ``pool``: a bound host σ sampler and the pool of (timestep, σ) pairs it replays from;
- ``probes``, ``backend``, ``map``, ``auto``: the in-run measurements (``mode = "map"``, ``"auto"``): probes
  cut from the run's first batches, the forced steps, the map backend over them, and the two sessions.

A host package subclasses the sessions with its batch layout and step call; nothing here names a host's modules.
"""
