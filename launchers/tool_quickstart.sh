#!/usr/bin/env bash
# The tool-use quickstart: SFT cold start + GRPO on multi-turn calculator episodes with the real SGLang engine on CPU
# (configs/tool_quickstart.yaml), through the same launcher as the quickstart. Prints held-out pass@1 before and after
# RL; the run folder holds metrics.jsonl (tool/call_rate, eval/tool_call_rate, eval/pass_at_k ...), report.png and
# pass_at_k.png. Extra arguments are config overrides (seed=1 run_dir=...).
exec env CONFIG=configs/tool_quickstart.yaml bash "$(dirname "${BASH_SOURCE[0]}")/quickstart.sh" "$@"
