"""fastdp._C.gather_into against the torch reference ``torch.cat([t.to(dst) for t in ts], dim)``.

Bit-exact: values, dtype, shape and strides (memory format included). CPU cases run everywhere
(the CPU implementation); CUDA cases skip without a GPU, the distinct-GPU case without two.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from fastdp.testing import DTYPES, onlyCUDAExt, onlyMultiGPUExt

try:
    from fastdp import _C
except ImportError as e:  # pragma: no cover - no build
    pytest.skip(f"fastdp._C not importable: {e}", allow_module_level=True)
if not hasattr(_C, "gather_into"):
    pytest.skip("fastdp._C has no gather_into", allow_module_level=True)


def make(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, shape, generator=g)
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def _cl(t):
    return t.contiguous(memory_format=torch.channels_last)


# name -> (factory(dtype, dim, k): the k-th replica's output for a gather along dim, dims)
# Replica k has k + 1 rows along the gather dim so slices have different sizes.
LAYOUTS = {
    "contiguous": (lambda dt, d, k: make(_shape((4, 6), d, k + 1), dt, k), [0, 1, -1]),
    "one_element": (lambda dt, d, k: make((1,), dt, k), [0, -1]),
    "zero_size": (lambda dt, d, k: make(_shape((0, 3), d, k), dt, k), [0, 1, -1]),
    "transposed": (
        lambda dt, d, k: make(_shape((5, 4), d, k + 1), dt, k).t().contiguous().t(),
        [0, 1, -1],
    ),
    "sliced": (lambda dt, d, k: make(_shape((4, 9), d, k + 1, 3), dt, k)[:, ::3], [0, 1, -1]),
    "channels_last": (
        lambda dt, d, k: _cl(make(_shape((2, 3, 4, 5), d, k + 1), dt, k)),
        [0, 1, -1],
    ),
}


def _shape(base, dim, size, scale=1):
    s = list(base)
    s[dim] = size * scale
    return tuple(s)


def reference(tensors, dim, destination):
    return torch.cat([t.to(destination) for t in tensors], dim)


def assert_same(got, want):
    assert got.device == want.device
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.stride() == want.stride(), (got.stride(), want.stride())
    assert not got.is_conj()
    assert torch.equal(got, want)


def run_case(tensors, dim, destination):
    got = _C.gather_into(tensors, dim, torch.device(destination))
    want = reference(tensors, dim, torch.device(destination))
    assert_same(got, want)
    return got


def replicas(layout, dtype, dim, n, device="cpu"):
    factory, _ = LAYOUTS[layout]
    # "transposed" along dim 1 must stay transposed after the shape change: build, then move.
    return [factory(dtype, dim, k).to(device) for k in range(n)]


CASES = [
    (layout, dtype, dim, n)
    for layout, (_, dims) in LAYOUTS.items()
    for dtype, dim, n in itertools.product(DTYPES, dims, [1, 2, 3, 8])
]
IDS = [f"{a}-{str(b)[6:]}-d{c}-n{d}" for a, b, c, d in CASES]


# ---------------------------------------------------------------- CPU


@pytest.mark.parametrize("layout,dtype,dim,n", CASES, ids=IDS)
def test_gather_cpu_matches_cat(layout, dtype, dim, n):
    run_case(replicas(layout, dtype, dim, n), dim, "cpu")


@pytest.mark.parametrize("dim", [0, 1, 2, 3, -1])
def test_gather_cpu_preserves_channels_last(dim):
    # k + 2: a size-1 dim makes channels_last ambiguous and torch.cat then picks contiguous
    ts = [_cl(make(_shape((2, 3, 4, 5), dim, k + 2), torch.float32, k)) for k in range(3)]
    out = run_case(ts, dim, "cpu")
    assert out.is_contiguous(memory_format=torch.channels_last)


AMBIGUOUS = [  # contiguous fast path vs torch.cat's memory format rules: "Contiguous cat
    # output without the meta device" in csrc/copy_layout.cpp
    ((2, 1, 3, 3), False),
    ((2, 1, 3, 3), True),
    ((2, 3, 1, 1), False),
    ((2, 3, 1, 1), True),
    ((1, 1, 1, 1), False),
    ((2, 1, 1, 3), True),
    ((4,), False),
    ((0, 3), False),
    ((3, 0), False),
]


@pytest.mark.parametrize("shape,channels_last", AMBIGUOUS)
@pytest.mark.parametrize("dim", [0, -1])
def test_gather_cpu_size_one_and_empty_dims_match_cat(shape, channels_last, dim):
    import torch._dynamo  # noqa: F401  (replaces cat's meta kernel with torch._refs.cat)

    ts = [make(shape, torch.float32, k) for k in range(3)]
    if channels_last:
        ts[1] = _cl(ts[1])
    run_case(ts, dim, "cpu")


def test_gather_cpu_mixed_memory_formats_give_contiguous():
    ts = [_cl(make((2, 3, 4, 5), torch.float32, 0)), make((2, 3, 4, 5), torch.float32, 1)]
    assert run_case(ts, 0, "cpu").is_contiguous()


def test_gather_cpu_conj_and_neg_sources_are_materialised():
    a = make((3, 2), torch.complex64, 0).conj()
    b = torch.ops.aten._neg_view(make((2, 2), torch.complex64, 1))
    run_case([a, b, make((1, 2), torch.complex64, 2)], 0, "cpu")


def test_gather_cpu_many_small_tensors_in_parallel():
    ts = [make((k % 3 + 1, 7), torch.float32, k) for k in range(64)]
    run_case(ts, 0, "cpu")
    run_case([t.t() for t in ts], 1, "cpu")


def test_gather_cpu_expanded_source():
    ts = [make((1, 4), torch.float32, 0).expand(3, 4), make((2, 4), torch.float32, 1)]
    run_case(ts, 0, "cpu")


def test_gather_cpu_skips_legacy_empty_tensor_like_cat():
    ts = [make((2, 3), torch.float32, 0), torch.empty(0), make((1, 3), torch.float32, 1)]
    run_case(ts, 0, "cpu")


def test_gather_cpu_all_empty():
    run_case([torch.empty(0, 3), torch.empty(0, 3)], 0, "cpu")


def test_gather_cpu_output_is_fresh_memory():
    ts = [make((2, 3), torch.float32, 0)]
    out = _C.gather_into(ts, 0, torch.device("cpu"))
    assert out.data_ptr() != ts[0].data_ptr()


def test_gather_rejects_mixed_dtypes():
    with pytest.raises(RuntimeError, match=r"gather_into: expected every tensor to have dtype"):
        _C.gather_into(
            [torch.zeros(2), torch.zeros(2, dtype=torch.float64)], 0, torch.device("cpu")
        )


def test_gather_rejects_empty_list():
    with pytest.raises(RuntimeError, match="at least one tensor"):
        _C.gather_into([], 0, torch.device("cpu"))


def test_gather_rejects_ndim_mismatch_with_torch_cat_text():
    with pytest.raises(RuntimeError, match="same number of dimensions: got 2 and 3"):
        _C.gather_into([torch.zeros(2, 3), torch.zeros(1, 2, 3)], 0, torch.device("cpu"))


def test_gather_rejects_mismatched_shapes_like_cat():
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        _C.gather_into([torch.zeros(2, 3), torch.zeros(2, 4)], 0, torch.device("cpu"))


def test_gather_result_has_no_autograd_history():
    ts = [make((2, 3), torch.float32, 0).requires_grad_(), make((2, 3), torch.float32, 1)]
    out = _C.gather_into(ts, 0, torch.device("cpu"))
    assert not out.requires_grad and out.grad_fn is None


# ---------------------------------------------------------------- CUDA

CUDA_CASES = [c for c in CASES if c[3] in (1, 3, 8)]
CUDA_IDS = [f"{a}-{str(b)[6:]}-d{c}-n{d}" for a, b, c, d in CUDA_CASES]


@onlyCUDAExt
@pytest.mark.parametrize("destination", ["cuda:0", "cpu"])
@pytest.mark.parametrize("layout,dtype,dim,n", CUDA_CASES, ids=CUDA_IDS)
def test_gather_cuda_sources_match_cat(layout, dtype, dim, n, destination):
    run_case(replicas(layout, dtype, dim, n, "cuda:0"), dim, destination)
    torch.cuda.synchronize()
    assert dict(_C.pinned_pool_stats())["lent"] == 0


@onlyCUDAExt
@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
def test_gather_host_sources_to_cuda(pinned):
    ts = [make((k + 1, 6), torch.float32, k) for k in range(3)]
    ts = [t.pin_memory() for t in ts] if pinned else ts
    run_case(ts, 0, "cuda:0")
    run_case([t.t() for t in ts], 1, "cuda:0")


@onlyCUDAExt
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gather_cuda_preserves_channels_last(dim):
    ts = [_cl(make(_shape((2, 3, 4, 5), dim, k + 2), torch.float16, k)).cuda() for k in range(4)]
    assert run_case(ts, dim, "cuda:0").is_contiguous(memory_format=torch.channels_last)


@onlyCUDAExt
def test_gather_cuda_conj_sources_and_large_strided():
    ts = [make((300, 257), torch.complex64, k).cuda().conj() for k in range(3)]
    run_case(ts, 1, "cuda:0")
    run_case([make((1000, 3000), torch.float32, k).cuda()[:, ::3] for k in range(2)], 1, "cpu")


@onlyCUDAExt
def test_gather_cuda_current_stream_orders_the_copies():
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        ts = [torch.full((1 << 20,), float(k), device="cuda:0") for k in range(4)]
        out = _C.gather_into(ts, 0, torch.device("cuda:0"))
        total = out.sum()
    torch.cuda.synchronize()
    assert total.item() == float(sum(range(4)) * (1 << 20))


@onlyMultiGPUExt
@pytest.mark.parametrize("destination", ["cuda:0", "cuda:1", "cpu"])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gather_distinct_gpus(destination, dim):
    n = torch.cuda.device_count()
    for dtype in (torch.float32, torch.bfloat16, torch.bool, torch.complex64):
        ts = [make(_shape((3, 4, 5), dim, k + 1), dtype, k).to(f"cuda:{k}") for k in range(n)]
        run_case(ts, dim, destination)
        run_case([t.transpose(0, -1).contiguous().transpose(0, -1) for t in ts], dim, destination)


# ---------------------------------------------------------------- fastdp.comm dispatch


def test_comm_gather_extension_and_torch_paths_agree(backend):
    from fastdp import comm

    ts = [_cl(make((k + 2, 3, 4, 5), torch.float32, k)) for k in range(3)]
    assert_same(comm.gather(ts, 0, "cpu"), torch.cat(ts, 0))
    assert_same(
        comm.gather([t.t() for t in [make((3, 2), torch.bool, 0)] * 2], 1, -1),
        torch.cat([make((3, 2), torch.bool, 0).t()] * 2, 1),
    )


def test_comm_gather_mixed_dtypes_take_the_torch_path(backend):
    from fastdp import comm

    ts = [torch.ones(2), torch.ones(2, dtype=torch.float64)]
    assert_same(comm.gather(ts, 0, "cpu"), torch.cat(ts))
