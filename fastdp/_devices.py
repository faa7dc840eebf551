"""Device normalisation shared by the wrapper, replicate and the launch.

Internally every device is a ``torch.device`` with an explicit index for an accelerator; the
public attributes of FastDataParallel keep DataParallel's form (ints for accelerator ids) so user
code reading them still works. The accelerator is CUDA when CUDA is available, else torch's
current accelerator (``torch.accelerator``: XPU, MPS, a PrivateUse1 backend); an int id is one of
its devices, and with no accelerator at all a CUDA id, as in DataParallel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def accelerator_type() -> str | None:
    """``"cuda"`` when CUDA is available, else torch's current accelerator's type, else None."""
    if torch.cuda.is_available():
        return "cuda"
    acc = torch.accelerator.current_accelerator()  # a CUDA build says cuda with no GPU too
    if acc is None or acc.type in ("cpu", "cuda") or torch.accelerator.device_count() == 0:
        return None
    return acc.type


def as_device(x: Any) -> torch.device:
    """``0``, ``'cuda:0'``, ``torch.device('cuda', 0)``, ``'cuda'`` (current), ``'cpu'``, ``-1``;
    on another accelerator its ids the same way (``0``, ``'xpu:0'``, ``'xpu'``)."""
    if isinstance(x, torch.device):
        dev = x
    elif isinstance(x, int):
        dev = torch.device("cpu") if x == -1 else torch.device(accelerator_type() or "cuda", x)
    elif isinstance(x, str):
        dev = torch.device(x)
    else:
        raise TypeError(f"fastdp: cannot interpret {x!r} ({type(x).__name__}) as a device")
    if dev.type in ("cpu", "cuda"):
        if dev.type == "cuda" and dev.index is None:
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
            dev = torch.device("cuda", index)
        return dev
    if dev.type != accelerator_type():
        raise ValueError(
            f"fastdp: device type {dev.type!r} is not supported (use ids of the accelerator, "
            f"{accelerator_type() or 'cuda'!r}, or 'cpu')"
        )
    if dev.index is None:
        dev = torch.device(dev.type, torch.accelerator.current_device_index())
    return dev


def as_devices(xs: Sequence[Any]) -> list[torch.device]:
    devs = [as_device(x) for x in xs]
    kinds = {d.type for d in devs}
    if len(kinds) > 1:
        raise ValueError(
            f"fastdp: device_ids mixes CPU and {(accelerator_type() or 'cuda').upper()} devices "
            f"({[str(d) for d in devs]}); use all accelerator ids (e.g. [0, 1]) or all CPU (e.g. "
            "['cpu', 'cpu'])"
        )
    return devs


def public_id(dev: torch.device) -> int | torch.device:
    """DataParallel's public form: an accelerator's index as an int, the CPU as
    torch.device('cpu')."""
    return dev if dev.type == "cpu" else dev.index


def current_stream(device: torch.device) -> Any:
    """The calling thread's current stream of ``device`` (None on the CPU): ``torch.cuda``'s on
    CUDA, ``torch.accelerator``'s on any other accelerator."""
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        return torch.cuda.current_stream(device)
    return torch.accelerator.current_stream(device)


def use_stream(stream: Any) -> Any:
    """A context in which ``stream`` (and its device) is current on the calling thread."""
    return torch.cuda.stream(stream) if stream.device.type == "cuda" else stream


def new_stream(device: torch.device) -> Any:
    """A stream of its own on an accelerator device."""
    if device.type == "cuda":
        return torch.cuda.Stream(device)
    return torch.Stream(device=device)


def new_event(device: torch.device) -> Any:
    """An event to record on a stream of ``device`` (an accelerator's)."""
    return torch.cuda.Event() if device.type == "cuda" else torch.Event(device=device)


_NO_RECORD_STREAM: set[str] = set()


def record_stream(t: torch.Tensor, stream: Any) -> bool:
    """``t.record_stream(stream)``: its memory is not reused before ``stream``'s work queued so
    far ran. False on an accelerator without it (the caller then holds ``t`` until an event
    recorded on ``stream`` completes)."""
    kind = t.device.type
    if kind in _NO_RECORD_STREAM:
        return False
    try:
        t.record_stream(stream)
    except NotImplementedError:
        if kind == "cuda":
            raise
        _NO_RECORD_STREAM.add(kind)
        return False
    return True
