"""Loads the C++/CUDA core ``fastdp._C`` and decides, in one place, whether it is used.

``FASTDP_DISABLE_EXT=1`` forces the pure-torch path. A build that fails to import warns once with
the real error and the torch path is used; nothing else in the package catches import errors.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from types import ModuleType

import torch  # libtorch must be loaded before _C

# What the package calls on the extension: a build without one of them (a stale .so from an
# older checkout) is treated as not loaded, so no call site needs to ask.
REQUIRED = (
    "scatter_chunks",
    "gather_into",
    "tensor_signature",
    "DictSnapshot",
    "grad_fn_use_count",
    "held_data_ptrs",
    "held_changed",
    "bucket_reduce_link",
    "peer_access",
    "build_info",
)

# The dtypes every copy-like path (scatter, gather, broadcast, reduce) is proven over, bit-exact
# against its torch reference: by the doctor and by the tests.
DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.bool,
    torch.complex64,
]

_ext: ModuleType | None = None
_load_error: str | None = None
try:
    from fastdp import _C as _ext  # type: ignore[no-redef]
except ImportError as e:  # a missing or broken build
    _load_error = f"{type(e).__name__}: {e}"
else:
    _missing = [f for f in REQUIRED if not hasattr(_ext, f)]
    if _missing:
        _ext, _load_error = (
            None,
            (f"a stale build of fastdp._C lacks {', '.join(_missing)}; rebuild it"),
        )

_enabled = os.environ.get("FASTDP_DISABLE_EXT", "0") != "1"
_warned = False


def ext() -> ModuleType | None:
    """The extension module when it is loaded and enabled, else None (use the torch path)."""
    global _warned
    if _ext is None and _enabled and not _warned:
        _warned = True
        warnings.warn(
            f"fastdp: the C++ extension fastdp._C could not be loaded ({_load_error}); "
            "falling back to the pure-torch path. Reinstall with "
            "`pip install --no-build-isolation -e .` to build it.",
            RuntimeWarning,
            stacklevel=3,
        )
    return _ext if _enabled else None


def loaded() -> bool:
    """Whether the extension imported (regardless of FASTDP_DISABLE_EXT)."""
    return _ext is not None


def load_error() -> str | None:
    return _load_error


def enabled() -> bool:
    """Whether the extension is allowed (FASTDP_DISABLE_EXT unset and not disabled at run time)."""
    return _enabled


def set_enabled(flag: bool) -> bool:
    """Allow or forbid the extension for later calls; returns the previous setting."""
    global _enabled
    prev, _enabled = _enabled, bool(flag)
    return prev


@contextlib.contextmanager
def use_extension(flag: bool) -> Iterator[None]:
    """Context manager: run the enclosed code with the extension allowed or forbidden."""
    prev = set_enabled(flag)
    try:
        yield
    finally:
        set_enabled(prev)


def build_info() -> dict[str, str]:
    """The extension's build record, or {} when it is not loaded."""
    return dict(_ext.build_info()) if _ext is not None else {}
