"""``downscale-plugin ttq``: time to quality from a host's tensorboard logs (hosts/kohya/ttq.py)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("tensorboard", reason="ttq reads tensorboard event files")

from torch.utils.tensorboard import SummaryWriter

from downscale_plugin.__main__ import main


def write_run(path, val, seconds_per_step: float, saving: float | None, every: int = 10, steps: int = 100) -> None:
    """A run's logs as sd-scripts writes them: the loss every step, the validation loss every ``every``
    steps, and (routed) the plugin's realized FLOP saving."""
    writer = SummaryWriter(str(path))
    for step in range(1, steps + 1):
        wall = 1000.0 + step * seconds_per_step
        writer.add_scalar("loss/current", 1.0, step, walltime=wall)
        if saving is not None:
            writer.add_scalar("downscale/flop_saving", saving, step, walltime=wall)
        if step % every == 0:
            writer.add_scalar("loss/validation/step_average", val(step), step, walltime=wall)
    writer.close()


def test_ttq_reads_the_host_logs_and_gives_the_paired_ratio(tmp_path, capsys) -> None:
    """Native falls linearly to its plateau at step 50; the routed runs learn at 0.8× the rate per step
    at 0.6× the FLOPs and 0.7× the seconds per step: 1.25× the steps, 0.75× the FLOPs, 0.875× the seconds."""
    natives, routeds = [], []
    for seed, speed in enumerate((1.0, 1.1, 0.9)):
        native = lambda s, k=speed: 2.0 - min(s * k, 50) / 50  # noqa: E731
        routed = lambda s, k=speed: 2.0 - min(0.8 * s * k, 50) / 50  # noqa: E731
        natives.append(tmp_path / f"native{seed}")
        routeds.append(tmp_path / f"routed{seed}")
        write_run(natives[-1], native, 1.0, None, every=1)
        write_run(routeds[-1], routed, 0.7, 0.4, every=1)
    assert main(["ttq", "--native", *map(str, natives), "--routed", *map(str, routeds)]) == 0
    out = capsys.readouterr().out
    figures = {axis: float(re.search(rf"^{axis}: ([\d.]+) \[", out, re.M).group(1)) for axis in ("steps", "flops", "seconds")}
    assert figures == pytest.approx({"steps": 1.25, "flops": 0.75, "seconds": 0.875}, rel=0.02)
    assert "3 seeds, 3 reached" in out


def test_ttq_one_pair_and_refusals(tmp_path, capsys) -> None:
    write_run(tmp_path / "n", lambda s: 2.0 - min(s, 50) / 50, 1.0, None)
    write_run(tmp_path / "r", lambda s: 2.0 - min(s, 50) / 100, 0.7, 0.4)  # reaches half the improvement only
    assert main(["ttq", "--native", str(tmp_path / "n"), "--routed", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "not reached" in out and "one pair: no interval" in out
    assert main(["ttq", "--native", str(tmp_path / "r"), "--routed", str(tmp_path / "n")]) == 2
    err = capsys.readouterr().err
    assert "a routed run" in err and "not a run with the plugin installed" in err
    assert main(["ttq", "--native", str(tmp_path / "n"), "--routed", str(tmp_path / "r"), "--tag", "loss/nope"]) == 2
    assert "no 'loss/nope' scalars" in capsys.readouterr().err
    assert main(["ttq", "--native", str(tmp_path / "n"), str(tmp_path / "n"), "--routed", str(tmp_path / "r")]) == 2
    assert "one routed run per native run" in capsys.readouterr().err
