"""Probe of ZeroRedundancyOptimizer on a GPU (the quick check's zero stage): its owners' steps
against the unsharded optimizer, in the stage of its own with tests/test_gpu_zero.py."""

from common import _err, _sync, _torch, probe


def _twin_steps(torch, kw, launch, steps=5):
    """Five steps of a ZeRO-sharded and a plain AdamW, each on its own FastDataParallel over
    [0, 0] with the caller on a side stream; returns the two models' parameters and the owners."""
    import copy

    from torch import nn

    import fastdp

    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).cuda()]
    nets.append(copy.deepcopy(nets[0]))
    dps = [fastdp.FastDataParallel(n, device_ids=[0, 0]) for n in nets]
    zero = fastdp.ZeroRedundancyOptimizer(
        nets[0].parameters(), torch.optim.AdamW, launch=launch, lr=1e-2, **kw
    )
    opts = [zero, torch.optim.AdamW(nets[1].parameters(), lr=1e-2, **kw)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(steps):
            x = torch.randn(32, 64, device="cuda")
            for dp, opt in zip(dps, opts):
                opt.zero_grad()
                dp(x).square().mean().backward()
                opt.step()
    _sync()
    owners = sorted({zero.owner_of(p) for p in nets[0].parameters()})
    return list(nets[0].parameters()), list(nets[1].parameters()), owners


@probe(timeout=90, in_all=False)
def zero_steps():
    """ZeroRedundancyOptimizer on [0, 0] (two owners on one GPU, stepping the originals in place
    on the caller's streams) against the unsharded optimizer, bit for bit: AdamW foreach and
    fused, launch threads and inline, the caller on a side stream. Not bit-exact but within 1e-5
    is a note (a kernel's order), beyond it a bug."""
    torch = _torch()
    rows, bad, inexact = [], [], []
    for kw in ({"foreach": True}, {"fused": True}):
        for launch in ("threads", "inline"):
            case = f"AdamW {next(iter(kw))}, launch={launch}, side stream"
            try:
                got, want, owners = _twin_steps(torch, kw, launch)
                diff = max((p - q).abs().max().item() for p, q in zip(got, want))
                exact = all(torch.equal(p, q) for p, q in zip(got, want))
                rows.append({"case": case, "bit_exact": exact, "max_abs_diff": diff,
                             "owners": owners})  # fmt: skip
                if diff > 1e-5 or owners != [0, 1]:
                    bad.append(case)
                elif not exact:
                    inexact.append(case)
            except Exception as e:  # noqa: BLE001
                rows.append({"case": case, "error": _err(e)})
                bad.append(case)
    status = "bug" if bad else ("note" if inexact else "ok")
    return {"status": status, "wrong": bad, "not_bit_exact": inexact, "cases": rows}
