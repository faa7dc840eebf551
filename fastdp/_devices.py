"""Device normalisation shared by the wrapper, replicate and the launch.

Internally every device is a ``torch.device`` with an explicit index for CUDA; the public
attributes of FastDataParallel keep DataParallel's form (ints for CUDA ids) so user code reading
them still works.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def as_device(x: Any) -> torch.device:
    """``0``, ``'cuda:0'``, ``torch.device('cuda', 0)``, ``'cuda'`` (current), ``'cpu'``, ``-1``."""
    if isinstance(x, torch.device):
        dev = x
    elif isinstance(x, int):
        dev = torch.device("cpu") if x == -1 else torch.device("cuda", x)
    elif isinstance(x, str):
        dev = torch.device(x)
    else:
        raise TypeError(f"fastdp: cannot interpret {x!r} ({type(x).__name__}) as a device")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(
            f"fastdp: device type {dev.type!r} is not supported (use CUDA ids or 'cpu')"
        )
    return dev


def as_devices(xs: Sequence[Any]) -> list[torch.device]:
    devs = [as_device(x) for x in xs]
    kinds = {d.type for d in devs}
    if len(kinds) > 1:
        raise ValueError(
            f"fastdp: device_ids mixes CPU and CUDA devices ({[str(d) for d in devs]}); "
            "use all CUDA ids (e.g. [0, 1]) or all CPU (e.g. ['cpu', 'cpu'])"
        )
    return devs


def public_id(dev: torch.device) -> int | torch.device:
    """DataParallel's public form: the CUDA index as an int, the CPU as torch.device('cpu')."""
    return dev.index if dev.type == "cuda" else dev
