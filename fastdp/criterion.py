"""Loss next to each output shard: ``ParallelCriterion``.

``FastDataParallel(..., gather_output=False)`` returns a :class:`Scattered` (defined with gather in
``fastdp/scatter_gather.py``, re-exported here) instead of gathering;
``ParallelCriterion(loss_fn)(scattered, *targets)`` scatters the targets with the same chunk sizes
onto the replicas' devices, runs ``loss_fn`` on every replica's device in parallel (the threads and
state propagation of ``fastdp.parallel_apply``) and combines the per-replica losses on the output
device. The full output never lands on one device (PyTorch-Encoding's DataParallelCriterion, with
the mean weighted by chunk sizes so it equals the whole-batch loss).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import Module

from fastdp import _tree
from fastdp.parallel_apply import parallel_apply
from fastdp.replicate import replicate
from fastdp.scatter_gather import Scattered, scatter_kwargs

__all__ = ["Scattered", "ParallelCriterion"]

_REDUCTIONS = ("mean", "sum", "batchmean", "none")


def _check_rows(targets: tuple, sizes: list[int] | None, dim: int) -> None:
    """Targets pair with the outputs row for row: a target tensor whose rows differ from the
    outputs' would be chunked on its own (the forward's rule) and mispaired, so it is an error."""
    if sizes is None:
        return
    leaves: list = []
    _tree.flatten(targets, leaves)
    total = sum(sizes)
    for i, t in enumerate(leaves):
        if t.dim() > 0 and t.size(dim) != total:
            raise ValueError(
                f"fastdp.ParallelCriterion: the outputs' chunks sum to {total} rows but target "
                f"tensor {i} has {t.size(dim)} rows along dim {dim}; pass targets for the same "
                "batch the forward saw"
            )


def _to(obj: Any, device: torch.device | None) -> Any:
    return obj if device is None else _tree.map_tensors(obj, lambda t: t.to(device))


class ParallelCriterion(Module):
    """Compute ``loss_fn`` next to each output shard and reduce like the whole-batch loss.

    Args:
        loss_fn: a loss module (``nn.CrossEntropyLoss()``) or function (``F.cross_entropy``),
            called as ``loss_fn(replica_output, *replica_targets, **replica_kwargs)``. Loss modules
            holding tensors (``weight=``) are replicated onto the replicas' devices.
        reduction: how ``loss_fn`` reduces; default ``loss_fn.reduction``, else ``'mean'``.
            ``'mean'`` (and ``'batchmean'``): per-replica losses weighted by chunk size / batch,
            which equals the whole-batch loss when every row weighs the same in the mean
            (not so for ``CrossEntropyLoss(weight=...)``, rejected, or targets hitting
            ``ignore_index`` unevenly). ``'sum'``: summed. ``'none'``: a :class:`Scattered` of the
            per-replica losses (``.gather()`` gives the whole-batch vector).
        dim: the dimension targets are split along (default: the outputs' ``dim``).

    Called with a plain tensor instead of a ``Scattered`` (a gathered forward, DDP), it is
    ``loss_fn`` itself.

    Example::

        model = fastdp.FastDataParallel(net, device_ids=[0, 1], gather_output=False)
        crit = fastdp.ParallelCriterion(nn.CrossEntropyLoss())
        loss = crit(model(x), y)   # 0-dim, on the output device
        loss.backward()
    """

    def __init__(
        self, loss_fn: Callable[..., Any], reduction: str | None = None, dim: int | None = None
    ) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        red = reduction if reduction is not None else getattr(loss_fn, "reduction", "mean")
        if red not in _REDUCTIONS:
            raise ValueError(
                f"fastdp.ParallelCriterion: reduction {red!r} is not supported; use 'mean', "
                "'sum', 'batchmean' (each replica's loss is 0-dim and they are combined weighted "
                "by chunk size, or summed) or 'none' (returns a fastdp.Scattered of per-replica "
                "losses; .gather() concatenates them)"
            )
        if (
            red == "mean"
            and getattr(loss_fn, "weight", None) is not None
            and isinstance(loss_fn, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss))
        ):
            raise ValueError(
                "fastdp.ParallelCriterion: a class-weighted mean (weight=...) is normalised by the "
                "targets' total weight, not by rows, so chunk-size weighting would be wrong; use "
                "reduction='sum' and divide by the total weight yourself"
            )
        self.reduction = red
        self.dim = dim

    def _loss_fns(self, devices: list[torch.device]) -> list[Callable[..., Any]]:
        fn = self.loss_fn
        if not isinstance(fn, Module):
            return [fn] * len(devices)
        tensors = list(fn.parameters()) + list(fn.buffers())
        if not tensors:
            return [fn] * len(devices)
        detach = not torch.is_grad_enabled()
        src = tensors[0].device
        if src == devices[0]:
            return list(replicate(fn, devices, detach))
        return list(replicate(fn, [src, *devices], detach))[1:]

    def forward(self, outputs: Any, *targets: Any, **kwargs: Any) -> Any:
        if not isinstance(outputs, Scattered):
            return self.loss_fn(outputs, *targets, **kwargs)
        n = len(outputs.outputs)
        dim = outputs.dim if self.dim is None else self.dim
        if n == 1:
            dev = outputs.devices[0]
            loss = self.loss_fn(outputs.outputs[0], *_to(targets, dev), **_to(kwargs, dev))
            if self.reduction == "none":
                return Scattered(
                    [loss], outputs.chunk_sizes, outputs.devices, dim, outputs.output_device
                )
            return loss if outputs.output_device is None else loss.to(outputs.output_device)
        devices = outputs.devices
        if targets or kwargs:
            _check_rows(targets, outputs.chunk_sizes, dim)
            tgts, kws = scatter_kwargs(targets, kwargs, devices, dim, outputs.chunk_sizes)
        else:
            tgts, kws = ((),) * n, ({},) * n
        inputs = [(out, *t) for out, t in zip(outputs.outputs, tgts)]
        losses = parallel_apply(self._loss_fns(devices), inputs, kws, devices)
        if self.reduction == "none":
            return Scattered(losses, outputs.chunk_sizes, devices, dim, outputs.output_device)
        return self._combine(losses, outputs)

    def _combine(self, losses: list[Any], outputs: Scattered) -> torch.Tensor:
        for r, loss in enumerate(losses):
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss)
                raise ValueError(
                    f"fastdp.ParallelCriterion: with reduction={self.reduction!r} every replica's "
                    f"loss must be a 0-dim tensor, replica {r} returned {shape}; use "
                    "reduction='none' for per-element losses"
                )
        out = outputs.output_device or outputs.devices[0]
        stacked = torch.stack([loss.to(out) for loss in losses])
        if self.reduction == "sum":
            return stacked.sum()
        sizes = outputs.chunk_sizes or [1] * len(losses)
        total = sum(sizes)
        w = torch.tensor([s / total for s in sizes], dtype=stacked.dtype, device=out)
        return (stacked * w).sum()
