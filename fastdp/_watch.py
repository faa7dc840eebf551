"""Cheap detection of structural changes to the modules that persistent replicas were built from.

NOTE [ Replica invalidation ]
Persistent replicas are shallow copies of the original modules (``_replicate_for_data_parallel``)
whose tensors are refreshed every step. They go stale when the *Python objects* they copied change,
and must then be rebuilt. The kinds of change, and what catches each, without a per-step walk:

* Module tree, plain attributes, ``training`` flags, parameters/buffers replaced by assignment
  (``model.module.scale = 3.0``, ``model.eval()``, ``seq.append(m)``, ``register_buffer``,
  ``load_state_dict(assign=True)``, ``.to()``/``.half()``/``.double()``): every such change goes
  through ``nn.Module.__setattr__``, ``__delattr__``, ``add_module``/``register_module``,
  ``register_parameter``, ``register_buffer`` or ``_apply``. ``install()`` wraps those methods once
  per process to bump a global generation counter when the module is *watched* (an original that
  some replica set was built from; membership is a WeakSet, so nothing leaks and pickles are
  untouched). Replicas are never watched, so attributes set inside ``forward`` do not count.
  Check per step: one integer comparison.
* Tensor identity, shape, strides, dtype, device, ``requires_grad`` of the originals
  (``p.requires_grad_(False)``, ``p.data = ...``, swapped tensors): a signature of the cached
  parameter and buffer list, computed by one C++ call (``fastdp._C.tensor_signature``) or a tuple
  in Python when the extension is off. Per step: O(P) in C++, O(1) Python calls.
* In-place updates (optimizer steps, ``weight.mul_()``, ``load_state_dict``'s ``copy_``): seen
  because every step copies the originals into the replicas.
* Hooks need nothing: replicas share the original modules' hook dicts (shallow ``__dict__`` copy).

* Attributes that a replica's own ``forward`` sets (``self.calls += 1``, caches): DataParallel
  starts every step from fresh copies, so such writes never outlive a step. Replicas are tracked
  with a snapshot of their ``__dict__``; the wrapped ``__setattr__``/``__delattr__`` mark a tracked
  replica dirty, and the next refresh restores only the dirty ones.

Not seen: writes that bypass ``Module`` methods (``module.__dict__[k] = v``,
``module._modules[k] = m`` directly); call ``FastDataParallel.invalidate_replicas()`` after those.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from torch.nn import Module

_watched: weakref.WeakSet = weakref.WeakSet()
# replica -> (snapshot of its __dict__ without the parameter slots, the slot names)
_snapshots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_dirty: weakref.WeakSet = weakref.WeakSet()
_generation = 0
_lock = threading.Lock()
_installed = False

_PATCHED = ("__setattr__", "__delattr__", "add_module", "register_module", "register_parameter",
            "register_buffer", "_apply")


def generation() -> int:
    return _generation


def bump() -> None:
    global _generation
    _generation += 1


def watch(modules: Any) -> None:
    """Start watching ``modules`` (the originals of a replica set)."""
    install()
    for m in modules:
        _watched.add(m)


def track_replica(replica: Module, protected: frozenset) -> None:
    """Remember ``replica``'s attributes (minus ``protected`` slots) to restore after a step."""
    install()
    d = replica.__dict__
    _snapshots[replica] = ({k: v for k, v in d.items() if k not in protected}, protected)


def restore_dirty() -> None:
    """Undo attribute writes made on tracked replicas since their snapshot (DataParallel's
    fresh-replica semantics)."""
    for r in list(_dirty):
        _dirty.discard(r)
        entry = _snapshots.get(r)
        if entry is None:
            continue
        snap, protected = entry
        d = r.__dict__
        for k in [k for k in d if k not in snap and k not in protected]:
            del d[k]
        d.update(snap)


def has_dirty() -> bool:
    return bool(_dirty)


def _wrap(name: str, orig: Any) -> Any:
    marks_replicas = name in ("__setattr__", "__delattr__")

    def wrapper(self, *args, **kwargs):
        global _generation
        try:
            if self in _watched:
                _generation += 1
            elif marks_replicas and self in _snapshots:
                _dirty.add(self)
        except TypeError:  # an unhashable module subclass cannot be watched (never cached)
            pass
        return orig(self, *args, **kwargs)

    wrapper.__name__ = name
    wrapper.__qualname__ = f"Module.{name}"
    wrapper.__doc__ = orig.__doc__
    wrapper.__wrapped__ = orig
    return wrapper


def install() -> None:
    """Wrap the mutating ``nn.Module`` methods once per process (idempotent, thread-safe)."""
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        for name in _PATCHED:
            setattr(Module, name, _wrap(name, getattr(Module, name)))
        _installed = True
