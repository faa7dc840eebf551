"""The doctor's kernel checks: the extension's copy kernels called directly, at real sizes.

The step's own paths short-circuit where they can (a chunk that stays on its device is a view),
so on one GPU they never launch a kernel. These checks call ``fastdp._C.scatter_chunks`` and
``gather_into`` themselves, on every visible GPU, with inputs that force a copy: host to each
GPU from pageable and pinned memory, each GPU to itself (the ``multi_copy`` kernel writing the
output's slices) and to the host, GPU 0 to every other GPU, with the pinned pool at 1 MiB, and
on a side stream whose work the kernels must follow. Each result is compared bit for bit (raw
bytes: float8 too) with torch's ``split(...).to(device)`` and ``torch.cat``.

Case sizes: every dtype at 2^20 + 3 elements (odd: a tail in every vector width), 1M-element
transposed, strided and channels_last views, and 40 MiB buffers (several staging windows, the
direct pinned path); ``quick`` shrinks them to a few KiB and 1 MiB + 3.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from fastdp import _backend
from fastdp._doctor_cases import Mismatch, gpus, need_ext, need_gpus, sync

MiB = 1 << 20


def dtypes() -> list[torch.dtype]:
    """Every dtype torch copies here (float8 where this torch has it)."""
    out = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64,
           torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
           torch.bool]
    return out + [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def _name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _fill(shape: tuple[int, ...], dt: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dt == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dt.is_complex:
        return torch.randn(shape, dtype=dt, generator=gen)
    if dt.is_floating_point:
        return torch.randn(shape, generator=gen).to(dt)
    lo, hi = (0, 256) if dt == torch.uint8 else (-128, 128)
    return torch.randint(lo, hi, shape, generator=gen, dtype=dt)


def cases(quick: bool = False) -> Iterator[tuple[str, torch.Tensor, int]]:
    """(label naming dtype, shape and layout; CPU tensor; dim)."""
    gen = torch.Generator().manual_seed(0)
    n = 4096 + 3 if quick else MiB + 3
    side = 67 if quick else 1031
    cl = 8 if quick else 64
    big = MiB + 3 if quick else 40 * MiB
    for dt in dtypes():
        yield f"{_name(dt)} ({n},)", _fill((n,), dt, gen), 0
    yield (f"float32 ({side + 4}, {side}).t() dim 1",
           _fill((side + 4, side), torch.float32, gen).t(), 1)
    yield (f"bfloat16 ({side}, {2 * side})[:, ::2] dim 0",
           _fill((side, 2 * side), torch.bfloat16, gen)[:, ::2], 0)
    x = _fill((4, cl, cl, cl), torch.float16, gen).contiguous(memory_format=torch.channels_last)
    yield f"float16 (4, {cl}, {cl}, {cl}) channels_last dim 0", x, 0
    yield f"float16 (4, {cl}, {cl}, {cl}) channels_last dim 1", x, 1
    yield f"uint8 ({big},) {big / MiB:.1f} MiB", _fill((big,), torch.uint8, gen), 0
    yield (f"float32 ({big // 4 + 3},) {big / MiB:.1f} MiB",
           _fill((big // 4 + 3,), torch.float32, gen), 0)


def big_cases(quick: bool) -> list[tuple[str, torch.Tensor, int]]:
    return [c for c in cases(quick) if "MiB" in c[0]]


def labels(quick: bool = False) -> list[str]:
    return [label for label, _, _ in cases(quick)]


def nbytes(quick: bool = False) -> int:
    return sum(t.numel() * t.element_size() for _, t, _ in cases(quick))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def same_bits(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    meta = (got.dtype, tuple(got.shape), got.device)
    if meta != (want.dtype, tuple(want.shape), want.device):
        raise Mismatch(f"{where}: got {meta}, torch gives "
                       f"{(want.dtype, tuple(want.shape), want.device)}")
    g, w = _bits(got), _bits(want)
    if not torch.equal(g, w):
        bad = (g != w).nonzero()
        raise Mismatch(f"{where}: {len(bad)} byte(s) differ, the first at byte {int(bad[0])}")


def _need(n: int) -> None:
    need_ext(cuda=n > 0)
    need_gpus(n)


def _plan(t: torch.Tensor, n: int, dim: int) -> list[int]:
    return [c.size(dim) for c in t.chunk(n, dim)]


def _pinned(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, pin_memory=True)
    return out.copy_(t)


def scatter_one(src: torch.Tensor, dim: int, devices: list[torch.device], where: str) -> None:
    plan = _plan(src, len(devices), dim)
    devices = devices[: len(plan)]  # torch.chunk may make fewer chunks than devices
    got = _backend.ext().scatter_chunks([src], [plan], dim, devices)
    want = [c.to(d) for c, d in zip(src.split(plan, dim), devices)]
    sync()
    for r, (row, w) in enumerate(zip(got, want)):
        same_bits(row[0], w, f"{where}, chunk {r}")


def gather_one(parts: list[torch.Tensor], dim: int, dest: torch.device, where: str) -> None:
    got = _backend.ext().gather_into(parts, dim, dest)
    want = torch.cat([p.to(dest) for p in parts], dim)
    sync()
    same_bits(got, want, where)


def _run(quick: bool, each: Callable[[str, torch.Tensor, int], None],
         subset: list | None = None) -> str:
    todo = list(cases(quick)) if subset is None else subset
    for label, t, dim in todo:
        each(label, t, dim)
    return f"{len(todo)} cases bit-exact vs torch ({sum(x.nbytes for _, x, _ in todo) / MiB:.0f} " \
           "MiB each way)"


def _cuda(g: int) -> torch.device:
    return torch.device("cuda", g)


def check_cpu_scatter(quick: bool) -> str:
    _need(0)
    return _run(quick, lambda lb, t, d: scatter_one(t, d, [torch.device("cpu")] * 2,
                                                    f"{lb} -> cpu"))


def check_cpu_gather(quick: bool) -> str:
    _need(0)
    return _run(quick, lambda lb, t, d: gather_one(list(t.chunk(3, d)), d, torch.device("cpu"),
                                                   f"{lb} -> cpu"))


def check_host_to_gpus(pinned: bool) -> Callable[[bool], str]:
    def run(quick: bool) -> str:
        _need(1)
        out = ""
        for g in range(gpus()):
            out = _run(quick, lambda lb, t, d, g=g: scatter_one(
                _pinned(t) if pinned else t, d, [_cuda(g)] * 2, f"{lb} -> cuda:{g}"))
        return f"every GPU ({gpus()}): {out}"
    return run


def check_gpu_gather(to_host: bool) -> Callable[[bool], str]:
    def run(quick: bool) -> str:
        _need(1)
        out = ""
        for g in range(gpus()):
            dest = torch.device("cpu") if to_host else _cuda(g)
            out = _run(quick, lambda lb, t, d, g=g, dest=dest: gather_one(
                list(t.to(_cuda(g)).chunk(3, d)), d, dest, f"{lb} cuda:{g} -> {dest}"))
        return f"every GPU ({gpus()}): {out}"
    return run


def check_gpu_to_gpus(quick: bool) -> str:
    _need(2)
    devs = [_cuda(g) for g in range(gpus())]
    out = _run(quick, lambda lb, t, d: scatter_one(t.to(devs[0]), d, devs[1:] + devs[:1],
                                                   f"{lb} cuda:0 -> {len(devs)} GPUs"))
    out = _run(quick, lambda lb, t, d: gather_one(
        [c.to(devs[k % len(devs)]) for k, c in enumerate(t.chunk(len(devs), d))], d, devs[0],
        f"{lb} {len(devs)} GPUs -> cuda:0"))
    return f"{len(devs)} GPUs both ways: {out}"


def check_small_pool(quick: bool) -> str:
    """The 40 MiB cases through a 1 MiB pinned pool: many windows, each reused in turn."""
    _need(1)
    ext = _backend.ext()
    old = ext.pinned_pool_set_capacity(MiB)
    try:
        out = ""
        for g in range(gpus()):
            out = _run(quick, lambda lb, t, d, g=g: scatter_one(
                t, d, [_cuda(g)] * 2, f"{lb} -> cuda:{g}, 1 MiB pool"), big_cases(quick))
            out = _run(quick, lambda lb, t, d, g=g: gather_one(
                list(t.to(_cuda(g)).chunk(2, d)), d, torch.device("cpu"),
                f"{lb} cuda:{g} -> cpu, 1 MiB pool"), big_cases(quick))
    finally:
        ext.pinned_pool_set_capacity(old)
    return f"pinned pool 1 MiB, every GPU ({gpus()}), both ways: {out}"


def check_side_stream(quick: bool) -> str:
    """Kernels on the caller's current (side) stream: behind a slow producer on that stream,
    ahead of its consumer, while the device's default stream is held busy."""
    _need(1)
    ext = _backend.ext()
    label, t, dim = big_cases(quick)[-1]
    for g in range(gpus()):
        dev = _cuda(g)
        src = t.to(dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))  # src is complete on the side stream
        with torch.cuda.device(dev), torch.cuda.stream(side):
            torch.cuda._sleep(int(5e7))  # the producer is slow: the kernels must wait for it
            x = src * 1
            on_dev = ext.gather_into(list(x.chunk(3, dim)), dim, dev)
            host = ext.gather_into(list(x.chunk(3, dim)), dim, torch.device("cpu"))
            with torch.cuda.stream(torch.cuda.default_stream(dev)):
                torch.cuda._sleep(int(5e7))  # a kernel on the default stream would lag
            up = ext.scatter_chunks([t], [_plan(t, 2, dim)], dim, [dev, dev])
            up_cat = torch.cat([row[0] for row in up], dim)
            ok = [torch.equal(_bits(on_dev), _bits(src)), torch.equal(_bits(up_cat), _bits(src))]
        sync()
        same_bits(host, t, f"{label} cuda:{g} -> cpu on a side stream")
        if not all(ok):
            raise Mismatch(f"{label} on cuda:{g}: a kernel did not follow the side stream "
                           f"(gather in place {ok[0]}, scatter from the host {ok[1]})")
    return f"every GPU ({gpus()}): {label} gathered and scattered on a side stream, in order"


def plan() -> list[tuple[str, Callable[[bool], str]]]:
    """(name, check(quick)): the CPU cases first, then the GPU ones."""
    return [
        ("kernels scatter pageable -> cpu", check_cpu_scatter),
        ("kernels gather cpu -> cpu", check_cpu_gather),
        ("kernels scatter pageable -> every GPU", check_host_to_gpus(pinned=False)),
        ("kernels scatter pinned -> every GPU", check_host_to_gpus(pinned=True)),
        ("kernels gather each GPU -> itself", check_gpu_gather(to_host=False)),
        ("kernels gather each GPU -> cpu", check_gpu_gather(to_host=True)),
        ("kernels cuda:0 <-> all GPUs", check_gpu_to_gpus),
        ("kernels 1 MiB pinned pool", check_small_pool),
        ("kernels side stream", check_side_stream),
    ]
