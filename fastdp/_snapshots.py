"""How persistent replicas see that their module changed, without wrapping ``nn.Module``."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from itertools import chain
from typing import Any

from torch.nn import Module

from fastdp import _backend


# NOTE [ Replica invalidation ]
# Persistent replicas hold shallow copies of the originals' dicts, rebuilt when those changed: each
# step compares, by identity, every key and value of the originals' ``__dict__``, ``_parameters``,
# ``_buffers`` and ``_modules`` with a snapshot (``DictSnapshot``: held references, so no address is
# reused; C++ with the extension), which sees plain attributes, ``training``, the tree and replaced
# tensors however written (``m.__dict__[k] = v`` too), and rebinding what is already bound
# (``model.train()`` each step) as no change; tensor identity, storage, shape, strides, dtype,
# device, ``requires_grad``: ``tensor_signature``. Unseen: changes inside a held object (a list
# appended to): ``FastDataParallel.invalidate_replicas()``. In-place tensor updates need nothing
# (every step copies), nor hooks (the replicas share the hook dicts).
class _PyDictSnapshot:
    """``fastdp._C.DictSnapshot`` without the extension (same contract): one pass over all the
    entries at C speed (``map``), per dict only when something changed."""

    def __init__(self, dicts: list[dict]) -> None:
        if not all(isinstance(d, dict) for d in dicts):
            raise TypeError("DictSnapshot takes a list of dicts")
        self.dicts = dicts
        self.sizes = list(map(len, dicts))
        # Where the sizes are unchanged, the dicts empty at the snapshot are still empty: the
        # passes over entries skip them (most ``_buffers`` and leaves' ``_modules``)
        self.full = [d for d in dicts if d]
        self.keys = tuple(chain.from_iterable(dicts))
        self.values = tuple(chain.from_iterable(map(dict.values, dicts)))
        # Keys compare by ``==`` (equal keys are the same key; a list compare runs in C, twice
        # the speed of ``is`` pairs); values by identity (``==`` can say equal for new objects)
        self.full_keys = list(chain.from_iterable(self.full))

    def changed(self) -> list[int]:
        if (
            list(map(len, self.dicts)) == self.sizes
            and self._same_keys()
            and all(
                map(operator.is_, chain.from_iterable(map(dict.values, self.full)), self.values)
            )
        ):
            return []
        out, start = [], 0
        for i, (d, n) in enumerate(zip(self.dicts, self.sizes)):
            keys, values = self.keys[start : start + n], self.values[start : start + n]
            start += n
            if (
                len(d) != n
                or not all(map(operator.is_, d, keys))
                or not all(map(operator.is_, d.values(), values))
            ):
                out.append(i)
        return out

    def _same_keys(self) -> bool:
        try:
            return list(chain.from_iterable(self.full)) == self.full_keys
        except Exception:  # a key type whose ``==`` raises: the pass below compares by identity
            return False

    def __len__(self) -> int:
        return len(self.dicts)


def snapshot(dicts: list[dict]) -> Any:
    """A ``DictSnapshot`` of ``dicts``: ``changed()`` lists the indices that changed since."""
    ext = _backend.ext()
    return ext.DictSnapshot(dicts) if ext is not None else _PyDictSnapshot(dicts)


def module_dicts(modules: Iterable[Module]) -> list[dict]:
    """The dicts whose entries are a module's state: attributes, parameters, buffers, children."""
    out = []
    for m in modules:
        d = m.__dict__
        out.append(d)
        out.extend(
            d[k] for k in ("_parameters", "_buffers", "_modules") if isinstance(d.get(k), dict)
        )  # TorchScript modules hold wrappers
    return out


class ReplicaAttrs:
    """DataParallel's replicas are fresh each step, so what a forward writes on one (``self.x =
    ...``, ``del self.y``, a buffer, parameter or submodule reassigned) is gone by the next.
    Persistent replicas get the same: every dict of ``module_dicts`` is saved at build and
    written back where a step changed it; the set then points its slots at its tensors again
    (the saved values of those slots may be older than the set's tensors)."""

    def __init__(self, replicas: list[Module]) -> None:
        self.dicts = module_dicts(replicas)
        self.saved = [dict(d) for d in self.dicts]
        self.snap: Any = None  # taken by seal(): what the next step's forward starts from

    def undo_forward_writes(self) -> bool:
        """Restore what a forward wrote since ``seal()``; True if anything was restored (the
        caller re-points its slots). Call before writing to the replicas."""
        if self.snap is None:
            return False
        changed = self.snap.changed()
        for i in changed:
            d = self.dicts[i]
            d.clear()
            d.update(self.saved[i])
        if changed:
            self.snap = None
        return bool(changed)

    def seal(self) -> None:
        """The replicas are as the set wants them to start a step."""
        if self.snap is None:
            self.snap = snapshot(self.dicts)
