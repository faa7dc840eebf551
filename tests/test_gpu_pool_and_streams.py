"""The CUDA halves of the pinned pool's, the host copies' and the reduce's contracts.

GPU only (each test skips without a GPU and a CUDA build; multi-GPU ones on one GPU). The host
logic of each is tested on the CPU: tests/test_scatter_pinned_pool.py (NOTE [ Pinned blocks and
graphs ]), tests/test_scatter_host_copy_route.py (NOTE [ Stream order of host copies ]),
tests/test_reduce_stream_order.py (NOTE [ Streams of a reduce across devices ]).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from fastdp import FastDataParallel, _backend, comm

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        _backend.build_info().get("built_with_cuda") != "1",
        reason="needs a CUDA build of fastdp._C",
    ),
]
ext = _backend.ext()
SLEEP = 50_000_000  # GPU cycles (tens of ms): a D2H queued behind it lands long after the call
MiB = 1 << 20


def pool() -> dict[str, int]:
    return dict(ext.pinned_pool_stats())


def late_pinned(src: torch.Tensor) -> torch.Tensor:
    """A pinned tensor of src's layout, filled by a non_blocking D2H that lands late."""
    pinned = torch.empty_strided(src.size(), src.stride(), dtype=src.dtype, pin_memory=True)
    pinned.zero_()
    torch.cuda._sleep(SLEEP)
    pinned.copy_(src, non_blocking=True)
    return pinned


# ------------------------------------------------------------ the pool under graph capture
@pytest.mark.parametrize("mode", ["global", "relaxed"])
def test_a_gather_captured_after_warm_up_replays_right_and_leaves_the_pool_working(mode) -> None:
    a, b = torch.randn(1024, 64, device="cuda"), torch.randn(512, 64, device="cuda")
    comm.gather([a, b], 0, 0)  # warm-up: the copy kernel's metadata block holds an event
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode=mode):
        out = comm.gather([a, b], 0, 0)
    for _ in range(3):  # the same class of block asked again after the capture
        c = comm.gather([b, a, b], 0, 0)
        torch.testing.assert_close(c, torch.cat([b, a, b]), rtol=0, atol=0)
    a.copy_(torch.randn_like(a))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, torch.cat([a, b]), rtol=0, atol=0)
    assert pool()["graph_held"] > 0


def test_re_captures_never_spend_a_small_pool_once_each_graph_is_destroyed() -> None:
    """Each capture of a gather lends the copy kernel's metadata block to its graph; destroying
    the graph returns it (NOTE [ Pinned blocks and graphs ]): a thousand captures through a pool
    of 128 blocks, where the 129th capture raised while graphs kept their blocks. CUDA runs a
    user object's destructor soon after the graph goes, not at once: hence the slack."""
    a, b = torch.randn(256, 64, device="cuda"), torch.randn(128, 64, device="cuda")
    comm.gather([a, b], 0, 0)  # warm-up outside any capture
    torch.cuda.synchronize()
    ext.pinned_pool_empty_cache()  # no idle block of another class takes the small capacity
    old = ext.pinned_pool_set_capacity(8 * MiB)  # 128 blocks of the metadata's 64 KiB class
    returns = pool()["graph_returns"]
    try:
        stream = torch.cuda.Stream()
        for i in range(1000):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                g.capture_begin()
                out = comm.gather([a, b], 0, 0)
                g.capture_end()
            if i % 250 == 0:
                g.replay()
                torch.cuda.synchronize()
                torch.testing.assert_close(out, torch.cat([a, b]), rtol=0, atol=0)
            del g, out
        torch.cuda.synchronize()
        assert pool()["graph_returns"] - returns >= 1000 - 128
    finally:
        ext.pinned_pool_set_capacity(old)


def test_pool_counters_can_be_read_inside_a_capture() -> None:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch.ones(4, device="cuda").mul_(2)
        comm.copy_stats()  # queries no event


