"""The scatter planner: torch.chunk semantics, explicit sizes, C++ and Python agree."""

import itertools

import pytest
import torch

from fastdp import _backend
from fastdp._planner import chunk_sizes_for, plan_chunks, plan_chunks_py

CHUNK_TABLE = [  # (batch, replicas, chunks)
    (30, 1, [30]), (30, 2, [15, 15]), (30, 3, [10, 10, 10]), (30, 8, [4] * 7 + [2]),
    (10, 1, [10]), (10, 2, [5, 5]), (10, 3, [4, 4, 2]), (10, 8, [2] * 5),
    (3, 1, [3]), (3, 2, [2, 1]), (3, 3, [1, 1, 1]), (3, 8, [1, 1, 1]),
    (0, 3, [0, 0, 0]),
]


@pytest.mark.parametrize("batch,n,expected", CHUNK_TABLE)
def test_chunk_table_matches_torch_chunk(backend, batch, n, expected):
    assert plan_chunks([batch], n) == [expected]
    assert [c.shape[0] for c in torch.empty(batch).chunk(n)] == expected


def test_cpp_and_python_planners_agree_exhaustively():
    if not _backend.loaded():
        pytest.skip("extension not built")
    ext = _backend._ext
    for size, n in itertools.product(range(0, 70), range(1, 10)):
        assert ext.plan_chunks([size], n, None) == plan_chunks_py([size], n)
        assert plan_chunks_py([size], n)[0] == [c.shape[0] for c in torch.empty(size).chunk(n)]


def test_leaves_with_same_chunk_count_but_different_sizes_are_allowed(backend):
    assert plan_chunks([10, 9], 3) == [[4, 4, 2], [3, 3, 3]]


def test_leaves_with_different_chunk_counts_raise_value_error(backend):
    with pytest.raises(ValueError, match="different numbers of chunks.*size 30.*into 8.*size 10"
                       ".*into 5"):
        plan_chunks([30, 10], 8)


def test_explicit_chunk_sizes_are_validated(backend):
    assert plan_chunks([7, 7], 3, [3, 0, 4]) == [[3, 0, 4], [3, 0, 4]]
    with pytest.raises(ValueError, match="sum to 6 but input tensor 0 has batch size 7"):
        plan_chunks([7], 3, [3, 2, 1])
    with pytest.raises(ValueError, match="3 entries but there are 2 devices"):
        plan_chunks([6], 2, [3, 2, 1])
    with pytest.raises(ValueError, match="non-negative"):
        plan_chunks([6], 2, [7, -1])


def test_planner_rejects_no_devices(backend):
    with pytest.raises(ValueError, match="at least one device"):
        plan_chunks([4], 0)
    assert chunk_sizes_for(5, 2) == [3, 2]
