"""Collective copies with ``torch.nn.parallel.comm``'s signatures, for CUDA *and* CPU devices.

Every function decides here, per call, whether the C++/CUDA extension serves the case or the torch
path does; the results are identical either way. Devices are ints (CUDA ids, -1 for the CPU),
strings or ``torch.device``. Outputs carry no autograd history (use ``fastdp._functions`` for that).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from torch.nn.parallel import comm as _tcomm

from fastdp import _backend
from fastdp._devices import all_distinct_cuda, as_device

__all__ = ["broadcast_coalesced", "broadcast_into", "reduce_add_coalesced", "scatter", "gather",
           "scatter_leaves"]

_DEFAULT_BUFFER = 10485760


def _dense(tensors: Sequence[torch.Tensor]) -> bool:
    return all(t.layout == torch.strided for t in tensors)


def _coalesced_op(
    name: str,
    lists: Sequence[Sequence[torch.Tensor]],
    devices: Sequence[torch.device],
    reduce: bool = False,
) -> Any:
    """``fastdp._C.<name>`` when it serves this call, else None (torch path): the one decision.

    Served: extension loaded and enabled, devices all CPU or all CUDA, every tensor strided with a
    dtype the op handles (checked in C++, one call per list: no Python work per tensor).
    """
    ext = _backend.ext()
    if ext is None or not hasattr(ext, name) or not hasattr(ext, "coalesced_supported"):
        return None
    if len({d.type for d in devices}) > 1:
        return None
    for tensors in lists:
        if not ext.coalesced_supported(tensors, reduce):
            return None
    return getattr(ext, name)
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
    if ext is None or not hasattr(ext, "scatter_chunks"):
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

    ``result[0]`` are the input tensors themselves; the others are new tensors with their own
    storage and version counters, bit-identical in value.
    """
    devs = [as_device(d) for d in devices]
    tensors = list(tensors)
    op = _coalesced_op("broadcast_coalesced", [tensors], devs)
    if op is not None:
        return [list(r) for r in op(tensors, devs, buffer_size)]
    if len(devs) > 1 and all_distinct_cuda(devs):
        return _tcomm.broadcast_coalesced(tensors, [d.index for d in devs], buffer_size)
    with torch.no_grad():
        return [tensors] + [[t.to(d, copy=True) for t in tensors] for d in devs[1:]]


def broadcast_into(
    tensors: Sequence[torch.Tensor], outs: Sequence[Sequence[torch.Tensor]]
) -> None:
    """Copy ``tensors`` into each device's persistent ``outs[d]`` (same shapes and dtypes).

    The persistent-replica refresh: one call per step for all tensors and devices; values are
    bit-identical to the sources. Runs on the current streams; no autograd.
    """
    tensors = list(tensors)
    if not tensors:
        return
    outs = [list(o) for o in outs]
    devices = [tensors[0].device] + [o[0].device for o in outs if o]
    op = _coalesced_op("broadcast_coalesced_into", [tensors], devices)
    if op is not None:
        op(tensors, outs)
        return
    with torch.no_grad():
        for dests in outs:
            torch._foreach_copy_(list(dests), tensors, non_blocking=True)


