#!/usr/bin/env bash
# The README's main command: install (if needed), then the CPU quickstart — SFT cold start + GRPO with the real
# SGLang engine on CPU (configs/quickstart.yaml). Prints held-out pass@1 before and after RL and writes
# runs/quickstart/{summary.json,report.png,report.md}. Extra arguments are config overrides (seed=1 run_dir=...);
# CONFIG=... runs another preset.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash launchers/install.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
PORT_ARGS=(--standalone)  # a free rendezvous port; MASTER_PORT=... pins one
[ -n "${MASTER_PORT:-}" ] && PORT_ARGS=(--master_port "$MASTER_PORT")
exec .venv/bin/megarl-torchrun --nproc_per_node "${NPROC:-1}" "${PORT_ARGS[@]}" \
  -m megarl.cli run "${CONFIG:-configs/quickstart.yaml}" "$@"
