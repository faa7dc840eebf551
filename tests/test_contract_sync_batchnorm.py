"""SyncBatchNorm across replicas in one process, and ``__data_parallel_replicate__`` (point 3)."""

import _thread
import copy
import gc
import sys
import threading
import time
import weakref

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import fastdp
from fastdp import sync_batchnorm
from fastdp.sync_batchnorm import replicas_meet as must_run_together
from fastdp.testing import device_of, replica_ids, withCUDA


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3),
        nn.BatchNorm2d(6, momentum=None),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, 5),
        nn.BatchNorm1d(5, affine=False),
    ).double()


def _sync_and_ref(net):
    """(SyncBatchNorm-converted copy, plain-BatchNorm reference copy)."""
    return nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(net)), copy.deepcopy(net)


def _assert_same_state(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert_close(p, q, msg=name)
        assert_close(p.grad, q.grad, msg=f"grad of {name}")
    for (name, x), y in zip(a.named_buffers(), b.buffers()):
        assert_close(x, y, msg=name)


@withCUDA
@pytest.mark.parametrize(
    "n,split", [(2, {}), (3, {}), (3, {"chunk_sizes": [6, 1, 3]}), (4, {"balance": [1, 0, 2, 1]})]
)
def test_training_steps_equal_whole_batch_batchnorm(kind, n, split):
    sync, ref = _sync_and_ref(_cnn())
    dev = device_of(kind)
    sync.to(dev)
    ref.to(dev)
    fdp = fastdp.FastDataParallel(sync, replica_ids(kind, n), **split)
    opt_a = torch.optim.SGD(sync.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(10, 3, 6, 6, generator=g, dtype=torch.float64).to(dev)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = fdp(xa), ref(xb)
        assert_close(ya, yb)
        (ya * torch.arange(5.0, dtype=ya.dtype, device=dev)).pow(2).sum().backward()
        (yb * torch.arange(5.0, dtype=yb.dtype, device=dev)).pow(2).sum().backward()
        assert_close(xa.grad, xb.grad)
        _assert_same_state(sync, ref)
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
    assert int(sync[1].num_batches_tracked) == 3


def test_plain_batchnorm_is_still_per_replica():
    # DataParallel semantics stay for unconverted BatchNorm: statistics of each replica's chunk.
    net = _cnn()
    x = torch.randn(10, 3, 6, 6, dtype=torch.float64)
    with pytest.raises(AssertionError):
        assert_close(fastdp.FastDataParallel(net, ["cpu"] * 2)(x), copy.deepcopy(net)(x))


@pytest.mark.parametrize(
    "shape,bn",
    [
        ((9, 4, 7), lambda: nn.BatchNorm1d(4)),
        ((9, 4), lambda: nn.BatchNorm1d(4, track_running_stats=False)),
        ((9, 2, 3, 2, 2), lambda: nn.BatchNorm3d(2, affine=False)),
    ],
)
def test_layer_variants_equal_whole_batch(shape, bn):
    sync, ref = _sync_and_ref(nn.Sequential(bn()).double())
    fdp = fastdp.FastDataParallel(sync, ["cpu"] * 3)
    for training in (True, False):
        sync.train(training)
        ref.train(training)
        x = torch.randn(*shape, dtype=torch.float64)
        assert_close(fdp(x), ref(x))
        for a, b in zip(sync.buffers(), ref.buffers()):
            assert_close(a, b)


def test_shared_layer_called_twice_per_forward():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(3)

        def forward(self, x):
            return self.bn(self.bn(x) * 2 + 1)

    sync, ref = _sync_and_ref(Twice().double())
    x = torch.randn(8, 3, dtype=torch.float64)
    assert_close(fastdp.FastDataParallel(sync, ["cpu"] * 3)(x), ref(x))
    assert_close(sync.bn.running_var, ref.bn.running_var)


def test_eval_mode_uses_running_stats_without_meeting(monkeypatch):
    sync, ref = _sync_and_ref(_cnn())
    sync.eval()
    ref.eval()

    def no_meeting(*args, **kwargs):
        raise AssertionError("replicas met in eval mode")

    monkeypatch.setattr(sync_batchnorm._Rendezvous, "exchange", no_meeting)
    x = torch.randn(7, 3, 6, 6, dtype=torch.float64)
    assert_close(fastdp.FastDataParallel(sync, ["cpu"] * 3)(x), ref(x))


def test_gradcheck_through_replicas():
    torch.manual_seed(0)
    sync = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(2))).double()
    sync[0].weight.data.uniform_(0.5, 1.5)
    sync[0].bias.data.uniform_(-1, 1)
    fdp = fastdp.FastDataParallel(sync, ["cpu"] * 3)
    x = torch.randn(7, 2, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fdp, (x,))


