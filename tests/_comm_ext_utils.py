"""Shared helpers of the fastdp._C coalesced comm tests (test_comm_ext*.py)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.testing import make_tensor

from fastdp import _backend
from fastdp.testing import DTYPES

_C = _backend._ext
CPU = torch.device("cpu")
NUM_DEVICES = [1, 2, 3, 8]


def ext_op(name: str):
    """fastdp._C.<name>, or None when the extension is missing or lacks it."""
    return getattr(_C, name, None) if _C is not None else None


def requires_ext(*names: str):
    """Skip (not fail) a test module when fastdp._C lacks one of the ops."""
    missing = [n for n in names if ext_op(n) is None]
    return pytest.mark.skipif(
        bool(missing), reason=f"fastdp._C lacks {', '.join(missing)} (not built or too old)"
    )


def _rand(shape, dtype, device=CPU):
    if dtype == torch.bool:
        return torch.rand(shape, device=device) > 0.5
    return make_tensor(shape, dtype=dtype, device=device, low=-8, high=8)


def _mixed(device=CPU, n=12):
    """Tensors of every dtype and awkward shapes: 0-size, 0-dim, one element, larger."""
    shapes = [(3, 4), (0,), (), (1,), (5, 0, 2), (17,), (2, 3, 4)]
    combos = itertools.islice(itertools.cycle(itertools.product(DTYPES, shapes)), n * 3)
    return [_rand(s, dt, device) for dt, s in itertools.islice(combos, 0, None, 3)]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.dtype.is_floating_point or a.dtype.is_complex:
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        view = torch.view_as_real(a.resolve_conj()) if a.is_complex() else a
        other = torch.view_as_real(b.resolve_conj()) if b.is_complex() else b
        width = ints[view.element_size()]
        return torch.equal(view.contiguous().view(width), other.contiguous().view(width))
    return torch.equal(a, b)


def _list_order_sum(lists):
    """fastdp.comm's torch path (torch's reduce_add too, for two lists): x0 + x1, add_ the rest."""
    out = []
    for j in range(len(lists[0])):
        acc = lists[0][j] + lists[1][j]
        for lst in lists[2:]:
            acc.add_(lst[j])
        out.append(acc)
    return out
