"""Tests of orca_server (wheel.py, server.py, launcher.py): wheel discovery, backend dir, environment, CLI, and
real tritonserver runs on a throwaway decoupled model (tests/smoke_model).

The smoke tests also pin down Python backend 2.51 behaviour that the engine's
Triton model relies on (error responses, cancellation, /generate input mapping,
custom metrics), so an upgrade of nvidia-pytriton that changes it fails here
first, with a small model, rather than deep inside the engine tests.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from test_server_e2e import wait_for
from tritonclient.utils import InferenceServerException

from orca_server.launcher import is_loopback
from orca_server.server import GRPC_RESPONSE_POOL_SIZE, TritonServer, build_command, redact
from orca_server.wheel import TritonServerError, find_pytriton_paths, prepare_backend_dir, server_env

SMOKE_MODEL = Path(__file__).resolve().parent / "smoke_model"
REPO_ROOT = Path(__file__).resolve().parent.parent


# -- helpers -----------------------------------------------------------------------------------------
def make_smoke_repository(root: Path) -> Path:
    """A model repository holding only the smoke model, laid out as Triton wants it."""
    repo = root / "repo"
    (repo / "smoke" / "1").mkdir(parents=True)
    shutil.copy(SMOKE_MODEL / "config.pbtxt", repo / "smoke" / "config.pbtxt")
    shutil.copy(SMOKE_MODEL / "model.py", repo / "smoke" / "1" / "model.py")
    return repo


def post(url: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def sse_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: ")]


def metric(server: TritonServer, name: str, **labels: str) -> float | None:
    """One sample from the Prometheus text on the metrics port (None if absent)."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return None


