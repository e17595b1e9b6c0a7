"""Attribute replacement on a module or an object instance: for one block, or for one run.

Every host handle the plugin uses is one attribute looked up at call time (a module function such
as a σ sampler or a loss, an instance member such as a DiT's ``rope_embedder`` or a trainer's step
method). :func:`swap_attr` replaces one only for the block that needs it, keeping the rest of the
step, and every other trainer in the process, untouched. :class:`Patches` is the record of the
replacements that last a whole run (the trainer's wrapped methods, the network's save, the
accelerator's hooks): the run owns one and undoes it, in reverse, when it ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def _restorer(owner: Any, name: str) -> Callable[[], None]:
    """Undo for ``setattr(owner, name, ...)``: re-set the previous value, or, when it came from the
    class (a method not in the instance ``__dict__``), delete the instance attribute, so no bound
    method is left behind shadowing the class (and a later class-level change stays visible)."""
    if name not in getattr(owner, "__dict__", {}) and hasattr(type(owner), name):
        return lambda: delattr(owner, name)
    previous = getattr(owner, name)
    return lambda: setattr(owner, name, previous)


@contextmanager
def swap_attr(owner: Any, name: str, value: Any) -> Iterator[Any]:
    """Set ``owner.name = value`` for the block and yield the previous value; always restored."""
    previous = getattr(owner, name)
    restore = _restorer(owner, name)
    setattr(owner, name, value)
    try:
        yield previous
    finally:
        restore()


class Patches:
    """The long-lived patches of one run, undone in reverse order by :meth:`undo` (idempotent)."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def set(self, owner: Any, name: str, value: Any) -> Any:
        """``owner.name = value`` until :meth:`undo`; returns the value it replaced."""
        previous = getattr(owner, name, None)
        self._undo.append(_restorer(owner, name) if hasattr(owner, name) else lambda: delattr(owner, name))
        setattr(owner, name, value)
        return previous

    def on_undo(self, undo: Callable[[], None]) -> None:
        """Record another kind of patch by its undo (e.g. a hook handle's ``remove``)."""
        self._undo.append(undo)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()

    def __len__(self) -> int:
        return len(self._undo)
