"""The replica set, the reducer and the no_sync cycle keep their state to themselves
(docs/how-it-works.md, *Layers*).

``ReplicaSet`` (``fastdp/_replica_set.py``), ``Reducer`` (``fastdp/_reducer.py``) and
``NoSyncCycle`` (``fastdp/_no_sync.py``) carry state across steps. The rules, read from the
source (an AST walk, nothing imported):

- every instance attribute is private and declared in ``__init__``, with a comment on its line;
- no other module of the library and no test reads or writes one of them: callers use the
  methods, whose docstrings state the contract (tests also ``ReplicaSet.for_tests()``, a hook
  no library module calls);
- a query (the methods listed in ``QUERIES``) assigns nothing on ``self``.

An attribute of the same name is not a violation where it is the accessing class's own state
(``self.x`` in a class of that module that assigns ``self.x``) or a module's attribute
(``fastdp._reducer.reduce_add``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from models import ROOT

GUARDED = {
    "ReplicaSet": "fastdp/_replica_set.py",
    "Reducer": "fastdp/_reducer.py",
    "NoSyncCycle": "fastdp/_no_sync.py",
}
QUERIES = {
    "ReplicaSet": [
        "valid",
        "serves",
        "launch_order",
        "runs_on_leaves",
        "holds_pending",
        "for_tests",
    ],
    "Reducer": ["graph_alive"],
    "NoSyncCycle": ["leaves", "awaits_backward"],
}
TEST_HOOKS = {"for_tests"}  # public methods only tests may call


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _self_targets(node: ast.AST) -> list[ast.Attribute]:
    """The ``self.x`` an assignment-like statement writes (tuples unpacked)."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = node.targets
    else:
        return []
    out: list[ast.Attribute] = []
    stack = list(targets)
    while stack:
        t = stack.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            stack.extend(t.elts)
        elif isinstance(t, ast.Starred):
            stack.append(t.value)
        elif isinstance(t, ast.Attribute):
            if isinstance(t.value, ast.Name) and t.value.id == "self":
                out.append(t)
    return out


def _writes_on_self(fn: ast.AST) -> list[ast.Attribute]:
    return [a for node in ast.walk(fn) for a in _self_targets(node)]


def instance_attributes(cls: ast.ClassDef) -> dict[str, list[tuple[str, ast.Attribute]]]:
    """Every ``self.x`` the class's methods assign: name -> [(method, node)]."""
    out: dict[str, list[tuple[str, ast.Attribute]]] = {}
    for fn in cls.body:
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for a in _writes_on_self(fn):
                out.setdefault(a.attr, []).append((fn.name, a))
    return out


def guarded_names() -> set[str]:
    names: set[str] = set()
    for cls, path in GUARDED.items():
        names |= set(instance_attributes(_class(_parse(Path(ROOT) / path), cls)))
    return names


def _module_names(tree: ast.Module) -> set[str]:
    """Names bound to modules by the file's imports (``import fastdp._reducer`` binds fastdp)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module in ("fastdp", None):
            names.update(a.asname or a.name for a in node.names)  # ``from fastdp import _x``
    return names


def foreign_accesses(path: Path, names: set[str], source: str | None = None) -> list[str]:
    """``path``'s reads and writes of ``names`` that are not its own classes' state."""
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    modules = _module_names(tree)
    own: dict[ast.AST, set[str]] = {}  # per class of this file, the self.x it assigns
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef):
            own[cls] = set(instance_attributes(cls))
    hits = []
    where = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name

    def visit(node: ast.AST, cls_attrs: set[str]) -> None:
        for child in ast.iter_child_nodes(node):
            attrs = own.get(child, cls_attrs) if isinstance(child, ast.ClassDef) else cls_attrs
            if isinstance(child, ast.Attribute) and child.attr in names:
                base = child.value
                mine = isinstance(base, ast.Name) and base.id == "self" and child.attr in attrs
                module = isinstance(base, ast.Name) and base.id in modules
                if not (mine or module):
                    hits.append(f"{where}:{child.lineno}: .{child.attr}")
            visit(child, attrs)

    visit(tree, set())
    return hits


def library_files() -> list[Path]:
    guarded = {Path(ROOT) / p for p in GUARDED.values()}
    return [p for p in sorted((Path(ROOT) / "fastdp").rglob("*.py")) if p not in guarded]


def _commented(lines: list[str], lineno: int) -> bool:
    """A comment on the declaration's line, or on a line of its own right above it."""
    return "#" in lines[lineno - 1] or lines[lineno - 2].lstrip().startswith("#")


