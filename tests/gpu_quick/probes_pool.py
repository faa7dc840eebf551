"""Probes of the pinned pool: under CUDA graph capture (global and relaxed, warm and cold), the
scatter paths under capture, four threads through a small pool, steady-state allocations."""

import re
import threading

from common import CLEAR, _err, _stats, _sync, _torch, probe


# ------------------------------------------- finding F1: the pinned pool under CUDA graph capture
def _gather_capture(mode, warm):
    torch = _torch()
    import fastdp  # noqa: F401
    from fastdp import comm as fcomm

    a = torch.randn(1024, 64, device="cuda")
    b = torch.randn(512, 64, device="cuda")
    res = {"capture_error_mode": mode, "warm_up_call_first": warm}
    g0 = torch.cuda.CUDAGraph()  # baseline: torch.cat is capturable
    with torch.cuda.graph(g0, capture_error_mode=mode):
        base = torch.cat([a, b])
    g0.replay()
    _sync()
    res["torch_cat_capturable"] = torch.equal(base, torch.cat([a, b]))
    if warm:
        fcomm.gather([a, b], 0, 0)  # multi_copy: its metadata block now holds a pool event
        _sync()
    g = torch.cuda.CUDAGraph()
    out = None
    try:
        with torch.cuda.graph(g, capture_error_mode=mode):
            out = fcomm.gather([a, b], 0, 0)
        res["captured"] = True
    except Exception as e:  # noqa: BLE001
        res["captured"] = False
        res["capture_error"] = _err(e)
    if res["captured"]:
        a.copy_(torch.randn_like(a))
        b.copy_(torch.randn_like(b))
        g.replay()
        _sync()
        res["replay_right"] = torch.equal(out, torch.cat([a, b]))
    after = []
    for _ in range(3):  # the pool after the capture: the same class of block is asked again
        try:
            c = fcomm.gather([b, a, b], 0, 0)
            _sync()
            after.append(bool(torch.equal(c, torch.cat([b, a, b]))))
        except Exception as e:  # noqa: BLE001
            after.append(_err(e))
            break
    res["gathers_after_capture"] = after
    try:
        res["pool_after"] = _stats()
    except Exception as e:  # noqa: BLE001
        res["pool_after"] = _err(e)
    if res["captured"] and res.get("replay_right"):
        try:
            a.copy_(torch.randn_like(a))
            g.replay()
            _sync()
            res["replay_after_pool_reuse_right"] = torch.equal(out, torch.cat([a, b]))
        except Exception as e:  # noqa: BLE001
            res["replay_after_pool_reuse_right"] = _err(e)
    good = (
        res["captured"]
        and res.get("replay_right") is True
        and all(x is True for x in after)
        and res.get("replay_after_pool_reuse_right", True) is True
    )
    res["status"] = "ok" if good else "bug"
    return res


@probe(timeout=45)
def gather_capture_global_warm():
    return _gather_capture("global", True)


@probe(timeout=45)
def gather_capture_global_cold():
    return _gather_capture("global", False)


@probe(timeout=45)
def gather_capture_relaxed_warm():
    return _gather_capture("relaxed", True)


