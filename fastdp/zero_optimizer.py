"""``ZeroRedundancyOptimizer``: the optimizer state sharded over a FastDataParallel's replicas.

Every parameter has one owner, a replica index; each owner holds an ``optimizer_class`` instance
over the parameters it owns (every parameter group kept, possibly empty), so a parameter's state
lives only there and each owner's step runs on its device. An owner on the originals' storage
steps the originals in place, as the unsharded optimizer does; an owner on another device (or on
storage of its own under ``FASTDP_CPU_DISTINCT=1``) steps master copies: the parameter and its
gradient are copied in, the updated values copied back into the original, and the next refresh
carries them to every replica. The original parameters' ``.grad`` is untouched until ``step()``,
so whatever a training loop does between ``backward()`` and ``step()`` sees DataParallel's
gradients.

Under ``torchrun`` (``WORLD_SIZE > 1``) the constructor returns torch's own
``torch.distributed.optim.ZeroRedundancyOptimizer`` (see ``fastdp.wrap``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch.optim import Optimizer

from fastdp._buckets import cpu_distinct, nbytes
from fastdp._devices import as_devices
from fastdp._workers import WorkerPool
from fastdp.data_parallel import live_wrappers
from fastdp.distributed import _world_size

__all__ = ["ZeroRedundancyOptimizer"]

# Optimizers whose step reads every parameter at once: sharding them would change their result.
_WHOLE_MODEL = (torch.optim.LBFGS,)


class _Shard:
    """One owner: its device, its optimizer, and the (original, master) pairs of the parameters
    it steps on a copy of its own."""

    def __init__(self, index: int, device: torch.device, copies: bool) -> None:
        self.index = index
        self.device = device
        self.copies = copies  # steps master copies, not the originals
        self.optimizer: Optimizer | None = None
        self.masters: dict[int, torch.Tensor] = {}  # id(original) -> master copy
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (original, master)
        self.load = 0  # bytes of the trainable parameters owned

    def key(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor this owner's optimizer holds for original ``p``."""
        return self.masters.get(id(p), p)

    def adopt(self, p: torch.Tensor) -> torch.Tensor:
        if not self.copies:
            return p
        with torch.no_grad():
            master = p.detach().to(self.device, copy=True)
        master.requires_grad_(p.requires_grad)
        self.masters[id(p)] = master
        self.pairs.append((p, master))
        return master

    def step(self, stream: Any) -> BaseException | None:
        """Copy gradients in, step, copy updated values back; an exception is returned, not raised
        (the caller raises the first one, in owner order)."""
        try:
            ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
            with ctx:
                self._copy_in()
                self.optimizer.step()
                self._copy_out()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            return e
        return None

    def _copy_in(self) -> None:
        """Masters take the originals' values every step: nothing tracks a write through
        ``.data`` (the originals are what the unsharded optimizer would read)."""
        with torch.no_grad():
            for p, m in self.pairs:
                _check_same_shape(p, m)
                m.copy_(p)
                m.grad = None if p.grad is None else p.grad.to(self.device, copy=True)

    def _copy_out(self) -> None:
        with torch.no_grad():
            for p, m in self.pairs:
                if m.grad is not None:
                    p.copy_(m)
                    m.grad = None

    def state_bytes(self) -> int:
        if self.optimizer is None:
            return 0
        return sum(
            nbytes(v)
            for st in self.optimizer.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )


def _check_same_shape(p: torch.Tensor, m: torch.Tensor) -> None:
    if p.shape != m.shape or p.dtype != m.dtype:
        raise RuntimeError(
            f"fastdp.ZeroRedundancyOptimizer: a parameter changed from {tuple(m.shape)} "
            f"{m.dtype} to {tuple(p.shape)} {p.dtype} after the optimizer was built; build the "
            "optimizer again after changing the model's parameters"
        )


class _ShardedState(MutableMapping):
    """``optimizer.state``: original parameter -> its state, read from and written to its owner's
    optimizer (a parameter of no owner reads as an empty dict, as ``defaultdict(dict)`` does)."""

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self._zero = weakref.ref(zero)
        self._other: dict[int, tuple[torch.Tensor, dict]] = {}

    def _find(self, p: Any) -> tuple[_Shard, torch.Tensor] | None:
        zero = self._zero()
        shard = None if zero is None else zero._shard_of(p)
        return None if shard is None else (shard, shard.key(p))

    def __getitem__(self, p: Any) -> dict:
        found = self._find(p)
        if found is None:
            return self._other.setdefault(id(p), (p, {}))[1]
        shard, key = found
        return shard.optimizer.state[key]

    def __contains__(self, p: Any) -> bool:
        found = self._find(p)
        if found is None:
            return id(p) in self._other
        return found[1] in found[0].optimizer.state

    def __setitem__(self, p: Any, value: dict) -> None:
        found = self._find(p)
        if found is None:
            self._other[id(p)] = (p, value)
        else:
            found[0].optimizer.state[found[1]] = value

    def __delitem__(self, p: Any) -> None:
        found = self._find(p)
        if found is None:
            del self._other[id(p)]
        else:
            del found[0].optimizer.state[found[1]]

    def __iter__(self) -> Iterator[torch.Tensor]:
        zero = self._zero()
        if zero is not None:
            yield from (p for p in zero._params() if p in self)
        yield from (p for p, _ in self._other.values())

    def __len__(self) -> int:
        return sum(1 for _ in self)


