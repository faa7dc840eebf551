"""The host-side decisions of host-to-GPU copies (csrc/host_copy_route.h), in any build.

``_C._host_copy_route``: how a pinned chunk is copied without a host temporary (NOTE [ Stream order
of host copies ]); each route is replayed here on bytes, as the DMAs would move them, and compared
with the chunk. ``_C._stage_rows``: the rows a pageable chunk is packed by, never wider than the
staging window. The GPU halves are in tests/test_gpu_pool_and_streams.py.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
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


def replay(chunk: torch.Tensor, route: dict, max_pitch: int = PITCH) -> torch.Tensor:
    """The destination's bytes after the route's copies (span: its source bytes, then the device
    copy, which is torch's)."""
    item = chunk.element_size()
    src = chunk.untyped_storage()
    base = chunk.storage_offset() * item
    host = torch.frombuffer(bytearray(bytes(src)), dtype=torch.uint8)
    nbytes = chunk.numel() * item
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    if route["kind"] == "span":
        assert base + route["span"] <= src.nbytes() and route["span"] <= 4 * nbytes
        last = sum((n - 1) * s for n, s in zip(chunk.shape, chunk.stride())) * item + item
        assert route["span"] == last  # covers the chunk's last byte, and no more
        out = torch.empty_strided(chunk.shape, dst_strides(chunk), dtype=chunk.dtype)
        out.copy_(chunk)
        return torch.frombuffer(bytearray(bytes(out.untyped_storage())), dtype=torch.uint8)
    w, h, sp, dp = route["width"], route["height"], route["spitch"], route["dpitch"]
    outer = route["outer_sizes"]
    for idx in itertools.product(*[range(n) for n in outer]):
        so = base + sum(i * s for i, s in zip(idx, route["outer_sstrides"]))
        do = sum(i * s for i, s in zip(idx, route["outer_dstrides"]))
        for r in range(h if sp else 1):
            assert sp <= max_pitch and dp <= max_pitch
            dst[do + r * dp : do + r * dp + w] = host[so + r * sp : so + r * sp + w]
    return dst


def expected(chunk: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(chunk.shape, dst_strides(chunk), dtype=chunk.dtype)
    out.copy_(chunk)
    return torch.frombuffer(bytearray(bytes(out.untyped_storage())), dtype=torch.uint8)


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
