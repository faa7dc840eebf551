"""``fastdp.install()``: ``torch.nn.DataParallel`` becomes FastDataParallel, for code that builds
``nn.DataParallel`` itself (HF Trainer, sentence-transformers, TRL) and cannot be edited.

``install(**defaults)`` replaces ``torch.nn.DataParallel``, ``torch.nn.parallel.DataParallel`` and
``torch.nn.parallel.data_parallel.DataParallel`` with one subclass of FastDataParallel whose
constructor fills in ``defaults`` for the arguments its caller did not pass (``device_ids=['cpu']
* 2`` runs a multi-GPU script's replicas on the CPU). Its ``isinstance``/``issubclass`` checks
are torch's DataParallel's, so every DataParallel and FastDataParallel still passes them.
Calls nest (each ``uninstall()``, or leaving the context manager form, undoes the latest; the
newest defaults apply) and are serialised by a lock.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

import torch.nn
import torch.nn.parallel

from fastdp.data_parallel import FastDataParallel

__all__ = ["install", "uninstall", "installed"]

# the module, not torch.nn.parallel's data_parallel function of the same name
_dp_module = importlib.import_module("torch.nn.parallel.data_parallel")
_ORIGINAL = _dp_module.DataParallel
_HOMES = (torch.nn, torch.nn.parallel, _dp_module)
_lock = threading.Lock()
_stack: list[tuple[type, ...]] = []  # what each install() replaced, for uninstall()


class _ChecksAsDataParallel(type(FastDataParallel)):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _ORIGINAL)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _ORIGINAL)


def _installed_class(defaults: dict[str, Any]) -> type:
    class DataParallel(FastDataParallel, metaclass=_ChecksAsDataParallel):
        """``torch.nn.DataParallel`` under ``fastdp.install``: FastDataParallel with defaults."""

        fastdp_defaults = dict(defaults)
        fastdp_built = 0  # wrappers built (subclasses included): fastdp.run reports none

        def __init__(
            self,
            module: Any,
            device_ids: Any = None,
            output_device: Any = None,
            dim: int = 0,
            **kwargs: Any,
        ) -> None:
            opts = {**self.fastdp_defaults, **kwargs}
            if device_ids is None:
                device_ids = opts.pop("device_ids", None)
            else:
                opts.pop("device_ids", None)
            if output_device is None:
                output_device = opts.pop("output_device", None)
            else:
                opts.pop("output_device", None)
            super().__init__(module, device_ids, output_device, dim, **opts)
            DataParallel.fastdp_built += 1

    DataParallel.__qualname__ = DataParallel.__name__ = "DataParallel"
    DataParallel.__module__ = "fastdp.install"
    return DataParallel


class _Installation:
    """What ``install()`` returns: also a context manager that uninstalls on exit."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def __enter__(self) -> type:
        return self.cls

    def __exit__(self, *exc: Any) -> None:
        uninstall()


def install(**defaults: Any) -> _Installation:
    """Make ``torch.nn.DataParallel`` FastDataParallel with ``defaults`` (any FastDataParallel
    keyword: ``device_ids``, ``launch``, ``scalar_outputs``, ...). See the module docstring."""
    cls = _installed_class(defaults)
    with _lock:
        _stack.append(tuple(home.DataParallel for home in _HOMES))
        for home in _HOMES:
            home.DataParallel = cls
    return _Installation(cls)


def uninstall() -> None:
    """Undo the latest ``install()`` (all of them: ``while installed(): uninstall()``)."""
    with _lock:
        if not _stack:
            return
        for home, old in zip(_HOMES, _stack.pop()):
            home.DataParallel = old


def installed() -> bool:
    """Whether ``torch.nn.DataParallel`` is fastdp's now."""
    return torch.nn.DataParallel is not _ORIGINAL
