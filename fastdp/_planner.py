"""The scatter planner: chunk sizes for every input leaf of a forward.

The C++ planner (``fastdp._C.plan_chunks``) and this Python fallback implement one contract and
are tested against each other: per leaf ``torch.chunk`` sizes (``split = ceil(size / n)``; ``n``
chunks of 0 for an empty leaf), all leaves yielding the same number of chunks or a ValueError; with
explicit ``chunk_sizes`` (one per device, non-negative) every leaf must have size
``sum(chunk_sizes)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastdp import _backend


def chunk_sizes_for(size: int, num_devices: int) -> list[int]:
    if num_devices <= 0:
        raise ValueError(f"fastdp.plan_chunks: need at least one device, got {num_devices}")
    if size < 0:
        raise ValueError(f"fastdp.plan_chunks: leaf size must be >= 0, got {size}")
    if size == 0:
        return [0] * num_devices
    split = -(-size // num_devices)
    return [min(split, size - off) for off in range(0, size, split)]


def plan_chunks_py(
    leaf_sizes: Sequence[int], num_devices: int, chunk_sizes: Sequence[int] | None = None
) -> list[list[int]]:
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
        for i, s in enumerate(leaf_sizes):
            if s != total:
                raise ValueError(
                    f"fastdp: chunk_sizes sum to {total} but input tensor {i} has batch size {s} "
                    "along the scatter dim"
                )
        return [list(chunk_sizes) for _ in leaf_sizes]
    plan: list[list[int]] = []
    for i, s in enumerate(leaf_sizes):  # leaf by leaf, so errors come in the C++ planner's order
        p = chunk_sizes_for(s, num_devices)
        plan.append(p)
        if len(p) != len(plan[0]):
            raise ValueError(
                f"fastdp: input tensors split into different numbers of chunks: tensor 0 (size "
                f"{leaf_sizes[0]}) into {len(plan[0])}, tensor {i} (size {leaf_sizes[i]}) into "
                f"{len(p)} on {num_devices} devices. DataParallel would silently drop rows; give "
                "every tensor a batch size that splits into the same number of chunks, or pass "
                "non-batched data as a non-tensor"
            )
    return plan


def plan_chunks(
    leaf_sizes: Sequence[int], num_devices: int, chunk_sizes: Sequence[int] | None = None
) -> list[list[int]]:
    ext = _backend.ext()
    if ext is not None:
        return ext.plan_chunks(list(leaf_sizes), num_devices,
                               None if chunk_sizes is None else list(chunk_sizes))
    return plan_chunks_py(leaf_sizes, num_devices, chunk_sizes)
