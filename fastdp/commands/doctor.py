"""``python -m fastdp doctor``: prove this machine's fastdp paths, one line per check.

The first thing to run on a new machine. Every extension path (scatter from pageable, pinned and
device memory; gather to a device and to the CPU; coalesced broadcast and reduce; the persistent
replica refresh) is run on a small matrix of inputs (every dtype incl. bf16/bool/complex,
non-contiguous, channels_last, 0/1/odd sizes, dims 0/1/-1) and compared bit for bit with torch's
own path; the ``kernels ...`` checks call the extension's copy kernels directly on every visible
GPU at real sizes (the step's own paths short-circuit where they can, so on one GPU they never
launch one): host to each GPU from pageable and pinned memory, each GPU to itself and to the
host, GPU 0 to every other GPU, through a 1 MiB pinned pool and on a side stream (``--quick``
shrinks the cases: ``_doctor_cases.py``); then the P2P matrix, NCCL across all visible GPUs,
and a 3-step training parity of FastDataParallel against ``nn.DataParallel`` and the plain module,
on ``[0, 0]`` and on all GPUs. Without a GPU the CPU checks run and the GPU ones SKIP saying why.

Prints a table (PASS / FAIL / SKIP and why) and exits 1 on any FAIL, naming the environment switch
that avoids the failing path (``FASTDP_P2P=0``, ``FASTDP_DISABLE_EXT=1``). ``--json FILE`` writes
the same as ``fastdp.doctor()`` returns.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

import fastdp.comm as comm
from fastdp import _backend, _buckets
from fastdp._devices import as_device
from fastdp.commands._doctor_cases import (
    AVOID_EXT,
    MiB,
    Mismatch,
    Skip,
    big_kernel_cases,
    bits,
    cases,
    ext_vs_torch,
    gpus,
    kernel_cases,
    kernel_labels,
    make,
    need_ext,
    need_gpus,
    same,
    same_bits,
    sync,
)
from fastdp.commands.info import accelerator_line, info

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
AVOID_P2P = "FASTDP_P2P=0"
_GPUS_NEEDED = {"cpu": 0, "[0,0]": 1, "all": 2}

# The checks: each returns its PASS text or raises Skip/Mismatch.


def check_extension() -> str:
    build = _backend.build_info()
    if not _backend.enabled():
        raise Skip(f"disabled by {AVOID_EXT}")
    if not _backend.loaded():
        raise Mismatch(
            f"fastdp._C failed to import ({_backend.load_error()}): every stage falls "
            "back to torch; rebuild with `pip install --no-build-isolation -e .`"
        )
    cuda = build.get("built_with_cuda") == "1"
    if gpus() and not cuda:
        raise Mismatch(
            "CPU-only build on a machine with GPUs: CUDA copies fall back to torch; "
            "rebuild where nvcc and a CUDA torch are present"
        )
    return f"loaded, {'CUDA ' + build.get('cuda_version', '') if cuda else 'CPU-only'} build"


def _source(t: torch.Tensor, where: str) -> torch.Tensor:
    """`t` (layout kept) on the CPU ('pageable'), in pinned memory ('pinned') or on cuda:0."""
    if where == "pageable":
        return t
    if where == "pinned":
        out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, pin_memory=True)
    else:
        out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cuda:0")
    out.copy_(t.conj() if t.is_conj() else t)  # the bits under a conj view, then the same view
    return out.conj() if t.is_conj() else out


def _devices(kind: str) -> list:
    return {"cpu": ["cpu"] * 3, "[0,0]": [0, 0], "all": list(range(gpus()))}[kind]


def _need_ext_on(kind: str) -> None:
    need_gpus(_GPUS_NEEDED[kind])
    need_ext(cuda=kind != "cpu")


def scatter_check(where: str, kind: str) -> Callable[[], str]:
    def run() -> str:
        _need_ext_on(kind)
        devs, n = _devices(kind), 0
        for label, t, dim in cases():
            src = _source(t, where)
            ext_vs_torch(
                lambda src=src, dim=dim: comm.scatter(src, devs, dim=dim), f"{label} -> {devs}"
            )
            n += 1
        return f"{n} cases bit-exact vs torch"

    return run


def gather_check(kind: str, dest: str) -> Callable[[], str]:
    def run() -> str:
        _need_ext_on(kind)
        n = 0
        for label, t, dim in cases():
            with _backend.use_extension(False):
                parts = comm.scatter(
                    _source(t, "pageable" if kind == "cpu" else "cuda"), _devices(kind), dim=dim
                )
            ext_vs_torch(
                lambda parts=parts, dim=dim: comm.gather(parts, dim, dest), f"{label} -> {dest}"
            )
            n += 1
        return f"{n} cases bit-exact vs torch"

    return run


# The kernel checks: fastdp._C's scatter_chunks and gather_into called directly on inputs that
# force a copy, each result compared byte for byte with torch's split(...).to() and torch.cat.


def _need_kernels(n_gpus: int) -> None:
    need_ext(cuda=n_gpus > 0)
    need_gpus(n_gpus)


def _chunk_sizes(t: torch.Tensor, n: int, dim: int) -> list[int]:
    return [c.size(dim) for c in t.chunk(n, dim)]


def _cuda(g: int) -> torch.device:
    return torch.device("cuda", g)


def scatter_one(src: torch.Tensor, dim: int, devices: list[torch.device], where: str) -> None:
    sizes = _chunk_sizes(src, len(devices), dim)
    devices = devices[: len(sizes)]  # torch.chunk may make fewer chunks than devices
    got = _backend.ext().scatter_chunks([src], [sizes], dim, devices)
    want = [c.to(d) for c, d in zip(src.split(sizes, dim), devices)]
    sync()
    for r, (rep, w) in enumerate(zip(got, want)):
        same_bits(rep[0], w, f"{where}, chunk {r}")


def gather_one(parts: list[torch.Tensor], dim: int, dest: torch.device, where: str) -> None:
    got = _backend.ext().gather_into(parts, dim, dest)
    want = torch.cat([p.to(dest) for p in parts], dim)
    sync()
    same_bits(got, want, where)


def _each_case(
    quick: bool, each: Callable[[str, torch.Tensor, int], None], subset: list | None = None
) -> str:
    todo = list(kernel_cases(quick)) if subset is None else subset
    for label, t, dim in todo:
        each(label, t, dim)
    return (
        f"{len(todo)} cases bit-exact vs torch ({sum(x.nbytes for _, x, _ in todo) / MiB:.0f} "
        "MiB each way)"
    )


def _each_gpu(quick: bool, *each: Callable[..., None], subset: list | None = None) -> str:
    """Every case through each `each(g, label, t, dim)` on every GPU g; the last one's text."""
    out = ""
    for g in range(gpus()):
        for fn in each:
            out = _each_case(quick, partial(fn, g), subset)
    return out


