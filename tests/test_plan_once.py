"""The step's plan is made once and the scatter executes it: the inputs are flattened and split
once per forward, and ``scatter_planned`` decides nothing again (``fastdp/_planner.py``)."""

from __future__ import annotations

import collections
import functools

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import fastdp
from fastdp import _planner, _tree
from fastdp import scatter_gather as sg
from fastdp._planner import make_plan
from fastdp.testing import CPU


class Sum(nn.Module):
    """Adds up its tensor inputs, positional and keyword (rows broadcast from ``x``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(2.0))

    def forward(self, x, extra=None, **kwargs):
        out = x * self.w
        for v in ([extra] if extra is not None else []) + list(kwargs.values()):
            if isinstance(v, torch.Tensor):
                out = out + v.sum(-1, keepdim=True)
            elif isinstance(v, dict):
                out = out + sum(t.sum(-1, keepdim=True) for t in v.values())
        return out


def _count(monkeypatch, module, names):
    """Wrap ``module.<name>`` for each name with a counter of its outermost calls (a recursive
    walker's calls into itself are one walk); returns the counter."""
    calls: collections.Counter = collections.Counter()
    depth: collections.Counter = collections.Counter()
    for name in names:
        fn = getattr(module, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] += depth[_name] == 0
            depth[_name] += 1
            try:
                return _fn(*args, **kwargs)
            finally:
                depth[_name] -= 1

        monkeypatch.setattr(module, name, functools.wraps(fn)(counted))
    return calls


STEP_INPUTS = {
    "one tensor": lambda: ((torch.randn(10, 3),), {}),
    "positional tensors": lambda: ((torch.randn(10, 3), torch.randn(10, 2)), {}),
    "kwargs": lambda: ((torch.randn(10, 3),), {"extra": torch.randn(10, 4)}),
    "nested dict": lambda: (
        (torch.randn(10, 3),),
        {"d": {f"k{i}": torch.randn(10, 2) for i in range(16)}, "flag": True},
    ),
}


@pytest.mark.parametrize("case", list(STEP_INPUTS))
def test_a_forward_flattens_and_splits_its_inputs_once(backend, monkeypatch, case):
    inputs, kwargs = STEP_INPUTS[case]()
    dp = fastdp.FastDataParallel(Sum(), ["cpu"] * 4, launch="inline")  # auto keys its trials
    ref = dp(*inputs, **kwargs)  # builds the replicas
    planner = _count(monkeypatch, _planner, ["flatten_inputs", "split_leaves", "_splits"])
    trees = _count(monkeypatch, _tree, ["flatten", "first_tensor"])
    public = _count(monkeypatch, sg, ["scatter_kwargs", "scatter", "_one_device"])
    out = dp(*inputs, **kwargs)
    assert_close(out, ref)
    assert planner["flatten_inputs"] == planner["split_leaves"] == 1
    assert planner["_splits"] <= 1  # one leaf takes its torch.chunk sizes directly
    flattened = 0 if case in ("one tensor", "positional tensors") else 1
    assert trees["flatten"] == flattened and trees["first_tensor"] == 0
    assert public["scatter_kwargs"] == public["scatter"] == 0
    assert public["_one_device"] == 2  # the scatter's copy path and the gather's


def test_the_plan_holds_what_the_scatter_needs(backend):
    x, mask = torch.randn(10, 3), torch.randn(10, 2)
    plan = make_plan((x,), {"mask": mask, "name": "a"}, devices=[CPU] * 3, ids=["cpu"] * 3)
    assert plan.leaves[0] is x and plan.leaves[1] is mask
    assert plan.devices == [CPU] * 3 and plan.dims == [0, 0]
    assert [list(s) for s in plan.splits] == [[4, 4, 2], [4, 4, 2]]
    rebuilt = _tree.build(plan.spec, plan.leaves)
    assert rebuilt[0][0] is x and rebuilt[1]["name"] == "a" and rebuilt[1]["mask"] is mask


def test_leaves_that_lose_rows_are_narrowed_in_the_plan(backend):
    x, count = torch.randn(10, 3), torch.ones(2)
    told = []
    plan = make_plan(
        (x,), {"count": count}, devices=[CPU] * 3, ids=["cpu"] * 3, on_drop=told.append
    )
    assert [list(s) for s in plan.splits] == [[4, 4], [1, 1]]  # the fewest chunks: 2 replicas
    assert plan.leaves[0].shape == (8, 3) and plan.leaves[0].data_ptr() == x.data_ptr()
    assert len(told) == 1 and "inputs[0] (10 rows, 8 used)" in told[0]


def test_positional_tensors_are_their_own_leaves(backend):
    x, y = torch.randn(6, 2), torch.randn(6, 5)
    plan = make_plan((x, y), {}, devices=[CPU] * 2, ids=["cpu"] * 2, dim=-1)
    assert plan.spec is None and plan.leaves == [x, y] and plan.dims == [1, 1]
    assert [list(s) for s in plan.splits] == [[1, 1], [3, 2]]


def test_scatter_planned_decides_nothing_again(backend, monkeypatch):
    inputs = (torch.randn(7, 3), [torch.randn(7, 2), "tag"])
    kwargs = {"extra": torch.randn(7, 4)}
    plan = make_plan(inputs, kwargs, devices=[CPU] * 3, ids=["cpu"] * 3)
    ref = sg.scatter_kwargs(inputs, kwargs, [CPU] * 3)

    def refuse(*args, **kwargs):
        raise AssertionError("the scatter planned again")

    for name in ["flatten_inputs", "split_leaves", "_splits", "chunk_sizes_for", "batch_size"]:
        monkeypatch.setattr(_planner, name, refuse)
    monkeypatch.setattr(sg, "flatten_inputs", refuse)
    monkeypatch.setattr(sg, "split_leaves", refuse)
    monkeypatch.setattr(_tree, "flatten", refuse)
    ins, kws = sg.scatter_planned(
        plan.spec, plan.leaves, plan.dims, plan.splits, plan.devices, inputs, kwargs
    )
    monkeypatch.undo()
    assert len(ins) == len(kws) == len(ref[0]) == 3
    for got, want in zip(ins + kws, ref[0] + ref[1]):
        got_leaves, want_leaves = [], []
        got_spec, want_spec = _tree.flatten(got, got_leaves), _tree.flatten(want, want_leaves)
        assert _tree.structure_key(got_spec) == _tree.structure_key(want_spec)
        assert_close(got_leaves, want_leaves)
    assert [i[1][1] for i in ins] == ["tag"] * 3


def test_unreplicated_steps_do_not_split(backend, monkeypatch):
    calls = _count(monkeypatch, _planner, ["flatten_inputs", "split_leaves"])
    dp = fastdp.FastDataParallel(Sum(), ["cpu"])
    out = dp(torch.tensor([1.0, 2.0]), extra=torch.tensor(0.0))  # 0-dim: never chunked here
    assert_close(out, torch.tensor([2.0, 4.0])) and not calls


def test_an_overridden_scatter_seam_gets_dataparallels_call(backend, monkeypatch):
    seen = []

    class Seam(fastdp.FastDataParallel):
        def scatter(self, inputs, kwargs, device_ids, chunk_sizes=None):
            seen.append((len(inputs), dict(kwargs), list(device_ids), chunk_sizes))
            return super().scatter(inputs, kwargs, device_ids, chunk_sizes)

    calls = _count(monkeypatch, sg, ["split_leaves"])  # as scatter_kwargs calls it
    dp = Seam(Sum(), ["cpu"] * 2, chunk_sizes=[3, 1])
    assert dp._plan((torch.ones(4, 2),), {}, None).leaves is None
    x = torch.randn(4, 2)
    assert_close(dp(x), x * 2)
    assert seen == [(1, {}, [CPU, CPU], [3, 1])]
    assert calls["split_leaves"] == 1  # the seam's own scatter_kwargs, not the step's plan


def test_a_scatter_set_on_the_instance_is_called(backend):
    dp = fastdp.FastDataParallel(Sum(), ["cpu"] * 2)
    seen = []

    def scatter(inputs, kwargs, device_ids):
        seen.append(len(inputs))
        return sg.scatter_kwargs(inputs, kwargs, [CPU] * 2)

    dp.scatter = scatter
    x = torch.randn(4, 2)
    assert_close(dp(x), x * 2) and seen == [1]


def test_dropped_rows_warn_once_from_the_plan(backend):
    dp = fastdp.FastDataParallel(Sum(), ["cpu"] * 4)
    x, extra = torch.randn(8, 3), torch.randn(2, 4)
    with pytest.warns(UserWarning, match=r"inputs\[0\] \(8 rows, 4 used\)"):
        out = dp(x, extra=extra)
    assert out.shape == (4, 3)  # 2 replicas of 2 rows: x's last 4 rows dropped
    strict = fastdp.FastDataParallel(Sum(), ["cpu"] * 4, strict_chunks=True)
    with pytest.raises(ValueError, match=r"inputs\[0\] \(8 rows, 4 used\).*\(strict_chunks=True\)"):
        strict(x, extra=extra)
