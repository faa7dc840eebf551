"""Autograd Functions of the data-parallel step, on CPU and CUDA devices.

``Scatter`` and ``Gather`` are fused: one Function application covers every leaf of a step, so the
Python work per step does not grow with the number of leaves' chunks. Where every replica shares
one device, ``fastdp.scatter_gather`` uses ``split``/``cat`` instead (see
NOTE [ Same-device scatter and gather ]). ``Broadcast`` and ``ReduceAddCoalesced`` mirror torch's
(each one's backward is the other) through ``fastdp.comm``.
Under ``create_graph=True`` the backward of Scatter and Gather is the other Function, so double
backward works whichever backend (extension kernels carry no autograd history) did the copies.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from itertools import chain

import torch
from torch.autograd import Function

from fastdp import comm

_SCALAR_WARNING = (
    "Was asked to gather along dimension 0, but all input tensors were scalars; "
    "will instead unsqueeze and return a vector."
)


def vector_if_scalars(
    parts: Sequence[torch.Tensor], dim: int
) -> tuple[Sequence[torch.Tensor], bool]:
    """DataParallel's rule for one output leaf: 0-dim parts gathered along dim 0 become a vector
    (each part viewed as size 1), with its warning. Returns the parts and whether they were."""
    if dim == 0 and parts[0].dim() == 0 and all(t.dim() == 0 for t in parts):
        warnings.warn(_SCALAR_WARNING, stacklevel=3)
        return [t.view(1) for t in parts], True
    return parts, False


class Scatter(Function):
    """``Scatter.apply(devices, splits, dims, *leaves)`` -> replica-major chunks.

    Output ``r * len(leaves) + i`` is chunk ``r`` of leaf ``i`` on ``devices[r]``.
    Backward gathers each leaf's chunk gradients back onto the leaf's device.
    """

    @staticmethod
    def forward(ctx, devices, splits, dims, *leaves):
        ctx.dims = dims
        ctx.sources = [t.device for t in leaves]
        ctx.n = len(leaves)
        return tuple(chain.from_iterable(comm.scatter_leaves(leaves, devices, splits, dims)))

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.n
        out = []
        for i in range(n):
            if not ctx.needs_input_grad[3 + i]:
                out.append(None)
                continue
            parts = grads[i::n]
            if torch.is_grad_enabled():  # create_graph=True: stay differentiable
                out.append(Gather.apply(ctx.sources[i], ctx.dims[i], len(parts), *parts)[0])
            else:
                out.append(comm.gather(parts, ctx.dims[i], ctx.sources[i]))
        return (None, None, None, *out)


class Gather(Function):
    """``Gather.apply(target, dim, n_replicas, *flat)`` with ``flat`` leaf-major.

    ``flat[i * n_replicas + r]`` is replica ``r``'s tensor for output leaf ``i``; returns one
    concatenated tensor per leaf on ``target``. All-0-dim leaves gathered along dim 0 become
    vectors, with DataParallel's warning.
    """

    @staticmethod
    def forward(ctx, target, dim, n_replicas, *flat):
        n_leaves = len(flat) // n_replicas
        ctx.dim, ctx.n_replicas = dim, n_replicas
        ctx.devices, ctx.sizes, ctx.scalar = [], [], []
        outs = []
        for i in range(n_leaves):
            parts, scalar = vector_if_scalars(flat[i * n_replicas : (i + 1) * n_replicas], dim)
            ctx.scalar.append(scalar)
            ctx.devices.append([t.device for t in parts])
            ctx.sizes.append([t.size(dim) for t in parts])
            outs.append(comm.gather(parts, dim, target))
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        out = []
        for i, g in enumerate(grads):
            if torch.is_grad_enabled():  # create_graph=True: stay differentiable
                parts = list(Scatter.apply(ctx.devices[i], [ctx.sizes[i]], [ctx.dim], g))
            else:
                chunks = comm.scatter_leaves([g], ctx.devices[i], [ctx.sizes[i]], [ctx.dim])
                parts = [c[0] for c in chunks]
            if ctx.scalar[i]:
                parts = [p[0] for p in parts]
            out.extend(parts)
        return (None, None, None, *out)


class Broadcast(Function):
    """``Broadcast.apply(devices, *inputs)`` -> device-major copies (device 0's alias inputs)."""

    @staticmethod
    def forward(ctx, devices, *inputs):
        ctx.devices = devices
        if not inputs:
            return ()
        ctx.num_inputs = len(inputs)
        ctx.input_device = inputs[0].device
        outputs = comm.broadcast_coalesced(inputs, devices)
        non_diff = []
        for idx, needs in enumerate(ctx.needs_input_grad[1:]):
            if not needs:
                non_diff.extend(out[idx] for out in outputs)
        ctx.mark_non_differentiable(*non_diff)
        return tuple(chain.from_iterable(outputs))

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (None, *ReduceAddCoalesced.apply(ctx.input_device, ctx.num_inputs, *grad_outputs))


class ReduceAddCoalesced(Function):
    """``ReduceAddCoalesced.apply(destination, num_inputs, *grads)`` with ``grads`` device-major."""

    @staticmethod
    def forward(ctx, destination, num_inputs, *grads):
        ctx.devices = [grads[i].device for i in range(0, len(grads), num_inputs)]
        groups = [grads[i : i + num_inputs] for i in range(0, len(grads), num_inputs)]
        return tuple(comm.reduce_add_coalesced(groups, destination))

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (None, None, *Broadcast.apply(ctx.devices, *grad_outputs))
