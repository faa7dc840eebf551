#!/usr/bin/env bash
# The quick check's sanitize stage: compute-sanitizer memcheck, racecheck and synccheck over the
# doctor's [0,0] and kernel checks (--quick), then memcheck over the probes' san_subset. Each of
# the four runs gets a quarter of the stage's limit (STAGE_LIM, set by run_stage) less a margin
# for its kill grace, so all four end inside the stage; `timeout --foreground` keeps each in the
# stage's process group (tests/gpu_quick/stages.sh). SANITIZER: the binary (default: found).
set -uo pipefail
PY=${PY:-${PYTHON:-python3}}
san=${SANITIZER:-$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer \
  2>/dev/null | head -1)}
[ -n "$san" ] || { echo "compute-sanitizer not found"; exit 1; }
per=$(((${STAGE_LIM:-120} - 30) / 4))
[ "$per" -lt 2 ] && per=2
echo "each run's limit: ${per}s (+5 s to die) of the stage's ${STAGE_LIM:-120}s"
run() {  # run TOOL NOCACHE ARGS...: one sanitizer run under its limit
  local tool=$1 nocache=$2
  shift 2
  env ${nocache:+PYTORCH_NO_CUDA_MEMORY_CACHING=1} timeout --foreground -k 5 "$per" "$san" \
    --tool "$tool" --error-exitcode 3 --print-limit 20 "$@"
}
rc=0
for tool in memcheck racecheck synccheck; do
  echo "=== $tool: doctor --quick -k [0,0] -k kernels ==="
  nocache=""
  [ "$tool" = memcheck ] && nocache=1
  run "$tool" "$nocache" "$PY" -m fastdp.doctor --quick -k "[0,0]" -k kernels ||
    { echo "$tool rc=$?"; rc=1; }
done
echo "=== memcheck: probes san_subset ==="
run memcheck 1 "$PY" tests/gpu_quick/run_probes.py --one san_subset ||
  { echo "memcheck rc=$?"; rc=1; }
exit $rc
