#!/usr/bin/env bash
# The whole test suite: lint, then pytest.
source "$(dirname "$0")/_venv.sh"
cd "$ROOT"
ruff check src tests bench
exec python -m pytest -q "$@"
