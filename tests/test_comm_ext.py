"""fastdp._C.broadcast_coalesced(_into) against torch.nn.parallel.comm.broadcast_coalesced.

Reference: ``t.clone()``, bit for bit. CPU "devices" (virtual replicas) here; the CUDA and NCCL
variants are in test_comm_ext_cuda.py, reduce in test_comm_ext_reduce.py.
"""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
from _comm_ext_utils import (
    CPU,
    DTYPES,
    NUM_DEVICES,
    _mixed,
    _rand,
    _same_bits,
    ext_op,
    requires_ext,
)

pytestmark = requires_ext("broadcast_coalesced", "broadcast_coalesced_into")
bcast = ext_op("broadcast_coalesced")
bcast_into = ext_op("broadcast_coalesced_into")


# ---- broadcast_coalesced -------------------------------------------------------------------


@pytest.mark.parametrize("dtype,n", list(itertools.product(DTYPES, NUM_DEVICES)))
def test_broadcast_bit_exact_per_dtype(dtype, n):
    ts = [_rand((4, 5), dtype), _rand((7,), dtype), _rand((), dtype)]
    refs = [t.clone() for t in ts]
    result = bcast(ts, [CPU] * n, 10485760)
    assert len(result) == n
    for copies in result:
        assert all(_same_bits(c, r) for c, r in zip(copies, refs))


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_broadcast_mixed_dtypes_and_shapes_bit_exact(n):
    ts = _mixed()
    result = bcast(ts, [CPU] * n, 10485760)
    for copies in result[1:]:
        assert [c.shape for c in copies] == [t.shape for t in ts]
        assert all(_same_bits(c, t) for c, t in zip(copies, ts))


def test_broadcast_result0_is_the_inputs():
    ts = _mixed()
    result = bcast(ts, [CPU] * 3, 10485760)
    assert all(a is b for a, b in zip(result[0], ts))


def test_broadcast_copies_have_their_own_storage():
    ts = [t for t in _mixed() if t.numel() > 0]
    result = bcast(ts, [CPU] * 4, 10485760)
    ptrs = {t.untyped_storage().data_ptr() for t in ts}
    for copies in result[1:]:
        assert all(c.untyped_storage().data_ptr() not in ptrs for c in copies)
        assert all(c.data_ptr() != t.data_ptr() for c, t in zip(copies, ts))
    # Different destinations never share memory either.
    assert {c.data_ptr() for c in result[1]}.isdisjoint({c.data_ptr() for c in result[2]})


def test_broadcast_version_counters_independent():
    ts = [torch.randn(3, 4), torch.randn(5)]
    result = bcast(ts, [CPU] * 3, 10485760)
    before = [t._version for t in ts]
    neighbour = result[1][1]._version
    result[1][0].add_(1)
    result[2][0].mul_(2)
    assert [t._version for t in ts] == before  # the originals are untouched
    assert result[1][1]._version == neighbour  # a view in the same bucket keeps its own counter
    assert torch.equal(ts[0] + 1, result[1][0])


def test_broadcast_zero_size_and_one_element():
    ts = [torch.zeros(0), torch.ones(1), torch.empty(3, 0, dtype=torch.int64), torch.tensor(2.5)]
    result = bcast(ts, [CPU] * 3, 10485760)
    for copies in result[1:]:
        assert [c.shape for c in copies] == [t.shape for t in ts]
        assert all(_same_bits(c, t) for c, t in zip(copies, ts))


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(6, 5).t(),
        lambda: torch.randn(10)[::3],
        lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        lambda: torch.randn(1, 4).expand(3, 4),
        lambda: torch.randn(4, dtype=torch.complex64).conj(),
        lambda: torch.randn(4, dtype=torch.complex64).conj().imag,
    ],
    ids=["transposed", "strided", "channels_last", "expanded", "conj", "neg_view"],
)
def test_broadcast_non_contiguous_inputs(make):
    t = make()
    result = bcast([t, torch.randn(3)], [CPU] * 3, 10485760)
    for copies in result[1:]:
        assert torch.equal(copies[0], t)
        assert copies[0].is_contiguous()  # torch's flatten: outputs are contiguous


