"""fastdp.comm.scatter: one extension call per call, views where nothing moves.

Counted through ``fastdp.comm.copy_stats()``. The CPU cases run everywhere; the CUDA ones skip
without a GPU and a CUDA build (``tests/gpu.sh check`` runs them).
"""

from __future__ import annotations

import pytest
import torch

from fastdp import _backend, comm
from fastdp.testing import onlyCUDA

needs_ext = pytest.mark.skipif(_backend.ext() is None, reason="needs the fastdp._C extension")
onlyCUDABuild = pytest.mark.skipif(
    _backend.build_info().get("built_with_cuda") != "1", reason="needs a CUDA build of fastdp._C"
)


def calls(key: str = "scatter_ext_calls") -> int:
    return comm.copy_stats()[key]


def shares_storage(part: torch.Tensor, src: torch.Tensor) -> bool:
    return part.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()


@needs_ext
@pytest.mark.parametrize("replicas", [2, 4])
def test_scatter_calls_the_extension_once_per_call(replicas: int) -> None:
    x = torch.randn(4 * replicas, 3)
    sizes = [4] * replicas
    before = calls()
    parts = comm.scatter(x, ["cpu"] * replicas, chunk_sizes=sizes)
    assert calls() - before == 1
    for got, want in zip(parts, x.split(sizes)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_copy_stats_are_counters() -> None:
    stats = comm.copy_stats()
    assert set(stats) >= {
        "scatter_ext_calls",
        "gather_ext_calls",
        "broadcast_layouts_built",
        "pinned_pool_allocations",
    }
    assert all(isinstance(v, int) and v >= 0 for v in stats.values())


@pytest.mark.parametrize("devices", [["cpu"] * 4, [-1, "cpu", torch.device("cpu")]])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_same_device_scatter_returns_chunk_views_without_the_extension(devices, dim) -> None:
    x = torch.randn(7, 5)
    before = calls()
    parts = comm.scatter(x, devices, dim=dim)
    assert calls() == before
    want = x.chunk(len(devices), dim)
    assert len(parts) == len(want)
    for got, ref in zip(parts, want):
        assert shares_storage(got, x)
        assert got.stride() == ref.stride() and got.storage_offset() == ref.storage_offset()
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_same_device_scatter_of_fewer_rows_than_devices_gives_fewer_chunks() -> None:
    x = torch.arange(3.0).unsqueeze(1)
    parts = comm.scatter(x, ["cpu"] * 8)
    assert [p.shape[0] for p in parts] == [1, 1, 1]


def test_same_device_scatter_raises_torch_errors() -> None:
    with pytest.raises(RuntimeError, match="at least one device"):
        comm.scatter(torch.ones(2), [])
    with pytest.raises((IndexError, RuntimeError)):
        comm.scatter(torch.ones(2), ["cpu"], dim=3)


# --- CUDA --------------------------------------------------------------------------------------


@onlyCUDA
@pytest.mark.parametrize("devices", [[0, 0, 0, 0], ["cuda:0", torch.device("cuda", 0)]])
def test_cuda_same_device_scatter_returns_views_as_torch(devices) -> None:
    x = torch.randn(10, 6, device="cuda:0")
    before = calls()
    parts = comm.scatter(x, devices)
    assert calls() == before
    want = torch.cuda.comm.scatter(x, [0] * len(devices))
    assert len(parts) == len(want)
    for got, ref in zip(parts, want):
        assert shares_storage(got, x) and got.data_ptr() == ref.data_ptr()
        assert got.stride() == ref.stride()


@onlyCUDA
@onlyCUDABuild
@pytest.mark.parametrize("pinned", [True, False])
def test_cuda_scatter_from_host_calls_the_extension_once(pinned: bool) -> None:
    x = torch.randn(64, 33)
    if pinned:
        x = x.pin_memory()
    before = calls()
    parts = comm.scatter(x, [0, 0, 0, 0])
    assert calls() - before == 1
    for got, ref in zip(parts, x.chunk(4)):
        torch.testing.assert_close(got.cpu(), ref, rtol=0, atol=0)


@pytest.mark.parametrize("devices", [["cpu", "cpu"], [-1, -1, -1]])
def test_scatter_with_streams_is_torchs(monkeypatch, devices) -> None:
    """``streams=`` asks for each chunk's copy on the stream given for it, which one copy per
    device cannot honour: torch's ``comm.scatter`` serves it, streams passed through."""
    seen = {}

    def torch_scatter(tensor, devs, chunk_sizes, dim, streams, *, out=None):
        seen["streams"] = streams
        return tuple(tensor.chunk(len(devs), dim))

    monkeypatch.setattr(comm._tcomm, "scatter", torch_scatter)
    streams = [object() for _ in devices]
    parts = comm.scatter(torch.randn(6, 3), devices, streams=streams)
    assert seen["streams"] is streams and len(parts) == len(devices)
