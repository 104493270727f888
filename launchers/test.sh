#!/usr/bin/env bash
# The README's test command: install (if needed), then run the test suite (prints the slowest tests).
# Arguments go to pytest: `bash launchers/test.sh -m unit` runs the fast tier, `-m "not slurm"` all but the
# Slurm tests, `tests/reshard` one folder (tiers and layout: tests/README.md). No argument: everything.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash launchers/install.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
# Everything: the Slurm tier in a second pytest process beside the others. Its jobs spend much of their time waiting
# (Slurm's scheduling cycle and requeue delay, engine and torchrun start-ups), while the single-process unit tier leaves
# a core idle: together they finish sooner than one after the other. Its own temporary folder and no shared cache; its
# report is printed after the others'; the command fails if either fails.
SLURM_TMP="$(mktemp -d "${TMPDIR:-/tmp}/megarl-slurm-tests.XXXXXX")"
.venv/bin/python -m pytest -m slurm -p no:cacheprovider --basetemp "$SLURM_TMP/basetemp" > "$SLURM_TMP/pytest.log" 2>&1 &
SLURM_PID=$!
trap 'kill "$SLURM_PID" 2>/dev/null || true' EXIT
rc=0
.venv/bin/python -m pytest -m "not slurm" || rc=$?
slurm_rc=0
wait "$SLURM_PID" || slurm_rc=$?
trap - EXIT
echo
echo "=== the Slurm tier (pytest -m slurm, run beside the others) ==="
cat "$SLURM_TMP/pytest.log"
rm -rf "$SLURM_TMP"
[ "$rc" -eq 0 ] && [ "$slurm_rc" -eq 0 ]
