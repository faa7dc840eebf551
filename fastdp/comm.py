"""Collective copies with ``torch.nn.parallel.comm``'s signatures, for CUDA *and* CPU devices.

``scatter``/``gather`` decide here, per call, whether the extension's fused kernels serve the case
or the torch path does (identical results); ``broadcast_coalesced``/``reduce_add_coalesced`` are
the replication engine's (``fastdp/_buckets.py``, ``fastdp/_reducer.py``). Devices are ints (CUDA
ids, -1 for the CPU), strings or ``torch.device``. Outputs carry no autograd history (use
``fastdp._functions`` for that). Any thread may call them at once: the NCCL calls beneath take
turns (``NCCL_LOCK`` in ``fastdp/_transports.py``).
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from torch.nn.parallel import comm as _tcomm

from fastdp import _backend, _buckets
from fastdp._devices import as_device
from fastdp._planner import splits_for
from fastdp._reducer import reduce_add

__all__ = [
    "broadcast_coalesced",
    "copy_stats",
    "reduce_add_coalesced",
    "scatter",
    "gather",
    "scatter_leaves",
    "own_version_views",
    "split_own_versions",
]

_DEFAULT_BUFFER = 10485760

_STATS_LOCK = threading.Lock()
_STATS = {"scatter_ext_calls": 0, "gather_ext_calls": 0, "broadcast_layouts_built": 0}


def _count(key: str) -> None:
    with _STATS_LOCK:
        _STATS[key] += 1


def copy_stats() -> dict[str, int]:
    """Process-wide counters of this module's copies since import (never reset; compare two
    reads). Not the wrapper's per-step ``FastDataParallel.comm_stats()``.

    ``scatter_ext_calls``: calls of the extension's fused scatter; ``gather_ext_calls``: of its
    gather; ``broadcast_layouts_built``: bucket layouts ``broadcast_coalesced`` built (one per
    new tensor set); ``pinned_pool_allocations``: pinned blocks the extension's pool allocated
    (0 without a CUDA build).
    """
    with _STATS_LOCK:
        out = dict(_STATS)
    ext = _backend.ext()
    pool = dict(ext.pinned_pool_stats()) if ext is not None else {}
    out["pinned_pool_allocations"] = int(pool.get("allocations", 0))
    return out


@functools.cache
def _ext_has_cuda() -> bool:
    return _backend.build_info().get("built_with_cuda") == "1"


def _copy_ext(
    tensors: Sequence[torch.Tensor], devices: Sequence[torch.device], *, one_dtype: bool = False
) -> ModuleType | None:
    """The extension when its fused scatter/gather serve this case, else None (the torch path).

    Served: dense strided, non-quantized tensors of at least one dimension on CPU or CUDA devices
    (CUDA ones only by a CUDA build); ``one_dtype``: all of one dtype (a byte copy does no type
    promotion, torch.cat does).
    """
    ext = _backend.ext()
    if ext is None:
        return None
    kinds = {t.device.type for t in tensors} | {d.type for d in devices}
    if not kinds <= {"cpu", "cuda"} or ("cuda" in kinds and not _ext_has_cuda()):
        return None
    if not all(t.layout == torch.strided and not t.is_quantized and t.dim() > 0 for t in tensors):
        return None
    if one_dtype and len({t.dtype for t in tensors}) > 1:
        return None
    return ext


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], devices: Sequence[Any], buffer_size: int = _DEFAULT_BUFFER
) -> list[list[torch.Tensor]]:
    """Copies of ``tensors`` on each of ``devices``; ``devices[0]`` must hold them.

    ``result[0]`` are the input tensors themselves; the others are new contiguous tensors on flat
    buckets of at most ``buffer_size`` bytes (one broadcast per bucket, grouped as DDP groups
    them), each with its own version counter, bit-identical in value.
    """
    devs = [as_device(d) for d in devices]
    tensors = list(tensors)
    if not devs:
        raise RuntimeError("Expected at least one device to broadcast to")
    for t in tensors:
        if t.device != devs[0]:
            raise RuntimeError(
                f"fastdp.comm.broadcast_coalesced: every tensor must be on devices[0] "
                f"({devs[0]}), but one is on {t.device}"
            )
    layout = _broadcast_layout(tensors, devs, buffer_size).with_storage(tensors)
    layout.refresh(tensors, None)
    return [tensors] + [list(layout.per_replica[j]) for j in range(1, len(devs))]


# Broadcast layouts: broadcast_coalesced lays out its buckets (_buckets.Layout without storage:
# bucket assignment, geometry, the extension's per-bucket view makers) once per tensor set and
# reuses the layout; every call still allocates its own flats and copies the current values, so
# results of two calls never alias. The key is the tensors' signature (identity, storage, shape,
# strides, dtype, device: ``_C.tensor_signature``, or those fields themselves without the
# extension) with the devices and the bucket size. The cache holds no tensor, so it keeps none
# alive; it is bounded (LRU).
_LAYOUTS: collections.OrderedDict[Any, _buckets.Layout] = collections.OrderedDict()
_LAYOUTS_MAX = 16


def _strides(t: torch.Tensor) -> tuple[int, ...] | None:
    return t.stride() if t.layout == torch.strided else None


def _broadcast_layout(
    tensors: list[torch.Tensor], devs: list[torch.device], buffer_size: int
) -> _buckets.Layout:
    ext = _backend.ext()
    if ext is not None:
        sig: Any = ext.tensor_signature(tensors)
    else:
        sig = tuple((id(t), t.shape, _strides(t), t.dtype, t.device) for t in tensors)
    key = (sig, tuple(devs), buffer_size)
    with _STATS_LOCK:
        layout = _LAYOUTS.get(key)
        if layout is not None:
            _LAYOUTS.move_to_end(key)
            return layout
    layout = _buckets.Layout(tensors, devs, range(1, len(devs)), buffer_size, allocate=False)
    with _STATS_LOCK:
        _STATS["broadcast_layouts_built"] += 1
        _LAYOUTS[key] = layout
        while len(_LAYOUTS) > _LAYOUTS_MAX:
            _LAYOUTS.popitem(last=False)
    return layout


def reduce_add_coalesced(
    inputs: Sequence[Sequence[torch.Tensor]],
    destination: Any = None,
    buffer_size: int = _DEFAULT_BUFFER,
) -> list[torch.Tensor]:
    """Position-wise sums over devices: ``result[i] = sum(inputs[d][i] for d)`` on ``destination``.

    ``destination=None`` means the device of ``inputs[0]``. The one reduction of the package
    (``reduce_add`` in ``fastdp/_reducer.py``): buckets of at most ``buffer_size`` bytes,
    summed in list order (between distinct GPUs in NCCL's order, within float tolerance).
    """
    inputs = [list(x) for x in inputs]
    if not inputs or not inputs[0]:
        return []
    for x in inputs[1:]:
        if len(x) != len(inputs[0]):
            raise RuntimeError(
                "fastdp.comm.reduce_add_coalesced: every device needs as many tensors "
                f"({len(inputs[0])}), got {len(x)}"
            )
    dest = inputs[0][0].device if destination is None else as_device(destination)
    with torch.no_grad():
        return reduce_add(inputs, dest, buffer_size)


# Same-device chunks (NOTE [ Same-device scatter and gather ] for the wrapper's): a chunk bound for
# the device its source is on is a view of the source, as in torch's comm.scatter (whose .to()
# returns the chunk itself). When every chunk of a ``scatter`` without chunk_sizes stays, it returns
# ``tensor.chunk``'s views before any split or extension call (``torch.chunk`` gives
# ``splits_for``'s sizes): no byte moves, the cost is torch's own. Other same-device chunks are
# views too, made by the extension's one call for all leaves.


def _all_on(dev: torch.device, devices: Sequence[Any]) -> bool:
    """Whether every entry of ``devices`` (ints, strings or torch.device) names ``dev``."""
    cuda_id = dev.index if dev.type == "cuda" else -1
    name = str(dev)
    for d in devices:
        if (type(d) is int and d == cuda_id) or (type(d) is str and d == name) or d == dev:
            continue
        if type(d) is int or as_device(d) != dev:
            return False
    return True


def scatter(
    tensor: torch.Tensor,
    devices: Sequence[Any] | None = None,
    chunk_sizes: Sequence[int] | None = None,
    dim: int = 0,
    streams: Any = None,
    *,
    out: Any = None,
) -> tuple[torch.Tensor, ...]:
    """Split ``tensor`` along ``dim`` (``torch.chunk`` sizes unless ``chunk_sizes``) onto devices.

    The chunk that stays on the tensor's own device is a view of it, as in torch. ``out=`` (CUDA
    outputs) and ``streams=`` (each chunk copied on the stream given for it, which the extension's
    one copy per device cannot honour) are served by ``torch.nn.parallel.comm.scatter``.
    """
    if out is not None or streams is not None:
        return _tcomm.scatter(tensor, devices, chunk_sizes, dim, streams, out=out)
    if chunk_sizes is None and devices and _all_on(tensor.device, devices):
        return tensor.chunk(len(devices), dim)  # views, as torch's (above ``_all_on``)
    devs = [as_device(d) for d in (devices or ())]
    if not devs:
        raise RuntimeError("Expected at least one device to scatter to")
    if dim < 0:
        dim += tensor.dim()
    if chunk_sizes is not None and len(chunk_sizes) != len(devs):
        raise RuntimeError(
            "Expected devices and chunk_sizes to be of same length, but got "
            f"len(devices) = {len(devs)} and len(chunk_sizes) = {len(chunk_sizes)}"
        )
    if chunk_sizes is None:
        sizes = splits_for([tensor.size(dim)], len(devs))[0]
    else:
        sizes = splits_for([tensor.size(dim)], len(devs), list(chunk_sizes))[0]
    per_device = scatter_leaves([tensor], devs[: len(sizes)], [sizes], [dim])
    return tuple(chunks[0] for chunks in per_device[: len(sizes)])


def scatter_leaves(
    leaves: Sequence[torch.Tensor],
    devices: Sequence[torch.device],
    splits: Sequence[Sequence[int]],
    dims: Sequence[int],
) -> list[list[torch.Tensor]]:
    """The fused scatter: ``result[r][i]`` is chunk ``r`` of ``leaves[i]`` on ``devices[r]``.

    ``splits[i]`` are leaf i's chunk sizes along ``dims[i]`` (one per device). Chunks that stay
    on the leaf's device are views; the others are copies (non-blocking from pinned memory).
    """
    devices = [d if isinstance(d, torch.device) else as_device(d) for d in devices]
    ext = _copy_ext(leaves, devices)
    if ext is not None:
        _count("scatter_ext_calls")
        out = [
            list(r)
            for r in ext.scatter_chunks(
                list(leaves), [list(p) for p in splits], list(dims), list(devices)
            )
        ]
        return out + [[] for _ in devices[len(out) :]]
    out = [[] for _ in devices]
    for leaf, sizes, dim in zip(leaves, splits, dims):
        for r, chunk in enumerate(leaf.split(list(sizes), dim)):
            dev = devices[r]
            # non_blocking only towards a GPU: a non-blocking D2H could be read before it landed.
            out[r].append(
                chunk if chunk.device == dev else chunk.to(dev, non_blocking=dev.type == "cuda")
            )
    return out


def own_version_views(chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views like ``chunks``, each of a fresh alias of its chunk's base (no autograd history) with
    a version counter of its own (NOTE [ Input chunks written in place ] in
    ``fastdp/scatter_gather.py``): the extension's one call, else ``set_`` per chunk."""
    ext = _backend.ext()
    if ext is not None:
        return ext.own_version_views(chunks)
    out = []
    for c in chunks:
        root = c._base if c._is_view() else c
        alias = root.new_empty(0).set_(root)
        out.append(alias.as_strided(c.size(), c.stride(), c.storage_offset()))
    return out


