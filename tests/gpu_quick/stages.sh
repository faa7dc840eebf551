# The quick check's stage runner, sourced by tests/gpu_quick.sh (and its dry-run tests).
# run_stage reads SUMMARY, DEADLINE, RESERVE, SKIP and START from the caller; a stage with less
# than MIN_STAGE_S (default 20) seconds left is skipped.

# in_group LIMIT LOG 'command': the command (bash -c) in a process group of its own, its output
# appended to LOG. At LIMIT seconds the whole group gets SIGTERM, 10 s later SIGKILL, and when
# the command ends whatever it left in its group is killed: nothing a stage started outlives it.
# Commands inside keep to one group (`timeout --foreground`: a plain nested timeout makes a group
# of its own, out of reach). Status: the command's, 124 when stopped at LIMIT.
in_group() {
  local lim=$1 log=$2 cmd=$3 flag pid dog rc
  if ! command -v setsid >/dev/null; then  # no util-linux: timeout(1) alone, one level deep
    timeout --kill-after=10 "$lim" bash -c "$cmd" >>"$log" 2>&1 </dev/null
    return
  fi
  flag=$(mktemp -u)
  # A background job of a shell without job control is no group leader: setsid does not fork,
  # so $! is the new group's id.
  setsid bash -c "$cmd" >>"$log" 2>&1 </dev/null &
  pid=$!
  setsid bash -c "sleep $lim; : >'$flag'; kill -TERM -- -$pid; sleep 10; kill -KILL -- -$pid" \
    >/dev/null 2>&1 </dev/null &
  dog=$!
  wait "$pid"
  rc=$?
  { kill -KILL -- "-$dog" "-$pid"; wait "$dog"; } 2>/dev/null  # reaped quietly
  if [ -e "$flag" ]; then
    rm -f "$flag"
    rc=124
  fi
  return "$rc"
}

# run_stage NAME CAP LOG 'command': under its limit (CAP, or less when the deadline is nearer),
# never stops the script; a line in summary.txt: ok, FAIL, TIMEOUT (its own cap ran out) or CUT
# (the deadline's shorter limit ran out: the run's budget, not the stage, is short).
run_stage() {
  local name=$1 cap=$2 log=$3 cmd=$4 left lim t0 rc dt what
  if [[ "$SKIP" == *" $name "* ]]; then
    printf '%-12s SKIPPED (GPU_CHECK_SKIP)\n' "$name" >>"$SUMMARY"
    return 99
  fi
  left=$((DEADLINE - $(date +%s) - RESERVE))
  lim=$((cap < left ? cap : left))
  if [ "$lim" -lt "${MIN_STAGE_S:-20}" ]; then
    printf '%-12s SKIPPED (%ss left before the deadline)\n' "$name" "$left" >>"$SUMMARY"
    return 99
  fi
  printf '\n===== %s: limit %ss (cap %ss), %ss into the run =====\n+ %s\n' "$name" "$lim" \
    "$cap" "$(($(date +%s) - START))" "$cmd" >>"$log"
  t0=$(date +%s)
  STAGE_LIM=$lim in_group "$lim" "$log" "$cmd"
  rc=$?
  dt=$(($(date +%s) - t0))
  what=ok
  [ "$rc" -ne 0 ] && what=FAIL
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    what=TIMEOUT
    [ "$lim" -lt "$cap" ] && what=CUT
  fi
  printf '%-12s %-7s rc=%-3s %4ss (limit %ss)  -> %s\n' "$name" "$what" "$rc" "$dt" "$lim" \
    "$(basename "$log")" >>"$SUMMARY"
  return "$rc"
}

# quick_verdict: 0 when the build and every stage that ran passed (a CUT stage is no failure)
# and no probe found a bug.
quick_verdict() {
  ! grep -qE '^[a-z-]+ +(FAIL|TIMEOUT)|^  (bug|error|crash|timeout) ' "$SUMMARY"
}
