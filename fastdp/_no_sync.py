"""``no_sync()``'s cycle, owned by the replica set: the leaves the replicas run on, the
generations retired mid-cycle, the probe that tells whether a micro-step's backward has run, the
sources' grad marks (``zero_grad`` since) and the fold into the originals' ``.grad``
(NOTE [ no_sync ]). The sum itself is the reducer's ``reduce_add``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from fastdp import _reducer, _torch_private
from fastdp._compiled import mark_static


class Probe:
    """Whether a micro-step's backward has yet to run (``value``); ``then``: what to queue when
    it runs (a fold that had to wait for it: see ``NoSyncCycle.end``)."""

    __slots__ = ("value", "then")

    def __init__(self) -> None:
        self.value = False
        self.then: Any = None

    def ran(self, _grads: Any) -> None:
        self.value = False
        then, self.then = self.then, None
        if then is not None:
            _torch_private.queue_engine_callback(then)


# NOTE [ no_sync ]
# Under ``no_sync()`` (decided at forward time) replicas run on leaves (``detach()`` views of the
# replica tensors) whose ``.grad`` accumulate on each replica's device: nothing is reduced (a cycle
# costs the fold and its last step's reduction) until the next grad-enabled forward outside, which
# folds every generation of leaves (tensors renewed mid-cycle get new leaves; the old keep what
# graphs still owe them) into the originals' ``.grad`` by plain accumulation. A probe on each
# replica's first leaf tells whether a micro-step's backward has run: until it has, a refresh
# renews what that graph saved instead of overwriting it, and a fold runs again when it ends (an
# engine callback). Copy replicas are refilled every micro-step (``.data`` edits bump no version).
# ``zero_grad()`` drops pending gradients.
class NoSyncCycle:
    """The ``no_sync()`` cycle of one replica set: its leaves (per replica, one per source), the
    generations retired mid-cycle, the probe on a micro-step's backward, the sources' grad marks
    and the fold.

    Its one caller is the replica set: per micro-step ``start`` (the first) or
    ``drop_if_zeroed``, ``new_leaves`` when the set renews its tensors mid-cycle, ``watch``; per
    step outside ``stop_watching``; for the wrapper's ``zero_grad`` ``drop_pending``, and for its
    fold ``end``. Every field is private; ``leaves`` and ``awaits_backward`` are queries."""

    def __init__(self, sources: list[torch.Tensor], stats: dict[str, int] | None) -> None:
        self._sources = sources  # the originals the fold adds into
        self._stats = stats  # the wrapper's comm_stats() counters, or None
        self._leaves: list[list[torch.Tensor]] | None = None  # NOTE [ no_sync ]; None outside
        self._retired: list[list[list[torch.Tensor]]] = []  # this cycle's earlier leaves
        self._probe = Probe()  # a micro-step's backward has not run yet
        self._probe_nodes: list[Any] = []  # its leaves' AccumulateGrad nodes, hooked
        self._probe_at = 0  # where in a replica's leaves to look for the probe: see watch()
        self._marks: tuple = ()  # grad_marks() of the sources when the cycle started

    def leaves(self) -> list[list[torch.Tensor]] | None:
        """The replicas' leaves of this cycle (per replica, one per source), None outside one.
        A query: the replica set points its slots at them."""
        return self._leaves

    def awaits_backward(self) -> bool:
        """Whether the last micro-step's graph may still need the leaves (its backward has yet
        to run). A query."""
        return self._probe.value

    def start(self, tensors: list[list[torch.Tensor]], in_order: bool) -> None:
        """The first micro-step of a cycle: fresh leaves on ``tensors``, the grad marks taken."""
        self._retired = []
        self.new_leaves(tensors, in_order)
        self._marks = grad_marks(self._sources)

    def new_leaves(self, tensors: list[list[torch.Tensor]], in_order: bool) -> None:
        """Leaves on ``tensors``; the old ones, if any, are retired with their gradients (a
        graph still alive may add to them) until the fold."""
        if self._leaves is not None:
            self._retired.append(self._leaves)
        self._leaves = make_leaves(tensors, self._sources)
        self._probe_nodes = []
        if in_order:  # NOTE [ Compiled replicas run in order ]: inputs at fixed addresses
            mark_static(self._leaves)

    def watch(self) -> None:
        """A micro-step's forward runs on the leaves: ``awaits_backward`` holds until its
        backward accumulates into a replica's probe leaf (one hook per replica and leaves): the
        first that requires grad, or, once that one went without, the first that received a
        gradient."""
        if self._probe.value:  # the last probe did not fire
            got = [
                k
                for gen in self._generations()
                for rep in gen
                for k, t in enumerate(rep)
                if t.grad is not None
            ]
            if got and min(got) != self._probe_at:
                self._probe_at, self._probe_nodes = min(got), []
        if not self._probe_nodes:
            self._probe = Probe()  # holds no replica tensor: the hooks make no cycle
            for rep in self._leaves or ():
                leaf = next((t for t in rep[self._probe_at :] if t.requires_grad), None)
                if leaf is not None:
                    node = torch.autograd.graph.get_gradient_edge(leaf).node
                    node.register_prehook(self._probe.ran)
                    self._probe_nodes.append(node)
        self._probe.value = bool(self._probe_nodes)

    def stop_watching(self) -> None:
        """A step outside the cycle: what a micro-step's graph saved was renewed before it, so
        ``awaits_backward`` answers False (a fold queued for that backward still runs)."""
        self._probe.value = False

    def drop_if_zeroed(self) -> None:
        """A ``zero_grad()`` since the last micro-step drops the pending gradients."""
        if grad_marks(self._sources) != self._marks:
            self.drop_pending()
            self._marks = grad_marks(self._sources)

    def drop_pending(self, zeros: bool = False) -> None:
        """Forget the pending gradients; ``zeros``: ``zero_grad(set_to_none=False)``, which
        leaves zeros where plain accumulation would have had a gradient."""
        generations = self._generations()
        for gen in generations if zeros else ():
            if any(leaf.grad is not None for rep in gen for leaf in rep):
                # a reduce gives every source that required grad then one (zeros if unused)
                for s, leaf in zip(self._sources, gen[0]):
                    if s.grad is None and leaf.requires_grad:
                        s.grad = torch.zeros_like(s)
        for rep in (rep for gen in generations for rep in gen):
            for leaf in rep:
                leaf.grad = None

    def _generations(self) -> list[list[list[torch.Tensor]]]:
        return self._retired + ([] if self._leaves is None else [self._leaves])

    def end(self) -> Callable[[], int]:
        """End the cycle (the next micro-step makes fresh leaves) and return its fold: every
        generation's gradients (none if ``zero_grad`` dropped them) added into the sources'
        ``.grad``, to be called once every set of the wrapper has ended its cycle (a fold
        changes the grad marks another set's ``end`` compares). While the last micro-step's
        backward has yet to run (its forward inside ``no_sync()``, its backward after a forward
        outside), what it adds to the leaves is folded again when that backward ends."""
        generations = self._generations()
        self._leaves, self._retired, self._probe_nodes = None, [], []
        if not generations or grad_marks(self._sources) != self._marks:
            return _nothing
        pending = [(self._sources, leaves) for leaves in generations]
        step = functools.partial(fold, pending, self._stats)  # not self: no cycle
        if self._probe.value:
            self._probe.then = step
        return step


def _nothing() -> int:
    return 0


def grad_marks(sources: list[torch.Tensor]) -> tuple:
    """What ``zero_grad`` changes: each source's ``.grad`` identity and version."""
    return tuple(None if s.grad is None else (id(s.grad), s.grad._version) for s in sources)


def make_leaves(
    tensors: list[list[torch.Tensor]], sources: list[torch.Tensor]
) -> list[list[torch.Tensor]]:
    """Per replica, leaves on the persistent tensors' storage (requires_grad as the sources)."""
    with torch.inference_mode(False), torch.no_grad():
        return [
            [t.detach().requires_grad_(s.requires_grad) for t, s in zip(rep, sources)]
            for rep in tensors
        ]


def fold(
    pending: list[tuple[list[torch.Tensor], list[list[torch.Tensor]]]],
    stats: dict[str, int] | None = None,
) -> int:
    """Add every replica's leaf gradients into their sources' ``.grad`` (plain accumulation's
    in-place add) through ``reduce_add``; returns how many sources
    received gradients. A source that required grad when its leaves were made (at its
    micro-steps' reduce) and that no replica computed a gradient for gets zeros where its
    ``.grad`` is None (DataParallel's reduce gives every such source one, whatever
    ``requires_grad`` says since).
    The leaves' ``.grad`` are taken (None after): a graph still to run its backward adds anew."""
    received = 0
    for sources, leaves in pending:
        hit = [k for k in range(len(sources)) if any(rep[k].grad is not None for rep in leaves)]
        per_replica = [
            [rep[k].grad if rep[k].grad is not None else torch.zeros_like(rep[k]) for k in hit]
            for rep in leaves
            if any(rep[k].grad is not None for k in hit)
        ]
        if not hit:
            continue
        for k in set(range(len(sources))) - set(hit):
            s = sources[k]
            if s.grad is None and leaves[0][k].requires_grad:
                s.grad = torch.zeros_like(s)
        with torch.no_grad():
            # the reducer's one sum, looked up at the call; never a leaf's .grad
            totals = _reducer.reduce_add(per_replica, sources[0].device, stats=stats)
            for k, total in zip(hit, totals):
                s = sources[k]
                if s.grad is None:
                    s.grad = total
                elif s.grad.is_sparse and not total.is_sparse:
                    s.grad = total.add_(s.grad)  # AccumulateGrad's out-of-place dense sum
                else:
                    s.grad += total
        for rep in leaves:
            for k in hit:
                rep[k].grad = None
        received += len(hit)
    return received