def test_state_is_private_and_declared_once_in_init_with_a_comment():
    problems = []
    for cls_name, path in GUARDED.items():
        lines = (Path(ROOT) / path).read_text().splitlines()
        attrs = instance_attributes(_class(_parse(Path(ROOT) / path), cls_name))
        assert attrs, f"{cls_name}: no instance attributes found (parser out of date?)"
        for name, sites in sorted(attrs.items()):
            if not name.startswith("_"):
                problems.append(f"{cls_name}.{name}: public state (make it private, add a method)")
            in_init = [a for method, a in sites if method == "__init__"]
            if not in_init:
                problems.append(f"{cls_name}.{name}: first set outside __init__")
            elif not _commented(lines, min(a.lineno for a in in_init)):
                problems.append(f"{cls_name}.{name}: declared in __init__ without a comment")
    assert problems == []


@pytest.mark.parametrize("path", library_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_library_module_touches_their_state(path):
    """Callers go through the methods (DDP's Reducer: private fields, a contract per method)."""
    assert foreign_accesses(path, guarded_names()) == []


def test_no_test_touches_their_state():
    """Tests too: through the methods, or the ``for_tests()`` hook (read-only, live)."""
    hits = []
    for path in sorted((Path(ROOT) / "tests").glob("*.py")):
        hits += foreign_accesses(path, guarded_names())
    assert hits == []


def test_test_hooks_are_not_called_by_the_library():
    hits = []
    for path in library_files():
        hits += foreign_accesses(path, TEST_HOOKS)
    assert hits == []


@pytest.mark.parametrize("cls_name", sorted(QUERIES))
def test_queries_write_nothing(cls_name):
    cls = _class(_parse(Path(ROOT) / GUARDED[cls_name]), cls_name)
    methods = {fn.name: fn for fn in cls.body if isinstance(fn, ast.FunctionDef)}
    for name in QUERIES[cls_name]:
        assert name in methods, f"{cls_name}.{name} is gone: update QUERIES"
        writes = [f".{a.attr} (line {a.lineno})" for a in _writes_on_self(methods[name])]
        assert writes == [], f"{cls_name}.{name} is a query but writes {writes}"


def test_the_walk_sees_a_violation():
    """The rule's own check: a foreign read, a foreign write and a module attribute."""
    source = (
        "import fastdp._reducer\n"
        "def f(rs):\n"
        "    rs._tensors[0] = rs._sources\n"
        "    return fastdp._reducer\n"
        "class Own:\n"
        "    def __init__(self):\n"
        "        self._sources = 1\n"
        "    def g(self):\n"
        "        return self._sources\n"
    )
    hits = foreign_accesses(Path("probe.py"), {"_tensors", "_sources", "_reducer"}, source)
    assert [h.split(": ")[1] for h in hits] == ["._tensors", "._sources"]


def test_the_slot_mode_changes_in_one_place():
    """``ReplicaSet._slots`` (what the replicas' slots point at) is written by ``_assign`` alone,
    besides its declaration: every mode change also re-points the slots."""
    attrs = instance_attributes(_class(_parse(Path(ROOT) / GUARDED["ReplicaSet"]), "ReplicaSet"))
    assert sorted({method for method, _ in attrs["_slots"]}) == ["__init__", "_assign"]
