"""SyncBatchNorm across the replicas of one process, and the replication-callback protocol.

``nn.SyncBatchNorm`` needs a process group; inside FastDataParallel, ``prepare_replicas`` makes
every replica's SyncBatchNorm meet the others in this process instead, so batch statistics (and
their gradients) cover the whole batch: outputs, gradients and running stats equal ``BatchNorm``
on the whole batch on one device. Modules defining ``__data_parallel_replicate__(ctx, copy_id)``
(Synchronized-BatchNorm-PyTorch, PyTorch-Encoding) get their callback after every replication,
with one shared context per original module, as their ``DataParallelWithCallback`` does.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd import Function
from torch.autograd.function import once_differentiable
from torch.nn import Module, SyncBatchNorm

from fastdp import _devices
from fastdp._runners import ReplicaAborted, current_launch, launch_number

__all__ = ["CallbackContext", "prepare_replicas", "replicas_meet"]

_DEFAULT_TIMEOUT = 300.0
_scan_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_warned_subclass = False


class CallbackContext:
    """The context shared by the replicas of one module in ``__data_parallel_replicate__``."""


# NOTE [ Synchronising replicas without a barrier in backward ]
# Forward: each replica posts its per-channel (mean, biased var, count) to a rendezvous and waits
# for the others' (a Condition, not threading.Barrier: a completed meeting stays complete even if
# the step is aborted right after), then combines all of them in replica order (Chan's parallel
# variance) on its own device, through differentiable copies. Backward needs no meeting: the global
# statistics are nodes of one autograd graph spanning the replicas, so the engine sums ``sum_dy`` /
# ``sum_dy_xmu`` from all replicas before differentiating the local ones; a barrier there would
# deadlock where the engine runs several replicas' backward on one thread (CPU, a shared GPU). A
# replica that raises, finishes without reaching a layer the others wait at, or times out
# (``FASTDP_SYNC_TIMEOUT`` seconds, else ``_DEFAULT_TIMEOUT``) releases the others with an error;
# none hangs. Leaving the block closes the meeting: NOTE [ A block left while replicas run ].
class _Rendezvous:
    """One step's meeting point of ``n`` replicas; keys are (layer, call)."""

    def __init__(self, n: int, timeout: float, names: Sequence[str]) -> None:
        self.n, self.timeout, self.names = n, timeout, names
        self.cond = threading.Condition()
        self.slots: dict[tuple[int, int], list] = {}
        self.done = [False] * n
        self.failed: tuple[int, BaseException] | None = None
        self.armed = launch_number()  # launches numbered below it started before the block
        self.closed: int | None = None  # launch_number() when the block was left
        self.held: list[tuple[Any, list[torch.Tensor]]] = []  # see _collect

    def finish(self, rank: int, exc: BaseException | None) -> None:
        with self.cond:
            self.done[rank] = True
            if (
                exc is not None
                and self.failed is None
                and self.closed is None
                and not isinstance(exc, ReplicaAborted)
            ):
                self.failed = (rank, exc)
            self.cond.notify_all()

    def close(self) -> bool:
        """End the meeting (the block is left): waiting replicas stop at once. Returns whether
        every replica has finished its forward."""
        with self.cond:
            self.closed = launch_number()
            self.slots, self.failed = {}, None  # nothing kept alive by forwards left in place
            self.cond.notify_all()
            held, self.held = self.held, []
        for event, _ in held:
            event.synchronize()
            return all(self.done)

    def exchange(self, key: tuple[int, int], rank: int, payload: Any) -> list[Any]:
        n, where = self.n, f"SyncBatchNorm '{self.names[key[0]]}' (call {key[1]})"
        with self.cond:
            entry = self.slots.setdefault(key, [[None] * n, 0, 0])
            entry[0][rank] = payload
            entry[1] += 1
            if entry[1] == n:
                self.cond.notify_all()
            deadline = time.monotonic() + self.timeout
            while entry[1] < n:
                if self.closed is not None:
                    raise ReplicaAborted(
                        f"fastdp: replica {rank} stopped waiting at {where}: the step ended "
                        "(interrupted) before every replica arrived"
                    )
                if self.failed is not None:
                    r, exc = self.failed
                    raise ReplicaAborted(
                        f"fastdp: replica {rank} stopped waiting at {where} because replica {r} "
                        f"failed: {type(exc).__name__}: {exc}"
                    ) from exc
                missing = [r for r in range(n) if entry[0][r] is None]
                gone = [r for r in missing if self.done[r]]
                if gone:
                    raise RuntimeError(
                        f"fastdp: replica {rank} waits at {where} but replica(s) {gone} finished "
                        "their forward without reaching it; every replica must call each "
                        "SyncBatchNorm the same number of times (data-dependent control flow?)"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"fastdp: replica {rank} waited {self.timeout:g} s at {where} for "
                        f"replica(s) {missing}; set FASTDP_SYNC_TIMEOUT (seconds) if they are "
                        "just slow"
                    )
                self.cond.wait(left)
            entry[2] += 1
            if entry[2] == n:
                del self.slots[key]
            return entry[0]

    def batch_norm(
        self,
        key: tuple[int, int],
        rank: int,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        momentum: float,
        eps: float,
    ) -> torch.Tensor:
        dims = [0, *range(2, x.dim())]
        xs = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        count = x.numel() // x.size(1)
        if count > 0:
            var, mean = torch.var_mean(xs, dims, correction=0)
        else:
            var = mean = xs.new_zeros(x.size(1))
        event = None
        if x.device.type != "cpu":
            event = _devices.new_event(x.device)
            event.record(_devices.current_stream(x.device))
        means, vars_, counts = _collect(
            self.exchange(key, rank, (mean, var, count, event)), x.device, self.held
        )
        total = sum(counts)
        if total <= 1:
            raise ValueError(
                "Expected more than 1 value per channel when training, got input "
                f"size {[total, *x.shape[1:]]} over all replicas"
            )
        shares = [c / total for c in counts]  # Python floats: no host-to-device copy
        g_mean = sum(m * s for m, s in zip(means, shares))
        g_var = sum((v + (m - g_mean) ** 2) * s for m, v, s in zip(means, vars_, shares))
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(g_mean.to(running_mean.dtype), alpha=momentum)
                unbiased = g_var * (total / (total - 1))
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        return _BatchNormElemt.apply(x, g_mean, torch.rsqrt(g_var + eps), weight, bias)


