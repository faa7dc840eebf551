"""Probes of the host-to-GPU copy paths: stream order of pinned chunks (every copy kind), the host
allocator's events on pinned sources, narrow rows and wide rows against torch and the H2D limit,
the device's maximum pitch."""

import os
import time

from common import SLEEP, _err, _late_pinned, _same, _stats, _sync, _time, _torch, probe


# ------------------------------------------------------------------------------------------ env
@probe(timeout=60)
def env():
    torch = _torch()
    import fastdp

    info = fastdp.info()
    d = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": torch.cuda.device_count(),
        "device": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
        "built_with_cuda": info.get("built_with_cuda"),
        "arch_list": info.get("arch_list"),
        "nccl": info.get("nccl"),
        "torch_threads": torch.get_num_threads(),
        "pool": _stats(),
    }
    try:
        import cupy

        d["max_pitch_bytes"] = int(cupy.cuda.runtime.deviceGetAttribute(11, 0))  # MaxPitch
    except Exception as e:  # noqa: BLE001
        d["max_pitch_bytes"] = f"n/a ({_err(e)})"
    return {"status": "ok" if d["built_with_cuda"] else "error", **d}


# ------------------------------------------------------ finding F2: stream order of pinned chunks
@probe(timeout=60)
def pinned_order():
    """NOTE [ Stream order of host copies ]: a pinned batch still being filled by a non_blocking
    D2H on the current stream must be read after it lands. One case per path of scatter_pinned
    (dense, 2-D, span, rows, conj resolved on the GPU; expanded and overlapping sources, whose
    rows are never a 2-D copy's pitch), plus a side stream; torch's comm.scatter
    on the same input as the baseline (its .to() makes non-dense chunks contiguous on the host)."""
    torch = _torch()
    from torch.nn.parallel import comm as tcomm

    from fastdp import comm as fcomm

    g = torch.Generator(device="cuda").manual_seed(0)
    cuda = torch.device("cuda", 0)

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=cuda, dtype=dtype, generator=g)

    cases = [
        ("dense dim0 (memcpy)", lambda: rnd(64, 96), lambda t: t, 0),
        ("rows dim1 (2-D DMA)", lambda: rnd(64, 96), lambda t: t, 1),
        ("column slice dim0 (2-D DMA)", lambda: rnd(64, 96), lambda t: t[:, :40], 0),
        (
            "3-D slice dim0 (span)",
            lambda: rnd(16, 8, 96),
            lambda t: t[:, :, :48],
            0,
        ),
        (
            "channels_last dim1 (span)",
            lambda: rnd(8, 6, 5, 4).contiguous(memory_format=torch.channels_last),
            lambda t: t,
            1,
        ),
        (
            "conj dense dim0 (conj on the GPU)",
            lambda: rnd(64, 48, dtype=torch.complex64),
            lambda t: t.conj(),
            0,
        ),
        ("dense dim0 on a side stream", lambda: rnd(64, 96), lambda t: t, 0),
        ("expanded rows, a mask (span)", lambda: rnd(1, 512), lambda t: t.expand(8, 512), 0),
        ("overlapping rows, unfold (span)", lambda: rnd(1024), lambda t: t.unfold(0, 512, 1), 0),
        (
            "expanded level, far apart (rows of 1)",
            lambda: rnd(2, 100000),
            lambda t: t[:, :512].unsqueeze(1).expand(2, 4, 512),
            0,
        ),
    ]
    impls = {
        "fastdp": lambda v, dim: fcomm.scatter(v, [0, 0], dim=dim),
        "torch": lambda v, dim: tcomm.scatter(v, [0, 0], dim=dim),
    }
    rows, fast_bad = [], []
    for label, make, view, dim in cases:
        row = {"case": label}
        for impl, fn in impls.items():
            side = torch.cuda.Stream() if "side stream" in label else None
            try:
                src = make()
                _sync()
                ctx = (
                    torch.cuda.stream(side)
                    if side is not None
                    else torch.cuda.stream(torch.cuda.current_stream())
                )
                with ctx:
                    pinned = _late_pinned(src)
                    parts = fn(view(pinned), dim)
                _sync()
                ok = _same(
                    torch.cat([p.resolve_conj() for p in parts], dim), view(src).resolve_conj()
                )
                row[impl] = "right" if ok else "STALE/wrong"
            except Exception as e:  # noqa: BLE001
                row[impl] = _err(e)
            if impl == "fastdp" and row[impl] != "right":
                fast_bad.append(label)
        rows.append(row)
    status = "ok" if not fast_bad else "bug"
    return {"status": status, "fastdp_not_right": fast_bad, "cases": rows}


# --------------------------------------------- finding: host allocator event on pinned sources
@probe(timeout=45)
def host_alloc_reuse():
    """scatter_pinned records the current stream on the source's host-allocator block: a pinned
    source freed right after the call must not be lent again (and overwritten) before its DMA."""
    torch = _torch()
    from fastdp import comm as fcomm

    out = []
    bad = False
    for label, dim in (("dense (memcpy)", 0), ("rows dim1 (2-D DMA)", 1)):
        a = torch.randn(1 << 12, 1 << 10).pin_memory()
        expected = a.clone()
        _sync()
        torch.cuda._sleep(SLEEP)  # the DMA below waits ~50 ms behind this
        parts = fcomm.scatter(a, [0, 0], dim=dim)
        ptr = a.data_ptr()
        del a
        b = torch.empty(1 << 12, 1 << 10, pin_memory=True)
        reused = b.data_ptr() == ptr
        b.fill_(-7.0)
        _sync()
        ok = torch.equal(torch.cat([p.cpu() for p in parts], dim), expected)
        bad = bad or not ok
        out.append({"case": label, "block_reused_while_pending": reused, "values_right": ok})
        del b, parts
    return {"status": "bug" if bad else "ok", "cases": out}


