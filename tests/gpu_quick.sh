#!/usr/bin/env bash
# The quick GPU check: ONE device command (under 9 minutes on one H100/H200 of 16 cores) that
# builds the extension, probes every CUDA path (tests/gpu_quick/: each copy kind, the pinned pool
# under load and under graph capture, stream order, pitch and staging limits, the bucket node's
# sums), steps ZeroRedundancyOptimizer, takes the key bench rows, runs the GPU test files and
# compute-sanitizer on a small subset.
#
#   bash tests/gpu.sh quick [OUTDIR]      (or bash tests/gpu_quick.sh OUTDIR)
#
# OUTDIR (default $OUT, else gpu-out/quick) receives: summary.txt (stage table, probe verdicts,
# key bench rows; also printed last), build.log, probes.log, probes.json, zero.log,
# zero-probes.json, bench.log, bench.json, tests.log, sanitize.log, doctor.json. Stages run in
# priority order under one deadline (GPU_CHECK_BUDGET_S, default 505 s); each has its own cap and
# a failing stage never stops the next one (only a failed build does); a stage stopped at the
# deadline's shorter limit is CUT, no failure. Each stage runs in a process group of its own and
# its pytest is verbose (failed ids survive a kill). Knobs: PYTHON, GPU_CHECK_SKIP="stage ...",
# GPU_CHECK_PROBE_S (each header probe's limit, default 45), XDIST_WORKERS (default 10),
# PROBE_BIG=0 (skips the 4 GiB pitch probe).
# FASTDP_GPU_DRY_RUN=1 runs the plumbing on a CPU machine (CI): no install, probes skip, the
# benches' --gpu-dry-run --tiny, the CPU halves of the test files, no sanitizer.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
OUTDIR=${1:-${OUT:-gpu-out/quick}}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
PY=${PYTHON:-python3}
DRY=${FASTDP_GPU_DRY_RUN:-0}
BUDGET=${GPU_CHECK_BUDGET_S:-505}
DEADLINE=$((START + BUDGET))
RESERVE=15
SKIP=" ${GPU_CHECK_SKIP:-} "
SUMMARY=$OUTDIR/summary.txt
export OUTDIR PY DRY PYTHONUNBUFFERED=1
: >"$SUMMARY"
for f in build probes zero bench tests sanitize; do : >"$OUTDIR/$f.log"; done

# run_stage and quick_verdict: each stage in a process group of its own, under its limit.
source tests/gpu_quick/stages.sh
PROBE_S=${GPU_CHECK_PROBE_S:-45}  # each of the header's probes (a broken driver hangs there)

{
  echo "gpu.sh quick  $(date -u +%FT%TZ)  budget=${BUDGET}s  dry_run=$DRY"
  echo "tree: $(git rev-parse --short HEAD 2>/dev/null || echo '?')," \
    "$(git status --porcelain 2>/dev/null | wc -l) changed paths"
  if command -v nvidia-smi >/dev/null; then
    timeout -k 5 "$PROBE_S" nvidia-smi --query-gpu=name,driver_version,memory.total \
      --format=csv,noheader 2>&1 | head -4 || echo "nvidia-smi: rc=$? (limit ${PROBE_S}s)"
  fi
  timeout -k 5 "$PROBE_S" "$PY" -c "import torch, sys; print('python', sys.version.split()[0],
    'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())" \
    2>&1 || echo "first torch import: rc=$? (limit ${PROBE_S}s)"
  echo "cores: $(nproc)  xdist: $(timeout -k 5 "$PROBE_S" "$PY" -c 'import xdist; print("yes")' \
    2>/dev/null || echo no)"
  echo
  echo "stage        result  rc   time"
} >>"$SUMMARY" 2>&1

B=(--no-plots --no-progress)
if [ "$DRY" = 1 ]; then
  BUILD='echo "dry run: would run MAX_JOBS=$(nproc) FASTDP_FORCE_CUDA=1 $PY -m pip install \
    --no-build-isolation --no-deps -e ."; "$PY" -m fastdp.info'
  BENCH_COMM="--gpu-dry-run --tiny --replicas 2"
  BENCH_STEPS="--gpu-dry-run --tiny --replicas 2"
  CORE="tests/test_scatter_pinned_pool.py tests/test_gpu_copy_order.py
    tests/test_gpu_pool_and_streams.py"
  ZERO="tests/test_gpu_zero.py tests/test_optim_zero_contract.py"
  SAN_CMD='echo "dry run: would run compute-sanitizer memcheck/racecheck/synccheck over" \
    "doctor --quick -k [0,0] -k kernels and memcheck over the probes san_subset";
    "$PY" -m fastdp.doctor --quick -k cpu -k kernels'
  DOCTOR_ARGS="--quick -k cpu"
  PAR=""
