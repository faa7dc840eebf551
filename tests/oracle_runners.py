"""The three runners the differential oracle (tests/test_replicas_oracle.py) compares.

Each owns a deepcopy of one model and its own optimizers, and offers the same operations:
``forward``, ``backward``, ``grad`` (``torch.autograd.grad``), ``no_sync``, ``zero_grad``, ``step``,
``round_trip`` (training goes on with a deep copy or a saved and loaded copy). ``Wrapped`` runs a
``FastDataParallel`` (persistent or fresh replicas). ``Chunked`` is DataParallel's semantics by
hand: each chunk runs through a fresh deepcopy of the model on the chunk's device, its output
gathered to the first (a fresh replica: whatever a forward rebinds on it is gone by the next step);
in-place writes of chunk 0's copy to tensors it still holds reach the originals (replica 0 shares
their storage); gradients of the copies are summed into the originals' ``.grad``, through the hooks
registered on the originals; parameters that need a gradient and got none get zeros (DataParallel's
``Broadcast``).
"""

from __future__ import annotations

import copy
import io
import threading
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from fastdp import FastDataParallel, ZeroRedundancyOptimizer
from fastdp.testing import home


def make_optimizers(model: nn.Module, kind: str) -> list[torch.optim.Optimizer]:
    """SGD with momentum or AdamW, both with weight decay; a sparse embedding gets plain SGD.
    ``kind`` ending in ``+zero``: the dense parameters' optimizer is a
    ``ZeroRedundancyOptimizer`` of the same class (the model must be wrapped already)."""
    sparse = [p for n, p in model.named_parameters() if n.startswith("emb.")]
    dense = [p for n, p in model.named_parameters() if not n.startswith("emb.")]
    base, _, zero = kind.partition("+")
    if base == "sgd":
        cls, kw = torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}
    else:
        cls, kw = torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}
    if zero:
        opts: list[torch.optim.Optimizer] = [ZeroRedundancyOptimizer(dense, cls, **kw)]
    else:
        opts = [cls(dense, **kw)]
    if sparse:
        opts.append(torch.optim.SGD(sparse, lr=0.1))
    return opts


class Runner:
    """What the runners share: the model, its optimizers, hooks on the originals."""

    def __init__(self, model: nn.Module, opt: str) -> None:
        self.model = model
        self.opt_kind = opt
        self.opts = make_optimizers(model, opt)

    def param(self, name: str) -> nn.Parameter:
        return dict(self.model.named_parameters())[name]

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def reset_optimizers(self) -> None:
        self.opts = make_optimizers(self.model, self.opt_kind)

    def round_trip(self, how: str) -> None:
        """Go on with a copy of the whole object (``copy.deepcopy``, or ``torch.save`` then
        ``torch.load``), as an early-stopping "best model" copy or a saved wrapper does; the
        optimizers move to the copy's parameters with their state."""
        obj = self._whole()
        if how == "deepcopy":
            obj = copy.deepcopy(obj)
        else:
            buf = io.BytesIO()
            torch.save(obj, buf)
            buf.seek(0)
            obj = torch.load(buf, weights_only=False)
        self._replace(obj)
        old, self.opts = self.opts, make_optimizers(self.model, self.opt_kind)
        for new, o in zip(self.opts, old):
            new.load_state_dict(o.state_dict())


class Wrapped(Runner):
    """A ``FastDataParallel`` over ``devices`` (an id list; the model on the first)."""

    def __init__(
        self,
        model: nn.Module,
        opt: str,
        devices: list[Any],
        persistent: bool,
        cap_mb: float,
        launch: str | None,
    ) -> None:
        self.fdp = FastDataParallel(
            model, devices, persistent=persistent, bucket_cap_mb=cap_mb, launch=launch
        )
        # the sharded optimizer is persistent state: the persistent runner alone runs it
        super().__init__(model, opt if persistent else opt.partition("+")[0])

    def _whole(self) -> Any:
        return self.fdp

    def _replace(self, obj: Any) -> None:
        self.fdp, self.model = obj, obj.module

    def forward(self, x: torch.Tensor, idx: torch.Tensor, keep: bool = False) -> torch.Tensor:
        return self.fdp(x, idx)  # ``keep``: the chunked runner's (a graph still alive)

    def forward_threads(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Any]:
        """The batches through the wrapper, one thread each, started together."""
        results: list[Any] = [None] * len(batches)
        barrier = threading.Barrier(len(batches))

        def run(i: int) -> None:
            barrier.wait()
            try:
                results[i] = self.fdp(*batches[i])
            except Exception as e:  # re-raised on the caller's thread
                results[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batches))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in results:
            if isinstance(r, Exception):
                raise r
        return results

    def backward(self, loss: torch.Tensor, names: list[str] | None = None, **kw: Any) -> None:
        inputs = None if names is None else [self.param(n) for n in names]
        loss.backward(inputs=inputs, **kw)

    def grad(self, loss: torch.Tensor, names: list[str], **kw: Any) -> tuple:
        return torch.autograd.grad(loss, [self.param(n) for n in names], allow_unused=True, **kw)

    def hvp(self, gs: tuple, names: list[str], v: list[torch.Tensor]) -> tuple:
        """The gradient of ``sum(g * v)`` over ``gs`` (``grad(..., create_graph=True)``'s)."""
        return self.grad(_dot(gs, v), names)

    def no_sync(self) -> Any:
        return self.fdp.no_sync()

    def zero_grad(self, set_to_none: bool) -> None:
        self.fdp.zero_grad(set_to_none)

    def add_hook(self, name: str, fn: Any) -> None:
        self.param(name).register_hook(fn)

    def add_post_hook(self, name: str, fn: Any) -> None:
        self.param(name).register_post_accumulate_grad_hook(fn)


