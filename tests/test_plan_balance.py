"""Uneven splits: ``chunk_sizes=[...]`` and ``balance=[...]`` (issue 6, point 1)."""

import threading

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import fastdp
from fastdp._planner import balanced_chunk_sizes
from fastdp.testing import device_of, replica_ids, withCUDA


class Recorder(nn.Module):
    """Records (first row id, rows) of every call; row ids are the input's column 0."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.calls = []
        self.lock = threading.Lock()

    def forward(self, x, extra=None):
        with self.lock:
            self.calls.append((int(x[0, 0]) if len(x) else -1, x.size(0)))
        out = self.lin(x)
        return out if extra is None else out + extra["b"].sum(1, keepdim=True)


def _rows(batch):
    x = torch.randn(batch, 3)
    x[:, 0] = torch.arange(batch, dtype=torch.float32)
    return x


def _seen(module):
    return [n for _, n in sorted(module.calls)]


@withCUDA
@pytest.mark.parametrize("sizes", [[5, 1, 4], [1, 1, 8], [10, 0, 0], [2, 8, 0]])
def test_chunk_sizes_seen_inside_module(kind, sizes):
    m = Recorder().to(device_of(kind))
    fdp = fastdp.FastDataParallel(m, replica_ids(kind, 3), chunk_sizes=sizes)
    x = _rows(10)
    out = fdp(x)
    assert _seen(m) == [s for s in sizes if s]
    assert_close(out.cpu(), m.lin(x.to(out.device)).cpu())


def test_zero_size_device_is_skipped_and_gather_order_kept():
    m = Recorder()
    fdp = fastdp.FastDataParallel(m, ["cpu"] * 4, chunk_sizes=[3, 0, 5, 2])
    x = _rows(10)
    out = fdp(x)
    assert len(m.calls) == 3  # three replicas ran, not four
    assert _seen(m) == [3, 5, 2]
    assert_close(out, m.lin(x))


def test_zero_size_devices_are_not_passed_to_replicate_or_parallel_apply():
    seen = {}

    class Spy(fastdp.FastDataParallel):
        def replicate(self, module, device_ids):
            seen["replicate"] = list(device_ids)
            return super().replicate(module, device_ids)

        def parallel_apply(self, replicas, inputs, kwargs, devices=None):
            seen["apply"] = list(devices)
            return super().parallel_apply(replicas, inputs, kwargs, devices)

    fdp = Spy(Recorder(), ["cpu"] * 3, balance=[1, 0, 1])
    fdp(_rows(6))
    assert len(seen["replicate"]) == 2 and len(seen["apply"]) == 2


@pytest.mark.parametrize(
    "batch,weights,expected",
    [
        (10, [1, 2, 1], [3, 5, 2]),  # quotas 2.5 / 5 / 2.5: the tie goes to the lower index
        (10, [1, 1, 1], [4, 3, 3]),
        (7, [0.5, 0.25, 0.25], [3, 2, 2]),  # quotas 3.5 / 1.75 / 1.75
        (2, [1, 1, 1], [1, 1, 0]),  # a device may get 0 rows
        (9, [3, 0, 1], [7, 0, 2]),
        (0, [1, 2], [0, 0]),
        (100, [0.1, 0.2, 0.7], [10, 20, 70]),  # exact, despite 0.1 + 0.2 != 0.3 in floats
    ],
)
def test_balanced_chunk_sizes_largest_remainder(batch, weights, expected):
    assert balanced_chunk_sizes(batch, weights) == expected


def test_balance_seen_inside_module_for_every_batch_size():
    m = Recorder()
    fdp = fastdp.FastDataParallel(m, ["cpu"] * 3, balance=[1, 2, 1])
    for batch in (10, 4, 2):
        m.calls.clear()
        x = _rows(batch)
        out = fdp(x)
        assert _seen(m) == [s for s in balanced_chunk_sizes(batch, [1, 2, 1]) if s]
        assert_close(out, m.lin(x))


def test_balance_zero_weight_device_never_runs():
    m = Recorder()
    fdp = fastdp.FastDataParallel(m, ["cpu"] * 3, balance=[0, 1, 1])
    fdp(_rows(9))
    assert _seen(m) == [5, 4]


def test_nested_inputs_and_kwargs_follow_chunk_sizes():
    m = Recorder()
    fdp = fastdp.FastDataParallel(m, ["cpu"] * 3, chunk_sizes=[6, 1, 3])
    x = _rows(10)
    b = torch.randn(10, 4)
    out = fdp(x, extra={"b": b, "tag": "kept"})
    assert _seen(m) == [6, 1, 3]
    assert_close(out, m.lin(x) + b.sum(1, keepdim=True))


def test_tuple_input_and_dim1():
    class Cat(nn.Module):
        def forward(self, pair):
            a, b = pair
            return a * 2 + b

    fdp = fastdp.FastDataParallel(Cat(), ["cpu"] * 2, dim=1, chunk_sizes=[1, 4])
    a, b = torch.randn(3, 5), torch.randn(3, 5)
    assert_close(fdp((a, b)), a * 2 + b)


def test_chunk_sizes_grads_equal_single_device():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    ref.load_state_dict(net.state_dict())
    x = torch.randn(11, 4)
    fastdp.FastDataParallel(net, ["cpu"] * 3, chunk_sizes=[7, 0, 4])(x).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad)


def test_default_split_is_unchanged():
    m = Recorder()
    fastdp.FastDataParallel(m, ["cpu"] * 3)(_rows(10))
    assert _seen(m) == [4, 4, 2]


def test_chunk_sizes_not_summing_to_batch_names_both_numbers():
    fdp = fastdp.FastDataParallel(Recorder(), ["cpu"] * 3, chunk_sizes=[4, 4, 1])
    with pytest.raises(ValueError, match=r"sum to 9 but the batch has 10"):
        fdp(_rows(10))


def test_chunk_sizes_checked_on_a_single_device_too():
    fdp = fastdp.FastDataParallel(Recorder(), ["cpu"], chunk_sizes=[3])
    with pytest.raises(ValueError, match=r"sum to 3 but the batch has 4"):
        fdp(_rows(4))


def test_chunk_sizes_wrong_length_names_both_numbers():
    with pytest.raises(ValueError, match=r"chunk_sizes has 2 entries but device_ids has 3"):
        fastdp.FastDataParallel(Recorder(), ["cpu"] * 3, chunk_sizes=[5, 5])
    with pytest.raises(ValueError, match=r"balance has 4 entries but device_ids has 3"):
        fastdp.FastDataParallel(Recorder(), ["cpu"] * 3, balance=[1, 1, 1, 1])


def test_chunk_sizes_and_balance_are_mutually_exclusive():
    with pytest.raises(ValueError, match=r"mutually exclusive.*chunk_sizes=\[5, 5\].*balance"):
        fastdp.FastDataParallel(Recorder(), ["cpu"] * 2, chunk_sizes=[5, 5], balance=[1, 1])


@pytest.mark.parametrize("bad", [[-1, 2], [1.5, 2], [True, 1]])
def test_chunk_sizes_must_be_non_negative_ints(bad):
    with pytest.raises(ValueError, match="non-negative ints"):
        fastdp.FastDataParallel(Recorder(), ["cpu"] * 2, chunk_sizes=bad)


@pytest.mark.parametrize("bad", [[0, 0], [-1, 2], [float("nan"), 1], [float("inf"), 1]])
def test_balance_must_be_positive_finite(bad):
    with pytest.raises(ValueError, match="balance must be finite"):
        fastdp.FastDataParallel(Recorder(), ["cpu"] * 2, balance=bad)


def test_extensions_are_keyword_only():
    with pytest.raises(TypeError):
        fastdp.FastDataParallel(Recorder(), ["cpu"] * 2, None, 0, [1, 1])


def test_zero_weight_device_skipped_without_tensor_inputs():
    calls = []

    class NoTensors(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, scale):
            calls.append(scale)
            return self.w * scale

    out = fastdp.FastDataParallel(NoTensors(), ["cpu"] * 3, balance=[1, 0, 1])(2.0)
    assert len(calls) == 2 and out.shape == (2,)