def split_own_versions(
    leaves: Sequence[torch.Tensor], splits: Sequence[Sequence[int]], dims: Sequence[int]
) -> list[torch.Tensor]:
    """The scatter of plain strided tensors that all stay on their device, replica-major:
    ``out[r * len(leaves) + i]`` is chunk ``r`` of ``leaves[i]``, a view of its bytes. Chunks 1..
    of a leaf that neither requires grad nor is an inference, conj or neg tensor have version
    counters of their own (NOTE [ Input chunks written in place ] in ``fastdp/scatter_gather.py``):
    the extension gives ``split``'s own views a fresh counter each, in one call; without it they
    are ``own_version_views`` of ``split``'s."""
    ext = _backend.ext()
    if ext is not None:
        return ext.split_own_versions(leaves, splits, dims)
    n, chunks = len(leaves), list(map(torch.Tensor.split_with_sizes, leaves, splits, dims))
    where = [
        i
        for i, t in enumerate(leaves)
        if not (t.requires_grad or t.is_inference() or t.is_conj() or t.is_neg())
        and len(chunks[i]) > 1
    ]
    if where:
        own = iter(own_version_views([c for i in where for c in chunks[i][1:]]))
        for i in where:
            chunks[i] = (chunks[i][0], *(next(own) for _ in chunks[i][1:]))
    return [c[r] for r in range(len(splits[0]) if n else 0) for c in chunks]


def gather(
    tensors: Sequence[torch.Tensor], dim: int = 0, destination: Any = None, *, out: Any = None
) -> torch.Tensor:
    """Concatenate ``tensors`` along ``dim`` on ``destination``.

    ``destination=None`` means the current device of the inputs' accelerator for accelerator
    inputs (the current CUDA device for CUDA ones, as in torch) and the CPU for CPU inputs.
    """
    if out is not None:
        return _tcomm.gather(tensors, dim, destination, out=out)
    if not tensors:
        raise RuntimeError("Expected at least one tensor to gather from")
    if destination is None:
        dest = tensors[0].device
        if dest.type == "cuda":
            dest = torch.device("cuda", torch.cuda.current_device())
        elif dest.type != "cpu":
            dest = torch.device(dest.type, torch.accelerator.current_device_index())
    else:
        dest = as_device(destination)
    ext = _copy_ext(tensors, [dest], one_dtype=True)
    if ext is not None:
        _count("gather_ext_calls")
        return ext.gather_into(list(tensors), dim, dest)
    return torch.cat([t.to(dest, non_blocking=dest.type == "cuda") for t in tensors], dim)
