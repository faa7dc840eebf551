"""Transports: the device-specific half of every broadcast and reduce, behind one interface,
and the counters of ``comm_stats()``.

Only the transport depends on the device type. CPU: ``copy_`` and in-order sums. CUDA: torch's
own ``broadcast(out=)`` and ``reduce_add`` (``torch.nn.parallel.comm``, which ``torch.cuda.comm``
re-exports only once imported): one NCCL call (torch's cached communicators) when the flats sit
on distinct GPUs, copies otherwise (repeated ids). Any other accelerator (``torch.accelerator``:
XPU, MPS, a PrivateUse1 backend): non-blocking ``copy_`` and in-order sums, ``torch.Event``.
Everything runs on the calling thread's current stream of each device: the caller's streams for
a refresh (the replicas then run on the same streams, NOTE [ The caller's streams ]), the streams
autograd gives the bucket's node for a reduce.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch.nn.parallel import comm as torch_comm

__all__ = ["NCCL_LOCK", "STAT_KEYS", "Transport", "count", "new_stats", "transport_for"]

STAT_KEYS = (
    "buckets",
    "broadcasts",
    "reduces",
    "bytes_broadcast",
    "bytes_reduced",
    "sums_out_of_place",
)


class Transport(Protocol):
    """What the flat layout and the reducer ask of a device type (``name``: "cpu", "cuda" or
    "accelerator")."""

    name: str

    @staticmethod
    def broadcast(src: torch.Tensor, dsts: Sequence[torch.Tensor]) -> None:
        """Copy ``src`` into every tensor of ``dsts`` (same shape, any devices)."""

    @staticmethod
    def reduce(flats: Sequence[torch.Tensor], dest: torch.device) -> torch.Tensor:
        """A new tensor on ``dest``: ``flats[0] + flats[1] + ...``, summed in that order."""

    @staticmethod
    def order_reads(per_replica: Sequence[Sequence[torch.Tensor]], dest: torch.device) -> None:
        """Before a reduce onto ``dest`` reads ``per_replica`` on their devices' current streams:
        NOTE [ Streams of a reduce across devices ]."""


def new_stats() -> dict[str, int]:
    return dict.fromkeys(STAT_KEYS, 0)


def count(stats: dict[str, int] | None, kind: str, nbytes: int) -> None:
    """One broadcast or reduce of ``nbytes`` (once per bucket, whatever the number of devices)."""
    if stats is not None:
        stats[kind + "s"] += 1
        stats["bytes_" + ("broadcast" if kind == "broadcast" else "reduced")] += nbytes


class _CpuTransport:
    """Copies and in-order sums (also the CUDA transport's fallback for what NCCL cannot do)."""

    name = "cpu"

    @staticmethod
    def broadcast(src: torch.Tensor, dsts: Sequence[torch.Tensor]) -> None:
        for d in dsts:
            d.copy_(src)

    @staticmethod
    def reduce(flats: Sequence[torch.Tensor], dest: torch.device) -> torch.Tensor:
        out = flats[0].to(dest, copy=True)
        for f in flats[1:]:
            out.add_(f.to(dest))
        return out

    @staticmethod
    def order_reads(per_replica: Sequence[Sequence[torch.Tensor]], dest: torch.device) -> None:
        return None  # one stream of work per CPU device: nothing to order


# NOTE [ Streams of a reduce across devices ]
# Autograd runs a bucket's node on a stream of the destination that waited for every incoming
# gradient; gradients on other GPUs are read on this thread's current streams of their devices
# (in an autograd device thread, their default streams), which waited for nothing. So
# ``order_reads`` makes each of those streams wait on an event recorded on the destination's
# stream, and records each such gradient (a sparse one's indices and values) on the stream that
# reads it (its blocks are not reused before the read). torch's NCCL calls take no lock of their
# own (``AutoNcclGroup`` only groups them; communicators are created on first use into a map
# without one; the GIL is released): see ``NCCL_LOCK`` below.


# One NCCL caller at a time: two threads enqueueing collectives on the same GPUs at once (two
# callers of one wrapper, NOTE [ Concurrent calls ]; bucket nodes of different destinations) could
# queue them in opposite orders on two devices' streams, each kernel then waiting for a peer queued
# behind the other: a hang. NCCL_LOCK, process-wide, is held around each NCCL call fastdp makes (the
# first creates the communicators): enqueueing only, nothing under it waits for the GPU, and every
# device's streams get the collectives in one order.
NCCL_LOCK = threading.Lock()


class _CudaTransport:
    name = "cuda"

    @staticmethod
    def order_reads(per_replica: Sequence[Sequence[torch.Tensor]], dest: torch.device) -> None:
        tensors = [
            t for rep in per_replica for t in rep if t.device.type == "cuda" and t.device != dest
        ]
        if dest.type != "cuda" or not tensors:
            return
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(dest))
        streams: dict[torch.device, Any] = {}
        for t in tensors:
            if t.device not in streams:
                streams[t.device] = torch.cuda.current_stream(t.device)
                streams[t.device].wait_event(ready)
            for part in _dense_parts(t):
                part.record_stream(streams[t.device])

    @staticmethod
    def broadcast(src: torch.Tensor, dsts: Sequence[torch.Tensor]) -> None:
        if src.layout != torch.strided:
            for d in dsts:
                d.copy_(src, non_blocking=True)
            return
        # torch's broadcast views a complex source as real but not its out= tensors (a shape
        # error), and NCCL has no complex types: move complex flats as their real pairs.
        out = [_as_real(d) for d in dsts]
        with NCCL_LOCK:
            torch_comm.broadcast(_as_real(src), out=out)

    @staticmethod
    def reduce(flats: Sequence[torch.Tensor], dest: torch.device) -> torch.Tensor:
        if (
            dest.type != "cuda"
            or all(f.device != dest for f in flats)
            or any(f.layout != torch.strided for f in flats)
        ):
            return _CpuTransport.reduce(flats, dest)  # reduce_add needs an input on dest
        if flats[0].dtype.is_complex:  # NCCL has no complex types; pairwise sums are the same
            reals = [_as_real(f) for f in flats]
            with NCCL_LOCK:
                return torch.view_as_complex(torch_comm.reduce_add(reals, dest.index))
        with NCCL_LOCK:
            return torch_comm.reduce_add(list(flats), dest.index)  # one NCCL reduce where it can