@probe(timeout=45)
def capture_scatter_paths():
    """Pinned + pageable leaves in one call under capture: the clear error (pageable refused);
    a captured 2-D pinned scatter replays the current bytes; the pool still works afterwards;
    copy_stats() (pool stats: cudaEventQuery) inside a capture."""
    torch = _torch()
    from fastdp import comm as fcomm

    res = {}
    devs = [torch.device("cuda", 0)] * 2
    pinned, pageable = torch.randn(32, 16).pin_memory(), torch.randn(32, 16)
    splits = [[16, 16], [16, 16]]
    fcomm.scatter_leaves([pinned, pageable], devs, splits, [0, 0])
    _sync()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            fcomm.scatter_leaves([pinned, pageable], devs, splits, [0, 0])
        res["mixed"] = "captured (expected the clear error)"
    except Exception as e:  # noqa: BLE001
        res["mixed"] = _err(e)
        res["mixed_clear_error"] = bool(re.search(CLEAR, str(e)))
    p2 = torch.randn(32, 16).pin_memory()
    fcomm.scatter(p2, [0, 0], dim=1)
    _sync()
    g2 = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g2):
            parts = fcomm.scatter(p2, [0, 0], dim=1)
            out = torch.cat(parts, 1) * 2
        p2.copy_(torch.randn(32, 16))
        g2.replay()
        _sync()
        res["pinned_2d_replay_right"] = torch.equal(out.cpu(), p2 * 2)
    except Exception as e:  # noqa: BLE001
        res["pinned_2d_replay_right"] = _err(e)
    # A pinned chunk of two strided dims with narrow rows (a span copy): a host copy made at
    # capture time would not be redone by a replay; the DMA of the span is.
    p3 = torch.randn(16, 8, 96).pin_memory()
    v3 = p3[:, :, :48]
    fcomm.scatter(v3, [0, 0], dim=0)
    _sync()
    g4 = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g4):
            parts = fcomm.scatter(v3, [0, 0], dim=0)
            out3 = torch.cat(parts, 0) * 2
        p3.copy_(torch.randn(16, 8, 96))
        g4.replay()
        _sync()
        res["pinned_fallback_replay_right"] = torch.equal(out3.cpu(), v3 * 2)
    except Exception as e:  # noqa: BLE001
        res["pinned_fallback_replay_right"] = _err(e)
        res["pinned_fallback_clear_error"] = bool(re.search(CLEAR, str(e)))
    try:
        y = torch.randn(1 << 20)
        parts = fcomm.scatter(y, [0, 0])
        _sync()
        res["pageable_after_right"] = torch.equal(torch.cat([p.cpu() for p in parts]), y)
    except Exception as e:  # noqa: BLE001
        res["pageable_after_right"] = _err(e)
    g3 = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g3):
            torch.ones(4, device="cuda").mul_(2)
            fcomm.copy_stats()
        res["copy_stats_in_capture"] = "fine"
    except Exception as e:  # noqa: BLE001
        res["copy_stats_in_capture"] = _err(e)
    good = (
        res.get("mixed_clear_error") is True
        and res.get("pinned_2d_replay_right") is True
        and res.get("pageable_after_right") is True
        and (
            res.get("pinned_fallback_replay_right") is True
            or res.get("pinned_fallback_clear_error")
        )
    )
    res["status"] = "ok" if good else "bug"
    return res


# ------------------------------------------------------------------- pinned pool under load
@probe(timeout=60, env={"FASTDP_PINNED_POOL_MB": "2"})
def pool_threads():
    """4 threads scatter pageable 4 MiB tensors through a 2 MiB pool: waits outside the lock,
    'every block lent' fallbacks, event reuse; every result exact, nothing left lent."""
    torch = _torch()
    from fastdp import comm as fcomm

    results, errors = {}, []

    def work(k):
        gen = torch.Generator().manual_seed(k)
        try:
            for it in range(8):
                x = torch.randn(1024, 1024, generator=gen)
                results[(k, it)] = (x, fcomm.scatter(x, [0, 0]))
        except Exception as e:  # noqa: BLE001
            errors.append(_err(e))

    before = _stats()
    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _sync()
    wrong = [
        f"{k}"
        for k, (x, parts) in results.items()
        if not torch.equal(torch.cat([p.cpu() for p in parts]), x)
    ]
    after = _stats()
    ok = not errors and not wrong and after.get("lent") == 0 and after.get("reserved", 0) <= 2 << 20
    return {
        "status": "ok" if ok else "bug",
        "errors": errors,
        "wrong": wrong,
        "pool_before": before,
        "pool_after": after,
    }


@probe(timeout=60)
def pool_steady():
    """Pool size classes: after a warm-up, repeated pageable scatters allocate nothing (with and
    without a sync between calls). The GPU test of this runs under xdist; here it runs alone."""
    torch = _torch()
    from fastdp import comm as fcomm

    rows = []
    grew = False
    for mib in (16, 64):
        x = torch.randn(256, mib * 1024)  # rows of 64 KiB or 256 KiB
        for devs in ([0, 0], [0, 0, 0, 0]):
            for _ in range(5):  # warm-up as a training loop would: no sync between calls
                fcomm.scatter(x, devs)
            _sync()
            s0 = _stats()
            for _ in range(20):
                parts = fcomm.scatter(x, devs)
            _sync()
            s1 = _stats()
            for _ in range(10):
                parts = fcomm.scatter(x, devs)
                _sync()
            s2 = _stats()
            right = torch.equal(torch.cat([p.cpu() for p in parts]), x)
            d1 = {k: s1[k] - s0[k] for k in ("allocations", "waits", "frees")}
            d2 = {k: s2[k] - s1[k] for k in ("allocations", "waits", "frees")}
            # a block or two more while the DMA lags the packing is the warm-up finishing;
            # growth under synced calls, or steady growth, is the size classes failing
            grew = grew or d1["allocations"] > 2 or d2["allocations"] > 0 or not right
            rows.append(
                {
                    "MiB": mib,
                    "devices": len(devs),
                    "no_sync_x20": d1,
                    "sync_x10": d2,
                    "blocks": s2["blocks"],
                    "reserved": s2["reserved"],
                    "right": right,
                }
            )
    return {"status": "bug" if grew else "ok", "rows": rows}
