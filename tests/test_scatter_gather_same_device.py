"""NOTE [ Same-device scatter and gather ]: ``split``/``cat`` where every replica shares a device
give what the fused Functions give (values, gradients, double backward, warnings), and the lean
step (inline launch, profiler label) keeps the step's contract."""

from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from fastdp import FastDataParallel
from fastdp import scatter_gather as sg

CPU3 = [torch.device("cpu")] * 3
Pair = namedtuple("Pair", ["a", "b"])


def _inputs(rg):
    x = torch.randn(7, 3, requires_grad=rg)
    y = torch.randn(2, 7, requires_grad=rg)
    return x, y


def _step(inputs, kwargs, dim, devices=CPU3):
    """Scatter, a differentiable per-replica function, gather: the outputs and input grads."""
    ins, kws = sg.scatter_kwargs(inputs, kwargs, devices, dim)
    outs = [
        tuple(t * (r + 1) for t in i) + tuple(v * 2 for v in k.values())
        for r, (i, k) in enumerate(zip(ins, kws))
    ]
    gathered = sg.gather(outs, devices[0], dim)
    return ins, gathered


@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("rg", [False, True])
@pytest.mark.parametrize("with_kwargs", [False, True])
def test_split_and_cat_match_the_fused_functions(monkeypatch, dim, rg, with_kwargs):
    torch.manual_seed(0)
    x, y = _inputs(rg)
    leaf = (x,) if dim == 0 else (y,)
    kwargs = {"z": (x if dim == 0 else y).detach() + 1} if with_kwargs else {}
    ins_fast, out_fast = _step(leaf, kwargs, dim)
    grads_fast = (
        torch.autograd.grad(sum(t.pow(2).sum() for t in out_fast), leaf, create_graph=True)
        if rg
        else None
    )
    with monkeypatch.context() as mp:
        mp.setattr(sg, "_one_device", lambda tensors, devices: False)
        ins_fn, out_fn = _step(leaf, kwargs, dim)
        grads_fn = (
            torch.autograd.grad(sum(t.pow(2).sum() for t in out_fn), leaf, create_graph=True)
            if rg
            else None
        )
    assert [[t.shape for t in i] for i in ins_fast] == [[t.shape for t in i] for i in ins_fn]
    for a, b in zip(ins_fast, ins_fn):
        assert_close(a, b)
    assert_close(out_fast, out_fn)
    if rg:  # the fast path ran autograd's own nodes, the other the Functions
        assert ins_fast[0][0].grad_fn.name() == "SplitWithSizesBackward0"
        assert out_fast[0].grad_fn.name() == "CatBackward0"
        assert "Scatter" in ins_fn[0][0].grad_fn.name()
        assert_close(grads_fast, grads_fn)
        g2_fast = torch.autograd.grad(grads_fast[0].sum(), leaf)  # double backward
        with monkeypatch.context() as mp:
            mp.setattr(sg, "_one_device", lambda tensors, devices: False)
            g2_fn = torch.autograd.grad(grads_fn[0].sum(), leaf)
        assert_close(g2_fast, g2_fn)


def test_chunks_are_views_of_the_input_with_their_own_version_counters(backend):
    """Chunk 0 is a view of the input sharing its version counter; the others are views of the
    input's bytes (of the input itself with the extension, of aliases of it without), each with a
    version counter of its own (NOTE [ Input chunks written in place ]): no bytes copied."""
    x = torch.randn(6, 2)
    ins, _ = sg.scatter_kwargs((x,), None, CPU3, 0)
    assert ins[0][0]._base is x
    for i in ins[1:]:
        assert i[0]._is_view() and i[0]._base.shape == x.shape
        assert i[0]._base.data_ptr() == x.data_ptr()
    assert [i[0].data_ptr() for i in ins] == [x[r * 2 :].data_ptr() for r in range(3)]
    versions = [x._version] + [i[0]._version for i in ins[1:]]
    ins[1][0].add_(0)
    assert [x._version] + [i[0]._version for i in ins[1:]] == [
        versions[0],
        versions[1] + 1,
        versions[2],
    ]
    ins[0][0].add_(0)
    assert x._version == versions[0] + 1 and ins[2][0]._version == versions[2]


