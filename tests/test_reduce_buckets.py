"""The replication engine's buckets (fastdp/_buckets.py): which tensors share one, the calls and
bytes a step costs, and fastdp.comm's coalesced collectives on the engine.

Distinct-device behaviour runs on CPU replicas with ``FASTDP_CPU_DISTINCT=1`` (the ``distinct``
fixture of tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from models import linear_stack

from fastdp import FastDataParallel, _buckets, comm
from fastdp.testing import DTYPES

# ---- bucket assignment -----------------------------------------------------------------------


def test_buckets_fill_in_reverse_order_per_dtype_with_a_small_first_bucket():
    mb = 2**20
    ts = [torch.empty(mb // 4) for _ in range(6)] + [torch.empty(8, dtype=torch.float64)]
    buckets = _buckets.assign_buckets(ts, 2.5 * mb)
    assert buckets[0] == [5]  # 1 MiB first bucket: the last float tensor alone
    assert buckets[1] == [4, 3, 2]  # then up to the cap (closed once it reaches 2.5 MiB)
    assert sorted(buckets[2:]) == [[1, 0], [6]]  # float64 never shares a flat with float32
    assert sorted(i for b in buckets for i in b) == list(range(7))


def test_sparse_tensors_get_buckets_of_their_own():
    ts = [torch.ones(3), torch.eye(3).to_sparse(), torch.ones(2)]
    buckets = _buckets.assign_buckets(ts, 2**20)
    assert [1] in buckets and sorted(i for b in buckets for i in b) == [0, 1, 2]


@pytest.mark.parametrize("layers,most", [(10, 1), (100, 1), (1000, 3)])
def test_calls_per_step_follow_bytes_not_tensors(distinct, layers, most):
    model = linear_stack(layers)
    fdp = FastDataParallel(model, device_ids=["cpu"] * 4)
    x = torch.randn(8, 32)
    for _ in range(2):
        fdp(x).sum().backward()
        stats = fdp.comm_stats()
        assert 1 <= stats["buckets"] <= most
        assert stats["broadcasts"] == stats["buckets"] == stats["reduces"]
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert stats["bytes_broadcast"] == stats["bytes_reduced"] == nbytes


def test_comm_stats_are_zeroed_by_each_forward(distinct):
    fdp = FastDataParallel(linear_stack(3), device_ids=["cpu"] * 2)
    fdp(torch.randn(4, 32)).sum().backward()
    assert fdp.comm_stats()["reduces"] == 1
    fdp(torch.randn(4, 32))
    assert fdp.comm_stats()["reduces"] == 0 and fdp.comm_stats()["broadcasts"] == 1


def test_bucket_cap_mb_must_be_positive():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        FastDataParallel(linear_stack(1), device_ids=["cpu"] * 2, bucket_cap_mb=0)


# ---- fastdp.comm on the engine ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_coalesced_is_bit_exact_in_small_buckets(dtype):
    ts = [torch.testing.make_tensor(s, dtype=dtype, device="cpu") for s in [(3, 4), (5,), (2, 2)]]
    ts.append(torch.testing.make_tensor((4, 3), dtype=dtype, device="cpu").t())  # strided
    out = comm.broadcast_coalesced(ts, ["cpu"] * 3, buffer_size=16)
    assert out[0] == ts
    for row in out[1:]:
        for a, b in zip(row, ts):
            assert a.data_ptr() != b.data_ptr() and a.shape == b.shape
            assert torch.equal(a, b)
            a.add_(1) if dtype != torch.bool else a.logical_not_()
    assert all(not torch.equal(a, b) for a, b in zip(out[1], ts))  # own storage


def test_broadcast_coalesced_needs_a_device():
    with pytest.raises(RuntimeError, match="at least one device"):
        comm.broadcast_coalesced([torch.ones(2)], [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bfloat16])
def test_reduce_add_coalesced_sums_in_list_order(dtype):
    rows = [
        [torch.testing.make_tensor(s, dtype=dtype, device="cpu") for s in [(3, 3), (7,)]]
        for _ in range(3)
    ]
    got = comm.reduce_add_coalesced(rows, "cpu", buffer_size=8)
    for k in range(2):
        assert torch.equal(got[k], rows[0][k] + rows[1][k] + rows[2][k])
        assert all(got[k].data_ptr() != r[k].data_ptr() for r in rows)


def test_reduce_add_coalesced_handles_sparse_tensors():
    a, b = torch.eye(3).to_sparse(), (2 * torch.eye(3)).to_sparse()
    (got,) = comm.reduce_add_coalesced([[a], [b]])
    assert torch.equal(got.to_dense(), 3 * torch.eye(3))
