#!/usr/bin/env bash
# The GPU check: ~5 minutes on one GPU, nothing downloaded (see scripts/gpu_check.py and docs/GPU.md).
#
#   bash scripts/gpu_check.sh            # on a machine with a CUDA GPU
#   bash scripts/gpu_check.sh --cpu      # the same checks on the CPU with tiny sizes (part of the tests)
#
# Runs on the machine's own Python and torch (PYTHON, else .venv/bin/python, else python3) with
# PYTHONPATH=src: first it checks that interpreter (Python >= 3.10, torch >= the oldest supported), then
# the packages geotrain needs besides torch -- what is missing is unpacked from the wheels the project
# ships (scripts/wheels, CPython 3.12) into .deps/pyX.Y (GPU_CHECK_DEPS overrides; GPU_CHECK_WHEELS names
# another wheel folder), or it refuses in one line (exit 3). Then one table; the details go to
# runs/gpu_check[_cpu]/gpu_check.md (GPU_CHECK_OUT overrides); exit 1 if a check fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
MODE=gpu
if [ "${1:-}" = "--cpu" ]; then MODE=cpu; shift; fi
OUT="${GPU_CHECK_OUT:-runs/gpu_check$([ "$MODE" = cpu ] && echo _cpu)}"

if ! "$PY" -c "" >/dev/null 2>&1; then
  echo "gpu_check: no Python interpreter at '$PY' (set PYTHON=...)" >&2; exit 3
fi
PYTHONPATH="$PWD/src" "$PY" - <<'EOF' || exit 3
import sys
if sys.version_info < (3, 10):
    sys.exit(f"gpu_check: Python {sys.version.split()[0]} is too old (geotrain needs 3.10+)")
try:
    from geotrain.torch_compat import OLDEST_TORCH, torch_version
except Exception as e:  # noqa: BLE001 -- any failure to import torch is the one-line answer
    sys.exit(f"gpu_check: this Python ({sys.executable}) has no usable torch: {type(e).__name__}: {e}")
if torch_version() < OLDEST_TORCH:
    import torch
    sys.exit(f"gpu_check: torch {torch.__version__} is older than the oldest supported "
             f"{'.'.join(map(str, OLDEST_TORCH))}")
EOF
VER="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
DEPS="${GPU_CHECK_DEPS:-$PWD/.deps/py$VER}"
NOTE="$("$PY" scripts/gpu_deps.py --target "$DEPS" ${GPU_CHECK_WHEELS:+--wheels "$GPU_CHECK_WHEELS"})" || exit 3
echo "$NOTE"
export PYTHONPATH="$PWD/src:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
# 8 minutes at most (GPU_CHECK_TIMEOUT seconds), also if a rank hangs (-k: then SIGKILL).
exec timeout -k 10 "${GPU_CHECK_TIMEOUT:-480}" "$PY" scripts/gpu_check.py --mode "$MODE" --out "$OUT" --deps "${NOTE#gpu_check deps: }" "$@"
