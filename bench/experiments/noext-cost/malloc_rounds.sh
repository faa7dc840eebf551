#!/bin/bash
# Four alternated rounds of ../noext-anchor/cpu_ratio.py on mlp1000 for two
# checkouts, each with glibc's default heap and with its mmap/trim thresholds fixed at 256 MiB
# (no trimming, no mmap'd blocks). Usage: malloc_rounds.sh <base checkout> <new checkout>
set -e
ratio="$(cd "$(dirname "$0")" && pwd)/../noext-anchor/cpu_ratio.py"
fixed="MALLOC_TRIM_THRESHOLD_=268435456 MALLOC_MMAP_THRESHOLD_=268435456"
for _ in 1 2 3 4; do
  for tree in "$1" "$2"; do
    for envs in "HEAP=default" "$fixed"; do
      tag=$([ "$envs" = "HEAP=default" ] && echo default || echo fixed)
      (cd "$tree" && env $envs PYTHONPATH="$tree" python "$ratio" mlp1000 "$(basename "$tree")-$tag")
    done
  done
done
