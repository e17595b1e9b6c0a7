"""``downscale-plugin ttq``: time to quality of a routed run against a native one, from the host's own logs.

What the lab study measures (``benchmarks/bench_quality.py``) is what a user must measure on their
own model, since the lab's teaching efficiency per routed step is not a prediction for theirs: train
the same LoRA twice in the host, natively and with the plugin (same seed, data and settings, with
the host's validation loss logged to tensorboard: sd-scripts' ``--validation_split`` (or a validation
data set) and ``--validate_every_n_steps``, ``--log_with tensorboard --logging_dir DIR``), then

    downscale-plugin ttq --native LOGDIR [LOGDIR ...] --routed LOGDIR [LOGDIR ...]

Per pair (the i-th native run with the i-th routed run; one pair per seed), each run's validation
curve is smoothed by its monotone fit (``quality.monotone_fit``); native's improvement is its first
validation point − its fitted end, and each run's time to ``--quality`` of that improvement is read in
steps, training FLOPs (a routed run's from the plugin's own ``downscale/flop_saving`` scalar: the
FLOP model's realized saving so far) and wall seconds since the run's first logged scalar (which
include the host's validation passes, the same in both runs). With two or more pairs it prints the
geometric-mean ratio routed ÷ native with a paired 95 % t interval on the log-ratios
(``quality.ratio_interval``); one pair gives the ratio alone.
"""

from __future__ import annotations

import argparse
import glob
import os
from dataclasses import dataclass

from ...cli import fail, register
from ...quality import first_reach, monotone_fit, ratio_interval

VALIDATION_TAG = "loss/validation/step_average"  # sd-scripts' validation loss (train_network.py)
SAVING_TAG = "downscale/flop_saving"  # the plugin's realized FLOP saving (accounting.Accounting.scalars)
AXES = ("steps", "flops", "seconds")


@dataclass(frozen=True)
class LoggedRun:
    """One run's validation curve on each axis: steps, training FLOPs (native steps = 1 each) and wall seconds."""

    path: str
    steps: list[float]
    flops: list[float]
    seconds: list[float]
    val: list[float]
    routed: bool


def read_run(path: str, tag: str) -> LoggedRun:
    """The run's scalars from its tensorboard event files (every file under ``path``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(glob.glob(os.path.join(path, "**", "events.out.tfevents.*"), recursive=True))
    if not files:
        raise ValueError(f"{path}: no tensorboard event files under it (train with --log_with tensorboard --logging_dir)")
    scalars: dict[str, dict[int, tuple[float, float]]] = {}
    for name in files:
        acc = EventAccumulator(name, size_guidance={"scalars": 0})
        acc.Reload()
        for key in acc.Tags()["scalars"]:
            scalars.setdefault(key, {}).update({e.step: (e.wall_time, e.value) for e in acc.Scalars(key)})
    if tag not in scalars:
        raise ValueError(f"{path}: no {tag!r} scalars (tags: {', '.join(sorted(scalars)) or 'none'}); log the host's validation loss")
    start = min(wall for series in scalars.values() for wall, _ in series.values())
    points = sorted(scalars[tag].items())
    saving = sorted(scalars.get(SAVING_TAG, {}).items())

    def saving_at(step: int) -> float:
        before = [value for s, (_, value) in saving if s <= step]
        return before[-1] if before else 0.0

    return LoggedRun(
        path=path,
        steps=[float(s) for s, _ in points],
        flops=[s * (1.0 - saving_at(s)) for s, _ in points],
        seconds=[wall - start for _, (wall, _) in points],
        val=[value for _, (_, value) in points],
        routed=bool(saving),
    )


def pair_times(native: LoggedRun, routed: LoggedRun, quality: float) -> dict[str, tuple[float | None, float | None]]:
    """(native, routed) time to ``quality`` of native's improvement on each axis."""
    fit = monotone_fit(native.val)
    target = native.val[0] - quality * (native.val[0] - fit[-1])
    routed_fit = monotone_fit(routed.val)
    return {
        axis: (first_reach(getattr(native, axis), fit, target), first_reach(getattr(routed, axis), routed_fit, target)) for axis in AXES
    }


def problems_of(natives: list[LoggedRun], routeds: list[LoggedRun]) -> list[str]:
    out = [f"--native {r.path}: the plugin's {SAVING_TAG!r} is logged there: a routed run" for r in natives if r.routed]
    out += [f"--routed {r.path}: no {SAVING_TAG!r} scalars: not a run with the plugin installed" for r in routeds if not r.routed]
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--native", nargs="+", required=True, metavar="LOGDIR", help="the native runs' tensorboard log dirs, one per seed")
    parser.add_argument("--routed", nargs="+", required=True, metavar="LOGDIR", help="the routed runs' log dirs, in the same seed order")
    parser.add_argument("--tag", default=VALIDATION_TAG, help=f"the validation loss scalar (default {VALIDATION_TAG}, sd-scripts')")
    parser.add_argument("--quality", type=float, default=0.9, help="the target share of native's improvement (default 0.9)")


def run(args: argparse.Namespace) -> int:
    if len(args.native) != len(args.routed):
        return fail(
            [f"--native and --routed: one routed run per native run, in seed order (got {len(args.native)} and {len(args.routed)})"]
        )
    if not 0 < args.quality <= 1:
        return fail([f"--quality must be in (0, 1] (got {args.quality})"])
    try:
        natives = [read_run(p, args.tag) for p in args.native]
        routeds = [read_run(p, args.tag) for p in args.routed]
    except ImportError:
        return fail(["ttq reads tensorboard event files: pip install tensorboard (sd-scripts' requirements install it)"])
    except ValueError as err:
        return fail([str(err)])
    problems = problems_of(natives, routeds)
    if problems:
        return fail(problems)
    share = f"{round(100 * args.quality)} %"
    print(f"time to {share} of native's improvement (from its first validation point to its fitted end), routed ÷ native:")
    ratios: dict[str, list[float]] = {axis: [] for axis in AXES}
    reached: dict[str, list[bool]] = {axis: [] for axis in AXES}
    for native, routed in zip(natives, routeds, strict=True):
        times = pair_times(native, routed, args.quality)
        cells = []
        for axis in AXES:
            n, r = times[axis]
            if not n:
                cells.append(f"{axis}: native reached it at its start")
                continue
            reached[axis].append(r is not None)
            ratios[axis].append((r if r is not None else getattr(routed, axis)[-1]) / n)  # not reached: its end, a lower bound
            cells.append(f"{axis} {n:.4g} -> {'not reached' if r is None else f'{r:.4g}'} ({ratios[axis][-1]:.3f}{'' if r else '+'})")
        print(f"  {os.path.basename(native.path.rstrip('/'))} / {os.path.basename(routed.path.rstrip('/'))}: " + "; ".join(cells))
    for axis in AXES:
        if len(ratios[axis]) < 2:
            continue
        iv = ratio_interval(ratios[axis], reached[axis])
        print(f"{axis}: {iv.ratio:.3f} [{iv.lo:.3f}, {iv.hi:.3f}] (paired 95 % t on the log-ratio, {iv.seeds} seeds, {iv.reached} reached)")
    if len(natives) < 2:
        print("one pair: no interval; train two or more seeds per arm for one")
    return 0


register("ttq", "time to quality of routed runs against native ones, from the host's tensorboard logs", add_arguments, run)
