"""The host-side decisions of host-to-GPU copies (csrc/host_copy_route.h), in any build.

``_C._host_copy_route``: how a pinned chunk is copied without a host temporary (NOTE [ Stream order
of host copies ]); each route is replayed here on bytes, as the DMAs would move them, and compared
with the chunk. ``_C._stage_rows``: the rows a pageable chunk is packed by, never wider than the
staging window. The GPU halves are in tests/test_gpu_pool_and_streams.py.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastdp import _backend

ext = _backend.ext()
pytestmark = pytest.mark.skipif(
    ext is None or not hasattr(ext, "_host_copy_route"), reason="needs fastdp._C with the routes"
)
MiB = 1 << 20
PITCH = (1 << 31) - 1  # cudaDevAttrMaxPitch on current GPUs


def dst_strides(chunk: torch.Tensor) -> list[int]:
    """The strides ``chunk.to(<GPU>)`` gets (dense, in the chunk's order)."""
    return list(torch.empty_like(chunk, memory_format=torch.preserve_format).stride())


def route_of(chunk: torch.Tensor, max_pitch: int = PITCH) -> dict:
    return ext._host_copy_route(
        list(chunk.shape), list(chunk.stride()), dst_strides(chunk), chunk.element_size(),
        max_pitch,
    )  # fmt: skip


def raw(storage: torch.UntypedStorage) -> torch.Tensor:
    """A storage's bytes (a copy)."""
    n = storage.nbytes()
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (n,), (1,)).clone()


def replay(chunk: torch.Tensor, route: dict, max_pitch: int = PITCH) -> torch.Tensor:
    """The destination's bytes after the route's copies (span: its source bytes, then the device
    copy, which is torch's)."""
    item = chunk.element_size()
    src = chunk.untyped_storage()
    base = chunk.storage_offset() * item
    host = raw(src)
    nbytes = chunk.numel() * item
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    if nbytes == 0:  # scatter_pinned copies nothing
        return dst
    if route["kind"] == "span":
        assert base + route["span"] <= src.nbytes() and route["span"] <= 4 * nbytes
        last = sum((n - 1) * s for n, s in zip(chunk.shape, chunk.stride())) * item + item
        assert route["span"] == last  # covers the chunk's last byte, and no more
        out = torch.empty_strided(chunk.shape, dst_strides(chunk), dtype=chunk.dtype)
        out.copy_(chunk)
        return raw(out.untyped_storage())
    w, h, sp, dp = route["width"], route["height"], route["spitch"], route["dpitch"]
    if h > 1:  # a 2-D copy: cudaMemcpy2D refuses a pitch below the width or above the maximum
        assert route["kind"] in ("2d", "rows") and w <= sp <= max_pitch and w <= dp <= max_pitch
    outer = route["outer_sizes"]
    for idx in itertools.product(*[range(n) for n in outer]):
        so = base + sum(i * s for i, s in zip(idx, route["outer_sstrides"]))
        do = sum(i * s for i, s in zip(idx, route["outer_dstrides"]))
        for r in range(h):  # height 1: one plain copy of `width` bytes
            assert so + r * sp + w <= len(host) and do + r * dp + w <= nbytes
            dst[do + r * dp : do + r * dp + w] = host[so + r * sp : so + r * sp + w]
    return dst