else
  BUILD='MAX_JOBS=$(nproc) FASTDP_FORCE_CUDA=1 "$PY" -m pip install --no-build-isolation \
    --no-deps -e . && "$PY" -m fastdp.info &&
    "$PY" -c "import fastdp, sys; sys.exit(not fastdp.info()[\"built_with_cuda\"])"'
  BENCH_COMM=""
  BENCH_STEPS="--replicas 2"
  CORE="tests/test_gpu_copy_order.py tests/test_gpu_pool_and_streams.py
    tests/test_scatter_ext.py tests/test_gather_ext.py tests/test_scatter_comm_calls.py
    tests/test_replicas_broadcast_cache.py tests/test_scatter_pinned_pool.py
    tests/test_scatter_host_copy_route.py tests/test_scatter_cross_device_copies.py
    tests/test_gpu_parity.py tests/test_tools_cuda_build.py tests/test_scatter_gather_same_device.py
    tests/test_upstream_comm.py tests/test_reduce_reducer.py tests/test_reduce_buckets.py
    tests/test_reduce_distinct_replicas.py"
  ZERO="tests/test_gpu_zero.py"
  SAN_CMD='bash tests/gpu_quick/sanitize.sh'
  DOCTOR_ARGS=""
  PAR=""
  "$PY" -c "import xdist" 2>/dev/null && PAR="-n ${XDIST_WORKERS:-10}"
fi
export BENCH_COMM BENCH_STEPS CORE ZERO PAR DOCTOR_ARGS

# 1. build: nothing else can run without it.
run_stage build 300 "$OUTDIR/build.log" "$BUILD"
rc=$?
if [ "$rc" -ne 0 ] && [ "$rc" -ne 99 ]; then
  echo "build failed: no other stage can run (see build.log)" >>"$SUMMARY"
  tail -n 30 "$OUTDIR/build.log"
  cat "$SUMMARY"
  exit 1
fi
# 2. the probes, one process each, most telling first.
run_stage probes 140 "$OUTDIR/probes.log" \
  '"$PY" tests/gpu_quick/run_probes.py --all --json "$OUTDIR/probes.json" \
     --budget $((STAGE_LIM - 5))'
# 3. ZeroRedundancyOptimizer on the GPU: its probe (owners on [0, 0] against the unsharded AdamW,
#    foreach and fused, threads and inline, a side stream) and its test file.
run_stage zero 90 "$OUTDIR/zero.log" \
  '"$PY" tests/gpu_quick/run_probes.py --all --plan zero --json "$OUTDIR/zero-probes.json" \
     --budget $((STAGE_LIM / 2)) && "$PY" -m pytest $ZERO -v -rfE -p no:cacheprovider'
# 4. comm and replicate rows: scatter pinned/pageable/same-device vs torch and the H2D limit,
#    gather, broadcast_coalesced, replicate().
run_stage bench-comm 80 "$OUTDIR/bench.log" \
  '"$PY" -m fastdp.bench --suite gpu-comm gpu-replicate $BENCH_COMM --out "$OUTDIR/bench-comm" \
     --no-plots --no-progress && cat "$OUTDIR/bench-comm/table.txt"'
# 5. the test files of the CUDA paths (GPU tests run; multi-GPU ones skip on one GPU).
run_stage tests-core 170 "$OUTDIR/tests.log" \
  '"$PY" -m pytest $CORE -v -rfE --maxfail=40 -p no:cacheprovider $PAR'
# 6. compute-sanitizer on the quick subsets, each run under a quarter of what the stage leaves.
run_stage sanitize 140 "$OUTDIR/sanitize.log" "$SAN_CMD"
# 7. training steps against nn.DataParallel (2 replicas on cuda:0).
run_stage bench-steps 150 "$OUTDIR/bench.log" \
  '"$PY" -m fastdp.bench --suite gpu-steps $BENCH_STEPS --out "$OUTDIR/bench-steps" \
     --no-plots --no-progress && cat "$OUTDIR/bench-steps/table.txt"'
# 8. the doctor: every path bit-exact against torch at real sizes.
run_stage doctor 45 "$OUTDIR/tests.log" '"$PY" -m fastdp.doctor $DOCTOR_ARGS --json \
  "$OUTDIR/doctor.json"'
# 9. the wider end-to-end files, in whatever time is left (not in the dry run).
if [ "$DRY" = 1 ]; then
  printf '%-12s SKIPPED (dry run)\n' tests-wide >>"$SUMMARY"
else
  run_stage tests-wide 400 "$OUTDIR/tests.log" \
    '"$PY" -m pytest tests/test_upstream_data_parallel.py tests/test_launch_strategies.py \
       tests/test_contract_module.py -v -rfE --maxfail=40 -p no:cacheprovider $PAR'
fi

timeout 20 "$PY" tests/gpu_quick/summarize.py "$OUTDIR" >>"$SUMMARY" 2>&1 ||
  echo "summarize failed" >>"$SUMMARY"
echo "total $(($(date +%s) - START)) s; files: $(cd "$OUTDIR" && ls | tr '\n' ' ')" >>"$SUMMARY"
cat "$SUMMARY"
quick_verdict
