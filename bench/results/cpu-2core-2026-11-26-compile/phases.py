import sys, time, torch, collections
torch.set_num_threads(1)
import fastdp
from fastdp.data_parallel import FastDataParallel as F
from fastdp.bench import modes
from fastdp.bench.suite_compile import gelu_mlp
acc = collections.defaultdict(float)
def timed(cls, name):
    f = getattr(cls, name)
    def w(*a, **k):
        t = time.perf_counter_ns()
        try:
            return f(*a, **k)
        finally:
            acc[name] += time.perf_counter_ns() - t
    setattr(cls, name, w)
for name in ("_start_step", "_plan", "scatter", "_replicate_step", "_launch_step", "_gather_step"):
    timed(F, name)
import fastdp._runners as R
orig_rit = R.run_in_turn
n, width = 2, 64
torch.manual_seed(0)
model = gelu_mlp(width).train()
args = (torch.randn(width, width),)
cm = torch.compile(model)
fdp = F(cm, device_ids=["cpu"] * n)
def step():
    t0 = time.perf_counter_ns()
    out = fdp(*args)
    t1 = time.perf_counter_ns()
    acc["forward total"] += t1 - t0
    loss = modes.loss_of(out)
    t2 = time.perf_counter_ns()
    acc["loss"] += t2 - t1
    loss.backward()
    acc["backward"] += time.perf_counter_ns() - t2
# module time inside launch: wrap the compiled replicas' forward via a forward pre/post hook is costly; time module calls directly
for _ in range(20): step()
acc.clear()
N = 2000
for _ in range(N): step()
for k, v in acc.items():
    print(f"{k:16s} {v / N / 1e3:8.1f} us")
# compiled module alone on 2 chunks (what launch spends in the modules)
chunks = [c for c in args[0].chunk(2)]
t = time.perf_counter_ns()
for _ in range(N):
    outs = [cm(c) for c in chunks]
print(f"{'2 module calls':16s} {(time.perf_counter_ns() - t) / N / 1e3:8.1f} us (floor's forward, no grad-free)")
t = time.perf_counter_ns()
for _ in range(N):
    o = torch.cat([cm(c) for c in chunks]); l = modes.loss_of(o); l.backward()
print(f"{'floor step':16s} {(time.perf_counter_ns() - t) / N / 1e3:8.1f} us")
# launch internals
import fastdp._runners as R, fastdp._launch as L
acc.clear()
timed(F, "parallel_apply")
import fastdp.data_parallel as DPM
orig = R.run_in_turn
def rit(*a, **k):
    t = time.perf_counter_ns()
    try:
        return orig(*a, **k)
    finally:
        acc["run_in_turn"] += time.perf_counter_ns() - t
L.run_in_turn = rit if hasattr(L, "run_in_turn") else None
R.run_in_turn = rit
for _ in range(N): step()
for k, v in acc.items():
    print(f"{k:16s} {v / N / 1e3:8.1f} us")
rs = next(iter(fdp._replica_sets.values()))
reps = rs.replicas
t = time.perf_counter_ns()
for _ in range(N):
    outs = [r(c) for r, c in zip(reps, chunks)]
print(f"{'replicas direct':16s} {(time.perf_counter_ns() - t) / N / 1e3:8.1f} us")
print([type(r).__name__ for r in reps], L.__dict__.get("run_in_turn"))
from fastdp._compiled import backward_with_forward
from fastdp._torch_private import record_function
def timeit(label, fn):
    for _ in range(50): fn()
    t = time.perf_counter_ns()
    for _ in range(N): fn()
    print(f"{label:28s} {(time.perf_counter_ns() - t) / N / 1e3:8.1f} us")
def direct():
    return [r(c) for r, c in zip(reps, chunks)]
def in_bwf():
    with backward_with_forward():
        return [r(c) for r, c in zip(reps, chunks)]
def in_rf():
    with record_function("x"):
        return [r(c) for r, c in zip(reps, chunks)]
scat = fdp.scatter(args, {}, fdp.device_ids)[0]
def scattered():
    return [r(*c) for r, c in zip(reps, scat)]
def cm_twice():
    return [cm(c) for c in chunks]
for lab, fn in [("direct", direct), ("in backward_with_forward", in_bwf), ("in record_function", in_rf), ("scatter outputs", scattered), ("cm twice", cm_twice), ("direct", direct)]:
    timeit(lab, fn)
calls_t = [0, 0]
def rit2(modules, inputs, kwargs, devices):
    out = []
    for i, module in enumerate(modules):
        inp = inputs[i]
        if not isinstance(inp, (list, tuple)):
            inp = (inp,)
        t = time.perf_counter_ns()
        out.append(module(*inp, **kwargs[i]))
        calls_t[i] += time.perf_counter_ns() - t
    return out
R.run_in_turn = rit2; L.run_in_turn = rit2
acc.clear()
for _ in range(N): step()
print("in-step module calls:", [round(c / N / 1e3, 1) for c in calls_t], {k: round(v / N / 1e3, 1) for k, v in acc.items()})
def step_no_bw():
    out = fdp(*args)
    return out
calls_t[:] = [0, 0]
for _ in range(N): step_no_bw()
print("forward-only steps, module calls:", [round(c / N / 1e3, 1) for c in calls_t])
cnt = collections.Counter()
import fastdp._replica_set as RSM
op = RSM.ReplicaSet._point_slots
def ps(self):
    cnt["point_slots"] += 1
    return op(self)
RSM.ReplicaSet._point_slots = ps
ou = SNM.ReplicaAttrs.undo_forward_writes if False else None
import fastdp._snapshots as SNM
ou = SNM.ReplicaAttrs.undo_forward_writes
def uf(self):
    r = ou(self)
    cnt["undo_true" if r else "undo_false"] += 1
    if r and cnt["printed"] < 1:
        cnt["printed"] += 1
        ch = self.snap.changed() if self.snap is not None else "snap None"
        print("changed dicts:", ch)
    return r
SNM.ReplicaAttrs.undo_forward_writes = uf
ot = RSM.ReplicaSet._tainted
def tt(self):
    r = ot(self); cnt["tainted" if r else "clean"] += 1; return r
RSM.ReplicaSet._tainted = tt
for _ in range(100): step()
print(cnt)
ft = [0, 0]
def floor_step():
    outs = []
    for i, c in enumerate(chunks):
        t = time.perf_counter_ns()
        outs.append(cm(c))
        ft[i] += time.perf_counter_ns() - t
    l = modes.loss_of(torch.cat(outs)); l.backward()
for _ in range(50): floor_step()
ft[:] = [0, 0]
t = time.perf_counter_ns()
for _ in range(N): floor_step()
tot = (time.perf_counter_ns() - t) / N / 1e3
print("floor in-step module calls:", [round(c / N / 1e3, 1) for c in ft], "step", round(tot, 1))
calls_t[:] = [0, 0]
t = time.perf_counter_ns()
for _ in range(N): step()
tot = (time.perf_counter_ns() - t) / N / 1e3
print("fdp in-step module calls:", [round(c / N / 1e3, 1) for c in calls_t], "step", round(tot, 1))
