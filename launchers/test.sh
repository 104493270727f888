#!/usr/bin/env bash
# The README's test command: install (if needed), then run the test suite (prints the slowest tests).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash launchers/install.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest "$@"
