"""Buckets: which tensors travel together, and the flat layout of replicas that do not alias the
originals (one flat per bucket).
"""

from __future__ import annotations

import copy
import itertools
import os
from collections.abc import Sequence
from typing import Any

import torch

from fastdp import _backend
from fastdp._transports import count, transport_for

__all__ = [
    "DEFAULT_CAP_MB",
    "FIRST_BUCKET_BYTES",
    "Layout",
    "alias",
    "assign_buckets",
    "cpu_distinct",
]

DEFAULT_CAP_MB = 25.0

FIRST_BUCKET_BYTES = 1024 * 1024


def cpu_distinct() -> bool:
    """``FASTDP_CPU_DISTINCT=1``: CPU replicas get storage of their own, as distinct GPUs do."""
    return os.environ.get("FASTDP_CPU_DISTINCT", "0") == "1"


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def flattenable(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and not t.is_quantized


# NOTE [ Buckets ]
# Tensors are grouped as DDP's ``Reducer`` groups them: per (dtype, device), in reverse
# registration order (the last layers, whose gradients are ready first, fill the first bucket),
# the first bucket of each dtype capped at ``min(FIRST_BUCKET_BYTES, cap)``, the others at ``cap``
# (``bucket_cap_mb=``). A replica that does not alias the originals (another device, or any CPU
# replica under ``FASTDP_CPU_DISTINCT=1``) holds each bucket as one flat tensor; its tensors live
# on that flat's storage with version counters of their own and the originals' strides where
# those are dense. A refresh packs a bucket's originals into a staging flat on the source device
# (one multi-tensor copy) and broadcasts it into every such flat (one transport call per bucket);
# with every copy replica on the source device, no staging: one multi-tensor copy per replica.
# Tensors that cannot be flattened (sparse, quantized) form buckets of one.
def assign_buckets(tensors: Sequence[torch.Tensor], cap_bytes: float) -> list[list[int]]:
    """Indices of ``tensors`` per bucket, in the order they are filled (NOTE [ Buckets ])."""
    first_cap = min(FIRST_BUCKET_BYTES, cap_bytes)
    done: list[list[int]] = []
    open_: dict[Any, tuple[list[int], int]] = {}
    started: set = set()
    for i in reversed(range(len(tensors))):
        t = tensors[i]
        if not flattenable(t):
            done.append([i])
            continue
        key = (t.dtype, t.device)
        idx, size = open_.get(key, ([], 0))
        idx.append(i)
        size += nbytes(t)
        limit = cap_bytes if key in started else first_cap
        if size >= limit:
            done.append(idx)
            open_.pop(key, None)
            started.add(key)
        else:
            open_[key] = (idx, size)
    done.extend(idx for idx, _ in open_.values())
    return done


def _on_storage(
    flat: torch.Tensor, offset: int, shape: torch.Size, stride: tuple[int, ...]
) -> torch.Tensor:
    """A tensor on ``flat``'s storage at ``offset`` elements, with a version counter of its own
    (not an autograd view: replicas' tensors are independent, as DataParallel's)."""
    with torch.no_grad():
        t = torch.empty(0, dtype=flat.dtype, device=flat.device)
        return t.set_(flat.untyped_storage(), flat.storage_offset() + offset, shape, stride)


def alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor on ``t``'s storage, as ``t``, with a version counter of its own: a replica on the
    originals' device (NOTE [ Persistent replicas ] in fastdp/_replica_set.py)."""
    return _on_storage(t, 0, t.size(), t.stride())


def dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides where they cover its elements exactly once (any dense layout, as
    channels_last), else the contiguous ones: how a copy of ``t`` sits in a flat."""
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1)
    step = 1
    for st, n in dims:  # dense: each dimension steps over exactly the ones inside it
        if st != step:
            break
        step *= n
    else:
        return t.stride()
    strides, step = [], 1
    for n in reversed(t.shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class Layout:
    """Persistent copies of ``tensors`` for the replicas ``copy_replicas`` of ``devices`` (replica 0
    is on the source device), grouped into buckets (NOTE [ Buckets ])."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        devices: Sequence[torch.device],
        copy_replicas: Sequence[int],
        cap_bytes: float,
        buckets: list[list[int]] | None = None,
        *,
        allocate: bool = True,
    ) -> None:
        self.devices = list(devices)
        self.copy_replicas = list(copy_replicas)
        self.buckets = assign_buckets(tensors, cap_bytes) if buckets is None else buckets
        self.transport = transport_for(self.devices)
        self.shapes = [t.shape for t in tensors]
        self.strides = [dense_strides(t) if flattenable(t) else None for t in tensors]
        self.flat = [b_is_flat(tensors, b) for b in self.buckets]
        self.numels = [[tensors[i].numel() for i in b] for b in self.buckets]
        self.bytes = [sum(nbytes(tensors[i]) for i in b) for b in self.buckets]
        src = self.devices[0]
        # NOTE [ Buckets ]: staging only where a copy leaves the source device
        self.direct = all(self.devices[j] == src for j in self.copy_replicas)
        self.view_makers = [self._view_maker(b, k) for k, b in enumerate(self.buckets)]
        if allocate:
            self._allocate(tensors)

    def with_storage(self, tensors: Sequence[torch.Tensor]) -> Layout:
        """A layout with this one's devices, buckets and geometry and storage of its own, for
        tensors of the geometry it was built for; assigns no bucket again."""
        new = copy.copy(self)
        new._allocate(tensors)
        return new

    def _view_maker(self, b: list[int], k: int) -> Any:
        """The extension's maker of a flat bucket's tensors (None: made in Python)."""
        ext = _backend.ext()
        if ext is None or not self.flat[k] or not hasattr(ext, "FlatViews"):
            return None
        offsets = [0, *itertools.accumulate(self.numels[k])][:-1]
        shapes = [list(self.shapes[i]) for i in b]
        return ext.FlatViews(offsets, shapes, [list(self.strides[i]) for i in b])

    def _allocate(self, tensors: Sequence[torch.Tensor]) -> None:
        src = self.devices[0]
        with torch.inference_mode(False), torch.no_grad():
            self.staging = (
                []
                if self.direct
                else [self._storage(tensors, b, k, src) for k, b in enumerate(self.buckets)]
            )
            self.staging_views = [
                self._views(s, tensors, b, k, alias=False)
                for k, (s, b) in enumerate(zip(self.staging, self.buckets))
            ]
            self.flats: dict[int, list[torch.Tensor]] = {}
            self.per_replica: dict[int, list[torch.Tensor | None]] = {}
            for j in self.copy_replicas:
                flats = [
                    self._storage(tensors, b, k, self.devices[j])
                    for k, b in enumerate(self.buckets)
                ]
                rep: list[torch.Tensor | None] = [None] * len(tensors)
                for k, (f, b) in enumerate(zip(flats, self.buckets)):
                    for i, t in zip(b, self._views(f, tensors, b, k, alias=True)):
                        rep[i] = t
                self.flats[j], self.per_replica[j] = flats, rep
            self.replica_views = (
                {
                    j: [[self.per_replica[j][i] for i in b] for b in self.buckets]
                    for j in self.copy_replicas
                }
                if self.direct
                else {}
            )

    def add_memory(self, out: dict[str, dict[str, int]]) -> None:
        """Add the bytes this layout holds to ``out[device]["replicas"]`` (the copy replicas' flats)
        and ``out[device]["staging"]``."""
        for kind, flats in [
            ("staging", self.staging),
            *(("replicas", f) for f in self.flats.values()),
        ]:
            for f in flats:
                per = out.setdefault(str(f.device), {"replicas": 0, "staging": 0})
                per[kind] += nbytes(f)

    def _storage(
        self, tensors: Sequence[torch.Tensor], b: list[int], k: int, device: torch.device
    ) -> torch.Tensor:
        if not self.flat[k]:
            return torch.empty_like(tensors[b[0]], device=device)
        return torch.empty(sum(self.numels[k]), dtype=tensors[b[0]].dtype, device=device)

    def _views(
        self, flat: torch.Tensor, tensors: Sequence[torch.Tensor], b: list[int], k: int, alias: bool
    ) -> list[torch.Tensor]:
        if not self.flat[k]:
            return [flat]
        if self.view_makers[k] is not None:
            return self.view_makers[k](flat)
        out, offset = [], 0
        for i, n in zip(b, self.numels[k]):
            shape, stride = self.shapes[i], self.strides[i]
            out.append(
                _on_storage(flat, offset, shape, stride)
                if alias
                else flat.as_strided(shape, stride, flat.storage_offset() + offset)
            )
            offset += n
        return out

    def refresh(self, tensors: Sequence[torch.Tensor], stats: dict[str, int] | None) -> None:
        """Copy ``tensors`` (the originals, on the source device) into every copy replica: per
        bucket one pack and one broadcast. No autograd."""
        if not self.copy_replicas:
            return
        with torch.no_grad():
            if self.direct:
                for k, b in enumerate(self.buckets):
                    srcs = [tensors[i] for i in b]
                    for j in self.copy_replicas:
                        if self.flat[k]:
                            torch._foreach_copy_(self.replica_views[j][k], srcs)
                        else:
                            self.flats[j][k].copy_(srcs[0])
                    count(stats, "broadcast", self.bytes[k])
                return
            for k, b in enumerate(self.buckets):
                if self.flat[k]:
                    torch._foreach_copy_(self.staging_views[k], [tensors[i] for i in b])
                else:
                    self.staging[k].copy_(tensors[b[0]])
                self.transport.broadcast(
                    self.staging[k], [self.flats[j][k] for j in self.copy_replicas]
                )
                count(stats, "broadcast", self.bytes[k])


def b_is_flat(tensors: Sequence[torch.Tensor], b: list[int]) -> bool:
    return all(flattenable(tensors[i]) for i in b)