def _collect(
    payloads: list[Any], dev: torch.device, held: list[tuple[Any, list[torch.Tensor]]]
) -> tuple[list, list, list[int]]:
    """Every replica's statistics on ``dev``. On an accelerator the reads are ordered after each
    producer's stream (its event) and the producers' memory stays alive until the reading stream
    ran them: ``record_stream``, or where the accelerator has none, a reference in ``held`` with
    an event recorded after the reads (the meeting's ``close`` waits for it)."""
    means, vars_, counts = [], [], []
    for mean, var, count, event in payloads:
        reader = None
        if event is not None:
            stream = _devices.current_stream(dev)
            stream.wait_event(event)
            # the stream that reads: torch copies between devices on the source's current stream
            reader = stream if mean.device == dev else _devices.current_stream(mean.device)
            if _devices.record_stream(mean, reader):
                var.record_stream(reader)
                reader = None
        means.append(mean.to(dev))
        vars_.append(var.to(dev))
        counts.append(count)
        if reader is not None:
            done = _devices.new_event(mean.device)
            done.record(reader)
            held.append((done, [mean, var]))
    return means, vars_, counts


class _BatchNormElemt(Function):
    """``y = (x - mean) * invstd * weight + bias``, channels on dim 1, differentiable in all five.

    Backward returns ``-invstd * w * sum_dy`` for mean and ``w * sum_dy_xmu`` for invstd; the graph
    of the global statistics carries them to every replica (NOTE [ Synchronising replicas without
    a barrier in backward ]).
    """

    @staticmethod
    def forward(ctx, x, mean, invstd, weight, bias):
        shape = [1, x.size(1)] + [1] * (x.dim() - 2)
        scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
        y = (x.to(mean.dtype) - mean.view(shape)) * scale.view(shape)
        if bias is not None:
            y = y + bias.to(y.dtype).view(shape)
        ctx.save_for_backward(x, mean, invstd, weight)
        ctx.has_bias = bias is not None
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, mean, invstd, weight = ctx.saved_tensors
        shape = [1, x.size(1)] + [1] * (x.dim() - 2)
        dims = [0, *range(2, x.dim())]
        dyf = dy.to(mean.dtype)
        w = torch.ones_like(invstd) if weight is None else weight.to(invstd.dtype)
        sum_dy = dyf.sum(dims)
        sum_dy_xmu = (dyf * (x.to(mean.dtype) - mean.view(shape))).sum(dims)
        gx = (dyf * (invstd * w).view(shape)).to(x.dtype) if ctx.needs_input_grad[0] else None
        g_mean = -(invstd * w) * sum_dy
        g_invstd = w * sum_dy_xmu
        gw = None if weight is None else (sum_dy_xmu * invstd).to(weight.dtype)
        gb = sum_dy.to(weight.dtype if weight is not None else dy.dtype) if ctx.has_bias else None
        return gx, g_mean, g_invstd, gw, gb


