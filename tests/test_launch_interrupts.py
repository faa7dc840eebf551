"""Ctrl-C at every line of the worker pool's submission and drain (``fastdp/_workers.py``).

A trace function raises KeyboardInterrupt at the k-th line the caller's thread runs in the pool,
for every k; the next step must then complete (on a thread, joined with a timeout: a hang fails)
and equal the plain module on the chunks, and no task of the interrupted step may run after it
started (steps never overlap).
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from torch import nn

from fastdp import FastDataParallel
from fastdp._workers import WorkerPool, _Task, _wait

# the pool's code the caller's thread runs: submission, waiting, the drain, growing
POOL_CODE = frozenset(
    f.__code__
    for f in (
        WorkerPool.run,
        WorkerPool.drain,
        WorkerPool._grow,
        WorkerPool._worker,
        WorkerPool.interrupted.fget,
        _Task.__init__,
        _wait,
    )
)


class Logged(nn.Module):
    """A linear layer whose forward logs (step, chunk) when it starts and when it ends."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.log, self.step = log, 0

    def forward(self, x):
        k = int(x[0, 0].item())
        self.log.append(("start", self.step, k))
        out = torch.tanh(self.lin(x))
        self.log.append(("end", self.step, k))
        return out


def batch(n: int) -> torch.Tensor:
    x = torch.randn(2 * n, 4)
    x[:, 0] = torch.arange(n).repeat_interleave(2).float()
    return x


def interrupting(k: int, code: frozenset = POOL_CODE) -> tuple:
    """(trace function, its line count): KeyboardInterrupt at the k-th line of ``code`` run on
    this thread (k=0: never)."""
    seen = [0]

    def local(frame, event, arg):
        if event == "line":
            seen[0] += 1
            if seen[0] == k:
                raise KeyboardInterrupt(f"line {k}")
        return local

    def trace(frame, event, arg):
        return local if frame.f_code in code else None

    return trace, seen


def traced_step(
    fdp: FastDataParallel, x: torch.Tensor, k: int, code: frozenset = POOL_CODE
) -> tuple[bool, int]:
    """One step interrupted at line k of ``code``: (whether it was interrupted, lines seen)."""
    trace, seen = interrupting(k, code)
    sys.settrace(trace)
    try:
        fdp(x)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    finally:
        sys.settrace(None)
    return interrupted, seen[0]


def bounded_step(fdp: FastDataParallel, x: torch.Tensor, seconds: float = 30.0) -> torch.Tensor:
    box: dict = {}

    def target():
        try:
            box["out"] = fdp(x)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["err"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the step after an interrupt hung"
    if "err" in box:
        raise box["err"]
    return box["out"]


def check_next_step(fdp: FastDataParallel, log: list, n: int, step: int) -> None:
    """The next step completes, equals the module on the chunks, and overlaps no earlier task."""
    model = fdp.module
    model.step = step
    x = batch(n)
    out = bounded_step(fdp, x)
    with torch.no_grad():
        torch.testing.assert_close(out.detach(), torch.cat([model(c) for c in x.chunk(n)]))
    del log[-2 * n :]  # the reference's own forwards
    first = log.index(next(e for e in log if e[1] == step))
    assert all(e[1] == step for e in log[first:]), "an interrupted step's task ran after it"
    log.clear()


@pytest.mark.usefixtures("storage")
@pytest.mark.parametrize("busy", [False, True], ids=["idle", "after_interrupted_step"])
def test_interrupt_at_every_line_of_the_pool(busy):
    """busy: the step interrupted at line k starts by draining an interrupted step (Ctrl-C while
    it waited for its replicas), so the drain's lines are covered too."""
    n, log = 3, []
    fdp = FastDataParallel(Logged(log), ["cpu"] * n, launch="threads")
    fdp(batch(n))  # warm-up: workers exist
    _, total = traced_step(fdp, batch(n), 0)
    log.clear()
    k, step = 1, 0
    while True:
        step += 1
        fdp.module.step = step
        if busy:  # Ctrl-C in the wait for the replicas leaves the pool busy
            assert traced_step(fdp, batch(n), 1, frozenset([_wait.__code__]))[0]
            step += 1
            fdp.module.step = step
        interrupted, seen = traced_step(fdp, batch(n), k)
        if not interrupted:
            assert seen < k
            break
        step += 1
        check_next_step(fdp, log, n, step)
        k += 1
    assert k > total >= 10  # every line of a whole step was hit once