def expected(chunk: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(chunk.shape, dst_strides(chunk), dtype=chunk.dtype)
    out.copy_(chunk)
    return raw(out.untyped_storage())


def cl(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).contiguous(memory_format=torch.channels_last)


# (label, source, dim, number of chunks, kind of chunk 0's route)
CASES = [
    ("dense dim0", lambda: torch.randn(64, 96), 0, 2, "dense"),
    ("wide rows dim1", lambda: torch.randn(64, 1024), 1, 2, "2d"),
    ("3-D slice dim0: two levels merge", lambda: torch.randn(16, 8, 512)[:, :, :256], 0, 2, "2d"),
    ("3-D slice narrow rows", lambda: torch.randn(16, 8, 96)[:, :, :48], 0, 2, "span"),
    ("channels_last dim1 (channels)", lambda: cl(8, 6, 5, 4), 1, 2, "span"),
    ("channels_last dim0", lambda: cl(8, 6, 5, 4), 0, 2, "dense"),
    ("4-byte rows dim1", lambda: torch.randn(4096, 2), 1, 2, "span"),
    ("16-byte rows", lambda: torch.randn(4096, 8)[:, :4], 0, 2, "span"),
    ("two sparse levels", lambda: torch.randn(16, 64, 512)[:, :4, :256], 0, 2, "rows"),
    ("transposed dense", lambda: torch.randn(96, 64).t(), 0, 2, "span"),
    ("transposed, wide rows", lambda: torch.randn(1024, 256).t(), 0, 2, "2d"),
    ("complex, narrow rows", lambda: torch.randn(8, 16, dtype=torch.cfloat), 1, 2,
     "span"),
    ("expanded rows (a mask)", lambda: torch.randn(1, 512).expand(8, 512), 0, 2, "span"),
    ("expanded rows, 3-D", lambda: torch.randn(1, 1, 512).expand(4, 3, 512), 0, 2, "span"),
    ("overlapping rows (unfold)", lambda: torch.randn(1024).unfold(0, 512, 1), 0, 2, "span"),
    ("expanded level far apart", lambda: torch.randn(2, 100000)[:, :512].unsqueeze(1)
     .expand(2, 4, 512), 1, 2, "rows"),
    ("overlapping level far apart", lambda: torch.randn(2, 100000)[:, :1024].unfold(1, 512, 64),
     1, 2, "rows"),
]  # fmt: skip


@pytest.mark.parametrize("label,make,dim,n,kind", CASES, ids=[c[0] for c in CASES])
def test_pinned_chunks_are_copied_by_dma_without_a_host_temporary(label, make, dim, n, kind):
    for chunk in make().chunk(n, dim):
        route = route_of(chunk)
        assert route["kind"] in ("dense", "2d", "rows", "span")
        assert torch.equal(replay(chunk, route), expected(chunk)), (label, route)
    assert route_of(make().chunk(n, dim)[0])["kind"] == kind


def test_narrow_rows_are_not_a_2d_copy() -> None:
    for cols in (1, 2, 4, 16, 32):
        route = route_of(torch.randn(4096, 2 * cols)[:, :cols])  # rows of 4 to 128 bytes
        assert route["kind"] == "span" and route["width"] == cols * 4
    assert route_of(torch.randn(4096, 64)[:, :64])["kind"] == "dense"


def test_narrow_rows_far_apart_stay_a_2d_copy() -> None:
    """A span more than 4x the chunk's bytes is not worth moving: the 2-D copy, slow but right."""
    route = route_of(torch.randn(4096, 64)[:, :1])
    assert route["kind"] == "2d" and route["width"] == 4 and route["height"] == 4096


def test_a_pitch_above_the_devices_maximum_is_copied_row_by_row() -> None:
    args = ([2, 1 << 30], [1 << 31, 1], [1 << 30, 1], 1)
    route = ext._host_copy_route(*args, PITCH)
    assert route["kind"] == "rows" and route["spitch"] == 0 and route["width"] == 1 << 30
    assert route["outer_sizes"] == [2] and route["outer_sstrides"] == [1 << 31]
    assert ext._host_copy_route(*args, 1 << 32)["kind"] == "2d"  # a device that allows it


def test_expanded_and_overlapping_rows_are_never_a_2d_pitch() -> None:
    """A (4, 512) chunk of strides (0, 1) (an expanded mask) or (1, 1) (a sliding window): rows
    that repeat or overlap in the source are no pitch; the span covers them in one copy."""
    for strides in ([0, 1], [1, 1], [256, 1]):
        route = ext._host_copy_route([4, 512], strides, [512, 1], 4, PITCH)
        assert route["kind"] == "span" and route["span"] == (3 * strides[0] + 512) * 4, route
    far = ext._host_copy_route([2, 4, 512], [1 << 20, 0, 1], [2048, 512, 1], 4, PITCH)
    assert far["kind"] == "rows" and far["height"] == 1 and far["outer_sizes"] == [2, 4], far


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    data=st.data(),
)
def test_every_route_moves_the_chunks_bytes(shape, data) -> None:
    base = torch.arange(math.prod(shape) * 8, dtype=torch.int16).view(*shape[:-1], shape[-1] * 8)
    stops = [data.draw(st.integers(1, n)) for n in base.shape]
    view = base[tuple(slice(0, s) for s in stops)]
    if data.draw(st.booleans()) and view.dim() >= 2:
        view = view.transpose(0, -1)
    dim = data.draw(st.integers(0, view.dim() - 1))
    for chunk in view.chunk(2, dim):
        pitch = data.draw(st.sampled_from([PITCH, 64]))
        route = route_of(chunk, max_pitch=pitch)
        assert torch.equal(replay(chunk, route, pitch), expected(chunk)), route


