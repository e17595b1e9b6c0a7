"""A trap for plugin code that reseeds or rewinds a global generator the host draws from (issue 10, item 2).

``RngTrap`` (a context manager) replaces, for as long as it is active:

- every global seeding function (``torch.manual_seed``/``seed`` and their ``torch.random`` names,
  ``torch.cuda``/``mps``/``xpu`` ``manual_seed``/``manual_seed_all``/``seed``/``seed_all``,
  ``random.seed``, ``numpy.random.seed``): a call with a plugin frame anywhere on the stack is a
  violation. ``torch.manual_seed`` calls ``torch.cuda.manual_seed_all`` through the module attribute
  even on a CPU-only build, so a ``from torch import manual_seed`` in plugin code is caught too;
- every global state setter (``torch.set_rng_state``, ``torch.cuda.set_rng_state[_all]``, the MPS/XPU
  ones, ``random.setstate``, ``numpy.random.set_state``): from plugin code only
  ``downscale_plugin.rng.forked`` may call them, and only to put back, generator by generator, the
  state it read on entry (the matching getters are wrapped to record what each fork saved);
- ``seed_forked`` in every loaded plugin module: it seeds through generator objects, which no
  function trap sees, so it must run inside an active ``forked`` whose devices include every
  device it seeds.

"Plugin code" is any frame whose file is under ``downscale_plugin/`` except ``downscale_plugin/lab/``,
the stand-in host (its trainer seeds like a host does). A host function that the plugin calls is
under a plugin frame, so a reseed the plugin causes through the host is caught as well. Violations
are recorded (``violations``: one line each, with the innermost plugin frame), never raised, so a run
completes and the test reports all of them; ``restores`` and ``seeded`` count what the trap checked
and passed, so a test can prove the trap saw the plugin's forks at all. Importable without pytest
(the real-host end-to-end run installs it in a subprocess).
"""

from __future__ import annotations

import importlib
import os
import random
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import downscale_plugin

try:
    from downscale_plugin import rng as plugin_rng
except ImportError:  # a tree from before rng.py (783fcdb and older): no plugin call may set a state at all
    plugin_rng = None

PLUGIN_DIR = os.path.dirname(os.path.abspath(downscale_plugin.__file__)) + os.sep
LAB_DIR = os.path.join(PLUGIN_DIR, "lab") + os.sep
REPO_DIR = os.path.dirname(PLUGIN_DIR.rstrip(os.sep))
FORKED_CODE = plugin_rng.forked.__wrapped__.__code__ if plugin_rng is not None else None

SEEDERS = (
    (torch, "manual_seed"),
    (torch, "seed"),
    (torch.random, "manual_seed"),
    (torch.random, "seed"),
    (torch.cuda, "manual_seed"),
    (torch.cuda, "manual_seed_all"),
    (torch.cuda, "seed"),
    (torch.cuda, "seed_all"),
    (torch.mps, "manual_seed"),
    (torch.mps, "seed"),
    (torch.xpu, "manual_seed"),
    (torch.xpu, "manual_seed_all"),
    (torch.xpu, "seed"),
    (torch.xpu, "seed_all"),
    (random, "seed"),
    (np.random, "seed"),
)
# (module, name, generator kind, index of the device argument or None, default device)
SETTERS = (
    (torch, "set_rng_state", "cpu", None, None),
    (torch.random, "set_rng_state", "cpu", None, None),
    (torch.cuda, "set_rng_state", "cuda", 1, "cuda"),
    (torch.cuda, "set_rng_state_all", "cuda_all", None, None),
    (torch.mps, "set_rng_state", "mps", 1, "mps"),
    (torch.xpu, "set_rng_state", "xpu", 1, "xpu"),
    (torch.xpu, "set_rng_state_all", "xpu_all", None, None),
    (random, "setstate", "python", None, None),
    (np.random, "set_state", "numpy", None, None),
)
GETTERS = (
    (torch, "get_rng_state", "cpu", None, None),
    (torch.random, "get_rng_state", "cpu", None, None),
    (torch.cuda, "get_rng_state", "cuda", 0, "cuda"),
    (torch.mps, "get_rng_state", "mps", 0, "mps"),
    (torch.xpu, "get_rng_state", "xpu", 0, "xpu"),
    (random, "getstate", "python", None, None),
    (np.random, "get_state", "numpy", None, None),
)
# Plugin modules that bind ``seed_forked`` at import; loaded up front so their names can be wrapped.
SEEDING_MODULES = (
    "downscale_plugin.router",
    "downscale_plugin.mapping.estimator",
    "downscale_plugin.mapping.certify",
    "downscale_plugin.hosts.sd_scripts.start",
    "downscale_plugin.hosts.sd_scripts.map_backend",
    "downscale_plugin.hosts.musubi.family",
    "downscale_plugin.hosts.lab.map_backend",
)


