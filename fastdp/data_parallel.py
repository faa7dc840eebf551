"""``FastDataParallel``: ``torch.nn.DataParallel``'s contract, on CUDA ids or CPU virtual replicas.

The contract kept and the deliberate fixes: ``docs/how-it-works.md`` (*Usage*) and
``docs/migrating.md`` (*Deviations from nn.DataParallel*).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import chain
from typing import Any

import torch
from torch.nn import DataParallel, Module
from torch.nn.parameter import UninitializedParameter

from fastdp import _backend, _buckets, _launch, _torch_private, _transports
from fastdp._compiled import context_from_options, is_compiled, untraced_forward
from fastdp._devices import accelerator_type, as_device, as_devices, public_id
from fastdp._launch import Order
from fastdp._methods import MethodCall, generate_call, method_call
from fastdp._planner import StepPlan, batch_size, check_split_args, make_plan
from fastdp._replica_set import NotCacheable, ReplicaSet, tensor_signature
from fastdp._snapshots import module_dicts, snapshot
from fastdp._state_dict import load_wrapped_state_dict
from fastdp._workers import WorkerPool
from fastdp.parallel_apply import parallel_apply
from fastdp.replicate import replicate
from fastdp.scatter_gather import Scattered, gather, scatter_kwargs, scatter_planned
from fastdp.sync_batchnorm import prepare_replicas, replicas_meet

__all__ = ["FastDataParallel", "data_parallel"]

_ZERO_STATS = _transports.new_stats()
_MAX_SETS = 2  # replica sets kept: the most recent device tuples (a partial last batch's spare)

_record_function = _torch_private.record_function  # the step's profiler label

_LIVE: weakref.WeakSet = weakref.WeakSet()  # every FastDataParallel alive (live_wrappers)


def live_wrappers() -> list[FastDataParallel]:
    """The wrappers alive now (``ZeroRedundancyOptimizer`` finds its parameters' wrapper)."""
    return list(_LIVE)


def _check_device(module: Module, src: torch.device) -> None:
    for t in chain(module.parameters(), module.buffers()):
        if t.device != src:
            raise RuntimeError(
                "module must have its parameters and buffers "
                f"on device {src} (device_ids[0]) but found one of "
                f"them on device: {t.device}"
            )


def _check_balance(device_ids: list[int]) -> None:
    from torch.nn.parallel.data_parallel import _check_balance as torch_check_balance

    torch_check_balance(sorted(set(device_ids)))


class FastDataParallel(DataParallel):
    """Data parallelism at the module level: ``nn.DataParallel``'s behaviour, faster.

    Args:
        module: the module to parallelize.
        device_ids: accelerator devices (ints, ``torch.device``, ``'cuda:N'``; repeats allowed:
            replicas then share a GPU; CUDA when available, else torch's current accelerator) or
            CPU devices (``['cpu'] * n``: the whole multi-replica pipeline on the CPU). Default:
            all the accelerator's devices; with none, ``forward`` just calls the module.
        output_device: where outputs are gathered (default ``device_ids[0]``; -1 or ``'cpu'``
            for the CPU).
        dim: the dimension inputs are chunked along and outputs concatenated along.
        persistent: keyword-only; keep replicas across steps (``docs/how-it-works.md``);
            False replicates afresh every step, as DataParallel does.
        chunk_sizes: keyword-only; rows per device (summing to the batch; 0 skips a device).
        balance: keyword-only; relative shares per device, turned into chunk sizes for every
            batch by largest-remainder rounding (0 skips a device). Exclusive with chunk_sizes.
        gather_output: keyword-only; False makes ``forward`` return a ``fastdp.Scattered`` of the
            per-replica outputs (see ``fastdp.ParallelCriterion``).
        launch: keyword-only; how replicas run: ``"threads"`` (one worker thread each),
            ``"inline"`` (in turn on the caller's thread) or ``"auto"`` (measure both, keep the
            faster). Default ``FASTDP_LAUNCH``, else ``"auto"``; see *Launch strategies*
            in ``docs/how-it-works.md``. ``launch_report()`` shows what ``auto`` picked.
        bucket_cap_mb: keyword-only; the size of the buckets replicas are refreshed and
            gradients reduced in (DDP's default 25; the first bucket at most 1 MiB). See
            *Buckets* in ``docs/how-it-works.md``; ``comm_stats()`` counts the calls.
        strict_chunks: keyword-only; input tensors that split into more chunks than others lose
            their extra rows, as in DataParallel, with one warning per wrapper naming them; True
            raises ``ValueError`` instead (``docs/migrating.md``).
        scalar_outputs: keyword-only; how 0-dim outputs (a loss per replica) are gathered:
            ``"stack"`` (DataParallel's vector and warning), ``"mean"`` (one 0-dim value, the
            replicas' values weighted by their rows: the whole-batch mean of a per-sample mean
            loss, so a later ``.mean()`` changes nothing) or ``"sum"`` (the replicas' sum, for
            losses each replica normalised by a global count and used as they are; not for HF
            Trainer, which multiplies by n_gpu: keep the default ``"stack"`` there).

    ``generate`` and ``call_method`` run a method of the module (Hugging Face's ``generate``, any
    other by name) on every replica with ``forward``'s step: see ``docs/features.md``.
    SyncBatchNorm layers (``nn.SyncBatchNorm.convert_sync_batchnorm``) are synchronised across
    the replicas, and ``__data_parallel_replicate__`` callbacks run: see ``fastdp.sync_batchnorm``.
    ``load_state_dict`` takes ``module.``-prefixed and bare keys: see ``fastdp/_state_dict.py``.
    """

    def __init__(
        self,
        module: Module,
        device_ids: Sequence[int | str | torch.device] | None = None,
        output_device: int | str | torch.device | None = None,
        dim: int = 0,
        *,
        persistent: bool = True,
        chunk_sizes: Sequence[int] | None = None,
        balance: Sequence[float] | None = None,
        gather_output: bool = True,
        launch: str | None = None,
        bucket_cap_mb: float = _buckets.DEFAULT_CAP_MB,
        strict_chunks: bool = False,
        scalar_outputs: str = "stack",
    ) -> None:
        Module.__init__(self)
        _torch_private.log_api_usage_once("fastdp.FastDataParallel")
        self.module = module
        self.dim = dim
        self.persistent = persistent
        if not bucket_cap_mb > 0:
            raise ValueError(f"fastdp: bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.bucket_cap_mb = bucket_cap_mb
        if scalar_outputs not in ("stack", "mean", "sum"):
            raise ValueError(
                f"fastdp: scalar_outputs must be 'stack', 'mean' or 'sum', got {scalar_outputs!r}"
            )
        self.scalar_outputs = scalar_outputs
        self.strict_chunks = strict_chunks
        self.strategy = _launch.make(launch)  # the strategies: fastdp/_launch.py
        self.gather_output = gather_output
        self._compile_ctx: Any = None  # FastDataParallel.compile's torch.compile context
        self._start()
        devs = self._resolve_devices(device_ids)
        # [beyond DP] chunk sizes and shares per device
        self.chunk_sizes, self.balance = check_split_args(
            chunk_sizes, balance, None if devs is None else len(devs)
        )
        if devs is None:
            self.device_ids = []
            return
        self._devices = devs
        self.device_ids = [public_id(d) for d in devs]
        out = devs[0] if output_device is None else as_device(output_device)
        self._output = out
        self.output_device = (
            public_id(out) if out.type != "cpu" else (-1 if devs[0].type != "cpu" else out)
        )
        self.src_device_obj = devs[0]
        if devs[0].type == "cuda":
            _check_balance(self.device_ids)
        if len(devs) == 1:
            self.module.to(self.src_device_obj)

    # Saving the wrapper: a pickle or deepcopy holds what DataParallel's holds (the module, the
    # Module dicts and the settings: device_ids, output_device, dim, the keyword-only ones). What
    # serves the steps of one process (replica sets, signatures, workers, the step lock, gradients
    # pending under no_sync, counters, caches) is named in ``_RUNTIME``: ``_start`` makes it
    # afresh, ``__getstate__`` leaves it out and ``__setstate__`` calls ``_start``, so a copy
    # steps as a fresh wrapper of a copy of the module does, and the original is left as it was.
    _RUNTIME = (
        "_drop_warned",
        "_comm",
        "_replica_sets",
        "_checked",
        "_last",
        "_step_lock",
        "_pool",
        "_no_sync",
        "_pending_sets",
        "no_sync_stats",
        "_direct_compiled",  # _module_for's cache
    )

    def _start(self) -> None:
        """The per-process state, fresh (see ``_RUNTIME``); registers the wrapper."""
        self._drop_warned = False  # the rows-dropped warning given (once per wrapper)
        self._comm = _transports.new_stats()  # see comm_stats()
        self._replica_sets: dict[tuple[Any, ...], ReplicaSet] = {}
        self._checked: tuple | None = None  # NOTE [ One signature per step ]
        self._last: dict[str, str | None] = {"launch": None}  # see last_launch
        self._step_lock = threading.Lock()
        self._pool = WorkerPool()
        weakref.finalize(self, self._pool.shutdown)
        self._no_sync = False
        self._pending_sets: dict[int, ReplicaSet] = {}  # replica sets holding no_sync gradients
        self.no_sync_stats = {"micro_steps": 0, "folds": 0}  # reductions saved, folds made
        _LIVE.add(self)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for name in self._RUNTIME:
            state.pop(name, None)
        state["strategy"] = _launch.make(self.strategy.name)  # "auto" measures anew
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._start()

    @staticmethod
    def _resolve_devices(device_ids: Any) -> list[torch.device] | None:
        """The replica devices, or None for DataParallel's pass-through (no accelerator)."""
        acc = accelerator_type()
        if device_ids is not None:
            devs = as_devices(list(device_ids))
            if not devs:
                if acc is None:
                    return None  # DataParallel without an accelerator: the module runs directly
                raise RuntimeError("no available devices were found")
            if devs[0].type == "cpu":
                return devs
            if acc is None:
                warnings.warn(
                    f"fastdp: device_ids={list(device_ids)} but CUDA is not available; the module "
                    "runs directly, as nn.DataParallel does. Use device_ids=['cpu'] * n for CPU "
                    "replicas.",
                    stacklevel=3,
                )
                return None
            return devs
        if acc is None:
            return None
        n = torch.cuda.device_count() if acc == "cuda" else torch.accelerator.device_count()
        return [torch.device(acc, i) for i in range(n)]

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # see NOTE [ Compiling the wrapper ]
            return untraced_forward(self, inputs, kwargs)
        return self._forward(inputs, kwargs, self._compile_ctx)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``generate`` (Hugging Face's, or any of that name) on every replica at
        once, the batch split as ``forward``'s; sequences right-padded with the pad token (else
        EOS) where replicas stopped at different lengths. See *Generation and any method* in
        ``docs/features.md`` for the fields of a ``return_dict_in_generate`` output."""
        call = generate_call(self.module, args, kwargs, self.dim, len(self.device_ids))
        return self._forward(args, kwargs, self._compile_ctx, call)

    def call_method(self, name: str, /, *args: Any, **kwargs: Any) -> Any:
        """``getattr(replica, name)(*args, **kwargs)`` on every replica at once, with
        ``forward``'s scatter and gather (an ``encode``, a ``predict_step``); every tensor input
        must have the same batch size. See *Generation and any method* in ``docs/features.md``."""
        call = method_call(self.module, name, args, kwargs, self.dim, len(self.device_ids))
        return self._forward(args, kwargs, self._compile_ctx, call)

    def _forward(
        self,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any],
        ctx: Any,
        call: MethodCall | None = None,
    ) -> Any:
        """One step: plan -> scatter -> replicate (refresh) -> parallel_apply -> gather; the
        reduce runs in backward (fastdp/_reducer.py). ``call``: a method in forward's place."""
        with _record_function("FastDataParallel.forward" if call is None else call.label):
            self._start_step()
            plan = self._plan(inputs, kwargs, ctx)
            if plan.unreplicated:
                return self._direct(self._callee(ctx, call)(*inputs, **kwargs), plan)
            inputs, module_kwargs = self._scatter_step(plan, inputs, kwargs)
            if not inputs and not module_kwargs:
                inputs, module_kwargs = ((),), ({},)
            if len(self.device_ids) == 1:
                return self._direct(self._callee(ctx, call)(*inputs[0], **module_kwargs[0]), plan)
            if not self._step_lock.acquire(blocking=False):  # NOTE [ Concurrent calls ]
                return self._fresh_step(plan, inputs, module_kwargs, call)
            if not torch.is_grad_enabled() and self._micro_backward_due():
                self._step_lock.release()
                return self._fresh_step(plan, inputs, module_kwargs, call)
            try:
                replicas = self._replicate_step(plan, len(inputs))
                outputs = self._launch_step(plan, replicas, inputs, module_kwargs, call)
            finally:
                self._step_lock.release()
            return self._gather_step(plan, outputs, inputs, module_kwargs, call)

    # NOTE [ Concurrent calls ]
    # DataParallel builds replicas per call, so two threads may call one wrapper (inference
    # servers do). The persistent replicas serve one call at a time, from its replicate to
    # the end of its launch; a call made meanwhile (another thread's, or a replica's forward
    # calling the wrapper again) replicates afresh, DataParallel's algorithm, for itself.
    def _fresh_step(
        self, plan: StepPlan, inputs: Sequence[Any], kwargs: Sequence[Any], call: MethodCall | None
    ) -> Any:
        """A step on fresh replicas, for a call made while the persistent ones serve another."""
        devs = plan.devices[: len(inputs)]
        replicas = replicate(self.module, devs, not torch.is_grad_enabled())
        method = None if call is None else call.name
        with prepare_replicas(replicas):
            outputs = parallel_apply(
                replicas, inputs, kwargs, devs, launch="threads", method=method
            )
        return self._gather_step(plan, outputs, inputs, kwargs, call)

    def _micro_backward_due(self) -> bool:
        """A ``no_sync`` micro-step's backward has yet to run: a forward without grad meanwhile
        runs on fresh replicas (DataParallel's algorithm), so the persistent ones stay on the
        leaves that backward's reentrant checkpoints re-run on."""
        return any(rs.awaits_micro_backward() for rs in self._pending_sets.values())

    def _start_step(self) -> None:
        self._comm.update(_ZERO_STATS)
        if self._pending_sets and not self._no_sync and torch.is_grad_enabled():
            self._fold_pending()

    def _plan(self, inputs: tuple[Any, ...], kwargs: dict[str, Any], ctx: Any) -> StepPlan:
        verified = self._check_device_cached() if self.device_ids else None
        # the plan splits the inputs where the scatter seam is ours (no subclass's, no instance's)
        own = type(self).scatter is FastDataParallel.scatter and "scatter" not in self.__dict__
        return make_plan(
            inputs,
            kwargs,
            devices=self._devices if self.device_ids else [],
            ids=self.device_ids,
            dim=self.dim,
            chunk_sizes=self.chunk_sizes,
            balance=self.balance,
            gather_output=self.gather_output,
            ctx=ctx,
            verified=verified,
            split=own,
            on_drop=self._rows_dropped,
        )

    def _scatter_step(
        self, plan: StepPlan, inputs: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
        if plan.leaves is not None:  # the wrapper's own seam: the plan executed as it is
            return scatter_planned(
                plan.spec, plan.leaves, plan.dims, plan.splits, plan.devices, inputs, kwargs
            )
        split = {} if plan.sizes is None else {"chunk_sizes": plan.sizes}
        return self.scatter(inputs, kwargs, plan.ids, **split)  # an overridden seam splits

    def _replicate_step(self, plan: StepPlan, n: int) -> list[Module]:
        ids = plan.ids if len(plan.ids) == n else plan.ids[:n]
        if type(self).replicate is FastDataParallel.replicate:
            return self.replicate(self.module, ids, plan=plan)
        return self.replicate(self.module, ids)  # a subclass's seam: DataParallel's signature

    def _launch_step(
        self,
        plan: StepPlan,
        replicas: list[Module],
        inputs: Sequence[Any],
        kwargs: Sequence[Any],
        call: MethodCall | None = None,
    ) -> list[Any]:
        """Arm the replicas where they meet in forward, then the ``parallel_apply`` seam."""
        on = {"devices": plan.devices[: len(inputs)]} if plan.custom_split else {}
        if call is not None:
            on["method"] = call.name
        rs = self._set_of(replicas)
        if rs is not None and rs.launch_order() is not Order.TOGETHER:  # nothing to arm
            outputs = self.parallel_apply(replicas, inputs, kwargs, **on)
        else:
            with prepare_replicas(replicas):  # [beyond DP] SyncBatchNorm, callbacks
                outputs = self.parallel_apply(replicas, inputs, kwargs, **on)
        if rs is not None:
            rs.after_launch(outputs)
        return outputs

    def _set_of(self, replicas: Sequence[Module]) -> ReplicaSet | None:
        """The kept replica set ``replicas`` belong to; None for fresh replicas."""
        for rs in self._replica_sets.values():
            if rs.serves(replicas):
                return rs
        return None

    def _gather_step(
        self,
        plan: StepPlan,
        outputs: list[Any],
        inputs: Sequence[Any],
        kwargs: Sequence[Any],
        call: MethodCall | None = None,
    ) -> Any:
        if not self.gather_output:  # [beyond DP]
            n = len(outputs)
            return Scattered(outputs, plan.chunk_rows(n), plan.devices[:n], self.dim, self._output)
        if call is not None and call.gather is not None:
            return call.gather(outputs, inputs, kwargs, self._output)
        if self.scalar_outputs == "stack":
            return self.gather(outputs, self.output_device)
        rows = [_rows(i, k, self.dim) for i, k in zip(inputs, kwargs)]
        return self.gather(outputs, self.output_device, weights=rows)

    def _callee(self, ctx: Any, call: MethodCall | None) -> Any:
        """What a step without replicas calls: the module (``_module_for``) or its method."""
        return self._module_for(ctx) if call is None else getattr(self.module, call.name)

    def _module_for(self, ctx: Any) -> Module:
        """The module to call directly (no replicas), compiled with the wrapper's ``ctx``."""
        if ctx is None or is_compiled(self.module):
            return self.module
        hit = self.__dict__.get("_direct_compiled")  # not a submodule: kept out of state_dict
        if hit is None or hit[0] is not ctx or hit[1]._orig_mod is not self.module:
            hit = self.__dict__["_direct_compiled"] = (ctx, ctx(self.module))
        return hit[1]

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's ``no_sync()``: backward passes of forwards run inside keep every replica's
        gradients on the replica, unreduced; the first grad-enabled forward outside folds them
        into the originals' ``.grad``, so after its backward ``.grad`` equals plain gradient
        accumulation. Saves one cross-device reduce of all parameters per micro-step. See
        *Gradient accumulation* in ``docs/features.md``."""
        old, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = old

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``Module.zero_grad``, also dropping gradients pending under ``no_sync()``."""
        super().zero_grad(set_to_none)
        for rs in self._pending_sets.values():
            rs.drop_pending(zeros=not set_to_none)

    def _fold_pending(self) -> None:
        # every cycle ends before any fold runs: a fold changes the grad marks another set reads
        folds = [rs.end_cycle() for rs in self._pending_sets.values()]
        self._pending_sets = {}
        self.no_sync_stats["folds"] += 1
        for fold in folds:
            fold()

    def comm_stats(self) -> dict[str, int]:
        """This step's replication traffic: ``buckets`` (the replica set's buckets, parameters
        and buffers), ``broadcasts`` and ``reduces`` (one per bucket, whatever the number of
        devices; without the extension one reduce node serves all buckets),
        ``bytes_broadcast``, ``bytes_reduced``; ``sums_out_of_place``: gradients the
        extension's bucket nodes summed into new tensors because autograd's in-place rule
        refused their memory (a view of a gradient another node still reads; every one under
        ``create_graph``), each one allocation more. Zeroed when a forward starts, updated as each
        call is issued (a backward hook sees the reduces so far). Persistent replicas
        only (``persistent=False`` replicates with ``fastdp.comm`` and counts nothing)."""
        return dict(self._comm)

    def memory_stats(self) -> dict[str, dict[str, int]]:
        """Bytes the wrapper holds, per device (``str(device)``): ``replicas`` (the persistent
        replicas' own copies of parameters and buffers; replicas on the originals' storage
        hold none) and ``staging`` (the source device's packing flats), over the replica sets
        kept (at most two device tuples: the last step's and one more, least recently used
        dropped). ``"pinned"``: the extension's pinned host staging pool (``reserved`` bytes,
        shared by the process)."""
        out: dict[str, dict[str, int]] = {}
        for rs in self._replica_sets.values():
            rs.add_memory(out)
        ext = _backend.ext()
        pool = getattr(ext, "pinned_pool_stats", None)
        if pool is not None:
            out["pinned"] = {"reserved": dict(pool()).get("reserved", 0)}
        return out

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Compile the module inside every replica with ``torch.compile``'s keyword options
        (``mode``, ``backend``, ``dynamic``, ``fullgraph``, ``options``, ...); the wrapper's own
        planning, scatter, threads and gather stay eager. See *torch.compile* in
        ``docs/features.md``."""
        if args:
            raise TypeError("FastDataParallel.compile takes torch.compile's keyword options only")
        self._compile_ctx = context_from_options(**kwargs)
        self.invalidate_replicas()

    def _direct(self, output: Any, plan: StepPlan) -> Any:
        """The output of a forward that ran the module itself (no replicas, no gather)."""
        if self.gather_output:
            return output
        device = plan.devices[0] if plan.devices else None
        return Scattered(
            [output], None if plan.batch is None else [plan.batch], [device], self.dim, None
        )

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """``Module.load_state_dict`` taking ``module.``-prefixed (DataParallel, DDP) or bare keys
        (the plain module, ``fastdp.unwrap(m).state_dict()``, FSDP2's ``get_model_state_dict``).

        Mismatched keys raise a ``RuntimeError`` naming the nearest expected keys.
        """
        return load_wrapped_state_dict(self, state_dict, strict, assign)

    # NOTE [ One signature per step ]
    # The module's dicts and tensors are checked once per step, here (NOTE [ Replica
    # invalidation ]). When both match ``self._checked``, that record is returned and becomes
    # the plan's ``verified``; ``replicate`` with that plan skips the ReplicaSet's own checks
    # when the set was last validated under the same record (the module is unchanged since).
    # A ``replicate`` without a plan validates fully.
    def _check_device_cached(self) -> Any:
        """DataParallel's per-step device check, re-run only when the module changed."""
        if self._checked is not None:
            dicts, signature, tensors = self._checked
            if not dicts.changed() and tensor_signature(tensors) == signature:
                return self._checked
        _check_device(self.module, self.src_device_obj)
        if not self.persistent:
            return None
        tensors = list(chain(self.module.parameters(), self.module.buffers()))
        if any(isinstance(t, UninitializedParameter) for t in tensors):
            return None  # lazy modules: replicate raises DataParallel's error
        self._checked = (
            snapshot(module_dicts(self.module.modules())),
            tensor_signature(tensors),
            tensors,
        )
        return None

    def invalidate_replicas(self) -> None:
        """Drop the cached replicas: call after changing the module behind ``nn.Module``'s back
        (e.g. ``module.__dict__[k] = v``); see *Persistent replicas* in ``docs/how-it-works.md``."""
        self._replica_sets.clear()
        self._checked = None

    def replicate(
        self, module: Module, device_ids: Sequence[Any], *, plan: StepPlan | None = None
    ) -> list[Module]:
        """DataParallel's ``replicate``; persistent replicas come back as a new list of their
        set's roots. ``plan``: the step's (context, verified signature); a subclass overriding
        this seam is called with DataParallel's signature, without it."""
        devs = _devs(device_ids, self)
        if not self.persistent or module is not self.module:
            return replicate(module, devs, not torch.is_grad_enabled())
        ctx, verified = (
            (self._compile_ctx, None) if plan is None else (plan.compile_ctx, plan.verified)
        )
        key = tuple(devs) if ctx is None else (*devs, ctx)  # NOTE [ Compiling the wrapper ]
        sets = self._replica_sets
        rs = sets.pop(key, None)  # back in last: the sets are kept least recently used first
        if rs is None or not rs.valid(verified):  # NOTE [ One signature per step ]
            try:
                rs = ReplicaSet(module, devs, ctx, self.bucket_cap_mb * 2**20, self._comm)
            except NotCacheable:
                return replicate(module, devs, not torch.is_grad_enabled())
        sets[key] = rs
        if len(sets) > _MAX_SETS:
            del sets[next(iter(sets))]
        replicas = rs.refresh(self._no_sync, verified)
        if rs.runs_on_leaves():
            self.no_sync_stats["micro_steps"] += 1
        if rs.holds_pending():  # under no_sync: fold at the next step outside
            self._pending_sets[id(rs)] = rs
        return replicas

    def scatter(
        self,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        device_ids: Sequence[Any],
        chunk_sizes: Sequence[int] | None = None,
    ) -> Any:
        return scatter_kwargs(
            inputs,
            kwargs,
            _devs(device_ids, self),
            dim=self.dim,
            chunk_sizes=chunk_sizes,
            on_drop=self._rows_dropped,
        )

    def _rows_dropped(self, message: str) -> None:
        """NOTE [ DataParallel's chunking ]: one warning per wrapper, or an error."""
        if self.strict_chunks:
            raise ValueError(
                message.replace(
                    " Pass strict_chunks=True to make this an error.", " (strict_chunks=True)"
                )
            )
        if not self._drop_warned:
            self._drop_warned = True
            warnings.warn(message, UserWarning, stacklevel=6)

    def parallel_apply(
        self,
        replicas: Sequence[Module],
        inputs: Sequence[Any],
        kwargs: Any,
        devices: Sequence[Any] | None = None,
        *,
        launch: str | None = None,
        method: str | None = None,
    ) -> list[Any]:
        """DataParallel's seam: ``replicas[i](*inputs[i], **kwargs[i])`` on ``devices[i]``
        (default: the wrapper's first ``len(replicas)`` devices). ``launch`` overrides the
        wrapper's strategy for this call; what overrides both (replicas that meet, compiled
        replica sets) is decided by ``fastdp._launch.launch`` from its arguments. ``method``:
        each replica's method of that name in place of its forward (``generate``,
        ``call_method``; a subclass overriding this seam takes it for those calls)."""
        n = len(replicas)
        devs = self._devices[:n] if devices is None else [as_device(d) for d in devices]
        rs = self._set_of(replicas)
        pool = self._pool if self.persistent and n >= 2 else None
        if pool is not None and pool.interrupted:  # an interrupted step's replicas may be busy
            pool.drain()
            self.invalidate_replicas()
        return _launch.launch(
            replicas,
            inputs,
            kwargs,
            devs,
            self.strategy,
            name=launch,
            pool=pool,
            together=replicas_meet(replicas),
            order=Order.ANY if rs is None else rs.launch_order(),
            record=self._last,
            method=method,
        )

    @property
    def last_launch(self) -> str | None:
        """The strategy the last multi-replica step ran (``"threads"``, ``"inline"``, ...)."""
        return self._last["launch"]

    @property
    def launch(self) -> str:
        """The launch strategy's name (``"threads"``, ``"inline"``, ``"auto"``); settable."""
        return self.strategy.name

    @launch.setter
    def launch(self, value: str | None) -> None:
        self.strategy = _launch.make(value)

    def launch_report(self) -> list[dict[str, Any]]:
        """What ``launch="auto"`` measured and chose, one record per (devices, inputs, grad):
        ``choice`` (``"threads"``/``"inline"``, None while measuring), ``threads_ms``/``inline_ms``
        (median forward wall times of the last trial) and ``trials``. Empty under a forced
        strategy."""
        return self.strategy.report()

    def gather(
        self, outputs: Any, output_device: Any, *, weights: Sequence[int] | None = None
    ) -> Any:
        """DataParallel's ``gather``; 0-dim outputs as ``scalar_outputs`` says (``weights``:
        each replica's rows, for ``"mean"``)."""
        return gather(
            outputs,
            _dev(output_device, self),
            dim=self.dim,
            scalars=self.scalar_outputs,
            weights=weights,
        )


def _rows(inputs: Any, kwargs: Any, dim: int) -> int:
    """A replica's rows: its inputs' batch size (the planner's rule), 1 without one."""
    rows = batch_size((inputs, kwargs), dim)
    return 1 if rows is None else rows


def _devs(ids: Sequence[Any], owner: FastDataParallel) -> list[torch.device]:
    if ids is owner.device_ids:  # the step's own ids (not copied: see forward)
        return owner._devices
    return [as_device(i) for i in ids]


def _dev(output_device: Any, owner: FastDataParallel) -> torch.device:
    if output_device is owner.output_device:
        return owner._output
    return as_device(output_device)


def data_parallel(
    module: Module,
    inputs: Any,
    device_ids: Sequence[int | str | torch.device] | None = None,
    output_device: int | str | torch.device | None = None,
    dim: int = 0,
    module_kwargs: Any | None = None,
) -> Any:
    """Evaluate ``module(*inputs, **module_kwargs)`` in parallel (functional FastDataParallel)."""
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    if device_ids is None:
        acc = accelerator_type()
        if acc is None:
            raise RuntimeError("device type could not be determined")
        count = torch.cuda.device_count() if acc == "cuda" else torch.accelerator.device_count()
        device_ids = list(range(count))
    devs = as_devices(list(device_ids))
    if not devs:
        raise RuntimeError("no available devices were found")
    out = devs[0] if output_device is None else as_device(output_device)
    _check_device(module, devs[0])
    inputs, kwargs = scatter_kwargs(inputs, module_kwargs, devs, dim)
    if not inputs and not kwargs:
        inputs, kwargs = ((),), ({},)
    if len(devs) == 1:
        return module(*inputs[0], **kwargs[0])
    used = devs[: len(inputs)]
    replicas = replicate(module, used)
    with prepare_replicas(replicas):
        outputs = parallel_apply(replicas, inputs, kwargs, used)
    return gather(outputs, out, dim)
