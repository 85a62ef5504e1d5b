#!/usr/bin/env bash
# The GPU check: ~5 minutes on one GPU, nothing downloaded (see scripts/gpu_check.py and docs/GPU.md).
#
#   bash scripts/gpu_check.sh            # on a machine with a CUDA GPU
#   bash scripts/gpu_check.sh --cpu      # the same checks on the CPU with tiny sizes (part of the tests)
#
# Writes runs/gpu_check[_cpu]/gpu_check.md (GPU_CHECK_OUT overrides) and exits non-zero if a check fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
MODE=gpu
if [ "${1:-}" = "--cpu" ]; then MODE=cpu; shift; fi
OUT="${GPU_CHECK_OUT:-runs/gpu_check$([ "$MODE" = cpu ] && echo _cpu)}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# 8 minutes at most, also if a rank hangs (-k: then SIGKILL).
exec timeout -k 10 480 "$PY" scripts/gpu_check.py --mode "$MODE" --out "$OUT" "$@"
