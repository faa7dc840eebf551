"""DataParallel's ``replicate``, on the CPU or an accelerator (fresh replicas on every call).

Same algorithm and guarantees as ``torch.nn.parallel.replicate``: replica 0's parameters share
storage with the originals and its buffers *are* the original buffer objects (BatchNorm running
stats update the original); other replicas get copies with their own version counters; gradients
of every replica flow back to the originals through ``Broadcast``'s backward (a coalesced reduce).
Two fixes: replicas expose their parameters through ``parameters()`` (DataParallel's yield
nothing), so ``next(self.parameters())`` works inside a replica's forward; a method bound to a
module in its ``__dict__`` is bound to the replica (``_rebind_methods``).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MethodType
from typing import Any, TypeVar

import torch
from torch.nn import Module
from torch.nn.parallel.replicate import _replicatable_module
from torch.nn.parameter import UninitializedParameter

from fastdp import comm
from fastdp._compiled import budget_for, finish_replica, is_compiled, replicate_module
from fastdp._devices import as_device
from fastdp._functions import Broadcast

__all__ = ["check_replicatable", "clone_tree", "finish_tree", "replicate"]

T = TypeVar("T", bound=Module)

# nn.DataParallel fails here with ValueError("Attempted to use an uninitialized parameter...");
# keep that type and text and add torch's own explanation from nn/modules/lazy.py.
_LAZY_MESSAGE = (
    "Attempted to use an uninitialized parameter in replicate. Modules with uninitialized "
    "parameters can't be used with `DataParallel`. Run a dummy forward pass to correctly "
    "initialize the modules"
)


def check_replicatable(network: Module, params: list[torch.Tensor]) -> None:
    """DataParallel's errors for a network it cannot replicate (ScriptModule parents, lazy)."""
    if not _replicatable_module(network):
        raise RuntimeError(
            "Cannot replicate network where python modules are children of ScriptModule"
        )
    if any(isinstance(p, UninitializedParameter) for p in params):
        raise ValueError(_LAZY_MESSAGE)


def clone_tree(modules: list[Module], num: int) -> list[list[Module]]:
    """``num`` replicas of the tree whose ``modules()`` are ``modules``, children wired inside each
    replica; parameters and buffers are the caller's to set. The one replica builder of
    ``replicate`` and ``ReplicaSet``."""
    index = {m: i for i, m in enumerate(modules)}
    # NOTE [ Compiled replicas ] in fastdp/_compiled.py: what replicate_module copies
    replicas = [[replicate_module(m) for m in modules] for _ in range(num)]
    for i, m in enumerate(modules):
        for key, child in m._modules.items():
            for rep in replicas:
                if child is None:
                    rep[i]._modules[key] = None
                else:
                    setattr(rep[i], key, rep[index[child]])
    return replicas


def point_parameter(replica: Module, key: str, t: torch.Tensor) -> None:
    """A replica's parameter slot ``key`` at ``t``, as DataParallel's ``setattr``: a plain
    attribute (replicas' parameters are not leaves), plus an entry in ``_parameters`` so that
    ``parameters()`` sees it. The one slot write of ``replicate`` and ``ReplicaSet``."""
    replica.__dict__[key] = t
    replica._parameters[key] = t
    replica._former_parameters[key] = t


def _rebind_methods(modules: list[Module], replicas: list[list[Module]]) -> None:
    """Methods bound to a module of the tree in its ``__dict__`` (``model.forward = MethodType(f,
    model)``: accelerate's convert_outputs_to_fp32, PEFT, TRL) bound to the replica instead: a
    replica's dict is a copy, and DataParallel's replica k computes with the original's weights
    (on distinct devices, a device mismatch). Called before a replica set saves its dicts, so the
    rebound method is part of the replica as built."""
    index = None
    for i, m in enumerate(modules):
        if MethodType not in map(type, m.__dict__.values()):  # the common case, scanned in C
            continue
        for key, value in m.__dict__.items():
            if type(value) is not MethodType:
                continue
            if index is None:
                index = {id(mod): k for k, mod in enumerate(modules)}
            k = index.get(id(value.__self__))
            if k is not None:
                for rep in replicas:
                    rep[i].__dict__[key] = MethodType(value.__func__, rep[k])


def finish_tree(modules: list[Module], replicas: list[list[Module]], compiled: bool) -> None:
    """After the tensors are set: methods bound in a module's dict bound to its replica
    (``_rebind_methods``), each replica finished from its module; with ``compiled`` code the
    compile budget scaled to the replicas (``_compiled.budget_for``)."""
    _rebind_methods(modules, replicas)
    for rep in replicas:
        for m, r in zip(modules, rep):
            finish_replica(m, r)
    if compiled or any(is_compiled(m) for m in modules):
        budget_for(len(replicas))


def _broadcast(tensors: list[torch.Tensor], devices: list[torch.device], detach: bool):
    if not tensors:
        return [[] for _ in devices]
    if detach:
        return comm.broadcast_coalesced(tensors, devices)
    copies = Broadcast.apply(devices, *tensors)
    n = len(tensors)
    return [list(copies[i : i + n]) for i in range(0, len(copies), n)]


def replicate(network: T, devices: Sequence[Any], detach: bool = False) -> list[T]:
    """Replicas of ``network``, one per device; see the module docstring for the guarantees."""
    if not devices:
        check_replicatable(network, [])
        return []
    params = list(network.parameters())
    check_replicatable(network, params)
    devices = [as_device(d) for d in devices]
    param_indices = {p: i for i, p in enumerate(params)}
    param_copies = _broadcast(params, devices, detach)

    buffers = list(network.buffers())
    rg = [b for b in buffers if b.requires_grad and not detach]
    not_rg = [b for b in buffers if not (b.requires_grad and not detach)]
    rg_idx = {b: i for i, b in enumerate(rg)}
    not_rg_idx = {b: i for i, b in enumerate(not_rg)}
    rg_copies = _broadcast(rg, devices, detach)
    not_rg_copies = _broadcast(not_rg, devices, True)

    modules = list(network.modules())
    replicas = clone_tree(modules, len(devices))
    for i, module in enumerate(modules):
        for key, param in module._parameters.items():
            for j, rep in enumerate(replicas):
                replica = rep[i]
                if param is None:
                    replica._parameters[key] = None
                    continue
                point_parameter(replica, key, param_copies[j][param_indices[param]])
        for key, buf in module._buffers.items():
            for j, rep in enumerate(replicas):
                if buf is None:
                    rep[i]._buffers[key] = None
                elif buf.requires_grad and not detach:
                    setattr(rep[i], key, rg_copies[j][rg_idx[buf]])
                else:
                    setattr(rep[i], key, not_rg_copies[j][not_rg_idx[buf]])
    finish_tree(modules, replicas, compiled=False)
    return [rep[0] for rep in replicas]
