"""The gradient side of the replicas, shaped like DDP's ``Reducer``: ``reduce_add`` (the one
sum), the per-bucket autograd nodes that call it, and ``Reducer``, one per replica set (its
nodes, their liveness, unreached buckets). ``no_sync()``'s cycle is ``fastdp/_no_sync.py``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd import Function

from fastdp import _backend, _devices, _torch_private
from fastdp._buckets import assign_buckets
from fastdp._buckets import nbytes as tensor_bytes
from fastdp._transports import count, transport_for


# Every cross-replica sum of the package goes through ``reduce_add``: the persistent replicas'
# backward (one bucket node per bucket), ``no_sync()``'s fold, and ``comm.reduce_add_coalesced``
# (``persistent=False``'s ``Broadcast`` backward). Per bucket it packs each replica's gradients
# into one flat, sums the flats already on the destination, reduces the rest with one transport
# call (``fastdp/_transports.py``) and returns views of the sum. Under ``create_graph=True`` the
# sum is made of differentiable ops; when every replica's tensors are on the destination (CPU
# replicas, repeated GPU ids) one multi-tensor add per replica needs no pack.
def reduce_add(
    per_replica: Sequence[Sequence[torch.Tensor]],
    dest: torch.device,
    cap_bytes: float = float("inf"),
    stats: dict[str, int] | None = None,
    nbytes: int | None = None,
) -> list[torch.Tensor]:
    """``result[k] = per_replica[0][k] + per_replica[1][k] + ...`` on ``dest``: the package's
    one sum.

    ``per_replica``: one list of tensors per replica, in order, each on one device. Sums run in
    replica order (the transport's order between distinct GPUs). Results never alias an input.
    ``nbytes``: the inputs' size when the caller knows it (one bucket), for ``stats``.
    """
    first = per_replica[0]
    if not first:
        return []
    # see NOTE [ Streams of a reduce across devices ]
    transport_for([dest]).order_reads(per_replica, dest)
    if len(per_replica) == 1:
        return [g.to(dest, copy=True) for g in first]
    if torch.is_grad_enabled() and any(g.requires_grad for rep in per_replica for g in rep):
        return _sum_each(per_replica, dest)  # differentiable: create_graph=True
    with torch.no_grad():
        if all(rep[0].device == dest for rep in per_replica) and _all_strided(first):
            # dense replica 0: foreach's slow path adds later replicas' sparse ones into it (dense)
            out = list(torch._foreach_add(list(first), list(per_replica[1])))
            for rep in per_replica[2:]:
                torch._foreach_add_(out, list(rep))
            if stats is not None:
                count(stats, "reduce", sum(map(tensor_bytes, first)) if nbytes is None else nbytes)
            return out
        results: list[Any] = [None] * len(first)
        for bucket in assign_buckets(first, cap_bytes):
            sums = _reduce_bucket([[rep[i] for i in bucket] for rep in per_replica], dest)
            for i, s in zip(bucket, sums):
                results[i] = s
            if stats is not None:
                count(stats, "reduce", sum(tensor_bytes(first[i]) for i in bucket))
        return results


def _sum_each(
    per_replica: Sequence[Sequence[torch.Tensor]], dest: torch.device
) -> list[torch.Tensor]:
    """Tensor by tensor, in replica order: differentiable ops, and what cannot be flattened."""
    out = []
    for k in range(len(per_replica[0])):
        column = _densify_mixed([rep[k] for rep in per_replica])
        total = column[0].to(dest, copy=True)
        for g in column[1:]:
            total = total + g.to(dest)
        out.append(total)
    return out


# Sparse gradients are summed as torch's ``comm.reduce_add_coalesced`` sums them for
# DataParallel: all sparse (an embedding with ``sparse=True`` that every replica used), a sparse
# sum; a mix of layouts (a replica that skipped it gets dense zeros), each made dense first, then a
# dense sum. Only a dense tensor of replica 0 can take the multi-tensor adds as they are: a dense
# sum adds a sparse gradient into itself, a sparse one cannot take a dense one.
def _densify_mixed(column: list[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor's gradients over the replicas, all sparse or all dense (see above)."""
    layouts = {g.layout for g in column}
    if len(layouts) == 1:
        return column
    return [g if g.layout == torch.strided else g.to_dense() for g in column]


def _all_strided(tensors: Sequence[torch.Tensor]) -> bool:
    return all(g.layout == torch.strided for g in tensors)


def _reduce_bucket(per_replica: list[list[torch.Tensor]], dest: torch.device) -> list[torch.Tensor]:
    """One bucket whose replicas are not all on ``dest``: one flatten per replica, those on
    ``dest`` summed there, then one transport reduce of that sum and the other replicas' flats."""
    if {g.layout for rep in per_replica for g in rep} != {torch.strided}:  # one call, not one per g
        return _reduce_sparse_bucket(per_replica, dest)
    flats = [torch.cat([g.reshape(-1) for g in rep]) for rep in per_replica]
    local = [f for f in flats if f.device == dest]
    parts = [f for f in flats if f.device != dest]
    if local:
        total = local[0]
        for f in local[1:]:
            total = total + f
        parts.insert(0, total)
    total = transport_for([dest]).reduce(parts, dest)
    return [
        piece.view(g.shape)
        for piece, g in zip(total.split([g.numel() for g in per_replica[0]]), per_replica[0])
    ]


def _reduce_sparse_bucket(
    per_replica: list[list[torch.Tensor]], dest: torch.device
) -> list[torch.Tensor]:
    """A bucket with sparse gradients: the all-sparse columns summed one by one (sparse), the
    others (mixed ones made dense) as a dense bucket (see ``_densify_mixed``)."""
    sparse = [
        k
        for k in range(len(per_replica[0]))
        if not any(rep[k].layout == torch.strided for rep in per_replica)
    ]
    results: list[Any] = [None] * len(per_replica[0])
    for k, total in zip(sparse, _sum_each([[rep[k] for k in sparse] for rep in per_replica], dest)):
        results[k] = total
    dense = sorted(set(range(len(per_replica[0]))) - set(sparse))
    if dense:
        dense_per_replica = [
            [rep[k] if rep[k].layout == torch.strided else rep[k].to_dense() for k in dense]
            for rep in per_replica
        ]
        for k, total in zip(dense, _reduce_bucket(dense_per_replica, dest)):
            results[k] = total
    return results


class ExpectBackward:
    """Whether a step's graph still awaits its backward (DDP's ``expect_autograd_hooks_``; see
    NOTE [ Persistent replicas ]): set by ``prepare_for_backward``, cleared by a bucket node's
    backward."""

    __slots__ = ("value",)

    def __init__(self, value: bool = True) -> None:
        self.value = value


# NOTE [ Unreached buckets ]
# A bucket none of whose tensors took part in the forward is not reached by autograd, where
# DataParallel's one Broadcast node gives every parameter a gradient (zeros if unused). With the
# extension, the first bucket node of a backward asks the engine which sources it accumulates into
# (``csrc/graph_task.cpp``: Python cannot ask) and queues a callback that gives the buckets that did
# not run zeros where ``.grad`` is None and they require grad. Without it, a set of two or more
# buckets links every step an anchor (``UnreachedAnchor``): every source is its input, every bucket
# node takes its output, so any reached bucket reaches every source, and the anchor gives the unrun
# buckets' sources zeros, which the engine accumulates, captures or drops as the backward asks. Its
# cost (the sums live to the end of backward): bench/results/cpu-2core-2026-11-26-anchor.
class BucketGroup:
    """The buckets of one replica set, per running backward."""

    __slots__ = ("sources", "flat", "tasks")

    def __init__(self, sources: list[list[torch.Tensor]]) -> None:
        self.sources = sources
        self.flat = [s for b in sources for s in b]
        # per backward (graph task id) the buckets whose nodes ran in it: a reentrant
        # checkpoint's nested backward runs inside the outer one, and each gives its own zeros
        self.tasks: dict[Any, set[int]] = {}

    def reset(self) -> None:
        self.tasks = {}

    def mark(self, b: int) -> tuple[Any, set[int] | None]:
        """Bucket ``b``'s node runs in the current backward: that backward's id, and the set of
        buckets that ran in it when ``b`` is its first (None otherwise)."""
        task = _torch_private.current_graph_task_id()
        ran = self.tasks.get(task)
        if ran is not None:
            ran.add(b)
            return task, None
        ran = self.tasks[task] = {b}
        return task, ran

    def ran_in_this_backward(self) -> set[int]:
        """The buckets whose nodes ran in the current backward (the anchor's question, asked
        once a backward: the answer is forgotten)."""
        return self.tasks.pop(_torch_private.current_graph_task_id(), set())

    def bucket_ran(self, b: int) -> None:
        """Bucket ``b``'s extension node runs in the current backward."""
        if len(self.sources) < 2:  # one bucket: it cannot go unreached
            return
        task, ran = self.mark(b)
        ext = _backend.ext()
        if ran is None or ext is None:
            return
        if ext.graph_task_mode() == 1:
            targets = [True] * len(self.flat)
        else:
            targets = ext.graph_task_accumulates(self.flat)
            if not any(targets):
                return
        _torch_private.queue_engine_callback(lambda: self._zero_unreached(task, ran, targets))

    def _zero_unreached(self, task: Any, ran: set[int], targets: list[bool]) -> None:
        self.tasks.pop(task, None)
        k, hooked = 0, []
        for b, sources in enumerate(self.sources):
            for s in sources:
                if b not in ran and targets[k] and s.requires_grad:
                    if _HOOKS(s) or _POST_HOOKS(s):
                        hooked.append(s)
                    elif s.grad is None:
                        s.grad = torch.zeros_like(s)
                k += 1
        if hooked:  # its hooks see the zeros DataParallel's Broadcast accumulates: the engine's
            torch.autograd.backward(hooked, [torch.zeros_like(s) for s in hooked])


class BucketLink:
    """What a bucket's node needs in backward; holds no replica tensor (no cycles)."""

    __slots__ = ("index", "n", "nbytes", "dest", "stats", "expect_backward", "group")

    def __init__(
        self,
        index: int,
        sources: Sequence[torch.Tensor],
        dest: torch.device,
        stats: dict[str, int] | None,
        expect_backward: ExpectBackward,
        group: BucketGroup,
        nbytes: int | None = None,
    ) -> None:
        if nbytes is None:
            nbytes = sum(map(tensor_bytes, sources))
        self.index, self.n, self.nbytes = index, len(sources), nbytes
        self.dest, self.stats, self.group = dest, stats, group
        self.expect_backward = expect_backward

    def ran(self, local: bool, fresh: int) -> None:
        """The node's backward starts (the C++ node sums ``local`` replicas itself, ``fresh`` of
        them into new tensors: NOTE [ Summing in place ] in csrc/bucket_reduce.cpp). Called
        from the node's backward with the GIL taken for it: no call it can spare."""
        self.expect_backward.value = False
        if len(self.group.sources) > 1:  # one bucket cannot go unreached
            self.group.bucket_ran(self.index)
        stats = self.stats
        if local and stats is not None:  # ``count(stats, "reduce", nbytes)``, inline
            stats["reduces"] += 1
            stats["bytes_reduced"] += self.nbytes
            stats["sums_out_of_place"] += fresh

    def reduce_replicas(self, per_replica: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        return reduce_add(per_replica, self.dest, stats=self.stats, nbytes=self.nbytes)


# NOTE [ Early reduction ]
# Each bucket's node returns the replicas' tensors of its bucket and, in backward, their sum to
# the originals (so ``.grad``, hooks, ``autograd.grad`` and double backward see DataParallel's
# total). Autograd runs ready nodes highest sequence number first: a node gets AccumulateGrad's
# (the maximum) and runs once every replica's gradients for its bucket exist, while earlier layers
# are still in backward (DDP's early launch). While a source has a post-accumulate-grad hook the
# nodes get the lowest instead: they run after the nested backwards of reentrant checkpoints, as
# DataParallel's Broadcast does, so the hook sees each sum once. With the extension the node is
# C++ (``csrc/bucket_reduce.cpp``, made once per tensor set, one Python call per bucket); without
# it, ``BucketReduce``, made every step.
class BucketReduce(Function):
    """``BucketReduce.apply(link, per_replica, anchor, *sources)`` -> ``per_replica`` flattened: the
    persistent replica tensors themselves become outputs of this node; backward sums them onto
    the sources with ``reduce_add``.
    ``anchor``: the set's ``UnreachedAnchor`` output, None for a one-bucket set."""

    @staticmethod
    def forward(ctx, link, per_replica, anchor, *sources):
        ctx.link = link
        outs = [t for rep in per_replica for t in rep]
        frozen = [
            rep[k]
            for k in range(len(sources))
            if not ctx.needs_input_grad[3 + k]
            for rep in per_replica
        ]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(outs)

    @staticmethod
    @_torch_private.untraced  # as the C++ node: compiled autograd runs it, never traces it
    def backward(ctx, *grads):
        link = ctx.link
        link.expect_backward.value = False
        if len(link.group.sources) > 1:
            link.group.mark(link.index)
        n = link.n
        sums = link.reduce_replicas([grads[j : j + n] for j in range(0, len(grads), n)])
        return (None, None, ANCHOR_GRAD if ctx.needs_input_grad[2] else None, *sums)


# The anchor's output, and what a bucket node gives it back: a tensor, not None, as compiled
# autograd adds up the gradients an anchor receives (its graph takes every gradient for
# defined). On the CPU and float32 whatever the sources' device or the default dtype, so the two
# always match (the engine checks a gradient's device against its input's).
ANCHOR_GRAD = torch.empty(0, dtype=torch.float32)


class UnreachedAnchor(Function):
    """``UnreachedAnchor.apply(group, *sources)`` -> an empty tensor that every bucket node of
    the group takes as an input; backward gives zeros to the sources of the buckets that did
    not run in it (NOTE [ Unreached buckets ], the path without the extension)."""

    @staticmethod
    def forward(ctx, group, *sources):
        ctx.group = group
        ctx.set_materialize_grads(False)
        return torch.empty(0, dtype=torch.float32)

    @staticmethod
    @_torch_private.untraced
    def backward(ctx, _):
        group = ctx.group
        ran = group.ran_in_this_backward()
        if _torch_private.in_compiled_autograd():
            ran = set()  # zeros for all: its graph adds them where it expects tensors
        elif len(ran) == len(group.sources):
            return (None,) * (1 + len(group.flat))
        needs, out, k = ctx.needs_input_grad, [None], 0
        for b, sources in enumerate(group.sources):
            for s in sources:
                k += 1
                out.append(torch.zeros_like(s) if needs[k] and b not in ran else None)
        return tuple(out)


def link_bucket(
    link: BucketLink,
    per_replica: Sequence[Sequence[torch.Tensor]],
    sources: Sequence[torch.Tensor],
    native: bool = False,
    anchor: torch.Tensor | None = None,
) -> Any:
    """Apply the bucket's node (grad mode on); returns it (``Reducer`` sets its turn).

    ``native``: the extension's C++ node (made once per tensor set: the Python Function's
    machinery costs ~2 us per gradient, which small models feel); else the ``BucketReduce``
    Function above, the same sums, with ``anchor`` (NOTE [ Unreached buckets ])."""
    ext = _backend.ext() if native else None
    if ext is not None:
        outs = ext.bucket_reduce_link(
            list(sources),
            [t for rep in per_replica for t in rep],
            link.dest,
            link.ran,
            link.reduce_replicas,
        )
    else:
        outs = BucketReduce.apply(link, per_replica, anchor, *sources)
    return next((t.grad_fn for t in outs if t.grad_fn is not None), None)


def _stream_of(device: torch.device) -> Any:
    """The current stream of ``device`` that a node made now would run on (None: the CPU)."""
    return _devices.current_stream(device)


_VERSION = operator.attrgetter("_version")
_HOOKS = operator.attrgetter("_backward_hooks")
_POST_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")


def has_grad_hooks(sources: list[torch.Tensor]) -> bool:
    """Whether a source's gradient goes through a hook (tensor or post-accumulate)."""
    return any(map(_HOOKS, sources)) or any(map(_POST_HOOKS, sources))


class Reducer:
    """The gradient side of one replica set (DDP's ``Reducer``, in one process): which sources
    each reduce node serves, the nodes (made once per tensor set with the extension, every step
    without), whether the last step's graph still needs them, and unreached buckets.
    Communication is the transports' (``fastdp/_transports.py``).

    Its one caller is the replica set, which owns the replica tensors: ``prepare_for_forward``
    every step, ``prepare_for_backward`` every step outside ``no_sync``'s micro-steps (and with
    ``grad=False`` at a cycle's first), ``link`` when its tensors are new, ``graph_alive`` before
    it overwrites them. Every field is private; ``graph_alive`` is a query."""

    def __init__(
        self,
        sources: list[torch.Tensor],
        dest: torch.device,
        buckets: list[list[int]],
        stats: dict[str, int] | None,
        native: bool,
    ) -> None:
        self._sources = sources  # the originals the replicas' gradients are summed into
        self._dest = dest  # the originals' device: where every sum lands
        self._stats = stats  # the wrapper's comm_stats() counters, or None
        self._native = native  # the extension's C++ nodes, made once per tensor set
        self._buckets = buckets  # per bucket, its sources' indices (NOTE [ Buckets ])
        per_bucket = [[sources[i] for i in b] for b in buckets]
        self._group = BucketGroup(per_bucket)  # which buckets ran in this backward
        self._bucket_sources = [(s, sum(map(tensor_bytes, s))) for s in per_bucket]  # and bytes
        self._expect_backward = ExpectBackward(False)  # the last step's graph awaits its backward
        self._probes: list[tuple[torch.Tensor, int]] = []  # (a node's output, its owner count)
        self._nodes: list[Any] = []  # the bucket nodes (their turn: _set_turns)
        self._early = True  # the nodes' turn: NOTE [ Early reduction ]
        self._per_bucket: tuple = (None, [])  # (tensors, per bucket its replicas' of them)
        self._stream: Any = None  # the destination's current stream at the last link

    def prepare_for_forward(self) -> None:
        """A forward starts (the set's ``refresh``): the last backward's bookkeeping of which
        buckets ran is dropped."""
        g = self._group
        if g.tasks:  # the last backward's bookkeeping
            g.reset()

    def link(self, tensors: list[list[torch.Tensor]], expect: ExpectBackward | None = None) -> None:
        """One reduce node per bucket (grad mode on), whose outputs are ``tensors`` (per replica,
        one per source) themselves."""
        self._expect_backward = ExpectBackward(False) if expect is None else expect
        self._probes = []
        self._stream = _stream_of(self._dest)
        if self._per_bucket[0] is not tensors:  # per tensor set, not per step
            self._per_bucket = (
                tensors,
                [[[rep[i] for i in b] for rep in tensors] for b in self._buckets],
            )
        self._nodes = []
        with torch.enable_grad(), torch.inference_mode(False):
            anchor = None
            # NOTE [ Unreached buckets ]. Linked every step: the kind of backward is known only in
            # backward, and linked after the fact, a first ``backward(inputs=...)`` would leave a
            # named parameter None where DataParallel gives zeros.
            if not self._native and len(self._buckets) > 1:
                anchor = UnreachedAnchor.apply(self._group, *self._group.flat)
            pairs = zip(self._per_bucket[1], self._bucket_sources)
            for b, (per_replica, (sources, size)) in enumerate(pairs):
                link = BucketLink(
                    b, sources, self._dest, self._stats, self._expect_backward, self._group, size
                )
                node = link_bucket(
                    link,
                    per_replica,
                    sources,
                    native=self._native,
                    anchor=anchor,
                )
                if node is not None:
                    self._nodes.append(node)
        self._set_turns()
        ext = _backend.ext()
        if self._native and ext is not None:
            for bucket in self._buckets:
                probe = next(
                    (tensors[0][i] for i in bucket if tensors[0][i].grad_fn is not None), None
                )
                if probe is not None:
                    self._probes.append((probe, ext.grad_fn_use_count(probe)))

    def prepare_for_backward(self, tensors: list[list[torch.Tensor]], grad: bool) -> None:
        """This step's forward runs on ``tensors`` and its backward reduces (``grad``), or not."""
        if not grad:
            self._expect_backward.value = False
            return
        early = not any(map(_POST_HOOKS, self._sources))
        if self._native and _stream_of(self._dest) != self._stream:
            self._early = early  # nodes follow the current stream (see below)
            self.link(tensors, ExpectBackward(True))
        elif self._native:  # the nodes made by link() serve every step
            self._expect_backward.value = True
            if early != self._early:
                self._early = early
                self._set_turns()
        else:
            self._early = early
            self.link(tensors, ExpectBackward(True))

    # Nodes follow the current stream: autograd runs a node on the stream that was current on its
    # device when the node was made (its outputs' metadata), after every incoming gradient's stream.
    # The extension's nodes are made once per tensor set, so a later step under another current
    # stream (a side stream, a graph capture after an eager warm-up) would reduce on the first
    # step's stream, serialised behind it, or under capture depend on the legacy stream, which the
    # capture refuses. So ``prepare_for_backward`` compares the destination's current stream with
    # the last link's, once a step, and links afresh when it changed (the Python nodes are linked
    # every step anyway).

    # The late turn: a post-accumulate-grad hook acts on ``.grad`` itself, so it sees how many
    # times and in which order the nodes accumulate. A backward may reach a node more than once
    # (each replica's reentrant checkpoint recomputes in a nested backward that reaches it
    # again); DataParallel's one ``Broadcast`` node runs last in the outer backward. So while a
    # source has such a hook the nodes get the lowest sequence number and run after the nested
    # backwards, unless a checkpoint node ties at 0 (the first node a fresh worker thread makes).
    def _set_turns(self) -> None:
        """Each node's turn in backward, the earliest or the last (NOTE [ Early reduction ])."""
        nr = _torch_private.MAX_SEQUENCE_NR if self._early else 0
        for node in self._nodes:
            _torch_private.set_sequence_nr(node, nr)

    def graph_alive(self) -> bool:
        """Whether the last linked step's graph may still need the current tensors (a
        micro-step's: ``NoSyncCycle.awaits_backward``). A query."""
        if not self._expect_backward.value:
            return False
        if not self._native:
            return True  # no owner counts without the extension: be conservative
        ext = _backend.ext()
        return any(ext.grad_fn_use_count(t) > base for t, base in self._probes)