def reduce_add_coalesced(
    inputs: Sequence[Sequence[torch.Tensor]],
    destination: Any = None,
    buffer_size: int = _DEFAULT_BUFFER,
) -> list[torch.Tensor]:
    """Position-wise sums over devices: ``result[i] = sum(inputs[d][i] for d)`` on ``destination``.

    ``destination=None`` means the device of ``inputs[0]``. Summation runs in list order,
    ``inputs[0] + inputs[1] + ...`` (bit-identical between the extension and the torch path; between
    distinct GPUs NCCL's order, within float tolerance).
    """
    inputs = [list(x) for x in inputs]
    first = inputs[0]
    if destination is None and not first:
        return []
    dest = first[0].device if destination is None else as_device(destination)
    devs = [x[0].device for x in inputs if x]
    if dest in devs:
        op = _coalesced_op("reduce_add_coalesced", inputs, devs, reduce=True)
        if op is not None:
            return list(op(inputs, dest, buffer_size))
    if len(devs) > 1 and all_distinct_cuda(devs) and dest.type == "cuda":
        return _tcomm.reduce_add_coalesced(inputs, dest.index, buffer_size)
    with torch.no_grad():
        if all(g.device == dest for grads in inputs for g in grads):
            out = list(torch._foreach_add(first, inputs[1])) if len(inputs) > 1 else \
                [t.clone() for t in first]
            for grads in inputs[2:]:
                torch._foreach_add_(out, grads)
            return out
        out = [t.to(dest, copy=True) for t in first]
        for grads in inputs[1:]:
            torch._foreach_add_(out, [g.to(dest) for g in grads])
    return out


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
    outputs) is served by ``torch.nn.parallel.comm.scatter``.
    """
    if out is not None:
        return _tcomm.scatter(tensor, devices, chunk_sizes, dim, streams, out=out)
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
        sizes = plan_chunks([tensor.size(dim)], len(devs))[0]
    else:
        sizes = plan_chunks([tensor.size(dim)], len(devs), list(chunk_sizes))[0]
    return tuple(scatter_leaves([tensor], devs[: len(sizes)], [sizes], [dim])[r][0]
                 for r in range(len(sizes)))


def scatter_leaves(
    leaves: Sequence[torch.Tensor],
    devices: Sequence[torch.device],
    plan: Sequence[Sequence[int]],
    dims: Sequence[int],
) -> list[list[torch.Tensor]]:
    """The fused scatter: ``result[r][i]`` is chunk ``r`` of ``leaves[i]`` on ``devices[r]``.

    ``plan[i]`` are leaf i's chunk sizes along ``dims[i]`` (one per device). Chunks that stay on the
    leaf's device are views; the others are copies (non-blocking from pinned memory).
    """
    devices = [d if isinstance(d, torch.device) else as_device(d) for d in devices]
    ext = _copy_ext(leaves, devices)
    if ext is not None:
        out = [list(r) for r in ext.scatter_chunks(list(leaves), [list(p) for p in plan],
                                                   list(dims), list(devices))]
        return out + [[] for _ in devices[len(out):]]
    out = [[] for _ in devices]
    for leaf, sizes, dim in zip(leaves, plan, dims):
        for r, chunk in enumerate(leaf.split(list(sizes), dim)):
            dev = devices[r]
            # non_blocking only towards a GPU: a non-blocking D2H could be read before it landed.
            out[r].append(chunk if chunk.device == dev else
                          chunk.to(dev, non_blocking=dev.type == "cuda"))
    return out


def gather(
    tensors: Sequence[torch.Tensor], dim: int = 0, destination: Any = None, *, out: Any = None
) -> torch.Tensor:
    """Concatenate ``tensors`` along ``dim`` on ``destination``.

    ``destination=None`` means the current CUDA device for CUDA inputs (as in torch) and the CPU for
    CPU inputs.
    """
    if out is not None:
        return _tcomm.gather(tensors, dim, destination, out=out)
    if not tensors:
        raise RuntimeError("Expected at least one tensor to gather from")
    if destination is None:
        dest = tensors[0].device
        if dest.type == "cuda":
            dest = torch.device("cuda", torch.cuda.current_device())
    else:
        dest = as_device(destination)
    ext = _copy_ext(tensors, [dest], one_dtype=True)
    if ext is not None:
        return ext.gather_into(list(tensors), dim, dest)
    return torch.cat([t.to(dest, non_blocking=dest.type == "cuda") for t in tensors], dim)


def plan_chunks(
    leaf_sizes: Sequence[int], num_devices: int, chunk_sizes: Sequence[int] | None = None
) -> list[list[int]]:
    """Chunk sizes per leaf; see ``fastdp._planner.plan_chunks`` (C++ when the extension is on)."""
    from fastdp import _planner

    return _planner.plan_chunks(leaf_sizes, num_devices, chunk_sizes)
