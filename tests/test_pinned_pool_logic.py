"""The pinned pool's bookkeeping (csrc/pinned_pool_core.h), tested on host memory in any build.

``_C._HostBlockPool`` is the pool the CUDA build uses, over malloc'd blocks and events that are
flags (``complete`` sets one; a wait sets it, as a stream reaching the event would). The CUDA
build's pool itself is checked by the GPU test at the end.
"""

from __future__ import annotations

import pytest
import torch

from fastdp import _backend, comm
from fastdp.testing import onlyCUDA

ext = _backend.ext()
pytestmark = pytest.mark.skipif(
    ext is None or not hasattr(ext, "_HostBlockPool"), reason="needs fastdp._C with _HostBlockPool"
)
KiB, MiB = 1 << 10, 1 << 20


def stats(pool) -> dict[str, int]:
    return dict(pool.stats())


def step(pool, sizes, *, complete: bool = True) -> list[int]:
    """Acquire a block per size, record an event on each, release them; complete the events."""
    blocks = [pool.acquire(n) for n in sizes]
    assert all(blocks)
    events = [pool.record(b) for b in blocks]
    for b in blocks:
        pool.release(b)
    if complete:
        for e in events:
            pool.complete(e)
    return events


@pytest.mark.parametrize(
    "sizes", [[3 * MiB, 3 * MiB, 700 * KiB], [1, 64 * KiB, 64 * KiB + 1, 5 * MiB, 5 * MiB]]
)
def test_repeated_steps_of_the_same_sizes_allocate_nothing_after_the_first(sizes) -> None:
    pool = ext._HostBlockPool(256 * MiB)
    step(pool, sizes)
    first = stats(pool)["allocations"]
    assert first == len(sizes)
    for _ in range(5):
        step(pool, sizes)
    after = stats(pool)
    assert after["allocations"] == first and after["frees"] == 0 and after["waits"] == 0


def test_blocks_come_in_size_classes() -> None:
    pool = ext._HostBlockPool(256 * MiB)
    got = {n: pool.size(pool.acquire(n)) for n in (1, 64 * KiB, 65 * KiB, 3 * MiB, 4 * MiB)}
    assert got == {1: 64 * KiB, 64 * KiB: 64 * KiB, 65 * KiB: 128 * KiB, 3 * MiB: 4 * MiB,
                   4 * MiB: 4 * MiB}  # fmt: skip


def test_a_block_in_flight_is_not_lent_again_until_its_events_complete() -> None:
    pool = ext._HostBlockPool(256 * MiB)
    (event,) = step(pool, [MiB], complete=False)
    b = pool.acquire(MiB)  # the first is in flight: a second block
    assert stats(pool)["allocations"] == 2
    pool.release(b)
    pool.complete(event)
    step(pool, [MiB, MiB])
    assert stats(pool)["allocations"] == 2


def test_at_capacity_the_pool_waits_on_the_oldest_block_instead_of_allocating() -> None:
    pool = ext._HostBlockPool(2 * MiB)
    (e1,) = step(pool, [MiB], complete=False)
    (e2,) = step(pool, [MiB], complete=False)
    b = pool.acquire(MiB)  # both in flight, no room: waits on the oldest (e1)
    s = stats(pool)
    assert b and s["allocations"] == 2 and s["waits"] == 1
    assert pool.completed(e1) and not pool.completed(e2)
    pool.release(b)


def test_requests_above_the_capacity_or_with_everything_lent_get_nothing() -> None:
    pool = ext._HostBlockPool(MiB)
    assert pool.acquire(2 * MiB) == 0
    assert pool.acquire(0) == 0
    b = pool.acquire(MiB)
    assert pool.acquire(MiB) == 0  # never waits on a block it lent
    pool.release(b)


def test_a_smaller_capacity_frees_idle_blocks_and_in_flight_ones_stay() -> None:
    pool = ext._HostBlockPool(8 * MiB)
    step(pool, [MiB, 2 * MiB])
    (pending,) = step(pool, [4 * MiB], complete=False)
    assert pool.set_capacity(MiB) == 8 * MiB
    s = stats(pool)
    assert s["frees"] == 2 and s["reserved"] == 4 * MiB and s["in_flight"] == 4 * MiB
    pool.complete(pending)
    pool.empty_cache()
    assert stats(pool)["reserved"] == 0


def test_other_classes_are_freed_only_when_the_capacity_forces_it() -> None:
    pool = ext._HostBlockPool(4 * MiB)
    step(pool, [2 * MiB])
    step(pool, [MiB])  # fits beside it: nothing freed
    assert stats(pool)["frees"] == 0
    step(pool, [4 * MiB])  # needs all the room: the idle blocks go
    s = stats(pool)
    assert s["frees"] == 2 and s["reserved"] == 4 * MiB


def test_cpu_build_reports_no_pool_allocations() -> None:
    if _backend.build_info().get("built_with_cuda") == "1":
        pytest.skip("a CUDA build has a real pool")
    assert comm.copy_stats()["pinned_pool_allocations"] == 0


@onlyCUDA
@pytest.mark.skipif(
    _backend.build_info().get("built_with_cuda") != "1", reason="needs a CUDA build of fastdp._C"
)
def test_cuda_pool_allocations_are_constant_across_repeated_scatters() -> None:
    x = torch.randn(4096, 1024)  # 16 MiB pageable: several windows through the pool
    comm.scatter(x, [0, 0])
    torch.cuda.synchronize()
    before = comm.copy_stats()["pinned_pool_allocations"]
    for _ in range(5):
        parts = comm.scatter(x, [0, 0])
    torch.cuda.synchronize()
    assert comm.copy_stats()["pinned_pool_allocations"] == before
    torch.testing.assert_close(torch.cat([p.cpu() for p in parts]), x, rtol=0, atol=0)


@pytest.mark.parametrize("total", [1, 700 * KiB, MiB, MiB + 1, 3 * MiB, 16 * MiB, 1 << 30])
def test_pageable_scatter_windows_keep_two_in_flight(total: int) -> None:
    window = ext._scatter_window(total, 256 * MiB)
    if total <= MiB:
        assert window == total  # one piece
    else:
        assert MiB <= window <= 4 * MiB and -(-total // window) >= 2
    assert ext._scatter_window(total, 0) == 0  # staging off: the caller copies unstaged
    assert ext._scatter_window(total, 2 * MiB) <= MiB


def test_pinned_pool_events_are_not_move_assigned() -> None:
    """erase(remove_if(...)) over a std::vector of CUDAEvents move-assigns the survivors, and
    c10's CUDAEvent move-assignment overwrites the target's event without destroying it: one
    leaked cudaEvent per completed copy. The leak is invisible to the pool's counters (and no GPU
    is here), so this pins the container: a std::list, whose remove_if destroys in place."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1] / "csrc"
    core = re.sub(r"//[^\n]*", "", (root / "pinned_pool_core.h").read_text())
    cuda = re.sub(r"//[^\n]*", "", (root / "cuda/pinned_pool.cpp").read_text())
    assert re.search(r"std::list<Event>\s+events", core)
    assert re.search(r"PoolBlock<at::cuda::CUDAEvent>", (root / "cuda/pinned_pool.h").read_text())
    for code in (core, cuda):
        assert not re.search(r"std::vector<\s*((at|c10)::cuda::CUDA)?Event\b", code)
    assert ".erase(" not in core.split("bool idle(")[1].split("}")[0]
