"""Modules that are also functions: ``fastdp.info`` and ``fastdp.doctor``.

``fastdp.info`` and ``fastdp.doctor`` are functions of the package and modules of the same name
(``python -m fastdp.info``). Importing a submodule binds it on its package, so after ``import
fastdp.info`` the name would be the module and ``fastdp.info()`` would raise ``TypeError``.
Each such module calls ``callable_module(__name__, function)``: the module itself becomes callable,
so the name works both ways whichever was imported first.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any


def callable_module(name: str, function: Callable[..., Any]) -> None:
    """Make the module ``name`` callable as ``function`` (the module docstring)."""

    class _CallableModule(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs)

    _CallableModule.__call__.__doc__ = function.__doc__
    sys.modules[name].__class__ = _CallableModule
