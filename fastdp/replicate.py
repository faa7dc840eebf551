"""DataParallel's ``replicate``, on CPU or CUDA devices (fresh replicas on every call).

Same algorithm and guarantees as ``torch.nn.parallel.replicate``: replica 0's parameters share
storage with the originals and its buffers *are* the original buffer objects (BatchNorm running
stats update the original); other replicas get copies with their own version counters; gradients
of every replica flow back to the originals through ``Broadcast``'s backward (a coalesced reduce).
One fix: replicas expose their parameters through ``parameters()`` (DataParallel's yield nothing),
so ``next(self.parameters())`` works inside a replica's forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch.nn import Module
from torch.nn.parallel.replicate import _replicatable_module
from torch.nn.parameter import UninitializedParameter

from fastdp import comm
from fastdp._compiled import budget_for, finish_replica, is_compiled, replicate_module
from fastdp._devices import as_device
from fastdp._functions import Broadcast

__all__ = ["replicate"]

T = TypeVar("T", bound=Module)

# nn.DataParallel fails here with ValueError("Attempted to use an uninitialized parameter...");
# keep that type and text and add torch's own explanation from nn/modules/lazy.py.
_LAZY_MESSAGE = (
    "Attempted to use an uninitialized parameter in replicate. Modules with uninitialized "
    "parameters can't be used with `DataParallel`. Run a dummy forward pass to correctly "
    "initialize the modules"
)


def _broadcast(tensors: list[torch.Tensor], devices: list[torch.device], detach: bool):
    if not tensors:
        return [[] for _ in devices]
    if detach:
        return comm.broadcast_coalesced(tensors, devices)
    copies = Broadcast.apply(devices, *tensors)
    n = len(tensors)
    return [list(copies[i:i + n]) for i in range(0, len(copies), n)]


def replicate(network: T, devices: Sequence[Any], detach: bool = False) -> list[T]:
    """Replicas of ``network``, one per device; see the module docstring for the guarantees."""
    if not _replicatable_module(network):
        raise RuntimeError(
            "Cannot replicate network where python modules are children of ScriptModule"
        )
    if not devices:
        return []
    devices = [as_device(d) for d in devices]
    num = len(devices)

    params = list(network.parameters())
    if any(isinstance(p, UninitializedParameter) for p in params):
        raise ValueError(_LAZY_MESSAGE)
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
    module_indices = {m: i for i, m in enumerate(modules)}
    copies: list[list[Module]] = [[] for _ in devices]
    for module in modules:
        for j in range(num):
            copies[j].append(replicate_module(module))  # NOTE [ Compiled replicas ]

    for i, module in enumerate(modules):
        for key, child in module._modules.items():
            for j in range(num):
                if child is None:
                    copies[j][i]._modules[key] = None
                else:
                    setattr(copies[j][i], key, copies[j][module_indices[child]])
        for key, param in module._parameters.items():
            for j in range(num):
                replica = copies[j][i]
                if param is None:
                    replica._parameters[key] = None
                    continue
                p = param_copies[j][param_indices[param]]
                setattr(replica, key, p)  # non-leaf: a plain attribute, as in DataParallel
                replica._parameters[key] = p  # ...and visible to parameters() (the fix)
                replica._former_parameters[key] = p
        for key, buf in module._buffers.items():
            for j in range(num):
                replica = copies[j][i]
                if buf is None:
                    replica._buffers[key] = None
                elif buf.requires_grad and not detach:
                    setattr(replica, key, rg_copies[j][rg_idx[buf]])
                else:
                    setattr(replica, key, not_rg_copies[j][not_rg_idx[buf]])
    for i, module in enumerate(modules):
        for j in range(num):
            finish_replica(module, copies[j][i])
    if any(is_compiled(m) for m in modules):
        budget_for(num)  # NOTE [ One compile budget per device ]
    return [copies[j][0] for j in range(num)]
