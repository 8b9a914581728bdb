#!/usr/bin/env bash
# The whole GPU verification in one run (scripts/gpu_check.py says what it does and writes).
#
#   scripts/gpu_check.sh [OUT_DIR] [--budget SECONDS] [--stages env,tests,decode,offline]
#
# For a bare GPU machine: nothing is installed, the tree runs from PYTHONPATH with an interpreter that
# has torch and transformers: $PYTHON, else the repository's .venv where it has torch, else python3.
# Where torch sees no GPU the stages run on the CPU as a smoke check of the script (GPU parts skipped).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]] && "$ROOT/.venv/bin/python" -c "import torch" 2>/dev/null; then
        PYTHON="$ROOT/.venv/bin/python"
    else
        PYTHON=python3
    fi
fi
exec "$PYTHON" "$ROOT/scripts/gpu_check.py" --python "$PYTHON" "$@"
