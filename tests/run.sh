#!/usr/bin/env bash
# Fresh machine -> tests: make a virtualenv, install torch and test tools, build fastdp, run pytest.
# Usage: bash tests/run.sh [pytest args]    (environment: see .ci/setup_env.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/setup_env.sh
"$VENV/bin/python" -m fastdp.info
set +e
"$VENV/bin/python" -m pytest tests "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "tests/run.sh: pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
