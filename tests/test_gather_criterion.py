"""``gather_output=False`` -> ``fastdp.Scattered`` and ``fastdp.ParallelCriterion`` (point 2)."""

import copy
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import fastdp
from fastdp import _functions

Pair = namedtuple("Pair", "logits aux")


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))


def _pair(net, **kw):
    """(FastDataParallel on 3 CPU replicas, an identical plain module)."""
    ref = copy.deepcopy(net)
    return fastdp.FastDataParallel(net, ["cpu"] * 3, gather_output=False, **kw), ref


def _data(batch=10, classes=4):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 6, generator=g), torch.randint(0, classes, (batch,), generator=g)


def _assert_grads_equal(a, b):
    for p, q in zip(a.parameters(), b.parameters()):
        assert_close(p.grad, q.grad)


def test_forward_returns_scattered_with_chunks_and_devices():
    fdp, _ = _pair(_net())
    out = fdp(_data()[0])
    assert isinstance(out, fastdp.Scattered)
    assert out.chunk_sizes == [4, 4, 2]
    assert [o.shape[0] for o in out] == [4, 4, 2]
    assert out.devices == [torch.device("cpu")] * 3 and out.dim == 0


@pytest.mark.parametrize(
    "batch,n,sizes", [(2, 3, [1, 1]), (30, 8, [4] * 7 + [2]), (10, 8, [2] * 5), (0, 2, [0, 0])]
)
def test_scattered_chunk_sizes_follow_torch_chunk(batch, n, sizes):
    out = fastdp.FastDataParallel(_net(), ["cpu"] * n, gather_output=False)(torch.randn(batch, 6))
    assert out.chunk_sizes == sizes and [len(o) for o in out] == sizes


def test_scattered_gather_equals_gathered_forward_exactly():
    net = _net()
    x = _data()[0]
    gathered = fastdp.FastDataParallel(net, ["cpu"] * 3)(x)
    assert torch.equal(
        fastdp.FastDataParallel(net, ["cpu"] * 3, gather_output=False)(x).gather(), gathered
    )


def test_scattered_gather_keeps_nested_structure():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 4)

        def forward(self, x):
            y = self.lin(x)
            return {"pair": Pair(y, y.sum(1)), "n": 1}

    m = TwoHeads()
    x = _data()[0]
    want = fastdp.FastDataParallel(m, ["cpu"] * 3)(x)
    got = fastdp.FastDataParallel(m, ["cpu"] * 3, gather_output=False)(x).gather()
    assert isinstance(got["pair"], Pair) and got["n"] == want["n"]
    assert torch.equal(got["pair"].logits, want["pair"].logits)
    assert torch.equal(got["pair"].aux, want["pair"].aux)


@pytest.mark.parametrize(
    "loss_fn,reduction",
    [
        (nn.CrossEntropyLoss(), "mean"),
        (nn.CrossEntropyLoss(reduction="sum"), "sum"),
        (F.cross_entropy, None),
        (nn.CrossEntropyLoss(label_smoothing=0.1), "mean"),
    ],
)
@pytest.mark.parametrize("split", [{}, {"chunk_sizes": [8, 0, 3]}, {"balance": [1, 3, 1]}])
def test_criterion_loss_and_grads_equal_single_device(loss_fn, reduction, split):
    fdp, ref = _pair(_net(), **split)
    x, y = _data(11)
    loss = fastdp.ParallelCriterion(loss_fn)(fdp(x), y)
    want = loss_fn(ref(x), y)
    assert loss.dim() == 0 and loss.device == torch.device("cpu")
    assert_close(loss, want)
    loss.backward()
    want.backward()
    _assert_grads_equal(fdp.module, ref)


def test_criterion_mean_is_weighted_by_chunk_size():
    # Uneven chunks: a plain average of the per-replica means would be wrong here.
    fdp, ref = _pair(_net(), chunk_sizes=[8, 1, 1])
    x, y = _data()
    out = fdp(x)
    loss = fastdp.ParallelCriterion(nn.MSELoss())(out, F.one_hot(y, 4).float())
    unweighted = (
        sum(F.mse_loss(o, F.one_hot(t, 4).float()) for o, t in zip(out, y.split([8, 1, 1]))) / 3
    )
    want = F.mse_loss(ref(x), F.one_hot(y, 4).float())
    assert_close(loss, want)
    assert not torch.allclose(unweighted, want)


def test_criterion_batchmean_kl_div():
    fdp, ref = _pair(_net())
    x, _ = _data()
    target = torch.softmax(torch.randn(10, 4), 1)
    kl = nn.KLDivLoss(reduction="batchmean")
    loss = fastdp.ParallelCriterion(kl)(fdp(x), target)
    want = kl(torch.log_softmax(ref(x), 1), target)
    assert_close(
        fastdp.ParallelCriterion(
            lambda o, t: kl(torch.log_softmax(o, 1), t), reduction="batchmean"
        )(fdp(x), target),
        want,
    )
    assert loss.dim() == 0


