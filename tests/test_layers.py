"""The import rule of docs/ARCHITECTURE.md: core ← features (mapping, fasterdit) ← hosts, and the lab
(a stand-in host trainer) imports nothing from the plugin.

Every import counts, wherever it stands (module level, inside a function, ``importlib.import_module``
with a literal name), because a lazy import is still a dependency. The package's entry files
(``__init__`` with its lazy public names, ``__main__``) may name any layer: they are the front door.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "downscale_plugin"
ENTRY_FILES = {"__init__.py", "__main__.py"}
FEATURES = ("mapping", "fasterdit")


def layer(module: str) -> str:
    """``core``, ``feature``, ``host`` or ``lab`` for a dotted module name inside the package."""
    parts = module.split(".")[1:]
    if not parts:
        return "entry"
    if parts[0] in FEATURES:
        return "feature"
    if parts[0] in ("hosts", "lab"):
        return "host" if parts[0] == "hosts" else "lab"
    return "core"


ALLOWED = {
    "core": {"core"},
    "feature": {"core", "feature"},
    "host": {"core", "feature", "host", "lab"},
    "lab": {"lab"},
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every plugin module this file imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found += [(node.lineno, target)]
            if node.module is None or node.level:  # ``from . import x``: x may be a submodule
                found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return [(line, name) for line, name in found if name == "downscale_plugin" or name.startswith("downscale_plugin.")]


def plugin_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if not (p.parent == PACKAGE and p.name in ENTRY_FILES))


def violations(path: Path) -> list[str]:
    own = layer(module_name(path))
    out = []
    for line, target in imported_modules(path):
        theirs = layer(target)
        if theirs == "entry" and own != "host" or theirs not in ALLOWED[own] | {"entry"}:
            out.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {own} imports {target} ({theirs})")
    return out


def test_every_layer_imports_only_downward():
    problems = [v for path in plugin_files() for v in violations(path)]
    assert not problems, "\n".join(problems)


# What each host package may import of the others (docs/ARCHITECTURE.md §1): the shared kohya package
# none; the two kohya hosts the shared package only; the lab adapter also sd-scripts' hook and σ family,
# because the lab trainer is a stand-in with sd-scripts' Flux trainer contract.
HOST_PACKAGES = {"kohya": set(), "sd_scripts": {"kohya"}, "musubi": {"kohya"}, "lab": {"kohya", "sd_scripts"}}


def host_package(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "hosts" else None


def test_host_packages_import_only_the_shared_one():
    problems = []
    for path in plugin_files():
        own = host_package(module_name(path))
        if own is None:
            continue
        for line, target in imported_modules(path):
            theirs = host_package(target)
            if theirs is not None and theirs != own and theirs not in HOST_PACKAGES[own]:
                problems.append(f"{path.relative_to(PACKAGE.parent)}:{line}: hosts.{own} imports {target}")
    assert not problems, "\n".join(problems)
    assert set(HOST_PACKAGES) == {p.name for p in (PACKAGE / "hosts").iterdir() if (p / "__init__.py").is_file()}


def import_cycles() -> list[list[str]]:
    """Every import cycle among the package's modules (the entry files aside), each as the path that closes it.
    Imports under ``if TYPE_CHECKING:`` count: an annotation that needs the importer back is the same coupling,
    only hidden from the interpreter."""
    files = {module_name(p): p for p in plugin_files()}
    graph = {name: sorted({t for _, t in imported_modules(path) if t in files and t != name}) for name, path in files.items()}
    found, state, stack = [], {}, []

    def visit(name: str) -> None:
        state[name] = "open"
        stack.append(name)
        for target in graph[name]:
            if state.get(target) == "open":
                found.append(stack[stack.index(target) :] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[name] = "done"

    for name in graph:
        if name not in state:
            visit(name)
    return found


def test_no_import_cycles():
    """No module imports, even lazily or for annotations only, a module that imports it back: what two modules
    both need lives in a third that both import (musubi-tuner's start and its auto session share
    ``family.run_sampler``, sd-scripts' ``trainer.plan_sampler``), or the importer states what it needs as a
    protocol (the lab's auto session, ``hosts/lab/auto.py``)."""
    cycles = [" → ".join(cycle) for cycle in import_cycles()]
    assert not cycles, "\n".join(cycles)


def code_strings(path: Path) -> list[tuple[int, str]]:
    """String constants of a file that are not docstrings (docstrings may tell which host does what)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


HOST_WORDS = ("library.", "sd_scripts", "sd-scripts", "musubi", "train_network", "downscale_plugin.hosts", "downscale_plugin.lab")


def test_core_and_features_name_no_host():
    """No host module name in core or feature code, not even as a string (a lookup table, a lazy import)."""
    problems = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {value!r}"
        for path in plugin_files()
        if layer(module_name(path)) in ("core", "feature")
        for line, value in code_strings(path)
        if any(word in value for word in HOST_WORDS)
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("source", "target", "allowed"),
    [
        ("downscale_plugin.router", "downscale_plugin.hosts.sd_scripts.hook", False),
        ("downscale_plugin.mapping.windows", "downscale_plugin.hosts.lab.map_backend", False),
        ("downscale_plugin.fasterdit.latent_stds", "downscale_plugin.lab.data", False),
        ("downscale_plugin.lab.trainer", "downscale_plugin.grid", False),
        ("downscale_plugin.hosts.lab.adapter", "downscale_plugin.lab.trainer", True),
        ("downscale_plugin.fasterdit.policies", "downscale_plugin.config", True),
    ],
)
def test_the_rule_itself(source, target, allowed):
    """The checker catches the upward imports the old layout had (core → mapping, features → lab)."""
    assert (layer(target) in ALLOWED[layer(source)]) is allowed
