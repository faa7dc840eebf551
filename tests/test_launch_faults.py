"""Faults on CPU replicas: a replica that raises (an Exception or any other BaseException), Ctrl-C
mid-step, deleting the wrapper.

Each test measures the thread count after a warm-up step (persistent worker threads, when there are
any, exist by then) and requires it to be the same after the fault, and the next step to match the
plain module on the whole batch (outputs and gradients).
"""

from __future__ import annotations

import _thread
import copy
import gc
import os
import signal
import sys
import threading
import time
import weakref

import pytest
import torch
from torch import nn

from fastdp import FastDataParallel
from fastdp._workers import _STOP, WorkerPool

# NOTE [ Tests under each launch strategy ]; each also with the extension allowed and forced off
pytestmark = pytest.mark.usefixtures("launch", "backend")

CPU4 = ["cpu"] * 4


class Faulty(nn.Module):
    """A linear layer whose forward can raise in one replica or sleep in all of them.

    The replica is recognised by its chunk: column 0 of the input holds the replica's index.
    """

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)
        self.raise_in: int | None = None
        self.errors: dict = {}  # chunk -> a function of the chunk making what its replica raises
        self.sleep_s = 0.0
        self.finished: list[tuple[int, float]] = []  # (chunk, sleep) of each finished forward

    def forward(self, x):
        k = int(x[0, 0].item()) if x.numel() else -1
        slow = self.sleep_s
        if slow:
            time.sleep(slow)
        if k in self.errors:  # raised without a local: no frame-exception cycle
            raise self.errors[k](k)
        if k == self.raise_in:
            raise ValueError(f"boom in chunk {k}")
        out = self.bn(self.lin(x))
        self.finished.append((k, slow))
        return out


def batch(n: int, rows: int = 2) -> torch.Tensor:
    x = torch.randn(n * rows, 4)
    x[:, 0] = torch.arange(n).repeat_interleave(rows).float()
    return x


def wait_threads(target: int, timeout: float = 5.0) -> int:
    """The thread count once it has dropped to ``target`` (or after ``timeout``). Callers check
    ``<=``: wrappers of earlier tests may finish releasing their workers meanwhile."""
    deadline = time.monotonic() + timeout
    while threading.active_count() > target and time.monotonic() < deadline:
        time.sleep(0.01)
    return threading.active_count()


def check_step_matches_plain(fdp: FastDataParallel, n: int) -> None:
    """One training step equals the plain module's: outputs, input and parameter gradients."""
    module = fdp.module
    ref = Faulty()
    ref.load_state_dict(module.state_dict())
    x = batch(n).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = fdp(x)
    out.square().sum().backward()
    # The reference: BatchNorm statistics are per chunk in DataParallel, so run chunk by chunk.
    ref_out = torch.cat([ref(c) for c in xr.chunk(n)])
    ref_out.square().sum().backward()
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(x.grad, xr.grad)
    for (name, p), q in zip(module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("n,bad", [(2, 1), (4, 0), (4, 3)])
def test_exception_in_one_replica(n, bad):
    model = Faulty()
    fdp = FastDataParallel(model, ["cpu"] * n)
    fdp(batch(n))  # warm-up
    threads = threading.active_count()
    model.finished.clear()
    model.raise_in, model.sleep_s = bad, 0.05
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"Caught ValueError in replica {bad} on device cpu"):
        fdp(batch(n))
    assert time.monotonic() - start < 5.0
    assert sorted(k for k, _ in model.finished) == [k for k in range(n) if k != bad]
    assert wait_threads(threads) <= threads
    assert all(p.grad is None for p in model.parameters())
    model.raise_in, model.sleep_s = None, 0.0
    check_step_matches_plain(fdp, n)
    assert wait_threads(threads) <= threads


class Cancelled(BaseException):
    """A cancellation: no Exception, and not buildable from a message (two arguments)."""

    def __init__(self, scope: str, reason: str) -> None:
        super().__init__(scope, reason)


BASE_ERRORS = {
    "SystemExit": lambda k: SystemExit(3),
    "KeyboardInterrupt": lambda k: KeyboardInterrupt(f"chunk {k}"),
    "pytest.fail": lambda k: pytest.fail.Exception(f"failed in chunk {k}"),
    "Cancelled": lambda k: Cancelled("step", f"chunk {k}"),
}


