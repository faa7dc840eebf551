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
    sizes = (1, 64 * KiB, 65 * KiB, MiB + 1, 3 * MiB, 4 * MiB, 100 * MiB)
    got = {n: pool.size(pool.acquire(n)) for n in sizes}
    assert got == {1: 64 * KiB, 64 * KiB: 64 * KiB, 65 * KiB: 128 * KiB, MiB + 1: 5 * MiB // 4,
                   3 * MiB: 3 * MiB, 4 * MiB: 4 * MiB, 100 * MiB: 112 * MiB}  # fmt: skip


@pytest.mark.parametrize("n", [MiB + 1, 3 * MiB - 7, 5 * MiB, 65 * MiB, 100 * MiB, 200 * MiB + 3])
def test_a_block_above_one_mib_is_at_most_a_fifth_unused(n: int) -> None:
    pool = ext._HostBlockPool(256 * MiB)
    size = pool.size(pool.acquire(n))
    assert n <= size and (size - n) * 5 < size


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


# NOTE [ Pinned blocks and graphs ]: a capturing acquire neither queries nor waits on an event.
def test_a_capturing_acquire_never_queries_or_waits_on_events() -> None:
    pool = ext._HostBlockPool(2 * MiB)
    step(pool, [MiB], complete=False)  # a block in flight
    queries = pool.queries()
    b = pool.acquire(MiB, capturing=True)  # a new block: the one in flight is not asked
    assert b and pool.queries() == queries
    assert pool.acquire(MiB, capturing=True) == 0  # at capacity: nothing, and no wait
    s = stats(pool)
    assert pool.queries() == queries and s["waits"] == 0 and s["graph_held"] == MiB


def test_a_block_lent_during_capture_is_not_lent_again_while_its_graph_lives() -> None:
    pool = ext._HostBlockPool(256 * MiB)
    held = pool.acquire(MiB, capturing=True)
    pool.release(held)  # its graph still reads it on every replay
    assert pool.acquire(MiB) != held and pool.acquire(MiB, capturing=True) != held
    assert stats(pool)["graph_held"] == 2 * MiB


def test_re_captures_never_spend_the_pool_once_each_graph_is_destroyed() -> None:
    """A capturing acquire lends its block to the graph; destroying the graph (CUDA runs the
    user object's destructor) gives it back: re-captures reuse the same blocks."""
    pool = ext._HostBlockPool(4 * MiB)
    for _ in range(50):
        held = [pool.acquire(MiB, capturing=True) for _ in range(4)]
        assert all(held) and pool.acquire(MiB, capturing=True) == 0  # the capacity is spent
        for b in held:
            pool.release(b)  # the capture's handles end: the graph still holds the blocks
        assert pool.acquire(MiB) == 0 and stats(pool)["graph_held"] == 4 * MiB
        graph = pool.end_capture()
        assert graph.blocks() == 4
        graph.destroy()
        assert sorted(pool.acquire(MiB) for _ in range(4)) == sorted(held)  # idle, no events
        for b in held:
            pool.release(b)
    s = stats(pool)
    assert s["graph_held"] == 0 and s["lent"] == 0 and s["in_flight"] == 0
    assert s["graph_returns"] == 200 and s["allocations"] == 4 and s["reserved"] == 4 * MiB


def test_a_block_whose_graph_is_destroyed_before_its_release_is_lent_once_released() -> None:
    pool = ext._HostBlockPool(MiB)
    b = pool.acquire(MiB, capturing=True)
    pool.end_capture().destroy()  # e.g. a capture invalidated while the copy still holds it
    assert pool.acquire(MiB) == 0 and pool.acquire(MiB, capturing=True) == 0
    pool.release(b)
    assert pool.acquire(MiB) == b and pool.acquire(MiB) == 0  # lent once


def test_a_graph_returns_its_blocks_once_whatever_is_lent_after() -> None:
    pool = ext._HostBlockPool(MiB)
    b = pool.acquire(MiB, capturing=True)
    pool.release(b)
    old = pool.end_capture()
    old.destroy()
    assert pool.acquire(MiB, capturing=True) == b  # reused by the next capture
    pool.release(b)
    old.destroy()  # returns nothing more: the next graph still holds the block
    assert pool.acquire(MiB) == 0 and old.blocks() == 0
    graph = pool.end_capture()
    del graph  # deleting a graph returns its blocks, as destroy() does
    assert pool.acquire(MiB) == b and stats(pool)["graph_returns"] == 2