def test_broadcast_many_small_tensors_span_several_buckets():
    ts = [torch.randn(5) for _ in range(40)] + [torch.arange(3) for _ in range(30)]
    buffer_size = 64  # three float32 tensors of 20 bytes per bucket
    result = bcast(ts, [CPU] * 4, buffer_size)
    for copies in result[1:]:
        assert all(_same_bits(c, t) for c, t in zip(copies, ts))
        storages = {}
        for c in copies:
            storages.setdefault(c.untyped_storage().data_ptr(), []).append(c)
        assert len(storages) > 10
        for group in storages.values():
            nbytes = sum(c.numel() * c.element_size() for c in group)
            assert nbytes <= buffer_size or len(group) == 1
            assert len({c.dtype for c in group}) == 1


def test_broadcast_tensor_larger_than_buffer_gets_own_bucket():
    ts = [torch.randn(100), torch.randn(2), torch.randn(2)]
    result = bcast(ts, [CPU] * 2, 16)
    big, a, b = result[1]
    assert big.untyped_storage().nbytes() == 400
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert all(torch.equal(c, t) for c, t in zip(result[1], ts))


def test_broadcast_outputs_do_not_require_grad():
    ts = [torch.randn(3, requires_grad=True), torch.randn(2, requires_grad=True)]
    result = bcast(ts, [CPU] * 2, 10485760)
    assert result[0][0] is ts[0]
    assert not any(c.requires_grad for c in result[1])
    assert all(c._base is None for c in result[1])


def test_broadcast_empty_list():
    assert bcast([], [CPU] * 3, 1024) == [[], [], []]


def test_broadcast_rejects_sparse():
    with pytest.raises(RuntimeError, match="fastdp.broadcast_coalesced: only dense"):
        bcast([torch.randn(3, 3).to_sparse()], [CPU] * 2, 1024)


def test_broadcast_rejects_tensor_not_on_devices0():
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CPU or all CUDA|no CUDA support"):
            bcast([torch.randn(3)], [CPU, torch.device("cuda", 0)], 1024)
    with pytest.raises(RuntimeError, match="expected at least one device"):
        bcast([torch.randn(3)], [], 1024)
    with pytest.raises(RuntimeError, match="buffer_size must be positive"):
        bcast([torch.randn(3)], [CPU], 0)


def test_broadcast_concurrent_calls_from_threads():
    ts = _mixed()
    errors, results = [], []

    def work():
        try:
            for _ in range(20):
                results.append(bcast(ts, [CPU] * 3, 256))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(_same_bits(c, t) for r in results for c, t in zip(r[2], ts))


# ---- broadcast_coalesced_into (persistent replicas) ----------------------------------------


@pytest.mark.parametrize("n", [2, 3, 8])
def test_into_refreshes_broadcast_outputs_in_place(n):
    ts = _mixed()
    result = bcast(ts, [CPU] * n, 128)
    ptrs = [[c.data_ptr() for c in copies] for copies in result[1:]]
    for step in range(3):
        new = [_rand(t.shape, t.dtype) for t in ts]
        bcast_into(new, result[1:])
        for copies in result[1:]:
            assert all(_same_bits(c, t) for c, t in zip(copies, new)), step
        assert [[c.data_ptr() for c in copies] for copies in result[1:]] == ptrs


def test_into_accepts_any_destination_layout():
    ts = [torch.randn(4, 6), torch.arange(10), torch.randn(3, dtype=torch.complex64)]
    outs = [
        [
            torch.empty(6, 4).t(),
            torch.empty(20, dtype=torch.int64)[::2],
            torch.empty(3, dtype=torch.complex64),
        ],
        [
            torch.empty(4, 6),
            torch.empty(10, dtype=torch.int64),
            torch.empty(3, dtype=torch.complex64).conj(),
        ],
    ]
    bcast_into(ts, outs)
    for o in outs:
        assert all(torch.equal(a, b) for a, b in zip(o, ts))


def test_into_handwritten_flat_buffers():
    ts = [torch.randn(2, 3), torch.randn(4), torch.arange(5), torch.randn(0)]
    flat_f, flat_i = torch.empty(10), torch.empty(5, dtype=torch.int64)
    outs = [[flat_f[:6].view(2, 3), flat_f[6:], flat_i, torch.empty(0)]]
    bcast_into(ts, outs)
    assert torch.equal(flat_f, torch.cat([ts[0].flatten(), ts[1]]))
    assert torch.equal(flat_i, ts[2])


