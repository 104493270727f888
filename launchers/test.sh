#!/usr/bin/env bash
# The README's test command: install (if needed), then run the test suite (prints the slowest tests).
# Arguments go to pytest: `bash launchers/test.sh -m unit` runs the fast tier, `-m "not slurm"` all but the
# Slurm tests, `tests/reshard` one folder (tiers and layout: tests/README.md). No argument: everything.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash launchers/install.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest "$@"
