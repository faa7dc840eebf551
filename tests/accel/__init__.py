"""A multi-device test accelerator for torch, on its PrivateUse1 extension points.

``enable(devices, asynchronous)`` builds the C++ in ``csrc/`` once (cached under ``build_dir()``),
registers it and returns its device type name: ``torch.device(name, i)`` for ``i < devices``,
``torch.accelerator``, ``torch.Stream`` and ``torch.Event`` then work on it. Its memory is host
memory tagged with a device; ops without a kernel of their own run on the host through a CPU
fallback; an op on tensors of two devices raises, as on CUDA. With ``asynchronous=True``, copies
land on their stream's queue and run only when something waits for them (the lazy streams of
``csrc/runtime.h``), so a missing stream or event wait reads stale memory (fresh memory is NaN).

Registration changes torch's process-wide state (the current accelerator, pinned memory, the
autograd engine's device threads), so a process that enables it runs only tests written for it:
``python -m pytest tests/accel`` (tests/conftest.py leaves it out of a run of the whole suite).
Enable it before the process's first backward: autograd sizes its device threads then.
"""

from __future__ import annotations

import os
import types

import torch

NAME = "fdpaccel"
_HERE = os.path.dirname(os.path.abspath(__file__))
_enabled: dict[str, int] = {}


def build_dir() -> str:
    """Where the extension is built and cached: ``FASTDP_ACCEL_BUILD``, or
    ``tests/accel/build/<torch version>`` (one build per torch a checkout is tested with)."""
    default = os.path.join(_HERE, "build", torch.__version__.replace("+", "-"))
    return os.environ.get("FASTDP_ACCEL_BUILD", default)


def _load() -> None:
    from torch.utils.cpp_extension import load

    os.makedirs(build_dir(), exist_ok=True)
    load(
        name="fdpaccel_ext",
        sources=[os.path.join(_HERE, "csrc", "accel.cpp")],
        extra_include_paths=[os.path.join(_HERE, "csrc")],
        extra_cflags=["-O1"],
        build_directory=build_dir(),
        is_python_module=False,
        verbose=bool(os.environ.get("FASTDP_ACCEL_VERBOSE")),
    )


def _index(device: int | str | torch.device | None) -> int:
    if device is None:
        return int(torch.ops.fdpaccel.current_device())
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != NAME:
        raise ValueError(f"expected a {NAME} device, got {device}")
    return int(torch.ops.fdpaccel.current_device()) if device.index is None else device.index


def _device_module() -> types.ModuleType:
    """``torch.<name>``: what torch.accelerator, autocast and torch.manual_seed ask of a backend."""
    ops = torch.ops.fdpaccel
    mod = types.ModuleType(f"torch.{NAME}")

    def device_count() -> int:
        return int(ops.device_count())

    def current_device() -> int:
        return int(ops.current_device())

    def set_device(device: int | str | torch.device) -> None:
        ops.set_device(_index(device))

    def synchronize(device: int | str | torch.device | None = None) -> None:
        ops.synchronize(_index(device))

    def memory_allocated(device: int | str | torch.device | None = None) -> int:
        return int(ops.memory_allocated(_index(device)))

    def manual_seed_all(seed: int) -> None:
        """Random ops run on the host with the CPU's generator, which torch.manual_seed seeds."""

    for fn in (device_count, current_device, set_device, synchronize, memory_allocated):
        setattr(mod, fn.__name__, fn)
    mod.is_available = lambda: True
    mod.is_initialized = lambda: True
    mod._is_in_bad_fork = lambda: False
    mod.manual_seed_all = manual_seed_all
    mod.manual_seed = manual_seed_all
    mod.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]
    return mod


def enable(devices: int = 3, asynchronous: bool = False) -> str:
    """Builds (once, cached), registers and configures the test device; returns its type name.

    Args:
        devices: how many devices it has; fixed by the process's first call.
        asynchronous: queue copies on their streams until waited for (a later call may switch;
            every stream is drained first).
    """
    if not _enabled:
        taken = torch._C._get_privateuse1_backend_name()
        if taken not in ("privateuseone", NAME):
            raise RuntimeError(f"PrivateUse1 is already the {taken!r} backend in this process")
        _load()
    torch.ops.fdpaccel.configure(devices, asynchronous)
    if not _enabled:
        torch.utils.rename_privateuse1_backend(NAME)
        torch._register_device_module(NAME, _device_module())
        torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
        _enabled["devices"] = devices
    return NAME


def pending(device: int, stream_id: int = 0) -> int:
    """How many tasks of a stream have not run yet (always 0 when synchronous)."""
    return int(torch.ops.fdpaccel.pending(device, stream_id))
