#!/usr/bin/env bash
# The main job on the built-in default: the emulated two-datacenter demo.
source "$(dirname "$0")/_venv.sh"
cd "$ROOT"
exec geotrain demo "$@"
