"""The wrapper pickles and deep-copies as nn.DataParallel does: the module and the settings go,
the per-process state is rebuilt on the next step (``FastDataParallel._RUNTIME``)."""

import contextlib
import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import fastdp
from fastdp import FastDataParallel
from fastdp.data_parallel import live_wrappers


def _saved(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


ROUND_TRIPS = {"save": _saved, "deepcopy": copy.deepcopy}
round_trip = pytest.mark.parametrize("trip", list(ROUND_TRIPS))


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


def _batch(i, rows=11):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)


class _Run:
    """A wrapper, its optimizer and the steps it takes: ``step(i)`` a synced step with an
    optimizer step, ``micro(i)`` a ``no_sync()`` forward and backward, ``backward(i)`` a synced
    forward and backward without the optimizer step."""

    def __init__(self, fdp):
        self.fdp = fdp
        self.opt = torch.optim.SGD(fdp.parameters(), lr=0.1, momentum=0.9)

    def _fb(self, i, quiet=False):
        x, y = _batch(i)
        with self.fdp.no_sync() if quiet else contextlib.nullcontext():
            out = self.fdp(x)
            F.mse_loss(out, y).backward()
        return out.detach()

    def step(self, i):
        out = self._fb(i)
        self.opt.step()
        self.opt.zero_grad()
        return out

    def micro(self, i):
        return self._fb(i, quiet=True)

    def backward(self, i):
        return self._fb(i)


# what the wrapper went through before the round trip
HISTORIES = {
    "fresh": [],
    "steps": ["step", "step"],
    "no_sync": ["step", "micro"],
    "backward": ["step", "backward"],
}


def _assert_same(a, b):
    """Bit for bit: parameters, their ``.grad`` and buffers of two wrappers' modules."""
    for (n, p), (_, q) in zip(a.module.named_parameters(), b.module.named_parameters()):
        assert torch.equal(p, q), n
        assert (p.grad is None) == (q.grad is None), n
        assert p.grad is None or torch.equal(p.grad, q.grad), n
    for (n, s), (_, t) in zip(a.module.named_buffers(), b.module.named_buffers()):
        assert torch.equal(s, t), n


@pytest.mark.usefixtures("launch", "storage")  # NOTE [ Tests under each launch strategy ]
@pytest.mark.parametrize("history", list(HISTORIES))
@round_trip
def test_copy_trains_as_a_fresh_wrapper_of_a_copy_and_the_original_goes_on(backend, trip, history):
    runs = [_Run(FastDataParallel(_net(), ["cpu"] * 3)) for _ in range(2)]
    for i, what in enumerate(HISTORIES[history]):
        for run in runs:
            getattr(run, what)(i)
    orig, twin = runs  # twin: the same history, never saved nor copied
    clone = ROUND_TRIPS[trip](orig.fdp)
    ref = FastDataParallel(copy.deepcopy(orig.fdp.module), ["cpu"] * 3)
    assert clone.module is not orig.fdp.module
    assert isinstance(clone, nn.DataParallel) and clone in live_wrappers()
    assert list(clone.state_dict()) == list(orig.fdp.state_dict())
    assert clone.device_ids == orig.fdp.device_ids and clone.launch == orig.fdp.launch
    _assert_same(clone, ref)
    copied, fresh = _Run(clone), _Run(ref)
    for i in range(10, 13):
        assert torch.equal(copied.step(i), fresh.step(i))
        _assert_same(clone, ref)
        assert torch.equal(orig.step(i), twin.step(i))
        _assert_same(orig.fdp, twin.fdp)
    assert clone.no_sync_stats == ref.no_sync_stats


