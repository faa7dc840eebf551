#!/bin/bash
# Instructions of N steps of mlp1000 without the extension (4 CPU replicas, inline) under
# callgrind; two runs (3 and 7 steps) per checkout, the difference / 4 is one step's count.
# Usage: callgrind_run.sh <checkout> <steps>
set -e
here="$(cd "$(dirname "$0")" && pwd)"
cd "$1" && PYTHONPATH="$1" valgrind --tool=callgrind --callgrind-out-file=/dev/null \
  python "$here/steps.py" mlp1000 "$2" 2>&1 | grep "Collected"
