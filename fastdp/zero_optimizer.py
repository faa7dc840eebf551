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
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from fastdp import _devices
from fastdp._buckets import cpu_distinct, nbytes
from fastdp._workers import WorkerPool
from fastdp._zero_shards import Shard, ShardedState, bind, check_arguments, devices_for
from fastdp.distributed import _world_size

__all__ = ["ZeroRedundancyOptimizer"]


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
        check_arguments(optimizer_class, process_group, overlap_with_ddp, launch)
        self._ready = False  # add_param_group only records groups until the shards exist
        self._optimizer_class = optimizer_class
        self._launch = launch
        self.parameters_as_bucket_view = parameters_as_bucket_view
        super().__init__(params, defaults)
        params_ = list(self._params())
        self._wrapper, devs = devices_for(params_, devices)
        distinct = cpu_distinct()
        self._shards = [
            Shard(i, d, d != params_[0].device or (distinct and i > 0 and d.type == "cpu"))
            for i, d in enumerate(devs)
        ]
        self._owner: dict[int, Shard] = {}
        self._assign(params_)
        for shard in self._shards:
            groups = [self._local_group(g, shard) for g in self.param_groups]
            shard.optimizer = optimizer_class(groups, **defaults)
        self.defaults = dict(self._shards[0].optimizer.defaults)
        self._pull_group_settings()
        self.state = ShardedState(self._shard_of, self._params)  # type: ignore[assignment]
        self._pool = WorkerPool()
        weakref.finalize(self, self._pool.shutdown)
        self._ready = True

    # ----- parameters and owners

    def _params(self) -> Iterator[torch.Tensor]:
        for g in self.param_groups:
            yield from g["params"]

    def _shard_of(self, p: Any) -> Shard | None:
        return self._owner.get(id(p)) if isinstance(p, torch.Tensor) else None

    def _assign(self, params: Sequence[torch.Tensor]) -> None:
        """By bytes, in contiguous runs: the trainable parameters, in order, cut into one run per
        owner of about equal bytes (a tensor goes to the run its middle byte falls in, so each
        run is within one tensor of total/n); the largest run to the least loaded owner, ties to
        the highest index (index 0 also holds the originals and their gradients). Runs keep each
        owner's tensors in the order they were allocated in (a strided pick is measurably slower
        for thousands of small tensors). Frozen parameters (no state) go to owner 0, uncopied,
        and so do parameters sharing memory with another (tied weights loaded with
        ``assign=True``): their in-place updates must land one after the other on the same
        bytes, in parameter order, as in the unsharded optimizer."""
        storages: dict[int, int] = {}
        for p in self._params():
            key = p.untyped_storage().data_ptr()
            storages[key] = storages.get(key, 0) + 1
        trainable = [
            p for p in params if p.requires_grad and storages[p.untyped_storage().data_ptr()] == 1
        ]
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

    def _local_group(self, group: dict[str, Any], shard: Shard) -> dict[str, Any]:
        local = _settings(group)
        local["params"] = [shard.key(p) for p in group["params"] if self._owner[id(p)] is shard]
        return local

    def _pull_group_settings(self) -> None:
        """Give the global groups the settings the optimizer class filled in (its defaults)."""
        for g, local in zip(self.param_groups, self._shards[0].optimizer.param_groups):
            for k, v in _settings(local).items():
                g.setdefault(k, v)

    def _push_group_settings(self) -> None:
        """The global groups' settings (an LR scheduler writes ``lr`` there) to every owner."""
        for shard in self._shards:
            for g, local in zip(self.param_groups, shard.optimizer.param_groups):
                local.update(_settings(g))

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

    def _workers(self) -> list[list[Shard]]:
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
        per_device: dict[torch.device, list[Shard]] = {}
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
        home = self._shards[0].device
        groups = [[(s, _caller_streams(home, s.device)) for s in g] for g in self._workers()]
        if len(groups) > 1:
            errors = [e for es in self._pool.run([bind(g) for g in groups]) for e in es]
        else:
            errors = [s.step(st) for g in groups for s, st in g]
        for e in errors:
            if e is not None:
                raise e
        return loss

    # ----- state dicts

    def consolidate_state_dict(self, to: int = 0) -> None:
        """torch's consolidation: a no-op here, every shard is in this process already."""

    def state_dict(self) -> dict[str, Any]:
        """torch's layout for ``optimizer_class`` over all parameters (each state tensor stays on
        its owner's device; ``load_state_dict`` of any optimizer moves it to its parameter)."""
        groups, start = [], 0
        for g in self.param_groups:
            packed = _settings(g)
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        state = {}
        for i, p in enumerate(self._params()):
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
            g.update(_settings(s))
        for shard in self._shards:
            local_groups, local_state, n = [], {}, 0
            for s, g in zip(saved, self.param_groups):
                owned = [p for p in g["params"] if self._owner[id(p)] is shard]
                packed = _settings(s)
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

    def copy_stats(self) -> dict[str, dict[str, int]]:
        """Copies between devices made so far per owner, keyed as ``memory_stats``:
        ``values_in``, ``grads_in`` and ``values_out``, one each per step for an owner stepping
        master copies, whatever its number of tensors (plus one per sparse gradient)."""
        return {k: dict(s.copies_made) for k, s in zip(self.memory_stats(), self._shards)}

    def __repr__(self) -> str:
        inner = repr(self._shards[0].optimizer).replace("\n", "\n    ")
        return (
            f"ZeroRedundancyOptimizer({self._optimizer_class.__name__}, "
            f"{len(self._shards)} owners)\n    {inner}"
        )


def _caller_streams(home: torch.device, device: torch.device) -> list[Any]:
    """The caller's current streams of the originals' device and of an owner's (none on the
    CPU): the owner's copies and step run on them, ordered with the caller's work."""
    devices = [home] if home == device else [home, device]
    return [_devices.current_stream(d) for d in devices if d.type != "cpu"]


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's settings: everything but its parameters."""
    return {k: v for k, v in group.items() if k != "params"}
