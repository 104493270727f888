#!/usr/bin/env bash
# Install megarl and its pinned stack into ./.venv. Used by launchers/quickstart.sh, launchers/test.sh and CI.
#
#   bash launchers/install.sh            # CPU set when no GPU is visible, GPU set otherwise
#   MEGARL_DEVICE=gpu bash launchers/install.sh
#
# Idempotent: a stamp in .venv records a hash of this script, requirements/ and setup.py; when nothing changed the
# script returns in well under a second. Only package registries are contacted.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${MEGARL_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"

if [ -z "${MEGARL_DEVICE:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then MEGARL_DEVICE=gpu; else MEGARL_DEVICE=cpu; fi
fi
case "$MEGARL_DEVICE" in cpu|gpu) ;; *) echo "install.sh: MEGARL_DEVICE must be cpu or gpu, got '$MEGARL_DEVICE'" >&2; exit 2;; esac

# The code sandbox (megarl/sandbox) isolates with bubblewrap, from the system package manager: installed here when
# missing and running as root (as tests/slurm_cluster.py does for Slurm). Otherwise the sandbox raises
# SandboxUnavailable with this fix when code is to be run; nothing else needs it.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "megarl: installing bubblewrap (code sandbox)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; } \
      || echo "megarl: warning: apt-get install -y bubblewrap failed; the code sandbox will be unavailable" >&2
  else
    echo "megarl: note: bubblewrap (bwrap) is not installed; the code sandbox needs it (as root: apt-get install -y bubblewrap)" >&2
  fi
fi

STAMP_FILE="$VENV/.megarl-install-stamp"
STAMP="$MEGARL_DEVICE $(cat launchers/install.sh requirements/*.txt setup.py | sha256sum | cut -c1-16)"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP_FILE" 2>/dev/null)" = "$STAMP" ]; then
  echo "megarl: $VENV is up to date ($MEGARL_DEVICE)"
  exit 0
fi

"$PYTHON" - <<'EOF'
import sys
if sys.version_info[:2] < (3, 11):
    sys.exit(f"megarl needs Python >= 3.11 (found {sys.version.split()[0]}); set PYTHON=/path/to/python3.11")
EOF

START=$SECONDS
TOTAL=5; [ "$MEGARL_DEVICE" = cpu ] || TOTAL=3
STEP=0
step() {  # one progress line per stage: pip stays quiet, and the first install (minutes) never looks stuck
  STEP=$((STEP + 1))
  echo "megarl: [$STEP/$TOTAL] $1 ($((SECONDS - START)) s so far)"
}
echo "megarl: installing the $MEGARL_DEVICE stack into $VENV (a few minutes the first time; benchmarks/install.py measures it)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

if [ "$MEGARL_DEVICE" = cpu ]; then
  # torch 2.13.0 CPU wheel first, so nothing below can pull a CUDA build.
  step "torch 2.13.0 (CPU wheel)"
  "${PIP[@]}" torch==2.13.0
  step "the CPU requirements (requirements/cpu.txt: transformers, SGLang's CPU dependencies, reasoning-gym, ...)"
  "${PIP[@]}" -r requirements/cpu.txt
  # SGLang's declared dependencies pin CUDA-only packages (torch==2.14.1 CUDA, flashinfer, sglang-kernel); on CPU we
  # install it without them on top of the exact list above (requirements/cpu.txt), which is what its CPU engine needs.
  step "sglang 0.5.23 (without its CUDA-only dependencies)"
  "${PIP[@]}" --no-deps sglang==0.5.23
else
  step "the GPU requirements (requirements/gpu.txt)"
  "${PIP[@]}" -r requirements/gpu.txt
fi
# megatron-core 0.19.2 declares Requires-Python>=3.12 but ships a cp311 wheel that runs on 3.11; mbridge declares no
# requirements. Both go in without dependency resolution; their real needs are in the requirement lists.
step "megatron-core 0.19.2 and mbridge 0.15.1"
"${PIP[@]}" --no-deps --ignore-requires-python megatron-core==0.19.2 mbridge==0.15.1
step "megarl (editable)"
"${PIP[@]}" --no-deps --no-build-isolation -e .

echo "$STAMP" > "$STAMP_FILE"
echo "megarl: installed in $((SECONDS - START)) s ($("$VENV/bin/python" -c 'import torch, megatron.core as m; print("torch", torch.__version__, "megatron-core", m.__version__)'))"
