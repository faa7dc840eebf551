"""Persistent replicas: built once per device tuple, refreshed every step, never stale.

NOTE [ Persistent replicas ]
DataParallel's ``replicate`` clones every submodule and ``setattr``s every parameter on every step.
A ``ReplicaSet`` does that once. Each replica's parameters are persistent tensors: replica 0's
alias the originals (``detach()``: storage and version counter shared, as DataParallel's views);
replicas on the originals' own device (CPU replicas, repeated GPU ids) alias the storage with
version counters of their own, so optimizer steps reach them with no copy; replicas on other
devices hold copies, refreshed every step by one call per device. Buffers are copies (refreshed
every step) except replica 0's, which are the originals (BatchNorm statistics from replica 0).

Autograd: one ``Refresh`` node *returns the persistent tensors themselves*, so their ``grad_fn``
is that node and the replica modules never need touching. Its backward sums every replica's
gradient into the originals (DataParallel's Broadcast backward: a coalesced reduce), so gradient
hooks on the originals see the total once, ``autograd.grad`` works, unused parameters get zeros,
and double backward works (differentiable ops). On the extension path the node is made once per
tensor set (``RefreshState.link``) and reused by every step: it saves no tensors, so nothing is
freed by a backward. A step's Python work is then a signature check, a copy call and a flag. On
the torch path a Python ``Refresh`` is applied every step.

Overwriting copies is only safe when no live graph still needs their old values. A step is
"pending" from its refresh until the node's backward runs; a pending step is harmless once
nothing points at the node any more (the extension compares the node's owner count with its value
right after linking). Otherwise (two forwards before one backward with copies, held outputs, or
the torch path without a backward) the set gets fresh copies (and a fresh node): slower, correct.
Aliases are never overwritten, so they never need this.
Rebuilds on structural change: see NOTE [ Replica invalidation ] in ``fastdp/_watch.py``.
Compiled modules: NOTE [ Compiled replicas ] and NOTE [ CUDA graphs on replicas ] in
``fastdp/_compiled.py``; ``no_sync()``'s leaves: NOTE [ no_sync ] in ``fastdp/_accumulate.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Function
from torch.nn import Module
from torch.nn.parameter import UninitializedParameter

from fastdp import _backend, _watch, comm
from fastdp._accumulate import LeafAccumulation
from fastdp._compiled import (
    compile_root,
    finish_replica,
    is_compiled,
    mark_static,
    replicate_module,
)
from fastdp._functions import ReduceAddCoalesced


def tensor_signature(tensors: list[torch.Tensor]) -> Any:
    """Identity/shape/dtype/device/requires_grad of ``tensors``, one C++ call when available."""
    ext = _backend.ext()
    if ext is not None and hasattr(ext, "tensor_signature"):
        return ext.tensor_signature(tensors)
    return tuple((id(t), t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, t.requires_grad)
                 for t in tensors)


class _Token:
    """Whether a step's graph still awaits its backward (see NOTE [ Persistent replicas ])."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending = True


class Refresh(Function):
    """``Refresh.apply(rs, *sources)``: refresh ``rs``'s replica tensors, link them to sources."""

    @staticmethod
    def forward(ctx, rs, *sources):
        rs.copy_sources(sources)
        ctx.n, ctx.devices, ctx.src = len(sources), rs.devices, rs.src_device
        ctx.token = rs.token = _Token()
        outs = [t for dev_tensors in rs.tensors for t in dev_tensors]
        n = len(sources)
        frozen = [outs[j * n + k] for k in range(n) if not ctx.needs_input_grad[1 + k]
                  for j in range(len(rs.devices))]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.token.pending = False
        if len(ctx.devices) == 1:
            return (None, *grads)
        return (None, *ReduceAddCoalesced.apply(ctx.src, ctx.n, *grads))


class NotCacheable(Exception):
    """The module cannot have persistent replicas (TorchScript modules); replicate afresh."""