def bounded(fn, seconds: float = 30.0):
    """``fn()`` on a thread: its result, or its error re-raised; fails (not hangs) past
    ``seconds``."""
    box: dict = {}

    def target():
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["err"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"the call did not return within {seconds} s (hung)"
    if "err" in box:
        raise box["err"]
    return box["out"]


@pytest.mark.usefixtures("storage")
@pytest.mark.parametrize("kind", BASE_ERRORS)
@pytest.mark.parametrize("n,bad", [(2, 1), (4, 0)])
def test_base_exception_in_one_replica(kind, n, bad):
    """A replica's SystemExit, KeyboardInterrupt, pytest failure or cancellation reaches the
    caller as itself (threads: a note names the replica), every other replica finishes, and the
    next step works: no worker lost (it used to die, and every later step hung)."""
    model = Faulty()
    fdp = FastDataParallel(model, ["cpu"] * n)
    fdp(batch(n))  # warm-up
    threads = threading.active_count()
    raised: list[BaseException] = []
    model.errors = {bad: lambda k: raised.append(BASE_ERRORS[kind](k)) or raised[-1]}
    model.finished.clear()
    with pytest.raises(BaseException) as info:
        fdp(batch(n))
    assert [info.value] == raised  # the replica's own object: type, arguments, exit code
    if fdp.last_launch == "threads":  # inline, it propagated from the caller's own thread
        assert sorted(k for k, _ in model.finished) == [k for k in range(n) if k != bad]
        notes = getattr(info.value, "__notes__", [f"in replica {bad} on device cpu"])  # 3.10
        assert any(f"in replica {bad} on device cpu" in note for note in notes)
    model.errors = {}
    assert bounded(lambda: fdp(batch(n))).shape == (2 * n, 3)
    check_step_matches_plain(fdp, n)
    assert wait_threads(threads) <= threads


def test_base_exception_wins_over_an_exception():
    """As inline (where it stops the step on the caller's thread), a replica's SystemExit is
    raised in preference to another replica's ValueError, whichever replica comes first."""
    model = Faulty()
    fdp = FastDataParallel(model, CPU4)
    fdp(batch(4))
    model.errors = {0: lambda k: ValueError("replica 0's"), 1: lambda k: SystemExit(5)}
    with pytest.raises(SystemExit) as info:
        fdp(batch(4))
    assert info.value.code == 5
    model.errors = {}
    check_step_matches_plain(fdp, 4)


def test_failed_step_leaves_no_reference_cycle():
    """Regression: ExceptionWrapper.reraise's frame held the exception (a cycle through its
    traceback), so a failed step kept the wrapper, its replicas and its workers alive until the
    garbage collector ran."""
    baseline = threading.active_count()
    model = Faulty()
    fdp = FastDataParallel(model, CPU4)
    fdp(batch(4))
    model.raise_in = 2
    refs = [weakref.ref(fdp), weakref.ref(model)]
    gc.collect()
    gc.disable()  # whatever survives now is held by a cycle (or a leak), not by pending garbage
    try:
        with pytest.raises(ValueError, match="Caught ValueError in replica 2") as excinfo:
            fdp(batch(4))
        del excinfo  # the traceback holds the step's frames
        del fdp, model  # reference counting alone must release everything
        assert all(r() is None for r in refs)
    finally:
        gc.enable()
    assert wait_threads(baseline) <= baseline


@pytest.mark.parametrize("how", ["interrupt_main", "sigint"])
def test_keyboard_interrupt_mid_step(how, sigint):
    model = Faulty()
    fdp = FastDataParallel(model, CPU4)
    fdp(batch(4))  # warm-up
    threads = threading.active_count()
    before = copy.deepcopy(model.state_dict())
    model.finished.clear()
    model.sleep_s = 1.5

    def fire():
        if how == "interrupt_main":
            _thread.interrupt_main()
        else:
            os.kill(os.getpid(), signal.SIGINT)

    x1 = batch(4)
    timer = threading.Timer(0.2, fire)
    start = time.monotonic()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        fdp(x1)
    elapsed = time.monotonic() - start
    sigint["armed"] = False
    timer.join()
    threaded = fdp.last_launch == "threads"
    # Inline, replicas run on the main thread: a real SIGINT interrupts the sleep at once, but
    # interrupt_main only sets a flag, acted on when the running replica's sleep returns (as for
    # the bare module); still one replica's call, not the step's four.
    limit = 1.0 if threaded or how == "sigint" else 1.5 + 1.0
    assert elapsed < limit, f"control came back after {elapsed:.2f} s"

    # Threads: the next step waits for the interrupted replicas (they cannot be stopped). Inline:
    # the interrupt stopped replica 0 mid-forward and the others never started.
    model.sleep_s = 0.0
    x2 = batch(4).requires_grad_()
    out = fdp(x2)
    interrupted = [1.5] * 4 if threaded else []
    assert [slow for _, slow in model.finished] == interrupted + [0.0] * 4  # never overlapping
    out.square().sum().backward()
    ref = Faulty()
    ref.load_state_dict(before)
    if threaded:
        ref(x1.chunk(4)[0])  # the interrupted step's replica 0 still updated the running stats
    x2r = x2.detach().clone().requires_grad_()
    chunks = x2r.chunk(4)
    outs = [ref(chunks[0])]  # only replica 0's running-stat update reaches the module
    stats = {k: v.clone() for k, v in ref.bn.named_buffers()}
    outs += [ref(c) for c in chunks[1:]]
    ref_out = torch.cat(outs)
    ref_out.square().sum().backward()
    with torch.no_grad():
        for k, v in stats.items():
            getattr(ref.bn, k).copy_(v)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(x2.grad, x2r.grad)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(model.bn, name), getattr(ref.bn, name), msg=name)
    assert wait_threads(threads) <= threads  # no thread left behind, none blocked


