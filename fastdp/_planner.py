"""The scatter planner: chunk sizes for every input leaf of a forward, DataParallel's rules.

NOTE [ DataParallel's chunking ]
Each tensor leaf is chunked as ``torch.chunk`` chunks it (``split = ceil(size / n)``, so a leaf
may yield fewer than ``n`` chunks; ``n`` chunks of 0 for an empty leaf). As DataParallel's
``scatter`` ``zip``s its containers, the step runs as many replicas as the leaf with the fewest
chunks has: the other leaves' extra chunks (their last rows) are dropped. HF Trainer relies on it
(``num_items_in_batch`` has one row per GPU, so a partial last batch drops its spare rows). The
wrapper warns once naming the dropped leaves, or raises with ``strict_chunks=True``. With explicit
``chunk_sizes`` (one per device) leaves of size ``sum(chunk_sizes)`` take them; others are chunked
by ``torch.chunk`` over as many devices and truncated the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fastdp import balance
from fastdp._devices import public_id


def chunk_sizes_for(size: int, num_devices: int) -> list[int]:
    """``torch.chunk``'s sizes for one leaf of ``size`` rows over ``num_devices``."""
    if num_devices <= 0:
        raise ValueError(f"fastdp.plan_chunks: need at least one device, got {num_devices}")
    if size < 0:
        raise ValueError(f"fastdp.plan_chunks: leaf size must be >= 0, got {size}")
    if size == 0:
        return [0] * num_devices
    split = -(-size // num_devices)
    return [min(split, size - off) for off in range(0, size, split)]


def plan_chunks(
    leaf_sizes: Sequence[int], num_devices: int, chunk_sizes: Sequence[int] | None = None
) -> list[list[int]]:
    """Chunk sizes per leaf (NOTE [ DataParallel's chunking ]): all of one length, the fewest
    chunks any leaf has; ``dropped(leaf_sizes, plan)`` says which leaves lose rows."""
    if chunk_sizes is not None:
        if len(chunk_sizes) != num_devices:
            raise ValueError(
                f"fastdp: chunk_sizes has {len(chunk_sizes)} entries but there are "
                f"{num_devices} devices"
            )
        for c in chunk_sizes:
            if c < 0:
                raise ValueError(f"fastdp: chunk_sizes must be non-negative, got {c}")
        total = sum(chunk_sizes)
        plan = [
            list(chunk_sizes) if s == total else chunk_sizes_for(s, num_devices) for s in leaf_sizes
        ]
    else:
        plan = [chunk_sizes_for(s, num_devices) for s in leaf_sizes]
    if plan:
        k = min(len(p) for p in plan)
        plan = [p if len(p) == k else p[:k] for p in plan]
    return plan


def dropped(leaf_sizes: Sequence[int], plan: Sequence[Sequence[int]]) -> list[int]:
    """Indices of the leaves whose planned chunks do not cover all their rows."""
    return [i for i, (s, p) in enumerate(zip(leaf_sizes, plan)) if sum(p) != s]


@dataclass(slots=True)
class StepPlan:
    """One forward's decisions, made once before the scatter and read by every stage after it."""

    ctx: Any  # the torch.compile context replicas run under (None: eager)
    devices: list[torch.device]  # the devices that get rows, in replica order
    ids: list[Any]  # their ids as the seams take them (the wrapper's own list when not custom)
    sizes: list[int] | None = None  # rows per device (chunk_sizes/balance); None: torch.chunk's
    batch: int | None = None  # the first input's rows, where sizes or Scattered need it
    direct: bool = False  # the module runs itself: no accelerator, or one CPU device
    custom: bool = False  # devices/sizes differ from the wrapper's defaults
    verified: Any = None  # NOTE [ One signature per step ] in fastdp/data_parallel.py

    def split(self) -> dict[str, Any]:
        """The scatter's keyword for the chunk sizes (none: torch.chunk's)."""
        return {} if self.sizes is None else {"chunk_sizes": self.sizes}

    def rows(self, n: int) -> list[int] | None:
        """Rows of the first ``n`` replicas (None when no tensor input fixed them)."""
        if self.sizes is not None:
            return self.sizes[:n]
        return None if self.batch is None else chunk_sizes_for(self.batch, len(self.devices))[:n]


def make_plan(
    wrapper: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any], ctx: Any, verified: Any = None
) -> StepPlan:
    """The plan of one ``FastDataParallel`` forward: devices, chunk sizes, context."""
    devices: list[torch.device] = wrapper._devices if wrapper.device_ids else []
    sizes, used, batch = None, devices, None
    if (
        wrapper.chunk_sizes is not None or wrapper.balance is not None or not wrapper.gather_output
    ):  # [beyond DP] the devices that get rows, and how many
        batch = balance.first_batch_size((inputs, kwargs), wrapper.dim)
        if devices:
            used, sizes = balance.plan_devices(
                devices, batch, wrapper.dim, wrapper.chunk_sizes, wrapper.balance
            )
    custom = sizes is not None or len(used) != len(devices)
    ids = [public_id(d) for d in used] if custom else wrapper.device_ids
    direct = not devices or (len(devices) == 1 and devices[0].type == "cpu")
    return StepPlan(ctx, used, ids, sizes, batch, direct, custom, verified)
