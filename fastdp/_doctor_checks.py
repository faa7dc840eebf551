"""The checks of ``python -m fastdp.doctor``: each returns its PASS text or raises Skip/Mismatch.

``plan()`` lists them with the environment switch that avoids the path each one proves.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

import fastdp.comm as comm
from fastdp import _backend, _doctor_kernels, engine
from fastdp._devices import as_device
from fastdp._doctor_cases import AVOID_EXT, Mismatch, Skip, cases, ext_vs_torch, make, same, sync
from fastdp._doctor_cases import gpus as _gpus
from fastdp._doctor_cases import need_ext as _need_ext
from fastdp._doctor_cases import need_gpus as _need_gpus

AVOID_P2P = "FASTDP_P2P=0"


def check_extension() -> str:
    info = _backend.build_info()
    if not _backend.enabled():
        raise Skip(f"disabled by {AVOID_EXT}")
    if not _backend.loaded():
        raise Mismatch(f"fastdp._C failed to import ({_backend.load_error()}): every stage falls "
                       "back to torch; rebuild with `pip install --no-build-isolation -e .`")
    cuda = info.get("built_with_cuda") == "1"
    if _gpus() and not cuda:
        raise Mismatch("CPU-only build on a machine with GPUs: CUDA copies fall back to torch; "
                       "rebuild where nvcc and a CUDA torch are present")
    return f"loaded, {'CUDA ' + info.get('cuda_version', '') if cuda else 'CPU-only'} build"


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
    return {"cpu": ["cpu"] * 3, "[0,0]": [0, 0], "all": list(range(_gpus()))}[kind]


def scatter_check(where: str, kind: str) -> Callable[[], str]:
    def run() -> str:
        _need_gpus(0 if kind == "cpu" else 2 if kind == "all" else 1)
        _need_ext(cuda=kind != "cpu")
        devs, n = _devices(kind), 0
        for label, t, dim in cases():
            src = _source(t, where)
            ext_vs_torch(lambda src=src, dim=dim: comm.scatter(src, devs, dim=dim),
                         f"{label} -> {devs}")
            n += 1
        return f"{n} cases bit-exact vs torch"
    return run


def gather_check(kind: str, dest: str) -> Callable[[], str]:
    def run() -> str:
        _need_gpus(0 if kind == "cpu" else 2 if kind == "all" else 1)
        _need_ext(cuda=kind != "cpu")
        n = 0
        for label, t, dim in cases():
            with _backend.use_extension(False):
                parts = comm.scatter(_source(t, "pageable" if kind == "cpu" else "cuda"),
                                     _devices(kind), dim=dim)
            ext_vs_torch(lambda parts=parts, dim=dim: comm.gather(parts, dim, dest),
                         f"{label} -> {dest}")
            n += 1
        return f"{n} cases bit-exact vs torch"
    return run


def _lists(kind: str, small_ints: bool) -> list[list[torch.Tensor]]:
    devs = [torch.device("cpu") if d == "cpu" else torch.device("cuda", d)
            for d in _devices(kind)]
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
        for row in lists[1:]:
            out = [o + r.to(o.device) for o, r in zip(out, row)]
        return out
    return [[t.to(as_device(d), copy=True) for t in first] for d in devs[1:]]


def coalesced_check(op: str, kind: str) -> Callable[[], str]:
    """The replication engine (the step's own broadcast, refresh and reduce: fastdp/engine.py,
    fastdp/reducer.py) in small buckets against torch's per-tensor primitives."""
    def run() -> str:
        _need_gpus(0 if kind == "cpu" else 2 if kind == "all" else 1)
        devs = _devices(kind)
        lists = _lists(kind, small_ints=op == "reduce")
        if op == "broadcast":
            got = comm.broadcast_coalesced(lists[0], devs, 4096)[1:]
        elif op == "reduce":
            got = comm.reduce_add_coalesced(lists, devs[0], 4096)
        else:  # refresh: persistent bucket copies, refreshed in place after the sources changed
            layout = engine.Layout(lists[0], [as_device(d) for d in devs],
                                   range(1, len(devs)), 4096)
            layout.refresh(lists[0], None)
            with torch.no_grad():
                for t, u in zip(lists[0], lists[-1]):
                    t.copy_(u.to(t.device))
            layout.refresh(lists[0], None)
            got = [layout.rows[j] for j in range(1, len(devs))]
        want = _engine_reference(op, lists, devs)
        sync()
        same(got, want, f"engine {op}", strides=False)
        return f"{len(lists[0])} tensors of {len(set(t.dtype for t in lists[0]))} dtypes " \
               f"bit-exact vs torch on {devs}"
    return run


