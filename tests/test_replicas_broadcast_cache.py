"""fastdp.comm.broadcast_coalesced lays out a tensor set once (the comment above ``_LAYOUTS`` in
fastdp/comm.py) and still returns fresh tensors with the current values on every call.

Counted through ``fastdp.comm.copy_stats()["broadcast_layouts_built"]``; every test runs with the
extension and on the pure-torch path (``backend``).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from fastdp import comm
from fastdp.testing import onlyCUDA

DEVICES = ["cpu"] * 3


def built() -> int:
    return comm.copy_stats()["broadcast_layouts_built"]


def tensor_set() -> list[torch.Tensor]:
    return [
        torch.randn(4, 5),
        torch.randn(7),
        torch.randn(2, 3, 4, 2).contiguous(memory_format=torch.channels_last),
        torch.arange(6, dtype=torch.int64),
        torch.randn(3, 3).t(),
    ]


def test_repeated_broadcast_of_one_tensor_set_builds_one_layout(backend) -> None:
    ts = tensor_set()
    before = built()
    for _ in range(4):
        comm.broadcast_coalesced(ts, DEVICES)
    assert built() - before == 1


def test_a_changed_geometry_builds_a_new_layout(backend) -> None:
    ts = tensor_set()
    comm.broadcast_coalesced(ts, DEVICES)
    before = built()
    ts[1] = torch.randn(9)
    out = comm.broadcast_coalesced(ts, DEVICES)
    assert built() - before == 1
    assert out[1][1].shape == (9,)
    comm.broadcast_coalesced(ts, DEVICES[:2])  # other devices: another plan
    assert built() - before == 2


def test_results_carry_the_values_of_each_call(backend) -> None:
    ts = tensor_set()
    first = comm.broadcast_coalesced(ts, DEVICES)
    old = [t.clone() for t in ts]
    with torch.no_grad():
        for t in ts:
            t.add_(3)
    second = comm.broadcast_coalesced(ts, DEVICES)
    for j in (1, 2):
        for got, want in zip(second[j], ts):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert got.stride() == want.stride() or not want.is_contiguous()
        for got, want in zip(first[j], old):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_results_of_two_calls_do_not_alias(backend) -> None:
    ts = tensor_set()
    first = comm.broadcast_coalesced(ts, DEVICES)
    second = comm.broadcast_coalesced(ts, DEVICES)
    ptrs = {t.untyped_storage().data_ptr() for row in first[1:] for t in row}
    assert not ptrs & {t.untyped_storage().data_ptr() for row in second[1:] for t in row}
    with torch.no_grad():
        second[1][0].fill_(0)
    torch.testing.assert_close(first[1][0], ts[0], rtol=0, atol=0)


def test_replica_zero_is_the_inputs_and_copies_have_own_version_counters(backend) -> None:
    ts = tensor_set()
    out = comm.broadcast_coalesced(ts, DEVICES)
    assert all(a is b for a, b in zip(out[0], ts))
    a, b = out[1][0], out[1][1]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one flat
    va, vb = a._version, b._version
    with torch.no_grad():
        a.add_(1)
    assert a._version == va + 1 and b._version == vb
    assert not a.requires_grad and a.grad_fn is None


def test_the_layout_cache_keeps_no_tensor_alive(backend) -> None:
    ts = tensor_set()
    refs = [weakref.ref(t) for t in ts]
    out = comm.broadcast_coalesced(ts, DEVICES)
    out_refs = [weakref.ref(t) for row in out[1:] for t in row]
    del ts, out
    gc.collect()
    assert all(r() is None for r in refs + out_refs)


def test_the_layout_cache_is_bounded(backend) -> None:
    for n in range(comm._LAYOUTS_MAX + 5):
        comm.broadcast_coalesced([torch.randn(n + 1)], DEVICES)
    assert len(comm._LAYOUTS) <= comm._LAYOUTS_MAX


@onlyCUDA
@pytest.mark.parametrize("devices", [[0, 0, 0], [0, 0]])
def test_cuda_broadcast_matches_torch_and_lays_out_once(devices) -> None:
    ts = [t.cuda() for t in tensor_set()]
    before = built()
    for _ in range(3):
        got = comm.broadcast_coalesced(ts, devices)
    assert built() - before == 1
    want = torch.cuda.comm.broadcast_coalesced(ts, devices)
    for grow, wrow in zip(got, want):
        for g, w in zip(grow, wrow):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