class Chunked(Runner):
    """DataParallel's semantics by hand (see the module docstring)."""

    def __init__(self, model: nn.Module, opt: str, devices: list[Any]) -> None:
        super().__init__(model, opt.partition("+")[0])
        self.n = len(devices)
        self.devices = [home([d]) for d in devices]  # copy i runs on devices[i], chunk 0 at home
        self.live: list[dict] = []  # each copy's parameters as its forward found them
        self.hooks: dict[str, list] = {}
        self.post_hooks: dict[str, list] = {}  # run once a backward, on the accumulated .grad

    def _whole(self) -> Any:
        return self.model

    def _replace(self, obj: Any) -> None:
        self.model, self.live = obj, []

    def forward(self, x: torch.Tensor, idx: torch.Tensor, keep: bool = False) -> torch.Tensor:
        if not keep:
            self.live = []
        chunks = list(zip(x.chunk(self.n), idx.chunk(self.n)))
        copies = [copy.deepcopy(self.model) for _ in chunks]  # all before any chunk runs
        for i, c in enumerate(copies[1:], 1):
            c.to(self.devices[i])
        outs = []
        for i, ((xc, ic), c) in enumerate(zip(chunks, copies)):
            xc, ic = xc.to(self.devices[i]), ic.to(self.devices[i])
            for p in c.parameters():
                p.grad = None
            self.live.append(dict(c.named_parameters()))
            held = {n: (t, t.data_ptr()) for n, t in _tensors(c)} if i == 0 else None
            try:
                outs.append(c(xc, ic).to(self.devices[0]))
            finally:
                if held is not None:
                    self._write_back(c, held)
        return torch.cat(outs)

    def forward_threads(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Any]:
        self.live = []
        return [self.forward(*b, keep=True) for b in batches]

    def _write_back(self, c: nn.Module, held: dict) -> None:
        """Chunk 0's in-place writes to tensors its copy still holds reach the originals; under
        no_grad, so does ``.data =`` (DataParallel's replica 0 then holds the original tensors:
        ``broadcast_coalesced`` returns its inputs for the source device)."""
        mine = dict(_tensors(self.model))
        grad = torch.is_grad_enabled()
        with torch.no_grad():
            for name, t in _tensors(c):
                if name not in held or held[name][0] is not t or name not in mine:
                    continue
                if held[name][1] == t.data_ptr():
                    if not torch.equal(mine[name], t):
                        mine[name].copy_(t)
                elif not grad:
                    mine[name].data = t.data

    def _copies_of(self, names: list[str]) -> list[list[torch.Tensor]]:
        return [[c[n] for n in names] for c in self.live]

    def _total(self, name: str, grads: list[torch.Tensor | None]) -> torch.Tensor | None:
        grads = [g.to(self.devices[0]) for g in grads if g is not None]
        if not grads:
            return None
        total = grads[0]
        for g in grads[1:]:
            total = total + g
        for owner, fn in self.hooks.get(name, []):
            if owner is self.param(name):  # load_state_dict(assign=True) drops its hooks
                total = fn(total)
        return total

    def backward(self, loss: torch.Tensor, names: list[str] | None = None, **kw: Any) -> None:
        inputs = None if names is None else [t for row in self._copies_of(names) for t in row]
        loss.backward(inputs=inputs, **kw)
        totals = {}
        for name in self.live[0] if self.live else ():
            rows = self._copies_of([name])
            totals[name] = self._total(name, [row[0].grad for row in rows])
            for row in rows:
                row[0].grad = None
        reached = any(t is not None for t in totals.values())
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                total = totals.get(name)
                if (
                    total is None
                    and reached
                    and p.requires_grad
                    and p.grad is None
                    and (names is None or name in names)
                ):
                    p.grad = torch.zeros_like(p)  # DataParallel's Broadcast: unused get zeros
                elif total is not None:
                    if p.grad is None:
                        p.grad = total.clone()
                    elif p.grad.is_sparse and not total.is_sparse:
                        p.grad = total + p.grad  # AccumulateGrad's order of layouts
                    else:
                        p.grad = p.grad + total
                    for owner, fn in self.post_hooks.get(name, []):
                        if owner is p:
                            fn(p)

    def grad(self, loss: torch.Tensor, names: list[str], **kw: Any) -> tuple:
        rows = self._copies_of(names)
        flat = torch.autograd.grad(loss, [t for row in rows for t in row], allow_unused=True, **kw)
        k = len(names)
        return tuple(
            self._total(n, [flat[r * k + j] for r in range(len(rows))]) for j, n in enumerate(names)
        )

    def hvp(self, gs: tuple, names: list[str], v: list[torch.Tensor]) -> tuple:
        return self.grad(_dot(gs, v), names)

    def no_sync(self) -> Any:
        return nullcontext()  # plain accumulation

    def zero_grad(self, set_to_none: bool) -> None:
        self.model.zero_grad(set_to_none)

    def add_hook(self, name: str, fn: Any) -> None:
        self.param(name).register_hook(fn).remove()  # raises as the wrappers' runners do
        self.hooks.setdefault(name, []).append((self.param(name), fn))

    def add_post_hook(self, name: str, fn: Any) -> None:
        self.param(name).register_post_accumulate_grad_hook(fn).remove()
        self.post_hooks.setdefault(name, []).append((self.param(name), fn))


def _dot(gs: tuple, v: list[torch.Tensor]) -> torch.Tensor:
    """``sum(g * v)`` over the gradients that exist: a Hessian-vector product's output."""
    return sum((g * w).sum() for g, w in zip(gs, v) if g is not None)


def _tensors(m: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(m.named_parameters()) + list(m.named_buffers())
