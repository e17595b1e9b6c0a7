"""The run's patch record (downscale_plugin/scope.py ``Patches``): every patch undone, in reverse."""

from __future__ import annotations

import types

from downscale_plugin.scope import Patches


class Host:
    def method(self) -> str:
        return "class"


def test_patches_restore_instance_class_and_missing_attributes_in_reverse():
    host, module = Host(), types.SimpleNamespace(fn="original")
    host.field = 1
    order: list[str] = []
    patches = Patches()
    assert patches.set(host, "method", lambda: "patched") is not None
    patches.set(host, "field", 2)
    patches.set(host, "added", 3)
    patches.set(module, "fn", "replaced")
    patches.set(module, "fn", "twice")  # a second patch of one handle unwinds to the first
    patches.on_undo(lambda: order.append("hook removed"))
    assert (host.method(), host.field, host.added, module.fn, len(patches)) == ("patched", 2, 3, "twice", 6)
    patches.undo()
    assert host.method() == "class" and "method" not in host.__dict__  # no bound shadow of the class left
    assert host.field == 1 and not hasattr(host, "added") and module.fn == "original"
    assert order == ["hook removed"] and len(patches) == 0
    patches.undo()  # idempotent
    assert order == ["hook removed"]