def test_a_graph_destroyed_after_its_pool_was_trimmed_or_destroyed_is_safe() -> None:
    pool = ext._HostBlockPool(4 * MiB)
    pool.release(pool.acquire(2 * MiB, capturing=True))
    graph = pool.end_capture()
    pool.empty_cache()
    pool.set_capacity(MiB)  # the held block stays: its graph may read it
    assert stats(pool)["reserved"] == 2 * MiB and stats(pool)["frees"] == 0
    graph.destroy()
    pool.empty_cache()  # idle now: freed
    assert stats(pool)["reserved"] == 0 and stats(pool)["frees"] == 1
    pool = ext._HostBlockPool(MiB)
    pool.acquire(MiB, capturing=True)
    graph = pool.end_capture()
    del pool  # the graph outlives its pool: its return finds nothing to give back to
    graph.destroy()
    assert graph.blocks() == 0


def test_a_capturing_acquire_reuses_an_idle_block() -> None:
    pool = ext._HostBlockPool(256 * MiB)
    step(pool, [MiB])  # its event completed
    b = pool.acquire(MiB)  # a query outside the capture saw it and dropped it
    pool.release(b)
    assert pool.acquire(MiB, capturing=True) == b and stats(pool)["allocations"] == 1


def test_release_and_stats_never_query_events() -> None:
    """A release runs in PinnedBlock's destructor: an event query there could throw (terminate)."""
    pool = ext._HostBlockPool(4 * MiB)
    step(pool, [MiB], complete=False)  # in flight, and first in the pool's order
    b = pool.acquire(MiB)
    pool.set_capacity(MiB)  # below what is reserved: nothing idle to free yet
    pool.set_queries_throw(True)  # every query now fails, as after a device fault
    pool.release(b)
    s = stats(pool)
    assert s["in_flight"] == MiB and s["lent"] == 0 and s["reserved"] == 2 * MiB
    with pytest.raises(RuntimeError, match="injected event query"):
        pool.acquire(MiB)  # acquire does query: the error reaches the caller there


@pytest.mark.parametrize("how", ["oom", "error"])
def test_a_failed_allocation_leaves_the_pool_as_it_was(how: str) -> None:
    pool = ext._HostBlockPool(4 * MiB)
    pool.fail_next_alloc(how)
    if how == "oom":
        assert pool.acquire(MiB) == 0  # out of memory: the caller takes the unstaged path
    else:
        with pytest.raises(RuntimeError, match="injected allocation error"):
            pool.acquire(MiB)  # any other error is the caller's, not cleared
    s = stats(pool)
    assert s["reserved"] == 0 and s["allocations"] == 0 and s["blocks"] == 0
    step(pool, [MiB, MiB, 2 * MiB])  # the whole capacity is still there
    assert stats(pool)["reserved"] == 4 * MiB


def test_after_a_sync_a_step_needs_no_more_blocks_than_it_holds_at_once() -> None:
    """The GPU test below relies on this, whatever the DMA timing: with every event complete
    between steps, a step of w windows (each acquired while the previous is in flight) never
    takes the pool past w blocks of the class."""
    pool = ext._HostBlockPool(256 * MiB)
    for lag in (True, False, True):
        events = []
        for _ in range(4):
            b = pool.acquire(4 * MiB)
            events.append(pool.record(b))
            pool.release(b)
            if not lag:
                pool.complete(events[-1])
        for e in events:
            pool.complete(e)
        assert stats(pool)["blocks"] <= 4


def test_cpu_build_reports_no_pool_allocations() -> None:
    if _backend.build_info().get("built_with_cuda") == "1":
        pytest.skip("a CUDA build has a real pool")
    assert comm.copy_stats()["pinned_pool_allocations"] == 0


@onlyCUDA
@pytest.mark.skipif(
    _backend.build_info().get("built_with_cuda") != "1", reason="needs a CUDA build of fastdp._C"
)
def test_cuda_pool_allocations_are_bounded_across_repeated_scatters() -> None:
    """Synchronised between calls, a call holds at most its windows' blocks at once, however
    the DMAs lag (the test above): the bound holds under any load, e.g. parallel workers."""
    x = torch.randn(4096, 1024)  # 16 MiB pageable: several windows through the pool
    comm.scatter(x, [0, 0])
    torch.cuda.synchronize()
    before = comm.copy_stats()["pinned_pool_allocations"]
    total = x.numel() * x.element_size()
    windows = -(-total // ext._scatter_window(total, dict(ext.pinned_pool_stats())["capacity"]))
    for _ in range(5):
        parts = comm.scatter(x, [0, 0])
        torch.cuda.synchronize()
    assert comm.copy_stats()["pinned_pool_allocations"] - before <= windows
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
