# Sourced by tests/run.sh and bench/run.sh: a virtualenv with torch and the test tools (HF
# transformers and accelerate for tests/test_hf_trainer.py, matplotlib for the plot tests),
# then fastdp built into it.
#   FASTDP_VENV   virtualenv path (default .venv); reuses system site-packages (a preinstalled torch)
#   FASTDP_TORCH  torch version (default: what is installed, else 2.11.0 with a GPU, 2.13.0 without)
#   FASTDP_TRANSFORMERS  transformers version (default 5.24.0, the release tests/test_hf_zoo.py's
#                 CI sample was drawn from; empty: whatever is installed, else the latest)
#   FASTDP_CLEAN  1: remove earlier build outputs first (CI switches torch builds in one tree)
#   FASTDP_FORCE_CPU / FASTDP_FORCE_CUDA, TORCH_CUDA_ARCH_LIST, CUDA_HOME: see setup.py
set -euo pipefail
VENV="${FASTDP_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV"
fi
VPY="$VENV/bin/python"
have_torch="$("$VPY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)"
if [ -z "${FASTDP_TORCH:-}" ]; then
  if [ -n "$have_torch" ]; then FASTDP_TORCH="$have_torch"
  elif nvidia-smi -L >/dev/null 2>&1; then FASTDP_TORCH=2.11.0
  else FASTDP_TORCH=2.13.0; fi
fi
FASTDP_TRANSFORMERS="${FASTDP_TRANSFORMERS-5.24.0}"
# hypothesis is pinned: its derandomized examples change with its version (a deeper run with the
# newest: FASTDP_HYPOTHESIS_EXAMPLES, tests/test_*_properties.py).
pkgs=(pytest hypothesis==6.155.2 ninja numpy setuptools wheel accelerate matplotlib
      "transformers${FASTDP_TRANSFORMERS:+==$FASTDP_TRANSFORMERS}" ${FASTDP_EXTRA_PKGS:-})
if [ "$have_torch" != "$FASTDP_TORCH" ]; then pkgs+=("torch==$FASTDP_TORCH"); fi
missing=()
for p in "${pkgs[@]}"; do
  case "$p" in
    torch==*) missing+=("$p") ;;
    *==*) [ "$("$VPY" -c "import importlib.metadata as m; print(m.version('${p%%==*}'))" \
             2>/dev/null)" = "${p#*==}" ] || missing+=("$p") ;;
    *) "$VPY" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('$p') is None)" \
         2>/dev/null || missing+=("$p") ;;
  esac
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "fastdp setup: pip install ${missing[*]}" >&2
  "$VPY" -m pip install -q "${missing[@]}"
fi
if [ "${FASTDP_CLEAN:-0}" = "1" ]; then rm -rf build fastdp/_C*.so; fi
echo "fastdp setup: building with torch $("$VPY" -c 'import torch; print(torch.__version__)')" >&2
"$VPY" -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v "^WARNING" >&2 || true
"$VPY" -c "import fastdp._C" || { echo "fastdp setup: the extension failed to build/import" >&2; exit 1; }
