"""Persistent replicas: built once, refreshed every step, rebuilt on every kind of change.

Each change scenario steps, changes the model, steps again and compares outputs and gradients with
the plain module on the whole batch. ``test_scenarios_fail_without_*`` re-run them against a cache
that never invalidates (or never refreshes) and require a mismatch: the tests can fail.
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
from torch import nn
from torch.testing import assert_close

from fastdp import FastDataParallel
from fastdp._replica_set import ReplicaSet
from fastdp.testing import worker_threads

pytestmark = pytest.mark.usefixtures("launch")  # NOTE [ Tests under each launch strategy ]

N = 3


class Scaled(nn.Module):
    def __init__(self, dropout=False):
        super().__init__()
        self.lin1, self.act, self.lin2 = nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4)
        if dropout:
            self.act = nn.Sequential(nn.ReLU(), nn.Dropout(0.5))
        self.scale = 1.0

    def forward(self, x):
        return self.lin2(self.act(self.lin1(x))) * self.scale


def _new_lin1(m):
    m.lin1 = nn.Linear(6, 8)


def _append(m):
    m.lin2 = nn.Sequential(m.lin2, nn.Tanh())


def _new_param(m):
    m.lin1.weight = nn.Parameter(torch.randn(8, 6))


def _data_swap(m):
    m.lin1.weight.data = torch.randn(8, 6)


def _double(m):
    m.double()


def _eval_mode(m):
    m.eval()  # dropout must be off in every replica


def _hook_added(m):
    m._hook = m.lin2.register_forward_hook(lambda mod, i, o: o * 2)


def _attribute(m):
    m.scale = 3.0


def _state_dict(m):
    torch.manual_seed(7)
    m.load_state_dict(Scaled().state_dict())


def _state_dict_assign(m):
    torch.manual_seed(8)
    m.load_state_dict(Scaled().state_dict(), assign=True)


def _register_buffer(m):
    m.lin1.register_buffer("unused", torch.ones(2))
    m.scale = 0.5


def _inplace(m):
    with torch.no_grad():
        m.lin1.weight.mul_(-2)


def _requires_grad(m):
    m.lin1.weight.requires_grad_(False)


# name -> (change, what must catch it: "invalidation" or "refresh")
SCENARIOS = {
    "replace_submodule": (_new_lin1, "invalidation"),
    "module_tree": (_append, "invalidation"),
    "parameter_identity": (_new_param, "invalidation"),
    "parameter_data_swap": (_data_swap, "invalidation"),
    "dtype_double": (_double, "invalidation"),
    "eval_mode": (_eval_mode, "invalidation"),
    "hook_added": (_hook_added, None),  # replicas share the hook dicts: no rebuild needed
    "plain_attribute": (_attribute, "invalidation"),
    "load_state_dict": (_state_dict, "refresh"),
    "load_state_dict_assign": (_state_dict_assign, "invalidation"),
    "register_buffer_and_attribute": (_register_buffer, "invalidation"),
    "inplace_update": (_inplace, "refresh"),
    "requires_grad": (_requires_grad, None),  # autograd's needs_input_grad handles it
}


def _fdp_step(fdp, x):
    fdp.module.zero_grad(set_to_none=True)
    out = fdp(x)
    out.sum().backward()
    return out.detach(), {n: p.grad for n, p in fdp.module.named_parameters()}


def run_scenario(name):
    """Returns (fastdp outputs, grads) and (plain outputs, grads) after the change."""
    change, _ = SCENARIOS[name]
    torch.manual_seed(0)
    model = Scaled(dropout=name == "eval_mode")
    fdp = FastDataParallel(model, device_ids=["cpu"] * N)
    x = torch.randn(9, 6)
    _fdp_step(fdp, x)
    _fdp_step(fdp, x)  # the cache is warm
    change(model)
    xx = x.to(next(model.parameters()).dtype)
    out, grads = _fdp_step(fdp, xx)
    model.zero_grad(set_to_none=True)
    ref = model(xx)
    ref.sum().backward()
    return (out, grads), (ref.detach(), {n: p.grad for n, p in model.named_parameters()})


def _matches(a, b):
    try:
        assert_close(a[0], b[0], rtol=1e-5, atol=1e-6)
        assert a[1].keys() == b[1].keys()
        for k in a[1]:
            if a[1][k] is None or b[1][k] is None:
                assert a[1][k] is None and b[1][k] is None, k
            else:
                assert_close(a[1][k], b[1][k], rtol=1e-5, atol=1e-6)
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_change_between_steps_is_seen(backend, name):
    got, ref = run_scenario(name)
    assert _matches(got, ref)


def _fails(name):
    try:
        got, ref = run_scenario(name)
    except Exception:
        return True  # a stale replica that raises also counts as caught
    return not _matches(got, ref)


def test_scenarios_fail_without_invalidation(monkeypatch):
    monkeypatch.setattr(ReplicaSet, "valid", lambda self, verified=None: True)
    caught = [n for n, (_, by) in SCENARIOS.items() if by == "invalidation"]
    assert all(_fails(n) for n in caught), [n for n in caught if not _fails(n)]


def test_scenarios_fail_without_refresh(monkeypatch):
    """On the torch path, where the copy is a patchable Python method (the extension's copy is
    inside its C++ refresh, exercised by every other test)."""
    from fastdp import _backend

    monkeypatch.setattr(_backend, "_enabled", False)
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "1")  # copies, as on other devices
    monkeypatch.setattr(ReplicaSet, "copy_sources", lambda self: None)
    caught = [n for n, (_, by) in SCENARIOS.items() if by == "refresh"]
    assert all(_fails(n) for n in caught)


def test_replicas_are_built_once_in_steady_state(backend, replica_builds):
    builds = replica_builds
    model = Scaled()
    fdp = FastDataParallel(model, device_ids=["cpu"] * N)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        opt.zero_grad()
        fdp(torch.randn(9, 6)).sum().backward()
        opt.step()
    assert len(builds) == 1
    r1 = fdp.replicate(model, fdp.device_ids)
    assert fdp.replicate(model, fdp.device_ids)[1] is r1[1]  # the same replica objects


@pytest.mark.parametrize("alias", [True, False])
def test_copy_path_matches_alias_path(backend, monkeypatch, alias):
    """Replicas on another device hold copies; on one machine the copy path is forced."""
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "0" if alias else "1")
    for name in ("inplace_update", "load_state_dict", "parameter_data_swap"):
        got, ref = run_scenario(name)
        assert _matches(got, ref), name


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
    """The first graph is still pending when the second forward refreshes: no in-place
    clobbering of tensors it saved (plain PyTorch allows this pattern, so must we)."""
    torch.manual_seed(0)
    model = Scaled()
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
    model = Scaled()
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
    model = Scaled()
    fdp = FastDataParallel(model, device_ids=["cpu"] * N)
    x = torch.randn(9, 6)
    with torch.inference_mode():
        assert_close(fdp(x), model(x))
    with torch.no_grad():
        fdp(x)
    got = _fdp_step(fdp, x)
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    for n, p in model.named_parameters():
        assert_close(got[1][n], p.grad, msg=n)


def test_held_outputs_across_steps_stay_correct(backend, monkeypatch):
    """Users who keep losses across steps (``losses.append(loss)``) keep graphs alive; forced
    copies (as on other devices) must then not be overwritten under those graphs."""
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "1")
    torch.manual_seed(0)
    model = Scaled()
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
    """NOTE [ RNN replicas ]: a replica's LSTM never rebuilds its weight list in forward (that
    would call flatten_parameters, which moves cuDNN weights off the refreshed tensors), also
    after its tensors are renewed under a held graph; training matches the module."""
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
