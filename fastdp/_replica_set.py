"""Persistent replicas: built once per device tuple, refreshed every step, never stale."""

from __future__ import annotations

import enum
import operator
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn import Module

from fastdp import _backend, _buckets, _torch_private
from fastdp._compiled import compile_root, is_compiled, mark_static
from fastdp._launch import Order
from fastdp._no_sync import NoSyncCycle
from fastdp._reducer import _HOOKS, _VERSION, Reducer, has_grad_hooks
from fastdp._renewal import Renew, renewal
from fastdp._snapshots import ReplicaAttrs, module_dicts, snapshot
from fastdp.replicate import check_replicatable, clone_tree, finish_tree, point_parameter

# RNN replicas: RNNBase keeps its weights in a list and weakrefs to them; when a ref no longer
# matches the attribute, forward rebuilds both (a Python __setattr__ each, which dirties the
# replica) and calls flatten_parameters(), which on cuDNN moves the tensors onto a new buffer
# (``set_``) so they stop seeing the refreshes. A slot assignment points both at the replica's
# tensors, so forward never rebuilds them; after a restore of the replicas' dicts they are pointed
# again.
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


class NotCacheable(Exception):
    """The module cannot have persistent replicas (TorchScript modules); replicate afresh."""


class Slots(enum.Enum):
    """What the replicas' parameter slots point at (set by ``ReplicaSet._assign`` alone)."""

    LINKED = "linked"  # the set's tensors, outputs of the reduce nodes (a grad step)
    ORIGINALS = "originals"  # as LINKED, but replica 0 on the originals themselves (no grad)
    LEAVES = "leaves"  # the no_sync cycle's leaves (NOTE [ no_sync ] in fastdp/_no_sync.py)


