"""The map's cell journal: every finished (image, bin) cell on disk as it ends, so a map resumes.

A map at a few thousand tokens runs for hours on a CPU, and a map on a real model for hours on a
GPU; a process that ends early (a session's end, a preempted job) should lose one cell, not the
map. ``map --out DIR`` appends each finished cell to ``DIR/cells.partial.jsonl`` (one JSON line, its
floats exact); ``map --resume`` reads it back and measures only the cells it lacks. Every cell is
seeded per (image, bin, arm, draw) (``estimator.collect``), so a resumed map equals the map run in
one go, bit for bit at the same torch build and thread count.

The journal's first line is its key: the measurement's settings (the command without the flags
that only read it: margin, alpha, simultaneous, out) and the code revision. A resume under another
key is refused before any model loads: cells measured under other settings or other code would be
mixed into one map without a trace. The journal is removed once the map's outputs are written.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .estimator import Cell

JOURNAL = "cells.partial.jsonl"


class JournalError(ValueError):
    """A journal that cannot be resumed from: unreadable, or written under another key."""


class CellJournal:
    """Append-only cells of one map measurement, keyed by its settings and code revision."""

    def __init__(self, out_dir: str | os.PathLike[str], key: dict[str, Any]) -> None:
        self.path = Path(out_dir) / JOURNAL
        self.key = key

    def exists(self) -> bool:
        return self.path.is_file()

    def read(self) -> list[tuple[Cell, float]]:
        """The cells of a journal written under this key, each with the seconds it took (the last copy of
        a cell wins; a torn last line, a process ended while writing it, is dropped)."""
        try:
            lines = self.path.read_text().splitlines()
        except OSError as err:
            raise JournalError(f"resume: cannot read {self.path}: {err}") from err
        try:
            header = json.loads(lines[0])["key"] if lines else None
        except (ValueError, KeyError, TypeError) as err:
            raise JournalError(f"resume: {self.path} has no key line: {err}") from err
        if header != self.key:
            changed = sorted(k for k in set(self.key) | set(header or {}) if (header or {}).get(k) != self.key.get(k))
            details = "; ".join(f"{k}: {(header or {}).get(k)!r} in the journal, {self.key.get(k)!r} now" for k in changed)
            raise JournalError(f"resume: {self.path} was written under other settings or code ({details}); rerun without --resume")
        cells: dict[tuple[int, int], tuple[Cell, float]] = {}
        for number, line in enumerate(lines[1:], start=2):
            try:
                blob = json.loads(line)
            except ValueError as err:
                if number == len(lines):  # the process ended while writing it
                    break
                raise JournalError(f"resume: {self.path} line {number}: {err}") from err
            cell = Cell(blob["image"], blob["bin"], _floats(blob["half_cos"]), _floats(blob["cos"]), _floats(blob["norm"]))
            cells[(cell.image, cell.bin)] = (cell, float(blob["seconds"]))
        return list(cells.values())

    def start(self, cells: Iterable[tuple[Cell, float]] = ()) -> None:
        """A new journal under this key, holding ``cells`` (those a resume carries over, with their seconds)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w") as fh:
            fh.write(json.dumps({"key": self.key}) + "\n")
            for cell, seconds in cells:
                fh.write(_line(cell, seconds))
            fh.flush()
            os.fsync(fh.fileno())

    def append(self, cell: Cell, seconds: float) -> None:
        with open(self.path, "a") as fh:
            fh.write(_line(cell, seconds))
            fh.flush()
            os.fsync(fh.fileno())

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def _line(cell: Cell, seconds: float) -> str:
    return json.dumps({**asdict(cell), "seconds": round(seconds, 3)}) + "\n"  # NaN as the token NaN: read back exactly, as every float


def _floats(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) if v is not None else math.nan for k, v in values.items()}
