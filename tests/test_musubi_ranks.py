"""The plugin in musubi-tuner's trainers across two processes, on the doubles (``tests/doubles/musubi_*.py``) with
two gloo ranks (``torch.multiprocessing.spawn``; CI, no musubi-tuner, no GPU).

Each rank runs its own seed and its own data, as an unseeded musubi-tuner run draws per process. The doubles'
accelerator follows accelerate under the process group (ranks, ``reduce``, barriers, trackers on the main
process), and the loop saves on the main process only, as training/trainer_base.py does. Asserted: the ranks
route identically every step with per-rank σ; the counts are summed over ranks; only the main process logs and
saves; ``--save_state``/``--resume`` keeps the whole run's counts and the forward index, also resumed on one process
from a state two ranks saved; ranks on different
buckets count the steps where their routes disagree.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import join_group, spawn_ranks
from safetensors import safe_open

from downscale_plugin.hosts.kohya.run import COUNTS_FILE

DOUBLES = str(Path(__file__).parent / "doubles")


def _spawn(main, tmp_path: Path) -> tuple[dict, dict]:
    spawn_ranks(main, 2, str(tmp_path))
    return tuple(torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))


def _init(rank: int, world: int, port: int) -> None:
    sys.path.insert(0, DOUBLES)
    join_group(rank, world, port)


def _train(cls, *argv: str, downscale: dict, trainer=None):
    from musubi_trainer_base import setup_parser

    args = setup_parser().parse_args(["--network_module", "downscale_plugin", "--network_args", "inner=musubi_lora", *argv])
    args.downscale = downscale
    trainer = trainer if trainer is not None else cls()
    trainer.train(args)
    return trainer


def _mine(rank: int) -> tuple[str, ...]:
    return ("--seed", str(100 + rank), "--data_seed", str(7 + rank))


# -- every step the same route on both ranks ---------------------------------------------------------


def _route_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    _init(rank, world, port)
    try:
        import musubi_trainers

        common = ("--timestep_sampling", "qwen_shift", "--batch_size", "2", "--items_per_bucket", "8", "--max_train_steps", "40")
        out = os.path.join(out_dir, f"rank{rank}")
        downscale = {"routes": [{"scale": 0.5, "sigma_min": 0.55, "sigma_max": 0.9}]}
        trainer = _train(
            musubi_trainers.QwenImageNetworkTrainer, *common, *_mine(rank), "--log_with", "tensorboard", "--output_dir", out,
            downscale=downscale,
        )  # fmt: skip
        run = trainer.last_network.downscale_run
        calls = trainer.last_transformer.calls
        torch.save(
            {
                "tokens": [c["tokens"] for c in calls],
                "t": [c["t"] for c in calls],
                "seed": run.seed,
                "local": run.accounting.total_steps,
                "total": run.totals.total_steps,
                "resampled": (run.accounting.counts.resampled, run.totals.counts.resampled),
                "compared": (run.totals.compared, run.totals.disagreed),
                "logged": run.accelerator.logged,
                "trackers": len(run.accelerator.trackers),
                "patched": [name for name in ("process_batch", "generate_step_logs") if name in vars(trainer)],
                "weights": {k: v.detach().clone() for k, v in trainer.last_network.state_dict().items()},
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_route_identically_every_step(tmp_path):
    """Qwen-Image at batch size 2, coupled gate, one route in a σ window: the route is drawn from rank 0's seed and
    the step's forward index, so both ranks run the same grid every step while each rank's σ are its own."""
    r0, r1 = _spawn(_route_rank, tmp_path)
    assert r0["seed"] == r1["seed"] == 100  # shared_seed: rank 0's, not each rank's own --seed
    assert len(r0["tokens"]) == 40 and r0["tokens"] == r1["tokens"]  # the same grid on both ranks, every step
    assert {shape[1] for shape in r0["tokens"]} == {16, 4}  # both happened: native 8×8 packed 2×2, routed 4×4
    assert not any(torch.equal(a, b) for a, b in zip(r0["t"], r1["t"], strict=True))  # per-sample σ stay per rank
    assert r0["local"] == r1["local"] == 40 and r0["total"] == r1["total"] == 80  # counts summed over ranks
    assert r0["resampled"][1] == r1["resampled"][1] == r0["resampled"][0] + r1["resampled"][0]
    assert r0["compared"] == r1["compared"] == (40, 0)  # one bucket: the ranks never disagreed
    # only the main process logs (init_trackers runs there), with the cross-rank totals
    assert r1["trackers"] == 0 and not r1["logged"] and r0["trackers"] == 1 and len(r0["logged"]) == 40
    assert [logs["downscale/steps"] for logs in r0["logged"]] == [2.0 * (i + 1) for i in range(40)]
    # ... and saves, with the whole run's counts in the metadata
    assert os.listdir(tmp_path / "rank0") == ["last.safetensors"] and not (tmp_path / "rank1").exists()
    with safe_open(str(tmp_path / "rank0" / "last.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["ss_downscale_counts"])["forwards"] == 80
    assert r0["patched"] == r1["patched"] == []  # the run's patches came off on both ranks (rank 1: at end_training)
    # the host's gradient all-reduce keeps the replicas in step (their data and σ differ)
    assert all(torch.allclose(r0["weights"][k], r1["weights"][k], atol=1e-6) for k in r0["weights"])


# -- --save_state on the main process, both ranks --resume -------------------------------------------

RESUMED = {"routes": [{"scale": 0.5, "sigma_min": 0.5}]}


def _resume_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """A run that saves its state at step 4 (main process), then both ranks resume from it."""
    _init(rank, world, port)
    try:
        import musubi_trainers

        common = ("--timestep_sampling", "sigmoid", "--batch_size", "2", "--items_per_bucket", "8", "--max_train_steps", "8")
        downscale = RESUMED
        cls = musubi_trainers.QwenImageNetworkTrainer
        first_dir = os.path.join(out_dir, f"first{rank}")
        first = _train(
            cls, *common, *_mine(rank), "--save_state", "--save_every_n_steps", "4", "--output_dir", first_dir, downscale=downscale
        )
        dist.barrier()
        state = os.path.join(out_dir, "first0", "last-step00000004-state")  # the main process saved it
        resumed_dir = os.path.join(out_dir, f"resumed{rank}")
        resumed = _train(cls, *common, *_mine(rank), "--resume", state, "--output_dir", resumed_dir, downscale=downscale)
        run = resumed.last_network.downscale_run
        torch.save(
            {
                "offset": run.router.resume_offset,
                "forwards": run.hook.step,
                "local": run.accounting.total_steps,
                "total": run.totals.total_steps,
                "first": [c["tokens"] for c in first.last_transformer.calls],
                "resumed": [c["tokens"] for c in resumed.last_transformer.calls],
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def resumed_ranks(tmp_path_factory) -> tuple[Path, dict, dict]:
    """The two-rank run that saved its state at step 4 and resumed from it (its directory, both ranks' records)."""
    out = tmp_path_factory.mktemp("resume")
    return (out, *_spawn(_resume_rank, out))


def test_two_gloo_ranks_resume_with_the_whole_runs_counts(resumed_ranks):
    """The main process saves the cross-rank totals with its state at step 4; on ``--resume`` every rank reads the
    resumed forwards (total / ranks) and only the main process adds the totals back, so the totals and
    ``ss_downscale_counts`` are the whole run's on every rank, not doubled. musubi-tuner restarts global_step at 0
    and trains ``max_train_steps`` again: the router's forward n is absolute forward 4 + n."""
    tmp_path, r0, r1 = resumed_ranks
    assert os.listdir(tmp_path / "first0") and not (tmp_path / "first1").exists()  # saves: the main process only
    steps = [f"last-step{n:08d}{ext}" for n in (4, 8) for ext in ("-state", ".safetensors")]
    assert sorted(os.listdir(tmp_path / "first0")) == sorted(["last-state", "last.safetensors", *steps])
    assert r0["offset"] == r1["offset"] == 4 and r0["forwards"] == r1["forwards"] == 8
    assert r0["local"] == 4 * 2 + 8 and r1["local"] == 8  # rank 0 carries the saved totals (4 forwards × 2 ranks)
    assert r0["total"] == r1["total"] == 4 * 2 + 8 * 2
    with safe_open(str(tmp_path / "resumed0" / "last.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["ss_downscale_counts"])["forwards"] == 24
    assert not (tmp_path / "resumed1").exists()
    # the resumed forwards 1–4 are absolute 5–8: they route as the saved run's 5–8, on both ranks
    assert r0["resumed"] == r1["resumed"] and r0["first"] == r1["first"]
    assert r0["resumed"][:4] == r0["first"][4:8] and len({shape[1] for shape in r0["first"] + r0["resumed"]}) == 2


def test_a_state_saved_on_two_ranks_resumes_on_one_process_at_the_same_forward(resumed_ranks, monkeypatch):
    """The counts in the state are sums over the two ranks that saved it (8 forwards = 4 per rank); a run resumed on one
    process goes on at absolute forward 4, not 8, so its forwards 1–4 route as the saved run's 5–8 (the route is a
    function of the shared seed, rank 0's 100, and the absolute forward index)."""
    tmp_path, r0, _ = resumed_ranks
    monkeypatch.syspath_prepend(DOUBLES)
    import musubi_trainers

    state = str(tmp_path / "first0" / "last-step00000004-state")
    common = ("--timestep_sampling", "sigmoid", "--batch_size", "2", "--items_per_bucket", "8", "--max_train_steps", "8")
    out = str(tmp_path / "one")
    one = _train(musubi_trainers.QwenImageNetworkTrainer, *common, *_mine(0), "--resume", state, "--output_dir", out, downscale=RESUMED)
    run = one.last_network.downscale_run
    assert run.router.resume_offset == 4 and run.totals.total_steps == 4 * 2 + 8
    assert [c["tokens"] for c in one.last_transformer.calls][:4] == r0["first"][4:8]
    assert json.loads((Path(state) / COUNTS_FILE).read_text())["processes"] == 2


# -- ranks on different buckets ------------------------------------------------------------------------


def _bucket_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """Both ranks hold the same two buckets (the same token vocabulary, as every rank of a musubi-tuner run builds
    the whole dataset group); each rank's seed shuffles its batch order, so on some steps the ranks are on
    different buckets, where flux_shift's μ (from the latent size) gives them different route odds."""
    _init(rank, world, port)
    try:
        import musubi_trainers

        buckets = []

        class Recording(musubi_trainers.QwenImageNetworkTrainer):
            def call_dit(self, args, accelerator, transformer, latents, batch, *rest, **kwargs):
                buckets.append(tuple(batch["latents"].shape[-2:]))  # the grid the DiT runs (small when routed)
                return super().call_dit(args, accelerator, transformer, latents, batch, *rest, **kwargs)

        steps = 120
        argv = ("--timestep_sampling", "flux_shift", "--buckets", "64x64", "768x768", "--items_per_bucket", "1")
        downscale = {"routes": [{"scale": 0.5, "sigma_min": 0.6}]}
        out = os.path.join(out_dir, f"rank{rank}")
        trainer = _train(
            None, *argv, *_mine(rank), "--max_train_steps", str(steps), "--output_dir", out, downscale=downscale, trainer=Recording()
        )
        run = trainer.last_network.downscale_run
        torch.save(
            {"grids": buckets, "compared": run.totals.compared, "disagreed": run.totals.disagreed, "summary": run.totals.summary_text()},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_on_different_buckets_count_their_disagreements(tmp_path):
    r0, r1 = _spawn(_bucket_rank, tmp_path)
    native = {(8, 8): (8, 8), (4, 4): (8, 8), (96, 96): (96, 96), (48, 48): (96, 96)}  # run grid → its bucket
    routed = [[grid in ((4, 4), (48, 48)) for grid in r["grids"]] for r in (r0, r1)]
    bucket = [[native[grid] for grid in r["grids"]] for r in (r0, r1)]
    steps = len(r0["grids"])
    assert steps == len(r1["grids"]) == 120
    same = [a == b for a, b in zip(*bucket, strict=True)]
    assert 0 < sum(same) < steps  # the ranks were on different buckets on some steps, on the same on others
    assert all(a == b for a, b, s in zip(*routed, same, strict=True) if s)  # one bucket, one law: one route
    differ = sum(a != b for a, b in zip(*routed, strict=True))
    assert differ > 0  # 64² vs 768² under flux_shift: the route odds differ, so some steps must
    assert (r0["compared"], r0["disagreed"]) == (r1["compared"], r1["disagreed"]) == (steps, differ)
    assert f"ranks ran different routes on {differ} of {steps} steps" in r0["summary"]
