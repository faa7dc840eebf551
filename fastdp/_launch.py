"""The launch: how a step's replicas run. One class per strategy, ``make(name)`` picks one, and
``launch``, the one function that decides a launch from its arguments (the strategy asked for, the
rules that override it: NOTE [ Replicas that must run at once ]); the replica runners the
strategies call are ``fastdp/_runners.py``, the wrapper's worker threads ``fastdp/_workers.py``.

Adding a strategy is one ``Strategy`` subclass and one entry in ``_STRATEGIES``.

The strategies (docs/how-it-works.md, *Launch strategies*). ``threads``: one persistent worker per
replica, as DataParallel's threads; replicas overlap where they release the GIL, but a
dispatch-bound forward (small layers; any forward on a GPU, whose kernels are asynchronous) runs
slower than in turn. ``inline``: replicas in turn on the caller's thread, under its streams and
grad/autocast state; distinct GPUs still overlap (asynchronous launches). ``auto`` (default): per
(devices, input structure, grad mode) both are timed on alternate steps (``WARMUP``, then ``TRIALS``
each), the lower median forward is kept and re-tried every ``RECHECK`` steps. Errors, Ctrl-C and
cleanup are the same under every strategy. Replicas that meet inside forward always run on threads
(NOTE [ Replicas that must run at once ]). ``launch=`` or ``FASTDP_LAUNCH`` forces one.
"""

from __future__ import annotations

import enum
import os
import statistics
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn import Module

from fastdp import _tree
from fastdp._compiled import backward_with_forward
from fastdp._runners import (
    BoundMethod,
    capture_state,
    raise_first_error,
    run_in_turn,
    run_on_threads,
    run_replica,
    wait_for_stragglers,
)
from fastdp._workers import WorkerPool

__all__ = [
    "Strategy",
    "Threads",
    "Inline",
    "Auto",
    "THREADS",
    "INLINE",
    "LAUNCHES",
    "make",
    "resolve_launch",
    "input_key",
    "Order",
    "launch",
]


class Strategy:
    """Runs one step's replicas: ``run`` returns their outputs, a replica's error wrapped as
    ``run_replica`` wraps it (the caller raises the first). ``pool``: the wrapper's persistent
    workers, or None for a one-off call (``fastdp.parallel_apply``)."""

    name = ""

    def run(
        self,
        modules: Sequence[Module],
        inputs: Sequence[Any],
        kwargs: Sequence[dict[str, Any]],
        devices: Sequence[torch.device],
        pool: WorkerPool | None = None,
    ) -> list[Any]:
        raise NotImplementedError

    def ran(self) -> str:
        """The strategy the last ``run`` used (``auto`` says which it picked)."""
        return self.name

    def report(self) -> list[dict[str, Any]]:
        """What the strategy measured (``auto`` only)."""
        return []


class Threads(Strategy):
    """One thread per replica: the wrapper's persistent workers, else fresh threads."""

    name = "threads"

    def run(
        self,
        modules: Sequence[Module],
        inputs: Sequence[Any],
        kwargs: Sequence[dict[str, Any]],
        devices: Sequence[torch.device],
        pool: WorkerPool | None = None,
    ) -> list[Any]:
        if pool is None:
            return run_on_threads(modules, inputs, kwargs, devices)
        state = capture_state(devices)  # in the caller: NOTE [ The caller's streams ]
        return pool.run(
            [
                _Call(i, modules[i], inputs[i], kwargs[i], devices[i], state)
                for i in range(len(modules))
            ]
        )


class Inline(Strategy):
    """Each replica in turn on the caller's thread."""

    name = "inline"

    def run(
        self,
        modules: Sequence[Module],
        inputs: Sequence[Any],
        kwargs: Sequence[dict[str, Any]],
        devices: Sequence[torch.device],
        pool: WorkerPool | None = None,
    ) -> list[Any]:
        return run_in_turn(modules, inputs, kwargs, devices)


class _Call:
    """One replica's task for the worker pool (a callable holding no reference to the wrapper)."""

    __slots__ = ("args",)

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __call__(self) -> Any:
        out = run_replica(*self.args)
        self.args = None
        return out


THREADS, INLINE = Threads(), Inline()


def input_key(inputs: Any, kwargs: Any) -> tuple:
    """What makes a step's cost differ: the number of chunks and the first chunk's structure,
    shapes and dtypes (positional and keyword)."""
    if not len(inputs):
        return (0,)
    first = inputs[0]
    if not (kwargs and kwargs[0]) and all(type(t) is torch.Tensor for t in first):
        return (len(inputs), len(first), *[(tuple(t.shape), t.dtype) for t in first])  # common
    leaves: list[torch.Tensor] = []
    spec = _tree.flatten((first, kwargs[0] if kwargs else None), leaves)
    return (len(inputs), _tree.structure_key(spec), *[(tuple(t.shape), t.dtype) for t in leaves])