def test_uneven_and_empty_batches_split_like_torch_chunk():
    for batch in (0, 1, 5, 7):
        x = torch.randn(batch, 2)
        ins, kws = sg.scatter_kwargs((x, x + 1), None, CPU3, 0)
        if batch == 0:
            assert [i[0].shape[0] for i in ins] == [0, 0, 0]
        else:
            assert [i[0].shape[0] for i in ins] == [c.shape[0] for c in x.chunk(3)]
        assert len(kws) == len(ins) and all(k == {} for k in kws)
        for i in ins:
            assert_close(i[1], i[0] + 1)
        one, _ = sg.scatter_kwargs((x,), None, CPU3, -2)  # one leaf: memoised chunk sizes
        assert [i[0].shape for i in one] == [i[0].shape for i in ins]


def test_inputs_the_fast_split_does_not_take_still_raise_dataparallels_errors():
    with pytest.raises(RuntimeError, match="at least a 1-dimensional"):
        sg.scatter_kwargs((torch.tensor(1.0),), None, CPU3, 0)
    with pytest.raises(IndexError, match="Dimension out of range"):
        sg.scatter_kwargs((torch.randn(4),), None, CPU3, 1)
    with pytest.warns(UserWarning, match=r"inputs\[0\] \(6 rows, 4 used\)"):
        ins, _ = sg.scatter_kwargs((torch.randn(6), torch.randn(2)), None, CPU3, 0)
    assert len(ins) == 2


@pytest.mark.parametrize(
    "make",
    [lambda r: torch.tensor(float(r)), lambda r: Pair(torch.ones(r + 1, 2), torch.tensor(1.0 * r))],
)
def test_gather_same_device_matches_the_function_path(monkeypatch, make):
    outs = [make(r) for r in range(3)]
    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        fast = sg.gather(outs, "cpu", 0)
    with monkeypatch.context() as mp:
        mp.setattr(sg, "_one_device", lambda tensors, devices: False)
        with pytest.warns(UserWarning, match="all input tensors were scalars"):
            slow = sg.gather(outs, "cpu", 0)
    assert type(fast) is type(slow)
    assert_close(fast, slow)


def test_gather_of_nothing_still_fails_loudly():
    with pytest.raises(IndexError):
        sg.gather([], "cpu", 0)


def test_a_step_is_labelled_for_the_profiler():
    fdp = FastDataParallel(nn.Linear(3, 2), device_ids=["cpu"] * 2)
    x = torch.randn(4, 3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fdp(x)
    assert "FastDataParallel.forward" in [e.name for e in prof.events()]


@pytest.mark.parametrize("launch", ["inline", "threads"])
def test_wrapper_step_matches_the_plain_module_on_the_chunks(launch):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 8), nn.GELU(), nn.BatchNorm1d(8), nn.Linear(8, 2))
    ref = nn.Sequential(nn.Linear(5, 8), nn.GELU(), nn.BatchNorm1d(8), nn.Linear(8, 2))
    ref.load_state_dict(m.state_dict())
    fdp = FastDataParallel(m, device_ids=["cpu"] * 3, launch=launch)
    for _ in range(3):
        x = torch.randn(10, 5, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        out = fdp(x)
        want = torch.cat([ref(c) for c in xr.chunk(3)])
        assert_close(out, want)
        out.pow(2).sum().backward()
        want.pow(2).sum().backward()
        assert_close(x.grad, xr.grad)
        for p, q in zip(m.parameters(), ref.parameters()):
            assert_close(p.grad, q.grad)
    assert fdp.last_launch == launch
