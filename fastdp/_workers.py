"""Persistent worker threads for ``parallel_apply``: one per replica slot, reused every step.

A step submits one task per replica and waits on per-task events; the wait is interruptible, so
Ctrl-C returns control at once. Tasks of an interrupted step still finish on their workers (Python
cannot kill a thread); the next step first waits for them (``drain``), so steps never overlap.
A task that raises (even a BaseException) never ends its worker: the error is re-raised in the
caller; a worker found dead is replaced. ``shutdown`` (also run by a finalizer when the owning
wrapper is collected) stops the threads.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

_STOP = object()
_POLL_S = 0.05  # a SIGINT delivered to any thread is acted on within this


class _Task:
    __slots__ = ("fn", "done", "result", "raised")

    def __init__(self, fn: Callable[[], Any] | None) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.raised: BaseException | None = None


def _loop(q: queue.SimpleQueue) -> None:
    while True:
        task = q.get()
        if task is _STOP:
            return
        try:
            if task.fn is not None:  # None: a drain's marker
                task.result = task.fn()
        except BaseException as e:  # noqa: BLE001 - the worker outlives any task's error
            task.raised = e
        finally:
            task.fn = None
            task.done.set()


def _wait(task: _Task, worker: threading.Thread) -> bool:
    """Wait (interruptibly) for ``task`` on ``worker``; False if the worker died first."""
    while not task.done.wait(_POLL_S):
        if not worker.is_alive():
            return task.done.is_set()
    return True


# NOTE [ Interrupt-safe submission ]
# A KeyboardInterrupt can arrive between any two lines of ``run``. No list records what was
# submitted (an interrupt between recording and queueing would leave recorded work no worker
# runs, or queued work nobody waits for): a run's token is in ``_runs`` from before its first put
# until all its tasks finished. While one is, ``drain`` puts a marker on every worker's queue and
# waits for the markers: a queue is FIFO, so whatever an interrupted run had queued has finished
# then, however far its submission got. No lock is held across lines (an interrupt could leave it
# held); a worker is recorded before it starts: one that never started counts as dead.
class WorkerPool:
    """Daemon threads named ``fastdp-worker-i``; ``run`` executes one callable per worker."""

    def __init__(self) -> None:
        self._queues: list[queue.SimpleQueue] = []
        self._threads: list[threading.Thread] = []
        self._runs: set[object] = set()  # tokens of runs whose tasks may not all have finished

    def _grow(self, n: int) -> None:
        for i, t in enumerate(self._threads):  # a dead worker is replaced, with a fresh queue
            if not t.is_alive():
                self._queues[i], self._threads[i] = self._worker(i)
                self._threads[i].start()
        while len(self._queues) < n:
            q, t = self._worker(len(self._queues))
            self._queues.append(q)
            self._threads.append(t)
            t.start()

    @staticmethod
    def _worker(i: int) -> tuple[queue.SimpleQueue, threading.Thread]:
        q: queue.SimpleQueue = queue.SimpleQueue()
        return q, threading.Thread(target=_loop, args=(q,), daemon=True, name=f"fastdp-worker-{i}")

    def drain(self) -> None:
        """Wait for tasks of an earlier (interrupted) step (NOTE [ Interrupt-safe submission ])."""
        stale = list(self._runs)
        if not stale:
            return
        markers = [(_Task(None), t) for t in self._threads]
        for q, (marker, _) in zip(self._queues, markers):
            q.put(marker)
        for marker, t in markers:
            _wait(marker, t)
        for token in stale:
            self._runs.discard(token)

    def run(self, fns: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run ``fns[i]`` on worker i; their results. Calls from several threads may overlap."""
        self.drain()
        self._grow(len(fns))
        tasks = [_Task(fn) for fn in fns]
        workers, token = self._threads[: len(tasks)], object()
        self._runs.add(token)
        for q, task in zip(self._queues, tasks):
            q.put(task)
        died = [i for i, (task, t) in enumerate(zip(tasks, workers)) if not _wait(task, t)]
        self._runs.discard(token)
        if died:
            raise RuntimeError(f"fastdp: worker thread(s) {died} died while running a task")
        for task in tasks:
            if task.raised is not None:
                raise task.raised
        return [task.result for task in tasks]

    @property
    def interrupted(self) -> bool:
        return bool(self._runs)

    def shutdown(self) -> None:
        for q in self._queues:
            q.put(_STOP)
        for t in self._threads:
            if t is not threading.current_thread() and t.is_alive():
                t.join(timeout=5)
        self._queues, self._threads = [], []

    def __len__(self) -> int:
        return len(self._threads)