@probe(timeout=90)
def copy_shapes_perf():
    """scatter onto [0]*n from pinned memory whose chunks take the 2-D DMA with narrow rows, and
    from pageable memory whose outer rows exceed the staging window (torch's unstaged copy):
    fastdp against torch's comm.scatter and one plain pinned H2D of the same bytes."""
    torch = _torch()
    from torch.nn.parallel import comm as tcomm

    from fastdp import comm as fcomm

    cases = [
        (
            "pinned (4096,4096) f32 dim0: memcpy",
            lambda: torch.randn(4096, 4096).pin_memory(),
            lambda t: t,
            0,
            2,
        ),
        (
            "pinned (4096,4096) f32 dim1: 2-D rows 8 KiB",
            lambda: torch.randn(4096, 4096).pin_memory(),
            lambda t: t,
            1,
            2,
        ),
        (
            "pinned (65536,256) f32 dim1: 2-D rows 512 B",
            lambda: torch.randn(65536, 256).pin_memory(),
            lambda t: t,
            1,
            2,
        ),
        (
            "pinned (1M,8)[:, :4] f32 dim0: 2-D rows 16 B",
            lambda: torch.randn(1 << 20, 8).pin_memory(),
            lambda t: t[:, :4],
            0,
            2,
        ),
        (
            "pinned (1M,2) f32 dim1: 2-D rows 4 B",
            lambda: torch.randn(1 << 20, 2).pin_memory(),
            lambda t: t,
            1,
            2,
        ),
        (
            "pageable (64,1M) f32 -> 4: rows 4 MiB = window",
            lambda: torch.randn(64, 1 << 20),
            lambda t: t,
            0,
            4,
        ),
        (
            "pageable (8,3,1024,1024) f32 -> 4: rows 12 MiB > window",
            lambda: torch.randn(8, 3, 1024, 1024),
            lambda t: t,
            0,
            4,
        ),
    ]
    rows = []
    worst = 0.0
    for label, make, view, dim, n in cases:
        try:
            base = make()
            v = view(base)
            devs = [0] * n
            got = fcomm.scatter(v, devs, dim=dim)
            _sync()
            right = all(torch.equal(gp.cpu(), w) for gp, w in zip(got, v.chunk(n, dim)))
            nbytes = v.numel() * v.element_size()
            limit_src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
            limit_dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            t_f = _time(lambda v=v, devs=devs, dim=dim: fcomm.scatter(v, devs, dim=dim))
            t_t = _time(lambda v=v, devs=devs, dim=dim: tcomm.scatter(v, devs, dim=dim))
            t_l = _time(lambda s=limit_src, d=limit_dst: d.copy_(s, non_blocking=True))
            ratio = t_f / t_t
            worst = max(worst, ratio)
            rows.append(
                {
                    "case": label,
                    "right": right,
                    "fastdp_ms": round(t_f, 3),
                    "torch_ms": round(t_t, 3),
                    "h2d_limit_ms": round(t_l, 3),
                    "x_torch": round(ratio, 2),
                    "fastdp_GBps": round(nbytes / t_f / 1e6, 2),
                }
            )
            base = v = got = limit_src = limit_dst = None  # freed before the next case
        except Exception as e:  # noqa: BLE001
            rows.append({"case": label, "error": _err(e)})
    bad = any(r.get("right") is False or "error" in r for r in rows)
    return {
        "status": "bug" if bad else ("perf-risk" if worst > 2.0 else "ok"),
        "worst_x_torch": round(worst, 2),
        "rows": rows,
    }


@probe(timeout=90)
def pitch_limit():
    """A pinned chunk whose row pitch exceeds 2 GiB takes cudaMemcpy2DAsync (spitch > the
    device's max pitch, 2^31-1 on most GPUs). Needs ~4 GiB pinned + ~12 GiB on the GPU."""
    torch = _torch()
    from fastdp import comm as fcomm

    if os.environ.get("PROBE_BIG", "1") == "0":
        return {"status": "skip", "why": "PROBE_BIG=0"}
    cols = 1 << 31  # spitch 2^31 > 2^31-1; 4 GiB exactly (the host allocator rounds up to 2^k)
    t0 = time.perf_counter()
    x = torch.empty(2, cols, dtype=torch.uint8, pin_memory=True)
    x.zero_()
    x[:, ::65521] = 5
    x[1, -1] = 9
    res = {"pin_and_fill_s": round(time.perf_counter() - t0, 2), "spitch_bytes": cols}
    try:
        parts = fcomm.scatter(x, [0, 0], dim=1)
        _sync()
        res["right"] = torch.equal(torch.cat(parts, 1), x.cuda())
        res["status"] = "ok" if res["right"] else "bug"
    except Exception as e:  # noqa: BLE001
        res["error"] = _err(e)
        res["status"] = "bug"
    return res
