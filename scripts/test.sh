#!/usr/bin/env bash
# The whole test suite, as CI runs it: lint, pytest on the pinned torch, then the tests marked oldest_torch
# (the runtime subset and torch_compat) on the oldest supported torch (.venv-torch211, made on first use;
# GEOTRAIN_SKIP_TORCH211=1 skips that leg). Arguments go to the first pytest only (and then the second leg
# is skipped: a subset was asked for).
source "$(dirname "$0")/_venv.sh"
cd "$ROOT"
ruff check src tests bench scripts
if [ "${GEOTRAIN_SKIP_TORCH211:-0}" != 1 ]; then
    source "$ROOT/scripts/_venv_torch211.sh"
    export GEOTRAIN_TORCH211_PYTHON="$VENV211/bin/python"     # tests/test_gpu_check.py rehearses on it
fi
python -m pytest -q --durations=20 "$@"
if [ $# -eq 0 ] && [ "${GEOTRAIN_SKIP_TORCH211:-0}" != 1 ]; then
    echo "-- torch $("$VENV211/bin/python" -c 'import torch; print(torch.__version__)') (the oldest supported): " \
         "pytest -m oldest_torch"
    "$VENV211/bin/python" scripts/gpu_deps.py --target "$DEPS211" --quiet
    # only the files that hold such tests: the others may import what that venv lacks (matplotlib, transformers)
    PYTHONPATH="$ROOT/src:$DEPS211" "$VENV211/bin/python" -m pytest -q -m oldest_torch -p no:cacheprovider \
        $(grep -l "oldest_torch" tests/test_*.py)
fi