def test_gradcheck_batch_norm_elemt_function():
    x = torch.randn(5, 3, 2, dtype=torch.float64, requires_grad=True)
    args = [torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    args[1] = args[1].detach().abs().add(0.5).requires_grad_()  # invstd > 0
    assert torch.autograd.gradcheck(sync_batchnorm._BatchNormElemt.apply, (x, *args))


class _Failing(nn.Module):
    """Replica holding the sentinel row raises (or sleeps, or skips its second BatchNorm)."""

    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.bn1 = nn.BatchNorm1d(3)
        self.bn2 = nn.BatchNorm1d(3)

    def forward(self, x):
        marked = bool((x[:, 0] == 1000).any())
        if marked and self.mode == "raise":
            raise KeyError("boom in the marked replica")
        if marked and self.mode == "sleep":
            time.sleep(1.0)
        x = self.bn1(x)
        if marked and self.mode == "skip":
            return x
        return self.bn2(x)


def _run_bounded(fn, seconds=20):
    """Run fn in a thread; fail (not hang) if it does not finish."""
    box = {}

    def target():
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["err"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "FastDataParallel hung"
    return box


def _marked_batch():
    x = torch.randn(9, 3)
    x[7, 0] = 1000  # in replica 2 of 3
    return x


def test_replica_exception_releases_the_others_and_surfaces(monkeypatch):
    monkeypatch.setenv("FASTDP_SYNC_TIMEOUT", "60")
    fdp = fastdp.FastDataParallel(
        nn.SyncBatchNorm.convert_sync_batchnorm(_Failing("raise")), ["cpu"] * 3
    )
    start = time.monotonic()
    box = _run_bounded(lambda: fdp(_marked_batch()))
    assert time.monotonic() - start < 10
    assert isinstance(box["err"], KeyError)
    assert "in replica 2 on device cpu" in str(box["err"])
    fdp(torch.randn(9, 3))  # the next step is clean


def test_replica_skipping_a_layer_is_an_error_not_a_hang(monkeypatch):
    monkeypatch.setenv("FASTDP_SYNC_TIMEOUT", "60")
    fdp = fastdp.FastDataParallel(
        nn.SyncBatchNorm.convert_sync_batchnorm(_Failing("skip")), ["cpu"] * 3
    )
    box = _run_bounded(lambda: fdp(_marked_batch()))
    assert isinstance(box["err"], RuntimeError)
    assert "same number of times" in str(box["err"]) and "bn2" in str(box["err"])


def test_timeout_when_a_replica_is_stuck(monkeypatch):
    monkeypatch.setenv("FASTDP_SYNC_TIMEOUT", "0.2")
    fdp = fastdp.FastDataParallel(
        nn.SyncBatchNorm.convert_sync_batchnorm(_Failing("sleep")), ["cpu"] * 3
    )
    box = _run_bounded(lambda: fdp(_marked_batch()))
    assert isinstance(box["err"], TimeoutError)
    assert "FASTDP_SYNC_TIMEOUT" in str(box["err"])


class _Stalling(nn.Module):
    """While ``ctl["stall"]`` (one dict the replicas share), the marked row's replica presses
    Ctrl-C for the caller, then waits for ``ctl["resume"]`` before the BatchNorm others wait at."""

    def __init__(self):
        super().__init__()
        self.ctl = {"stall": False, "resume": threading.Event()}
        self.bn1 = nn.BatchNorm1d(3)
        self.lin = nn.Linear(3, 3)
        self.bn2 = nn.BatchNorm1d(3)

    def forward(self, x):
        if self.ctl["stall"] and bool((x[:, 0] == 1000).any()):
            _thread.interrupt_main()
            self.ctl["resume"].wait(60)
        return self.bn2(self.lin(self.bn1(x)))


@pytest.mark.usefixtures("storage", "launch")  # replicas that meet run on threads under each
@pytest.mark.parametrize("resume", ["before_next_step", "once_next_step_armed"])
def test_step_after_an_interrupted_step_runs_at_once(resume, monkeypatch, sigint):
    """Ctrl-C while replicas wait at a SyncBatchNorm: the next step neither waits for
    FASTDP_SYNC_TIMEOUT nor fails, and equals BatchNorm on the whole batch, whether the
    interrupted step's late replica goes on before the next step or once it armed its own."""
    monkeypatch.setenv("FASTDP_SYNC_TIMEOUT", "5")
    ref = _Stalling().double()
    sync = nn.SyncBatchNorm.convert_sync_batchnorm(_Stalling().double())
    sync.load_state_dict(ref.state_dict())
    ctl = sync.ctl
    fdp = fastdp.FastDataParallel(sync, ["cpu"] * 3)
    fdp(torch.randn(9, 3, dtype=torch.float64))  # warm-up: persistent replicas, workers
    ctl["stall"] = True
    with pytest.raises(KeyboardInterrupt):
        fdp(_marked_batch().double())
    ctl["stall"], sigint["armed"] = False, False
    if resume == "before_next_step":
        ctl["resume"].set()
    else:
        wrapper = sys.modules["fastdp.data_parallel"]
        arm = wrapper.prepare_replicas

        def arm_then_resume(replicas):
            prepared = arm(replicas)
            ctl["resume"].set()
            return prepared

        monkeypatch.setattr(wrapper, "prepare_replicas", arm_then_resume)
    x = torch.randn(9, 3, dtype=torch.float64, requires_grad=True)
    start = time.monotonic()
    box = _run_bounded(lambda: fdp(x))
    assert time.monotonic() - start < 2.5, "the next step waited for FASTDP_SYNC_TIMEOUT"
    assert "err" not in box, box.get("err")
    box["out"].square().sum().backward()
    xr = x.detach().clone().requires_grad_()
    ref(xr).square().sum().backward()
    assert_close(box["out"], ref(xr.detach()))
    assert_close(x.grad, xr.grad)
    for (name, p), q in zip(sync.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, msg=name)


class _Spy(fastdp.FastDataParallel):
    def replicate(self, module, device_ids):
        replicas = super().replicate(module, device_ids)
        self.last = [weakref.ref(r) for r in replicas]
        self.forwards = [r.__dict__.get("forward") for r in replicas]
        return replicas


@pytest.mark.parametrize("root_is_bn", [False, True])
def test_replicas_left_untouched_and_freed_without_gc(root_is_bn):
    sync, _ = _sync_and_ref(_cnn())
    x = torch.randn(6, 3, 6, 6, dtype=torch.float64)
    if root_is_bn:
        sync, x = nn.SyncBatchNorm(3).double(), x[:, :, 0]
    fdp = _Spy(sync, ["cpu"] * 3, persistent=False)  # fresh replicas every step
    fdp(x).sum().backward()  # warm-up (lazy imports, caches)
    gc.collect()
    gc.disable()
    try:
        fdp(x).sum().backward()
        assert all(ref() is None for ref in fdp.last), "replicas kept alive (reference cycle?)"
    finally:
        gc.enable()
    assert all("forward" not in m.__dict__ for m in sync.modules())  # originals never patched


def test_prepared_replicas_are_restored_after_the_step():
    sync, ref = _sync_and_ref(_cnn())
    replicas = fastdp.replicate.replicate(sync, ["cpu"] * 2)
    with sync_batchnorm.prepare_replicas(replicas):
        assert isinstance(replicas[0][1].__dict__["forward"], sync_batchnorm._Forward)
        assert must_run_together(replicas)  # asked of the replicas, not of a registry
    assert all("forward" not in m.__dict__ for r in replicas for m in r.modules())
    assert not must_run_together(replicas)


def test_block_left_while_replicas_may_still_run():
    """Left by an error while replicas may run, the block keeps their forwards, closed: the
    replicas no longer meet, a later call runs the module's own forward."""
    sync, ref = _sync_and_ref(_cnn())
    replicas = fastdp.replicate.replicate(sync, ["cpu"] * 2)
    with pytest.raises(KeyboardInterrupt):
        with sync_batchnorm.prepare_replicas(replicas):
            raise KeyboardInterrupt  # before the launch: a replica might still be queued
    assert not must_run_together(replicas)
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    assert_close(replicas[1](x), ref(x))  # no process group: plain BatchNorm behaviour
    with sync_batchnorm.prepare_replicas(replicas):  # armed again, then restored
        assert must_run_together(replicas)
    assert all("forward" not in m.__dict__ for r in replicas for m in r.modules())


def test_persistent_replicas_are_reused_and_left_clean():
    sync, ref = _sync_and_ref(_cnn())
    fdp = _Spy(sync, ["cpu"] * 3)
    x = torch.randn(6, 3, 6, 6, dtype=torch.float64)
    fdp(x).sum().backward()
    first = [r() for r in fdp.last]
    fdp(x).sum().backward()
    assert [r() for r in fdp.last] == first  # the same replica objects: cached
    assert all("forward" not in m.__dict__ for r in first for m in r.modules())


def test_converted_model_still_works_alone():
    sync, ref = _sync_and_ref(_cnn())
    x = torch.randn(6, 3, 6, 6, dtype=torch.float64)
    fastdp.FastDataParallel(sync, ["cpu"] * 2)(x)
    ref(x)
    assert_close(sync(x), ref(x))  # no process group: plain BatchNorm behaviour


class MeanCentering(nn.Module):
    """A Synchronized-BatchNorm-PyTorch-style module: copies talk through the shared ctx."""

    calls = []

    def __data_parallel_replicate__(self, ctx, copy_id):
        if copy_id == 0:  # the master copy is called first
            ctx.cond, ctx.sums, ctx.copies = threading.Condition(), {}, 0
        ctx.copies += 1
        self._ctx, self._copy_id = ctx, copy_id
        MeanCentering.calls.append((id(ctx), copy_id))

    def forward(self, x):
        ctx = getattr(self, "_ctx", None)
        if ctx is None:
            return x - x.mean(0)
        with ctx.cond:
            ctx.sums[self._copy_id] = (x.detach().sum(0), len(x))
            ctx.cond.notify_all()
            ctx.cond.wait_for(lambda: len(ctx.sums) == ctx.copies, timeout=10)
        total = sum(s for s, _ in ctx.sums.values())
        return x - total / sum(n for _, n in ctx.sums.values())


def test_replication_callback_protocol():
    net = nn.Sequential(nn.Linear(4, 4), MeanCentering(), nn.Sequential(MeanCentering()))
    fdp = fastdp.FastDataParallel(net, ["cpu"] * 3)
    x = torch.randn(10, 4)
    for _ in range(2):
        MeanCentering.calls.clear()
        assert_close(fdp(x), _centered_twice(net, x))
        ctxs = {}
        for ctx, copy_id in MeanCentering.calls:
            ctxs.setdefault(ctx, []).append(copy_id)
        assert len(ctxs) == 2  # one shared context per original module
        assert all(ids == [0, 1, 2] for ids in ctxs.values())  # master first, every copy once
    assert not hasattr(net[1], "_ctx")  # the original is not called back


def _centered_twice(net, x):
    y = net[0](x)
    y = y - y.mean(0)
    return y - y.mean(0)