def is_plugin_file(path: str) -> bool:
    path = os.path.abspath(path)
    return path.startswith(PLUGIN_DIR) and not path.startswith(LAB_DIR)


def innermost_plugin_frame(frame: Any) -> Any:
    while frame is not None:
        if is_plugin_file(frame.f_code.co_filename):
            return frame
        frame = frame.f_back
    return None


def _forked_frame(frame: Any) -> Any:
    """``frame`` itself, or the ``rng.forked`` frame that runs it as a comprehension (its own frame before 3.12); else None."""
    if FORKED_CODE is None:
        return None
    while frame is not None and frame.f_code is not FORKED_CODE and frame.f_code.co_name.startswith("<"):
        if frame.f_code.co_filename != FORKED_CODE.co_filename:
            return None
        frame = frame.f_back
    return frame if frame is not None and frame.f_code is FORKED_CODE else None


def _where(frame: Any) -> str:
    return f"{os.path.relpath(frame.f_code.co_filename, REPO_DIR)}:{frame.f_lineno} in {frame.f_code.co_name}"


def _device_key(kind: str, args: tuple, kwargs: dict, index: int | None, default: str | None) -> str:
    if index is None:
        return kind
    device = args[index] if len(args) > index else kwargs.get("device", default)
    if isinstance(device, int):
        device = torch.device(kind, device)
    return str(torch.device(device))


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    return a == b


def _copy_state(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, np.ndarray):
        return state.copy()
    if isinstance(state, tuple | list):
        return type(state)(_copy_state(s) for s in state)
    if isinstance(state, dict):
        return {k: _copy_state(v) for k, v in state.items()}
    return state


