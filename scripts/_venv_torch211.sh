# Sourced by scripts/test.sh: .venv-torch211, a stand-in for the GPU machine's Python -- the oldest supported
# torch (2.11, as on the GPU machine), numpy, pytest and what that machine's image has; NOT pydantic, fastapi,
# uvicorn: those come from the shipped wheels (scripts/gpu_deps.py), as they must there. Made on first use
# (~80 s and ~4.7 GB here: PyPI's torch 2.11 brings its CUDA libraries; no CPU-only 2.11 wheel is reachable).
# GEOTRAIN_TORCH211_VENV puts it elsewhere (one for several checkouts). Python 3.12 (the machine's) where
# found, else python3.
VENV211="${GEOTRAIN_TORCH211_VENV:-$ROOT/.venv-torch211}"
STAMP211="$VENV211/.geotrain-torch211"
if [ ! -f "$STAMP211" ]; then
    PY312=python3
    for p in python3.12 "$(command -v pyenv >/dev/null && pyenv root)"/versions/3.12*/bin/python3.12; do
        if [ -n "$p" ] && "$p" -c "" >/dev/null 2>&1; then PY312="$p"; break; fi
    done
    "$PY312" -m venv "$VENV211"
    "$VENV211/bin/pip" install -q --disable-pip-version-check "torch==2.11.0" numpy pytest pytest-timeout tqdm \
        safetensors tokenizers prometheus-client jinja2
    touch "$STAMP211"
fi
DEPS211="$VENV211/geotrain-deps"      # what scripts/gpu_deps.py unpacks from the shipped wheels
