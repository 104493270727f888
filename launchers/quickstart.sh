#!/usr/bin/env bash
# The README's main command: install (if needed), then run the main job.
# Until the RL trainer lands, the main job is the model-bridge smoke run (see README "What the quickstart does").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash launchers/install.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
NPROC="${NPROC:-2}"
exec .venv/bin/torchrun --nproc_per_node "$NPROC" --master_port "${MASTER_PORT:-29561}" -m megarl.cli smoke "$@"
