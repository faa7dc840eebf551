"""fastdp.comm's per-call choice for the coalesced ops: extension and torch path agree bit for bit.

Also which cases the extension declines (``coalesced_supported``) and that they still work.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from _comm_ext_utils import CPU, DTYPES, _mixed, _rand, _same_bits, ext_op, requires_ext

from fastdp import _backend, comm

pytestmark = requires_ext("broadcast_coalesced", "reduce_add_coalesced", "coalesced_supported")
supported = ext_op("coalesced_supported")


def _both(fn):
    """fn() with the extension allowed, then forbidden."""
    with _backend.use_extension(True):
        a = fn()
    with _backend.use_extension(False):
        b = fn()
    return a, b


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_seam_broadcast_ext_equals_torch_path(n):
    ts = _mixed()
    ext, ref = _both(lambda: comm.broadcast_coalesced(ts, ["cpu"] * n, 256))
    assert all(a is b for a, b in zip(ext[0], ts))
    for ea, ra in zip(ext[1:], ref[1:]):
        assert all(_same_bits(x, y) for x, y in zip(ea, ra))


@pytest.mark.parametrize("dtype,n", list(itertools.product(DTYPES + [torch.int32], [2, 3, 5])))
def test_seam_reduce_ext_equals_torch_path(dtype, n):
    lists = [[_rand(s, dtype) for s in [(6, 7), (13,), (), (0, 3)]] for _ in range(n)]
    ext, ref = _both(lambda: comm.reduce_add_coalesced(lists, "cpu", 64))
    assert all(_same_bits(x, y) for x, y in zip(ext, ref))


def test_seam_broadcast_into_refreshes_persistent_copies():
    ts = _mixed()
    with _backend.use_extension(True):
        replicas = comm.broadcast_coalesced(ts, ["cpu"] * 4)
        new = [_rand(t.shape, t.dtype) for t in ts]
        comm.broadcast_into(new, replicas[1:])
    for copies in replicas[1:]:
        assert all(_same_bits(c, t) for c, t in zip(copies, new))


def test_seam_sparse_reduce_takes_torch_path():
    lists = [[torch.randn(4, 4).to_sparse(), torch.randn(3)] for _ in range(3)]
    assert not supported(lists[0], True)
    out = comm.reduce_add_coalesced(lists, "cpu")
    torch.testing.assert_close(out[0].to_dense(), sum(lst[0].to_dense() for lst in lists))
    torch.testing.assert_close(out[1], lists[0][1] + lists[1][1] + lists[2][1])


def test_seam_destination_outside_inputs_takes_torch_path():
    if not torch.cuda.is_available():
        pytest.skip("needs a second device kind to hold the destination")
    lists = [[torch.randn(3)] for _ in range(2)]
    out = comm.reduce_add_coalesced(lists, torch.device("cuda", 0))
    assert out[0].device.type == "cuda"


@pytest.mark.parametrize(
    "dtype,reduce,ok",
    [
        (torch.float32, True, True),
        (torch.int16, True, True),
        (torch.bool, True, True),
        (torch.complex128, True, True),
        (torch.float8_e4m3fn, True, False),
        (torch.float8_e4m3fn, False, True),
        (torch.uint16, True, False),
        (torch.uint16, False, True),
        (torch.complex32, False, True),
        (torch.complex32, True, False),
    ],
)
def test_coalesced_supported_dtypes(dtype, reduce, ok):
    assert supported([torch.zeros(2, dtype=dtype), torch.zeros(1)], reduce) is ok


def test_coalesced_supported_rejects_sparse_and_accepts_empty():
    assert not supported([torch.zeros(2), torch.zeros(2, 2).to_sparse()], False)
    assert supported([], True)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint16, torch.complex32])
def test_broadcast_exotic_dtypes_bit_exact(dtype):
    bcast = ext_op("broadcast_coalesced")
    t = torch.arange(12, dtype=torch.uint8).view(dtype)  # arbitrary bit patterns
    copies = bcast([t, t[1:]], [CPU] * 3, 1 << 20)
    for c in copies[1:]:
        assert torch.equal(c[0].view(torch.uint8), t.view(torch.uint8))
        assert torch.equal(c[1].view(torch.uint8), t[1:].contiguous().view(torch.uint8))
