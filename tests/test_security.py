"""Triton as this project starts it, attacked as someone on the same host would (README "Security"): every
administrative call without the admin key is refused over HTTP and gRPC, nothing an attacker sends is run
or written, and with the key the same calls work; with the launcher's default flags nothing listens beyond
loopback.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
from orca_client.admin import ADMIN_KEY_HEADER, GRPC_ADMIN_KEY_HEADER
from test_launcher import make_smoke_repository
from tritonclient.utils import InferenceServerException

from orca_server.launcher import is_loopback
from orca_server.server import TritonServer, free_ports

REPO_ROOT = Path(__file__).resolve().parent.parent


def _payload(marker: Path) -> str:
    """A model.py that, were Triton ever to run it, leaves `marker` behind."""
    return (f"from pathlib import Path\nPath({str(marker)!r}).write_text('pwned')\n"
            "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n")


def _config(name: str) -> str:
    return json.dumps({"name": name, "backend": "python", "max_batch_size": 0,
                       "input": [{"name": "IN", "data_type": "TYPE_INT32", "dims": [1]}],
                       "output": [{"name": "OUT", "data_type": "TYPE_INT32", "dims": [1]}]})


def _http(server: TritonServer, method: str, path: str, body: Any = None,
          headers: dict[str, str] | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{server.http_url}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _http_attacks(marker: Path, target: str) -> dict[str, tuple[str, str, Any]]:
    """Every administrative HTTP call, by name: (method, path, body). `target` is a served model."""
    override = {"config": _config("evil"), "file:1/model.py": base64.b64encode(_payload(marker).encode()).decode()}
    return {
        "index": ("POST", "/v2/repository/index", {}),
        "load": ("POST", f"/v2/repository/models/{target}/load", {}),
        "load with config": ("POST", f"/v2/repository/models/{target}/load",
                             {"parameters": {"config": _config(target)}}),
        "load with file override": ("POST", "/v2/repository/models/evil/load", {"parameters": override}),
        "unload": ("POST", f"/v2/repository/models/{target}/unload", {}),
        "log settings": ("GET", "/v2/logging", None),
        "log update": ("POST", "/v2/logging", {"log_verbose_level": 1, "log_file": str(marker)}),
        "trace settings": ("GET", "/v2/trace/setting", None),
        "trace update": ("POST", "/v2/trace/setting", {"trace_file": str(marker), "trace_level": ["TIMESTAMPS"]}),
        "statistics": ("GET", "/v2/models/stats", None),
        "model statistics": ("GET", f"/v2/models/{target}/stats", None),
        "system shm status": ("GET", "/v2/systemsharedmemory/status", None),
        "system shm register": ("POST", "/v2/systemsharedmemory/region/r/register",
                                {"key": "/orca_attack", "offset": 0, "byte_size": 64}),
        "system shm unregister": ("POST", "/v2/systemsharedmemory/unregister", {}),
        "cuda shm status": ("GET", "/v2/cudasharedmemory/status", None),
        "cuda shm register": ("POST", "/v2/cudasharedmemory/region/r/register",
                              {"raw_handle": {"b64": base64.b64encode(b"x" * 64).decode()}, "device_id": 0,
                               "byte_size": 64}),
    }


def _grpc_attacks(marker: Path, target: str) -> dict[str, Callable[[grpcclient.InferenceServerClient, Any], Any]]:
    """Every administrative gRPC call, by name: a call of the client with the given headers."""
    return {
        "index": lambda c, h: c.get_model_repository_index(headers=h),
        "load": lambda c, h: c.load_model(target, headers=h),
        "load with config": lambda c, h: c.load_model(target, headers=h, config=_config(target)),
        "load with file override": lambda c, h: c.load_model(
            "evil", headers=h, config=_config("evil"), files={"file:1/model.py": _payload(marker).encode()}),
        "unload": lambda c, h: c.unload_model(target, headers=h),
        "log settings": lambda c, h: c.get_log_settings(headers=h),
        "log update": lambda c, h: c.update_log_settings({"log_verbose_level": 1, "log_file": str(marker)}, headers=h),
        "trace settings": lambda c, h: c.get_trace_settings(headers=h),
        "trace update": lambda c, h: c.update_trace_settings(settings={"trace_file": str(marker)}, headers=h),
        "statistics": lambda c, h: c.get_inference_statistics(headers=h),
        "system shm status": lambda c, h: c.get_system_shared_memory_status(headers=h),
        "system shm register": lambda c, h: c.register_system_shared_memory("r", "/orca_attack", 64, headers=h),
        "system shm unregister": lambda c, h: c.unregister_system_shared_memory(headers=h),
        "cuda shm status": lambda c, h: c.get_cuda_shared_memory_status(headers=h),
        "cuda shm register": lambda c, h: c.register_cuda_shared_memory("r", b"x" * 64, 0, 64, headers=h),
    }


def _refused_everywhere(server: TritonServer, marker: Path, target: str, key: str | None) -> None:
    """Every administrative call without the key (`key` None) or with a wrong one is refused, on both protocols."""
    headers = grpc_headers = None
    if key is not None:
        headers, grpc_headers = {ADMIN_KEY_HEADER: key}, {GRPC_ADMIN_KEY_HEADER: key}
    answers = {name: _http(server, method, path, body, headers)
               for name, (method, path, body) in _http_attacks(marker, target).items()}
    allowed = {name: answer for name, answer in answers.items()
               if answer[0] != 403 or ADMIN_KEY_HEADER not in answer[1]}
    assert not allowed, f"HTTP admin calls not refused: {allowed}"
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        passed = {}
        for name, call in _grpc_attacks(marker, target).items():
            try:
                passed[name] = call(client, grpc_headers)
            except InferenceServerException as exc:
                if ADMIN_KEY_HEADER not in (exc.message() or ""):
                    passed[name] = exc.message()
        assert not passed, f"gRPC admin calls not refused: {passed}"
    finally:
        client.close()
    assert not marker.exists(), "an attacker's file was written"
    for path in (f"/v2/models/{target}/ready", "/v2/models/evil/ready"):
        assert _http(server, "GET", path)[0] == (200 if target in path else 400)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    root = tmp_path_factory.mktemp("security")
    with TritonServer(make_smoke_repository(root), log_path=root / "tritonserver.log") as server:
        yield server


def test_admin_apis_refuse_every_call_without_the_key(smoke: TritonServer, tmp_path: Path) -> None:
    """Counted: 16 HTTP and 15 gRPC administrative calls, each refused without the key and with a wrong one;
    the smoke model still serves, no model "evil" exists, the payload never ran, the key is not in the log."""
    marker = tmp_path / "pwned"
    assert len(_http_attacks(marker, "smoke")) == 16 and len(_grpc_attacks(marker, "smoke")) == 15
    _refused_everywhere(smoke, marker, "smoke", None)
    _refused_everywhere(smoke, marker, "smoke", smoke.admin_key + "x")
    assert smoke.admin_key not in smoke.log_path.read_text(errors="replace")


def test_the_admin_key_opens_them(smoke: TritonServer) -> None:
    """With the key, the repository API works: unload and load back the smoke model, over HTTP then gRPC."""
    headers = smoke.admin_headers
    assert _http(smoke, "POST", "/v2/repository/index", {}, headers)[0] == 200
    assert _http(smoke, "GET", "/v2/logging", None, headers)[0] == 200
    assert _http(smoke, "POST", "/v2/repository/models/smoke/unload", {}, headers)[0] == 200
    assert _http(smoke, "GET", "/v2/models/smoke/ready")[0] != 200
    assert _http(smoke, "POST", "/v2/repository/models/smoke/load", {}, headers)[0] == 200
    assert _http(smoke, "GET", "/v2/models/smoke/ready")[0] == 200
    client = grpcclient.InferenceServerClient(smoke.grpc_url)
    headers = smoke.grpc_admin_headers
    try:
        client.unload_model("smoke", headers=headers)
        assert not client.is_model_ready("smoke")
        client.load_model("smoke", headers=headers)
        assert client.is_model_ready("smoke")
        assert client.get_inference_statistics("smoke", headers=headers, as_json=True)["model_stats"]
    finally:
        client.close()


def test_orca_gpt_cannot_be_reloaded_or_unloaded_without_the_key(orca_server: TritonServer, tmp_path: Path) -> None:
    """The engine's own model: a reload with an overridden config (a trace file or a model path anywhere, run-
    time LoRA updating on) and an unload are refused; orca_gpt stays ready."""
    _refused_everywhere(orca_server, tmp_path / "pwned", "orca_gpt", None)


# -- what listens ------------------------------------------------------------------------------------
def _listening(pids: set[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that a process of `pids` holds (/proc/net/tcp*)."""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:
                continue
            raw, port = local.split(":")
            packed = bytes.fromhex(raw)
            if width == 4:
                address = socket.inet_ntop(socket.AF_INET, packed[::-1])
            else:  # four 32-bit words, each in host (little-endian) order
                address = socket.inet_ntop(socket.AF_INET6, b"".join(packed[i:i + 4][::-1] for i in range(0, 16, 4)))
            found.append((address, int(port, 16)))
    return found