def test_deleting_wrapper_releases_threads_and_replicas():
    baseline = threading.active_count()
    refs: list[weakref.ref] = []

    class Spy(FastDataParallel):
        def replicate(self, module, device_ids):
            replicas = super().replicate(module, device_ids)
            refs.extend(weakref.ref(r) for r in replicas)
            return replicas

    model = Faulty()
    fdp = Spy(model, CPU4)
    for _ in range(3):
        fdp(batch(4)).sum().backward()
    refs += [weakref.ref(fdp), weakref.ref(model)]
    params = [weakref.ref(p) for p in model.parameters()]
    del fdp, model
    gc.collect()
    assert all(r() is None for r in refs)
    assert all(r() is None for r in params)
    assert wait_threads(baseline) <= baseline


@pytest.mark.parametrize("finish", ["backward", "no_backward", "no_grad"])
def test_parameters_freed_after_wrapper_deleted(finish):
    """Regression: a refresh node that owned the replica tensors whose grad_fn it was formed a
    C++ reference cycle: every wrapper leaked its model, replicas and gradients (the bucket
    nodes' BucketLink holds no tensor for that reason)."""
    refs = []
    for _ in range(3):
        model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 8))
        fdp = FastDataParallel(model, CPU4)
        for _ in range(2):
            with torch.set_grad_enabled(finish != "no_grad"):
                out = fdp(torch.randn(16, 64))
            if finish == "backward":
                out.sum().backward()
        refs += [weakref.ref(p) for p in model.parameters()]
        refs += [weakref.ref(b) for b in model.buffers()]
        del fdp, model, out
    gc.collect()
    assert all(r() is None for r in refs)


def test_worker_pool_survives_and_replaces_workers():
    """A task's BaseException reaches the caller and its worker lives on; a worker that ended
    anyway (here told to stop) is replaced by the next run, which completes."""
    pool = WorkerPool()
    try:
        assert pool.run([lambda: 1, lambda: 2]) == [1, 2]
        with pytest.raises(SystemExit):
            pool.run([lambda: 1, lambda: sys.exit(7)])
        assert len(pool) == 2 and all(t.is_alive() for t in pool._threads)
        pool._queues[1].put(_STOP)
        pool._threads[1].join(5)
        assert bounded(lambda: pool.run([lambda: 3, lambda: 4])) == [3, 4]
        assert len(pool) == 2 and all(t.is_alive() for t in pool._threads)
    finally:
        pool.shutdown()
