"""Persistent replicas: built once, refreshed every step, kept across steps and through inference
mode, released with the wrapper. Rebuilt on every kind of change: tests/test_replicas_staleness.py.
"""

import copy
import gc
import os
import signal
import threading
import time
import weakref

import pytest
import torch
from models import ScaledMLP
from torch import nn
from torch.testing import assert_close

from fastdp import FastDataParallel
from fastdp.testing import output_and_grads, worker_threads

pytestmark = pytest.mark.usefixtures("launch")  # NOTE [ Tests under each launch strategy ]

N = 3


def test_replicas_are_built_once_in_steady_state(backend, replica_builds):
    builds = replica_builds
    model = ScaledMLP()
    fdp = FastDataParallel(model, device_ids=["cpu"] * N)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        opt.zero_grad()
        fdp(torch.randn(9, 6)).sum().backward()
        opt.step()
    assert len(builds) == 1
    r1 = fdp.replicate(model, fdp.device_ids)
    assert fdp.replicate(model, fdp.device_ids)[1] is r1[1]  # the same replica objects


def test_same_device_replicas_alias_storage_with_own_versions(backend, monkeypatch):
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "0")  # the suite may run with distinct replicas
    model = nn.Linear(3, 3)
    fdp = FastDataParallel(model, device_ids=["cpu"] * 3)
    fdp(torch.randn(6, 3)).sum().backward()
    r = fdp.replicate(model, fdp.device_ids)
    for rep in r[1:]:
        assert rep.weight.data_ptr() == model.weight.data_ptr()  # no copy on the same device
    v = model.weight._version
    with torch.no_grad():
        r[2].weight.add_(0)
    assert model.weight._version == v


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_fifty_step_training_matches_plain_module(backend, opt_name):
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 2)
    )
    ref = copy.deepcopy(model)
    fdp = FastDataParallel(model, device_ids=["cpu"] * 4)
    make = (
        (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
        if opt_name == "sgd"
        else (lambda p: torch.optim.Adam(p, lr=1e-2))
    )
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    g = torch.Generator().manual_seed(2)
    for step in range(50):
        b = [16, 16, 16, 5, 3, 2][step % 6]  # partial batches: fewer replicas, other device tuples
        x, y = torch.randn(b, 6, generator=g), torch.randn(b, 2, generator=g)
        for m, o in ((fdp, opt), (ref, ref_opt)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


def test_two_forwards_before_one_backward(backend):
    """The first graph is still alive when the second forward refreshes: no in-place
    clobbering of tensors it saved (plain PyTorch allows this pattern, so must we)."""
    torch.manual_seed(0)
    model = ScaledMLP()
    fdp = FastDataParallel(model, device_ids=["cpu"] * N)
    a, b = torch.randn(9, 6), torch.randn(6, 6)
    fdp(a).sum().backward()
    with torch.no_grad():
        model.lin1.weight.add_(0.5)  # an optimizer-like update between steps
    model.zero_grad()
    (fdp(a).sum() + fdp(b).pow(2).sum()).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    (model(a).sum() + model(b).pow(2).sum()).backward()
    for n, p in model.named_parameters():
        assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_two_forwards_before_one_backward_with_batchnorm(backend):
    """BatchNorm saves its running statistics for backward: the second forward's buffer refresh
    must not overwrite the copies the first graph saved (it raised "modified by an inplace
    operation"). Reference: the plain module on the same chunks (per-replica statistics)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    ref = copy.deepcopy(model)
    fdp = FastDataParallel(model, device_ids=["cpu"] * 2)
    a, b = torch.randn(8, 6), torch.randn(6, 6)
    fdp(a).sum().backward()
    model.zero_grad()
    (fdp(a).sum() + fdp(b).pow(2).sum()).backward()
    chunked = [torch.cat([ref(c) for c in x.chunk(2)]) for x in (a, a, b)]
    ref.zero_grad()
    (chunked[1].sum() + chunked[2].pow(2).sum()).backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_gradient_hooks_on_originals_see_the_total_once(backend):
    model = nn.Linear(3, 1)
    seen = []
    model.weight.register_hook(lambda g: seen.append(g.clone()))
    fdp = FastDataParallel(model, device_ids=["cpu"] * 3)
    x = torch.randn(6, 3)
    fdp(x).sum().backward()
    assert len(seen) == 1
    assert_close(seen[0], x.sum(0, keepdim=True))


def test_autograd_grad_wrt_parameters(backend):
    model = nn.Linear(3, 2)
    fdp = FastDataParallel(model, device_ids=["cpu"] * 3)
    x = torch.randn(6, 3)
    (gw,) = torch.autograd.grad(fdp(x).sum(), [model.weight])
    assert_close(gw, torch.ones(2, 1) * x.sum(0))


def test_deleting_the_wrapper_releases_threads_replicas_and_module(backend, launch):
    before = set(worker_threads())  # other tests' workers may end meanwhile: follow this one's only
    model = ScaledMLP()
    fdp = FastDataParallel(model, device_ids=["cpu"] * 4)
    fdp(torch.randn(8, 6)).sum().backward()
    mine = set(worker_threads()) - before
    assert len(mine) == (0 if launch == "inline" else 4)  # auto: threads first
    replica = weakref.ref(fdp.replicate(model, fdp.device_ids)[1])
    wrapper, module = weakref.ref(fdp), weakref.ref(model)
    del fdp, model
    gc.collect()
    deadline = time.time() + 5
    while any(t.is_alive() for t in mine) and time.time() < deadline:
        time.sleep(0.01)
    assert not any(t.is_alive() for t in mine)
    assert wrapper() is None and replica() is None and module() is None


class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cfg = {"delay": 0.0}  # shared by reference with the replicas

    def forward(self, x):
        time.sleep(self.cfg["delay"])
        return self.lin(x)


def test_keyboard_interrupt_returns_promptly_and_next_step_works(backend, sigint):
    model = Slow()
    fdp = FastDataParallel(model, device_ids=["cpu"] * 2)
    x = torch.randn(4, 4)
    fdp(x)
    model.cfg["delay"] = 2.0
    threads = len(threading.enumerate())
    timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
    start = time.perf_counter()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        fdp(x)
    assert time.perf_counter() - start < 1.2  # 0.2 s until the signal, then < 1 s
    sigint["armed"] = False
    timer.join()
    model.cfg["delay"] = 0.0
    assert_close(fdp(x), model(x))  # waits for the interrupted tasks, then runs correctly
    assert len(threading.enumerate()) <= threads


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1  # DataParallel: lost with the replica after every step
        self.last_rows = x.shape[0]
        return self.lin(x) * self.calls


def test_attributes_set_in_forward_do_not_outlive_the_step(backend):
    model = Counter()
    fdp = FastDataParallel(model, device_ids=["cpu"] * 2)
    x = torch.ones(4, 2)
    for _ in range(3):
        assert_close(fdp(x), model.lin(x))  # calls is 1 inside every replica, every step
    assert model.calls == 0 and not hasattr(model, "last_rows")
    replica = fdp.replicate(model, fdp.device_ids)[1]
    assert replica.calls == 0 and not hasattr(replica, "last_rows")


def test_first_call_in_inference_mode_then_training(backend):
    """Replica tensors made inside inference_mode must still serve later training steps."""
    torch.manual_seed(0)
    model = ScaledMLP()
    fdp = FastDataParallel(model, device_ids=["cpu"] * N)
    x = torch.randn(9, 6)
    with torch.inference_mode():
        assert_close(fdp(x), model(x))
    with torch.no_grad():
        fdp(x)
    got = output_and_grads(fdp, x)
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    for n, p in model.named_parameters():
        assert_close(got[1][n], p.grad, msg=n)


def test_held_outputs_across_steps_stay_correct(backend, monkeypatch):
    """Users who keep losses across steps (``losses.append(loss)``) keep graphs alive; forced
    copies (as on other devices) must then not be overwritten under those graphs."""
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "1")
    torch.manual_seed(0)
    model = ScaledMLP()
    fdp = FastDataParallel(model, device_ids=["cpu"] * N)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    held = []
    for _ in range(4):
        x = torch.randn(9, 6)
        for m, o in ((fdp, opt), (ref, ref_opt)):
            o.zero_grad()
            loss = m(x).pow(2).sum()
            if m is fdp:
                held.append(loss)
            loss.backward(retain_graph=True)
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p, q, rtol=1e-5, atol=1e-6)


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 8, num_layers=2, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.lstm(x)[0])


@pytest.mark.parametrize("alias", [True, False])
def test_rnn_replicas_keep_their_weight_cache_and_train_as_the_module(backend, monkeypatch, alias):
    """``_RNN_CACHE`` (fastdp/_replica_set.py): a replica's LSTM never rebuilds its weight list
    in forward (that would call flatten_parameters, which moves cuDNN weights off the refreshed
    tensors), also after its tensors are renewed under a held graph; training matches the
    module."""
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "0" if alias else "1")
    rebuilt = []
    orig = nn.LSTM._init_flat_weights

    def counting(self):
        rebuilt.append(self)
        orig(self)

    monkeypatch.setattr(nn.LSTM, "_init_flat_weights", counting)
    torch.manual_seed(0)
    model = _Recurrent()
    ref = copy.deepcopy(model)
    fdp = FastDataParallel(model, device_ids=["cpu"] * 3)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    held = []
    for step in range(6):
        x = torch.randn(7, 4, 6)
        for m, o in ((fdp, opt), (ref, ref_opt)):
            o.zero_grad()
            loss = m(x).pow(2).mean()
            if m is fdp and step % 2:
                held.append(loss)  # a live graph: the next refresh renews the replicas' tensors
            loss.backward(retain_graph=True)
            o.step()
    assert [m for m in rebuilt if m is not model.lstm and m is not ref.lstm] == []
    for rep in fdp.replicate(model, fdp.device_ids):
        lstm = rep.lstm
        assert [
            w is getattr(lstm, n) for w, n in zip(lstm._flat_weights, lstm._flat_weights_names)
        ] == [True] * 8
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p, q, rtol=1e-5, atol=1e-6)
