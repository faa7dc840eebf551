"""Inputs: chunking, nesting, kwargs, non-tensors. Outputs: containers, scalars, odd types."""

import dataclasses
import threading
from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from fastdp import FastDataParallel, data_parallel
from fastdp.scatter_gather import gather, scatter, scatter_kwargs
from fastdp.testing import CPU

Pair = namedtuple("Pair", ["a", "b"])


class Recorder(nn.Module):
    """Records what each replica received; returns its tensor inputs scaled (differentiable)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(2.0))
        self.seen = []
        self.lock = threading.Lock()

    def forward(self, *args, **kwargs):
        with self.lock:
            self.seen.append((args, kwargs))
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        return tensors[0] * self.w if tensors else self.w.view(1)


@pytest.mark.parametrize(
    "batch,n,sizes",
    [(30, 8, [4] * 7 + [2]), (10, 8, [2] * 5), (10, 3, [4, 4, 2]), (3, 8, [1, 1, 1])],
)
def test_only_as_many_replicas_as_chunks_run(backend, batch, n, sizes):
    m = Recorder()
    out = FastDataParallel(m, device_ids=["cpu"] * n)(torch.arange(batch, dtype=torch.float32))
    assert sorted(len(a[0]) for a, _ in m.seen) == sorted(sizes)
    assert_close(out, torch.arange(batch, dtype=torch.float32) * 2)


def test_nested_inputs_are_scattered_recursively(backend):
    x = torch.arange(12.0).view(6, 2)
    inputs = ({"a": x, "b": [x + 1, Pair(x + 2, "tag")]},)
    scattered, kwargs = scatter_kwargs(inputs, {"k": (x * 3,)}, [CPU] * 3)
    assert len(scattered) == 3 and len(kwargs) == 3
    for r in range(3):
        (d,) = scattered[r]
        assert_close(d["a"], x[2 * r : 2 * r + 2])
        assert isinstance(d["b"][1], Pair) and d["b"][1].b == "tag"
        assert_close(d["b"][1].a, (x + 2)[2 * r : 2 * r + 2])
        assert_close(kwargs[r]["k"][0], (x * 3)[2 * r : 2 * r + 2])


def test_non_tensors_are_passed_by_reference(backend):
    obj = object()
    m = Recorder()
    FastDataParallel(m, device_ids=["cpu"] * 2)(torch.ones(4), obj, {"k": obj}, flag=obj)
    assert len(m.seen) == 2
    for args, kwargs in m.seen:
        assert args[1] is obj and kwargs["flag"] is obj
        assert args[2] == {"k": obj} and args[2]["k"] is obj  # containers shallow-copied


def test_small_batch_with_kwargs_is_scattered_correctly(backend):
    """DataParallel pads kwargs/inputs wrongly here (pytorch #31460); all replicas get both."""
    m = Recorder()
    out = FastDataParallel(m, device_ids=["cpu"] * 4)(torch.ones(2, 3), scale=0.5)
    assert len(m.seen) == 2
    assert all(len(a) == 1 and k == {"scale": 0.5} for a, k in m.seen)
    assert out.shape == (2, 3)


def test_kwargs_only_tensors_decide_replica_count(backend):
    m = Recorder()
    FastDataParallel(m, device_ids=["cpu"] * 4)(x=torch.ones(3))
    assert len(m.seen) == 3 and all(a == () and k["x"].shape == (1,) for a, k in m.seen)


def test_tensors_splitting_into_different_chunk_counts_drop_rows_as_dataparallel(backend):
    m = Recorder()
    with pytest.warns(UserWarning, match=r"5 replica\(s\) run.*inputs\[0\] \(30 rows, 20 used\)"):
        FastDataParallel(m, device_ids=["cpu"] * 8)(torch.ones(30), mask=torch.ones(10))
    assert len(m.seen) == 5 and [a[0].shape[0] for a, _ in m.seen] == [4] * 5


def test_strict_chunks_makes_dropped_rows_an_error(backend):
    fdp = FastDataParallel(Recorder(), device_ids=["cpu"] * 8, strict_chunks=True)
    with pytest.raises(ValueError, match=r"different numbers of chunks.*inputs\[0\] \(30 rows"):
        fdp(torch.ones(30), mask=torch.ones(10))


@pytest.mark.parametrize("dim", [1, -1, -2])
def test_scatter_and_gather_along_other_dims(backend, dim):
    x = torch.randn(3, 10, 4, requires_grad=True)
    m = nn.Identity()
    out = FastDataParallel(m, device_ids=["cpu"] * 3, dim=dim)(x)
    assert_close(out, x)
    (out * torch.arange(out.numel()).view_as(out)).sum().backward()
    assert_close(x.grad, torch.arange(x.numel(), dtype=torch.float32).view_as(x))


def test_empty_batch_runs_every_replica_on_empty_chunks(backend):
    m = Recorder()
    out = FastDataParallel(m, device_ids=["cpu"] * 3)(torch.empty(0, 5))
    assert out.shape == (0, 5) and len(m.seen) == 3


def test_no_inputs_runs_on_the_first_device(backend):
    m = Recorder()
    out = FastDataParallel(m, device_ids=["cpu"] * 2)()
    assert_close(out, torch.tensor([2.0])) and len(m.seen) == 1


def test_non_tensor_inputs_only_run_on_every_device(backend):
    m = Recorder()
    out = FastDataParallel(m, device_ids=["cpu"] * 3)("no tensors")
    assert_close(out, torch.tensor([2.0, 2.0, 2.0]))
    assert [a for a, _ in m.seen] == [("no tensors",)] * 3


def test_zero_dim_input_is_rejected_like_torch_chunk(backend):
    with pytest.raises(RuntimeError, match="at least a 1-dimensional"):
        FastDataParallel(Recorder(), device_ids=["cpu"] * 2)(torch.tensor(1.0))


class Outputs(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        k = self.kind
        if k == "tuple":
            return x, (x * 2, None)
        if k == "list":
            return [x, [x + 1]]
        if k == "dict":
            return {"y": x, "z": {"w": x * 3}}
        if k == "namedtuple":
            return Pair(x, x - 1)
        if k == "none":
            return None
        if k == "dataclass":
            return Result(logits=x, loss=x.sum(), name="r")
        if k == "str":
            return f"s{x.shape[0]}"
        if k == "int":
            return x.shape[0]
        raise AssertionError(k)


@dataclasses.dataclass
class Result:
    logits: torch.Tensor
    loss: torch.Tensor
    name: str


@pytest.mark.parametrize("kind", ["tuple", "list", "dict", "namedtuple", "none"])
def test_output_containers_are_preserved(backend, kind):
    x = torch.randn(6, 2)
    ref = Outputs(kind)(x)
    out = FastDataParallel(Outputs(kind), device_ids=["cpu"] * 3)(x)
    assert type(out) is type(ref)
    if kind == "tuple":
        assert_close(out[0], x) and assert_close(out[1][0], x * 2)
        assert out[1][1] is None
    elif kind == "list":
        assert_close(out[1][0], x + 1)
    elif kind == "dict":
        assert_close(out["z"]["w"], x * 3)
    elif kind == "namedtuple":
        assert_close(out.b, x - 1)


def test_dataclass_outputs_are_gathered_field_wise(backend):
    x = torch.randn(6, 2)
    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        out = FastDataParallel(Outputs("dataclass"), device_ids=["cpu"] * 3)(x)
    assert isinstance(out, Result)
    assert_close(out.logits, x)
    assert_close(out.loss, torch.stack([c.sum() for c in x.chunk(3)]))
    assert out.name == ["r", "r", "r"]


@pytest.mark.parametrize("kind,expected", [("str", ["s2", "s2", "s1"]), ("int", [2, 2, 1])])
def test_plain_values_come_back_as_a_per_replica_list(backend, kind, expected):
    assert FastDataParallel(Outputs(kind), device_ids=["cpu"] * 3)(torch.ones(5)) == expected


def test_scalar_outputs_become_a_vector_with_dataparallels_warning(backend):
    m = nn.Linear(3, 1)
    x = torch.randn(8, 3)
    with pytest.warns(
        UserWarning,
        match="Was asked to gather along dimension 0, but all input "
        "tensors were scalars; will instead unsqueeze and return a vector.",
    ):
        out = FastDataParallel(_Loss(m), device_ids=["cpu"] * 4)(x)
    assert out.shape == (4,)
    assert_close(out, torch.stack([m(c).sum() for c in x.chunk(4)]))
    out.sum().backward()
    assert m.weight.grad is not None


class _Loss(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x).sum()


def test_scatter_of_a_tensor_returns_a_tuple_of_chunks(backend):
    parts = scatter(torch.arange(5), [CPU] * 2)
    assert isinstance(parts, tuple) and [p.tolist() for p in parts] == [[0, 1, 2], [3, 4]]
    assert gather(list(parts), CPU).tolist() == list(range(5))


def test_functional_data_parallel_matches_module(backend):
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    x = torch.randn(7, 4)
    out = data_parallel(m, x, device_ids=["cpu"] * 3, module_kwargs=None)
    assert_close(out, m(x))
