"""Scoped attribute replacement on a module or an object instance.

Every FasterDiT option reaches the host through one attribute looked up at call time (a module
function such as ``train_util.conditional_loss`` or ``flux_utils.prepare_img_ids``, or an instance
member such as a DiT's ``rope_embedder``). Replacing it only for the block that needs it keeps the
rest of the step, and every other trainer in the process, untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def swap_attr(owner: Any, name: str, value: Any) -> Iterator[Any]:
    """Set ``owner.name = value`` for the block and yield the previous value; always restored.

    When the previous value came from the class (a method, not in the instance ``__dict__``), the
    instance attribute is deleted afterwards instead of re-set, so no bound method is left behind
    shadowing the class (and a later class-level change stays visible).
    """
    from_class = name not in getattr(owner, "__dict__", {}) and hasattr(type(owner), name)
    previous = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield previous
    finally:
        if from_class:
            delattr(owner, name)
        else:
            setattr(owner, name, previous)
