import sys, time, torch
torch.set_num_threads(1)
from fastdp.bench import modes
from fastdp.bench import workloads as wl
name = sys.argv[1]; reps = int(sys.argv[2]) if len(sys.argv) > 2 else 15
w = wl.catalogue("cpu")[name]
torch.manual_seed(0)
model, args = wl.build(w, "cpu"), wl.make_inputs(w, "cpu")
import contextlib
stack = contextlib.ExitStack()
steps = {}
for mode in ("floor", "fastdp", "fastdp_noext"):
    obj = stack.enter_context(modes.wrapped(mode, model, ["cpu"] * 4))
    steps[mode] = modes.in_mode(mode, modes.train_step(obj, args))
    for _ in range(5): steps[mode]()
times = {m: [] for m in steps}
for r in range(reps):
    for m, s in steps.items():
        t = time.perf_counter()
        for _ in range(10): s()
        times[m].append((time.perf_counter() - t) / 10)
med = {m: sorted(v)[len(v)//2] for m, v in times.items()}
mn = {m: min(v) for m, v in times.items()}
print(name, " ".join(f"{m}: med x{med[m]/med['floor']:.3f} min x{mn[m]/mn['floor']:.3f}" for m in ("fastdp", "fastdp_noext")), f"floor {med['floor']*1e3:.2f}ms")
