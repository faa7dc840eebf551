"""Cheap detection of structural changes to the modules that persistent replicas were built from.

NOTE [ Replica invalidation ]
Persistent replicas are shallow copies whose tensors are refreshed every step; they are rebuilt
when the Python objects they copied change, found without a per-step walk. Module tree, plain
attributes, ``training`` and replaced tensors change through ``nn.Module`` methods that
``install()`` wraps to bump a generation counter for watched originals (ids, dropped by a
finalizer; rebinding the object already bound bumps nothing): one int comparison per step.
Tensor identity, shape, strides, dtype, device, ``requires_grad``: a signature of the originals
(``fastdp._C.tensor_signature`` or a tuple). In-place updates need nothing (every step copies),
nor hooks (shared dicts); a replica's own writes in ``forward`` are undone at the next refresh.
Writes that bypass ``Module`` methods (``m.__dict__[k] = v``) are not seen: call
``FastDataParallel.invalidate_replicas()``.

NOTE [ Opting out of the watch ]
The wrap is process-wide: once a persistent wrapper has run a step, every ``nn.Module`` attribute
write anywhere pays one Python call and an int-set lookup (the ``module-build`` bench row: a
1000-layer model built with and without it). ``FASTDP_WATCH_MODULES=0`` (read when a wrapper is
built) leaves ``nn.Module`` untouched; wrappers then replicate afresh every step as
``nn.DataParallel`` does (``persistent=False``), since nothing would see the changes above.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from torch.nn import Module, Parameter

# Membership by id: a set lookup of an int, no weakref made per call (the wrapper runs on every
# nn.Module attribute write in the process). A finalizer drops the id when its module dies.
_watched: set[int] = set()
# replica id -> (snapshot of its __dict__ without the parameter slots, the slot names)
_snapshots: dict[int, tuple[dict, frozenset]] = {}
_hot: set[int] = set()  # the ids of both
_dirty: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_generation = 0
_lock = threading.Lock()
_installed = False

_PATCHED = ("__setattr__", "__delattr__", "add_module", "register_module", "register_parameter",
            "register_buffer", "_apply")


def enabled() -> bool:
    """Whether the watch may be installed: ``FASTDP_WATCH_MODULES=0`` opts out (see
    NOTE [ Opting out of the watch ])."""
    return os.environ.get("FASTDP_WATCH_MODULES", "1") != "0"


def installed() -> bool:
    return _installed


def generation() -> int:
    return _generation


def bump() -> None:
    global _generation
    _generation += 1


def watch(modules: Any) -> None:
    """Start watching ``modules`` (the originals of a replica set)."""
    install()
    for m in modules:
        i = id(m)
        if i not in _watched:
            _watched.add(i)
            _hot.add(i)
            weakref.finalize(m, _forget, i)


def _forget(i: int) -> None:
    """A watched module or tracked replica died: its id may be reused."""
    _watched.discard(i)
    _snapshots.pop(i, None)
    _hot.discard(i)


def track_replica(replica: Module, protected: frozenset) -> None:
    """Remember ``replica``'s attributes (minus ``protected`` slots) to restore after a step."""
    install()
    i = id(replica)
    if i not in _snapshots:
        _hot.add(i)
        weakref.finalize(replica, _forget, i)
    d = replica.__dict__
    _snapshots[i] = ({k: v for k, v in d.items() if k not in protected}, protected)


def restore_dirty() -> None:
    """Undo attribute writes made on tracked replicas since their snapshot (DataParallel's
    fresh-replica semantics)."""
    for i, r in list(_dirty.items()):
        _dirty.pop(i, None)
        entry = _snapshots.get(i)
        if entry is None:
            continue
        snap, protected = entry
        d = r.__dict__
        for k in [k for k in d if k not in snap and k not in protected]:
            del d[k]
        d.update(snap)


def has_dirty() -> bool:
    return bool(_dirty)


def _rebinds_same(module: Module, name: str, value: Any) -> bool:
    """Whether ``module.name = value`` binds the object already bound (``model.train()`` every
    step, as HF Trainer does): nothing for the replicas to see, so no rebuild."""
    d = module.__dict__
    if name in d:  # a module or parameter set here moves into _modules / _parameters
        return d[name] is value and not isinstance(value, (Module, Parameter))
    for slots in ("_parameters", "_buffers", "_modules"):
        held = d.get(slots)
        if held is not None and name in held:
            return held[name] is value
    return False


def _wrap(name: str, orig: Any) -> Any:
    # The hot methods get fixed signatures: packing *args/**kwargs was most of the cost.
    # Their parameter names are nn.Module's, for callers passing them by keyword.
    if name == "__setattr__":
        def wrapper(self, name, value):
            global _generation
            i = id(self)
            if i in _hot:  # one lookup for the common case: a module nobody watches
                if i in _watched:
                    if not _rebinds_same(self, name, value):
                        _generation += 1
                elif i in _snapshots:
                    _dirty[i] = self
            return orig(self, name, value)
    elif name == "register_parameter":
        def wrapper(self, name, param):
            global _generation
            if id(self) in _watched and not _rebinds_same(self, name, param):
                _generation += 1
            return orig(self, name, param)
    elif name in ("add_module", "register_module"):
        def wrapper(self, name, module):
            global _generation
            if id(self) in _watched and not _rebinds_same(self, name, module):
                _generation += 1
            return orig(self, name, module)
    else:
        marks_replicas = name == "__delattr__"

        def wrapper(self, *args, **kwargs):
            global _generation
            i = id(self)
            if i in _watched:
                _generation += 1
            elif marks_replicas and i in _snapshots:
                _dirty[i] = self
            return orig(self, *args, **kwargs)

    wrapper.__name__ = name
    wrapper.__qualname__ = f"Module.{name}"
    wrapper.__doc__ = orig.__doc__
    wrapper.__wrapped__ = orig
    return wrapper


def install() -> None:
    """Wrap the mutating ``nn.Module`` methods once per process (idempotent, thread-safe); a
    no-op when opted out."""
    global _installed
    if _installed or not enabled():
        return
    with _lock:
        if _installed:
            return
        for name in _PATCHED:
            setattr(Module, name, _wrap(name, getattr(Module, name)))
        _installed = True
