"""Persistent replicas: built once per device tuple, refreshed every step, never stale.

NOTE [ Persistent replicas ]
A ``ReplicaSet`` clones the module tree once (``clone_tree``). Replica 0's tensors alias the
originals (storage and version counter, as DataParallel's); replicas on the originals' device
alias the storage with their own version counters; the others live in per-bucket flats that the
engine refreshes each step (NOTE [ Buckets ]); buffers of replicas 1.. are always copies. One
reduce node per bucket links the replicas to the originals (NOTE [ Early reduction ]); with the
extension the nodes serve every step, and when a step's graph is still alive at the next
refresh the set renews its tensors and nodes rather than overwrite what the graph needs.
Rebuilds: NOTE [ Replica invalidation ]; compiled modules: NOTE [ Compiled replicas ].
"""

from __future__ import annotations

import operator
import warnings
import weakref
from typing import Any

import torch
from torch.nn import Module

from fastdp import _backend, _buckets
from fastdp._compiled import compile_root, is_compiled, mark_static
from fastdp._reducer import _HOOKS, _VERSION, Reducer, has_grad_hooks
from fastdp._snapshots import ReplicaAttrs, module_dicts, snapshot
from fastdp.replicate import check_replicatable, clone_tree, finish_tree, point_parameter

# NOTE [ RNN replicas ]
# RNNBase keeps its weights in a list and weakrefs to them; when a ref no longer matches the
# attribute, forward rebuilds both (a Python __setattr__ each, which dirties the replica) and
# calls flatten_parameters(), which on cuDNN moves the tensors onto a new buffer (``set_``) so
# they stop seeing the refreshes. A slot assignment points both at the replica's tensors, so
# forward never rebuilds them; after a restore of the replicas' dicts they are pointed again.
_RNN_CACHE = ("_flat_weights", "_flat_weight_refs")
_SHARED_WRITE = (
    "fastdp: a forward wrote in place to a frozen parameter that replicas on the same device share "
    "with the original (CPU replicas, repeated GPU ids): the write landed once per replica, where "
    "replicas on distinct GPUs each write a copy of their own. FASTDP_CPU_DISTINCT=1 gives CPU "
    "replicas storage of their own; or keep such statistics in a buffer."
)


def _point_rnn_cache(r: Module) -> None:
    d = r.__dict__
    weights = [d.get(n) for n in r._flat_weights_names]
    d["_flat_weights"] = weights
    if "_flat_weight_refs" in d:
        d["_flat_weight_refs"] = [None if w is None else weakref.ref(w) for w in weights]


_META = operator.attrgetter("shape", "dtype", "device", "requires_grad")


def tensor_signature(tensors: list[torch.Tensor]) -> Any:
    """Identity/shape/dtype/device/requires_grad of ``tensors``, one C++ call when available."""
    ext = _backend.ext()
    if ext is not None:
        return ext.tensor_signature(tensors)
    # by columns: one C-level pass each costs less than a tuple per tensor
    return (
        list(map(id, tensors)),
        list(map(torch.Tensor.data_ptr, tensors)),
        list(map(torch.Tensor.stride, tensors)),
        list(map(_META, tensors)),
    )


class Replicas(list):
    """A step's replicas (their root modules); ``replica_set`` is the set they belong to. Made
    per step, so the set never refers to it (no reference cycle)."""

    __slots__ = ("replica_set",)

    def __init__(self, roots: list[Module], replica_set: ReplicaSet) -> None:
        super().__init__(roots)
        self.replica_set = replica_set

    def __reduce_ex__(self, protocol: int) -> Any:
        return list, (list(self),)  # saved as the plain list DataParallel's replicate returns


class NotCacheable(Exception):
    """The module cannot have persistent replicas (TorchScript modules); replicate afresh."""


