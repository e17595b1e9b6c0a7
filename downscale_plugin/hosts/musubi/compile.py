"""musubi-tuner's ``--compile`` and the routed grids: what the start warns about.

With ``--compile`` the trainer compiles each of the DiT's blocks with ``torch.compile`` after
``prepare_network`` (training/trainer_base.py ``_prepare_with_accelerator``, utils/model_utils.py
``compile_transformer``), with ``--compile_dynamic`` (true, false, auto; unset is auto) and, when given,
``torch._dynamo.config.cache_size_limit = --compile_cache_size_limit``. Every latent grid a step runs at
is an input shape the compiled blocks have not seen: statically compiled blocks recompile for it, and
once a block's code has ``cache_size_limit`` compiled versions dynamo runs it eagerly for new shapes,
without an error. A routed grid (and, in ``mode = "map"`` / ``"auto"``, each measured ratio's grid) adds
to the buckets' own grids.
"""

from __future__ import annotations

from typing import Any

from ...arch import get_arch
from ...config import DownscaleConfig
from ...grid import eligibility_table, target_grid
from .buckets import MusubiBuckets


def routed_grids(cfg: DownscaleConfig, arch: str, buckets: MusubiBuckets, measured: bool) -> list[tuple[int, int]]:
    """The latent grids a run's steps can run at besides its buckets' own: the routes' targets, and with an
    in-run measurement (``measured``) every measured ratio's grid of every bucket."""
    spec = get_arch(arch)
    native = list(buckets.latent_buckets)
    grids = {
        cell.target_hw for row in eligibility_table(native, tuple(cfg.routes), spec, cfg.tier_tolerance) for cell in row if cell.eligible
    }
    if measured:
        grids |= {target_grid(hw, ratio, spec) for hw in native for ratio in cfg.map.ratios} - {None}
    return sorted(grids - set(native))


def dynamo_cache_limit(args: Any) -> tuple[int, str]:
    """The cache limit the compiled blocks will run under, and where it comes from."""
    given = getattr(args, "compile_cache_size_limit", None)
    if given is not None:
        return int(given), "--compile_cache_size_limit"
    import torch._dynamo.config as dynamo  # only with --compile: the trainer imports it then anyway

    return int(getattr(dynamo, "recompile_limit", getattr(dynamo, "cache_size_limit", 8))), "torch._dynamo.config.cache_size_limit"


def compile_warning(args: Any, cfg: DownscaleConfig, arch: str, buckets: MusubiBuckets, measured: bool) -> str | None:
    """The start's warning for a ``--compile`` run whose steps run at grids its buckets do not (None: nothing to say)."""
    dynamic = (getattr(args, "compile_dynamic", None) or "auto").lower()
    if not getattr(args, "compile", False) or dynamic == "true":
        return None
    added = routed_grids(cfg, arch, buckets, measured)
    if not added:
        return None
    native = len(buckets.latent_buckets)
    total = native + len(added)
    limit, source = dynamo_cache_limit(args)
    grids = ", ".join(f"{h}x{w}" for h, w in added)
    verdict = (
        f"more than {source} = {limit}: past it dynamo runs the blocks eagerly for new shapes, without an error"
        if total > limit
        else f"within {source} = {limit}, but each is a compile stall the first time it runs"
    )
    how = "recompiles for each" if dynamic == "false" else "recompiles for each until it marks the sizes dynamic (auto)"
    return (
        f"downscale_plugin: --compile (--compile_dynamic {dynamic}): the routes add {len(added)} latent grid(s) ({grids}) to the "
        f"buckets' {native}, {total} grid shapes in all (each at its buckets' frame counts and batch sizes); dynamo {how}: "
        f"{verdict}. Pass --compile_dynamic true, or --compile_cache_size_limit {total} or more"
    )