def test_criterion_none_returns_scattered_losses():
    fdp, ref = _pair(_net(), balance=[2, 1, 1])
    x, y = _data()
    losses = fastdp.ParallelCriterion(nn.CrossEntropyLoss(reduction="none"))(fdp(x), y)
    assert isinstance(losses, fastdp.Scattered)
    assert [len(v) for v in losses] == losses.chunk_sizes == [5, 3, 2]
    assert_close(losses.gather(), F.cross_entropy(ref(x), y, reduction="none"))


def test_criterion_targets_and_kwargs_nested():
    def loss_fn(out, targets, scale=None, w=1.0):
        return (
            F.cross_entropy(out, targets["y"], reduction="sum") * w + (out * scale[:, None]).sum()
        )

    fdp, ref = _pair(_net())
    x, y = _data()
    scale = torch.randn(10)
    crit = fastdp.ParallelCriterion(loss_fn, reduction="sum")
    loss = crit(fdp(x), {"y": y}, scale=scale, w=0.5)
    want = loss_fn(ref(x), {"y": y}, scale=scale, w=0.5)
    assert_close(loss, want)
    loss.backward()
    want.backward()
    _assert_grads_equal(fdp.module, ref)


def test_criterion_never_gathers_the_output(monkeypatch):
    # CPU replicas gather with torch.cat, not through Gather: the proof is what loss_fn receives,
    # each replica's own output object (no gathered copy of it, whole or re-split).
    fdp, ref = _pair(_net())
    x, y = _data()
    out = fdp(x)
    seen = []

    def loss_fn(o, t):
        seen.append(o)
        return F.cross_entropy(o, t)

    def fail(*args, **kwargs):
        pytest.fail("the criterion gathered the output")

    monkeypatch.setattr(fastdp.Scattered, "gather", fail)
    monkeypatch.setattr(fastdp.scatter_gather, "gather", fail)
    monkeypatch.setattr(_functions.Gather, "forward", staticmethod(fail))
    loss = fastdp.ParallelCriterion(loss_fn)(out, y)
    assert len(seen) == 3 and all(a is b for a, b in zip(seen, out.outputs))
    assert_close(loss, F.cross_entropy(ref(x), y))


def test_loss_module_with_buffers_is_replicated():
    fdp, ref = _pair(_net())
    x, y = _data()
    weight = torch.tensor([1.0, 2.0, 0.5, 1.5])
    crit = nn.CrossEntropyLoss(weight=weight, reduction="sum")
    loss = fastdp.ParallelCriterion(crit)(fdp(x), y)
    assert_close(loss, crit(ref(x), y))


def test_weighted_mean_is_rejected_with_reason():
    with pytest.raises(ValueError, match="class-weighted mean"):
        fastdp.ParallelCriterion(nn.CrossEntropyLoss(weight=torch.ones(4)))


def test_unsupported_reduction_says_what_is_supported():
    with pytest.raises(ValueError, match=r"reduction 'max' is not supported.*'none'"):
        fastdp.ParallelCriterion(F.cross_entropy, reduction="max")


def test_non_scalar_loss_with_mean_raises_clear_error():
    fdp, _ = _pair(_net())
    x, y = _data()
    crit = fastdp.ParallelCriterion(lambda o, t: F.cross_entropy(o, t, reduction="none"))
    with pytest.raises(ValueError, match=r"replica 0 returned \(4,\).*reduction='none'"):
        crit(fdp(x), y)


def test_loss_error_names_the_replica():
    fdp, _ = _pair(_net())
    x, _ = _data()
    with pytest.raises(IndexError, match="in replica 0 on device cpu"):
        fastdp.ParallelCriterion(nn.CrossEntropyLoss())(fdp(x), torch.full((10,), 9))


def test_target_batch_mismatch_is_a_value_error():
    fdp, _ = _pair(_net())
    x, y = _data()
    with pytest.raises(ValueError, match="sum to 10 rows but target tensor 0 has 9 rows"):
        fastdp.ParallelCriterion(nn.CrossEntropyLoss())(fdp(x), y[:9])


def test_single_device_and_plain_outputs():
    net = _net()
    x, y = _data()
    one = fastdp.FastDataParallel(net, ["cpu"], gather_output=False)(x)
    assert isinstance(one, fastdp.Scattered) and len(one) == 1
    assert torch.equal(one.gather(), net(x))
    crit = fastdp.ParallelCriterion(nn.CrossEntropyLoss())
    assert_close(crit(one, y), F.cross_entropy(net(x), y))
    assert_close(crit(net(x), y), F.cross_entropy(net(x), y))  # a gathered output (DDP too)


def test_gather_output_default_is_true():
    assert torch.is_tensor(fastdp.FastDataParallel(_net(), ["cpu"] * 2)(_data()[0]))
