# Sourced by the set-up scripts: make .venv with the pinned CPU torch and the project, once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.geotrain-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.13.0" numpy
    "$VENV/bin/pip" install -q --disable-pip-version-check -e "$ROOT[dev]"
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
