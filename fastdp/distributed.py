"""Outgrowing one process: ``wrap`` picks FastDataParallel or DDP, ``shard_batch`` splits batches.

One script runs both ways::

    model = fastdp.wrap(net, device_ids=[0, 1])        # python train.py  -> FastDataParallel
    for x, y in loader:                                 # torchrun ...     -> DDP, one GPU a rank
        x, y = fastdp.shard_batch((x, y))               # this rank's rows of the global batch
        loss = F.cross_entropy(model(x), y.to(...))

Under ``torchrun`` (``WORLD_SIZE > 1``) every rank gets exactly the rows FastDataParallel's replica
of the same index would get (``torch.chunk`` sizes), and DDP averages the ranks' gradients, so with
a mean loss and a global batch divisible by the world size the effective batch and the loss
trajectory are those of the single-process run.
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from fastdp import _tree
from fastdp._devices import as_device
from fastdp._planner import batch_size, chunk_sizes_for
from fastdp.data_parallel import FastDataParallel

__all__ = ["wrap", "shard_batch"]

_FDP_KWARGS = frozenset(
    {"device_ids", "output_device", "dim", "chunk_sizes", "balance", "gather_output"}
)
_DDP_KWARGS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters) - {
    "self",
    "module",
}
_warned_uneven = False


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _cpu_requested(kwargs: dict[str, Any]) -> bool:
    ids = kwargs.get("device_ids")
    return bool(ids) and all(as_device(d).type == "cpu" for d in ids)


def wrap(model: Module, **kwargs: Any) -> Module:
    """FastDataParallel in one process; DistributedDataParallel under ``torchrun``.

    With ``WORLD_SIZE`` unset or 1: ``FastDataParallel(model, **kwargs)``; DDP-only keywords
    (``find_unused_parameters``, ...) are ignored. With ``WORLD_SIZE > 1``: initialises the default
    process group if needed (NCCL when CUDA is available, gloo on the CPU or when ``device_ids``
    names CPUs), moves ``model`` to ``cuda:LOCAL_RANK`` (a CPU run leaves it where it is) and
    returns ``DistributedDataParallel(model, ...)`` with the DDP keywords; ``device_ids`` and
    ``output_device`` are replaced by the local rank, FastDataParallel-only keywords
    (``chunk_sizes``, ``balance``, ``gather_output``) are ignored (``ParallelCriterion`` accepts
    DDP's plain outputs).

    Raises:
        TypeError: a keyword neither FastDataParallel nor DDP takes.
    """
    unknown = sorted(set(kwargs) - _FDP_KWARGS - _DDP_KWARGS)
    if unknown:
        raise TypeError(
            f"fastdp.wrap: unexpected keyword argument(s) {unknown}; it takes "
            f"FastDataParallel's {sorted(_FDP_KWARGS)} and DDP's keywords"
        )
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return FastDataParallel(model, **{k: v for k, v in kwargs.items() if k in _FDP_KWARGS})
    cpu = _cpu_requested(kwargs) or not torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not cpu:
        torch.cuda.set_device(local_rank)  # before NCCL initialises on this rank
    if not dist.is_initialized():
        dist.init_process_group("gloo" if cpu else "nccl")
    ddp_kwargs = {
        k: v
        for k, v in kwargs.items()
        if k in _DDP_KWARGS and k not in ("device_ids", "output_device")
    }
    if cpu:
        return DistributedDataParallel(model, **ddp_kwargs)
    model.to(torch.device("cuda", local_rank))
    return DistributedDataParallel(
        model, device_ids=[local_rank], output_device=local_rank, **ddp_kwargs
    )


def _shard(obj: Any, rank: int, world: int, dim: int, device: torch.device | None) -> Any:
    def part(t: torch.Tensor) -> torch.Tensor:
        sizes = chunk_sizes_for(t.size(dim), world)
        p = t.narrow(dim, sum(sizes[:rank]), sizes[rank] if rank < len(sizes) else 0)
        return p if device is None else p.to(device)

    return _tree.map_tensors(obj, part)


def _warn_uneven(obj: Any, world: int, dim: int) -> None:
    global _warned_uneven
    if _warned_uneven:
        return
    rows = batch_size(obj, dim)
    if rows is not None and rows % world:
        _warned_uneven = True
        warnings.warn(
            f"fastdp.shard_batch: a batch of {rows} does not split evenly over {world} "
            "ranks; DDP averages the ranks' gradients with equal weights, so a mean loss no "
            "longer equals the whole-batch mean (use a divisible batch or drop_last=True)",
            stacklevel=3,
        )


def shard_batch(batch: Any, dim: int = 0, *, device: Any = "auto") -> Any:
    """This process's share of a global batch (the batch itself outside ``torchrun``).

    Every tensor of the (nested) batch is split along ``dim`` with ``torch.chunk`` sizes over the
    world and rank ``r`` gets chunk ``r`` (FastDataParallel's replica ``r`` gets the same rows);
    non-tensors are passed through. Every rank must be given the same global batch (same seed
    or sampler order), e.g. a ``DataLoader`` of ``world_size *`` per-rank batch size.

    Args:
        batch: a tensor or a nested tuple / list / dict / namedtuple of tensors.
        dim: the batch dimension.
        device: where to put the shard; ``"auto"``: the current CUDA device under a NCCL
            process group, else unchanged; None: unchanged.
    """
    world = _world_size()
    if world <= 1:
        return batch
    if device == "auto":
        nccl = dist.is_initialized() and dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
    elif device is not None:
        device = as_device(device)
    _warn_uneven(batch, world, dim)
    return _shard(batch, _rank(), world, dim, device)