def check_p2p() -> str:
    _need_gpus(2)
    _need_ext(cuda=True)
    ext, n, rows, bad = _backend._ext, _gpus(), [], []
    for a in range(n):
        for b in range(a + 1, n):
            reported = torch.cuda.can_device_access_peer(a, b)
            direct = ext.peer_access(a, b)
            rows.append(f"{a}-{b}:{'reported' if reported else 'none'}/"
                        f"{'enabled+verified' if direct else 'staged'}")
            if reported and not direct and not _p2p_off():
                bad.append(f"cuda:{a}<->cuda:{b}")
    if bad:
        raise Mismatch(f"peer access reported but its verification copy failed between "
                       f"{', '.join(bad)} (fastdp stages those copies; torch's own copies between "
                       "them may be wrong)")
    return ("FASTDP_P2P=0, all staged: " if _p2p_off() else "") + " ".join(rows)


def _p2p_off() -> bool:
    import os

    return os.environ.get("FASTDP_P2P") == "0"


def check_nccl() -> str:
    """The engine's transport between all GPUs (torch's NCCL broadcast and reduce)."""
    _need_gpus(2)
    devs = list(range(_gpus()))
    lists = _lists("all", small_ints=True)
    if not torch.cuda.nccl.is_available([row[0] for row in lists]):
        raise Skip("torch reports NCCL unavailable here (the engine copies between the GPUs)")
    for op in ("broadcast", "reduce"):
        coalesced_check(op, "all")()
    return f"{len(devs)} GPUs: broadcast and reduce through torch's NCCL bit-exact vs copies"


def training_check(kind: str) -> Callable[[], str]:
    def run() -> str:
        from fastdp import FastDataParallel

        if kind != "cpu":
            _need_gpus(2 if kind == "all" else 1)
        ids = {"cpu": ["cpu", "cpu"], "[0,0]": [0, 0], "all": list(range(_gpus()))}[kind]
        dev = torch.device("cpu" if kind == "cpu" else "cuda:0")
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3)).to(dev)
        data = [(torch.randn(10, 12, device=dev), torch.randn(10, 3, device=dev))
                for _ in range(3)]
        runs = {"plain": _train(_clone(base), data, lambda m: m),
                "fastdp": _train(_clone(base), data, lambda m: FastDataParallel(m, ids))}
        if kind == "all":  # nn.DataParallel needs distinct GPUs
            runs["nn.DataParallel"] = _train(_clone(base), data, lambda m: nn.DataParallel(m, ids))
        for name, got in runs.items():
            for k, (g, w) in enumerate(zip(got, runs["plain"])):
                try:
                    torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
                except AssertionError as e:
                    raise Mismatch(f"{name} on {ids}, value {k}: {str(e).splitlines()[0]}") from e
        return f"3 SGD steps on {ids}: " + " = ".join(runs) + " (outputs, parameters)"
    return run


def _clone(m: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(m)


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


def plan(quick: bool = False) -> list[tuple[str, Callable[[], str], str]]:
    """(name, check, the switch that avoids its path); ``quick``: the kernel checks' small
    cases."""
    out: list[tuple[str, Callable[[], str], str]] = [("extension", check_extension, AVOID_EXT)]
    scatter = [("pageable", "cpu")] + [(w, k) for k in ("[0,0]", "all")
                                       for w in ("pageable", "pinned", "cuda")]
    for where, kind in scatter:
        out.append((f"scatter {where} -> {kind}", scatter_check(where, kind), AVOID_EXT))
    for kind, dest in (("cpu", "cpu"), ("[0,0]", "cuda:0"), ("[0,0]", "cpu"), ("all", "cuda:0"),
                       ("all", "cpu")):
        out.append((f"gather {kind} -> {dest}", gather_check(kind, dest), AVOID_EXT))
    for name, check in _doctor_kernels.plan():  # the kernels called directly, at real sizes
        out.append((name, partial(check, quick), AVOID_EXT))
    for op in ("broadcast", "reduce", "refresh"):
        for kind in ("cpu", "[0,0]", "all"):
            out.append((f"{op} coalesced {kind}", coalesced_check(op, kind), AVOID_EXT))
    out += [("p2p matrix", check_p2p, AVOID_P2P), ("nccl all GPUs", check_nccl, AVOID_P2P)]
    for kind in ("cpu", "[0,0]", "all"):
        out.append((f"training parity {kind}", training_check(kind), AVOID_EXT))
    return out
