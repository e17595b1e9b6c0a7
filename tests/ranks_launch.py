"""Launching a harness's training script as several CPU ranks and reading back what each rank recorded
(``tests/sd_scripts_e2e.py``, ``tests/musubi_e2e.py``, their ``ranks`` modes). Each rank runs the harness again
with ``--rank`` and writes ``WORK/rank{R}.json`` and ``WORK/rank{R}.log``; the launcher's output goes to
``WORK/launch.log``."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_command(script: str, processes: int, rank_argv: Sequence[str]) -> list[str]:
    """accelerate's launcher for ``processes`` CPU ranks of ``script --rank RANK_ARGV...`` on this machine.
    ``--num_processes N`` alone (or with ``--cpu``) takes accelerate's simple launcher, which starts one process;
    ``--multi_gpu`` takes torchrun's, which starts N, and each rank's Accelerator (ACCELERATE_USE_CPU, no visible GPU)
    then runs MULTI_CPU on gloo."""
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
        "--num_cpu_threads_per_process", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
        os.path.abspath(script), "--rank", *rank_argv,
    ]  # fmt: skip


def launch_ranks(script: str, work: Path, processes: int, rank_argv: Sequence[str], timeout: int) -> list[dict]:
    """Run the launch (killing the launcher and its ranks, their own session, past ``timeout`` s: a hung collective);
    return each rank's ``rank{R}.json`` with the banners and summaries its output printed (:func:`printed`)."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    with open(work / "launch.log", "w") as log:
        command = launch_command(script, processes, rank_argv)
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as late:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"the {processes}-process launch ran past {timeout} s (hung?)\n{log_tails(work, processes)}") from late
    assert code == 0, f"the launch exited {code}\n{log_tails(work, processes)}"
    ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(processes)]
    for r, rank in enumerate(ranks):
        assert rank["rank"] == r and rank["world_size"] == processes, (r, rank["rank"], rank["world_size"])
        rank.update(printed((work / f"rank{r}.log").read_text(errors="replace")))
    return ranks


def log_tails(work: Path, processes: int, chars: int = 6000) -> str:
    paths = [work / "launch.log", *(work / f"rank{r}.log" for r in range(processes))]
    return "\n".join(f"---- {p.name}\n{p.read_text(errors='replace')[-chars:]}" for p in paths if p.exists())


def printed(text: str) -> dict:
    """The plugin's start banner and end summary in one rank's output (printed, or logged after a logger's prefix):
    the banner's head lines, and each summary block (its head line, from where it starts, and the indented lines
    that follow it). The summary is printed right after the host's progress bar, which ends without a newline."""
    lines = text.splitlines()
    banners = [line for line in lines if re.search(r"(^|:)downscale_plugin \S+: \w+ \(.*process\(es\)", line)]
    summaries = []
    for i, line in enumerate(lines):
        head = re.search(r"downscale: \d+ train forwards", line)
        if head:
            block = [line[head.start() :]]
            for more in lines[i + 1 :]:
                if not re.match(r"  \S", more):  # its own lines; not the next log record (rich's indented continuation)
                    break
                block.append(more)
            summaries.append("\n".join(block))
    return {"banners": banners, "summaries": summaries}


def frozen_modules_unwrapped() -> list:
    """accelerate's MULTI_CPU ``prepare_model`` wraps every model in DDP, which refuses one without a trainable
    parameter ("DistributedDataParallel is not needed when a module doesn't have any parameter that requires a
    gradient"): the trainer's frozen DiT (sd-scripts' ``prepare_unet_with_accelerator``, musubi-tuner's
    ``accelerator.prepare(transformer)``; the LoRA's parameters live in the network, not in the DiT). Its multi-GPU branch leaves such a
    model unwrapped; this gives the CPU ranks that branch's behaviour (the network is still wrapped in DDP). Returns
    the list it fills: per prepared model, its class and what ``prepare_model`` returned."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    real = Accelerator.prepare_model
    prepared: list = []

    @functools.wraps(real)
    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        frozen = not any(p.requires_grad for p in model.parameters())
        if self.distributed_type == DistributedType.MULTI_CPU and frozen:
            evaluation_mode = True  # placement as usual, no DDP
        out = real(self, model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        prepared.append([type(model).__name__, type(out).__name__])
        return out

    Accelerator.prepare_model = prepare_model
    return prepared
