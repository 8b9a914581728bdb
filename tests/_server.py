"""The end-to-end test model repository: every model of model_repository/ exactly as shipped (orca_gpt and
request_level_gpt on SmolLM2 by default) beside tiny
random GPT-2 variants that exercise queueing, cancellation and long runs in milliseconds per iteration,
and the request-level baseline (request_level_gpt's config and model.py) on the same tiny checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests
from checkpoints import make_gpt2, make_lora_adapter
from orca_client.admin import ADMIN_KEY_ENV

from orca_server.server import free_ports

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_MODEL = REPO_ROOT / "model_repository" / "orca_gpt"
SHIPPED_BASELINE = REPO_ROOT / "model_repository" / "request_level_gpt"

# name -> parameters overriding the shipped config.pbtxt (the engine's, and REPORT_CUSTOM_METRICS)
TINY_MODELS = {
    # A long context so a request can run for seconds: room to act while it is in flight.
    "orca_tiny": {"max_bs": "8", "n_slots": "8192"},
    # One request per iteration and a queue of two: the third waiting request is refused. Orca's admission
    # (reserve): a running request holds the blocks for its whole max_tokens.
    "orca_tiny_q": {"max_bs": "1", "max_queue": "2", "n_slots": "4096", "kv_admission": "reserve"},
    # A pool of 8 blocks of 16 tokens, allocated on demand: one request of up to 128 tokens fits, two long
    # ones do not, so a burst preempts (and recomputes) requests.
    "orca_tiny_preempt": {"max_bs": "8", "n_slots": "128", "block_size": "16", "kv_admission": "on_demand"},
    # Tensor parallelism over two CPU worker processes (gloo); the failure test kills one of them, so no
    # other test may use this model.
    "orca_tiny_tp2": {"max_bs": "8", "n_slots": "2048", "tensor_parallel_size": "2", "device": "cpu",
                      "worker_timeout": "20"},
    # Their loops fail at their 3rd iteration (ENGINE_FAULTS, set in the server's environment): one hangs
    # inside it (a hung device: the watchdog gives up after worker_timeout), one's thread dies before it.
    "orca_tiny_hang": {"n_slots": "2048", "worker_timeout": "2"},
    "orca_tiny_crash": {"n_slots": "2048"},
    # tests/reliability: the in-process worker raises inside its 3rd iteration (ENGINE_FAULTS): only that
    # iteration's requests fail, the model stays ready. max_bs 2: a burst leaves some requests waiting.
    "orca_tiny_raise": {"max_bs": "2", "n_slots": "2048"},
    # tests/reliability soak: few running and a short waiting queue, so a burst saturates it and is refused.
    "orca_tiny_soak": {"max_bs": "4", "max_queue": "24", "n_slots": "4096"},
    # tests/test_timeline.py: orca-bench trace --timeline reloads it with its trace parameter set, then as
    # configured. Four requests per iteration and a budget of 32 tokens: prompts run in chunks. Its vllm:*
    # metrics are off (REPORT_CUSTOM_METRICS, a model parameter): tests/test_server_vllm_compat.py.
    "orca_tiny_timeline": {"max_bs": "4", "n_slots": "1024", "max_num_batched_tokens": "32",
                           "REPORT_CUSTOM_METRICS": "false"},
    # tests/test_server_e2e.py: speculative decoding (n-gram), otherwise orca_tiny; proposals verified in
    # iterations of up to 7 requests (the test's 4 at once; the default stops at 4).
    "orca_tiny_spec": {"max_bs": "8", "n_slots": "8192", "speculative_method": "ngram",
                       "speculative_disable_by_batch_size": "8"},
    # tests/test_server_lora.py: LoRA adapters, two slots. lora_a comes from lora_modules, lora_b from
    # vllm_backend's multi_lora.json (a path relative to the file): LORA_ADAPTERS, added by
    # build_test_repository; the test loads and unloads others at run time.
    "orca_tiny_lora": {"max_bs": "8", "n_slots": "4096", "enable_lora": "true", "max_loras": "2",
                       "allow_runtime_lora_updating": "true"},
}
LORA_MODEL = "orca_tiny_lora"
LORA_ADAPTERS = {"lora_a": 1, "lora_b": 2}  # adapter name -> the seed of its random weights
# Models the failure tests make fail (they unload themselves): no other test may rely on them.
FAILING_MODELS = ("orca_tiny_tp2", "orca_tiny_hang", "orca_tiny_crash")
# $ORCA_ENGINE_FAULT for the test server (orca.core.engine_loop.fault_from_env): only these models fail.
ENGINE_FAULTS = "orca_tiny_hang:3:hang,orca_tiny_crash:3:crash,orca_tiny_raise:3:raise"

# The baseline serving the tiny checkpoint. Triton runs a batch as soon as it holds max_batch_size
# requests; the long queue delay means a batch of exactly REQUEST_LEVEL_TINY_BATCH requests sent together
# is always one batch, however slowly they arrive (a test sending fewer waits out the delay).
REQUEST_LEVEL_TINY = "request_level_tiny"
REQUEST_LEVEL_TINY_BATCH = 4
REQUEST_LEVEL_TINY_DELAY_US = 30_000_000


def _with_parameters(config: str, name: str, params: dict[str, str]) -> str:
    """The config renamed, with the values of params' keys replaced (each must be a shipped parameter)."""
    lines, replaced = [], set()
    for line in config.splitlines():
        if line.startswith("name:"):
            line = f'name: "{name}"'
        for key, value in params.items():
            if line.startswith(f'parameters {{ key: "{key}"'):
                line = f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
                replaced.add(key)
        lines.append(line)
    if missing := set(params) - replaced:
        raise RuntimeError(f"the shipped config.pbtxt has no parameter {', '.join(sorted(missing))}")
    return "\n".join(lines) + "\n"


