"""The step recorder both end-to-end harnesses install in the training process (``tests/sd_scripts_e2e.py``,
``tests/musubi_e2e.py``): it wraps the plugin's run class, which both hosts share (``hosts/kohya/run.py``)."""

from __future__ import annotations


def recorder(seen: dict | None = None) -> tuple[list, list]:
    """Every train step's decision (rule, lead, σ, how many σ were redrawn, fallback, native and run grid) in order, and
    the run objects seen; into ``seen`` (when given) the network each run wraps, how often its ``metadata`` was built (what
    a ``save_weights`` adds) and the process group's backend while the steps run (accelerate's ``end_training`` ends it)."""
    import torch.distributed as dist

    from downscale_plugin.hosts.kohya.run import DownscaleRun  # the run class both hosts' start builds

    steps: list = []
    runs: list = []
    on_step = DownscaleRun.on_step

    def record(self, step, decision, native_hw, run_hw, *rest, **kw):
        if not runs or runs[-1] is not self:
            runs.append(self)
        steps.append({
            "step": step, "rule": decision.rule_index, "lead": decision.lead, "sigmas": decision.sigmas.reshape(-1).tolist(),
            "fallback": decision.fallback, "native_hw": list(native_hw), "run_hw": list(run_hw),
            "resampled": int(decision.resampled),
        })  # fmt: skip
        if seen is not None and "backend" not in seen:
            seen["backend"] = dist.get_backend() if dist.is_initialized() else None
        return on_step(self, step, decision, native_hw, run_hw, *rest, **kw)

    DownscaleRun.on_step = record
    if seen is not None:
        install, metadata = DownscaleRun.install_save_and_end, DownscaleRun.metadata
        seen.update(networks=[], metadata_calls=0)

        def install_save_and_end(self, network, *args, **kwargs):
            seen["networks"].append(network)
            return install(self, network, *args, **kwargs)

        def counted_metadata(self, *args, **kwargs):
            seen["metadata_calls"] += 1
            return metadata(self, *args, **kwargs)

        DownscaleRun.install_save_and_end, DownscaleRun.metadata = install_save_and_end, counted_metadata
    return steps, runs