# NOTE [ Persistent replicas ]
# A ``ReplicaSet`` clones the module tree once (``clone_tree``). Replica 0's tensors alias the
# originals (storage and version counter, as DataParallel's); replicas on the originals' device
# alias the storage with their own version counters; the others live in per-bucket flats that the
# engine refreshes each step (NOTE [ Buckets ]); buffers of replicas 1.. are always copies. One
# reduce node per bucket links the replicas to the originals (NOTE [ Early reduction ]); with the
# extension the nodes serve every step, and when a step's graph is still alive at the next
# refresh the set renews its tensors and nodes rather than overwrite what the graph needs.
# Rebuilds: NOTE [ Replica invalidation ]; compiled modules: NOTE [ Compiled replicas ].
class ReplicaSet:
    """Replicas of ``network`` on ``devices`` (``devices[0]`` holds the originals): the replica
    modules, their tensors and slots, the gradient side (a ``Reducer``) and ``no_sync()``'s
    cycle (a ``NoSyncCycle``).

    The wrapper (``FastDataParallel.replicate`` and its step) is the only caller. Per step:
    ``valid`` (may these replicas serve?), ``refresh`` (this step's replicas), ``launch_order``
    and ``serves`` (for the launch), ``after_launch``; around ``no_sync``: ``runs_on_leaves``,
    ``holds_pending``, ``end_cycle`` (the fold), ``drop_pending``. Every field is private; a
    query writes nothing."""

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
        modules = list(network.modules())
        if any(isinstance(m, torch.jit.ScriptModule) for m in modules):
            raise NotCacheable("TorchScript modules are replicated afresh every step")
        buffers = list(network.buffers())
        n = len(devices)
        # what the set was built from, fixed for its life (a change to any rebuilds it)
        self._devs = list(devices)  # the replicas' devices; [0] holds the originals
        self._src = devices[0]  # the originals' device
        self._ctx = compile_ctx  # the wrapper's torch.compile context (roots only)
        self._cap = cap_bytes  # bucket size (NOTE [ Buckets ])
        self._stats = stats  # the wrapper's comm_stats() counters
        self._net = modules  # the original modules, in ``modules()`` order
        self._sources = params + [b for b in buffers if b.requires_grad]  # what replicas link to
        self._bufs = [b for b in buffers if not b.requires_grad]  # copied to replicas 1..
        self._watched = self._sources + self._bufs  # what tensor_signature checks
        self._any_grad = any(s.requires_grad for s in self._sources)  # backward reduces
        # the RNNs among ``_net``, whose weight lists are pointed again (see ``_RNN_CACHE``)
        self._rnn_modules = [i for i, m in enumerate(modules) if hasattr(m, "_flat_weights_names")]
        self._linked = _backend.ext() is not None  # link once: needs grad_fn_use_count
        alias = not _buckets.cpu_distinct()  # replicas on the originals' device share storage
        # replicas with tensors of their own, refreshed from the originals every step
        self._copy_replicas = [j for j in range(1, n) if not (devices[j] == devices[0] and alias)]
        self._order = _launch_order(modules, n, compile_ctx, bool(self._copy_replicas))  # launches
        # the replicas and their state, renewed as NOTE [ Tensors a forward changed ] says
        self._slots = Slots.LINKED  # what the replicas' slots point at
        self._held: list[torch.Tensor] = []  # what the replicas held when last sealed
        self._held_ptrs: list[int] | bytes = []  # bytes: packed by the extension
        self._held_check: Any = None  # the extension's held_changed, where it sealed
        self._reseal = True  # what the replicas hold changed since: see _seal()
        self._shared_frozen: list[torch.Tensor] = []  # see _warn_shared_writes()
        self._shared_versions: list[int] = []  # their versions when sealed
        self._warned_shared = False  # _SHARED_WRITE said once per set
        self._untracked = False  # the last forward may have made a graph no node tracks
        self._n_buckets = 0  # comm_stats()'s "buckets", counted again after new layouts
        self._verified: Any = None  # the wrapper's record last refreshed under: see valid()
        self._layout: _buckets.Layout  # the copy replicas' flats (set by _new_tensors)
        self._buffer_layout: _buckets.Layout  # replicas 1..'s buffer flats
        self._buffer_copies: list[list[torch.Tensor]] = []  # per replica 1.., its buffers
        self._slots_at: list[tuple[int, str, int]] = []  # (module, key, source)
        self._buffer_slots: list[tuple[int, int, str, int]] = []  # (replica, module, key, buffer)
        self._replicas: list[list[Module]] = []  # per replica, its modules (``_net`` order)
        self._attrs: ReplicaAttrs | None = None  # the replicas' dicts as built, to undo writes
        with torch.inference_mode(False):  # replica tensors must be normal tensors
            self._tensors = self._new_tensors()  # per replica, one per source
            self._new_buffer_copies()
        self._reducer = Reducer(  # the gradient side
            self._sources, self._src, self._layout.buckets, stats, native=self._linked
        )
        self._cycle = NoSyncCycle(self._sources, stats)  # no_sync()'s leaves, probe and fold
        self._roots = self._build()  # the replicas' root modules (compiled ones included)
        if self._linked and self._any_grad:
            self._reducer.link(self._tensors)
        # after building (it writes)
        self._originals = snapshot(module_dicts(self._net))  # NOTE [ Replica invalidation ]
        self._signature = tensor_signature(self._watched)  # the originals' tensors at build

    def _new_tensors(self) -> list[list[torch.Tensor]]:
        with torch.inference_mode(False):
            first = [s.detach() for s in self._sources]  # replica 0: storage and version shared
            self._layout = _buckets.Layout(
                self._sources, self._devs, self._copy_replicas, self._cap
            )
            self._n_buckets = 0  # counted again by the next refresh
            rest = [
                self._layout.per_replica[j]
                if j in self._layout.per_replica
                else [_buckets.alias(s) for s in self._sources]
                for j in range(1, len(self._devs))
            ]
        return [first] + rest

    def _new_buffer_copies(self) -> None:
        """Buffers of replicas 1.. are always copies (BatchNorm updates them in place)."""
        self._buffer_layout = _buckets.Layout(
            self._bufs, self._devs, range(1, len(self._devs)), self._cap
        )
        self._n_buckets = 0
        self._buffer_copies = [
            self._buffer_layout.per_replica[j] for j in range(1, len(self._devs))
        ]

    def _in_turn(self) -> bool:
        return self._order in (Order.IN_TURN, Order.IN_TURN_COMPILING_BACKWARD)

    def _build(self) -> list[Module]:
        src_index = {t: k for k, t in enumerate(self._sources)}
        buf_index = {t: k for k, t in enumerate(self._bufs)}
        replicas = clone_tree(self._net, len(self._devs))
        for i, m in enumerate(self._net):
            for key, p in m._parameters.items():
                if p is None:
                    for rep in replicas:
                        rep[i]._parameters[key] = None
                else:
                    self._slots_at.append((i, key, src_index[p]))
            for key, b in m._buffers.items():
                for j, rep in enumerate(replicas):
                    if b is None:
                        rep[i]._buffers[key] = None
                    elif b in src_index:
                        self._slots_at.append((i, key, src_index[b]))
                    else:
                        own = b if j == 0 else self._buffer_copies[j - 1][buf_index[b]]
                        setattr(rep[i], key, own)
                        if j:
                            self._buffer_slots.append((j, i, key, buf_index[b]))
        # before the snapshots below: see NOTE [ Compiled replicas ]
        finish_tree(self._net, replicas, compiled=self._ctx is not None)
        roots = [compile_root(rep[0], self._ctx) for rep in replicas]
        if self._in_turn():  # NOTE [ Compiled replicas run in order ]: inputs at fixed addresses
            mark_static(self._tensors)
            mark_static(self._buffer_copies)
        self._replicas = replicas
        self._assign(Slots.LINKED)
        self._attrs = ReplicaAttrs([r for rep in replicas for r in rep])
        return roots

    def _assign(self, slots: Slots) -> None:
        """Point every replica's parameter slots as ``slots`` says, after undoing what a forward
        wrote to the replicas' dicts.

        Each slot as ``replicate`` writes it (``point_parameter``), RNN weight lists rebuilt
        afterwards.
        """
        self._slots = slots
        if self._attrs is not None:
            self._attrs.undo_forward_writes()
            self._attrs.snap = None
        self._point_slots()

    def _point_slots(self) -> None:
        """Every replica's slots at the tensors ``self._slots`` names."""
        per_replica = self._cycle.leaves() if self._slots is Slots.LEAVES else self._tensors
        rep0 = self._sources if self._slots is Slots.ORIGINALS else None
        for j, rep in enumerate(self._replicas):
            rep_tensors = rep0 if j == 0 and rep0 is not None else per_replica[j]
            for i, key, k in self._slots_at:
                r, t = rep[i], rep_tensors[k]
                if key in r._buffers:
                    r._buffers[key] = t
                    continue
                point_parameter(r, key, t)
            for i in self._rnn_modules:
                _point_rnn_cache(rep[i])
        for j, i, key, k in self._buffer_slots:
            self._replicas[j][i]._buffers[key] = self._buffer_copies[j - 1][k]
        self._reseal = True

    def valid(self, verified: Any = None) -> bool:
        """Whether the replicas still match the module: the wrapper asks before each
        ``refresh``; a query (writes nothing). ``verified``: the wrapper's record of a signature
        check passed this step (NOTE [ One signature per step ] in data_parallel.py); when the
        set was last refreshed under the same record, its own signature is skipped."""
        if (_backend.ext() is not None) != self._linked:
            return False  # the backend was switched: rebuild for the other path
        if verified is not None and verified is self._verified:
            return True
        return not self._originals.changed() and self._signature == tensor_signature(self._watched)

    def serves(self, replicas: Sequence[Module]) -> bool:
        """Whether ``replicas`` are this set's (what ``refresh`` returned, or a list of the same
        roots): the wrapper asks at the launch. A query."""
        roots = self._roots
        return len(replicas) == len(roots) and bool(roots) and replicas[0] is roots[0]

    def launch_order(self) -> Order:
        """What every launch of these replicas requires (``fastdp._launch.Order``), chosen when
        the set was built: ``TOGETHER`` asks the wrapper to arm them (``prepare_replicas``) every
        step. A query."""
        return self._order

    def _copy_sources(self) -> None:
        """Copy the originals into the copy replicas (no autograd): one broadcast per bucket."""
        self._layout.refresh(self._sources, self._stats)

    def _renew(self, renew: Renew, in_cycle: bool) -> None:
        """Make afresh what ``renew`` names (``renewal``); ``in_cycle``: a ``no_sync`` cycle holds
        leaves, which ``Renew.ALL`` renews too (the old keep their gradients until the fold). The
        caller points the slots at the new tensors."""
        if renew >= Renew.TENSORS:
            self._tensors = self._new_tensors()
            if self._in_turn():
                mark_static(self._tensors)
            if self._linked and self._any_grad:
                self._reducer.link(self._tensors)
        if renew >= Renew.BUFFERS:
            self._renew_buffers()
        if renew is Renew.ALL and in_cycle:
            self._cycle.new_leaves(self._tensors, self._in_turn())

    def _renew_buffers(self) -> None:
        """Fresh buffer copies for replicas 1.. (the old ones stay with a live graph)."""
        if not self._buffer_slots:
            return
        with torch.inference_mode(False):
            self._new_buffer_copies()
        if self._in_turn():
            mark_static(self._buffer_copies)
        for j, i, key, k in self._buffer_slots:
            self._replicas[j][i]._buffers[key] = self._buffer_copies[j - 1][k]
        self._reseal = True

    def _copy_buffers(self) -> None:
        if len(self._devs) > 1 and self._bufs:
            self._buffer_layout.refresh(self._bufs, self._stats)

    def add_memory(self, out: dict[str, dict[str, int]]) -> None:
        """Add the bytes this set holds per device to ``out`` (``FastDataParallel.memory_stats``);
        writes nothing of its own."""
        self._layout.add_memory(out)
        if len(self._devs) > 1:
            self._buffer_layout.add_memory(out)

    def _count_buckets(self) -> int:
        self._n_buckets = len(self._layout.buckets) + (
            len(self._buffer_layout.buckets) if len(self._devs) > 1 else 0
        )
        return self._n_buckets

    def refresh(self, no_sync: bool = False, verified: Any = None) -> list[Module]:
        """This step's replicas (a new list of the set's roots): tensors refreshed from the
        originals, autograd linked (on leaves that keep their gradients under ``no_sync``: see
        NOTE [ no_sync ]). Called by the wrapper once per step, after ``valid`` (or a build),
        before the launch; ``verified``: the record the set is now valid under (see ``valid``).
        Writes the replicas, their tensors and the reducer's step state."""
        self._verified = verified
        if self._stats is not None:
            self._stats["buckets"] = self._n_buckets or self._count_buckets()
        self._reducer.prepare_for_forward()
        # DataParallel's replicate(detach=True) gives replica 0 the original tensors themselves
        # (a forward's .data = reaches them); with grad, views of them
        originals = not torch.is_grad_enabled()
        # NOTE [ no_sync ]; hooks on the originals must see every micro-step's gradient
        micro_step = (
            no_sync and self._any_grad and not originals and not has_grad_hooks(self._sources)
        )
        first = self._cycle.leaves() is None
        renew = renewal(
            tainted=self._tainted(),  # what the last forward's replicas held, as sealed
            graph_alive=self._reducer.graph_alive(),
            awaits_backward=self._cycle.awaits_backward(),
            untracked=self._untracked,
            linked=self._linked,
            copy_replicas=bool(self._copy_replicas),
            micro_step=micro_step,
            first_micro_step=first,
        )
        undone = self._attrs.undo_forward_writes()
        if renew:
            self._renew(renew, in_cycle=not first)
        if micro_step:
            if first:  # the cycle's micro-steps reduce nothing
                self._reducer.prepare_for_backward(self._tensors, grad=False)
                self._cycle.start(self._tensors, self._in_turn())
            else:
                self._cycle.drop_if_zeroed()
            slots = Slots.LEAVES
        else:  # back to the linked tensors; the leaves wait for the fold
            slots = Slots.ORIGINALS if originals else Slots.LINKED
        if renew >= Renew.TENSORS or slots is not self._slots:
            self._assign(slots)
        elif undone:
            self._point_slots()
        self._copy_buffers()
        if micro_step:
            if self._copy_replicas:  # every micro-step: ``p.data.clamp_()`` changes no version
                with torch.no_grad():
                    self._copy_sources()
            self._cycle.watch()
            self._seal()
            return list(self._roots)
        if self._copy_replicas:
            self._copy_sources()
        self._untracked = not self._any_grad and torch.is_grad_enabled()
        self._cycle.stop_watching()
        self._reducer.prepare_for_backward(
            self._tensors, self._any_grad and torch.is_grad_enabled()
        )
        if self._reseal or self._attrs.snap is None:
            self._seal()
        return list(self._roots)

    def _seal(self) -> None:
        """The replicas start a step as the set made them: their dicts, and what their tensors
        are (NOTE [ Tensors a forward changed ]). Called by ``refresh``."""
        self._attrs.seal()
        if self._reseal:
            self._reseal = False
            per_replica = self._cycle.leaves() if self._slots is Slots.LEAVES else self._tensors
            # replica 0 on the originals: those are checked by the wrapper's signature
            first = 1 if self._slots is Slots.ORIGINALS else 0
            self._held = [t for rep in per_replica[first:] for t in rep] + [
                t for rep in self._buffer_copies for t in rep
            ]
            ext = _backend.ext()
            self._held_check = None if ext is None else ext.held_changed
            self._held_ptrs = (
                list(map(torch.Tensor.data_ptr, self._held))
                if ext is None
                else ext.held_data_ptrs(self._held)
            )
            frozen = [k for k, s in enumerate(self._sources) if not s.requires_grad]
            self._shared_frozen = [
                per_replica[j][k]
                for j in range(1, len(per_replica))
                if j not in self._copy_replicas
                for k in frozen
            ]
            self._shared_versions = list(map(_VERSION, self._shared_frozen))

    def after_launch(self, outputs: Sequence[Any]) -> None:
        """The wrapper calls it after each launch of these replicas, with their outputs: notes a
        graph no bucket node tracks, and warns once per set where a forward wrote in place to a
        frozen parameter the replicas share (README, *Persistent replicas*)."""
        alive = self._reducer.graph_alive() or self._cycle.awaits_backward()
        if self._any_grad and torch.is_grad_enabled() and not alive:
            # a graph that reaches no bucket node (the trainable parameters unused, or used only
            # inside a reentrant checkpoint) may still save replica tensors: assume it lives on
            self._untracked = self._untracked or _requires_grad(outputs)
        if self._shared_frozen:
            self._warn_shared_writes()

    def _warn_shared_writes(self) -> None:
        versions = list(map(_VERSION, self._shared_frozen))
        if versions != self._shared_versions:
            self._shared_versions = versions
            if not self._warned_shared:
                self._warned_shared = True
                warnings.warn(_SHARED_WRITE, UserWarning, stacklevel=5)

    # NOTE [ Tensors a forward changed ]
    # DataParallel's replica tensors are new every step; persistent ones are not, so what a
    # forward does to one would outlive the step: ``.data =`` (the replica would keep that
    # storage and never see a refresh again) or a hook (it would run once more every step).
    # Each step checks every tensor the replicas hold (one pass in C++; without the extension
    # one C-level pass for storage, one for hooks); a changed set gets fresh tensors (and
    # nodes), as DataParallel's would be.
    def _tainted(self) -> bool:
        """Whether a forward replaced the storage of, or hooked, a tensor the replicas hold."""
        held = self._held
        if self._held_check is not None:  # sealed with the extension: held_data_ptrs
            return self._held_check(held, self._held_ptrs)
        return list(map(torch.Tensor.data_ptr, held)) != self._held_ptrs or any(map(_HOOKS, held))

    def runs_on_leaves(self) -> bool:
        """Whether the last ``refresh`` gave a ``no_sync`` micro-step (slots on the leaves,
        nothing reduced). A query, for the wrapper's ``no_sync_stats``."""
        return self._slots is Slots.LEAVES

    def holds_pending(self) -> bool:
        """Whether gradients of a ``no_sync`` cycle wait on this set's leaves for a fold
        (``end_cycle``). A query."""
        return self._cycle.leaves() is not None

    def awaits_micro_backward(self) -> bool:
        """Whether a ``no_sync`` micro-step's graph has yet to run its backward (its reentrant
        checkpoints then re-run these replicas on the leaves). A query."""
        return self._cycle.awaits_backward()

    def drop_pending(self, zeros: bool = False) -> None:
        """``zero_grad()`` (the wrapper's): the gradients pending under ``no_sync`` go (see
        ``NoSyncCycle.drop_pending``)."""
        self._cycle.drop_pending(zeros)

    def end_cycle(self) -> Callable[[], int]:
        """End the ``no_sync`` cycle and return its fold (``NoSyncCycle.end``), which the
        wrapper calls once every set's cycle has ended; the slots go back to the linked
        tensors."""
        step = self._cycle.end()
        if self._slots is Slots.LEAVES:
            self._assign(Slots.LINKED)
        return step

    def for_tests(self) -> _TestView:
        """A test hook, never called by the library: the set's state, read live, under the
        names tests assert on. A query."""
        return _TestView(self)