# The tiny models run eagerly: they test queueing, cancellation and failures, and compiling each at the
# server's start would cost tens of seconds apiece. The shipped models compile as shipped (torch_compile
# auto on this CPU): the compiled forward pass is served end to end.
TINY_ENGINE_DEFAULTS = {"torch_compile": "off"}


def build_test_repository(root: Path) -> tuple[Path, Path]:
    """Returns (model repository, tiny GPT-2 checkpoint directory)."""
    repo = root / "model_repository"
    tiny = make_gpt2(root / "tiny-gpt2", n_positions=2048)
    for shipped in sorted(SHIPPED_MODEL.parent.glob("*/config.pbtxt")):  # every shipped model, as is
        shutil.copytree(shipped.parent, repo / shipped.parent.name)
    config = (SHIPPED_MODEL / "config.pbtxt").read_text()
    for name, params in TINY_MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        shutil.copy(SHIPPED_MODEL / "1" / "model.py", repo / name / "1" / "model.py")
        if name == LORA_MODEL:
            lora_a = _add_adapters(repo / name / "1", tiny)["lora_a"]
            params = {**params, "lora_modules": f"lora_a={lora_a}", "lora_root": str(lora_a.parent)}
        text = _with_parameters(config, name, {"model": str(tiny), **TINY_ENGINE_DEFAULTS, **params})
        (repo / name / "config.pbtxt").write_text(text)
    _add_request_level_tiny(repo, tiny)
    return repo, tiny


def _add_adapters(version_dir: Path, tiny: Path) -> dict[str, Path]:
    """LORA_ADAPTERS of the tiny checkpoint: lora_a outside the repository (for lora_modules), lora_b in the
    version directory, listed in its multi_lora.json by a relative path."""
    paths = {"lora_a": version_dir.parent.parent.parent / "adapters" / "lora_a", "lora_b": version_dir / "lora_b"}
    for name, path in paths.items():
        make_lora_adapter(tiny, path, seed=LORA_ADAPTERS[name])
    (version_dir / "multi_lora.json").write_text(json.dumps({"lora_b": "lora_b"}))
    return paths


def _add_request_level_tiny(repo: Path, tiny: Path) -> None:
    (repo / REQUEST_LEVEL_TINY / "1").mkdir(parents=True)
    shutil.copy(SHIPPED_BASELINE / "1" / "model.py", repo / REQUEST_LEVEL_TINY / "1" / "model.py")
    text = _with_parameters((SHIPPED_BASELINE / "config.pbtxt").read_text(), REQUEST_LEVEL_TINY,
                            {"model": str(tiny), **TINY_ENGINE_DEFAULTS})
    text, n_size = re.subn(r"^max_batch_size: \d+$", f"max_batch_size: {REQUEST_LEVEL_TINY_BATCH}", text, flags=re.M)
    text, n_delay = re.subn(
        r"max_queue_delay_microseconds: \d+", f"max_queue_delay_microseconds: {REQUEST_LEVEL_TINY_DELAY_US}", text
    )
    if (n_size, n_delay) != (1, 1):
        raise RuntimeError("request_level_gpt/config.pbtxt lacks max_batch_size or max_queue_delay_microseconds")
    (repo / REQUEST_LEVEL_TINY / "config.pbtxt").write_text(text)


@contextlib.contextmanager
def orca_openai(server: Any, log: Path, api_key: str, *options: str) -> Iterator[str]:
    """An orca-openai process in front of `server` (the session's TritonServer) on a free port, with
    `api_key` and further command-line `options`, its output in `log`: yields its base URL
    (http://127.0.0.1:PORT) once /health answers 200, and stops it (SIGINT) afterwards."""
    (port,) = free_ports(1)
    cmd = [sys.executable, "-m", "orca_openai", "--host", "127.0.0.1", "--port", str(port),
           "--triton-url", server.grpc_url, "--metrics-url", server.metrics_url, "--api-key", api_key, *options]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                env={**os.environ, ADMIN_KEY_ENV: server.admin_key})  # for Triton's model index
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"orca-openai did not become healthy:\n{log.read_text()}")
            time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def stalled_stream(url: str, api_key: str, body: dict[str, Any]) -> socket.socket:
    """A socket that POSTs `body` (a streaming completion) to orca-openai at `url` and never reads: a 4 KiB
    receive buffer and 536-byte segments keep what the server can push into it small, so its sends soon wait."""
    data = json.dumps(body).encode()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
        sock.connect((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\nAuthorization: Bearer "
                     + api_key.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(data)).encode() + b"\r\n\r\n" + data)
    except BaseException:
        sock.close()
        raise
    return sock