class _AcceleratorTransport:
    """An accelerator other than CUDA, through torch's device-generic API only. A copy between
    devices is ordered by ``copy_`` itself with the current streams of both (as CUDA's is);
    ``order_reads`` orders what ``copy_`` cannot see, with a ``torch.Event``."""

    name = "accelerator"

    @staticmethod
    def broadcast(src: torch.Tensor, dsts: Sequence[torch.Tensor]) -> None:
        for d in dsts:
            d.copy_(src, non_blocking=True)

    @staticmethod
    def reduce(flats: Sequence[torch.Tensor], dest: torch.device) -> torch.Tensor:
        out = torch.empty_like(flats[0], device=dest).copy_(flats[0], non_blocking=True)
        for f in flats[1:]:
            out.add_(f if f.device == dest else f.to(dest, non_blocking=True))
        return out

    @staticmethod
    def order_reads(per_replica: Sequence[Sequence[torch.Tensor]], dest: torch.device) -> None:
        _release_held()
        tensors = [t for rep in per_replica for t in rep if t.device != dest]
        if not tensors:
            return
        ready = _event(dest)
        ready.record(torch.accelerator.current_stream(dest))
        streams: dict[torch.device, Any] = {}
        for t in tensors:
            if t.device not in streams:
                streams[t.device] = torch.accelerator.current_stream(t.device)
                streams[t.device].wait_event(ready)
        if _records_streams(dest.type):
            for t in tensors:
                for part in _dense_parts(t):
                    part.record_stream(streams[t.device])
        else:
            _hold(list(streams.values()), tensors)


# Reads held without record_stream (``_release_held``): [thread, streams, tensors, events].
_HELD: list[list[Any]] = []
_HELD_LOCK = threading.Lock()


def _hold(streams: list[Any], tensors: list[torch.Tensor]) -> None:
    with _HELD_LOCK:
        _HELD.append([threading.current_thread(), streams, tensors, None])


def _release_held() -> None:
    """Drop the tensors earlier ``order_reads`` calls held once their streams passed them.

    Tensors without ``record_stream`` (the test device's) cannot tell their allocator that another
    stream still reads them: ``order_reads`` holds them instead. Once the calling thread has made
    its next call, or has ended, every read of its earlier call was enqueued: an event is recorded
    then on each reading stream, and a later call drops the tensors once those events completed.
    """
    if not _HELD:
        return
    me = threading.current_thread()
    with _HELD_LOCK:
        kept = []
        for entry in _HELD:
            owner, streams, _, events = entry
            if events is None:
                if owner is me or not owner.is_alive():
                    entry[3] = [_event(s.device) for s in streams]
                    for e, s in zip(entry[3], streams):
                        e.record(s)
                kept.append(entry)
            elif not all(e.query() for e in events):
                kept.append(entry)
        _HELD[:] = kept


@functools.cache
def _records_streams(device_type: str) -> bool:
    """Whether the accelerator's tensors take ``record_stream`` (else their reads are held)."""
    key = torch._C._dispatch_key_for_device(device_type)
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::record_stream", key)


def _event(device: torch.device) -> Any:
    """A ``torch.Event`` of ``device``'s accelerator, or an error naming what is missing."""
    try:
        return torch.Event(device=device)
    except (RuntimeError, NotImplementedError) as e:
        raise RuntimeError(
            f"fastdp: the {device.type!r} accelerator has no events (torch.Event: {e}); fastdp "
            "needs them to order reduces across its devices. Use device_ids of one device, or a "
            "torch build whose backend implements events (DeviceGuardImplInterface.record/block)"
        ) from e


def _dense_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The strided tensors whose blocks hold ``t``: itself, or a sparse tensor's indices and
    values (what torch's autograd records for a sparse gradient)."""
    if t.layout == torch.strided:
        return [t]
    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return []


def _as_real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.dtype.is_complex else t


def transport_for(devices: Sequence[torch.device]) -> type[Transport]:
    if any(d.type == "cuda" for d in devices):
        return _CudaTransport
    if any(d.type != "cpu" for d in devices):
        return _AcceleratorTransport
    return _CpuTransport
