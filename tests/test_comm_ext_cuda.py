"""fastdp._C coalesced broadcast / reduce-add on CUDA: repeated ids (device copies), the single-rank
NCCL communicator and, on machines with two GPUs, grouped NCCL between distinct devices.

All skip with a reason where no GPU (or no second GPU, or no NCCL) is present.
"""

from __future__ import annotations

import pytest
import torch
from _comm_ext_utils import DTYPES, _list_order_sum, _mixed, _rand, _same_bits, ext_op, requires_ext

from fastdp.testing import NUM_GPUS, onlyCUDA, onlyMultiGPU

pytestmark = [
    requires_ext("broadcast_coalesced", "broadcast_coalesced_into", "reduce_add_coalesced"),
    onlyCUDA,
]
bcast = ext_op("broadcast_coalesced")
bcast_into = ext_op("broadcast_coalesced_into")
reduce_add = ext_op("reduce_add_coalesced")
nccl = pytest.mark.skipif(
    ext_op("nccl_available") is None or not ext_op("nccl_available")(),
    reason="fastdp._C was built without NCCL",
)


def _cuda(i=0):
    return torch.device("cuda", i)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_cuda_repeated_ids_broadcast_bit_exact(n):
    ts = _mixed(_cuda())
    result = bcast(ts, [_cuda()] * n, 256)
    assert all(a is b for a, b in zip(result[0], ts))
    for copies in result[1:]:
        assert all(_same_bits(c, t) for c, t in zip(copies, ts))
        assert all(c.data_ptr() != t.data_ptr() for c, t in zip(copies, ts) if t.numel())


def test_cuda_repeated_ids_version_counters_independent():
    ts = [torch.randn(3, 4, device="cuda"), torch.randn(5, device="cuda")]
    result = bcast(ts, [_cuda()] * 3, 1 << 20)
    before = [t._version for t in ts]
    result[1][0].add_(1)
    assert [t._version for t in ts] == before


@pytest.mark.parametrize("n", [2, 3, 8])
def test_cuda_repeated_ids_into_refreshes_in_place(n):
    ts = _mixed(_cuda())
    result = bcast(ts, [_cuda()] * n, 256)
    ptrs = [[c.data_ptr() for c in copies] for copies in result[1:]]
    new = [_rand(t.shape, t.dtype, _cuda()) for t in ts]
    bcast_into(new, result[1:])
    torch.cuda.synchronize()
    for copies in result[1:]:
        assert all(_same_bits(c, t) for c, t in zip(copies, new))
    assert [[c.data_ptr() for c in copies] for copies in result[1:]] == ptrs


@pytest.mark.parametrize("dtype", DTYPES + [torch.int16])
@pytest.mark.parametrize("n", [2, 3, 8])
def test_cuda_repeated_ids_reduce_list_order_bit_exact(dtype, n):
    lists = [[_rand(s, dtype, _cuda()) for s in [(4, 5), (7,), (), (0,)]] for _ in range(n)]
    out = reduce_add(lists, _cuda(), 64)
    assert all(_same_bits(a, b) for a, b in zip(out, _list_order_sum(lists)))


def test_cuda_non_current_stream_orders_results():
    ts = [torch.randn(1 << 20, device="cuda")]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        ts[0].mul_(2)  # produced on the side stream
        result = bcast(ts, [_cuda()] * 2, 1 << 30)
    side.synchronize()
    assert torch.equal(result[1][0], ts[0])


@nccl
def test_nccl_single_rank_communicator():
    info = ext_op("nccl_comm_info")([0])
    assert info == [(0, 0, 1)]
    assert ext_op("nccl_comm_info")([0]) == info  # cached


@nccl
def test_single_device_returns_inputs_without_nccl():
    ts = [torch.randn(3, device="cuda")]
    assert bcast(ts, [_cuda()], 1024)[0][0] is ts[0]


@nccl
@onlyMultiGPU
def test_nccl_two_gpus_broadcast_bit_exact():
    ts = _mixed(_cuda(0))
    devices = [_cuda(i) for i in range(NUM_GPUS)]
    result = bcast(ts, devices, 256)
    for d, copies in enumerate(result[1:], start=1):
        assert all(c.device == devices[d] for c in copies)
        assert all(_same_bits(c.cpu(), t.cpu()) for c, t in zip(copies, ts))
    assert ext_op("nccl_comm_info")(list(range(NUM_GPUS)))[1][2] == NUM_GPUS


@nccl
@onlyMultiGPU
def test_nccl_two_gpus_into_and_reduce():
    devices = [_cuda(i) for i in range(NUM_GPUS)]
    ts = [torch.randn(1000, device="cuda:0"), torch.arange(10, device="cuda:0")]
    result = bcast(ts, devices, 1 << 20)
    new = [t * 3 for t in ts]
    bcast_into(new, result[1:])
    for copies in result[1:]:
        assert all(torch.equal(c.cpu(), t.cpu()) for c, t in zip(copies, new))
    lists = [[t.to(d) for t in new] for d in devices]
    out = reduce_add(lists, devices[-1], 1 << 20)
    ref = _list_order_sum([[t.cpu() for t in lst] for lst in lists])
    torch.testing.assert_close(out[0].cpu(), ref[0])
    assert torch.equal(out[1].cpu(), ref[1])  # integers: exact in any order
