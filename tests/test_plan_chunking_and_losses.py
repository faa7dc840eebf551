"""DataParallel's chunking (zip truncation, NOTE [ DataParallel's chunking ]) and scalar_outputs.

DataParallel's ``scatter`` needs CUDA devices, so its rules are restated here as the reference:
every tensor is ``torch.chunk``ed, containers are ``zip``ped (the fewest chunks win).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

from fastdp import FastDataParallel
from fastdp import scatter_gather as sg
from fastdp.testing import CPU


def _dp_rule(tensors: list[torch.Tensor], n: int) -> list[list[torch.Tensor]]:
    """DataParallel's scatter of a flat tuple of tensors: chunk each, zip the chunks."""
    return [list(r) for r in zip(*[t.chunk(n) for t in tensors])]


class Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.seen: list = []

    def forward(self, *args, **kwargs):
        self.seen.append((args, kwargs))
        first = (list(args) + list(kwargs.values()))[0]
        return first.float().sum() * self.w


@pytest.mark.parametrize("sizes,n", [((8, 2), 4), ((1, 2), 2), ((6, 4), 4), ((30, 10), 8)])
def test_positional_tensors_follow_dataparallels_zip(sizes, n):
    xs = [torch.arange(s, dtype=torch.float32) for s in sizes]
    want = _dp_rule(xs, n)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got, kw = sg.scatter_kwargs(tuple(xs), None, [CPU] * n)
    assert len(got) == len(want) == len(kw)
    for g, w in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(g, w))


@pytest.mark.parametrize("batch,n", [(1, 2), (6, 4), (3, 4)])
def test_trainers_num_items_in_batch_on_a_partial_last_batch(batch, n):
    """HF Trainer passes num_items_in_batch with one row per GPU: the last batch may have fewer
    rows than GPUs, and DataParallel runs as many replicas as input_ids has chunks."""
    m = Recorder()
    fdp = FastDataParallel(m, device_ids=["cpu"] * n)
    ids = torch.arange(batch)
    with pytest.warns(UserWarning, match=rf"kwargs\['num_items_in_batch'\] \({n} rows"):
        fdp(input_ids=ids, num_items_in_batch=torch.full((n,), 7))
    want = _dp_rule([ids, torch.full((n,), 7)], n)
    assert len(m.seen) == len(want)
    seen = sorted(m.seen, key=lambda s: int(s[1]["input_ids"][0]))  # replicas run in threads
    for (_, kw), (i, k) in zip(seen, want):
        assert torch.equal(kw["input_ids"], i) and torch.equal(kw["num_items_in_batch"], k)


def test_dropped_rows_warn_once_per_wrapper():
    fdp = FastDataParallel(Recorder(), device_ids=["cpu"] * 2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            fdp(torch.ones(1), torch.ones(2))
    assert sum("different numbers of chunks" in str(w.message) for w in seen) == 1


def test_strict_chunks_raises_naming_the_leaf():
    fdp = FastDataParallel(Recorder(), device_ids=["cpu"] * 2, strict_chunks=True)
    with pytest.raises(ValueError, match=r"kwargs\['n'\]"):
        fdp(x=torch.ones(1), n=torch.ones(2))


def test_dropped_rows_get_no_gradient_as_in_dataparallel():
    x = torch.ones(8, requires_grad=True)
    y = torch.ones(2, requires_grad=True)
    fdp = FastDataParallel(Recorder(), device_ids=["cpu"] * 4)
    with pytest.warns(UserWarning):
        fdp(x, y).sum().backward()  # 2 replicas: x's rows 4..7 are dropped
    assert torch.equal(x.grad, torch.tensor([1.0] * 4 + [0.0] * 4))


# ---- scalar_outputs --------------------------------------------------------------------------


def _loss_model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Linear(4, 1)

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x, y):
            return nn.functional.mse_loss(self.net(x).squeeze(1), y)  # a per-sample mean

    return Loss()


@pytest.mark.parametrize("batch,kw", [(9, {}), (10, {"balance": [1, 4]})])
def test_mean_scalar_outputs_equal_the_whole_batch_loss(batch, kw):
    m = _loss_model()
    x, y = torch.randn(batch, 4), torch.randn(batch)
    fdp = FastDataParallel(m, device_ids=["cpu"] * 2, scalar_outputs="mean", **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no scalar-gather warning
        loss = fdp(x, y)
    assert loss.dim() == 0
    want = m(x, y)
    assert_close(loss, want)
    assert_close(loss.mean(), want)
    loss.backward()
    got = m.net.weight.grad.clone()
    m.zero_grad()
    want.backward()
    assert_close(got, m.net.weight.grad)


def test_stack_scalar_outputs_are_dataparallels_vector():
    m = _loss_model()
    x, y = torch.randn(9, 4), torch.randn(9)
    fdp = FastDataParallel(m, device_ids=["cpu"] * 2)
    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        out = fdp(x, y)
    want = torch.stack([m(x[:5], y[:5]), m(x[5:], y[5:])])
    assert torch.equal(out, want)  # bit for bit; .mean() of it is not the batch mean (5 vs 4)


def test_sum_scalar_outputs_add_globally_normalised_losses():
    m = _loss_model()

    class SumLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = m

        def forward(self, x, y, n):
            return ((self.m.net(x).squeeze(1) - y) ** 2).sum() / n[0]

    x, y = torch.randn(9, 4), torch.randn(9)
    fdp = FastDataParallel(SumLoss(), device_ids=["cpu"] * 2, scalar_outputs="sum")
    loss = fdp(x, y, torch.full((2,), 9.0))
    assert_close(loss, ((m.net(x).squeeze(1) - y) ** 2).sum() / 9)


def test_scalar_outputs_must_be_known():
    with pytest.raises(ValueError, match="scalar_outputs"):
        FastDataParallel(nn.Linear(1, 1), device_ids=["cpu"] * 2, scalar_outputs="avg")
