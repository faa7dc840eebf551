import sys, time, torch, os
torch.set_num_threads(1)
from fastdp.bench import modes
from fastdp.bench import workloads as wl
import fastdp._replica_set as RS, fastdp._snapshots as SN
variant = sys.argv[2]
if "notaint" in variant:
    RS.ReplicaSet._tainted = lambda self: False
if "nosnap" in variant:
    SN.ReplicaAttrs.undo_forward_writes = lambda self: False
name = sys.argv[1]
w = wl.catalogue("cpu")[name]
torch.manual_seed(0)
model, args = wl.build(w, "cpu"), wl.make_inputs(w, "cpu")
import contextlib
stack = contextlib.ExitStack()
steps = {}
for mode in ("floor", "fastdp_noext"):
    obj = stack.enter_context(modes.wrapped(mode, model, ["cpu"] * 4))
    steps[mode] = modes.in_mode(mode, modes.train_step(obj, args))
    for _ in range(5): steps[mode]()
times = {m: [] for m in steps}
for r in range(15):
    for m, s in steps.items():
        t = time.perf_counter()
        for _ in range(10): s()
        times[m].append((time.perf_counter() - t) / 10)
med = {m: sorted(v)[len(v)//2] for m, v in times.items()}
print(name, variant, f"noext x{med['fastdp_noext']/med['floor']:.3f} overhead {1e3*(med['fastdp_noext']-med['floor']):.2f}ms floor {med['floor']*1e3:.2f}ms")