def _requires_grad(outputs: Any) -> bool:
    """Whether a tensor among ``outputs`` (containers torch's pytree knows) requires grad."""
    leaves = _torch_private.tree_leaves(outputs)
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)


class _TestView:
    """``ReplicaSet.for_tests``: read-only, live views of a set's state."""

    __slots__ = ("_rs",)

    def __init__(self, rs: ReplicaSet) -> None:
        self._rs = rs

    replicas = property(lambda v: v._rs._roots, doc="the replicas' roots")
    tensors = property(lambda v: v._rs._tensors, doc="per replica, one tensor per source")
    sources = property(lambda v: v._rs._sources, doc="the originals the replicas link to")
    leaves = property(lambda v: v._rs._cycle.leaves(), doc="the no_sync leaves, or None")
    layout = property(lambda v: v._rs._layout, doc="the copy replicas' flats (``_buckets.Layout``)")
    compile_ctx = property(lambda v: v._rs._ctx, doc="the torch.compile context")
    in_order = property(lambda v: v._rs._in_turn(), doc="whether the replicas run in turn")


def _launch_order(modules: list[Module], n: int, ctx: Any, copy_replicas: bool) -> Order:
    """How the replicas of ``modules`` on ``n`` devices must run: together where they meet in
    forward (SyncBatchNorm, replication callbacks; NOTE [ Replicas that must run at once ]),
    else in turn where several run compiled code (NOTE [ Compiled replicas run in order ];
    with copy replicas each backward compiled with its forward), else as the strategy says."""
    from fastdp.sync_batchnorm import _syncable

    if any(_syncable(m) or hasattr(m, "__data_parallel_replicate__") for m in modules):
        return Order.TOGETHER  # armed every step (callbacks run even for one replica)
    if n < 2 or (ctx is None and not any(is_compiled(m) for m in modules)):
        return Order.ANY
    return Order.IN_TURN_COMPILING_BACKWARD if copy_replicas else Order.IN_TURN