_TRIED = ("threads", "inline")  # what auto measures, by name; ties go to the first


class _Entry:
    __slots__ = ("schedule", "times", "choice", "steps", "trials")

    def __init__(self, warmup: int, trials: int) -> None:
        self.schedule = [None] * (warmup * 2) + list(_TRIED) * trials  # None: untimed warm-up
        self.times: dict[str, list[float]] = {s: [] for s in _TRIED}
        self.choice: str | None = None
        self.steps = 0
        self.trials = 0


class Auto(Strategy):
    """Measures the strategies of ``_TRIED`` per key and keeps the faster (the module
    docstring); a one-off call (no pool) runs on threads."""

    name = "auto"

    WARMUP = 1  # untimed steps per strategy before the first trial
    TRIALS = 3  # timed steps per strategy in a trial
    RECHECK = 1000  # steps of a key between trials
    MAX_KEYS = 64  # least recently used keys beyond this are forgotten

    def __init__(self) -> None:
        self.entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self.last: str | None = None

    def run(
        self,
        modules: Sequence[Module],
        inputs: Sequence[Any],
        kwargs: Sequence[dict[str, Any]],
        devices: Sequence[torch.device],
        pool: WorkerPool | None = None,
    ) -> list[Any]:
        if pool is None:
            self.last = "threads"
            return THREADS.run(modules, inputs, kwargs, devices)
        called = modules[0].name if modules and isinstance(modules[0], BoundMethod) else None
        key = (tuple(devices), input_key(inputs, kwargs), torch.is_grad_enabled(), called)
        name, timed = self.pick(key)
        self.last = name
        t0 = time.perf_counter()
        out = _STRATEGIES[name]().run(modules, inputs, kwargs, devices, pool)
        if timed:
            self.record(key, name, time.perf_counter() - t0)
        return out

    def ran(self) -> str:
        return self.last or "threads"

    def pick(self, key: tuple) -> tuple[str, bool]:
        """The strategy for this step of ``key`` and whether to time it (``record``)."""
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = _Entry(self.WARMUP, self.TRIALS)
            if len(self.entries) > self.MAX_KEYS:
                self.entries.popitem(last=False)
        elif len(self.entries) > 1:
            self.entries.move_to_end(key)
        e.steps += 1
        if e.schedule:
            n_warm = sum(1 for s in e.schedule if s is None)
            head = e.schedule.pop(0)
            if head is None:  # warm-up: alternate the strategies, untimed
                return _TRIED[n_warm % 2], False
            return head, True
        if e.steps >= self.RECHECK:
            e.steps = 0
            e.times = {s: [] for s in _TRIED}
            e.schedule = list(_TRIED) * self.TRIALS
        return e.choice or "threads", False

    def record(self, key: tuple, strategy: str, seconds: float) -> None:
        e = self.entries.get(key)
        if e is None:
            return
        e.times[strategy].append(seconds)
        if not e.schedule:
            med = {s: statistics.median(t) for s, t in e.times.items() if t}
            if len(med) == len(_TRIED):
                e.choice = min(_TRIED, key=lambda s: med[s])  # ties: threads (DataParallel's)
                e.trials += 1

    def report(self) -> list[dict[str, Any]]:
        """One record per key: its choice (None while still measuring) and the medians (ms)."""
        out = []
        for key, e in self.entries.items():
            rec: dict[str, Any] = {
                "devices": [str(d) for d in key[0]],
                "inputs": repr(key[1]),
                "grad": key[2],
                "method": key[3] if len(key) > 3 else None,  # None: forward
                "choice": e.choice,
                "trials": e.trials,
            }
            for s, t in e.times.items():
                rec[f"{s}_ms"] = statistics.median(t) * 1e3 if t else None
            out.append(rec)
        return out


_STRATEGIES = {"threads": lambda: THREADS, "inline": lambda: INLINE, "auto": Auto}
FIXED: dict[str, Strategy] = {"threads": THREADS, "inline": INLINE}  # stateless: shared
LAUNCHES = tuple(_STRATEGIES)


