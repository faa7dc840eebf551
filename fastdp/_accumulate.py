"""``no_sync()``: gradient accumulation that keeps gradients on the replicas between reductions.

NOTE [ no_sync ]
A step's backward normally runs the bucket nodes' backward (NOTE [ Early reduction ]): every
replica's gradient is reduced onto the originals' device and summed into ``.grad``. With
gradient accumulation that is one cross-device reduce of all parameters per micro-step. Under
``FastDataParallel.no_sync()`` (DDP's API; decided at forward time, as in DDP) a step's replicas
run on *leaves*: ``detach()`` views of the persistent replica tensors (same storage, no refresh
node), made once per accumulation cycle, whose ``.grad`` accumulate on the replica's own device.
Nothing is reduced and the originals' ``.grad`` are not touched.

The first grad-enabled forward outside ``no_sync()`` folds the pending gradients into the
originals: per parameter, the replicas' sums land on the originals' device in one addition (a
parameter no replica used stays as it was), and that step's own backward reduces as usual. So
after the first backward outside, ``.grad`` equals plain accumulation; ``M`` micro-steps cost two
reductions (the fold and the last step's) instead of ``M``.

Safety:
* Pending gradients are never overwritten: inside ``no_sync()`` the replica tensors are copied
  from the originals only on a cycle's first micro-step (nothing changes the originals between
  micro-steps; copying would also bump the version of tensors a pending graph saved), and never
  replaced (``_renew``) while leaves are in use.
* A model change inside ``no_sync()`` rebuilds the replica set; the old set stays registered
  with the wrapper until the fold, so its gradients are not lost (they go to the parameters they
  were computed for, as plain accumulation would).
* ``model.zero_grad()`` between micro-steps drops the pending gradients, as it drops DDP's. An
  optimizer's ``zero_grad()`` is seen where it changes the originals' ``.grad`` (identity and
  version, marked when a cycle starts and compared at every later micro-step and at the fold);
  one that finds them None already (``set_to_none`` after a step) leaves no trace, so the
  pending gradients stay: call the model's ``zero_grad()`` to drop them mid-cycle.
* ``persistent=False``, one device or no devices: the module's gradients go straight into the
  originals every step (correct accumulation, nothing saved).
"""

from __future__ import annotations

import torch

from fastdp import _watch
from fastdp._compiled import mark_static
from fastdp.reducer import reduce_add


def grad_marks(sources: list[torch.Tensor]) -> tuple:
    """What ``zero_grad`` changes: each source's ``.grad`` identity and version."""
    return tuple(None if s.grad is None else (id(s.grad), s.grad._version) for s in sources)


def make_leaves(tensors: list[list[torch.Tensor]], sources: list[torch.Tensor]
                ) -> list[list[torch.Tensor]]:
    """Per replica, leaves on the persistent tensors' storage (requires_grad as the sources)."""
    with torch.inference_mode(False), torch.no_grad():
        return [[t.detach().requires_grad_(s.requires_grad) for t, s in zip(row, sources)]
                for row in tensors]


def fold(pending: list[tuple[list[torch.Tensor], list[list[torch.Tensor]]]],
         stats: dict[str, int] | None = None) -> int:
    """Add every replica's leaf gradients into their sources' ``.grad`` (plain accumulation's
    in-place add) through the one reducer (NOTE [ One reducer ]); returns how many sources
    received gradients. A source no replica computed a gradient for stays as it was."""
    received = 0
    for sources, leaves in pending:
        hit = [k for k in range(len(sources)) if any(row[k].grad is not None for row in leaves)]
        rows = [[row[k].grad if row[k].grad is not None else torch.zeros_like(row[k])
                 for k in hit] for row in leaves if any(row[k].grad is not None for k in hit)]
        if not hit:
            continue
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
        if first:
            if self._graph_alive() and (self.copy_rows or not self.linked):
                self._renew()
            self.pending.value = False
            self.leaves = make_leaves(self.tensors, self.sources)
            if self.in_order:
                mark_static(self.leaves)
            self.marks = grad_marks(self.sources)
        elif grad_marks(self.sources) != self.marks:  # zero_grad() since: drop what was pending
            self.drop_pending()
            self.marks = grad_marks(self.sources)
        if not self.leaf_mode:
            self._assign(self.leaves)
        if _watch.has_dirty():
            _watch.restore_dirty()
        self._copy_buffers()
        if first:  # later micro-steps: the originals did not change; pending graphs saved these
            with torch.no_grad():
                self.copy_sources()
        return self.replicas

    def drop_pending(self) -> None:
        for row in self.leaves or ():
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
