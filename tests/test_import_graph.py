"""The layering of fastdp/ stays as docs/how-it-works.md states it (section "Layers"): a module
imports only from its own layer or a lower one, and no imports run in a circle. Read with ast,
not by importing: imports inside functions count, those under ``if TYPE_CHECKING:`` do not."""

from __future__ import annotations

import ast
import os
import re

import pytest
from models import ROOT

PKG = os.path.join(ROOT, "fastdp")
DOC = os.path.join(ROOT, "docs", "how-it-works.md")

# The C++ extension (csrc/, built as fastdp._C): below every Python module, imports none.
EXTENSION = "_C"


def documented_layers(text: str) -> dict[str, int]:
    """Module (short name; ``fastdp``: the package) -> its layer, 1 at the bottom."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    layers: dict[str, int] = {}
    for m in re.finditer(r"^(\d+)\. [^:\n]+: (.+)$", section, re.MULTILINE):
        for name in re.findall(r"`([\w.]+)`", m.group(2)):
            assert name not in layers, f"{name} is listed in two layers"
            layers[name] = int(m.group(1))
    return layers


def module_name(path: str, pkg: str) -> str:
    rel = os.path.relpath(path, pkg)[: -len(".py")].split(os.sep)
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join(rel) or "fastdp"


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _type_checking(child.test):
            yield from (n for c in child.orelse for n in [c, *_imports(c)])
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _imports(child)


def _short(dotted: str) -> str | None:
    if dotted == "fastdp":
        return "fastdp"
    return dotted[len("fastdp.") :] if dotted.startswith("fastdp.") else None


def imported_modules(source: str, name: str, modules: set[str]) -> set[str]:
    """The fastdp modules ``source`` (module ``name``) imports, by short name."""
    out = set()
    for node in _imports(ast.parse(source)):
        if isinstance(node, ast.Import):
            found = [_short(a.name) for a in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                parts = ["fastdp"] + ([] if name == "fastdp" else name.split("."))
                base = ".".join(parts[: len(parts) - node.level] + ([base] if base else []))
            found = []
            for a in node.names:
                full = _short(f"{base}.{a.name}")
                if full in modules or full == EXTENSION:
                    found.append(full)
                else:  # a name defined in ``base`` (``from fastdp import FastDataParallel``)
                    found.append(_short(base))
        out.update(m for m in found if m is not None and m in modules)
    out.discard(name)
    return out


def import_graph(pkg: str) -> dict[str, set[str]]:
    sources = {}
    for dirpath, _, files in os.walk(pkg):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8") as fh:
                    sources[module_name(path, pkg)] = fh.read()
    modules = set(sources)
    return {m: imported_modules(src, m, modules) for m, src in sources.items()}


def layer_of(module: str, layers: dict[str, int]) -> int | None:
    while module not in layers and "." in module:
        module = module.rsplit(".", 1)[0]  # bench.cli: the layer of bench
    return layers.get(module)


def upward(graph: dict[str, set[str]], layers: dict[str, int]) -> list[tuple[str, str]]:
    return sorted(
        (m, d)
        for m, deps in graph.items()
        for d in deps
        if layer_of(d, layers) > layer_of(m, layers)
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def layers():
    with open(DOC, encoding="utf-8") as f:
        return documented_layers(f.read())


@pytest.fixture(scope="module")
def graph():
    return import_graph(PKG)


def test_every_module_has_one_documented_layer(graph, layers):
    assert sorted(m for m in graph if layer_of(m, layers) is None) == []
    listed = {m for m in layers if m in graph or any(g.startswith(m + ".") for g in graph)}
    assert sorted(set(layers) - listed) == []  # the list names no module that is gone


def test_no_module_imports_a_higher_layer(graph, layers):
    assert upward(graph, layers) == []


def test_no_import_circles(graph):
    assert cycles(graph) == []


def test_the_checker_sees_function_level_and_skips_type_checking_imports():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from fastdp.data_parallel import FastDataParallel\n"
        "def f():\n    from fastdp import _launch\n    import fastdp.comm as c\n"
        "from fastdp import FastDataParallel\n"
    )
    mods = {"fastdp", "_launch", "comm", "data_parallel", "_tree"}
    assert imported_modules(source, "_tree", mods) == {"_launch", "comm", "fastdp"}
    graph = {"_tree": {"_launch"}, "_launch": {"_tree"}, "comm": set()}
    assert cycles(graph) == [["_launch", "_tree"]]
    assert upward({"_tree": {"_launch"}, "_launch": set()}, {"_tree": 1, "_launch": 7}) == [
        ("_tree", "_launch")
    ]


def test_the_no_sync_cycle_sits_on_the_reducer_and_the_wrapper_reaches_neither(graph):
    """``NoSyncCycle`` (``_no_sync``) folds through the reducer's sum; the reducer knows nothing
    of the cycle; the wrapper asks the replica set to fold (no gradient lists cross from the
    reducer to it); the renewal rule is a pure function that imports nothing of the package."""
    assert "_reducer" in graph["_no_sync"]
    assert "_no_sync" not in graph["_reducer"]
    assert {"_no_sync", "_reducer"} <= graph["_replica_set"]
    assert graph["data_parallel"] & {"_no_sync", "_reducer"} == set()
    assert graph["_renewal"] == set()
    assert "_renewal" in graph["_replica_set"]