@pytest.mark.usefixtures("launch")
@round_trip
def test_copy_made_inside_no_sync_is_a_fresh_wrapper_and_the_original_stays_inside(backend, trip):
    orig, twin = (_Run(FastDataParallel(_net(), ["cpu"] * 2)) for _ in range(2))
    with orig.fdp.no_sync(), twin.fdp.no_sync():
        orig.backward(0), twin.backward(0)  # micro-steps: the context is entered above
        clone = _Run(ROUND_TRIPS[trip](orig.fdp))
        ref = _Run(FastDataParallel(copy.deepcopy(orig.fdp.module), ["cpu"] * 2))
        for run in (orig, twin, clone, ref):  # synced for the copies, micro-steps for the others
            run.backward(1)
    for a, b in ((clone, ref), (orig, twin)):
        a.backward(2), b.backward(2)
        _assert_same(a.fdp, b.fdp)


@round_trip
def test_ema_copy_of_the_wrapper_follows_the_model_as_timms_model_ema(backend, trip):
    """timm's ``ModelEmaV2(model)`` after the DataParallel wrapper: ``deepcopy(model)``, then
    the copy's tensors move towards the model's under ``no_grad`` every step."""
    model = _Run(FastDataParallel(_net(), ["cpu"] * 3))
    model.step(0)
    ema = ROUND_TRIPS[trip](model.fdp).eval()
    plain = copy.deepcopy(model.fdp.module).eval()  # the same updates, on the plain module
    x, _ = _batch(99)
    for i in range(1, 4):
        model.step(i)
        with torch.no_grad():
            for dst in (ema.module, plain):
                for e, m in zip(dst.parameters(), model.fdp.module.parameters()):
                    e.lerp_(m, 0.1)
                for e, m in zip(dst.buffers(), model.fdp.module.buffers()):
                    e.copy_(m)
            assert_close(ema(x), plain(x))
    for e, p in zip(ema.module.parameters(), plain.parameters()):
        assert torch.equal(e, p)


class _Halves(nn.Module):
    """Splits along dim 1 (a wrapper with ``dim=1``): features first, rows second."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x.transpose(0, 1)).transpose(0, 1)


SETTINGS = {
    "persistent": False,
    "chunk_sizes": [3, 0, 5],
    "balance": [1.0, 2.0, 1.0],
    "bucket_cap_mb": 0.001,
    "strict_chunks": True,
    "scalar_outputs": "mean",
    "launch": "inline",
    "output_device": "cpu",
}


@round_trip
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_keyword_settings_survive_the_round_trip(trip, setting):
    fdp = FastDataParallel(_Halves(), ["cpu"] * 3, dim=1, **{setting: SETTINGS[setting]})
    x = torch.randn(4, 8)
    fdp(x).sum().backward()
    clone = ROUND_TRIPS[trip](fdp)
    names = ("dim", "output_device", "persistent", "chunk_sizes", "balance", "bucket_cap_mb")
    for name in (*names, "strict_chunks", "scalar_outputs", "gather_output", "launch"):
        assert getattr(clone, name) == getattr(fdp, name), name
    assert torch.equal(clone(x), fdp(x))


@round_trip
def test_parallel_criterion_wrapper_keeps_gather_output_false(backend, trip):
    fdp = FastDataParallel(_net(), ["cpu"] * 3, gather_output=False)
    crit = fastdp.ParallelCriterion(nn.MSELoss())
    x, y = _batch(0)
    crit(fdp(x), y).backward()
    clone = ROUND_TRIPS[trip](fdp)
    ref = FastDataParallel(copy.deepcopy(fdp.module), ["cpu"] * 3, gather_output=False)
    out = clone(x)
    assert isinstance(out, fastdp.Scattered)
    crit(out, y).backward()
    crit(ref(x), y).backward()
    _assert_same(clone, ref)


def test_runtime_names_are_what_start_makes():
    """``_RUNTIME`` names every attribute ``_start`` sets (plus the direct-call compile cache),
    so none of them is ever saved."""
    fdp = FastDataParallel(nn.Linear(2, 2), ["cpu"] * 2)
    for name in FastDataParallel._RUNTIME:
        fdp.__dict__.pop(name, None)
    before = set(vars(fdp))
    fdp._start()
    assert set(vars(fdp)) - before == set(FastDataParallel._RUNTIME) - {"_direct_compiled"}