def check_cpu_scatter(quick: bool) -> str:
    _need_kernels(0)
    return _each_case(
        quick, lambda lb, t, d: scatter_one(t, d, [torch.device("cpu")] * 2, f"{lb} -> cpu")
    )


def check_cpu_gather(quick: bool) -> str:
    _need_kernels(0)
    return _each_case(
        quick,
        lambda lb, t, d: gather_one(list(t.chunk(3, d)), d, torch.device("cpu"), f"{lb} -> cpu"),
    )


def check_host_to_gpus(pinned: bool) -> Callable[[bool], str]:
    def run(quick: bool) -> str:
        _need_kernels(1)
        out = _each_gpu(
            quick,
            lambda g, lb, t, d: scatter_one(
                _source(t, "pinned") if pinned else t, d, [_cuda(g)] * 2, f"{lb} -> cuda:{g}"
            ),
        )
        return f"every GPU ({gpus()}): {out}"

    return run


def check_gpu_gather(to_host: bool) -> Callable[[bool], str]:
    def run(quick: bool) -> str:
        _need_kernels(1)

        def each(g: int, lb: str, t: torch.Tensor, d: int) -> None:
            dest = torch.device("cpu") if to_host else _cuda(g)
            gather_one(list(t.to(_cuda(g)).chunk(3, d)), d, dest, f"{lb} cuda:{g} -> {dest}")

        return f"every GPU ({gpus()}): {_each_gpu(quick, each)}"

    return run


def check_gpu_to_gpus(quick: bool) -> str:
    _need_kernels(2)
    devs = [_cuda(g) for g in range(gpus())]
    out = _each_case(
        quick,
        lambda lb, t, d: scatter_one(
            t.to(devs[0]), d, devs[1:] + devs[:1], f"{lb} cuda:0 -> {len(devs)} GPUs"
        ),
    )
    out = _each_case(
        quick,
        lambda lb, t, d: gather_one(
            [c.to(devs[k % len(devs)]) for k, c in enumerate(t.chunk(len(devs), d))],
            d,
            devs[0],
            f"{lb} {len(devs)} GPUs -> cuda:0",
        ),
    )
    return f"{len(devs)} GPUs both ways: {out}"


