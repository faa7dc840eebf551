"""fastdp._C.reduce_add_coalesced against torch.nn.parallel.comm.reduce_add_coalesced semantics.

Bit-exact against list order, ``x0 + x1`` then ``add_`` of the rest (fastdp.comm's torch path, and
torch's non-NCCL reduce_add for two lists), and against fastdp.comm with the extension disabled;
within float tolerance against a float64 ``sum``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from _comm_ext_utils import (
    CPU,
    DTYPES,
    NUM_DEVICES,
    _list_order_sum,
    _rand,
    _same_bits,
    ext_op,
    requires_ext,
)

pytestmark = requires_ext("reduce_add_coalesced")
reduce_add = ext_op("reduce_add_coalesced")


def _lists(n, shapes, dtype):
    return [[_rand(s, dtype) for s in shapes] for _ in range(n)]


@pytest.mark.parametrize("dtype,n", list(itertools.product(DTYPES, NUM_DEVICES)))
def test_reduce_matches_torch_order_bit_exact(dtype, n):
    lists = _lists(n, [(4, 5), (7,), (), (0,)], dtype)
    out = reduce_add(lists, CPU, 10485760)
    if n == 1:  # contiguous clones
        assert all(
            _same_bits(a, b) and a.data_ptr() != b.data_ptr() or a.numel() == 0
            for a, b in zip(out, lists[0])
        )
        return
    ref = _list_order_sum(lists)
    assert all(_same_bits(a, b) for a, b in zip(out, ref))


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64]
)
def test_reduce_close_to_sum(dtype):
    lists = _lists(5, [(33, 9), (129,)], dtype)
    out = reduce_add(lists, CPU, 10485760)
    real = torch.float32 if dtype.is_complex else dtype
    for j, o in enumerate(out):
        wide = [lst[j].to(torch.complex128 if dtype.is_complex else torch.float64) for lst in lists]
        ref = sum(wide)
        # 4 roundings, each within one ulp of the running magnitude
        atol = 4 * torch.finfo(real).eps * max(sum(w.abs() for w in wide).max().item(), 1.0)
        torch.testing.assert_close(o.to(ref.dtype), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool])
def test_reduce_integers_exact(dtype):
    lists = _lists(4, [(100,), (3, 3)], dtype)
    out = reduce_add(lists, CPU, 10485760)
    for j, o in enumerate(out):
        ref = lists[0][j].clone()
        for lst in lists[1:]:
            ref = ref + lst[j]
        assert torch.equal(o, ref)


def test_reduce_results_are_fresh_tensors():
    lists = _lists(3, [(3, 4), (5,)], torch.float32)
    out = reduce_add(lists, CPU, 10485760)
    inputs = {t.untyped_storage().data_ptr() for lst in lists for t in lst}
    assert all(o.untyped_storage().data_ptr() not in inputs for o in out)
    before = [t._version for lst in lists for t in lst]
    out[0].add_(1)
    assert [t._version for lst in lists for t in lst] == before
    assert out[1]._version == 0
    assert all(o.is_contiguous() and not o.requires_grad for o in out)


def test_reduce_many_small_tensors_several_buckets():
    shapes = [(5,)] * 30 + [(2, 2)] * 10
    lists = [
        [_rand(s, torch.float32) for s in shapes] + [_rand((3,), torch.int64)] for _ in range(4)
    ]
    out = reduce_add(lists, CPU, 48)
    ref = _list_order_sum(lists)
    assert all(_same_bits(a, b) for a, b in zip(out, ref))
    assert len({o.untyped_storage().data_ptr() for o in out}) > 10


def test_reduce_non_contiguous_inputs():
    lists = [
        [
            torch.randn(5, 4).t(),
            torch.randn(12)[::2],
            torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last),
        ]
        for _ in range(3)
    ]
    out = reduce_add(lists, CPU, 10485760)
    ref = _list_order_sum(lists)
    assert all(_same_bits(a, b.contiguous()) for a, b in zip(out, ref))
    assert all(o.is_contiguous() for o in out)


def test_reduce_large_bucket_uses_all_threads_consistently():
    lists = _lists(3, [(1 << 20,), (12345,)], torch.float32)
    out = reduce_add(lists, CPU, 1 << 30)
    ref = _list_order_sum(lists)
    assert all(_same_bits(a, b) for a, b in zip(out, ref))


def test_reduce_requires_destination_among_inputs():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only message")
    with pytest.raises(RuntimeError, match="no CUDA support|must be the device of one"):
        reduce_add(_lists(2, [(3,)], torch.float32), torch.device("cuda", 0), 1024)


def test_reduce_rejects_sparse():
    lists = [[torch.randn(3, 3).to_sparse()] for _ in range(2)]
    with pytest.raises(RuntimeError, match="fastdp.reduce_add_coalesced: only dense"):
        reduce_add(lists, CPU, 1024)


def test_reduce_rejects_mismatched_inputs():
    with pytest.raises(RuntimeError, match="has dtype"):
        reduce_add([[torch.randn(3)], [torch.randn(4)]], CPU, 1024)
    with pytest.raises(RuntimeError, match="has dtype"):
        reduce_add([[torch.randn(3)], [torch.randn(3).double()]], CPU, 1024)
    with pytest.raises(RuntimeError, match="expected 1 like inputs"):
        reduce_add([[torch.randn(3)], []], CPU, 1024)


def test_reduce_unsupported_dtype_names_op():
    lists = [[torch.zeros(3, dtype=torch.float8_e4m3fn)] for _ in range(2)]
    with pytest.raises(RuntimeError, match="reduce_add_coalesced"):
        reduce_add(lists, CPU, 1024)


def test_reduce_empty_lists():
    assert reduce_add([[], []], CPU, 1024) == []
