"""Scatter of nested inputs and gather of nested outputs, DataParallel's rules plus its fixes.

Containers follow DataParallel: tensors are chunked along ``dim``; non-empty tuples, lists, dicts
(and subclasses rebuilt with ``type(obj)``) and namedtuples are recursed into; anything else is
passed by reference to every replica. Leaves that split into more chunks than others lose their
extra chunks, as DataParallel's ``zip`` drops them (NOTE [ DataParallel's chunking ] in
``fastdp/_planner.py``). Differences: tensor leaves of positional *and* keyword inputs are
planned together (DataParallel gives replicas without their positional inputs when kwargs hold
non-tensors and the batch is small: pytorch #31460, #52260); dataclass outputs are gathered
field-wise, and other objects as DataParallel gathers them where it can (NOTE [ Gathering other
objects ]), else as a per-replica list.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from fastdp import _tree, comm
from fastdp._devices import as_device
from fastdp._functions import Gather, Scatter, vector_if_scalars
from fastdp._planner import chunk_sizes_for, dropped, plan_chunks

__all__ = ["scatter", "scatter_kwargs", "gather", "Scattered"]


def scatter_plan(
    obj: Any,
    devices: Sequence[torch.device],
    dim: int = 0,
    chunk_sizes: Sequence[int] | None = None,
    on_drop: OnDrop | None = None,
    with_kwargs: bool = False,
) -> tuple[tuple, list[torch.Tensor], list[int], list[list[int]]]:
    """Flatten ``obj`` once and plan its chunks: (spec, leaves, per-leaf dims, plan). Leaves
    that lose rows are narrowed to the rows that go to replicas, and ``on_drop`` (default: a
    warning) hears which (NOTE [ DataParallel's chunking ])."""
    leaves: list[torch.Tensor] = []
    spec = _tree.flatten(obj, leaves)
    dims = []
    for i, t in enumerate(leaves):
        if t.layout != torch.strided or t.is_nested:
            raise TypeError(_unsplittable(t, leaf_paths(spec, with_kwargs).get(i, f"tensor {i}")))
        if t.dim() == 0:
            raise RuntimeError("chunk expects at least a 1-dimensional tensor")
        dims.append(dim % t.dim() if dim < 0 else dim)
        if dims[-1] >= t.dim():
            raise IndexError(
                f"Dimension out of range (expected to be in range of [{-t.dim()}, {t.dim() - 1}], "
                f"but got {dim})"
            )
    plan = _plan_rows(leaves, dims, len(devices), chunk_sizes, on_drop, spec, with_kwargs)
    return spec, leaves, dims, plan


OnDrop = Callable[[str], None]


def _unsplittable(t: torch.Tensor, path: str) -> str:
    kind = "a nested tensor" if t.is_nested else f"a {t.layout} tensor"
    return (
        f"fastdp: input {path} is {kind}, which cannot be chunked along the batch dim for the "
        "replicas (nn.DataParallel cannot either). Pass it dense (.to_dense(), or padded "
        "with torch.nested.to_padded_tensor), or inside an object that is not a tensor, "
        "list, tuple or dict so that every replica receives it whole."
    )


def warn_dropped(message: str) -> None:
    """The default for rows dropped as DataParallel drops them: a ``UserWarning``."""
    warnings.warn(message, UserWarning, stacklevel=5)


def _plan_rows(
    leaves: list[torch.Tensor],
    dims: list[int],
    n: int,
    chunk_sizes: Sequence[int] | None,
    on_drop: OnDrop | None,
    spec: tuple | None = None,
    with_kwargs: bool = False,
) -> list[list[int]]:
    """DataParallel's truncation, the one place it is written: the plan of ``leaves`` over ``n``
    devices; leaves that lose rows are narrowed in place to the rows that go to replicas (views:
    the rest get no gradient) and ``on_drop`` (default: a warning) hears which. ``spec``: the
    leaves' tree, for the message (None: positional tensors)."""
    sizes = [t.size(d) for t, d in zip(leaves, dims)]
    plan = plan_chunks(sizes, n, chunk_sizes)
    lost = dropped(sizes, plan)
    if lost:
        for i in lost:
            leaves[i] = leaves[i].narrow(dims[i], 0, sum(plan[i]))
        if spec is None:
            spec = ("tuple", tuple, tuple(("tensor", i) for i in range(len(leaves))))
        (on_drop or warn_dropped)(_drop_message(spec, sizes, plan, lost, with_kwargs))
    return plan


def leaf_paths(spec: tuple, with_kwargs: bool) -> dict[int, str]:
    """Leaf index -> a readable path: ``inputs[0]``; with ``with_kwargs`` the spec is of an
    ``(inputs, kwargs)`` pair and its leaves read ``inputs[0]``, ``kwargs['num_items']``."""
    out: dict[int, str] = {}
    if with_kwargs:
        _tree.paths(spec[2][0], "inputs", out)
        return _tree.paths(spec[2][1], "kwargs", out)
    return _tree.paths(spec, "inputs", out)


def _drop_message(
    spec: tuple, sizes: list[int], plan: list[list[int]], lost: list[int], with_kwargs: bool = False
) -> str:
    names = leaf_paths(spec, with_kwargs)
    what = ", ".join(
        f"{names.get(i, f'tensor {i}')} ({sizes[i]} rows, {sum(plan[i])} used)" for i in lost
    )
    return (
        f"fastdp: input tensors split into different numbers of chunks; as nn.DataParallel "
        f"does, {len(plan[0])} replica(s) run (the fewest chunks of any tensor) and the "
        f"extra rows of {what} are dropped. Pass strict_chunks=True to make this an error."
    )


# NOTE [ Same-device scatter and gather ]
# When every leaf and every replica is on one device (CPU replicas, repeated GPU ids), a chunk is
# a view of its leaf and a gathered output is one ``torch.cat``: no copy, stream or device
# differs. ``split``/``cat`` give exactly the chunks and outputs the fused Functions give, with
# autograd's own C++ nodes (their backwards are each other, as Scatter's and Gather's are), and
# cost a few microseconds where a Python ``Function.apply`` costs ~50 (wrapper step profile).
def _one_device(tensors: Sequence[Any], devices: Sequence[torch.device]) -> bool:
    """Whether ``tensors`` are plain strided tensors on ``devices``, all one device."""
    dev = devices[0]
    for d in devices:
        if d != dev:
            return False
    for t in tensors:  # loops, not all(): this runs twice a step
        if (
            type(t) is not torch.Tensor
            or t.device != dev
            or t.layout != torch.strided
            or t.is_nested
        ):
            return False
    return True


def _split_tensors(
    inputs: tuple,
    devices: Sequence[torch.device],
    dim: int,
    chunk_sizes: Sequence[int] | None,
    on_drop: OnDrop | None,
) -> Any:
    """``scatter_kwargs`` of positional tensors (no kwargs) on the replicas' one device; None
    where a leaf needs the general path's error (0-dim, ``dim`` out of range)."""
    dims = []
    for t in inputs:
        n = t.dim()
        d = dim + n if dim < 0 else dim
        if not 0 <= d < n:
            return None
        dims.append(d)
    if chunk_sizes is None and len(inputs) == 1:  # the commonest call: one batch tensor
        plan = [_chunk_sizes(inputs[0].size(d), len(devices))]
    else:
        inputs = list(inputs)
        plan = _plan_rows(inputs, dims, len(devices), chunk_sizes, on_drop)
    flat, n = comm.split_own_versions(inputs, plan, dims), len(inputs)
    per_replica = tuple(tuple(flat[r * n : (r + 1) * n]) for r in range(len(plan[0])))
    return per_replica, ({},) * len(plan[0])


# NOTE [ Input chunks written in place ]
# A chunk that stays on its leaf's device is a view of it. Chunk 0 shares the leaf's version
# counter, as DataParallel's chunk 0 on the input's device does; chunks 1.. get one of their own
# each, as DataParallel's copies on other GPUs have: a replica writing into its own chunk
# (``masked_fill_`` on ids, ``clamp_`` on positions) never invalidates what another replica saved,
# and no bytes are copied. The extension sets a fresh counter on ``split``'s views; torch alone
# makes the same views of aliases of the leaf's base (every replica's base has one shape, so
# compiled replicas share one cache entry). The write lands in the caller's tensor, where
# DataParallel's copies leave rows 1.. unchanged. Leaves that require grad keep plain views:
# autograd refuses in-place writes into ``split``'s outputs.
def _own_counters(
    leaves: Sequence[torch.Tensor], chunks: Sequence[Sequence[torch.Tensor]]
) -> list[Sequence[torch.Tensor]]:
    """``chunks[i]`` (leaf ``i``'s), those after the first that are views on the leaf's device
    remade with version counters of their own, in one call for every leaf (NOTE [ Input chunks
    written in place ])."""
    where, views = [], []
    for i, (leaf, cs) in enumerate(zip(leaves, chunks)):
        if len(cs) < 2 or leaf.requires_grad or type(leaf) is not torch.Tensor:
            continue
        if leaf.is_conj() or leaf.is_neg():
            continue
        dev = leaf.device
        for r in range(1, len(cs)):
            if cs[r].device == dev:  # a view (comm.scatter_leaves' contract); copies keep theirs
                where.append((i, r))
                views.append(cs[r])
    if not views:
        return list(chunks)
    out = [list(cs) for cs in chunks]
    for (i, r), view in zip(where, comm.own_version_views(views)):
        out[i][r] = view
    return out


@functools.lru_cache(maxsize=256)
def _chunk_sizes(size: int, n: int) -> tuple[int, ...]:
    """``torch.chunk``'s sizes (the planner's, for one leaf), memoised: batch sizes repeat."""
    return tuple(chunk_sizes_for(size, n))


def _scatter_flat(
    devices: list[torch.device], plan: list[list[int]], dims: list[int], leaves: list[torch.Tensor]
) -> Sequence[torch.Tensor]:
    """Replica-major chunks: ``flat[r * len(leaves) + i]`` is chunk ``r`` of leaf ``i``."""
    if not _one_device(leaves, devices):
        flat = Scatter.apply(devices, plan, dims, *leaves)
        n = len(leaves)
        chunks = _own_counters(leaves, [flat[i::n] for i in range(n)])
        return [c[r] for r in range(len(devices)) for c in chunks]
    return comm.split_own_versions(leaves, plan, dims)


def scatter_kwargs(
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    target_devices: Sequence[torch.device],
    dim: int = 0,
    chunk_sizes: Sequence[int] | None = None,
    on_drop: OnDrop | None = None,
) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
    """Scatter positional and keyword inputs together; one replica per chunk.

    Returns ``(inputs_per_replica, kwargs_per_replica)`` of equal length: the fewest chunks of
    any tensor leaf (the others' extra rows dropped, ``on_drop`` told: NOTE [ DataParallel's
    chunking ]), or ``len(target_devices)`` without tensor leaves (inputs passed by reference).
    """
    if not kwargs and inputs and _one_device(inputs, target_devices):
        fast = _split_tensors(inputs, target_devices, dim, chunk_sizes, on_drop)
        if fast is not None:
            return fast
    kwargs = kwargs or {}
    spec, leaves, dims, plan = scatter_plan(
        (tuple(inputs), kwargs), target_devices, dim, chunk_sizes, on_drop, with_kwargs=True
    )
    if not leaves:
        n = len(target_devices) if (inputs or kwargs) else 0
        return tuple(tuple(inputs) for _ in range(n)), tuple(dict(kwargs) for _ in range(n))
    n = len(plan[0])
    flat = _scatter_flat(list(target_devices[:n]), plan, dims, leaves)
    L = len(leaves)
    outs = [_tree.build(spec, flat[r * L : (r + 1) * L]) for r in range(n)]
    return tuple(o[0] for o in outs), tuple(o[1] for o in outs)


def scatter(
    inputs: Any, target_devices: Sequence[torch.device], dim: int = 0, on_drop: OnDrop | None = None
) -> list[Any]:
    """DataParallel's ``scatter``: one entry per chunk (tuple for a tensor input, else a list)."""
    spec, leaves, dims, plan = scatter_plan(inputs, target_devices, dim, None, on_drop)
    if not leaves:
        return [inputs for _ in target_devices]
    n = len(plan[0])
    flat = _scatter_flat(list(target_devices[:n]), plan, dims, leaves)
    L = len(leaves)
    res = [_tree.build(spec, flat[r * L : (r + 1) * L]) for r in range(n)]
    return tuple(res) if isinstance(inputs, torch.Tensor) else res


def _head(spec: tuple) -> Any:
    """What a container node must share across replicas besides its children: type and keys."""
    return (type(spec[1]), spec[2]) if spec[0] == "dataclass" else spec[1:-1]


def _same_structure(specs: list[tuple], path: str = "output") -> None:
    """Raises where the replicas' output specs differ (called once they are known to differ)."""
    a = specs[0]
    for b in specs[1:]:
        if a[0] != b[0]:
            if "tensor" in (a[0], b[0]):
                raise TypeError(
                    f"fastdp: replicas returned a tensor in some replicas and not others ({path})"
                )
            raise ValueError(f"fastdp: replicas returned different types at {path}")
        if a[0] == "dict" and len(a[2]) != len(b[2]):
            raise ValueError("All dicts must have the same number of keys")
        if a[0] not in ("tensor", "object") and (_head(a) != _head(b) or len(a[-1]) != len(b[-1])):
            raise ValueError(f"fastdp: replicas returned different containers at {path}")
    if a[0] in ("tensor", "object"):
        return
    names = a[2] if a[0] in ("dict", "dataclass") else range(len(a[-1]))
    for k, name in enumerate(names):
        _same_structure([s[-1][k] for s in specs], f"{path}[{name!r}]")


def _cat(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """``Gather``'s concatenation of one leaf on its own device (0-dim parts become a vector)."""
    if dim or parts[0].dim():  # no 0-dim parts to view as vectors
        return torch.cat(parts, dim)
    return torch.cat(vector_if_scalars(parts, dim)[0], dim)


def gather(
    outputs: Sequence[Any],
    target_device: Any,
    dim: int = 0,
    scalars: str = "stack",
    weights: Sequence[int] | None = None,
) -> Any:
    """Gather per-replica outputs onto ``target_device`` (one fused Gather for all tensors).

    ``scalars``: floating one-element outputs (losses) gathered along dim 0 become DataParallel's
    vector (``"stack"``), their ``weights``-weighted mean (``"mean"``) or their sum (``"sum"``),
    shaped as each replica's.
    """
    cpu = type(target_device) is torch.device and target_device.type == "cpu"
    target = target_device if cpu else as_device(target_device)
    if scalars == "stack" and outputs and _one_device(outputs, [target]):
        return _cat(outputs, dim)  # NOTE [ Same-device scatter and gather ]
    specs, parts, objects = [], [], []
    for out in outputs:
        leaves: list[torch.Tensor] = []
        objects.append([])
        specs.append(_tree.flatten(out, leaves, objects[-1]))
        parts.append(leaves)
    keys = [_tree.structure_key(x) for x in specs]
    if any(k != keys[0] for k in keys[1:]):
        _same_structure(specs)
    groups = [list(g) for g in zip(*parts)]
    gathered: list[Any] = [None] * len(groups)
    rest = list(range(len(groups)))
    if scalars != "stack" and dim == 0:  # losses: 0-dim, or one element (HF's (1, 1) losses)
        for g, parts in enumerate(groups):
            if all(p.numel() == 1 and p.is_floating_point() for p in parts):
                gathered[g] = _combine(parts, target, scalars, weights)
        rest = [g for g in rest if gathered[g] is None]
    if rest:
        n = len(outputs)
        flat = [t for g in rest for t in groups[g]]
        if _one_device(flat, [target]):  # NOTE [ Same-device scatter and gather ]
            done = [_cat(groups[g], dim) for g in rest]
        else:
            done = Gather.apply(target, dim, n, *flat)
        for g, t in zip(rest, done):
            gathered[g] = t

    def gather_object(k: int) -> Any:
        return _gather_object([o[k] for o in objects], target_device, dim, scalars, weights)

    return _tree.build(specs[0], gathered, gather_object)


# NOTE [ Gathering other objects ]
# An output that is neither a tensor nor a container gathers as DataParallel's ``gather_map``
# gathers it: ``type(out)(map(gather, zip(*outputs)))``, so any iterable whose type rebuilds from
# its gathered parts comes back whole (HF's ``DynamicCache`` and ``EncoderDecoderCache`` are built
# for exactly that). Where DataParallel would raise (not iterable, the rebuild raises) or return
# garbage (``str`` of a map), the replicas' objects come back as a per-replica list; None stays
# None; iterators are never consumed. A rebuild that raises is the one case that warns: the
# user receives a list where DataParallel's users would have received an error.
def _gather_object(
    values: list[Any], target: Any, dim: int, scalars: str, weights: Sequence[int] | None
) -> Any:
    """DataParallel's ``gather_map`` for the replicas' ``values`` of one object (NOTE [ Gathering
    other objects ])."""
    first = values[0]
    if first is None:
        return None
    if isinstance(first, (str, bytes, bytearray)) or not hasattr(type(first), "__iter__"):
        return values
    if any(iter(v) is v for v in values):  # iterators: zip would consume them
        return values

    def part(items: tuple) -> Any:
        return gather(items, target, dim, scalars, weights)

    try:
        return type(first)(map(part, zip(*values)))
    except Exception as e:  # DataParallel raises here
        warnings.warn(
            f"fastdp: an output of type {type(first).__name__} could not be rebuilt from its "
            f"gathered parts as nn.DataParallel rebuilds it ({type(e).__name__}: {e}); it is "
            "returned as a list with one entry per replica.",
            UserWarning,
            stacklevel=4,
        )
        return values


def _combine(
    parts: Sequence[torch.Tensor], target: torch.device, how: str, weights: Sequence[int] | None
) -> torch.Tensor:
    """One value, shaped as each replica's, from the replicas' (differentiable; on ``target``)."""
    values = torch.stack([p.reshape(()).to(target) for p in parts])
    if how == "sum":
        out = values.sum()
    elif weights is None:
        out = values.mean()
    else:
        w = torch.tensor(list(weights), dtype=values.dtype, device=target)
        out = (values * w).sum() / w.sum()
    return out.reshape(parts[0].shape)


class Scattered:
    """Per-replica outputs of a forward that was not gathered.

    Attributes:
        outputs: replica ``r``'s output (any structure the module returns), on ``devices[r]``.
        chunk_sizes: the rows of the input each replica got, or None when the inputs held no
            tensor to split.
        devices: the replicas' devices, in gather order.
        dim: the scatter/gather dimension.
        output_device: where ``gather()`` puts the result; None when the forward would not have
            gathered (one device: the module's output is returned as is).
    """

    __slots__ = ("outputs", "chunk_sizes", "devices", "dim", "output_device")

    def __init__(
        self,
        outputs: Sequence[Any],
        chunk_sizes: Sequence[int] | None,
        devices: Sequence[torch.device | None],
        dim: int = 0,
        output_device: torch.device | None = None,
    ) -> None:
        self.outputs = list(outputs)
        self.chunk_sizes = None if chunk_sizes is None else list(chunk_sizes)
        self.devices = list(devices)
        self.dim = dim
        self.output_device = output_device

    def gather(self) -> Any:
        """Exactly what the gathered forward returns (``gather``)."""
        if self.output_device is None:
            return self.outputs[0]
        return gather(self.outputs, self.output_device, self.dim)

    def __len__(self) -> int:
        return len(self.outputs)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.outputs)

    def __getitem__(self, i: int) -> Any:
        return self.outputs[i]

    def __repr__(self) -> str:
        devs = [str(d) for d in self.devices]
        return f"Scattered(replicas={len(self)}, chunk_sizes={self.chunk_sizes}, devices={devs})"
