"""fastdp._C.scatter_chunks against the torch reference ``leaf.split(splits, dim)[r].to(device)``.

Bit-exact: values, dtype, shape and strides. CPU cases run everywhere (the CPU implementation);
CUDA cases skip without a GPU, the distinct-GPU case without two.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from fastdp._planner import splits_for
from fastdp.testing import DTYPES, EXT_CUDA, onlyCUDAExt, onlyMultiGPUExt

try:
    from fastdp import _C
except ImportError as e:  # pragma: no cover - no build
    pytest.skip(f"fastdp._C not importable: {e}", allow_module_level=True)
if not hasattr(_C, "scatter_chunks"):
    pytest.skip("fastdp._C has no scatter_chunks", allow_module_level=True)


def make(shape, dtype, device="cpu"):
    g = torch.Generator().manual_seed(hash((tuple(shape), str(dtype))) % 2**31)
    if dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=g).bool()
    elif dtype == torch.int64:
        t = torch.randint(-(2**40), 2**40, shape, generator=g)
    elif dtype.is_complex:
        t = torch.randn(shape, dtype=dtype, generator=g)
    else:
        t = torch.randn(shape, generator=g).to(dtype)
    return t.to(device)


# name -> (factory(dtype, batch), dims it can be split along)
LAYOUTS = {
    "contiguous": (lambda dt, b: make((b, 6), dt), [0, 1, -1]),
    "one_element": (lambda dt, b: make((1,), dt), [0, -1]),
    "zero_rows": (lambda dt, b: make((0, 3), dt), [0, 1, -1]),
    "zero_cols": (lambda dt, b: make((b, 0), dt), [0, 1, -1]),
    "transposed": (lambda dt, b: make((7, b), dt).t(), [0, 1, -1]),
    "sliced": (lambda dt, b: make((b, 11), dt)[:, 1::3], [0, 1, -1]),
    "channels_last": (
        lambda dt, b: make((b, 3, 4, 5), dt).contiguous(memory_format=torch.channels_last),
        [0, 1, -1],
    ),
}


def splits_of(leaves, n, dim):
    return splits_for([t.size(dim) for t in leaves], n, None)


def reference(leaves, splits, dim, devices):
    return [
        [leaf.split(splits[i], dim)[r].to(devices[r]) for i, leaf in enumerate(leaves)]
        for r in range(len(splits[0]) if splits else 0)
    ]


def assert_same(got, want, *, view_of=None):
    assert len(got) == len(want)
    for row_got, row_want in zip(got, want):
        assert len(row_got) == len(row_want)
        for g, w in zip(row_got, row_want):
            assert g.device == w.device
            assert g.dtype == w.dtype
            assert g.shape == w.shape
            assert g.stride() == w.stride(), (g.stride(), w.stride())
            assert g.is_conj() == w.is_conj()
            assert torch.equal(g.resolve_conj(), w.resolve_conj())
            assert not g.requires_grad


def run_case(leaves, n, dim, devices):
    splits = splits_of(leaves, n, dim)
    got = _C.scatter_chunks(leaves, splits, dim, devices[: len(splits[0])])
    want = reference(leaves, splits, dim, devices)
    assert_same(got, want)
    return got, want, splits


# ---------------------------------------------------------------- CPU (CPU-replica mode)

CPU_CASES = [
    (layout, dtype, dim, n)
    for layout, (_, dims) in LAYOUTS.items()
    for dtype, dim, n in itertools.product(DTYPES, dims, [1, 2, 3, 8])
]


@pytest.mark.parametrize(
    "layout,dtype,dim,n", CPU_CASES, ids=[f"{a}-{str(b)[6:]}-d{c}-n{d}" for a, b, c, d in CPU_CASES]
)
def test_scatter_cpu_matches_split_to(layout, dtype, dim, n):
    factory, _ = LAYOUTS[layout]
    leaf = factory(dtype, 10)
    got, _, _ = run_case([leaf], n, dim, [torch.device("cpu")] * n)
    for row in got:  # CPU chunks are views of the leaf (no copy), as in torch
        assert row[0].untyped_storage().data_ptr() == leaf.untyped_storage().data_ptr()


@pytest.mark.parametrize("n", range(1, 9))
def test_scatter_cpu_fused_mixed_dtypes_one_call(n):
    leaves = [make((13, 4), dt) for dt in DTYPES] + [make((13, 2, 3), torch.float32)[:, :, ::2]]
    run_case(leaves, n, 0, [torch.device("cpu")] * n)


def test_scatter_cpu_negative_dim_normalised_per_leaf():
    leaves = [make((3, 8), torch.float32), make((2, 5, 8), torch.int64)]
    got, _, splits = run_case(leaves, 3, -1, [torch.device("cpu")] * 3)
    assert [t.size(-1) for t in got[0]] == [splits[0][0], splits[1][0]]


def test_scatter_cpu_conj_view_stays_lazy():
    leaf = make((6, 3), torch.complex64).conj()
    run_case([leaf], 3, 0, [torch.device("cpu")] * 3)


def test_scatter_cpu_fewer_chunks_than_devices():
    leaf = make((3, 2), torch.float32)
    got, _, splits = run_case([leaf], 8, 0, [torch.device("cpu")] * 8)
    assert len(splits[0]) == 3 and len(got) == 3


def test_scatter_cpu_explicit_chunk_sizes_with_zero():
    leaf = make((5, 2), torch.float32)
    splits = splits_for([5], 3, [2, 0, 3])
    got = _C.scatter_chunks([leaf], splits, 0, [torch.device("cpu")] * 3)
    assert_same(got, reference([leaf], splits, 0, [torch.device("cpu")] * 3))


def test_scatter_cpu_results_carry_no_autograd_history():
    leaf = make((4, 3), torch.float32).requires_grad_()
    got = _C.scatter_chunks([leaf], [[2, 2]], 0, [torch.device("cpu")] * 2)
    assert all(t.grad_fn is None for row in got for t in row)
    with torch.no_grad():  # views of a leaf report its requires_grad, as torch's own do
        want = leaf.split([2, 2])
    assert [row[0].requires_grad for row in got] == [t.requires_grad for t in want]


def test_scatter_rejects_splits_not_summing_to_size():
    with pytest.raises(RuntimeError, match=r"scatter_chunks: chunk sizes of leaf 0 sum to 3"):
        _C.scatter_chunks([torch.zeros(4)], [[1, 2]], 0, [torch.device("cpu")] * 2)


def test_scatter_rejects_more_chunks_than_devices():
    with pytest.raises(RuntimeError, match="only 1 devices"):
        _C.scatter_chunks([torch.zeros(4)], [[2, 2]], 0, [torch.device("cpu")])


def test_scatter_rejects_0_dim_leaf():
    with pytest.raises(RuntimeError, match="0-dimensional"):
        _C.scatter_chunks([torch.tensor(1.0)], [[1]], 0, [torch.device("cpu")])


def test_scatter_no_leaves_gives_no_replicas():
    assert _C.scatter_chunks([], [], 0, [torch.device("cpu")]) == []


@pytest.mark.skipif(EXT_CUDA, reason="checks the CPU-only build's error")
def test_scatter_cuda_device_without_cuda_build_raises():
    if dict(_C.build_info()).get("built_with_cuda") == "1":
        pytest.skip("CUDA build")
    with pytest.raises(RuntimeError, match="built without CUDA"):
        _C.scatter_chunks([torch.zeros(2)], [[1, 1]], 0, [torch.device("cuda", 0)] * 2)


@pytest.mark.skipif(
    dict(_C.build_info()).get("built_with_cuda") != "1" or torch.cuda.device_count() > 0,
    reason="checks a CUDA build on a machine without a GPU",
)
def test_scatter_cuda_build_without_gpu_raises_clearly():
    with pytest.raises(RuntimeError, match="scatter_chunks: expected CUDA device indices below 0"):
        _C.scatter_chunks([torch.zeros(2)], [[1, 1]], 0, [torch.device("cuda", 0)] * 2)


# ---------------------------------------------------------------- CUDA


def cuda_devices(n):
    return [torch.device("cuda", 0)] * n


@onlyCUDAExt
@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
@pytest.mark.parametrize(
    "layout,dtype,dim,n",
    [c for c in CPU_CASES if c[3] in (1, 3, 8)],
    ids=[f"{a}-{str(b)[6:]}-d{c}-n{d}" for a, b, c, d in CPU_CASES if d in (1, 3, 8)],
)
def test_scatter_host_to_cuda_matches_split_to(layout, dtype, dim, n, pinned):
    leaf = LAYOUTS[layout][0](dtype, 10)
    if pinned:
        leaf = leaf.pin_memory()
    got, _, _ = run_case([leaf], n, dim, cuda_devices(n))
    torch.cuda.synchronize()
    assert dict(_C.pinned_pool_stats())["lent"] == 0


@onlyCUDAExt
@pytest.mark.parametrize(
    "layout,dtype,dim,n",
    [c for c in CPU_CASES if c[3] in (2, 8)],
    ids=[f"{a}-{str(b)[6:]}-d{c}-n{d}" for a, b, c, d in CPU_CASES if d in (2, 8)],
)
def test_scatter_cuda_source_same_device_gives_views(layout, dtype, dim, n):
    leaf = LAYOUTS[layout][0](dtype, 10).cuda()
    got, _, _ = run_case([leaf], n, dim, cuda_devices(n))
    for row in got:
        assert row[0].untyped_storage().data_ptr() == leaf.untyped_storage().data_ptr()


@onlyCUDAExt
@pytest.mark.parametrize("n", range(1, 9))
def test_scatter_host_fused_mixed_dtypes_share_one_buffer_per_device(n):
    leaves = [make((13, 4), dt) for dt in DTYPES]
    leaves.append(make((13, 3, 2), torch.float32).transpose(1, 2))
    got, _, _ = run_case(leaves, n, 0, cuda_devices(n))
    for row in got:  # one buffer per destination: every chunk of a replica shares its storage
        ptrs = {t.untyped_storage().data_ptr() for t in row if t.numel()}
        assert len(ptrs) == 1
        for t in row:
            assert t.data_ptr() % 256 == 0


@onlyCUDAExt
def test_scatter_host_large_input_pipelines_through_small_pool():
    prev = _C.pinned_pool_set_capacity(4 << 20)
    try:
        leaves = [
            make((64, 1 << 16), torch.float32),
            make((64, 3, 1000), torch.float16)[:, 1],
            make((64, 1 << 15), torch.int64).pin_memory(),  # large pinned chunks go direct
        ]
        run_case(leaves, 3, 0, cuda_devices(3))
        torch.cuda.synchronize()
        stats = dict(_C.pinned_pool_stats())
        assert stats["reserved"] <= 4 << 20 and stats["lent"] == 0
    finally:
        _C.pinned_pool_set_capacity(prev)


@onlyCUDAExt
def test_scatter_host_with_pool_disabled_falls_back_to_torch_copies():
    prev = _C.pinned_pool_set_capacity(0)
    try:
        run_case([make((9, 5), torch.float32), make((9, 2), torch.bool)], 4, 0, cuda_devices(4))
    finally:
        _C.pinned_pool_set_capacity(prev)


@onlyCUDAExt
def test_scatter_cuda_oom_leaks_no_pinned_block_and_next_call_works():
    leaf = make((256, 1 << 18), torch.float32)  # 256 MiB
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(0.0001, 0)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            _C.scatter_chunks([leaf], [[128, 128]], 0, cuda_devices(2))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    torch.cuda.synchronize()
    assert dict(_C.pinned_pool_stats())["lent"] == 0
    run_case([make((8, 4), torch.float32)], 2, 0, cuda_devices(2))


@onlyCUDAExt
def test_scatter_current_stream_sees_the_copies():
    s = torch.cuda.Stream()
    leaf = make((1 << 12, 1 << 10), torch.float32)
    with torch.cuda.stream(s):
        got = _C.scatter_chunks([leaf], [[1 << 11, 1 << 11]], 0, cuda_devices(2))
        total = got[0][0].sum() + got[1][0].sum()  # on s, without any synchronize
    torch.cuda.synchronize()
    assert torch.allclose(total.cpu(), leaf.sum(), rtol=1e-4)


@onlyMultiGPUExt
@pytest.mark.parametrize("source", ["cpu", "cuda:0"])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter_distinct_gpus(source, dim):
    devices = [torch.device("cuda", k) for k in range(torch.cuda.device_count())]
    leaves = [make((16, 12), dt, source) for dt in (torch.float32, torch.bfloat16, torch.bool)] + [
        make((16, 3, 4, 5), torch.float16, source).contiguous(memory_format=torch.channels_last)
    ]
    run_case(leaves, len(devices), dim, devices)


# ---------------------------------------------------------------- fastdp.comm dispatch


def test_comm_scatter_leaves_extension_and_torch_paths_agree(backend):
    from fastdp import comm

    cpu = [torch.device("cpu")] * 4
    leaves = [make((3, 5), torch.float32), make((3, 2, 2), torch.int64).transpose(1, 2)]
    splits = splits_of(leaves, 4, 0)  # 3 rows on 4 devices: 3 replicas
    got = comm.scatter_leaves(leaves, cpu, splits, [0, 0])
    assert len(got) == 4 and got[3] == []  # one list per device, as the torch path gives
    assert_same(got[:3], reference(leaves, splits, 0, cpu))


def test_comm_scatter_per_leaf_dims(backend):
    from fastdp import comm

    cpu = [torch.device("cpu")] * 2
    leaves = [make((4, 6), torch.float32), make((6, 4), torch.float16)]
    got = comm.scatter_leaves(leaves, cpu, [[2, 2], [2, 2]], [0, 1])
    want = [[leaves[0].split(2, 0)[r], leaves[1].split(2, 1)[r]] for r in range(2)]
    assert_same(got, want)