def check_small_pool(quick: bool) -> str:
    """The 40 MiB cases through a 1 MiB pinned pool: many windows, each reused in turn."""

    def up(g: int, lb: str, t: torch.Tensor, d: int) -> None:
        scatter_one(t, d, [_cuda(g)] * 2, f"{lb} -> cuda:{g}, 1 MiB pool")

    def down(g: int, lb: str, t: torch.Tensor, d: int) -> None:
        gather_one(
            list(t.to(_cuda(g)).chunk(2, d)),
            d,
            torch.device("cpu"),
            f"{lb} cuda:{g} -> cpu, 1 MiB pool",
        )

    _need_kernels(1)
    ext = _backend.ext()
    old = ext.pinned_pool_set_capacity(MiB)
    try:
        out = _each_gpu(quick, up, down, subset=big_kernel_cases(quick))
    finally:
        ext.pinned_pool_set_capacity(old)
    return f"pinned pool 1 MiB, every GPU ({gpus()}), both ways: {out}"


def check_side_stream(quick: bool) -> str:
    """Kernels on the caller's current (side) stream: behind a slow producer on that stream,
    ahead of its consumer, while the device's default stream is held busy."""
    _need_kernels(1)
    ext = _backend.ext()
    label, t, dim = big_kernel_cases(quick)[-1]
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
            up = ext.scatter_chunks([t], [_chunk_sizes(t, 2, dim)], dim, [dev, dev])
            up_cat = torch.cat([rep[0] for rep in up], dim)
            ok = [torch.equal(bits(on_dev), bits(src)), torch.equal(bits(up_cat), bits(src))]
        sync()
        same_bits(host, t, f"{label} cuda:{g} -> cpu on a side stream")
        if not all(ok):
            raise Mismatch(
                f"{label} on cuda:{g}: a kernel did not follow the side stream "
                f"(gather in place {ok[0]}, scatter from the host {ok[1]})"
            )
    return f"every GPU ({gpus()}): {label} gathered and scattered on a side stream, in order"