class ZeroRedundancyOptimizer(Optimizer):
    """ZeRO stage 1 in one process: each parameter's optimizer state lives on one replica device.

    Args:
        params: the parameters (or parameter groups) of a ``FastDataParallel``'s module, as for
            any optimizer.
        optimizer_class: the optimizer each owner runs (any optimizer whose ``step`` updates each
            parameter from its own gradient and state: SGD, Adam, AdamW, Adagrad, RMSprop, their
            ``foreach``/``fused`` forms, user classes alike).
        process_group, parameters_as_bucket_view, overlap_with_ddp: torch's arguments, kept for
            one signature: in one process there is no process group (None only), the bucket
            view changes nothing, and ``overlap_with_ddp`` must stay False.
        devices: keyword-only; the owners' devices, one per replica index (default: the
            ``device_ids`` of the ``FastDataParallel`` whose module holds ``params``).
        launch: keyword-only; ``"threads"`` (every owner at once, one worker each),
            ``"inline"`` (in turn, on the caller's thread) or None: owners on distinct devices
            at once, those sharing a device in turn (``"inline"`` where the wrapper's is).
        **defaults: ``optimizer_class``'s keyword arguments (``lr``, ...).

    ``state_dict()`` is torch's layout for ``optimizer_class`` over ``params``: it loads into a
    plain optimizer, and this one loads a plain optimizer's. See *ZeRO-1* in
    ``docs/features.md``.
    """

    def __new__(cls, params: Any, optimizer_class: type[Optimizer], *args: Any, **kwargs: Any):
        if _world_size() > 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

            kwargs.pop("devices", None)
            kwargs.pop("launch", None)
            return TorchZero(params, optimizer_class, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[Optimizer],
        process_group: Any = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        *,
        devices: Sequence[Any] | None = None,
        launch: str | None = None,
        **defaults: Any,
    ) -> None:
        _check_arguments(optimizer_class, process_group, overlap_with_ddp, launch)
        self._ready = False  # add_param_group only records groups until the shards exist
        self._optimizer_class = optimizer_class
        self._launch = launch
        self.parameters_as_bucket_view = parameters_as_bucket_view
        super().__init__(params, defaults)
        params_ = list(self._params())
        self._wrapper, devs = _devices_for(params_, devices)
        distinct = cpu_distinct()
        self._shards = [
            _Shard(i, d, d != params_[0].device or (distinct and i > 0 and d.type == "cpu"))
            for i, d in enumerate(devs)
        ]
        self._owner: dict[int, _Shard] = {}
        self._assign(params_)
        for shard in self._shards:
            groups = [self._local_group(g, shard) for g in self.param_groups]
            shard.optimizer = optimizer_class(groups, **defaults)
        self.defaults = dict(self._shards[0].optimizer.defaults)
        self._pull_group_settings()
        self.state = _ShardedState(self)  # type: ignore[assignment]
        self._pool = WorkerPool()
        weakref.finalize(self, self._pool.shutdown)
        self._ready = True

    # ----- parameters and owners

    def _params(self) -> Iterator[torch.Tensor]:
        for g in self.param_groups:
            yield from g["params"]

    def _shard_of(self, p: Any) -> _Shard | None:
        return self._owner.get(id(p)) if isinstance(p, torch.Tensor) else None

    def _assign(self, params: Sequence[torch.Tensor]) -> None:
        """By bytes, in contiguous runs: the trainable parameters, in order, cut into one run per
        owner of about equal bytes (a tensor goes to the run its middle byte falls in, so each
        run is within one tensor of total/n); the largest run to the least loaded owner, ties to
        the highest index (index 0 also holds the originals and their gradients). Runs keep each
        owner's tensors in the order they were allocated in (a strided pick is measurably slower
        for thousands of small tensors). Frozen parameters (no state) go to owner 0, uncopied."""
        trainable = [p for p in params if p.requires_grad]
        n, total = len(self._shards), sum(nbytes(p) for p in trainable)
        runs: list[list[torch.Tensor]] = [[] for _ in range(n)]
        done = 0
        for p in trainable:
            runs[min(n - 1, int((done + nbytes(p) / 2) * n / max(total, 1)))].append(p)
            done += nbytes(p)
        by_size = sorted(runs, key=lambda r: -sum(nbytes(p) for p in r))
        owners = sorted(self._shards, key=lambda s: (s.load, -s.index))
        for run, shard in zip(by_size, owners):
            for p in run:
                self._owner[id(p)] = shard
                shard.load += nbytes(p)
        for p in params:
            if id(p) not in self._owner:
                self._owner[id(p)] = self._shards[0]
            elif p.requires_grad and self._owner[id(p)].copies:
                self._owner[id(p)].adopt(p)

    def _local_group(self, group: dict[str, Any], shard: _Shard) -> dict[str, Any]:
        local = {k: v for k, v in group.items() if k != "params"}
        local["params"] = [shard.key(p) for p in group["params"] if self._owner[id(p)] is shard]
        return local

    def _pull_group_settings(self) -> None:
        """Give the global groups the settings the optimizer class filled in (its defaults)."""
        for g, local in zip(self.param_groups, self._shards[0].optimizer.param_groups):
            for k, v in local.items():
                if k != "params":
                    g.setdefault(k, v)

    def _push_group_settings(self) -> None:
        """The global groups' settings (an LR scheduler writes ``lr`` there) to every owner."""
        for shard in self._shards:
            for g, local in zip(self.param_groups, shard.optimizer.param_groups):
                for k, v in g.items():
                    if k != "params":
                        local[k] = v

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``Optimizer.add_param_group``: the new parameters get owners (by bytes, after those
        already assigned) and every owner's optimizer gets the group."""
        super().add_param_group(param_group)
        if not self._ready:
            return
        group = self.param_groups[-1]
        self._assign(group["params"])
        for shard in self._shards:
            shard.optimizer.add_param_group(self._local_group(group, shard))
        self._pull_group_settings()

    # ----- the step

    def _workers(self) -> list[list[_Shard]]:
        """The owners with parameters, grouped by what steps them together: one group per device
        (owners sharing a device step in turn: concurrency there only contends for it), one per
        owner under ``launch="threads"``, one group of all under ``"inline"`` or when the
        wrapper's launch is ``"inline"``."""
        busy = [s for s in self._shards if any(g["params"] for g in s.optimizer.param_groups)]
        wrapper = self._wrapper() if self._wrapper is not None else None
        mode = self._launch or (
            "inline" if wrapper is not None and wrapper.launch == "inline" else None
        )
        if mode == "threads":
            return [[s] for s in busy]
        if mode == "inline":
            return [busy]
        per_device: dict[torch.device, list[_Shard]] = {}
        for s in busy:
            per_device.setdefault(s.device, []).append(s)
        return list(per_device.values())

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Every owner steps its parameters (owners on distinct devices at once, one worker
        thread each); the originals hold the updated values when it returns. ``closure`` runs
        once, first, on the caller's thread."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._push_group_settings()
        groups = [
            [
                (s, torch.cuda.current_stream(s.device) if s.device.type == "cuda" else None)
                for s in g
            ]
            for g in self._workers()
        ]
        if len(groups) > 1:
            errors = [e for es in self._pool.run([_bind(g) for g in groups]) for e in es]
        else:
            errors = [s.step(st) for g in groups for s, st in g]
        for e in errors:
            if e is not None:
                raise e
        return loss

    # ----- state dicts

    def consolidate_state_dict(self, to: int = 0) -> None:
        """torch's consolidation: a no-op here, every shard is in this process already."""

    def _indexed(self) -> Iterator[tuple[int, torch.Tensor]]:
        return enumerate(self._params())

    def state_dict(self) -> dict[str, Any]:
        """torch's layout for ``optimizer_class`` over all parameters (each state tensor stays on
        its owner's device; ``load_state_dict`` of any optimizer moves it to its parameter)."""
        groups, start = [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        state = {}
        for i, p in self._indexed():
            shard = self._owner[id(p)]
            st = shard.optimizer.state.get(shard.key(p))
            if st:
                state[i] = st
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's layout (from this class or a plain ``optimizer_class``): settings into
        the groups, each parameter's state to its owner (cast as its owner's optimizer casts)."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups)):
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't match the size of "
                "optimizer's group"
            )
        saved_id = {}
        for s, g in zip(saved, self.param_groups):
            for i, p in zip(s["params"], g["params"]):
                saved_id[id(p)] = i
            g.update({k: v for k, v in s.items() if k != "params"})
        for shard in self._shards:
            local_groups, local_state, n = [], {}, 0
            for s, g in zip(saved, self.param_groups):
                owned = [p for p in g["params"] if self._owner[id(p)] is shard]
                packed = {k: v for k, v in s.items() if k != "params"}
                packed["params"] = list(range(n, n + len(owned)))
                for j, p in enumerate(owned, start=n):
                    if saved_id[id(p)] in state_dict["state"]:
                        local_state[j] = state_dict["state"][saved_id[id(p)]]
                n += len(owned)
                local_groups.append(packed)
            shard.optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})

    # ----- reporting

    def owner_of(self, p: torch.Tensor) -> int:
        """The replica index whose device holds ``p``'s optimizer state."""
        shard = self._shard_of(p)
        if shard is None:
            raise KeyError("fastdp.ZeroRedundancyOptimizer: not a parameter of this optimizer")
        return shard.index

    def memory_stats(self) -> dict[str, dict[str, int]]:
        """Bytes per owner: ``optimizer_state`` (the state tensors) and ``master_copies`` (the
        parameters an owner steps on a device of its own). Keyed by ``str(device)``, or by
        ``"<device>#<replica index>"`` where devices repeat (CPU replicas)."""
        devs = [str(s.device) for s in self._shards]
        repeated = len(set(devs)) < len(devs)
        return {
            (f"{d}#{s.index}" if repeated else d): {
                "optimizer_state": s.state_bytes(),
                "master_copies": sum(nbytes(m) for m in s.masters.values()),
            }
            for d, s in zip(devs, self._shards)
        }

    def __repr__(self) -> str:
        inner = repr(self._shards[0].optimizer).replace("\n", "\n    ")
        return (
            f"ZeroRedundancyOptimizer({self._optimizer_class.__name__}, "
            f"{len(self._shards)} owners)\n    {inner}"
        )


