"""The ``tritonserver`` process: its command line, its ports, starting it, waiting for it, stopping it.

* :func:`build_command`: tritonserver's argv, the wheel's binary (located by
  :mod:`orca_server.wheel`) or an installed one: ports, addresses (loopback by default),
  Triton's administrative APIs behind the admin key, model control, the CPU-only flags.
* :class:`TritonServer`: Triton as a child process for tests and benchmarks, on
  given or free ports (:func:`free_ports`): start, wait for ready, stop the whole
  process group and remove the /dev/shm regions its stubs left behind.
* :func:`run_beside`: the CLI's foreground run of tritonserver beside the
  OpenAI-compatible front end (orca-openai) until Triton exits, signals
  forwarded to both.

Ports are always parameters: defaults live in the CLI (:mod:`orca_server.launcher`) only.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import secrets
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from orca_client.admin import ADMIN_KEY_HEADER, GRPC_ADMIN_KEY_HEADER

from orca_server.wheel import PyTritonPaths, TritonServerError, find_pytriton_paths, prepare_backend_dir, server_env

SHM_PREFIX_ROOT = "orca_triton_"
"""Prefix of the Python backend's /dev/shm regions for servers we start; lets
:class:`TritonServer` remove regions left behind after a forced kill."""


def has_nvidia_gpu() -> bool:
    """Whether an NVIDIA driver exposes a device here (cheap: no CUDA call)."""
    return Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia/gpus").is_dir()


LOOPBACK = "127.0.0.1"
"""Where Triton listens unless told otherwise: nothing beyond this host reaches it by default."""

RESTRICTED_APIS = ("model-repository", "shared-memory", "logging", "trace", "statistics")
"""Triton's administrative APIs, answered on HTTP and gRPC only to a request carrying the admin key: loading a
model with a config and a `file:` override is code execution, the rest reconfigure or inspect the server."""


GRPC_RESPONSE_POOL_SIZE = 4096
"""--grpc-max-response-pool-size where the binary has it (newer releases; the wheel's 2.51 has not): a bound
on the responses Triton holds for gRPC streams whose clients stop reading."""


def new_admin_key() -> str:
    """A fresh admin key: 256 random bits, URL-safe (Triton compares it as a plain header value)."""
    return secrets.token_urlsafe(32)


def redact(cmd: Sequence[str], admin_key: str) -> str:
    """`cmd` as one line for a log or a terminal, the admin key replaced by ***."""
    return " ".join(cmd).replace(admin_key, "***") if admin_key else " ".join(cmd)


@functools.lru_cache(maxsize=8)
def _help_text(binary: str, env_key: tuple[tuple[str, str], ...]) -> str:
    try:
        done = subprocess.run([binary, "--help"], env=dict(env_key), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout + done.stderr


def has_flag(binary: str | os.PathLike[str], flag: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether this tritonserver binary knows `flag` (read once from its --help)."""
    env_key = tuple(sorted((env if env is not None else os.environ).items()))
    return re.search(rf"^\s*{re.escape(flag)}\b", _help_text(str(binary), env_key), re.M) is not None


def build_command(
    model_repository: str | os.PathLike[str],
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    backend_dir: str | os.PathLike[str] | None,
    extra_args: Sequence[str] = (),
    *,
    admin_key: str,
    models: Sequence[str] = (),
    address: str = LOOPBACK,
    metrics_address: str | None = None,
    gpu: bool | None = None,
    paths: PyTritonPaths | None = None,
    tritonserver: str | os.PathLike[str] | None = None,
    response_pool: bool | None = None,
) -> list[str]:
    """The ``tritonserver`` argv, for every way this project starts Triton (the launcher, tests, the
    container, the manifests).

    HTTP and gRPC bind to ``address``, metrics to ``metrics_address`` (default ``address``): loopback
    unless the caller names another interface. Triton's administrative APIs (:data:`RESTRICTED_APIS`) answer
    only requests whose ``admin-key`` header is ``admin_key``. The server uses explicit model control (so a
    failed model can unload itself, in-process, and report not ready) and loads ``models``, or every model at
    startup (``--load-model=*``). ``tritonserver`` is an installed binary with its own backends (NVIDIA's
    container); otherwise the nvidia-pytriton wheel's, with ``backend_dir`` assembled for it. Without a GPU
    (``gpu=None`` detects one), GPU metrics and the pinned-memory pool are turned off: both need CUDA and only
    log errors otherwise. ``response_pool`` (None: when the binary has the flag) bounds the gRPC response
    pool. ``extra_args`` come last so they can override anything.
    """
    if not admin_key:
        raise ValueError("build_command needs an admin key: Triton's administrative APIs are never left open")
    if tritonserver is not None:
        binary = str(tritonserver)
        cmd = [binary, f"--model-repository={Path(model_repository).resolve()}"]
        if backend_dir is not None:
            cmd.append(f"--backend-directory={Path(backend_dir).resolve()}")
    else:
        paths = paths or find_pytriton_paths()
        binary = str(paths.tritonserver)
        if backend_dir is None:
            raise ValueError("the nvidia-pytriton wheel's tritonserver needs its assembled backend directory")
        cmd = [
            binary,
            f"--model-repository={Path(model_repository).resolve()}",
            f"--backend-directory={Path(backend_dir).resolve()}",
            f"--cache-directory={paths.caches_dir}",
        ]
    cmd += [f"--http-port={int(http_port)}", f"--grpc-port={int(grpc_port)}", f"--metrics-port={int(metrics_port)}"]
    if not (has_nvidia_gpu() if gpu is None else gpu):
        cmd += ["--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0"]
    cmd += [
        f"--http-address={address}",
        f"--grpc-address={address}",
        f"--metrics-address={metrics_address or address}",
    ]
    restricted = f"{','.join(RESTRICTED_APIS)}:{ADMIN_KEY_HEADER}={admin_key}"
    cmd += [f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"]
    if response_pool is None:
        response_pool = has_flag(binary, "--grpc-max-response-pool-size",
                                 server_env(paths=paths) if tritonserver is None else None)
    if response_pool:
        cmd.append(f"--grpc-max-response-pool-size={GRPC_RESPONSE_POOL_SIZE}")
    # Explicit model control in both cases: a model whose engine failed unloads itself, so Triton reports
    # it not ready (orca_gpt's model.py); --load-model=* loads every model at startup.
    cmd.append("--model-control-mode=explicit")
    cmd += [f"--load-model={name}" for name in models] if models else ["--load-model=*"]
    cmd += list(extra_args)
    return cmd


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports the OS reports free right now.

    All sockets stay open until every port is picked so the OS cannot hand out
    the same port twice; another process may still grab one before Triton binds
    it, which :class:`TritonServer` handles by retrying.
    """
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
        return ports


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    """Wait until no process of group ``pgid`` is left (stubs are reaped by init).

    Killed stubs are re-parented to init and linger for a moment; waiting for
    them means the next server starts with their CPU and shared memory free.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        time.sleep(0.05)
    return False


def _answers(url: str) -> bool:
    """Whether a GET of `url` answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: Path, lines: int = 60) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


class TritonServer:
    """Run ``tritonserver`` as a child process for tests and benchmarks.

    ``with TritonServer(repo) as server:`` starts Triton on the given ports (or
    free ones), waits for ``/v2/health/ready`` and ``/metrics`` and always stops it on exit:
    SIGINT for a graceful shutdown, then SIGKILL of the whole process group
    (which also holds the Python backend stubs) after ``stop_timeout``.

    Attributes available once constructed: ``http_url`` (``http://host:port``),
    ``http_address`` and ``grpc_url`` (``host:port``, what ``tritonclient.http``
    and ``tritonclient.grpc`` take), ``metrics_url`` (full ``.../metrics`` URL)
    and ``log_path``; ``admin_key`` (given, or a fresh one) opens Triton's administrative APIs, which
    :attr:`admin_headers` carry.
    """

    _PORT_RETRIES = 3

    def __init__(
        self,
        model_repository: str | os.PathLike[str],
        *,
        models: Sequence[str] = (),
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        host: str = "127.0.0.1",
        log_path: str | os.PathLike[str] | None = None,
        backend_dir: str | os.PathLike[str] | None = None,
        startup_timeout: float = 120.0,
        stop_timeout: float = 20.0,
        log_verbose: int = 0,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        admin_key: str | None = None,
    ) -> None:
        self.admin_key = admin_key or new_admin_key()
        self.model_repository = Path(model_repository).resolve()
        if not self.model_repository.is_dir():
            raise TritonServerError(f"model repository {self.model_repository} is not a directory")
        self.models = tuple(models)
        self.host = host
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.log_verbose = log_verbose
        self.extra_args = tuple(extra_args)
        self._fixed_ports = (http_port, grpc_port, metrics_port)
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self.log_path = Path(log_path) if log_path is not None else self._scratch() / "tritonserver.log"
        self._backend_dir = Path(backend_dir) if backend_dir is not None else self._scratch() / "backends"
        self._paths = find_pytriton_paths()
        self._env = server_env(env, paths=self._paths)
        self._shm_prefix = f"{SHM_PREFIX_ROOT}{os.getpid()}_{uuid.uuid4().hex[:8]}_"
        self._proc: subprocess.Popen[bytes] | None = None
        self.http_port, self.grpc_port, self.metrics_port = self._pick_ports()

    def _scratch(self) -> Path:
        """Temporary directory for whatever the caller did not place (log, backend dir).

        Kept after :meth:`stop` so the log can be read; removed by :meth:`close`.
        """
        if self._tmpdir is None:
            self._tmpdir = tempfile.TemporaryDirectory(prefix="orca_triton_")
        return Path(self._tmpdir.name)

    # -- addresses -------------------------------------------------------
    @property
    def http_address(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.http_address}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def admin_headers(self) -> dict[str, str]:
        """The header an HTTP request to Triton's administrative APIs needs (tritonclient.http's ``headers=``)."""
        return {ADMIN_KEY_HEADER: self.admin_key}

    @property
    def grpc_admin_headers(self) -> dict[str, str]:
        """The metadata a gRPC call to them needs (tritonclient.grpc's ``headers=``)."""
        return {GRPC_ADMIN_KEY_HEADER: self.admin_key}

    @property
    def pid(self) -> int | None:
        """Process id of tritonserver (also its process group id) while started."""
        return self._proc.pid if self._proc else None

    @property
    def shm_prefix(self) -> str:
        """Name prefix of this server's Python backend regions in /dev/shm."""
        return self._shm_prefix

    def _pick_ports(self) -> tuple[int, int, int]:
        chosen = iter(free_ports(3, self.host))
        http, grpc, metrics = (p if p is not None else next(chosen) for p in self._fixed_ports)
        return http, grpc, metrics

    # -- lifecycle -------------------------------------------------------
    def command(self) -> list[str]:
        """The full argv this server runs (for logs and error messages)."""
        args = [
            f"--log-verbose={self.log_verbose}",
            f"--backend-config=python,shm-region-prefix-name={self._shm_prefix}",
            *self.extra_args,
        ]
        return build_command(
            self.model_repository,
            self.http_port,
            self.grpc_port,
            self.metrics_port,
            self._backend_dir,
            args,
            admin_key=self.admin_key,
            models=self.models,
            address=self.host,
            paths=self._paths,
        )

    def start(self) -> TritonServer:
        """Start Triton and block until it reports ready.

        Retries with fresh ports if an auto-picked port was taken in the
        meantime.  Raises :class:`TritonServerError` with the log tail if the
        server exits or is not ready within ``startup_timeout``.
        """
        if self._proc is not None:
            raise TritonServerError("server already started")
        prepare_backend_dir(self._backend_dir, paths=self._paths)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        auto_ports = None in self._fixed_ports
        for attempt in range(1, self._PORT_RETRIES + 1):
            self._spawn()
            try:
                self._wait_ready()
                return self
            except TritonServerError:
                log = _tail(self.log_path, 200)
                self.stop()
                port_clash = "already in use" in log.lower()
                if not (auto_ports and port_clash and attempt < self._PORT_RETRIES):
                    raise
                self.http_port, self.grpc_port, self.metrics_port = self._pick_ports()
            except BaseException:  # e.g. Ctrl-C while waiting: never leave Triton behind
                self.stop()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _spawn(self) -> None:
        cmd = self.command()
        with open(self.log_path, "ab") as log:
            log.write(f"$ {redact(cmd, self.admin_key)}\n".encode())
            log.flush()
            # A new session makes Triton and its stubs one process group that
            # stop() can kill as a whole, and keeps Ctrl-C in a terminal
            # running pytest from reaching Triton before we stop it in order.
            self._proc = subprocess.Popen(
                cmd,
                env=self._env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        # Triton opens its metrics service just after HTTP: ready means both answer.
        urls = (f"{self.http_url}/v2/health/ready", self.metrics_url)
        while True:
            code = self._proc.poll()
            if code is not None:
                raise TritonServerError(
                    f"tritonserver exited with code {code} during startup "
                    f"(log {self.log_path}):\n{_tail(self.log_path)}"
                )
            unready = next((url for url in urls if not _answers(url)), None)
            if unready is None:
                return
            if time.monotonic() > deadline:
                raise TritonServerError(
                    f"tritonserver not ready at {unready} after {self.startup_timeout:.0f}s "
                    f"(log {self.log_path}):\n{_tail(self.log_path)}"
                )
            time.sleep(0.2)

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def send_signal(self, sig: int) -> None:
        """Sends ``sig`` to tritonserver alone (not its stubs), as a supervisor would: SIGTERM or SIGINT
        starts Triton's graceful shutdown (``--exit-timeout-secs``)."""
        if self._proc is None:
            raise TritonServerError("server not started")
        self._proc.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int | None:
        """Waits up to ``timeout`` s for tritonserver to exit; its exit code, or None if it still runs."""
        if self._proc is None:
            raise TritonServerError("server not started")
        try:
            return self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> int | None:
        """Stop the server (SIGINT, then SIGKILL of its group); return its exit code.

        Safe to call more than once and on a server that already died.
        """
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                pass
        # Kill whatever is left in the group: Triton itself if it ignored
        # SIGINT, and any Python backend stub it left behind.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
        _wait_group_gone(proc.pid, timeout=self.stop_timeout)
        self._remove_shm()
        return code

    def _remove_shm(self) -> None:
        """Remove /dev/shm regions of our stubs that a forced kill left behind."""
        shm = Path("/dev/shm")
        if shm.is_dir():
            for region in shm.glob(f"{self._shm_prefix}*"):
                with contextlib.suppress(OSError):
                    region.unlink()

    def close(self) -> None:
        """Stop the server and delete the temporary directory (log included)."""
        self.stop()
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> TritonServer:
        # start() stops the server itself on failure; the log stays for reading.
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"TritonServer({self.model_repository}, http={self.http_url}, {state})"


def run_beside(
    triton_cmd: list[str], env: Mapping[str, str], openai_cmd: list[str], openai_env: Mapping[str, str] | None = None
) -> int:
    """Runs tritonserver and orca-openai (in ``openai_env``: the admin key, say) as children until Triton
    exits; SIGINT/SIGTERM go to both, and orca-openai is stopped when Triton is gone. Returns Triton's exit
    status."""
    triton = subprocess.Popen(triton_cmd, env=dict(env))
    try:
        openai = subprocess.Popen(openai_cmd, env=dict(openai_env) if openai_env is not None else None)
    except OSError:
        triton.send_signal(signal.SIGINT)
        triton.wait()
        raise
    children = (triton, openai)

    def forward(signum: int, frame: object) -> None:
        for child in children:
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while triton.poll() is None:
            if openai.poll() is not None and openai.returncode not in (0, -signal.SIGINT, -signal.SIGTERM):
                print(f"orca-openai exited with status {openai.returncode}; Triton keeps running", flush=True)
                openai.returncode = 0  # said once
            with contextlib.suppress(subprocess.TimeoutExpired):
                triton.wait(timeout=0.5)
    finally:
        _stop(openai, signal.SIGTERM, 15)
        _stop(triton, signal.SIGINT, 60)  # running still only on an exception in this process
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return triton.returncode


def _stop(proc: subprocess.Popen, sig: int, timeout: float) -> None:
    """Sends `sig` to a child that still runs, and kills it if it has not exited within `timeout` s."""
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
