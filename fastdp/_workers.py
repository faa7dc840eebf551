"""Persistent worker threads for ``parallel_apply``: one per replica slot, reused every step.

A step submits one task per replica and waits on per-task events; the wait is interruptible, so
Ctrl-C returns control at once. Tasks of an interrupted step still finish on their workers (Python
cannot kill a thread); the next step first waits for them (``drain``), so steps never overlap.
``shutdown`` (also run by a finalizer when the owning wrapper is collected) stops the threads.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

_STOP = object()


class _Task:
    __slots__ = ("fn", "done", "result")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None


def _loop(q: queue.SimpleQueue) -> None:
    while True:
        task = q.get()
        if task is _STOP:
            return
        try:
            task.result = task.fn()  # fn never raises: run_replica wraps exceptions
        finally:
            task.fn = None
            task.done.set()


class WorkerPool:
    """Daemon threads named ``fastdp-worker-i``; ``run`` executes one callable per worker."""

    def __init__(self) -> None:
        self._queues: list[queue.SimpleQueue] = []
        self._threads: list[threading.Thread] = []
        self._inflight: list[_Task] = []
        self._lock = threading.Lock()

    def _grow(self, n: int) -> None:
        while len(self._queues) < n:
            q: queue.SimpleQueue = queue.SimpleQueue()
            t = threading.Thread(
                target=_loop, args=(q,), daemon=True, name=f"fastdp-worker-{len(self._queues)}"
            )
            t.start()
            self._queues.append(q)
            self._threads.append(t)

    def drain(self) -> None:
        """Wait for tasks of an earlier (interrupted) step."""
        for task in self._inflight:
            task.done.wait()
        self._inflight = []

    def run(self, fns: Sequence[Callable[[], Any]]) -> list[Any]:
        with self._lock:
            self.drain()
            self._grow(len(fns))
            tasks = [_Task(fn) for fn in fns]
            self._inflight = tasks
            for q, task in zip(self._queues, tasks):
                q.put(task)
        for task in tasks:
            # Short timed waits: a SIGINT delivered to any thread is acted on within 50 ms;
            # KeyboardInterrupt propagates and the tasks stay in flight (see drain).
            while not task.done.wait(0.05):
                pass
        self._inflight = []
        return [task.result for task in tasks]

    @property
    def interrupted(self) -> bool:
        return bool(self._inflight)

    def shutdown(self) -> None:
        for q in self._queues:
            q.put(_STOP)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)
        self._queues, self._threads = [], []

    def __len__(self) -> int:
        return len(self._threads)