def _bind(group: list[tuple[_Shard, Any]]) -> Callable[[], list[BaseException | None]]:
    return lambda: [shard.step(stream) for shard, stream in group]


def _check_arguments(
    optimizer_class: Any, process_group: Any, overlap_with_ddp: bool, launch: str | None
) -> None:
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
        raise TypeError(
            "fastdp.ZeroRedundancyOptimizer: optimizer_class must be a torch.optim.Optimizer "
            f"subclass, got {optimizer_class!r}"
        )
    if issubclass(optimizer_class, _WHOLE_MODEL):
        raise ValueError(
            f"fastdp.ZeroRedundancyOptimizer: {optimizer_class.__name__} reads every parameter "
            "in one step (its line search and history span the whole model), so its state "
            f"cannot be split by parameter; use {optimizer_class.__name__} itself"
        )
    if process_group is not None:
        raise ValueError(
            "fastdp.ZeroRedundancyOptimizer: one process has no process group; leave "
            "process_group=None (under torchrun the same call returns torch's optimizer)"
        )
    if overlap_with_ddp:
        raise ValueError(
            "fastdp.ZeroRedundancyOptimizer: overlap_with_ddp needs DDP's communication hook; "
            "in one process leave it False"
        )
    if launch not in (None, "threads", "inline"):
        raise ValueError(
            f"fastdp.ZeroRedundancyOptimizer: launch must be 'threads', 'inline' or None, "
            f"got {launch!r}"
        )


