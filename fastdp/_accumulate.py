"""``no_sync()``: gradient accumulation that keeps gradients on the replicas between reductions.

NOTE [ no_sync ]
Under ``FastDataParallel.no_sync()`` (DDP's API, decided at forward time) replicas run on leaves:
``detach()`` views of the persistent replica tensors, made once per accumulation cycle, whose
``.grad`` accumulate on each replica's device; nothing is reduced and the originals' ``.grad``
are untouched, so ``M`` micro-steps cost two reductions (a fold and the last step's), not ``M``.
The next grad-enabled forward outside ``no_sync()`` folds them into the originals' ``.grad``
(``fold``), which then equal plain accumulation. Pending gradients are never overwritten: copy
rows are copied on a cycle's first micro-step and again only when the originals changed in place
since (version counters), onto fresh tensors whose leaves take over the pending gradients; a set
rebuilt mid-cycle stays registered until the fold. A ``zero_grad()`` that changes the originals'
``.grad`` drops them. Parameters with hooks (``register_hook``, post-accumulate hooks) must see
every micro-step's gradient, so such a set reduces each micro-step as outside ``no_sync()``.
"""

from __future__ import annotations

import operator

import torch

from fastdp._compiled import mark_static
from fastdp._reducer import reduce_add

_VERSION = operator.attrgetter("_version")
_HOOKS = operator.attrgetter("_backward_hooks")
_POST_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")


def has_grad_hooks(sources: list[torch.Tensor]) -> bool:
    """Whether a source's gradient goes through a hook (tensor or post-accumulate)."""
    return any(map(_HOOKS, sources)) or any(map(_POST_HOOKS, sources))


def grad_marks(sources: list[torch.Tensor]) -> tuple:
    """What ``zero_grad`` changes: each source's ``.grad`` identity and version."""
    return tuple(None if s.grad is None else (id(s.grad), s.grad._version) for s in sources)


def make_leaves(
    tensors: list[list[torch.Tensor]], sources: list[torch.Tensor]
) -> list[list[torch.Tensor]]:
    """Per replica, leaves on the persistent tensors' storage (requires_grad as the sources)."""
    with torch.inference_mode(False), torch.no_grad():
        return [
            [t.detach().requires_grad_(s.requires_grad) for t, s in zip(row, sources)]
            for row in tensors
        ]


def fold(
    pending: list[tuple[list[torch.Tensor], list[list[torch.Tensor]]]],
    stats: dict[str, int] | None = None,
) -> int:
    """Add every replica's leaf gradients into their sources' ``.grad`` (plain accumulation's
    in-place add) through the one reducer (NOTE [ One reducer ]); returns how many sources
    received gradients. A source that requires grad and that no replica computed a gradient
    for gets zeros where its ``.grad`` is None (DataParallel's reduce gives every source one)."""
    received = 0
    for sources, leaves in pending:
        hit = [k for k in range(len(sources)) if any(row[k].grad is not None for row in leaves)]
        rows = [
            [row[k].grad if row[k].grad is not None else torch.zeros_like(row[k]) for k in hit]
            for row in leaves
            if any(row[k].grad is not None for k in hit)
        ]
        if not hit:
            continue
        for k in set(range(len(sources))) - set(hit):
            s = sources[k]
            if s.grad is None and s.requires_grad:
                s.grad = torch.zeros_like(s)
        with torch.no_grad():
            totals = reduce_add(rows, sources[0].device, stats=stats)  # never a leaf's .grad
            for k, total in zip(hit, totals):
                s = sources[k]
                if s.grad is None:
                    s.grad = total
                else:
                    s.grad += total
        received += len(hit)
    return received


class LeafAccumulation:
    """``ReplicaSet``'s side of NOTE [ no_sync ] (a mixin: it uses the set's tensors, copies
    and ``_assign``)."""

    def _refresh_no_sync(self) -> list:
        """A micro-step under ``no_sync``: replicas on leaves, nothing linked or reduced."""
        first = self.leaves is None
        versions = list(map(_VERSION, self.sources)) if self.copy_rows else None
        if first:
            if self._graph_alive() and (self.copy_rows or not self.linked):
                self._renew()
            self.pending.value = False
            self.leaves = make_leaves(self.tensors, self.sources)
            if self.in_order:
                mark_static(self.leaves)
            self.marks = grad_marks(self.sources)
        else:
            if grad_marks(self.sources) != self.marks:  # zero_grad() since: drop the pending
                self.drop_pending()
                self.marks = grad_marks(self.sources)
            if versions != self.copied:  # pending graphs may still need the old copies
                self._renew_all()
        if not self.leaf_mode:
            self._assign(self.leaves)
        self._copy_buffers()
        if first or versions != self.copied:
            with torch.no_grad():
                self.copy_sources()
            self.copied = versions
        self.seal()
        return self.replicas

    def drop_pending(self, zeros: bool = False) -> None:
        """Forget the pending gradients; ``zeros``: ``zero_grad(set_to_none=False)``, which
        leaves zeros where plain accumulation would have had a gradient."""
        rows = self.leaves or ()
        if zeros and any(leaf.grad is not None for row in rows for leaf in row):
            for s in self.sources:  # a reduce gives every source a gradient (zeros if unused)
                if s.grad is None and s.requires_grad:
                    s.grad = torch.zeros_like(s)
        for row in rows:
            for leaf in row:
                leaf.grad = None

    def take_pending(self) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]] | None:
        """The leaves with their gradients (None if ``zero_grad`` dropped them), ending the
        cycle: the next ``no_sync`` micro-step makes fresh leaves."""
        leaves, self.leaves = self.leaves, None
        if self.leaf_mode:
            self._assign()
        if leaves is None or grad_marks(self.sources) != self.marks:
            return None
        return self.sources, leaves