def test_into_bumps_version_counters():
    ts = [torch.randn(3), torch.randn(2)]
    result = bcast(ts, [CPU] * 3, 1024)
    before = [[c._version for c in copies] for copies in result[1:]]
    src_before = [t._version for t in ts]
    bcast_into(ts, result[1:])
    after = [[c._version for c in copies] for copies in result[1:]]
    assert all(a > b for ra, rb in zip(after, before) for a, b in zip(ra, rb))
    assert [t._version for t in ts] == src_before


def test_into_invalidates_saved_tensors_like_an_inplace_op():
    w = torch.randn(3)
    replica = bcast([w], [CPU] * 2, 1024)[1][0].requires_grad_()
    loss = (replica * replica).sum()
    bcast_into([w * 2], [[replica]])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_into_rejects_mismatched_outs():
    ts = [torch.randn(3)]
    with pytest.raises(RuntimeError, match="outs\\[0\\]\\[0\\] has dtype"):
        bcast_into(ts, [[torch.empty(4)]])
    with pytest.raises(RuntimeError, match="outs\\[0\\]\\[0\\] has dtype"):
        bcast_into(ts, [[torch.empty(3, dtype=torch.float64)]])
    with pytest.raises(RuntimeError, match="expected 1"):
        bcast_into(ts, [[]])
    with pytest.raises(RuntimeError, match="only dense"):
        bcast_into([torch.randn(2, 2)], [[torch.randn(2, 2).to_sparse()]])


def test_into_empty_is_a_no_op():
    bcast_into([], [[], []])
    bcast_into([torch.randn(2)], [])


# ---- the CUDA refresh's run detection (pure pointer logic, testable on CPU) ---------------------

runs_of = ext_op("_coalesced_runs")
needs_runs = pytest.mark.skipif(runs_of is None, reason="fastdp._C lacks _coalesced_runs")


@needs_runs
def test_runs_of_broadcast_outputs_are_its_buckets():
    ts = [torch.randn(5) for _ in range(6)] + [torch.arange(3)] + [torch.randn(2)]
    result = bcast(ts, [CPU] * 3, 44)  # float buckets: 2 tensors of 20 bytes each
    runs, strided = runs_of(ts, result[1:])
    assert strided == []
    assert sorted(runs) == [[0, 1], [2, 3], [4, 5], [6], [7]]


@needs_runs
def test_runs_split_where_any_destination_breaks_adjacency():
    ts = [torch.randn(4) for _ in range(4)]
    a, b = torch.empty(16), torch.empty(16)
    outs = [[a[0:4], a[4:8], a[8:12], a[12:16]], [b[0:4], b[4:8], b[12:16], b[8:12]]]
    runs, strided = runs_of(ts, outs)
    assert sorted(runs) == [[0, 1], [2], [3]] and strided == []


@needs_runs
def test_runs_skip_empty_and_list_strided():
    ts = [torch.randn(2), torch.randn(0), torch.randn(3), torch.randn(2, 2), torch.randn(1)]
    flat = torch.empty(6)
    outs = [[flat[0:2], torch.empty(0), flat[2:5], torch.empty(2, 2).t(), flat[5:6]]]
    runs, strided = runs_of(ts, outs)
    assert runs == [[0, 2, 4]] and strided == [3]


@needs_runs
def test_runs_never_cross_storages_or_dtypes():
    ts = [torch.randn(2), torch.randn(2), torch.arange(2)]
    flat = torch.empty(4)
    separate = [torch.empty(2), torch.empty(2)]
    runs, _ = runs_of(ts, [[separate[0], separate[1], torch.empty(2, dtype=torch.int64)]])
    assert sorted(runs) == [[0], [1], [2]]
    runs, _ = runs_of(ts, [[flat[:2], flat[2:], torch.empty(2, dtype=torch.int64)]])
    assert sorted(runs) == [[0, 1], [2]]


@needs_runs
def test_runs_reject_mismatched_lengths():
    with pytest.raises(RuntimeError, match="destination tensors for 2 sources"):
        runs_of([torch.randn(2), torch.randn(2)], [[torch.empty(2)]])