def _devices_for(
    params: Sequence[torch.Tensor], devices: Sequence[Any] | None
) -> tuple[Any, list[torch.device]]:
    """(a weak reference to the wrapper holding ``params`` or None, the owners' devices)."""
    if not params:
        raise ValueError("fastdp.ZeroRedundancyOptimizer: got an empty parameter list")
    homes = {p.device for p in params}
    if len(homes) > 1:
        raise ValueError(
            "fastdp.ZeroRedundancyOptimizer: the parameters are on several devices "
            f"({sorted(map(str, homes))}); a FastDataParallel's module lives on device_ids[0]"
        )
    ids = {id(p) for p in params}
    holders = [w for w in live_wrappers() if ids <= {id(q) for q in w.module.parameters()}]
    wrapper = weakref.ref(holders[0]) if len(holders) == 1 else None
    if devices is not None:
        devs = as_devices(list(devices))
    elif not holders:
        raise ValueError(
            "fastdp.ZeroRedundancyOptimizer: these parameters belong to no FastDataParallel. "
            "Wrap the model first (model = fastdp.FastDataParallel(net, device_ids=...)) and "
            "pass model.parameters(), or name the owners' devices with devices=[...]"
        )
    elif len(holders) > 1:
        raise ValueError(
            "fastdp.ZeroRedundancyOptimizer: these parameters belong to several "
            "FastDataParallel wrappers; name the owners' devices with devices=[...]"
        )
    else:
        w = holders[0]
        devs = as_devices(w.device_ids) if w.device_ids else [next(iter(homes))]
    if not devs:
        raise ValueError("fastdp.ZeroRedundancyOptimizer: devices is empty")
    if devs[0] != next(iter(homes)):
        raise ValueError(
            f"fastdp.ZeroRedundancyOptimizer: the parameters are on {next(iter(homes))} but the "
            f"first device is {devs[0]}; the first owner shares the originals' device"
        )
    return wrapper, devs
