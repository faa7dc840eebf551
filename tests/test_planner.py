"""The scatter planner: torch.chunk semantics, DataParallel's truncation, explicit sizes."""

import itertools

import pytest
import torch

from fastdp._planner import chunk_sizes_for, dropped, plan_chunks

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


def test_every_size_matches_torch_chunk():
    for size, n in itertools.product(range(0, 70), range(1, 10)):
        assert plan_chunks([size], n)[0] == [c.shape[0] for c in torch.empty(size).chunk(n)]


def test_leaves_with_same_chunk_count_but_different_sizes_are_allowed(backend):
    assert plan_chunks([10, 9], 3) == [[4, 4, 2], [3, 3, 3]]


def test_leaves_with_different_chunk_counts_are_truncated_to_the_fewest(backend):
    plan = plan_chunks([30, 10], 8)  # DataParallel's zip: 5 replicas, 10 of 30 rows dropped
    assert plan == [[4] * 5, [2] * 5] and dropped([30, 10], plan) == [0]
    plan = plan_chunks([1, 2], 2)  # HF Trainer's last batch: num_items_in_batch has n_gpu rows
    assert plan == [[1], [1]] and dropped([1, 2], plan) == [1]


def test_explicit_chunk_sizes_are_validated(backend):
    assert plan_chunks([7, 7], 3, [3, 0, 4]) == [[3, 0, 4], [3, 0, 4]]
    assert plan_chunks([7, 2], 3, [3, 0, 4]) == [[3, 0], [1, 1]]  # others: torch.chunk, truncated
    with pytest.raises(ValueError, match="3 entries but there are 2 devices"):
        plan_chunks([6], 2, [3, 2, 1])
    with pytest.raises(ValueError, match="non-negative"):
        plan_chunks([6], 2, [7, -1])


def test_planner_rejects_no_devices(backend):
    with pytest.raises(ValueError, match="at least one device"):
        plan_chunks([4], 0)
    assert chunk_sizes_for(5, 2) == [3, 2]
