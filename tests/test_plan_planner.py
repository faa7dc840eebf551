"""The scatter planner: torch.chunk semantics, DataParallel's truncation, explicit sizes."""

import itertools

import pytest
import torch

from fastdp._planner import chunk_sizes_for, dropped, splits_for

CHUNK_TABLE = [  # (batch, replicas, chunks)
    (30, 1, [30]),
    (30, 2, [15, 15]),
    (30, 3, [10, 10, 10]),
    (30, 8, [4] * 7 + [2]),
    (10, 1, [10]),
    (10, 2, [5, 5]),
    (10, 3, [4, 4, 2]),
    (10, 8, [2] * 5),
    (3, 1, [3]),
    (3, 2, [2, 1]),
    (3, 3, [1, 1, 1]),
    (3, 8, [1, 1, 1]),
    (0, 3, [0, 0, 0]),
]


@pytest.mark.parametrize("batch,n,expected", CHUNK_TABLE)
def test_chunk_table_matches_torch_chunk(backend, batch, n, expected):
    assert splits_for([batch], n) == [expected]
    assert [c.shape[0] for c in torch.empty(batch).chunk(n)] == expected


def test_every_size_matches_torch_chunk():
    for size, n in itertools.product(range(0, 70), range(1, 10)):
        assert splits_for([size], n)[0] == [c.shape[0] for c in torch.empty(size).chunk(n)]


def test_leaves_with_same_chunk_count_but_different_sizes_are_allowed(backend):
    assert splits_for([10, 9], 3) == [[4, 4, 2], [3, 3, 3]]


def test_leaves_with_different_chunk_counts_are_truncated_to_the_fewest(backend):
    plan = splits_for([30, 10], 8)  # DataParallel's zip: 5 replicas, 10 of 30 rows dropped
    assert plan == [[4] * 5, [2] * 5] and dropped([30, 10], plan) == [0]
    plan = splits_for([1, 2], 2)  # HF Trainer's last batch: num_items_in_batch has n_gpu rows
    assert plan == [[1], [1]] and dropped([1, 2], plan) == [1]


def test_explicit_chunk_sizes_are_validated(backend):
    assert splits_for([7, 7], 3, [3, 0, 4]) == [[3, 0, 4], [3, 0, 4]]
    assert splits_for([7, 2], 3, [3, 0, 4]) == [[3, 0], [1, 1]]  # others: torch.chunk, truncated
    with pytest.raises(ValueError, match="3 entries but there are 2 devices"):
        splits_for([6], 2, [3, 2, 1])
    with pytest.raises(ValueError, match="non-negative"):
        splits_for([6], 2, [7, -1])


def test_planner_rejects_no_devices(backend):
    with pytest.raises(ValueError, match="at least one device"):
        splits_for([4], 0)
    assert chunk_sizes_for(5, 2) == [3, 2]


# The step plan: one object per forward, made before the scatter from explicit arguments.
CPU = torch.device("cpu")


def _plan(*inputs, n=3, **options):
    from fastdp._planner import make_plan

    options.setdefault("ids", ["cpu"] * n)
    return make_plan(inputs, {}, devices=[CPU] * n, **options)


def test_default_plan_uses_the_given_ids_and_torch_chunk():
    ids = ["cpu"] * 3
    plan = _plan(torch.randn(10, 3), ids=ids)
    assert plan.ids is ids and not plan.custom_split and not plan.unreplicated
    assert plan.sizes is None and plan.batch is None and plan.chunk_rows(3) is None
    assert plan.devices == [CPU] * 3 and plan.dims == [0] and list(plan.splits[0]) == [4, 4, 2]


def test_chunk_sizes_drop_zero_row_devices_and_give_rows():
    plan = _plan(torch.randn(10, 3), chunk_sizes=[6, 0, 4])
    assert plan.custom_split and plan.sizes == [6, 4] and len(plan.devices) == 2
    assert plan.ids == [CPU] * 2 and plan.chunk_rows(2) == [6, 4] and plan.batch == 10


def test_scattered_outputs_plan_torch_chunk_rows_of_the_first_input():
    plan = _plan({"x": torch.randn(10, 3)}, n=4, gather_output=False)
    assert not plan.custom_split and plan.batch == 10 and plan.chunk_rows(4) == [3, 3, 3, 1]


def test_one_cpu_device_and_no_devices_run_the_module_directly():
    assert _plan(torch.randn(4, 3), n=1).unreplicated
    none = _plan(torch.randn(4, 3), n=0, ids=[])
    assert none.unreplicated and none.ids == [] and none.leaves is None


def test_the_wrappers_plan_is_make_plan_of_its_settings():
    import fastdp

    fdp = fastdp.FastDataParallel(torch.nn.Linear(3, 2), ["cpu"] * 3, chunk_sizes=[6, 0, 4], dim=0)
    x = torch.randn(10, 3)
    got, want = fdp._plan((x,), {}, None), _plan(x, chunk_sizes=[6, 0, 4])
    assert (got.sizes, got.ids, got.devices) == (want.sizes, want.ids, want.devices)
    assert [list(s) for s in got.splits] == [list(s) for s in want.splits] == [[6, 4]]


def test_batch_size_skips_leaves_without_the_dim():
    from fastdp._planner import batch_size

    scale, x = torch.tensor(2.0), torch.ones(5, 3)
    assert batch_size(((scale, x), {}), 0) == 5  # a 0-dim leaf has no batch dim: skipped
    assert batch_size(((scale,), {"x": x}), 1) == 3
    assert batch_size(((torch.ones(4),), {"x": x}), 1) == 3  # a 1-dim leaf has no dim 1
    assert batch_size(((scale,), {}), 0) is None
    assert batch_size(((torch.ones(0, 2),), {}), 0) == 0


def test_gathered_mean_weights_rows_past_a_zero_dim_first_input():
    """A scatter override that hands every replica a 0-dim scale before its chunk: the scalar
    outputs' mean is still weighted by each replica's rows (the batch-size rule), so it equals
    the whole batch's mean."""
    import fastdp

    class ScaleFirst(fastdp.FastDataParallel):
        def scatter(self, inputs, kwargs, device_ids, chunk_sizes=None):
            ins, kws = super().scatter(inputs[1:], kwargs, device_ids, chunk_sizes)
            return tuple((inputs[0], *i) for i in ins), kws

    class Loss(torch.nn.Module):
        def forward(self, scale, x):
            return (x * scale).mean()

    x = torch.arange(5.0).unsqueeze(1)
    fdp = ScaleFirst(Loss(), ["cpu"] * 2, scalar_outputs="mean")
    torch.testing.assert_close(fdp(torch.tensor(2.0), x), (x * 2).mean())