class _Forward:
    """A replica's forward for one step: syncs a SyncBatchNorm and/or reports a root's end.

    Holds its module weakly (no reference cycle through the module's ``__dict__``).
    """

    __slots__ = ("ref", "inner", "rv", "rank", "layer", "root", "calls")

    def __init__(
        self, module: Module, rv: _Rendezvous, rank: int, layer: int | None, root: bool
    ) -> None:
        prev = module.__dict__.get("forward")
        self.inner = prev.inner if isinstance(prev, _Forward) else prev
        self.ref = weakref.ref(module)
        self.rv, self.rank, self.layer, self.root, self.calls = rv, rank, layer, root, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rv, launch = self.rv, current_launch()
        if launch is not None and launch < (rv.armed if rv.closed is None else rv.closed):
            raise ReplicaAborted(  # NOTE [ A block left while replicas run ]
                f"fastdp: replica {self.rank} belongs to a step that was interrupted; it stops here"
            )
        if rv.closed is not None:  # the module's own forward, for every later call
            if self.inner is not None:
                return self.inner(*args, **kwargs)
            m = self.ref()
            return type(m).forward(m, *args, **kwargs)
        if not self.root:
            return self._call(args, kwargs)
        try:
            out = self._call(args, kwargs)
        except BaseException as e:
            self.rv.finish(self.rank, e)
            raise
        self.rv.finish(self.rank, None)
        return out

    def _call(self, args: tuple, kwargs: dict) -> Any:
        m = self.ref()
        if self.layer is not None:
            return _sync_bn_forward(m, self, *args, **kwargs)
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(m).forward(m, *args, **kwargs)


def _sync_bn_forward(m: SyncBatchNorm, fwd: _Forward, input: torch.Tensor) -> torch.Tensor:
    m._check_input_dim(input)
    check_channels = getattr(m, "_check_non_zero_input_channels", None)
    if check_channels is not None:
        check_channels(input)
    bn_training = m.training or (m.running_mean is None and m.running_var is None)
    if not bn_training:  # eval with running stats: nothing to synchronise
        return SyncBatchNorm.forward(m, input)
    factor = 0.0 if m.momentum is None else m.momentum
    track = m.training and m.track_running_stats
    if track:
        m.num_batches_tracked.add_(1)
        factor = 1.0 / float(m.num_batches_tracked) if m.momentum is None else m.momentum
    key = (fwd.layer, fwd.calls)
    fwd.calls += 1
    return fwd.rv.batch_norm(
        key,
        fwd.rank,
        input,
        m.weight,
        m.bias,
        m.running_mean if track else None,
        m.running_var if track else None,
        factor,
        m.eps,
    )


def _syncable(m: Module) -> bool:
    global _warned_subclass
    if not isinstance(m, SyncBatchNorm):
        return False
    own = m.__dict__.get("forward")
    if type(m).forward is SyncBatchNorm.forward and (own is None or isinstance(own, _Forward)):
        return True
    if not _warned_subclass:
        _warned_subclass = True
        warnings.warn(
            f"fastdp: {type(m).__name__} overrides SyncBatchNorm.forward; its replicas "
            "are not synchronised (they normalise with per-replica statistics)",
            stacklevel=4,
        )
    return False


def _scan(replicas: Sequence[Module]) -> tuple[list[str], list[list[Module]], list[list[Module]]]:
    """(names of synced layers, SyncBatchNorm modules per replica, callback modules per replica).

    Cached per replica set (cached replicas are scanned once); the cache holds modules weakly.
    """
    hit = _scan_cache.get(replicas[0])
    if (
        hit is not None
        and len(hit[0]) == len(replicas)
        and all(ref() is r for ref, r in zip(hit[0], replicas))
    ):
        names, sync_refs, cb_pos = hit[1]
        sync_bns = [[ref() for ref in refs] for refs in sync_refs]
        if all(m is not None for ms in sync_bns for m in ms):
            return names, sync_bns, cb_pos and _callbacks(replicas, cb_pos)
    named = list(replicas[0].named_modules())
    sync_pos = [j for j, (_, m) in enumerate(named) if _syncable(m)]
    cb_pos = [j for j, (_, m) in enumerate(named) if hasattr(m, "__data_parallel_replicate__")]
    mods = [[m for _, m in named]] + [list(r.modules()) for r in replicas[1:]]
    names = [named[j][0] or "<root>" for j in sync_pos]
    sync_bns = [[ms[j] for j in sync_pos] for ms in mods]
    _scan_cache[replicas[0]] = (
        [weakref.ref(r) for r in replicas],
        (names, [[weakref.ref(m) for m in ms] for ms in sync_bns], cb_pos),
    )
    return names, sync_bns, [[(j, ms[j]) for j in cb_pos] for ms in mods]