class ReplicaSet:
    """Replicas of ``network`` on ``devices`` (``devices[0]`` holds the originals): the module
    copies, their tensors and slots; the gradient side is ``self.reducer`` (``Reducer``)."""

    def __init__(
        self,
        network: Module,
        devices: list[torch.device],
        compile_ctx: Any = None,
        cap_bytes: float = _buckets.DEFAULT_CAP_MB * 2**20,
        stats: dict[str, int] | None = None,
    ) -> None:
        params = list(network.parameters())
        check_replicatable(network, params)
        self.devices = list(devices)
        self.src_device = devices[0]
        self.compile_ctx = compile_ctx  # the wrapper's torch.compile context (roots only)
        self.cap_bytes = cap_bytes
        self.stats = stats  # the wrapper's comm_stats() counters
        self.modules = list(network.modules())
        if any(isinstance(m, torch.jit.ScriptModule) for m in self.modules):
            raise NotCacheable("TorchScript modules are replicated afresh every step")
        buffers = list(network.buffers())
        self.sources = params + [b for b in buffers if b.requires_grad]
        self.buffers = [b for b in buffers if not b.requires_grad]
        self.watched = self.sources + self.buffers
        self.any_grad = any(s.requires_grad for s in self.sources)  # fixed by the signature
        self.rnn_rows = [i for i, m in enumerate(self.modules) if hasattr(m, "_flat_weights_names")]
        self.alias = not _buckets.cpu_distinct()
        self.linked = _backend.ext() is not None  # link once: needs grad_fn_use_count
        self.in_order = False  # NOTE [ Compiled replicas run in order ]
        self.leaf_mode = False  # the slots point at the reducer's no_sync leaves
        self.held: list[torch.Tensor] = []  # what the replicas held when last sealed
        self.held_ptrs: list[int] | bytes = []  # bytes: packed by the extension
        self.held_check: Any = None  # the extension's held_changed, where it sealed
        self.reseal = True  # what the replicas hold changed since: see seal()
        self.shared_frozen: list[torch.Tensor] = []  # see _warn_shared_writes()
        self.shared_versions: list[int] = []
        self.warned_shared = False
        self.row0_originals = False  # see refresh()
        self.untracked = False  # the last forward may have made a graph no node tracks
        with torch.inference_mode(False):  # replica tensors must be normal tensors
            self.tensors = self._new_tensors()
            self._new_buffer_copies()
        self.reducer = Reducer(
            self.sources, self.src_device, self.layout.buckets, stats, native=self.linked
        )
        self.replicas = self._build()
        if self.linked and self.any_grad:
            self.reducer.link(self.tensors)
        self.originals = snapshot(module_dicts(self.modules))  # after building (it writes)
        self.signature = tensor_signature(self.watched)
        self.verified: Any = None  # see valid()

    def _new_tensors(self) -> list[list[torch.Tensor]]:
        with torch.inference_mode(False):
            first = [s.detach() for s in self.sources]  # replica 0: storage and version shared
            self.copy_rows = [
                j
                for j in range(1, len(self.devices))
                if not (self.devices[j] == self.src_device and self.alias)
            ]
            self.layout = _buckets.Layout(
                self.sources, self.devices, self.copy_rows, self.cap_bytes
            )
            self.n_buckets = 0  # counted again by the next refresh
            rest = [
                self.layout.rows[j]
                if j in self.layout.rows
                else [_buckets.alias(s) for s in self.sources]
                for j in range(1, len(self.devices))
            ]
        return [first] + rest

    def _new_buffer_copies(self) -> None:
        """Buffers of replicas 1.. are always copies (BatchNorm updates them in place)."""
        self.buffer_layout = _buckets.Layout(
            self.buffers, self.devices, range(1, len(self.devices)), self.cap_bytes
        )
        self.n_buckets = 0
        self.buffer_copies = [self.buffer_layout.rows[j] for j in range(1, len(self.devices))]

    def _build(self) -> list[Module]:
        src_index = {t: k for k, t in enumerate(self.sources)}
        buf_index = {t: k for k, t in enumerate(self.buffers)}
        self.slots: list[tuple[int, str, int]] = []
        self.buffer_slots: list[tuple[int, int, str, int]] = []  # (row, module, key, buffer)
        copies = clone_tree(self.modules, len(self.devices))
        for i, m in enumerate(self.modules):
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
        # before the snapshots below: see NOTE [ Compiled replicas ]
        finish_tree(self.modules, copies, compiled=self.compile_ctx is not None)
        roots = [compile_root(row[0], self.compile_ctx) for row in copies]
        self.in_order = self._runs_compiled_in_order()
        if self.in_order:  # NOTE [ CUDA graphs on replicas ]: inputs at fixed addresses
            mark_static(self.tensors)
            mark_static(self.buffer_copies)
        self.copies = copies
        self.attrs: ReplicaAttrs | None = None
        self._assign()
        self.attrs = ReplicaAttrs([r for row in copies for r in row])
        return roots

    def _runs_compiled_in_order(self) -> bool:
        """Whether the set runs compiled code on several replicas (NOTE [ Compiled replicas run
        in order ]), unless replicas interact inside a forward (SyncBatchNorm, replication
        callbacks): those must run together, on threads."""
        from fastdp.sync_batchnorm import _syncable

        self.replicas_interact = any(
            _syncable(m) or hasattr(m, "__data_parallel_replicate__") for m in self.modules
        )
        return (
            len(self.devices) > 1
            and not self.replicas_interact
            and (self.compile_ctx is not None or any(is_compiled(m) for m in self.modules))
        )

    def _assign(self, tensors: list[list[torch.Tensor]] | None = None) -> None:
        """Point every replica's parameter slots at ``tensors`` (default ``self.tensors``: build
        and fresh tensors; the leaves of NOTE [ no_sync ] otherwise).

        Each slot as ``replicate`` writes it (``point_parameter``), RNN weight lists rebuilt
        afterwards.
        """
        self.leaf_mode = tensors is not None and tensors is not self.tensors
        if self.attrs is not None:
            self.attrs.undo_forward_writes()
            self.attrs.snap = None
        self._point_slots()

    def _point_slots(self) -> None:
        """Every replica's slots at the tensors of this mode (leaves or linked tensors)."""
        rows = self.leaves if self.leaf_mode else self.tensors
        for j, row in enumerate(self.copies):
            row_tensors = self.sources if j == 0 and self.row0_originals else rows[j]
            for i, key, k in self.slots:
                r, t = row[i], row_tensors[k]
                if key in r._buffers:
                    r._buffers[key] = t
                    continue
                point_parameter(r, key, t)
            for i in self.rnn_rows:
                _point_rnn_cache(row[i])
        for j, i, key, k in self.buffer_slots:
            self.copies[j][i]._buffers[key] = self.buffer_copies[j - 1][k]
        self.reseal = True

    def valid(self, verified: Any = None) -> bool:
        """Whether the replicas still match the module. ``verified``: the wrapper's record of a
        signature check passed this step (NOTE [ One signature per step ] in data_parallel.py);
        when the set was last validated under the same record, its own signature is skipped."""
        if (_backend.ext() is not None) != self.linked:
            return False  # the backend was switched: rebuild for the other path
        if verified is not None and verified is self.verified:
            return True
        if self.originals.changed() or self.signature != tensor_signature(self.watched):
            return False
        self.verified = verified
        return True

    def copy_sources(self) -> None:
        """Copy the originals into the copy rows (no autograd): one broadcast per bucket."""
        self.layout.refresh(self.sources, self.stats)

    def _renew(self) -> None:
        """Fresh replica tensors (and, on the extension path, fresh nodes)."""
        self.tensors = self._new_tensors()
        if self.in_order:
            mark_static(self.tensors)
        self._assign()
        if self.linked and self.any_grad:
            self.reducer.link(self.tensors)

    def _renew_buffers(self) -> None:
        """Fresh buffer copies for replicas 1.. (the old ones stay with the pending graph)."""
        if not self.buffer_slots:
            return
        with torch.inference_mode(False):
            self._new_buffer_copies()
        if self.in_order:
            mark_static(self.buffer_copies)
        for j, i, key, k in self.buffer_slots:
            self.copies[j][i]._buffers[key] = self.buffer_copies[j - 1][k]
        self.reseal = True

    def _copy_buffers(self) -> None:
        if len(self.devices) > 1 and self.buffers:
            self.buffer_layout.refresh(self.buffers, self.stats)

    def add_memory(self, out: dict[str, dict[str, int]]) -> None:
        """Add the bytes this set holds per device (see ``FastDataParallel.memory_stats``)."""
        self.layout.add_memory(out)
        if len(self.devices) > 1:
            self.buffer_layout.add_memory(out)

    def _count_buckets(self) -> int:
        self.n_buckets = len(self.layout.buckets) + (
            len(self.buffer_layout.buckets) if len(self.devices) > 1 else 0
        )
        return self.n_buckets

    def refresh(self, no_sync: bool = False) -> list[Module]:
        """This step's replicas: tensors refreshed from the originals, autograd linked (on
        leaves that keep their gradients under ``no_sync``: see NOTE [ no_sync ])."""
        if self.stats is not None:
            self.stats["buckets"] = self.n_buckets or self._count_buckets()
        self.reducer.start_step()
        renewed = self._tainted()  # first: what the last forward's replicas held, as sealed
        if renewed:
            self._renew_all()
        elif self.attrs.undo_forward_writes():
            self._point_slots()
        if self.row0_originals == torch.is_grad_enabled():
            # DataParallel's replicate(detach=True) gives replica 0 the original tensors
            # themselves (a forward's .data = reaches them); with grad, views of them
            self.row0_originals = not self.row0_originals
            self._point_slots()
        if (
            no_sync
            and self.any_grad
            and torch.is_grad_enabled()
            and not has_grad_hooks(self.sources)
        ):  # NOTE [ no_sync ]; hooks on the originals must see every micro-step's gradient
            return Replicas(self._refresh_no_sync(renewed), self)
        if self.leaf_mode:
            self._assign()  # back to the linked tensors; the leaves wait for the fold
        # a live graph may still need the copies' old values; with no source requiring grad no
        # node can tell (inputs that require grad make graphs all the same): assume one is
        if self.reducer.graph_alive() or self.untracked:
            if not self.linked or self.copy_rows or self.untracked:
                self._renew()
            self._renew_buffers()
        self._copy_buffers()
        if self.copy_rows:
            self.copy_sources()
        self.untracked = not self.any_grad and torch.is_grad_enabled()
        self.reducer.arm(self.tensors, self.any_grad and torch.is_grad_enabled())
        if self.reseal or self.attrs.snap is None:
            self.seal()
        return Replicas(self.replicas, self)

    def seal(self) -> None:
        """The replicas start a step as the set made them: their dicts, and what their tensors
        are (NOTE [ Tensors a forward changed ])."""
        self.attrs.seal()
        if self.reseal:
            self.reseal = False
            rows = self.leaves if self.leaf_mode else self.tensors
            # row 0 on the originals: those are checked by the wrapper's signature
            self.held = [t for row in rows[1 if self.row0_originals else 0 :] for t in row] + [
                t for row in self.buffer_copies for t in row
            ]
            ext = _backend.ext()
            self.held_check = None if ext is None else ext.held_changed
            self.held_ptrs = (
                list(map(torch.Tensor.data_ptr, self.held))
                if ext is None
                else ext.held_data_ptrs(self.held)
            )
            frozen = [k for k, s in enumerate(self.sources) if not s.requires_grad]
            self.shared_frozen = [
                rows[j][k] for j in range(1, len(rows)) if j not in self.copy_rows for k in frozen
            ]
            self.shared_versions = list(map(_VERSION, self.shared_frozen))

    def after_launch(self) -> None:
        if self.shared_frozen:
            self._warn_shared_writes()

    def _warn_shared_writes(self) -> None:
        """Replicas sharing the originals' storage apply a forward's in-place write to a frozen
        parameter once each (README, *Persistent replicas*): said once per set."""
        versions = list(map(_VERSION, self.shared_frozen))
        if versions != self.shared_versions:
            self.shared_versions = versions
            if not self.warned_shared:
                self.warned_shared = True
                warnings.warn(_SHARED_WRITE, UserWarning, stacklevel=5)

    def _tainted(self) -> bool:
        """NOTE [ Tensors a forward changed ]
        DataParallel's replica tensors are new every step; persistent ones are not, so what a
        forward does to one would outlive the step: ``.data =`` (the replica would keep that
        storage and never see a refresh again) or a hook (it would run once more every step).
        Each step checks every tensor the replicas hold (one pass in C++; without the extension
        one C-level pass for storage, one for hooks); a changed set gets fresh tensors (and
        nodes), as DataParallel's would be."""
        held = self.held
        if self.held_check is not None:  # sealed with the extension: held_data_ptrs
            return self.held_check(held, self.held_ptrs)
        return list(map(torch.Tensor.data_ptr, held)) != self.held_ptrs or any(map(_HOOKS, held))

    def _renew_all(self) -> None:
        """Fresh tensors for every replica (NOTE [ Tensors a forward changed ]); gradients
        pending under ``no_sync`` stay on the old leaves until the fold."""
        self._renew()
        self._renew_buffers()
        if self.reducer.leaves is not None:
            self.reducer.new_leaves(self.tensors, self.in_order)

    @property
    def leaves(self) -> list[list[torch.Tensor]] | None:
        """The replicas' leaves of this ``no_sync`` cycle (None outside one)."""
        return self.reducer.leaves

    def _refresh_no_sync(self, renewed: bool) -> list[Module]:
        """A micro-step under ``no_sync``: replicas on the reducer's leaves, nothing linked or
        reduced (NOTE [ no_sync ] in fastdp/_reducer.py). ``renewed``: the set just renewed
        every tensor."""
        first = self.reducer.leaves is None
        # a graph that saved the copies awaits its backward
        alive = not renewed and self.reducer.graph_alive()
        if first:
            if alive and (self.copy_rows or not self.linked):
                self._renew()
            self.reducer.start_cycle(self.tensors, self.in_order)
        else:
            self.reducer.drop_if_zeroed()
            if alive and self.copy_rows:
                self._renew_all()  # new leaves; the old keep what that graph owes them
        if alive:
            self._renew_buffers()
        if not self.leaf_mode:
            self._assign(self.reducer.leaves)
        self._copy_buffers()
        if self.copy_rows:  # every micro-step: ``p.data.clamp_()`` changes no version
            with torch.no_grad():
                self.copy_sources()
        self.reducer.watch()
        self.seal()
        return self.replicas

    def drop_pending(self, zeros: bool = False) -> None:
        """``zero_grad()``: the gradients pending under ``no_sync`` go (see ``Reducer``)."""
        self.reducer.drop_pending(zeros)

    def take_pending(self) -> list[tuple[list[torch.Tensor], list[list[torch.Tensor]]]]:
        """The pending ``no_sync`` gradients for the fold (``Reducer.take_pending``); the slots go
        back to the linked tensors."""
        pending = self.reducer.take_pending()
        if self.leaf_mode:
            self._assign()
        return pending