KERNEL_CHECKS: list[tuple[str, Callable[[bool], str]]] = [  # the CPU ones first
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


# The replication engine, P2P, NCCL and training parity.


def _lists(kind: str, small_ints: bool) -> list[list[torch.Tensor]]:
    devs = [torch.device("cpu") if d == "cpu" else torch.device("cuda", d) for d in _devices(kind)]
    base = [t for _, t, _ in cases(small_ints)]
    gen = torch.Generator().manual_seed(1)
    out = []
    for k, d in enumerate(devs):
        ts = base if k == 0 else [make(tuple(t.shape), t.dtype, gen, small_ints) for t in base]
        out.append([_source(t, "pageable").to(d) for t in ts])
    return out


def _engine_reference(op: str, lists: list[list[torch.Tensor]], devs: list) -> list:
    """What the engine must give, by torch's per-tensor primitives (copies; list-order sums)."""
    first = lists[0]
    if op == "reduce":
        out = [t.clone() for t in first]
        for rep in lists[1:]:
            out = [o + r.to(o.device) for o, r in zip(out, rep)]
        return out
    return [[t.to(as_device(d), copy=True) for t in first] for d in devs[1:]]


def coalesced_check(op: str, kind: str) -> Callable[[], str]:
    """The replication engine (the step's own broadcast, refresh and reduce: fastdp/_buckets.py,
    fastdp/_reducer.py) in small buckets against torch's per-tensor primitives."""

    def run() -> str:
        need_gpus(_GPUS_NEEDED[kind])
        devs = _devices(kind)
        lists = _lists(kind, small_ints=op == "reduce")
        if op == "broadcast":
            got = comm.broadcast_coalesced(lists[0], devs, 4096)[1:]
        elif op == "reduce":
            got = comm.reduce_add_coalesced(lists, devs[0], 4096)
        else:  # refresh: persistent bucket copies, refreshed in place after the sources changed
            layout = _buckets.Layout(
                lists[0], [as_device(d) for d in devs], range(1, len(devs)), 4096
            )
            layout.refresh(lists[0], None)
            with torch.no_grad():
                for t, u in zip(lists[0], lists[-1]):
                    t.copy_(u.to(t.device))
            layout.refresh(lists[0], None)
            got = [layout.per_replica[j] for j in range(1, len(devs))]
        want = _engine_reference(op, lists, devs)
        sync()
        same(got, want, f"engine {op}", strides=False)
        return (
            f"{len(lists[0])} tensors of {len(set(t.dtype for t in lists[0]))} dtypes "
            f"bit-exact vs torch on {devs}"
        )

    return run


def _p2p_off() -> bool:
    return os.environ.get("FASTDP_P2P") == "0"


def check_p2p() -> str:
    need_gpus(2)
    need_ext(cuda=True)
    ext, n, parts, bad = _backend._ext, gpus(), [], []
    for a in range(n):
        for b in range(a + 1, n):
            reported = torch.cuda.can_device_access_peer(a, b)
            direct = ext.peer_access(a, b)
            parts.append(
                f"{a}-{b}:{'reported' if reported else 'none'}/"
                f"{'enabled+verified' if direct else 'staged'}"
            )
            if reported and not direct and not _p2p_off():
                bad.append(f"cuda:{a}<->cuda:{b}")
    if bad:
        raise Mismatch(
            f"peer access reported but its verification copy failed between "
            f"{', '.join(bad)} (fastdp stages those copies; torch's own copies between "
            "them may be wrong)"
        )
    return ("FASTDP_P2P=0, all staged: " if _p2p_off() else "") + " ".join(parts)


def check_nccl() -> str:
    """The engine's transport between all GPUs (torch's NCCL broadcast and reduce)."""
    need_gpus(2)
    devs = list(range(gpus()))
    lists = _lists("all", small_ints=True)
    if not torch.cuda.nccl.is_available([rep[0] for rep in lists]):
        raise Skip("torch reports NCCL unavailable here (the engine copies between the GPUs)")
    for op in ("broadcast", "reduce"):
        coalesced_check(op, "all")()
    return f"{len(devs)} GPUs: broadcast and reduce through torch's NCCL bit-exact vs copies"


def training_check(kind: str) -> Callable[[], str]:
    def run() -> str:
        from fastdp import FastDataParallel

        need_gpus(_GPUS_NEEDED[kind])
        ids = {"cpu": ["cpu", "cpu"], "[0,0]": [0, 0], "all": list(range(gpus()))}[kind]
        dev = torch.device("cpu" if kind == "cpu" else "cuda:0")
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3)).to(dev)
        data = [(torch.randn(10, 12, device=dev), torch.randn(10, 3, device=dev)) for _ in range(3)]
        runs = {
            "plain": _train(copy.deepcopy(base), data, lambda m: m),
            "fastdp": _train(copy.deepcopy(base), data, lambda m: FastDataParallel(m, ids)),
        }
        if kind == "all":  # nn.DataParallel needs distinct GPUs
            runs["nn.DataParallel"] = _train(
                copy.deepcopy(base), data, lambda m: nn.DataParallel(m, ids)
            )
        for name, got in runs.items():
            for k, (g, w) in enumerate(zip(got, runs["plain"])):
                try:
                    torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
                except AssertionError as e:
                    raise Mismatch(f"{name} on {ids}, value {k}: {str(e).splitlines()[0]}") from e
        return f"3 SGD steps on {ids}: " + " = ".join(runs) + " (outputs, parameters)"

    return run


def _train(module: nn.Module, data, wrap) -> list[torch.Tensor]:
    model = wrap(module)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    seen = []
    for x, y in data:
        opt.zero_grad()
        out = model(x)
        nn.functional.mse_loss(out, y).backward()
        opt.step()
        seen.append(out.detach())
    return seen + [p.detach() for p in module.parameters()]


def all_checks(quick: bool = False) -> list[tuple[str, Callable[[], str], str]]:
    """(name, check, the switch that avoids its path); ``quick``: the kernel checks' small
    cases."""
    out: list[tuple[str, Callable[[], str], str]] = [("extension", check_extension, AVOID_EXT)]
    scatter = [("pageable", "cpu")] + [
        (w, k) for k in ("[0,0]", "all") for w in ("pageable", "pinned", "cuda")
    ]
    for where, kind in scatter:
        out.append((f"scatter {where} -> {kind}", scatter_check(where, kind), AVOID_EXT))
    for kind, dest in (
        ("cpu", "cpu"),
        ("[0,0]", "cuda:0"),
        ("[0,0]", "cpu"),
        ("all", "cuda:0"),
        ("all", "cpu"),
    ):
        out.append((f"gather {kind} -> {dest}", gather_check(kind, dest), AVOID_EXT))
    for name, check in KERNEL_CHECKS:
        out.append((name, partial(check, quick), AVOID_EXT))
    for op in ("broadcast", "reduce", "refresh"):
        for kind in ("cpu", "[0,0]", "all"):
            out.append((f"{op} coalesced {kind}", coalesced_check(op, kind), AVOID_EXT))
    out += [("p2p matrix", check_p2p, AVOID_P2P), ("nccl all GPUs", check_nccl, AVOID_P2P)]
    for kind in ("cpu", "[0,0]", "all"):
        out.append((f"training parity {kind}", training_check(kind), AVOID_EXT))
    return out


