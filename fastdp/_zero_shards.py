"""The owners of ``ZeroRedundancyOptimizer`` (fastdp/zero_optimizer.py): one ``Shard`` per
replica index (its device, its optimizer, its master copies and the step that copies values and
gradients in and back), the ``state`` mapping over them, and the checks of the constructor's
arguments and devices."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch.optim import Optimizer

from fastdp import _devices
from fastdp._buckets import nbytes
from fastdp._devices import as_devices
from fastdp.data_parallel import live_wrappers

# Optimizers whose step reads every parameter at once: sharding them would change their result.
WHOLE_MODEL = (torch.optim.LBFGS,)


class Shard:
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
        self.copies_made = {"values_in": 0, "grads_in": 0, "values_out": 0}  # across devices
        self.side: Any = None  # this owner's stream on the originals' device, made lazily

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

    def step(self, streams: Sequence[Any]) -> BaseException | None:
        """Copy gradients in, step, copy updated values back, on ``streams``: the caller's current
        streams of the originals' device and of this owner's (a worker thread's own are the
        default streams, unordered with the caller's); an exception is returned, not raised (the
        caller raises the first one, in owner order)."""
        try:
            with ExitStack() as stack:
                streams = self._own_side(list(streams), stack)
                for stream in streams:
                    stack.enter_context(_devices.use_stream(stream))
                self._copy_in()
                self.optimizer.step()
                self._copy_out()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            return e
        return None

    def _own_side(self, streams: list[Any], stack: ExitStack) -> list[Any]:
        """With masters on another accelerator device: the originals' side of this owner's copies
        on a stream of its own (a torch copy between devices runs on the source's current
        stream), after the caller's work there, which waits for it when the step ends."""
        if not (self.copies and self.pairs and len(streams) == 2):
            return streams
        home = streams[0]
        if self.side is None:
            self.side = _devices.new_stream(home.device)
        ready = _devices.new_event(home.device)
        ready.record(home)
        self.side.wait_event(ready)
        stack.callback(home.wait_stream, self.side)
        for p, _ in self.pairs:  # without record_stream: the home stream's wait_stream orders
            if p.grad is not None:  # the caller's later writes after the side stream's reads
                _devices.record_stream(p.grad, self.side)
        return [self.side, streams[1]]

    def _copy_in(self) -> None:
        """Masters take the originals' values every step: nothing tracks a write through
        ``.data`` (the originals are what the unsharded optimizer would read)."""
        with torch.no_grad():
            for p, m in self.pairs:
                check_same_shape(p, m)
            masters = [m for _, m in self.pairs]
            move([p for p, _ in self.pairs], masters)
            self.copies_made["values_in"] += bool(masters)
            dense = [(p.grad, m) for p, m in self.pairs if p.grad is not None]
            sparse = [(g, m) for g, m in dense if g.layout != torch.strided]
            dense = [(g, m) for g, m in dense if g.layout == torch.strided]
            for m in masters:
                m.grad = None
            for g, m in sparse:
                m.grad = g.to(self.device, copy=True)
            for g, m in dense:
                m.grad = torch.empty_like(g, device=self.device)
            move([g for g, _ in dense], [m.grad for _, m in dense])
            self.copies_made["grads_in"] += bool(dense) + len(sparse)

    def _copy_out(self) -> None:
        with torch.no_grad():
            stepped = [(p, m) for p, m in self.pairs if m.grad is not None]
            move([m for _, m in stepped], [p for p, _ in stepped])
            self.copies_made["values_out"] += bool(stepped)
            for _, m in stepped:
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


ALIGN = 16  # bytes: a slice of the flat buffer at a multiple of it views as any dtype


def move(sources: Sequence[torch.Tensor], dests: Sequence[torch.Tensor]) -> None:
    """``d.copy_(s)`` for every pair (same shapes and dtypes) as one copy across devices: a
    torch copy between devices synchronises both devices' current streams, so one per tensor
    serialises the owners on those barriers. The sources' bytes are packed into one flat buffer
    on their device, cross once, and one foreach copy on the destinations' device scatters
    them: the same bytes out, whatever the dtypes, strides or number of tensors."""
    if not sources:
        return
    pieces, offsets, at = [], [], 0
    for s in sources:
        raw = s.detach().resolve_conj().resolve_neg().contiguous().view(-1).view(torch.uint8)
        pad = -raw.numel() % ALIGN
        pieces.append(raw)
        if pad:
            pieces.append(raw.new_zeros(pad))
        offsets.append(at)
        at += raw.numel() + pad
    to = dests[0].device
    flat = torch.cat(pieces).to(to, non_blocking=to.type != "cpu")
    views = [
        flat[o : o + d.numel() * d.element_size()].view(d.dtype).view(d.shape)
        for o, d in zip(offsets, dests)
    ]
    torch._foreach_copy_(list(dests), views)


def check_same_shape(p: torch.Tensor, m: torch.Tensor) -> None:
    if p.shape != m.shape or p.dtype != m.dtype:
        raise RuntimeError(
            f"fastdp.ZeroRedundancyOptimizer: a parameter changed from {tuple(m.shape)} "
            f"{m.dtype} to {tuple(p.shape)} {p.dtype} after the optimizer was built; build the "
            "optimizer again after changing the model's parameters"
        )


class ShardedState(MutableMapping):
    """``optimizer.state``: original parameter -> its state, read from and written to its owner's
    optimizer (a parameter of no owner reads as an empty dict, as ``defaultdict(dict)`` does)."""

    def __init__(
        self,
        shard_of: Callable[[Any], Shard | None],
        params: Callable[[], Iterator[torch.Tensor]],
    ) -> None:
        # weak: the optimizer owns this mapping
        self._shard_of = weakref.WeakMethod(shard_of)  # type: ignore[arg-type]
        self._params = weakref.WeakMethod(params)  # type: ignore[arg-type]
        self._other: dict[int, tuple[torch.Tensor, dict]] = {}

    def _find(self, p: Any) -> tuple[Shard, torch.Tensor] | None:
        shard_of = self._shard_of()
        shard = None if shard_of is None else shard_of(p)
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
        params = self._params()
        if params is not None:
            yield from (p for p in params() if p in self)
        yield from (p for p, _ in self._other.values())

    def __len__(self) -> int:
        return sum(1 for _ in self)


def bind(group: list[tuple[Shard, list[Any]]]) -> Callable[[], list[BaseException | None]]:
    return lambda: [shard.step(streams) for shard, streams in group]


def check_arguments(
    optimizer_class: Any, process_group: Any, overlap_with_ddp: bool, launch: str | None
) -> None:
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
        raise TypeError(
            "fastdp.ZeroRedundancyOptimizer: optimizer_class must be a torch.optim.Optimizer "
            f"subclass, got {optimizer_class!r}"
        )
    if issubclass(optimizer_class, WHOLE_MODEL):
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


def devices_for(
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