def test_a_gather_to_the_host_under_capture_raises_the_clear_error() -> None:
    a = torch.randn(8, 4, device="cuda")
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="cannot be captured"):
        with torch.cuda.graph(g):
            comm.gather([a, a], 0, -1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_gather_across_gpus_under_capture_raises_the_clear_error() -> None:
    a, b = torch.randn(8, 4, device="cuda:0"), torch.randn(8, 4, device="cuda:1")
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="not captured in CUDA graphs"):
        with torch.cuda.graph(g):
            comm.gather([a, b], 0, 0)


# -------------------------------------------------------- every copy kind, in stream order
def cl(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda").contiguous(memory_format=torch.channels_last)


def rnd(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device="cuda")


KINDS = [
    ("3-D slice (2-D copy)", lambda: rnd(16, 8, 512), lambda t: t[..., :256], 0),
    ("3-D slice, narrow rows (span)", lambda: rnd(16, 8, 96), lambda t: t[..., :48], 0),
    ("channels_last by channels (span)", lambda: cl(8, 6, 5, 4), lambda t: t, 1),
    ("two sparse levels (rows)", lambda: rnd(16, 64, 512), lambda t: t[:, :4, :256], 0),
    ("4-byte rows (span)", lambda: rnd(4096, 2), lambda t: t, 1),
    ("conj (resolved on the GPU)", lambda: rnd(64, 48, dtype=torch.cfloat), lambda t: t.conj(), 0),
    ("expanded rows, a mask (span)", lambda: rnd(1, 512), lambda t: t.expand(8, 512), 0),
    ("overlapping rows, unfold (span)", lambda: rnd(1024), lambda t: t.unfold(0, 512, 1), 0),
    ("expanded level far apart (rows of 1)", lambda: rnd(2, 100000),
     lambda t: t[:, :512].unsqueeze(1).expand(2, 4, 512), 0),
]  # fmt: skip


@pytest.mark.parametrize("label,make,view,dim", KINDS, ids=[k[0] for k in KINDS])
def test_pinned_chunks_of_every_copy_kind_are_read_after_their_d2h(label, make, view, dim):
    src = make()
    torch.cuda.synchronize()
    parts = comm.scatter(view(late_pinned(src)), [0, 0], dim=dim)  # before the D2H lands
    torch.cuda.synchronize()
    torch.testing.assert_close(torch.cat(parts, dim), view(src), rtol=0, atol=0)


@pytest.mark.parametrize("label,make,view,dim", KINDS, ids=[k[0] for k in KINDS])
def test_a_captured_pinned_scatter_of_every_copy_kind_replays_the_current_bytes(
    label, make, view, dim
) -> None:
    host = make().cpu().pin_memory()
    comm.scatter(view(host), [0, 0], dim=dim)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.cat(comm.scatter(view(host), [0, 0], dim=dim), dim) * 2
    host.copy_(make().cpu())
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), view(host).resolve_conj() * 2, rtol=0, atol=0)


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory < 40 << 30,
    reason="needs 4 GiB of pinned memory and ~12 GiB on the GPU",
)
def test_a_pinned_chunk_whose_pitch_exceeds_the_devices_maximum_is_copied() -> None:
    x = torch.zeros(2, 1 << 31, dtype=torch.uint8, pin_memory=True)  # pitch 2 GiB
    x[:, ::65521] = 5
    x[1, -1] = 9
    parts = comm.scatter(x, [0, 0], dim=1)
    torch.cuda.synchronize()
    assert torch.equal(torch.cat(parts, 1), x.cuda())


def test_a_pageable_chunk_with_rows_wider_than_the_window_is_staged() -> None:
    old = ext.pinned_pool_set_capacity(64 * MiB)
    try:
        ext.pinned_pool_empty_cache()
        before = pool()["allocations"]
        x = torch.randn(8, 3, 1024, 1024)  # 12 MiB rows onto 4 replicas: 4 MiB windows
        parts = comm.scatter(x, [0, 0, 0, 0])
        torch.cuda.synchronize()
        assert pool()["allocations"] > before  # staged, not torch's unstaged copies
        torch.testing.assert_close(torch.cat([p.cpu() for p in parts]), x, rtol=0, atol=0)
    finally:
        ext.pinned_pool_set_capacity(old)


