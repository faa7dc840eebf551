"""Stream order of the extension's host copies (NOTE [ Stream order of host copies ]).

GPU only: every test skips without a GPU and a CUDA build; ``tests/gpu.sh check`` runs them.
A source still being written by the current stream must be read after the write lands; under
CUDA graph capture a copy is either captured right or refused with an error naming the fix.
"""

from __future__ import annotations

import pytest
import torch

from fastdp import FastDataParallel, _backend, comm

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        _backend.build_info().get("built_with_cuda") != "1",
        reason="needs a CUDA build of fastdp._C",
    ),
]
SLEEP = 50_000_000  # GPU cycles (tens of ms): the D2H lands long after scatter returns
CLEAR_ERROR = r"CUDA graph.*(pin_memory|FASTDP_DISABLE_EXT)"


def late_pinned_batch(src: torch.Tensor) -> torch.Tensor:
    """A pinned batch filled by a non_blocking D2H queued behind a long kernel."""
    pinned = torch.zeros(src.shape, dtype=src.dtype, pin_memory=True)
    torch.cuda._sleep(SLEEP)
    pinned.copy_(src, non_blocking=True)
    return pinned


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("devices", [[0, 0], [0, 0, 0, 0]])
def test_pinned_batch_filled_by_a_non_blocking_d2h_is_scattered_right(dim, devices) -> None:
    src = torch.randn(64, 96, device="cuda")
    pinned = late_pinned_batch(src)
    parts = comm.scatter(pinned, devices, dim=dim)  # at once, before the D2H has landed
    torch.cuda.synchronize()
    torch.testing.assert_close(torch.cat(parts, dim), src, rtol=0, atol=0)


def test_pinned_leaves_of_a_training_step_are_read_after_their_d2h() -> None:
    model = torch.nn.Linear(96, 8).cuda()
    dp = FastDataParallel(model, device_ids=[0, 0])
    src = torch.randn(64, 96, device="cuda")
    out = dp(late_pinned_batch(src))
    torch.testing.assert_close(out, model(src))


def test_a_pinned_scatter_under_graph_capture_replays_the_current_bytes() -> None:
    pinned = torch.randn(32, 16).pin_memory()
    comm.scatter(pinned, [0, 0])  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        parts = comm.scatter(pinned, [0, 0])
        out = torch.cat(parts) * 2
    pinned.copy_(torch.randn(32, 16))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), pinned * 2, rtol=0, atol=0)


def test_a_pageable_scatter_under_graph_capture_raises_the_clear_error() -> None:
    x = torch.randn(32, 16)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=CLEAR_ERROR):
        with torch.cuda.graph(graph):
            comm.scatter(x, [0, 0])


def test_a_step_under_graph_capture_is_right_or_raises_the_clear_error() -> None:
    model = torch.nn.Linear(16, 8).cuda()
    dp = FastDataParallel(model, device_ids=[0, 0], launch="inline")
    static_in = torch.randn(8, 16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):  # warm-up on a side stream, as torch.cuda.graphs asks
            dp(static_in)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.no_grad(), torch.cuda.graph(graph):
            static_out = dp(static_in)
    except RuntimeError as e:
        assert pytest.importorskip("re").search(CLEAR_ERROR, str(e)), str(e)
        return
    fresh = torch.randn(8, 16, device="cuda")
    static_in.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        torch.testing.assert_close(static_out, model(fresh))
