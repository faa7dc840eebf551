#!/usr/bin/env bash
# The GPU runbook: one stage per device command, each well inside 10 minutes on one H100 (16 cores).
#
#   bash tests/gpu.sh STAGE [OUTDIR]      STAGE: build | check | sanitize | bench | all | quick
#
#   quick     ONE device command under 9 minutes (tests/gpu_quick.sh): build, the probes of
#             every CUDA path, ZeroRedundancyOptimizer's, the key bench rows, the CUDA paths'
#             test files, compute-sanitizer on a small subset, each stage time-boxed; a summary
#             printed last. For a short GPU loan; the four stages below are the full runbook
#             (18-22 minutes).
#
#   build     pip install --no-build-isolation --no-deps -e . against the machine's own torch
#             (never a build carried from elsewhere), then python -m fastdp.info; fails unless
#             the extension was built with CUDA.
#   check     python -m fastdp.doctor (every path bit-exact vs torch, the kernels at real sizes on
#             every GPU, P2P, NCCL, training parity),
#             then the whole pytest suite (its GPU tests run, multi-GPU ones skip on one GPU;
#             12 pytest-xdist workers where xdist is installed, as on the device image).
#   sanitize  compute-sanitizer memcheck, racecheck and synccheck, each over the doctor's one-GPU
#             checks ([0,0]: every scatter/gather/broadcast/reduce/refresh path and a training
#             step) and its kernel checks on their --quick cases (every kernel called directly:
#             host<->GPU, GPU to itself, a 1 MiB pinned pool, a side stream), each under its own
#             time limit.
#   bench     python -m fastdp.bench, the GPU suites this machine can run (gpu-comm,
#             gpu-replicate, gpu-steps with its x-floor ratio, overhead-cuda; multigpu-* on 2+
#             GPUs), no plots.
#
# Each stage writes OUTDIR/STAGE.log and OUTDIR/STAGE.json ({stage, rc, seconds, dry_run, ...});
# check adds OUTDIR/doctor.json, bench OUTDIR/bench/{results.json,table.txt}. OUTDIR defaults to
# $OUT (the device machine's return folder), else gpu-out/. Exit status: the stage's.
# FASTDP_GPU_DRY_RUN=1 runs every stage's plumbing on a CPU machine (CI): no install, the CPU
# checks, the doctor without the sanitizer, the bench's --gpu-dry-run --tiny.
# PYTHON picks the interpreter (default python3: the one that holds torch on the device machine).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:-}
OUTDIR=${2:-${OUT:-gpu-out}}
PY=${PYTHON:-python3}
DRY=${FASTDP_GPU_DRY_RUN:-0}
export PYTHONUNBUFFERED=1
mkdir -p "$OUTDIR"

record() {  # record STAGE RC SECONDS [key=value ...]: OUTDIR/STAGE.json
  local stage=$1 rc=$2 secs=$3
  shift 3
  "$PY" - "$OUTDIR/$stage.json" "$stage" "$rc" "$secs" "$DRY" "$@" <<'EOF'
import json, sys
path, stage, rc, secs, dry, *kv = sys.argv[1:]
rec = {"stage": stage, "rc": int(rc), "seconds": int(secs), "dry_run": dry == "1"}
rec.update(dict(x.split("=", 1) for x in kv))
json.dump(rec, open(path, "w"), indent=1)
print(f"gpu.sh: {stage} rc={rc} in {secs} s -> {path}")
EOF
}

stage_build() {
  if [ "$DRY" = 1 ]; then
    echo "dry run: would run $PY -m pip install --no-build-isolation --no-deps -e ."
  else
    MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install --no-build-isolation --no-deps -e . ||
      return 1
  fi
  "$PY" -m fastdp.info || return 1
  [ "$DRY" = 1 ] || "$PY" -c "import fastdp, sys; sys.exit(not fastdp.info()['built_with_cuda'])" ||
    { echo "gpu.sh: the extension was not built with CUDA"; return 1; }
}

stage_check() {
  local rc=0
  "$PY" -m fastdp.doctor --json "$OUTDIR/doctor.json" || rc=1
  if [ "$DRY" = 1 ]; then  # the plumbing, not the suite (CI runs the suite itself)
    "$PY" -m pytest tests/test_scatter_cross_device_copies.py tests/test_tools_cuda_build.py -q \
      -p no:cacheprovider || rc=1
  else
    # Serially the suite needs ~30 min on an H100 machine; 12 xdist workers took 286 s there
    # (2026-11-24), and a test that crashes its worker is reported instead of ending the run.
    local par=()
    "$PY" -c "import xdist" 2>/dev/null && par=(-n 12)
    timeout 480 "$PY" -m pytest tests -q -rfE --maxfail=25 -p no:cacheprovider "${par[@]}" || rc=1
  fi
  return $rc
}

stage_sanitize() {
  local rc=0 tool san
  san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null |
        head -1)
  for tool in memcheck racecheck synccheck; do
    echo "=== $tool ==="
    if [ "$DRY" = 1 ]; then
      echo "dry run: would run ${san:-compute-sanitizer} --tool $tool --error-exitcode 3" \
           "$PY -m fastdp.doctor --quick -k [0,0] -k kernels"
      "$PY" -m fastdp.doctor --quick -k cpu -k kernels || rc=1
    elif [ -z "$san" ]; then
      echo "gpu.sh: compute-sanitizer not found"; return 1
    else
      # No caching allocator under memcheck: out-of-bounds accesses inside a cached block show.
      local nocache=()
      [ "$tool" = memcheck ] && nocache=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
      env "${nocache[@]}" timeout 170 "$san" --tool "$tool" --error-exitcode 3 --print-limit 20 \
        "$PY" -m fastdp.doctor --quick -k "[0,0]" -k kernels ||
        { echo "gpu.sh: $tool failed (rc $?)"; rc=1; }
    fi
  done
  return $rc
}

stage_bench() {
  if [ "$DRY" = 1 ]; then
    "$PY" -m fastdp.bench --gpu-dry-run --tiny --suite gpu-comm gpu-steps --replicas 2 \
      --out "$OUTDIR/bench" --no-plots --no-progress
  else
    local suites="gpu-comm gpu-replicate gpu-steps overhead-cuda"
    [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ] &&
      suites="$suites multigpu-comm multigpu-replicate multigpu-steps"
    # shellcheck disable=SC2086
    timeout 560 "$PY" -m fastdp.bench --suite $suites --out "$OUTDIR/bench" --no-plots \
      --no-progress
  fi
}

run_stage() {
  local stage=$1 start rc
  start=$(date +%s)
  echo "=== gpu.sh $stage (dry run: $DRY) ===" | tee "$OUTDIR/$stage.log"
  "stage_$stage" >>"$OUTDIR/$stage.log" 2>&1
  rc=$?
  tail -n 40 "$OUTDIR/$stage.log"
  record "$stage" "$rc" "$(( $(date +%s) - start ))" "log=$stage.log"
  return $rc
}

case "$STAGE" in
  build | check | sanitize | bench) run_stage "$STAGE" ;;
  quick) exec bash tests/gpu_quick.sh "${2:-${OUT:-gpu-out/quick}}" ;;
  all)  # the dry run's way to prove every stage; on a GPU, one stage per device command
    rc=0
    for s in build check sanitize bench; do run_stage "$s" || rc=1; done
    exit $rc ;;
  *) echo "usage: bash tests/gpu.sh build|check|sanitize|bench|all|quick [OUTDIR]" >&2; exit 2 ;;
esac
