#!/usr/bin/env bash
# The coding-agent example: writes its code tasks and SFT trajectories (megarl/examples/coding_agent.py) into
# runs/coding_agent/data once, then runs SFT cold start + GRPO on multi-turn episodes with the sandboxed `python` tool
# and the `code` reward (configs/coding_agent.yaml) through the quickstart's launcher. Prints held-out pass@1 before
# and after RL; metrics.jsonl holds tool/call_rate and eval/tool_call_rate. Extra arguments are config overrides.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash launchers/install.sh
.venv/bin/python -m megarl.examples.coding_agent runs/coding_agent/data
exec env CONFIG=configs/coding_agent.yaml bash launchers/quickstart.sh "$@"