def _tree(root: int) -> set[int]:
    """`root` and its descendants (/proc's children lists)."""
    pids, todo = set(), [root]
    while todo:
        pid = todo.pop()
        pids.add(pid)
        for task in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                todo += [int(child) for child in task.read_text().split()]
            except OSError:
                pass
    return pids


def test_the_launcher_listens_on_loopback_only_by_default(tmp_path: Path) -> None:
    """`make serve`'s command with its default flags (ports aside): tritonserver, its stub and orca-openai
    listen, and every listening socket of the process tree is on loopback (127.0.0.1, ::ffff:127.0.0.1)."""
    http, grpc, metrics, openai = free_ports(4)
    proc = subprocess.Popen(
        [sys.executable, "-m", "orca_server.launcher", "--model-repository", str(make_smoke_repository(tmp_path)),
         "--backend-dir", str(tmp_path / "b"), "--http-port", str(http), "--grpc-port", str(grpc),
         "--metrics-port", str(metrics), "--openai-port", str(openai)],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={k: v for k, v in os.environ.items() if k != "ORCA_ADMIN_KEY"},
    )
    try:
        ports = {http, grpc, metrics, openai}
        deadline = time.monotonic() + 180
        while True:  # until all four ports listen (orca-openai binds before Triton's model is ready)
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            sockets = _listening(_tree(proc.pid))
            if ports <= {port for _, port in sockets}:
                break
            assert time.monotonic() < deadline, f"not all of {ports} listen: {sockets}"
            time.sleep(0.5)
        beyond = [(a, p) for a, p in sockets if not is_loopback(a)]
        assert not beyond, f"listening beyond loopback: {beyond} (all: {sockets})"
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
    assert "admin-key=***" in out  # the command is shown, its key never


def test_the_baselines_batcher_queue_is_bounded() -> None:
    """request_level_gpt's waiting queue is Triton's dynamic batcher's: bounded as orca_gpt's max_queue (1024,
    EngineConfig's default), so a flood is refused at once instead of held without bound. The session's
    request_level_tiny is made from this config, so the session's Triton loading it checks the syntax."""
    from orca import EngineConfig

    repository = Path(__file__).resolve().parents[1] / "model_repository"
    config = (repository / "request_level_gpt" / "config.pbtxt").read_text()
    batching = config[config.index("dynamic_batching {"):]
    batching = batching[:batching.index("\n}\n")]
    assert "default_queue_policy { max_queue_size: 1024 }" in batching
    assert EngineConfig().max_queue == 1024