def _callbacks(replicas: Sequence[Module], cb_pos: list[int]) -> list[list[tuple[int, Module]]]:
    out = []
    for r in replicas:
        ms = list(r.modules())
        out.append([(j, ms[j]) for j in cb_pos])
    return out


# NOTE [ A block left while replicas run ]
# Ctrl-C (or any error) can leave the ``prepare_replicas`` block while replicas still run on
# workers: Python cannot stop them, and the next step only waits for them inside its launch,
# after it armed the replicas again. Restoring the forwards then would let a replica not yet at
# a layer run it unsynchronised, or join the next step's meeting (a deadlock until the timeout).
# So leaving the block closes the meeting (waiting replicas stop) and keeps the forwards while a
# replica has not finished: a call made by a replica of a launch numbered below the meeting's
# arming (or its closing) raises ``ReplicaAborted`` at once (``current_launch``); any other call
# runs the module's own forward. The next ``prepare_replicas`` replaces them.
class _Prepared:
    """Context manager returned by ``prepare_replicas``; restores the replicas' forwards on exit
    (NOTE [ A block left while replicas run ])."""

    def __init__(self, installed: list[tuple[Module, _Forward]], rv: _Rendezvous | None) -> None:
        self.installed, self.rv = installed, rv

    def __enter__(self) -> _Prepared:
        return self

    def __exit__(self, *exc: Any) -> None:
        rv, self.rv = self.rv, None
        if rv is not None and not rv.close() and exc[0] is not None:
            self.installed = []  # a replica may still run: the forwards stay, closed
            return
        for module, fwd in self.installed:
            if fwd.inner is None:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = fwd.inner
        self.installed = []


def replicas_meet(replicas: Sequence[Any]) -> bool:
    """Whether ``replicas`` meet each other during their forward, so they must run at once
    (on threads, whatever the launch strategy): ``prepare_replicas``
    armed them (their roots run its rendezvous's forward) and its block has not ended. A query
    of the replicas themselves: O(1), nothing written."""
    d = getattr(replicas[0], "__dict__", None) if replicas else None
    f = d.get("forward") if d is not None else None
    return isinstance(f, _Forward) and f.rv.closed is None


def _timeout(timeout: float | None) -> float:
    if timeout is not None:
        return float(timeout)
    return float(os.environ.get("FASTDP_SYNC_TIMEOUT", _DEFAULT_TIMEOUT))


def prepare_replicas(replicas: Sequence[Module], *, timeout: float | None = None) -> _Prepared:
    """Run replication callbacks and arm SyncBatchNorm sync for one step's ``replicas``.

    Call right after ``replicate`` and run the replicas inside the returned context::

        replicas = replicate(module, devices)
        with prepare_replicas(replicas):
            outputs = parallel_apply(replicas, inputs, kwargs, devices)

    The replicas must run concurrently (one thread each): inside the block, ``parallel_apply``
    runs them on threads whatever the launch strategy.
    Works with fresh or cached replicas: nothing is left on them after the ``with`` block
    (unless an error left it while a replica may still run: NOTE [ A block left while replicas
    run ]).

    Args:
        replicas: the step's replicas (module trees isomorphic to the original).
        timeout: seconds a replica waits for the others at a SyncBatchNorm before raising
            ``TimeoutError`` (default ``FASTDP_SYNC_TIMEOUT`` or 300).
    """
    if not replicas:
        return _Prepared([], None)
    names, sync_bns, callbacks = _scan(replicas)
    ctxs: dict[int, CallbackContext] = {}
    for copy_id, mods in enumerate(callbacks):  # master copy first, as DataParallelWithCallback
        for j, m in mods:
            m.__data_parallel_replicate__(ctxs.setdefault(j, CallbackContext()), copy_id)
    if len(replicas) < 2 or not (names or any(callbacks)):
        return _Prepared([], None)
    # callbacks' copies may talk to each other during forward: their roots run the rendezvous's
    # forward too (it has no layer to sync), so replicas_meet says they must run at once
    rv = _Rendezvous(len(replicas), _timeout(timeout), names)
    installed = []
    for rank, root in enumerate(replicas):
        layers = sync_bns[rank]
        for idx, m in enumerate(layers):
            installed.append((m, _Forward(m, rv, rank, idx, root=m is root)))
        if not any(m is root for m in layers):
            installed.append((root, _Forward(root, rv, rank, None, root=True)))
    for m, fwd in installed:
        m.__dict__["forward"] = fwd
    return _Prepared(installed, rv)