class RngTrap:
    def __init__(self) -> None:
        self.violations: list[str] = []
        self.restores = 0  # states forked put back, each checked equal to what it saved
        self.seeded = 0  # seed_forked calls inside a fork that covers their devices
        self.host_seeds = 0  # global seeding with no plugin frame on the stack (the host's own)
        self._saved: dict[tuple[int, str], Any] = {}
        self._forks: dict[int, tuple[torch.device, ...]] = {}  # live forked frames → their devices
        self._undo: list[tuple[Any, str, Any]] = []

    # -- wrappers ---------------------------------------------------------------------------------

    def _seeder(self, module: Any, name: str, original: Callable) -> Callable:
        label = f"{module.__name__}.{name}"

        def trapped(*args, **kwargs):
            frame = innermost_plugin_frame(sys._getframe(1))
            if frame is None:
                self.host_seeds += 1
            else:
                self.violations.append(f"{label}{args!r} under plugin code at {_where(frame)}")
            return original(*args, **kwargs)

        return trapped

    def _getter(self, kind: str, index: int | None, default: str | None, original: Callable) -> Callable:
        def trapped(*args, **kwargs):
            state = original(*args, **kwargs)
            frame = _forked_frame(innermost_plugin_frame(sys._getframe(1)))
            if frame is not None:
                key = _device_key(kind, args, kwargs, index, default)
                self._saved[(id(frame), key)] = _copy_state(state)
                if kind == "cpu":  # forked reads the CPU state first: a fork is live from here
                    self._forks[id(frame)] = tuple(torch.device(d) for d in frame.f_locals.get("devices", ()))
            return state

        return trapped

    def _setter(self, module: Any, name: str, kind: str, index: int | None, default: str | None, original: Callable) -> Callable:
        label = f"{module.__name__}.{name}"

        def trapped(*args, **kwargs):
            frame = innermost_plugin_frame(sys._getframe(1))
            if frame is not None:
                frame = _forked_frame(frame) or frame
                key = _device_key(kind, args, kwargs, index, default)
                new_state = args[0] if args else next(iter(kwargs.values()), None)
                if frame.f_code is not FORKED_CODE:
                    self.violations.append(f"{label} under plugin code at {_where(frame)} (only rng.forked may restore a state)")
                elif (id(frame), key) not in self._saved:
                    self.violations.append(f"{label}: rng.forked at {_where(frame)} set a {key} state it never saved")
                elif not _same_state(self._saved.pop((id(frame), key)), new_state):
                    self.violations.append(f"{label}: rng.forked at {_where(frame)} restored a {key} state other than the one it saved")
                else:
                    self.restores += 1
                if frame.f_code is FORKED_CODE and kind == "cpu":
                    self._forks.pop(id(frame), None)
            return original(*args, **kwargs)

        return trapped

    def _seed_forked(self, original: Callable) -> Callable:
        def trapped(value, devices=()):
            where = _where(sys._getframe(1))
            wanted = {torch.device(d) for d in devices}
            if not self._forks:
                self.violations.append(f"seed_forked({value}, {list(devices)}) outside any rng.forked at {where}")
            elif not wanted <= set(list(self._forks.values())[-1]):
                forked = list(self._forks.values())[-1]
                self.violations.append(
                    f"seed_forked seeds {sorted(map(str, wanted))} but the live fork holds {list(map(str, forked))} at {where}"
                )
            else:
                self.seeded += 1
            return original(value, devices)

        return trapped

    # -- install / remove -------------------------------------------------------------------------

    def _swap(self, owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return
        self._undo.append((owner, name, original))
        setattr(owner, name, make(original))

    def __enter__(self) -> RngTrap:
        for name in SEEDING_MODULES:
            try:
                importlib.import_module(name)
            except ImportError:  # an optional extra (the map's scipy) missing: that module cannot run either
                pass
        for module, name in SEEDERS:
            self._swap(module, name, lambda f, m=module, n=name: self._seeder(m, n, f))
        for module, name, kind, index, default in GETTERS:
            self._swap(module, name, lambda f, k=kind, i=index, d=default: self._getter(k, i, d, f))
        for module, name, kind, index, default in SETTERS:
            self._swap(module, name, lambda f, m=module, n=name, k=kind, i=index, d=default: self._setter(m, n, k, i, d, f))
        seed_forked = plugin_rng.seed_forked if plugin_rng is not None else object()
        for module in [m for name, m in list(sys.modules.items()) if name.startswith("downscale_plugin") and m is not None]:
            if getattr(module, "seed_forked", None) is seed_forked:
                self._swap(module, "seed_forked", self._seed_forked)
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()
        if self._forks:
            self.violations.append(f"{len(self._forks)} rng.forked context(s) never restored")

    def report(self) -> str:
        return "\n".join(self.violations) or "no violations"


# -- the host's streams, bit for bit (issue 10, item 3) ---------------------------------------------


def rng_states() -> tuple:
    """Torch's CPU generator, Python's ``random`` and NumPy's global state, as they are now."""
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def set_rng_states(states: tuple) -> None:
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested tensors / arrays / RNG states (``None`` only equals ``None``)."""
    return _same_state(a, b)


class NativeStepCheck:
    """While active, every train step the hook dispatches is checked against the host's own method.

    For each step: the RNG states at the hook's entry and at the host method's entry must be equal
    (the dry run and the gate left no trace, routed or not). A step the router left to the host
    (``needs_replay`` false) is then run a second time, by the host method alone, from the entry
    states: its outputs (prediction, target, timesteps, weighting) and the RNG states after it must
    equal the plugin step's bit for bit. ``native`` / ``replayed`` count the two kinds of step;
    ``failures`` lists what differed."""

    def __init__(self) -> None:
        from downscale_plugin.hosts.sd_scripts import hook

        self.hook_cls = hook.DownscaleHook
        self.failures: list[str] = []
        self.native = 0
        self.replayed = 0

    def __enter__(self) -> NativeStepCheck:
        original_dispatch = self.hook_cls.dispatch
        check = self

        def dispatch(hook, original, *call, is_train=True):
            if not is_train:
                return original_dispatch(hook, original, *call, is_train=is_train)
            entry = rng_states()
            seen = {}

            def host(*args, **kwargs):
                seen.setdefault("states", rng_states())
                return original(*args, **kwargs)

            out = original_dispatch(hook, host, *call, is_train=True)
            after = rng_states()
            step = hook.step
            if not same(seen.get("states"), entry):
                check.failures.append(f"step {step}: the RNG states reaching the host differ from the step's entry states")
            if hook.last.needs_replay:
                check.replayed += 1
                return out
            check.native += 1
            set_rng_states(entry)
            theirs = original(*call, is_train=True)
            if not same(rng_states(), after):
                check.failures.append(f"step {step}: the RNG states after the step differ from the host's own")
            for name, ours, host_out in zip(("prediction", "target", "timesteps", "weighting"), out, theirs, strict=True):
                ours = ours.detach() if isinstance(ours, torch.Tensor) else ours
                host_out = host_out.detach() if isinstance(host_out, torch.Tensor) else host_out
                if not same(ours, host_out):
                    check.failures.append(f"step {step}: {name} differs from the host's own")
            set_rng_states(after)
            return out

        self._original = original_dispatch
        self.hook_cls.dispatch = dispatch
        return self

    def __exit__(self, *exc: Any) -> None:
        self.hook_cls.dispatch = self._original
