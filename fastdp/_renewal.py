"""What a replica set renews before a step: ``renewal``, a pure function of the set's observable
state, the one place the rule is written (NOTE [ Tensors a forward changed ] and NOTE [ Persistent
replicas ] in ``fastdp/_replica_set.py``, NOTE [ no_sync ] in ``fastdp/_no_sync.py``).
"""

from __future__ import annotations

import enum


class Renew(enum.IntEnum):
    """What the set makes afresh; each value includes the ones below it."""

    NOTHING = 0
    BUFFERS = 1  # the buffer copies of replicas 1.. (the old ones stay with a live graph)
    TENSORS = 2  # and the replica tensors, with their nodes where linked once
    ALL = 3  # and, while a no_sync cycle holds leaves, a new generation of them


# A live graph (a linked step's, or a micro-step's whose backward has yet to run) may still need
# the old values: the set renews rather than overwrite them. Without the extension no node can
# tell (``linked`` False), and a graph no node tracks (``untracked``) may have saved anything.
# Copy replicas are refilled every step, so a live graph forces their tensors afresh; replicas
# that alias the originals are renewed only where the nodes cannot serve again. A micro-step
# runs on the cycle's leaves: mid-cycle (a step outside included: a no_grad forward), fresh copy
# tensors get fresh leaves (the old keep what that graph owes them), and tensors aliasing the
# originals are left as they are.
def renewal(
    *,
    tainted: bool,
    graph_alive: bool,
    awaits_backward: bool,
    untracked: bool,
    linked: bool,
    copy_replicas: bool,
    micro_step: bool,
    first_micro_step: bool,
) -> Renew:
    """What to renew before this step.

    ``tainted``: a forward replaced the storage of, or hooked, a tensor the replicas hold.
    ``graph_alive``: the last linked step's graph may still need the tensors
    (``Reducer.graph_alive``); ``awaits_backward``: a micro-step's backward has yet to run
    (``NoSyncCycle.awaits_backward``). ``untracked``: the last forward may have made a graph no
    node tracks. ``linked``: the extension's nodes, made once per tensor set. ``copy_replicas``:
    some replicas have tensors of their own. ``micro_step``: this step runs on ``no_sync``
    leaves; ``first_micro_step``: it starts the cycle (no leaves yet)."""
    if tainted:  # NOTE [ Tensors a forward changed ]
        return Renew.ALL
    alive = graph_alive or awaits_backward
    if micro_step:
        if not alive:
            return Renew.NOTHING
        if first_micro_step:
            return Renew.TENSORS if copy_replicas or not linked else Renew.BUFFERS
        return Renew.ALL if copy_replicas else Renew.BUFFERS
    if not (alive or untracked):
        return Renew.NOTHING
    if copy_replicas:  # and a cycle's leaves: the next micro-step refills the new tensors
        return Renew.ALL
    if not linked or untracked:
        return Renew.TENSORS
    return Renew.BUFFERS