def test_a_gather_to_the_host_takes_a_block_close_to_its_size() -> None:
    ext.pinned_pool_empty_cache()
    a = torch.randn(25 * MiB // 4 * 4, device="cuda")  # 100 MiB in one source
    before = pool()["reserved"]
    comm.gather([a[:1], a], 0, -1)
    assert pool()["reserved"] - before <= 100 * MiB * 5 // 4 + MiB


def test_mixed_pinned_and_pageable_leaves_scatter_right() -> None:
    pinned, pageable = torch.randn(32, 16).pin_memory(), torch.randn(32, 16)
    devs = [torch.device("cuda", 0)] * 2
    rows = comm.scatter_leaves([pinned, pageable, pinned[:, :8]], devs, [[16, 16]] * 3, [0] * 3)
    torch.cuda.synchronize()
    for i, leaf in enumerate([pinned, pageable, pinned[:, :8]]):
        torch.testing.assert_close(torch.cat([r[i].cpu() for r in rows]), leaf, rtol=0, atol=0)


def test_scatter_with_streams_copies_on_the_given_streams() -> None:
    x = torch.randn(1 << 12, 1 << 10).pin_memory()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda._sleep(SLEEP)  # the current stream is busy: a copy queued there would lag
    parts = comm.scatter(x, [0, 0], streams=streams)
    for s in streams:
        s.synchronize()
    with torch.cuda.stream(streams[0]):
        got = torch.cat([p.to("cpu") for p in parts])
    torch.cuda.synchronize()
    assert torch.equal(got, x)


# ------------------------------------------------------------------ the reduce's streams
def side_stream_steps(device_ids: list[int]) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512)).cuda()
    ref = copy.deepcopy(model)
    dp = FastDataParallel(model, device_ids=device_ids)
    streams = {d: torch.cuda.Stream(device=d) for d in set(device_ids)}
    worst = 0.0
    for _ in range(3):
        x = torch.randn(256, 512, device="cuda")
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        with contextlib.ExitStack() as stack:
            for d in sorted(streams, reverse=True):  # cuda:0 entered last: the current device
                streams[d].wait_stream(torch.cuda.current_stream(d))
                stack.enter_context(torch.cuda.stream(streams[d]))
                torch.cuda._sleep(SLEEP // 2)  # gradients land late on the side streams
            dp(x).square().sum().backward()
        torch.cuda.synchronize()
        ref(x).square().sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            worst = max(worst, ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item())
    return worst


def test_a_step_under_a_side_stream_gives_the_plain_gradients() -> None:
    assert side_stream_steps([0, 0]) < 1e-4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_step_under_side_streams_on_two_gpus_gives_the_plain_gradients() -> None:
    assert side_stream_steps([0, 1]) < 1e-4


def test_a_step_captured_after_a_default_stream_warm_up_replays_the_plain_gradients() -> None:
    """Nodes follow the current stream (``Reducer.prepare_for_backward``): the bucket nodes
    linked in the eager warm-up on the default stream are linked afresh under the capture's
    stream (else the captured backward depends on the legacy stream and the capture fails)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)).cuda()
    ref = copy.deepcopy(model)
    dp = FastDataParallel(model, device_ids=[0, 0], launch="inline")
    static_in = torch.randn(32, 64, device="cuda")
    for _ in range(3):  # the warm-up, on the default stream
        model.zero_grad(set_to_none=True)
        dp(static_in).square().sum().backward()
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dp(static_in).square().sum().backward()
    fresh = torch.randn(32, 64, device="cuda")
    static_in.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    ref(fresh).square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