def strided_view(data: st.DataObject) -> torch.Tensor:
    """A random view of a pinned-like source: levels expanded (stride 0), unfolded (overlapping
    or with gaps), permuted, sliced with steps, of size 0; channels_last; rows narrow and wide."""
    dtype = data.draw(st.sampled_from([torch.uint8, torch.int16, torch.float32, torch.float64]))
    shape = data.draw(st.lists(st.sampled_from([1, 2, 3, 5, 0]), min_size=0, max_size=3))
    shape.append(data.draw(st.sampled_from([64, 130, 1, 2, 3, 6, 80])))
    v = torch.arange(math.prod(shape), dtype=torch.float64).remainder(32749).to(dtype).view(shape)
    if v.dim() == 4 and data.draw(st.booleans()):
        v = v.contiguous(memory_format=torch.channels_last)
    for op in data.draw(st.lists(st.sampled_from(["expand", "unfold", "permute", "slice"]),
                                 max_size=3)):  # fmt: skip
        d = data.draw(st.integers(0, v.dim() - 1))
        if op == "expand" and v.dim() < 6:
            v = v.unsqueeze(d).expand(*v.shape[:d], data.draw(st.integers(0, 5)), *v.shape[d:])
        elif op == "expand":
            v = v.expand(*[data.draw(st.integers(0, 3)) if n == 1 else n for n in v.shape])
        elif op == "unfold" and v.shape[d] > 0:
            n = v.shape[d]
            win = data.draw(st.integers(1, n).map(lambda k, n=n: n + 1 - k))  # wide first
            v = v.unfold(d, win, data.draw(st.integers(1, win + 1)))
        elif op == "permute":
            v = v.permute(data.draw(st.permutations(range(v.dim()))))
        elif op == "slice":
            start = data.draw(st.integers(0, v.shape[d]))
            stop = data.draw(st.integers(start, v.shape[d]))
            v = v[(slice(None),) * d + (slice(start, stop, data.draw(st.integers(1, 3))),)]
    return v


@settings(
    max_examples=int(os.environ.get("FASTDP_HYPOTHESIS_EXAMPLES", "400")),
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_the_route_of_any_strided_pinned_view_replays_torchs_copy(data) -> None:
    """Every chunk of a random view: the route's DMAs (a 2-D copy's pitches at least its width and
    within the device's maximum) move the bytes torch's copy does."""
    view = strided_view(data)
    dim = data.draw(st.integers(0, view.dim() - 1))
    pitch = data.draw(st.sampled_from([PITCH, 64, 1024]))
    for chunk in view.chunk(data.draw(st.integers(1, 4)), dim):
        route = route_of(chunk, max_pitch=pitch)
        assert torch.equal(replay(chunk, route, pitch), expected(chunk)), (chunk.stride(), route)


# ------------------------------------------------------------------ pageable staging rows
@pytest.mark.parametrize(
    "shape,memory_format,window,want",
    [
        ((2, 3, 1024, 1024), torch.contiguous_format, 4 * MiB, (1, 3, 4 * MiB, [0])),
        ((16, 1 << 20), torch.contiguous_format, 4 * MiB, (0, 16, 4 * MiB, [])),
        ((2, 3, 1024, 1024), torch.contiguous_format, 0, (0, 2, 12 * MiB, [])),
        ((2, 3, 1024, 1024), torch.channels_last, 4 * MiB, (2, 1024, 12 << 10, [0])),
        ((5,), torch.contiguous_format, MiB, (0, 5, 4, [])),
    ],
)
def test_pageable_chunks_are_staged_by_rows_that_fit_the_window(
    shape, memory_format, window, want
) -> None:
    t = torch.empty(shape).contiguous(memory_format=memory_format)
    got = ext._stage_rows(list(t.shape), list(t.stride()), 4, window)
    assert tuple(got[:3]) == want[:3] and list(got[3]) == want[3]


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 64), min_size=1, max_size=4), window=st.integers(4, 1 << 16))
def test_staging_rows_never_exceed_the_window(shape, window) -> None:
    t = torch.empty(shape)
    dim, count, nbytes, outer = ext._stage_rows(shape, list(t.stride()), 4, window)
    assert nbytes <= window
    assert count == (shape[dim] if dim >= 0 else 1)
    assert all(o != dim and shape[o] > 1 for o in outer)
