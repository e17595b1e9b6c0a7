"""Where a started or resumed sd-scripts run stands in the adapter's forward count (train_network.py).

The router keys early/late spans, the coupled gate's lead draw and ``spread`` coins to the
**absolute forward index**: the 1-based count of train forwards the adapter has had, over every run
that trained it. This run's forward n (1-based) is absolute forward ``s × A + n``, where A is
``--gradient_accumulation_steps`` and s the host's own *initial step* (optimizer steps), which the
host takes, in this order (train_network.py):

1. ``--initial_step`` (even with ``--resume``: the host then ignores the state's step);
2. ``--initial_epoch`` e: ``(e − 1) × ⌈L / P / A⌉`` (L: batches per epoch of this process's
   dataloader, P: processes);
3. the ``current_step`` of ``train_state.json`` in the ``--resume`` state (the optimizer steps
   done when the state was saved; train_network.py), read by the run's accelerate load hook;
4. else 0.

What the host then does with s > 0 (U = ⌈L / A⌉ update steps per epoch):

- ``--skip_until_initial_step``: S = s × A; it starts at epoch E = S // U, skips S − E·L batches of
  it when that is positive and sets ``global_step = S − E·L`` (train_network.py).
  With A = 1 that is exactly the uninterrupted run's data from forward S + 1 on; with
  A > 1 it is only while S < U (E = 0): E counts update steps against batches, so once S ≥ U the
  host skips E·L > S batches (whole epochs the adapter never trained on), and ``global_step`` (in
  forwards, not updates) ends the run early. The index stays s × A + n: the adapter's own count,
  which is the uninterrupted run's index of the same forward wherever the host resumes the
  uninterrupted run's data.
- no skip (``--resume`` alone, or ``--initial_step``/``--initial_epoch`` without the flag): the host
  starts at epoch s // U from its first batch with ``global_step = 0`` and trains until
  ``global_step`` reaches ``max_train_steps`` or the epochs run out (train_network.py); its step
  count restarts, the restored optimizer, scheduler and weights do not. The adapter has had s × A
  forwards (with ``--resume`` alone: those the saved state trained), so this run's forwards are
  s × A + 1, s × A + 2, …: no index repeats an earlier run's, spans read training progress.

T (for early/late spans) stays ``max_train_steps × A``; forwards past T are late.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from ...rng import plugin_logger

logger = plugin_logger(__name__)

HOST_STATE_FILE = "train_state.json"  # written into the state dir by the host's save hook (train_network.py)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def read_host_state(state_dir: str) -> dict | None:
    """The host's ``train_state.json`` in a state dir (``{"current_epoch", "current_step"}``), or None."""
    path = os.path.join(state_dir, HOST_STATE_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        logger.warning("downscale_plugin: cannot read %s: %s", path, err)
        return None


def host_initial_step(args: Any, steps_from_state: int | None, batches: int | None, processes: int) -> tuple[int, str]:
    """The host's initial step s and where it came from (train_network.py)."""
    accumulation = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    initial_step, initial_epoch = _int(getattr(args, "initial_step", None)), _int(getattr(args, "initial_epoch", None))
    if initial_step is not None:
        return initial_step, f"--initial_step {initial_step}"
    if initial_epoch is not None:
        if batches is None:
            raise ValueError("--initial_epoch: the loop's batches per epoch are unknown")
        return (initial_epoch - 1) * math.ceil(batches / processes / accumulation), f"--initial_epoch {initial_epoch}"
    if steps_from_state is not None:
        return int(steps_from_state), f"{HOST_STATE_FILE} current_step {int(steps_from_state)}"
    return 0, "a fresh start"


@dataclass(frozen=True)
class HostStart:
    """Where the host's loop starts (train_network.py) and the absolute index of this run's forward 0."""

    initial_step: int  # s, in optimizer steps
    source: str
    accumulation: int
    skip: bool  # --skip_until_initial_step took effect (s > 0)
    batches: int | None  # L: batches per epoch of this process's dataloader
    epoch_to_start: int | None = None  # E (0-based)
    skipped: int = 0  # batches of epoch E the host skips
    global_step: int = 0  # the host's global_step at its first train step

    @property
    def offset(self) -> int:
        """Absolute index of this run's forward 0: its forward n is ``offset + n``."""
        return self.initial_step * self.accumulation

    @property
    def data_forward(self) -> int | None:
        """Forwards before the host's first trained batch in the uninterrupted run's batch order."""
        return None if self.epoch_to_start is None else self.epoch_to_start * self.batches + self.skipped

    @classmethod
    def of(cls, args: Any, steps_from_state: int | None, batches: int | None, processes: int) -> HostStart:
        accumulation = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
        s, source = host_initial_step(args, steps_from_state, batches, processes)
        skip = s > 0 and bool(getattr(args, "skip_until_initial_step", False))
        if s <= 0 or batches is None:
            return cls(s, source, accumulation, skip, batches, 0 if s <= 0 else None)
        per_epoch = math.ceil(batches / accumulation)
        if not skip:
            return cls(s, source, accumulation, False, batches, s // per_epoch)
        total = s * accumulation
        epoch = total // per_epoch
        left = total - epoch * batches
        return cls(s, source, accumulation, True, batches, epoch, max(left, 0), left)

    def describe(self) -> str:
        """One line: the index this run's forwards get, and where the host's loop starts."""
        if self.initial_step <= 0:
            return "absolute forward index = n, this run's forward (no initial step)"
        head = (
            f"absolute forward index = {self.initial_step} × {self.accumulation} + n = {self.offset} + n "
            f"(initial step {self.initial_step} from {self.source})"
        )
        if self.epoch_to_start is None:
            return head
        where = f"the host starts at epoch {self.epoch_to_start + 1} batch {self.skipped + 1} with global_step {self.global_step}"
        if self.skip:
            return f"{head}; {where} (--skip_until_initial_step)"
        again = self.offset - self.data_forward
        tail = f", {again} forward(s) of data the adapter had again" if again > 0 else ""
        return f"{head}; {where} (no --skip_until_initial_step: its step count restarts{tail})"

    def warning(self) -> str | None:
        """The host's skip arithmetic leaving the uninterrupted run's data order (A > 1), in words; else None."""
        if not self.skip or self.data_forward is None or self.data_forward == self.offset:
            return None
        return (
            f"--skip_until_initial_step with gradient_accumulation_steps {self.accumulation}: the host skips to epoch "
            f"{self.epoch_to_start + 1} (epoch_to_start = {self.offset} // ⌈{self.batches} / {self.accumulation}⌉), past "
            f"{self.data_forward - self.offset} batch(es) the adapter never trained on, with global_step {self.global_step}; "
            f"routing keeps the adapter's count {self.offset} + n"
        )


def banner_line(args: Any) -> str | None:
    """The start banner's resume line (before the host has resumed: the rule, and the state's step if readable)."""
    resume = getattr(args, "resume", None)
    initial_step, initial_epoch = getattr(args, "initial_step", None), getattr(args, "initial_epoch", None)
    if not resume and initial_step is None and initial_epoch is None:
        return None
    accumulation = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    flags = [f"--resume {resume}"] if resume else []
    flags += [f"--initial_step {initial_step}"] if initial_step is not None else []
    flags += [f"--initial_epoch {initial_epoch}"] if initial_epoch is not None else []
    flags += ["--skip_until_initial_step"] if getattr(args, "skip_until_initial_step", False) else []
    if initial_step is not None:
        s = f"s = {initial_step}"
    elif initial_epoch is not None:
        s = f"s = ({initial_epoch} − 1) × ⌈batches per epoch / processes / {accumulation}⌉"
    else:
        state = None if getattr(args, "resume_from_huggingface", False) else read_host_state(str(resume))
        step = (state or {}).get("current_step")
        s = (
            f"s = {step} ({HOST_STATE_FILE} current_step)"
            if step is not None
            else f"s = the state's {HOST_STATE_FILE} current_step (0 without one)"
        )
    return (
        f"resume ({' '.join(flags)}): spans, the coupled gate's step draws and spread coins keyed to the absolute forward index "
        f"s × {accumulation} + n "
        f"(n: this run's forward), {s}" + ("; counts continue from the state's" if resume else "")
    )


class HostResume:
    """Resolves the run's :class:`HostStart` once, at the first train step: from the loop's frame (the
    prepared ``train_dataloader``, ``epoch_to_start``, ``current_step``) and the ``train_state.json`` the
    run's load hook read (``host_state``). Logs it on the main process."""

    def __init__(self, args: Any, accelerator: Any, frame: Any, current_step: Any, host_state: Any):
        self.args = args
        self.accelerator = accelerator
        self.frame = frame
        self.current_step = current_step
        self.host_state = host_state  # () -> dict | None
        self.start: HostStart | None = None

    def resolve(self) -> HostStart:
        if self.start is not None:
            return self.start
        loop = dict(self.frame.f_locals) if self.frame is not None else {}
        loader = loop.get("train_dataloader")
        batches = len(loader) if loader is not None else None
        state = self.host_state() or {}
        processes = int(self.accelerator.num_processes)
        try:
            start = HostStart.of(self.args, _int(state.get("current_step")), batches, processes)
        except ValueError as err:
            logger.warning("downscale_plugin: %s; routing counts this run's forwards from 1", err)
            start = HostStart(0, "unknown", int(getattr(self.args, "gradient_accumulation_steps", 1) or 1), False, batches, 0)
        self.start = start
        main = int(self.accelerator.process_index) == 0
        seen = (loop.get("epoch_to_start"), None if self.current_step is None else int(self.current_step.value))
        expected = (start.epoch_to_start, start.global_step)
        if start.epoch_to_start is not None and seen[0] is not None and seen != expected and main:
            logger.warning(
                "downscale_plugin: the host loop starts at epoch_to_start %s, global_step %s; its arithmetic at this revision "
                "gives %s, %s: routing keys forwards from %d + n",
                *seen,
                *expected,
                start.offset,
            )
        if main:
            logger.info("downscale_plugin: %s", start.describe())
            note = start.warning()
            if note:
                logger.warning("downscale_plugin: %s", note)
        return start