def resolve_launch(launch: str | None) -> str:
    """``launch``, else ``FASTDP_LAUNCH``, else ``"auto"``; raises ValueError on anything else."""
    where = ""
    if launch is None:
        launch, where = os.environ.get("FASTDP_LAUNCH") or "auto", " (from FASTDP_LAUNCH)"
    if launch not in _STRATEGIES:
        raise ValueError(f"launch must be one of {LAUNCHES}, got {launch!r}{where}")
    return launch


def make(launch: str | None) -> Strategy:
    """The strategy named ``launch`` (see ``resolve_launch``); a fresh ``Auto`` each call."""
    return _STRATEGIES[resolve_launch(launch)]()


class Order(enum.Enum):
    """What a replica set requires of every launch, whatever the strategy (chosen once per set)."""

    ANY = "any"  # as the strategy says
    # they meet during forward once ``prepare_replicas`` armed them: then one thread each
    # (``launch``'s ``together``; NOTE [ Replicas that must run at once ])
    TOGETHER = "together"
    # compiled code on several replicas: in turn, inline (NOTE [ Compiled replicas run in order ])
    IN_TURN = "in_turn"
    # in turn, each backward compiled with its forward (NOTE [ Compiled replicas run in order ])
    IN_TURN_COMPILING_BACKWARD = "in_turn_compiling_backward"


# NOTE [ Replicas that must run at once ]
# The one rule that overrides every launch strategy: replicas that meet each other during their
# forward (fastdp's SyncBatchNorm rendezvous; modules with ``__data_parallel_replicate__``
# callbacks, whose copies talk through queues, as Synchronized-BatchNorm's SyncMaster) would wait
# forever for a replica that has not started if run in turn, so ``launch(..., together=True)``
# runs them on threads. The callers learn it from the replicas (``replicas_meet`` in
# ``fastdp/sync_batchnorm.py``: armed by ``prepare_replicas``). Compiled replica sets run in turn
# instead (``Order.IN_TURN``); a set whose replicas meet never does.
def launch(
    modules: Sequence[Module],
    inputs: Sequence[Any],
    kwargs: Sequence[dict[str, Any]] | None,
    devices: Sequence[torch.device],
    strategy: Strategy | None = None,
    *,
    name: str | None = None,
    pool: WorkerPool | None = None,
    together: bool = False,
    order: Order = Order.ANY,
    record: dict[str, str | None] | None = None,
    method: str | None = None,
) -> list[Any]:
    """Run ``modules[i](*inputs[i], **kwargs[i])`` on ``devices[i]``: the whole launch decision.

    ``strategy``: the caller's (a wrapper's, where ``auto`` keeps its measurements); None makes
    one from ``name`` (``make``). ``name``: a strategy named for this call that overrides
    ``strategy``. ``pool``: the wrapper's persistent workers; None for a one-off call (``auto``
    then means threads; threads of an interrupted one-off call are waited for first).
    ``together``: the replicas are armed to meet during forward (``replicas_meet``): threads,
    whatever was asked; ``order``: what their replica set requires (``ReplicaSet.launch_order``).
    ``record["launch"]`` gets the strategy that ran, also when interrupted. ``method``: each
    replica's method of that name runs in place of the replica's forward (``BoundMethod``; the
    decisions above are the same). The first replica error is raised (``raise_first_error``).
    """
    n = len(modules)
    _check_lengths("inputs", n, len(inputs))
    if kwargs is None:
        kwargs = ({},) * n
    else:
        _check_lengths("kwargs_tup", n, len(kwargs))
    _check_lengths("devices", n, len(devices))
    if name is not None and (strategy is None or name != strategy.name):
        strategy = FIXED.get(name) or make(name)
    elif strategy is None:
        strategy = make(None)
    compiling_backward = False
    if together:  # NOTE [ Replicas that must run at once ]
        strategy = THREADS
    elif order is Order.IN_TURN or order is Order.IN_TURN_COMPILING_BACKWARD:
        strategy = INLINE
        compiling_backward = order is Order.IN_TURN_COMPILING_BACKWARD
    if pool is None:
        wait_for_stragglers()
    if method is not None:
        modules = [BoundMethod(m, method) for m in modules]
    try:
        if compiling_backward:
            with backward_with_forward():
                results = strategy.run(modules, inputs, kwargs, devices, pool)
        else:
            results = strategy.run(modules, inputs, kwargs, devices, pool)
    finally:  # also when interrupted: what ran is what the next step must wait for
        if record is not None:
            record["launch"] = strategy.ran()
    raise_first_error(results)
    return results


def _check_lengths(what: str, n_modules: int, n: int) -> None:
    if n != n_modules:
        raise AssertionError(
            f"The number of modules {n_modules} is not equal to the number of {what} {n}"
        )
