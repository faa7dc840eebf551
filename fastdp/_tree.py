"""Nested inputs and outputs: the one walker, with DataParallel's container rules.

A tree is flattened into its tensor leaves and a spec that rebuilds it around new leaves. Tensors
are leaves; namedtuples, non-empty tuples, lists and dicts are recursed into; anything else
(strings, numbers, empty containers) is an object the spec carries. Used by scatter, gather,
ParallelCriterion, shard_batch, the launch strategies' keys and the step's row counts.

Spec nodes: ``("tensor", i)`` leaf i; ``("namedtuple", type, specs)``;
``("tuple", type, specs)``; ``("list", type, specs)``; ``("dict", type, keys, specs)``;
``("dataclass", instance, names, specs)``; ``("object", obj)`` (``("object", k)`` in an output
spec).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["build", "first_tensor", "flatten", "map_tensors", "paths", "structure_key"]


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def flatten(obj: Any, leaves: list[torch.Tensor], objects: list[Any] | None = None) -> tuple:
    """The spec of ``obj``; its tensors are appended to ``leaves`` in depth-first order.

    Inputs (``objects`` None): tuples and lists rebuild as plain ones, as DataParallel's scatter
    gives them, and ``("object", obj)`` carries the object. Outputs (``objects`` a list): gather's
    reading; containers keep their type, empty ones too, dataclasses are recursed into, and
    ``("object", k)`` refers to ``objects[k]``."""
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return ("tensor", len(leaves) - 1)
    outputs = objects is not None
    if isinstance(obj, dict) and (obj or outputs):
        return (
            "dict",
            type(obj),
            tuple(obj),
            tuple(flatten(v, leaves, objects) for v in obj.values()),
        )
    if _is_namedtuple(obj):
        return ("namedtuple", type(obj), tuple(flatten(x, leaves, objects) for x in obj))
    if isinstance(obj, (tuple, list)) and (obj or outputs):
        tup = isinstance(obj, tuple)
        kind = type(obj) if outputs else tuple if tup else list
        return ("tuple" if tup else "list", kind, tuple(flatten(x, leaves, objects) for x in obj))
    if outputs and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = tuple(f.name for f in dataclasses.fields(obj))
        return (
            "dataclass",
            obj,
            names,
            tuple(flatten(getattr(obj, n), leaves, objects) for n in names),
        )
    if not outputs:
        return ("object", obj)
    objects.append(obj)
    return ("object", len(objects) - 1)


def build(spec: tuple, leaves: Sequence[Any], objects: Callable[[Any], Any] | None = None) -> Any:
    """The tree of ``spec`` around ``leaves``; ``objects`` maps what an ``"object"`` node holds
    (default: that, as is)."""
    kind = spec[0]
    if kind == "tensor":
        return leaves[spec[1]]
    if kind == "object":
        return spec[1] if objects is None else objects(spec[1])
    if kind == "dict":
        return spec[1](zip(spec[2], [build(s, leaves, objects) for s in spec[3]]))
    if kind == "namedtuple":
        return spec[1](*[build(s, leaves, objects) for s in spec[2]])
    if kind in ("tuple", "list"):
        return spec[1](build(s, leaves, objects) for s in spec[2])
    new = copy.copy(spec[1])  # "dataclass": a dataclass, rebuilt field by field
    for name, s in zip(spec[2], spec[3]):
        object.__setattr__(new, name, build(s, leaves, objects))
    return new


def paths(spec: tuple, prefix: str, out: dict[int, str]) -> dict[int, str]:
    """Leaf index -> a readable path (``inputs[0]``, ``kwargs['mask']``, ``out.logits``)."""
    kind = spec[0]
    if kind == "tensor":
        out[spec[1]] = prefix
    elif kind in ("tuple", "list"):
        for k, s in enumerate(spec[2]):
            paths(s, f"{prefix}[{k}]", out)
    elif kind in ("namedtuple", "dataclass"):
        names = spec[1]._fields if kind == "namedtuple" else spec[2]
        for name, s in zip(names, spec[2] if kind == "namedtuple" else spec[3]):
            paths(s, f"{prefix}.{name}", out)
    elif kind == "dict":
        for key, s in zip(spec[2], spec[3]):
            paths(s, f"{prefix}[{key!r}]", out)
    return out


def structure_key(spec: tuple) -> tuple:
    """A hashable key of ``spec``'s structure: objects count by their type only."""
    kind = spec[0]
    if kind == "tensor":
        return spec
    if kind == "object":
        return ("object", type(spec[1]))
    if kind == "dataclass":
        return ("dataclass", type(spec[1]), spec[2], tuple(structure_key(s) for s in spec[3]))
    return (*spec[:-1], tuple(structure_key(s) for s in spec[-1]))


def first_tensor(
    obj: Any, where: Callable[[torch.Tensor], bool] | None = None
) -> torch.Tensor | None:
    """The first tensor leaf of input ``obj`` in flatten's order (the first for which ``where``
    holds, if given), or None; it stops there, without flattening the rest."""
    if isinstance(obj, torch.Tensor):
        return obj if where is None or where(obj) else None
    if isinstance(obj, dict):
        obj = obj.values()
    elif not isinstance(obj, (tuple, list)):
        return None
    for x in obj:
        t = first_tensor(x, where)
        if t is not None:
            return t
    return None


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with every tensor leaf replaced by ``fn(leaf)``."""
    leaves: list[torch.Tensor] = []
    spec = flatten(obj, leaves)
    return build(spec, [fn(t) for t in leaves]) if leaves else obj
