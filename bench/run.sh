#!/usr/bin/env bash
# Fresh machine -> benchmarks: make a virtualenv, install torch, build fastdp, run the suite that
# fits this hardware. Usage: bash bench/run.sh [--quick] [--out DIR] ...   (see bench/README.md)
set -euo pipefail
cd "$(dirname "$0")/.."
FASTDP_EXTRA_PKGS="matplotlib tqdm" source .ci/setup_env.sh
"$VENV/bin/python" -m fastdp.bench "$@"
