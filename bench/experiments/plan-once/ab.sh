#!/bin/bash
# Alternates N short processes of timing.py on two trees; prints the least time per case of each.
#   ./ab.sh <before-tree> <after-tree> [N=6] > runs.txt
HERE=$(cd "$(dirname "$0")" && pwd)
for i in $(seq "${3:-6}"); do
  echo "before $(PYTHONPATH=$1 python "$HERE/timing.py" 3)"
  echo "after $(PYTHONPATH=$2 python "$HERE/timing.py" 3)"
done
