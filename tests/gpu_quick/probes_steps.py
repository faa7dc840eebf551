"""Probes of whole steps: the bucket node's in-place sums, a small step bench against
nn.DataParallel, a step under a side stream, comm.scatter's streams=, and the compute-sanitizer
subset (every changed copy path once, small)."""

from common import _err, _sync, _time, _torch, probe


# ------------------------------------------------------------------ bucket node sums on a GPU
@probe(timeout=60)
def inplace_sums():
    """The C++ bucket node on [0,0] and [0,0,0,0]: in-place sums into replica 0's gradients
    (NOTE [ Summing in place ]) give the plain module's gradients; sums_out_of_place stays 0 for a
    Linear stack."""
    torch = _torch()
    import copy

    from torch import nn

    from fastdp import FastDataParallel

    rows = []
    bad = slow = False
    for ids in ([0, 0], [0, 0, 0, 0]):
        torch.manual_seed(0)
        model = nn.Sequential(
            *[m for _ in range(4) for m in (nn.Linear(256, 256), nn.ReLU())]
        ).cuda()
        ref = copy.deepcopy(model)
        dp = FastDataParallel(model, device_ids=ids)
        worst = 0.0
        for _ in range(3):
            x = torch.randn(64, 256, device="cuda")
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            dp(x).square().sum().backward()
            ref(x).square().sum().backward()
            for p, q in zip(model.parameters(), ref.parameters()):
                worst = max(
                    worst, ((p.grad - q.grad).abs().max() / (q.grad.abs().max() + 1e-12)).item()
                )
            with torch.no_grad():
                for p, q in zip(model.parameters(), ref.parameters()):
                    p.sub_(0.01 * p.grad)
                    q.sub_(0.01 * q.grad)
        stats = dp.comm_stats()
        bad = bad or not worst < 1e-4
        slow = slow or stats.get("sums_out_of_place", 0) > 0  # right, one allocation more each
        rows.append({"device_ids": ids, "max_rel_grad_diff": worst, "comm_stats": stats})
    return {"status": "bug" if bad else ("note" if slow else "ok"), "rows": rows}


# ----------------------------------------------------------- a small step bench (fallback row)
@probe(timeout=90)
def steps_mini():
    """bare vs nn.DataParallel vs FastDataParallel on [0,0], an 8 x Linear(2048) MLP, batch 1024,
    inputs on cuda:0, pinned and pageable. Medians of 10 steps (ms); a fallback for gpu-steps."""
    torch = _torch()
    from torch import nn

    from fastdp import FastDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(2048, 2048), nn.ReLU())]).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    wrappers = {
        "bare": model,
        "torch_dp": nn.DataParallel(model, device_ids=[0, 0]),
        "fastdp": FastDataParallel(model, device_ids=[0, 0]),
    }
    xs = {"cuda": torch.randn(1024, 2048, device="cuda")}
    xs["pinned"] = xs["cuda"].cpu().pin_memory()
    xs["pageable"] = xs["cuda"].cpu()
    rows = []
    for where, x in xs.items():
        row = {"input": where}
        for name, w in wrappers.items():

            def step(w=w, x=x, name=name):
                opt.zero_grad(set_to_none=True)
                inp = x.to("cuda", non_blocking=True) if name == "bare" else x
                w(inp).square().mean().backward()
                opt.step()

            try:
                for _ in range(3):
                    step()
                row[name] = round(_time(step), 2)
            except Exception as e:  # noqa: BLE001
                row[name] = _err(e)
        if isinstance(row.get("fastdp"), float) and isinstance(row.get("torch_dp"), float):
            row["fastdp_x_torch_dp"] = round(row["fastdp"] / row["torch_dp"], 3)
        rows.append(row)
    return {"status": "ok", "rows": rows}


@probe(timeout=60)
def side_stream_step():
    """Training under ``with torch.cuda.stream(s)`` (a side stream): the backward reduce must
    read the gradients after the side stream produced them. [0,0] always; [0,1] (distinct GPUs,
    the reduce in autograd's device thread of cuda:1) when there are two GPUs."""
    torch = _torch()
    import copy

    from torch import nn

    from fastdp import FastDataParallel

    rows, bad = [], False
    ids_list = [[0, 0]] + ([[0, 1]] if torch.cuda.device_count() >= 2 else [])
    for ids in ids_list:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512)).cuda()
        ref = copy.deepcopy(model)
        dp = FastDataParallel(model, device_ids=ids)
        side = torch.cuda.Stream()
        worst = 0.0
        for _ in range(3):
            x = torch.randn(256, 512, device="cuda")
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(20_000_000)  # the gradients land late on the side stream
                dp(x).square().sum().backward()
            torch.cuda.current_stream().wait_stream(side)
            ref(x).square().sum().backward()
            _sync()
            for p, q in zip(model.parameters(), ref.parameters()):
                diff = (p.grad - q.grad).abs().max() / (q.grad.abs().max() + 1e-12)
                worst = max(worst, diff.item())
        bad = bad or not worst < 1e-4
        rows.append({"device_ids": ids, "max_rel_grad_diff": worst})
    return {"status": "bug" if bad else "ok", "rows": rows}