# The runner, the report and the command line.


def _outcome(check: Callable[[], str]) -> tuple[str, str]:
    try:
        return PASS, check()
    except Skip as e:
        return SKIP, str(e)
    except Mismatch as e:
        return FAIL, str(e)
    except Exception as e:  # a crash in a path is a failure of that path, not of the doctor
        return FAIL, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def doctor(only: str | Sequence[str] | None = None, quick: bool = False) -> dict[str, Any]:
    """Runs every check (or those whose name contains ``only``, or one of them); returns the
    report as a dict.

    ``{"ok": bool, "seconds": float, "quick": bool, "kernel_cases": [label, ...], "info":
    fastdp.info(), "checks": [{"name", "status", "why", "avoid", "seconds"}, ...]}``; ``avoid``
    is the switch that avoids a FAILed path; ``kernel_cases`` name the dtype, shape and layout
    of every input the ``kernels ...`` checks run (``quick``: their small sizes).
    """
    start = time.perf_counter()
    checks = []
    wanted = [only] if isinstance(only, str) else list(only or ())
    for name, check, avoid in all_checks(quick):
        if wanted and not any(w in name for w in wanted):
            continue
        t0 = time.perf_counter()
        status, why = _outcome(check)
        checks.append(
            {
                "name": name,
                "status": status,
                "why": why,
                "avoid": avoid if status == FAIL else None,
                "seconds": round(time.perf_counter() - t0, 3),
            }
        )
    return {
        "ok": all(c["status"] != FAIL for c in checks),
        "seconds": round(time.perf_counter() - start, 3),
        "quick": quick,
        "kernel_cases": kernel_labels(quick),
        "info": _jsonable(info()),
        "checks": checks,
    }


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d, default=str))


def format_report(report: dict[str, Any]) -> str:
    i = report["info"]
    build = (
        "extension not loaded"
        if not i["extension_loaded"]
        else f"CUDA {i['build_cuda_version']} build ({i['arch_list']})"
        if i["built_with_cuda"]
        else "CPU-only build"
    )
    lines = [
        f"fastdp doctor: fastdp {i['version']}, torch {i['torch']}, {build}, "
        f"{len(i['gpus'])} GPU(s) {', '.join(sorted(set(i['gpus'])))}".rstrip(),
        f"accelerator: {accelerator_line(i)}",
    ]
    width = max((len(c["name"]) for c in report["checks"]), default=10)
    for c in report["checks"]:
        lines.append(f"  {c['status']}  {c['name']:<{width}}  {c['why']}")
    counts = {s: sum(c["status"] == s for c in report["checks"]) for s in (PASS, FAIL, SKIP)}
    lines.append(
        f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped "
        f"in {report['seconds']:.1f} s"
    )
    if any(c["name"].startswith("kernels") for c in report["checks"]):
        cases = report["kernel_cases"]
        lines.append(
            f"kernel cases ({len(cases)}{', quick' if report['quick'] else ''}): "
            + "; ".join(cases)
        )
    if counts[SKIP] and not i["gpus"]:
        lines.append("no CUDA GPU visible: the GPU checks were skipped")
    for c in report["checks"]:
        if c["status"] == FAIL:
            lines.append(
                f"FAILED {c['name']}: set {c['avoid']} to avoid this path "
                "(and please report it with the --json output)"
            )
    return "\n".join(lines)


def _estimate() -> str:
    """The run time by the case sizes (an estimate from sizes, not a measurement)."""
    full, quick = (
        sum(t.numel() * t.element_size() for _, t, _ in kernel_cases(q)) / MiB
        for q in (False, True)
    )
    return (
        f"Kernel cases: {len(kernel_labels())} inputs of {full:.0f} MiB in all "
        f"({quick:.1f} MiB with --quick). Each GPU check moves them about twice each way "
        "(fastdp, then torch) and compares the bytes; with ~10 GB/s host<->GPU and the "
        "inputs generated on the host per check (the larger cost, ~1 s), expect about "
        "15 s plus 3 s per GPU on an H100 machine, under 60 s up to 8 GPUs; --quick: a few "
        "seconds. Not yet measured on a GPU."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fastdp doctor",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_estimate(),
    )
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    p.add_argument(
        "-k",
        metavar="TEXT",
        action="append",
        help="only the checks whose name contains TEXT (repeat: any of them)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="the kernel checks on small cases (a few seconds; the sanitizer's runs)",
    )
    args = p.parse_args(argv)
    report = doctor(args.k, quick=args.quick)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["ok"] else 1
