#!/usr/bin/env bash
# guidellm (the vLLM project's load generator) in a venv of its own, for `orca-bench serve` (docs/PEERS.md).
#
# Idempotent: a venv that already has the pinned guidellm returns at once. Prints the venv's python last.
#   ORCA_GUIDELLM_VENV   where the venv goes (default: ~/.cache/orca/peers/guidellm-venv)
#   PYTHON               the interpreter to create it with (default: python3)
set -euo pipefail

GUIDELLM_VERSION=0.8.1
VENV=${ORCA_GUIDELLM_VENV:-$HOME/.cache/orca/peers/guidellm-venv}
PY=$VENV/bin/python

ready() {
    [ -x "$PY" ] && "$PY" - "$GUIDELLM_VERSION" <<'PYEOF' >/dev/null 2>&1
import importlib.metadata as md, sys
assert md.version("guidellm") == sys.argv[1], md.version("guidellm")
PYEOF
}

if ! ready; then
    echo "setting up guidellm $GUIDELLM_VERSION in $VENV (a few minutes)" >&2
    mkdir -p "$(dirname "$VENV")"
    [ -x "$PY" ] || "${PYTHON:-python3}" -m venv "$VENV"
    "$PY" -m pip install --quiet --upgrade pip >&2
    "$PY" -m pip install --quiet "guidellm==$GUIDELLM_VERSION" >&2
    ready || { echo "error: $VENV does not hold guidellm==$GUIDELLM_VERSION" >&2; exit 1; }
fi
echo "$PY"