@contextmanager
def grpc_stream(server: TritonServer) -> Iterator[tuple[grpcclient.InferenceServerClient, queue.Queue[Any]]]:
    """A gRPC bidirectional stream whose callback puts (result, error) on a queue."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        yield client, responses
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def smoke_inputs(value: int) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
    return [tensor]


def is_final(result: Any) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


# -- no server needed --------------------------------------------------------------------------------
def test_find_pytriton_paths_locates_the_wheels_files() -> None:
    paths = find_pytriton_paths()
    tag = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert os.access(paths.tritonserver, os.X_OK)
    assert paths.stub.parent.name == tag and os.access(paths.stub, os.X_OK)
    assert {p.name for p in paths.backend_files} == {"libtriton_python.so", "triton_python_backend_utils.py"}
    assert all(p.is_file() for p in paths.backend_files)
    assert any(paths.libs_dir.glob("libtritonserver*.so*"))
    assert "pytriton.triton" not in sys.modules, "PyTriton's API must not be imported"


def test_find_pytriton_paths_names_the_shipped_stubs_when_version_is_missing() -> None:
    with pytest.raises(TritonServerError, match=r"Python 2\.7.*3\.11"):
        find_pytriton_paths((2, 7))


def test_prepare_backend_dir_symlinks_and_is_idempotent(tmp_path: Path) -> None:
    paths = find_pytriton_paths()
    dest = prepare_backend_dir(tmp_path / "backends")
    python_dir = dest / "python"
    names = sorted(p.name for p in python_dir.iterdir())
    assert names == ["libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py"]
    for src in (*paths.backend_files, paths.stub):
        link = python_dir / src.name
        assert link.is_symlink() and link.resolve() == src.resolve()
    before = {p.name: p.lstat().st_ino for p in python_dir.iterdir()}
    assert prepare_backend_dir(tmp_path / "backends") == dest
    assert {p.name: p.lstat().st_ino for p in python_dir.iterdir()} == before, "second call rewrote files"


def test_prepare_backend_dir_copies_and_repairs_stale_entries(tmp_path: Path) -> None:
    paths = find_pytriton_paths()
    python_dir = tmp_path / "python"
    python_dir.mkdir()
    (python_dir / "triton_python_backend_stub").symlink_to(tmp_path / "gone")  # dangling
    (python_dir / "libtriton_python.so").write_bytes(b"stale")
    prepare_backend_dir(tmp_path, copy=True)
    for src in (*paths.backend_files, paths.stub):
        dst = python_dir / src.name
        assert not dst.is_symlink() and dst.read_bytes() == src.read_bytes()
    assert os.access(python_dir / "triton_python_backend_stub", os.X_OK)
    assert not [p for p in python_dir.iterdir() if p.name.startswith(".")], "temporary files left behind"


def test_server_env_puts_our_interpreter_and_libs_first_without_touching_os_environ() -> None:
    paths = find_pytriton_paths()
    snapshot = dict(os.environ)
    env = server_env({"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/x", "KEEP": "1"})
    assert os.environ == snapshot
    assert env["KEEP"] == "1"
    path = env["PATH"].split(os.pathsep)
    # The stub finds its prefix (and so our venv's site-packages) through python3 on PATH.
    assert path[0] == str(Path(sys.executable).absolute().parent) and path[-1] == "/usr/bin"
    assert (Path(path[0]) / "python3").exists()
    ld = env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert ld == [str(paths.libs_dir), sysconfig.get_config_var("LIBDIR"), "/opt/x"]


def test_build_command_modes_and_ports(tmp_path: Path) -> None:
    cmd = build_command(tmp_path, 1, 2, 3, tmp_path / "b", ["--log-verbose=1"], admin_key="k3y", models=["a", "b"],
                        address="10.0.0.5", metrics_address="0.0.0.0", response_pool=True)
    assert cmd[0].endswith("/tritonserver")
    for arg in (
        "--http-port=1",
        "--grpc-port=2",
        "--metrics-port=3",
        "--model-control-mode=explicit",
        "--load-model=a",
        "--load-model=b",
        "--http-address=10.0.0.5",
        "--grpc-address=10.0.0.5",
        "--metrics-address=0.0.0.0",
        "--http-restricted-api=model-repository,shared-memory,logging,trace,statistics:admin-key=k3y",
        "--grpc-restricted-protocol=model-repository,shared-memory,logging,trace,statistics:admin-key=k3y",
        f"--grpc-max-response-pool-size={GRPC_RESPONSE_POOL_SIZE}",
        f"--backend-directory={(tmp_path / 'b').resolve()}",
        f"--model-repository={tmp_path.resolve()}",
    ):
        assert arg in cmd
    assert cmd[-1] == "--log-verbose=1", "extra args must come last so they override"
    plain = build_command(tmp_path, 1, 2, 3, tmp_path, admin_key="k", gpu=False)
    assert "--model-control-mode=explicit" in plain and "--pinned-memory-pool-byte-size=0" in plain
    assert "--pinned-memory-pool-byte-size=0" not in build_command(tmp_path, 1, 2, 3, tmp_path, admin_key="k", gpu=True)
    assert [a for a in plain if a.startswith("--load-model")] == ["--load-model=*"]
    # Loopback unless told otherwise; the wheel's 2.51 has no response-pool flag (read off its --help).
    assert {a for a in plain if "-address=" in a} == {f"--{k}-address=127.0.0.1" for k in ("http", "grpc", "metrics")}
    assert not any(a.startswith("--grpc-max-response-pool-size") for a in plain)
    with pytest.raises(ValueError, match="admin key"):
        build_command(tmp_path, 1, 2, 3, tmp_path, admin_key="")
    # An installed Triton (NVIDIA's container) keeps its own backends and caches.
    system = build_command(tmp_path, 1, 2, 3, None, admin_key="k", tritonserver="/opt/tritonserver/bin/tritonserver",
                           response_pool=False)
    assert system[0] == "/opt/tritonserver/bin/tritonserver"
    assert not any(a.startswith(("--backend-directory", "--cache-directory")) for a in system)
    assert redact(system, "k3y") == " ".join(system) and "k3y" not in redact(cmd, "k3y")


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orca_server.launcher", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env=env,
    )


def test_cli_help_and_dry_run_with_ports_from_env(tmp_path: Path) -> None:
    helped = run_cli("--help")
    assert helped.returncode == 0 and "--model-repository" in helped.stdout and "ORCA_HTTP_PORT" in helped.stdout
    env = {**os.environ, "ORCA_HTTP_PORT": "18123", "ORCA_GRPC_PORT": "18124", "ORCA_METRICS_PORT": "18125"}
    dry = run_cli(
        "--model-repository",
        str(make_smoke_repository(tmp_path)),
        "--backend-dir",
        str(tmp_path / "b"),
        "--model",
        "smoke",
        "--tool-call-parser",
        "hermes",
        "--dry-run",
        "--",
        "--log-verbose=1",
        env=env,
    )
    assert dry.returncode == 0, dry.stderr
    assert "--tool-call-parser hermes" in dry.stdout  # orca-openai's command line
    for arg in ("--http-port=18123", "--grpc-port=18124", "--metrics-port=18125", "--load-model=smoke"):
        assert arg in dry.stdout
    assert dry.stdout.rstrip().endswith("--log-verbose=1")
    assert (tmp_path / "b" / "python" / "triton_python_backend_stub").exists()
    missing = run_cli("--model-repository", str(tmp_path / "nope"), "--dry-run")
    assert missing.returncode == 2 and "not found" in missing.stderr


def test_the_admin_key_is_never_printed_and_binding_beyond_loopback_warns(tmp_path: Path) -> None:
    """The dry run shows tritonserver's command with the key as ***, from $ORCA_ADMIN_KEY or --admin-key-file
    (created with mode 0600 when missing, then reused); --address 0.0.0.0 is allowed, with a warning."""
    repo = str(make_smoke_repository(tmp_path))
    env = {k: v for k, v in os.environ.items() if k != "ORCA_ADMIN_KEY"}
    common = ("--model-repository", repo, "--backend-dir", str(tmp_path / "b"), "--dry-run")
    from_env = run_cli(*common, env={**env, "ORCA_ADMIN_KEY": "s3cret-from-env"})
    assert from_env.returncode == 0, from_env.stderr
    assert "s3cret-from-env" not in from_env.stdout + from_env.stderr and "admin-key=***" in from_env.stdout
    assert "warning" not in from_env.stderr and "--http-address=127.0.0.1" in from_env.stdout
    assert "--host 127.0.0.1" in from_env.stdout  # orca-openai's
    key_file = tmp_path / "run" / "admin-key"
    first = run_cli(*common, "--admin-key-file", str(key_file), "--address", "0.0.0.0", env=env)
    assert first.returncode == 0, first.stderr
    key = key_file.read_text().strip()
    assert len(key) >= 32 and key_file.stat().st_mode & 0o777 == 0o600
    assert key not in first.stdout + first.stderr and "warning: --address 0.0.0.0" in first.stderr
    assert "--metrics-address=0.0.0.0" in first.stdout
    again = run_cli(*common, "--admin-key-file", str(key_file), "--metrics-address", "10.1.2.3", env=env)
    assert key_file.read_text().strip() == key and key not in again.stdout
    assert "warning: --metrics-address 10.1.2.3" in again.stderr and "--http-address=127.0.0.1" in again.stdout


def test_is_loopback() -> None:
    assert all(is_loopback(a) for a in ("127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost", "::ffff:127.0.0.1"))
    assert not any(is_loopback(a) for a in ("0.0.0.0", "::", "10.0.0.1", "::ffff:10.0.0.1", "example.com", ""))


def test_make_serve_takes_ports_from_the_environment(tmp_path: Path) -> None:
    """`ORCA_HTTP_PORT=... make serve` reaches tritonserver's (and orca-openai's) command line; a port given to
    make wins over the environment. `-o venv` keeps make from running scripts/setup_venv.sh (serve: venv)."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    repo = make_smoke_repository(tmp_path)

    def serve(*make_args: str, **env: str) -> str:
        done = subprocess.run(
            ["make", "-s", "-o", "venv", "serve", f"VPY={sys.executable}", f"MODEL_REPOSITORY={repo}",
             f"SERVE_ARGS=--dry-run --backend-dir {tmp_path / 'b'}", *make_args],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
            env={**{k: v for k, v in os.environ.items() if not k.startswith("ORCA_") and not k.endswith("_PORT")},
                 **env},
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    out = serve(ORCA_HTTP_PORT="18123", ORCA_GRPC_PORT="18124", ORCA_METRICS_PORT="18125", ORCA_OPENAI_PORT="18126")
    triton = out.rstrip().splitlines()[-1]  # the dry run prints tritonserver's command last
    for arg in ("--http-port=18123", "--grpc-port=18124", "--metrics-port=18125"):
        assert arg in triton
    assert "--port 18126 --triton-url 127.0.0.1:18124 --metrics-url http://127.0.0.1:18125/metrics" in out
    out = serve("HTTP_PORT=18200", "OPENAI_PORT=0", ORCA_HTTP_PORT="18123", ORCA_OPENAI_PORT="18126")
    assert "--http-port=18200" in out and "--grpc-port=8001" in out and "orca_openai" not in out
    out = serve()
    assert all(f"--{name}-port={port}" in out for name, port in (("http", 8000), ("grpc", 8001), ("metrics", 8002)))
    assert "--port 9000" in out


def test_startup_failure_raises_with_the_log_tail(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "config.pbtxt").write_text('name: "broken"\nbackend: "python"\nmax_batch_size: 0\n')
    (repo / "broken" / "1" / "model.py").write_text("raise RuntimeError('model import exploded')\n")
    server = TritonServer(repo, log_path=tmp_path / "server.log", startup_timeout=120)
    with pytest.raises(TritonServerError, match="(?s)exited with code.*model import exploded"):
        with server:
            pass
    assert not server.is_running()


# -- real servers on the smoke model -----------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    root = tmp_path_factory.mktemp("smoke")
    with TritonServer(make_smoke_repository(root), log_path=root / "tritonserver.log") as server:
        yield server


def test_decoupled_smoke(smoke_server: TritonServer) -> None:
    """Three streamed responses then FINAL, over gRPC streaming, HTTP generate_stream and generate."""
    with grpc_stream(smoke_server) as (client, responses):
        client.async_stream_infer("smoke", smoke_inputs(5), request_id="r1", enable_empty_final_response=True)
        outs = []
        while True:
            result, error = responses.get(timeout=30)
            assert error is None, error
            if is_final(result):
                assert not result.get_response().outputs
                break
            assert result.get_response().id == "r1"
            outs.append(int(result.as_numpy("OUT")[0]))
    assert outs == [5, 6, 7]

    status, text = post(f"{smoke_server.http_url}/v2/models/smoke/generate_stream", {"IN": 10})
    assert status == 200
    assert [event["OUT"] for event in sse_events(text)] == [10, 11, 12]

    status, text = post(f"{smoke_server.http_url}/v2/models/smoke/generate", {"IN": 3, "n": 1})
    assert status == 200, text
    body = json.loads(text)
    assert body["OUT"] == 3 and body["model_name"] == "smoke"
    # The stub runs in this interpreter's environment (PATH trick in server_env), not the base one.
    info = json.loads(body["INFO"])
    assert Path(info["sys_prefix"]) == Path(sys.prefix) and info["numpy"] == np.__version__

    # /generate insists on exactly one response (yet answers 200 with an error body).
    status, text = post(f"{smoke_server.http_url}/v2/models/smoke/generate", {"IN": 3})
    assert "exactly 1 response" in json.loads(text)["error"]


def test_generate_maps_input_names_to_tensors_and_other_keys_to_parameters(smoke_server: TritonServer) -> None:
    url = f"{smoke_server.http_url}/v2/models/smoke/generate"
    status, text = post(
        url,
        {
            "IN": 1,
            "n": 1,
            "FLAG": True,
            "TEXT": "hi there",
            "IDS": [4, 5, 6],
            "max_tokens": 8,
            "temperature": 0.5,
            "ignore_eos": False,
            "stop": "x",
        },
    )
    assert status == 200, text
    info = json.loads(json.loads(text)["INFO"])
    # Keys naming an input become tensors; a scalar fills a dims [1] input; a list fills dims [-1].
    assert info["FLAG"] == {"dtype": "bool", "shape": [1], "value": [True]}
    assert info["TEXT"] == {"dtype": "object", "shape": [1], "value": ["hi there"]}
    assert info["IDS"] == {"dtype": "int32", "shape": [3], "value": [4, 5, 6]}
    # Every other key is a request parameter; request.parameters() is their JSON (floats included).
    assert json.loads(info["parameters"]) == {
        "n": 1,
        "max_tokens": 8,
        "temperature": 0.5,
        "ignore_eos": False,
        "stop": "x",
    }
    assert post(url, {"IN": 1, "IDS": 7, "n": 1})[0] == 200  # scalar into dims [-1] -> shape [1]
    # A list or object under a key that is not an input is refused before the model sees it.
    status, text = post(url, {"IN": 1, "n": 1, "input_ids": [1, 2]})
    assert status == 400 and "parameter 'input_ids' has invalid type" in text
    status, text = post(url, {"IN": [1, 2], "n": 1})
    assert status == 400 and "can not convert input 'IN'" in text


def test_error_response_with_final_flag(smoke_server: TritonServer) -> None:
    """An error response sent with FINAL ends the request; the TritonError code does not reach clients."""
    url = f"{smoke_server.http_url}/v2/models/smoke"
    for code in ("INVALID_ARG", "UNAVAILABLE", "INTERNAL"):
        assert post(f"{url}/generate", {"IN": 1, "n": 0, "error": code}) == (
            400,
            '{"error":"smoke error ' + code + '"}',
        )
    status, text = post(f"{url}/generate_stream", {"IN": 1, "n": 2, "error": "UNAVAILABLE"})
    assert status == 200  # headers went out with the first event
    assert sse_events(text)[-1] == {"error": "smoke error UNAVAILABLE"} and len(sse_events(text)) == 3

    with grpc_stream(smoke_server) as (client, responses):
        client.async_stream_infer(
            "smoke",
            smoke_inputs(1),
            request_id="bad",
            parameters={"n": 1, "error": "UNAVAILABLE"},
            enable_empty_final_response=True,
        )
        result, error = responses.get(timeout=30)
        assert error is None and int(result.as_numpy("OUT")[0]) == 1
        result, error = responses.get(timeout=30)
        # The server sends error_message plus the request id and final flag; tritonclient passes on
        # only the message: no status code, no request id.
        assert result is None and isinstance(error, InferenceServerException)
        assert error.message() == "smoke error UNAVAILABLE" and error.status() is None
        # The stream stays usable.
        client.async_stream_infer(
            "smoke", smoke_inputs(7), request_id="next", parameters={"n": 1}, enable_empty_final_response=True
        )
        result, error = responses.get(timeout=30)
        assert error is None and result.get_response().id == "next"


def test_cancellation_reaches_the_model(smoke_server: TritonServer) -> None:
    """stop_stream(cancel_requests=True) and an HTTP client hanging up both make is_cancelled() true."""

    def cancelled() -> tuple[float, float]:
        return (
            metric(smoke_server, "smoke_cancelled_total", source="sender") or 0.0,
            metric(smoke_server, "smoke_cancelled_total", source="request") or 0.0,
        )

    start = cancelled()
    client = grpcclient.InferenceServerClient(smoke_server.grpc_url)
    responses: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("smoke", smoke_inputs(0), parameters={"n": 1000, "sleep": 0.05})
    assert responses.get(timeout=30)[1] is None
    client.stop_stream(cancel_requests=True)
    client.close()
    wait_for(lambda: cancelled() == (start[0] + 1, start[1] + 1), "the model to see the gRPC cancellation", timeout=30)

    request = urllib.request.Request(
        f"{smoke_server.http_url}/v2/models/smoke/generate_stream",
        data=json.dumps({"IN": 0, "n": 1000, "sleep": 0.05}).encode(),
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.readline().startswith(b"data: ")
    wait_for(lambda: cancelled() == (start[0] + 2, start[1] + 2), "the model to see the HTTP disconnect", timeout=30)


def test_custom_metrics_on_the_metrics_port(smoke_server: TritonServer) -> None:
    post(f"{smoke_server.http_url}/v2/models/smoke/generate", {"IN": 1, "n": 1})
    with urllib.request.urlopen(smoke_server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    assert "# TYPE smoke_duration_seconds histogram" in text
    assert "# TYPE smoke_requests_total counter" in text
    for le in ("0.1", "1", "10", "+Inf"):
        assert re.search(rf'^smoke_duration_seconds_bucket\{{model="smoke",le="{re.escape(le)}"\}} \d+$', text, re.M)
    assert re.search(r'^smoke_duration_seconds_count\{model="smoke"\} [1-9]\d*$', text, re.M)
    assert re.search(r'^smoke_duration_seconds_sum\{model="smoke"\} \S+$', text, re.M)


def test_stop_kills_a_server_that_will_not_exit_and_cleans_up(tmp_path: Path) -> None:
    """A request that never finishes makes Triton wait on SIGINT; stop() then SIGKILLs the group."""
    server = TritonServer(make_smoke_repository(tmp_path), stop_timeout=2)
    with server:
        pid = server.pid
        assert pid is not None
        started = threading.Event()

        def endless() -> None:
            request = urllib.request.Request(
                f"{server.http_url}/v2/models/smoke/generate_stream",
                data=json.dumps({"IN": 0, "n": 100000, "sleep": 0.05}).encode(),
            )
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    response.readline()
                    started.set()
                    response.read()
            except (OSError, http.client.HTTPException):
                pass  # the server is killed under us: that is the point

        client = threading.Thread(target=endless, daemon=True)
        client.start()
        assert started.wait(30)
        shm_prefix = server.shm_prefix
        assert list(Path("/dev/shm").glob(f"{shm_prefix}*"))
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 15
    assert not server.is_running()
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # no process of the group is left, stubs included
    assert not list(Path("/dev/shm").glob(f"{shm_prefix}*"))
    assert server.log_path.exists()
    server.close()
    assert not server.log_path.exists()
    client.join(timeout=30)


# -- the shipped models of model_repository (session fixture from conftest.py) -----------------------
def test_model_repository_serves_every_model(triton_server: TritonServer) -> None:
    """`make serve` works: each model in model_repository/ loads and reports ready."""
    names = sorted(p.parent.name for p in (REPO_ROOT / "model_repository").glob("*/config.pbtxt"))
    index_request = urllib.request.Request(f"{triton_server.http_url}/v2/repository/index", data=b"{}",
                                           headers=triton_server.admin_headers)
    with urllib.request.urlopen(index_request, timeout=30) as response:
        index = {m["name"]: m.get("state") for m in json.load(response)}
    # The session server's repository holds every shipped model as is, beside the tests' tiny ones.
    assert {name: index.get(name) for name in names} == dict.fromkeys(names, "READY")
    from _server import FAILING_MODELS  # the failure tests unload these, whatever the order of the tests

    assert all(state == "READY" for name, state in index.items() if name not in FAILING_MODELS), index
    for name in names:
        with urllib.request.urlopen(f"{triton_server.http_url}/v2/models/{name}/ready", timeout=30) as response:
            assert response.status == 200
    with urllib.request.urlopen(triton_server.metrics_url, timeout=30) as response:
        assert b"nv_inference_request_success" in response.read()
    # Both shipped models (torch_compile auto on this CPU) compiled their forward pass at load, inside the
    # stub, and said so in the server's log; the tiny ones run eagerly (tests/_server.py).
    log = triton_server.log_path.read_text(errors="replace")
    assert log.count("orca.worker.cpu_graphs.runner: forward pass compiled in") == len(names), log[-3000:]
    assert "runs eagerly: compiling failed" not in log