def _apply_refresh(rs: ReplicaSet, sources: list[torch.Tensor]) -> Any:
    """``Refresh.apply`` minus ``Function.apply``'s per-argument Python pass (which only unwraps
    dead functorch wrappers, so it is kept whenever a functorch transform is active)."""
    if torch._C._are_functorch_transforms_active():
        return Refresh.apply(rs, *sources)
    return _FUNCTION_BASE_APPLY.__get__(None, Refresh)(rs, *sources)


_FUNCTION_BASE_APPLY = torch._C._FunctionBase.__dict__["apply"]


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor on ``t``'s storage with a version counter of its own (not a view: autograd sees
    an independent tensor, as DataParallel's copies are)."""
    with torch.no_grad():
        a = torch.empty(0, dtype=t.dtype, device=t.device)
        return a.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


class ReplicaSet(LeafAccumulation):
    """Replicas of ``network`` on ``devices`` (``devices[0]`` holds the originals)."""

    alias_same_device = True  # tests turn it off to exercise the copy path on one device

    def __init__(self, network: Module, devices: list[torch.device],
                 compile_ctx: Any = None) -> None:
        from fastdp import replicate as _rep

        if not _rep._replicatable_module(network):
            raise RuntimeError(
                "Cannot replicate network where python modules are children of ScriptModule")
        self.devices = list(devices)
        self.src_device = devices[0]
        self.compile_ctx = compile_ctx  # the wrapper's torch.compile context (roots only)
        self.modules = list(network.modules())
        if any(isinstance(m, torch.jit.ScriptModule) for m in self.modules):
            raise NotCacheable("TorchScript modules are replicated afresh every step")
        params = list(network.parameters())
        if any(isinstance(p, UninitializedParameter) for p in params):
            from fastdp.replicate import _LAZY_MESSAGE

            raise ValueError(_LAZY_MESSAGE)
        buffers = list(network.buffers())
        self.sources = params + [b for b in buffers if b.requires_grad]
        self.buffers = [b for b in buffers if not b.requires_grad]
        self.watched = self.sources + self.buffers
        self.any_grad = any(s.requires_grad for s in self.sources)  # fixed by the signature
        self.rnn_rows = [i for i, m in enumerate(self.modules) if hasattr(m, "_flat_weights_names")]
        self.token: _Token | None = None
        self.leaves: list[list[torch.Tensor]] | None = None  # NOTE [ no_sync ]
        self.in_order = False  # NOTE [ Compiled replicas run in order ]
        self.leaf_mode = False
        self.marks: tuple = ()
        ext = _backend.ext()
        self.ext = ext if ext is not None and hasattr(ext, "RefreshState") else None
        self.state = self.ext.RefreshState() if self.ext is not None else None
        self.buffer_state = self.ext.RefreshState() if self.ext is not None else None
        with torch.inference_mode(False):  # replica tensors must be normal tensors
            self.tensors = self._new_tensors()
            self.buffer_copies = [[b.detach().to(d, copy=True) for b in self.buffers]
                                  for d in self.devices[1:]]
        if self.buffer_state is not None:
            self.buffer_state.tensors = [list(self.buffers)] + self.buffer_copies
            self.buffer_state.copy_rows = list(range(1, len(self.devices)))  # always copies
        self.replicas = self._build()
        if self.state is not None and self.any_grad:
            self.state.link(self.sources)
        _watch.watch(self.modules)
        self.generation = _watch.generation()  # after building: building bumps it
        self.signature = tensor_signature(self.watched)
        self.verified: Any = None  # see valid()

    def _new_tensors(self) -> list[list[torch.Tensor]]:
        with torch.inference_mode(False):
            return self._make_tensors()

    def _make_tensors(self) -> list[list[torch.Tensor]]:
        first = [s.detach() for s in self.sources]  # replica 0: storage and version shared
        rest = [[_alias(s) for s in self.sources] if d == self.src_device and self.alias_same_device
                else [torch.empty_like(s, device=d) for s in self.sources]
                for d in self.devices[1:]]
        self.copy_rows = [j for j in range(1, len(self.devices))
                          if not (self.devices[j] == self.src_device and self.alias_same_device)]
        if self.state is not None:
            self.state.tensors = [first] + rest
            self.state.copy_rows = self.copy_rows
        return [first] + rest

    def _build(self) -> list[Module]:
        index = {m: i for i, m in enumerate(self.modules)}
        src_index = {t: k for k, t in enumerate(self.sources)}
        buf_index = {t: k for k, t in enumerate(self.buffers)}
        self.slots: list[tuple[int, str, int]] = []
        self.buffer_slots: list[tuple[int, int, str, int]] = []  # (row, module, key, buffer)
        copies: list[list[Module]] = []
        for _ in self.devices:
            row = []
            for m in self.modules:
                row.append(replicate_module(m))  # NOTE [ Compiled replicas ]
            copies.append(row)
        for i, m in enumerate(self.modules):
            for key, child in m._modules.items():
                for row in copies:
                    if child is None:
                        row[i]._modules[key] = None
                    else:
                        setattr(row[i], key, row[index[child]])
            for key, p in m._parameters.items():
                if p is None:
                    for row in copies:
                        row[i]._parameters[key] = None
                else:
                    self.slots.append((i, key, src_index[p]))
            for key, b in m._buffers.items():
                for j, row in enumerate(copies):
                    if b is None:
                        row[i]._buffers[key] = None
                    elif b in src_index:
                        self.slots.append((i, key, src_index[b]))
                    else:
                        own = b if j == 0 else self.buffer_copies[j - 1][buf_index[b]]
                        setattr(row[i], key, own)
                        if j:
                            self.buffer_slots.append((j, i, key, buf_index[b]))
        for row in copies:  # before the snapshots below: see NOTE [ Compiled replicas ]
            for m, r in zip(self.modules, row):
                finish_replica(m, r)
        roots = [compile_root(row[0], self.compile_ctx) for row in copies]
        self.in_order = self._runs_compiled_in_order()
        if self.in_order:  # NOTE [ CUDA graphs on replicas ]: inputs at fixed addresses
            mark_static(self.tensors)
            mark_static(self.buffer_copies)
        self.copies = copies
        self._assign()
        slot_keys: dict[int, set] = {}
        for i, key, _ in self.slots:
            slot_keys.setdefault(i, set()).add(key)
        for row in copies:
            for i, r in enumerate(row):
                _watch.track_replica(r, frozenset(slot_keys.get(i, ())))
        return roots

    def _runs_compiled_in_order(self) -> bool:
        """Whether the set runs compiled code on several replicas (NOTE [ Compiled replicas run
        in order ]), unless replicas meet inside a forward (SyncBatchNorm, replication
        callbacks): those must run together, on threads."""
        from fastdp.sync_batchnorm import _syncable

        self.meet = any(_syncable(m) or hasattr(m, "__data_parallel_replicate__")
                        for m in self.modules)
        return len(self.devices) > 1 and not self.meet and (
            self.compile_ctx is not None or any(is_compiled(m) for m in self.modules))

    def _assign(self, tensors: list[list[torch.Tensor]] | None = None) -> None:
        """Point every replica's parameter slots at ``tensors`` (default ``self.tensors``: build
        and fresh tensors; the leaves of NOTE [ no_sync ] otherwise).

        As DataParallel's ``setattr``: a plain attribute (replicas' parameters are not leaves), plus
        an entry in ``_parameters`` so ``parameters()`` sees it; written straight into the dicts
        (no per-slot Python call), RNN weight lists rebuilt afterwards.
        """
        self.leaf_mode = tensors is not None and tensors is not self.tensors
        for j, row in enumerate(self.copies):
            row_tensors = (self.tensors if tensors is None else tensors)[j]
            for i, key, k in self.slots:
                r, t = row[i], row_tensors[k]
                if key in r._buffers:
                    r._buffers[key] = t
                    continue
                r.__dict__[key] = t
                r._parameters[key] = t
                r._former_parameters[key] = t
            for i in self.rnn_rows:
                r = row[i]
                r._flat_weights = [r.__dict__.get(n) for n in r._flat_weights_names]

    def valid(self, verified: Any = None) -> bool:
        """Whether the replicas still match the module. ``verified``: the wrapper's record of a
        signature check passed this step (NOTE [ One signature per step ] in data_parallel.py);
        when the set was last validated under the same record, its own signature is skipped."""
        ext = _backend.ext()
        if (ext if ext is not None and hasattr(ext, "RefreshState") else None) is not self.ext:
            return False  # the backend was switched: rebuild for the other path
        if self.generation != _watch.generation():
            return False
        if verified is not None and verified is self.verified:
            return True
        if self.signature != tensor_signature(self.watched):
            return False
        self.verified = verified
        return True

    def copy_sources(self, sources: tuple[torch.Tensor, ...]) -> None:
        """Copy the originals into replicas 1.. (called by Refresh.forward, under no_grad)."""
        if self.state is not None:
            self.state.copy(list(sources))
        elif self.copy_rows:
            comm.broadcast_into(list(sources), [self.tensors[j] for j in self.copy_rows])

    def _graph_alive(self) -> bool:
        """Torch path: whether the last step's graph may still need the current tensors."""
        return self.token is not None and self.token.pending  # no extension: be conservative

    def _renew(self) -> None:
        """Fresh replica tensors (and, on the extension path, a fresh node)."""
        self.tensors = self._new_tensors()
        if self.in_order:
            mark_static(self.tensors)
        self._assign()
        if self.state is not None and self.any_grad:
            self.state.link(self.sources)

    def _renew_buffers(self) -> None:
        """Fresh buffer copies for replicas 1.. (the old ones stay with the pending graph)."""
        if not self.buffer_slots:
            return
        with torch.inference_mode(False):
            self.buffer_copies = [[torch.empty_like(b, device=d) for b in self.buffers]
                                  for d in self.devices[1:]]
        if self.in_order:
            mark_static(self.buffer_copies)
        if self.buffer_state is not None:
            self.buffer_state.tensors = [list(self.buffers)] + self.buffer_copies
        for j, i, key, k in self.buffer_slots:
            self.copies[j][i]._buffers[key] = self.buffer_copies[j - 1][k]

    def _copy_buffers(self) -> None:
        if len(self.devices) > 1 and self.buffers:
            if self.buffer_state is not None:
                self.buffer_state.copy(self.buffers)
            else:
                with torch.no_grad():
                    comm.broadcast_into(self.buffers, self.buffer_copies)

    def refresh(self, no_sync: bool = False) -> list[Module]:
        """This step's replicas: tensors refreshed from the originals, autograd linked (on
        leaves that keep their gradients under ``no_sync``: see NOTE [ no_sync ])."""
        if no_sync and self.any_grad and torch.is_grad_enabled():
            return self._refresh_no_sync()
        if self.leaf_mode:
            self._assign()  # back to the linked tensors; the leaves wait for the fold
        alive = self.state.graph_alive() if self.state is not None else self._graph_alive()
        if alive:  # a live graph may still need the copies' old values (BatchNorm saves buffers)
            if self.state is None or self.copy_rows:
                self._renew()
            self._renew_buffers()
        self.token = None
        if _watch.has_dirty():
            _watch.restore_dirty()
        self._copy_buffers()
        if self.state is not None:  # the node made by link() serves every step
            if self.copy_rows:  # aliases alone need no copy (nor the call's list conversion)
                self.state.copy(self.sources)
            if self.any_grad and torch.is_grad_enabled():
                self.state.mark_step()
            return self.replicas
        if self.any_grad and torch.is_grad_enabled():
            _apply_refresh(self, self.sources)
        else:
            with torch.no_grad():
                self.copy_sources(tuple(self.sources))
        return self.replicas
