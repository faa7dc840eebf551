"""Scatter of nested inputs and gather of nested outputs, DataParallel's rules plus its fixes.

Containers follow DataParallel: tensors are chunked along ``dim``; non-empty tuples, lists, dicts
(and subclasses rebuilt with ``type(obj)``) and namedtuples are recursed into; anything else is
passed by reference to every replica. Leaves that split into more chunks than others lose their
extra chunks, as DataParallel's ``zip`` drops them (``fastdp/_planner.py``). Differences: tensor
leaves of positional *and* keyword inputs are split together (DataParallel gives replicas without
their positional inputs when kwargs hold non-tensors and the batch is small: pytorch #31460,
#52260); dataclass outputs are gathered field-wise, and other objects as DataParallel gathers them
where it can (``_gather_object``), else as a per-replica list.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from fastdp import _tree, comm
from fastdp._devices import as_device
from fastdp._functions import Gather, Scatter, vector_if_scalars
from fastdp._planner import OnDrop, flatten_inputs, split_leaves

__all__ = ["scatter", "scatter_kwargs", "gather", "Scattered"]


# NOTE [ Same-device scatter and gather ]
# When every leaf and every replica is on one device (CPU replicas, repeated GPU ids), a chunk is
# a view of its leaf and a gathered output is one ``torch.cat``: no copy, stream or device
# differs. ``split``/``cat`` give exactly the chunks and outputs the fused Functions give, with
# autograd's own C++ nodes (their backwards are each other, as Scatter's and Gather's are), and
# cost a fraction of a Python ``Function.apply`` (bench/README.md, *Python calls per step*).
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


def _chunks(
    leaves: list[torch.Tensor],
    splits: list[Sequence[int]],
    dims: list[int],
    devices: Sequence[torch.device],
) -> Sequence[torch.Tensor]:
    """Replica-major chunks: ``flat[r * len(leaves) + i]`` is chunk ``r`` of leaf ``i``."""
    n, L = len(splits[0]), len(leaves)
    if len(devices) != n:
        devices = devices[:n]
    if _one_device(leaves, devices):  # NOTE [ Same-device scatter and gather ]
        return comm.split_own_versions(leaves, splits, dims)
    flat = Scatter.apply(list(devices), splits, dims, *leaves)
    chunks = _own_counters(leaves, [flat[i::L] for i in range(L)])
    return [c[r] for r in range(n) for c in chunks]


def scatter_planned(
    spec: tuple | None,
    leaves: list[torch.Tensor],
    dims: list[int],
    splits: list[Sequence[int]],
    devices: Sequence[torch.device],
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
    """``scatter_kwargs`` of ``inputs``/``kwargs`` as planned (``StepPlan``'s fields of the same
    names): each replica's inputs and kwargs, the leaves split as ``splits`` says and rebuilt
    into ``spec`` (None: positional tensors); without leaves, the inputs by reference. It decides
    nothing again but how the chunks are made (views or copies)."""
    if not leaves:
        n = len(devices) if (inputs or kwargs) else 0
        kwargs = kwargs or {}
        return tuple(tuple(inputs) for _ in range(n)), tuple(dict(kwargs) for _ in range(n))
    parts = tuple(zip(*[iter(_chunks(leaves, splits, dims, devices))] * len(leaves)))
    if spec is None:  # replica r's part: its chunk of every leaf, in order
        return parts, ({},) * len(parts)
    spec_in, spec_kw = spec[2]
    return (
        tuple(_tree.build(spec_in, p) for p in parts),
        tuple(_tree.build(spec_kw, p) for p in parts),
    )


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
    spec, leaves = flatten_inputs(inputs, kwargs)
    dims, splits = split_leaves(spec, leaves, len(target_devices), dim, chunk_sizes, on_drop, True)
    return scatter_planned(spec, leaves, dims, splits, target_devices, inputs, kwargs)


def scatter(
    inputs: Any, target_devices: Sequence[torch.device], dim: int = 0, on_drop: OnDrop | None = None
) -> list[Any]:
    """DataParallel's ``scatter``: one entry per chunk (tuple for a tensor input, else a list)."""
    leaves: list[torch.Tensor] = []
    spec = _tree.flatten(inputs, leaves)
    dims, splits = split_leaves(spec, leaves, len(target_devices), dim, None, on_drop, False)
    if not leaves:
        return [inputs for _ in target_devices]
    parts = zip(*[iter(_chunks(leaves, splits, dims, target_devices))] * len(leaves))
    res = [_tree.build(spec, p) for p in parts]
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


# Other objects: an output that is neither a tensor nor a container gathers as DataParallel's
# ``gather_map`` gathers it: ``type(out)(map(gather, zip(*outputs)))``, so any iterable whose type
# rebuilds from its gathered parts comes back whole (HF's ``DynamicCache`` and
# ``EncoderDecoderCache`` are built for exactly that). Where DataParallel would raise (not iterable,
# the rebuild raises) or return garbage (``str`` of a map), the replicas' objects come back as a
# per-replica list; None stays None; iterators are never consumed. A rebuild that raises is the one
# case that warns: the user receives a list where DataParallel's users would have received an error.
def _gather_object(
    values: list[Any], target: Any, dim: int, scalars: str, weights: Sequence[int] | None
) -> Any:
    """DataParallel's ``gather_map`` for the replicas' ``values`` of one object (see the comment
    above)."""
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