@probe(timeout=45)
def scatter_streams():
    """comm.scatter(..., streams=): each chunk's copy on the stream given for it, as torch's
    (the chunk must be ready once that stream is synchronised, whatever the current stream)."""
    torch = _torch()
    from fastdp import comm as fcomm

    x = torch.randn(1 << 12, 1 << 10).pin_memory()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda._sleep(50_000_000)  # the current stream is busy: a copy there would lag
    parts = fcomm.scatter(x, [0, 0], streams=streams)
    for s in streams:
        s.synchronize()
    busy = not torch.cuda.current_stream().query()
    with torch.cuda.stream(streams[0]):  # read on a given stream, not behind the current one
        got = torch.cat([p.to("cpu") for p in parts])
    right = torch.equal(got, x)
    _sync()
    return {"status": "ok" if right else "bug", "right": right, "current_still_busy": busy}


# ---------------------------------------- the compute-sanitizer subset (not part of --all)
@probe(timeout=120, in_all=False)
def san_subset():
    """Every changed copy path once, small, no sleeps: for compute-sanitizer memcheck."""
    torch = _torch()
    from torch import nn

    from fastdp import FastDataParallel, _backend
    from fastdp import comm as fcomm

    ext = _backend.ext()
    checks = {}
    p = torch.randn(64, 97).pin_memory()
    for dim in (0, 1):
        parts = fcomm.scatter(p, [0, 0, 0], dim=dim)
        _sync()
        checks[f"pinned dim{dim}"] = torch.equal(torch.cat([q.cpu() for q in parts], dim), p)
    q3 = torch.randn(6, 5, 7).pin_memory()[:, :, :4]
    parts = fcomm.scatter(q3, [0, 0], dim=0)
    _sync()
    checks["pinned 3-D slice"] = torch.equal(torch.cat([q.cpu() for q in parts], 0), q3)
    old = ext.pinned_pool_set_capacity(1 << 20)
    try:
        x = torch.randn(3 * (1 << 18) + 5, 3)  # ~9 MiB through 512 KiB windows
        parts = fcomm.scatter(x, [0, 0])
        _sync()
        checks["pageable windows, 1 MiB pool"] = torch.equal(torch.cat([q.cpu() for q in parts]), x)
    finally:
        ext.pinned_pool_set_capacity(old)
    base = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, device="cuda")
    odd = [base[1:1001].view(500, 2), base[3:3003].view(1500, 2), base[7:2007].view(1000, 2)]
    out = fcomm.gather(odd, 0, 0)  # misaligned byte sources: narrow units in multi_copy
    _sync()
    checks["gather on device, odd offsets"] = torch.equal(out, torch.cat(odd))
    parts = [torch.randn(33, 5, device="cuda").half(), torch.randn(7, 5, device="cuda").half()]
    parts.append(torch.randn(5, 20, device="cuda").half().t()[:11])  # strided source
    out = fcomm.gather(parts, 0, 0)
    _sync()
    checks["gather on device, strided fp16"] = torch.equal(out, torch.cat(parts))
    host = fcomm.gather(parts, 0, -1)
    checks["gather to host"] = torch.equal(host, torch.cat(parts).cpu())
    ts = [torch.randn(n, device="cuda") for n in (3, 1000, 70001)]
    rows = fcomm.broadcast_coalesced(ts, [0, 0, 0])
    _sync()
    checks["broadcast_coalesced [0,0,0]"] = all(
        torch.equal(a, b) for r in rows for a, b in zip(r, ts)
    )
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
    dp = FastDataParallel(model, device_ids=[0, 0])
    for _ in range(2):
        dp(torch.randn(16, 32).pin_memory()).sum().backward()
    _sync()
    checks["training step [0,0] from pinned"] = all(q.grad is not None for q in model.parameters())
    bad = [k for k, v in checks.items() if not v]
    return {"status": "ok" if not bad else "bug", "checks": checks}
