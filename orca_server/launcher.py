"""Start NVIDIA Triton from the ``nvidia-pytriton`` wheel on a plain model repository.

Why this module exists: the ``nvidia-pytriton`` wheel ships the ``tritonserver``
binary, the Python backend (``libtriton_python.so`` plus
``triton_python_backend_utils.py``) and one Python backend *stub* per CPython
version, but it lays them out for PyTriton's own use.  To serve our decoupled
Python-backend model we need to

* assemble a backend directory ``<dir>/python/`` holding the backend library,
  its utils module and the stub built for *this* interpreter (Triton looks for
  the stub next to ``libtriton_python.so``);
* give the binaries a library path with the wheel's bundled ``.libs`` folder and
  the interpreter's ``libpython3.X.so`` (the stub links against it, and without
  our interpreter's LIBDIR it may pick up a different system libpython);
* make the stub's embedded interpreter use *this* environment's packages: it
  runs with an isolated config that ignores ``PYTHONPATH``, so we put this
  interpreter's ``bin`` first on ``PATH`` (see :func:`server_env`).

Everything here only reads the wheel's files; PyTriton's Python API is never
imported.  Ports are always parameters: defaults live in the CLI only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
STUB_NAME = "triton_python_backend_stub"
SHM_PREFIX_ROOT = "orca_triton_"
"""Prefix of the Python backend's /dev/shm regions for servers we start; lets
:class:`TritonServer` remove regions left behind after a forced kill."""


class TritonServerError(RuntimeError):
    """Triton could not be located, prepared, started or became unhealthy."""


@dataclasses.dataclass(frozen=True)
class PyTritonPaths:
    """Where the pieces of Triton live inside the installed ``nvidia-pytriton`` wheel."""

    package_dir: Path
    tritonserver: Path
    python_backend_dir: Path
    backend_files: tuple[Path, ...]
    stub: Path
    libs_dir: Path
    caches_dir: Path


def _python_tag(version: tuple[int, int] | None = None) -> str:
    major, minor = version if version is not None else sys.version_info[:2]
    return f"{major}.{minor}"


def find_pytriton_paths(python_version: tuple[int, int] | None = None) -> PyTritonPaths:
    """Locate the Triton binary, Python backend, stub and bundled libs in the wheel.

    Uses :func:`importlib.util.find_spec`, which finds the top-level ``pytriton``
    package without executing its ``__init__`` (PyTriton's API pulls in heavy
    dependencies and we use none of it).

    Args:
        python_version: ``(major, minor)`` of the stub to pick; defaults to the
            running interpreter, whose site-packages the stub will be given.

    Raises:
        TritonServerError: the wheel is missing, or it lacks a required file
            (for instance no stub for this Python version).
    """
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonServerError("package 'pytriton' not found: install nvidia-pytriton (scripts/setup_venv.sh)")
    package_dir = Path(next(iter(spec.submodule_search_locations))).resolve()
    root = package_dir / "tritonserver"
    tag = _python_tag(python_version)
    paths = PyTritonPaths(
        package_dir=package_dir,
        tritonserver=root / "bin" / "tritonserver",
        python_backend_dir=root / "backends" / "python",
        backend_files=tuple(root / "backends" / "python" / name for name in BACKEND_FILES),
        stub=root / "python_backend_stubs" / tag / STUB_NAME,
        libs_dir=package_dir.parent / "nvidia_pytriton.libs",
        caches_dir=root / "caches",
    )
    required = (paths.tritonserver, *paths.backend_files, paths.stub, paths.libs_dir)
    missing = [str(p) for p in required if not p.exists()]
    if missing:
        stubs = sorted(p.name for p in (root / "python_backend_stubs").glob("*"))
        raise TritonServerError(
            f"nvidia-pytriton at {package_dir} lacks {missing} (Python {tag}; stubs shipped for: {stubs or 'none'})"
        )
    return paths


def _link_or_copy(src: Path, dst: Path, *, copy: bool) -> None:
    """Make ``dst`` point at (or be a copy of) ``src``; no-op if already so.

    Replacement goes through a temporary name and :func:`os.replace` so that a
    concurrently starting server never sees a half-written file.
    """
    if copy:
        if (
            dst.is_file()
            and not dst.is_symlink()
            and dst.stat().st_size == src.stat().st_size
            and dst.stat().st_mtime_ns >= src.stat().st_mtime_ns
        ):
            return
    elif dst.is_symlink() and Path(os.readlink(dst)) == src:
        return
    tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex}")
    try:
        if copy:
            shutil.copy2(src, tmp)
        else:
            tmp.symlink_to(src)
        os.replace(tmp, dst)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def prepare_backend_dir(dest: Path, *, copy: bool = False, paths: PyTritonPaths | None = None) -> Path:
    """Create ``dest/python/`` with the Python backend and this Python's stub.

    Triton loads backend ``python`` from ``<backend-directory>/python/`` and the
    backend launches ``triton_python_backend_stub`` from that same folder, so
    the stub matching our interpreter must sit beside ``libtriton_python.so``.
    Symlinks are the default (cheap, and they follow a reinstalled wheel); the
    stub's RPATH is ``$ORIGIN``-relative and the loader resolves ``$ORIGIN`` of
    an executable through the symlink, and :func:`server_env` sets the library
    path anyway, so copies (``copy=True``) work too.  Idempotent.

    Returns:
        ``dest`` (resolved), the value for ``--backend-directory``.
    """
    paths = paths or find_pytriton_paths()
    dest = Path(dest).resolve()
    python_dir = dest / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for src in (*paths.backend_files, paths.stub):
        _link_or_copy(src, python_dir / src.name, copy=copy)
    return dest


def default_backend_dir() -> Path:
    """A persistent per-environment backend directory for the CLI.

    Inside a virtualenv it lives in the venv (tied to its interpreter and its
    wheel); otherwise in the user's cache directory, keyed by Python version.
    """
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "triton_backends"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "orca" / f"triton_backends-py{_python_tag()}"


def _join_paths(parts: Iterable[str | os.PathLike[str] | None]) -> str:
    """Join path-list entries with ``os.pathsep``, dropping empties and duplicates."""
    seen: list[str] = []
    for part in parts:
        for item in str(part or "").split(os.pathsep):
            if item and item not in seen:
                seen.append(item)
    return os.pathsep.join(seen)


def server_env(
    base: Mapping[str, str] | None = None,
    *,
    paths: PyTritonPaths | None = None,
) -> dict[str, str]:
    """Environment for ``tritonserver`` and the Python backend stubs it spawns.

    * ``PATH``: the running interpreter's ``bin`` directory first.  The stub
      embeds Python with an *isolated* config (``PyConfig_InitIsolatedConfig``),
      so it ignores ``PYTHONPATH``/``PYTHONHOME``; it finds its prefix the way
      ``python3`` would, by looking ``python3`` up on ``PATH``.  With a venv's
      ``bin`` first it finds ``pyvenv.cfg``, so ``sys.prefix`` is the venv and
      the venv's site-packages (``.pth`` files and editable installs included)
      are on the stub's ``sys.path``.  Without this the stub imports the base
      interpreter's packages (seen: numpy 2.x instead of the venv's 1.26).
    * ``LD_LIBRARY_PATH``: the wheel's ``nvidia_pytriton.libs`` (libtritonserver,
      libcudart...) and this interpreter's LIBDIR first, so the stub loads the
      ``libpython3.X.so`` of this interpreter, not a system one of the same
      minor version (``/lib/x86_64-linux-gnu`` has Debian's 3.11 here).
    * ``PYTHONUNBUFFERED``: model prints reach the server log promptly.

    The repository root is *not* put on the stub's path by the environment
    (nothing but ``PATH`` is honoured): ``pip install -e .`` makes the project
    importable, as ``scripts/setup_venv.sh`` does.

    Args:
        base: environment to extend; defaults to ``os.environ``.  Existing
            ``PATH``/``LD_LIBRARY_PATH`` entries are kept after ours.
        paths: wheel layout, from :func:`find_pytriton_paths` if not given.
    """
    paths = paths or find_pytriton_paths()
    env = dict(os.environ if base is None else base)
    # Not resolved: a venv's bin/python3 is a symlink, and resolving it would
    # lose the pyvenv.cfg next to it.
    interpreter_bin = Path(sys.executable).absolute().parent
    env["PATH"] = _join_paths([interpreter_bin, env.get("PATH") or os.defpath])
    libdir = sysconfig.get_config_var("LIBDIR")
    env["LD_LIBRARY_PATH"] = _join_paths([paths.libs_dir, libdir, env.get("LD_LIBRARY_PATH")])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def has_nvidia_gpu() -> bool:
    """Whether an NVIDIA driver exposes a device here (cheap: no CUDA call)."""
    return Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia/gpus").is_dir()


def build_command(
    model_repository: str | os.PathLike[str],
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    backend_dir: str | os.PathLike[str],
    extra_args: Sequence[str] = (),
    *,
    models: Sequence[str] = (),
    address: str | None = None,
    gpu: bool | None = None,
    paths: PyTritonPaths | None = None,
) -> list[str]:
    """The ``tritonserver`` argv.

    The server uses explicit model control (so a failed model can unload itself
    and report not ready) and loads ``models`` (a repository may hold more models
    than one test wants), or every model at startup (``--load-model=*``).  ``address`` binds
    HTTP, gRPC and metrics to one interface (tests use 127.0.0.1).  Without a
    GPU (``gpu=None`` detects one), GPU metrics and the pinned-memory pool are
    turned off: both need CUDA and only log errors otherwise.  ``extra_args``
    come last so they can override anything.
    """
    paths = paths or find_pytriton_paths()
    cmd = [
        str(paths.tritonserver),
        f"--model-repository={Path(model_repository).resolve()}",
        f"--backend-directory={Path(backend_dir).resolve()}",
        f"--cache-directory={paths.caches_dir}",
        f"--http-port={int(http_port)}",
        f"--grpc-port={int(grpc_port)}",
        f"--metrics-port={int(metrics_port)}",
    ]
    if not (has_nvidia_gpu() if gpu is None else gpu):
        cmd += ["--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0"]
    if address is not None:
        cmd += [
            f"--http-address={address}",
            f"--grpc-address={address}",
            f"--metrics-address={address}",
        ]
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


def _tail(path: Path, lines: int = 60) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


class TritonServer:
    """Run ``tritonserver`` as a child process for tests and benchmarks.

    ``with TritonServer(repo) as server:`` starts Triton on the given ports (or
    free ones), waits for ``/v2/health/ready`` and always stops it on exit:
    SIGINT for a graceful shutdown, then SIGKILL of the whole process group
    (which also holds the Python backend stubs) after ``stop_timeout``.

    Attributes available once constructed: ``http_url`` (``http://host:port``),
    ``http_address`` and ``grpc_url`` (``host:port``, what ``tritonclient.http``
    and ``tritonclient.grpc`` take), ``metrics_url`` (full ``.../metrics`` URL)
    and ``log_path``.
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
    ) -> None:
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
            log.write(f"$ {' '.join(cmd)}\n".encode())
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
        url = f"{self.http_url}/v2/health/ready"
        while True:
            code = self._proc.poll()
            if code is not None:
                raise TritonServerError(
                    f"tritonserver exited with code {code} during startup "
                    f"(log {self.log_path}):\n{_tail(self.log_path)}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TritonServerError(
                    f"tritonserver not ready at {url} after {self.startup_timeout:.0f}s "
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


def _env_port(name: str, default: int) -> int:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"{name}={value!r} is not a port number") from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m orca_server.launcher",
        description=(
            "Run the tritonserver binary from the nvidia-pytriton wheel on a Triton "
            "model repository, with the Python backend set up for this interpreter. "
            "Arguments after '--' are passed to tritonserver unchanged."
        ),
        epilog=(
            "Environment: ORCA_HTTP_PORT, ORCA_GRPC_PORT, ORCA_METRICS_PORT and ORCA_OPENAI_PORT set the "
            "default ports; ORCA_OPENAI_API_KEY makes the OpenAI API ask for that key. "
            "Example: python -m orca_server.launcher --model-repository "
            "model_repository --model orca_gpt -- --log-verbose=1"
        ),
    )
    parser.add_argument(
        "--model-repository",
        type=Path,
        default=Path("model_repository"),
        help="Triton model repository directory (default: %(default)s)",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=_env_port("ORCA_HTTP_PORT", 8000),
        help="HTTP/REST port (default: $ORCA_HTTP_PORT or 8000; now %(default)s)",
    )
    parser.add_argument(
        "--grpc-port",
        type=int,
        default=_env_port("ORCA_GRPC_PORT", 8001),
        help="gRPC port (default: $ORCA_GRPC_PORT or 8001; now %(default)s)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=_env_port("ORCA_METRICS_PORT", 8002),
        help="Prometheus metrics port (default: $ORCA_METRICS_PORT or 8002; now %(default)s)",
    )
    parser.add_argument(
        "--openai-port",
        type=int,
        default=_env_port("ORCA_OPENAI_PORT", 9000),
        help="port of the OpenAI-compatible API (orca-openai) started beside Triton; 0 = none "
        "(default: $ORCA_OPENAI_PORT or 9000; now %(default)s)",
    )
    parser.add_argument(
        "--no-openai",
        action="store_true",
        help="do not start the OpenAI-compatible API (same as --openai-port 0)",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="bind HTTP, gRPC and metrics to this address (default: all interfaces)",
    )
    parser.add_argument(
        "--model",
        dest="models",
        action="append",
        default=[],
        metavar="NAME",
        help="load only this model (repeatable; uses explicit model control). "
        "Default: load every model in the repository",
    )
    parser.add_argument(
        "--backend-dir",
        type=Path,
        default=None,
        help=f"where to assemble the Python backend (default: {default_backend_dir()})",
    )
    parser.add_argument(
        "--copy-backend",
        action="store_true",
        help="copy the backend files instead of symlinking them",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="prepare the backend dir, print the command and environment, do not start",
    )
    parser.add_argument("tritonserver_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tritonserver_args[:1] == ["--"]:
        args.tritonserver_args = args.tritonserver_args[1:]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: prepare the backend and exec tritonserver (never returns on success)."""
    args = parse_args(argv)
    if not args.model_repository.is_dir():
        print(f"error: model repository {args.model_repository} not found", file=sys.stderr)
        return 2
    try:
        paths = find_pytriton_paths()
        backend_dir = prepare_backend_dir(
            args.backend_dir or default_backend_dir(), copy=args.copy_backend, paths=paths
        )
    except (TritonServerError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    cmd = build_command(
        args.model_repository,
        args.http_port,
        args.grpc_port,
        args.metrics_port,
        backend_dir,
        args.tritonserver_args,
        models=args.models,
        address=args.address,
        paths=paths,
    )
    env = server_env(paths=paths)
    host = args.address if args.address not in (None, "0.0.0.0") else "localhost"
    openai = None if args.no_openai or not args.openai_port else openai_command(args)
    if args.dry_run:
        if openai:  # first: the last line stays tritonserver's command
            print(" ".join(openai))
        for key in ("PATH", "LD_LIBRARY_PATH"):
            print(f"{key}={env[key]}")
        print(" ".join(cmd))
        return 0
    print(" ".join(cmd), flush=True)
    print(
        f"Starting Triton. Once it is up:\n"
        f"  curl -sf http://{host}:{args.http_port}/v2/health/ready && echo ready\n"
        f"  curl -s http://{host}:{args.metrics_port}/metrics",
        flush=True,
    )
    if openai is None:
        os.execve(cmd[0], cmd, env)
        return 1  # pragma: no cover - execve does not return
    print(" ".join(openai), flush=True)
    print(f"  curl -s http://{host}:{args.openai_port}/v1/models   (the OpenAI-compatible API)", flush=True)
    return run_beside(cmd, env, openai)


def openai_command(args: argparse.Namespace) -> list[str]:
    """The argv of orca-openai (orca_openai/) fronting the Triton that :func:`main` starts."""
    triton_host = args.address if args.address not in (None, "0.0.0.0") else "127.0.0.1"
    return [
        sys.executable, "-m", "orca_openai",
        "--host", args.address or "0.0.0.0",
        "--port", str(args.openai_port),
        "--triton-url", f"{triton_host}:{args.grpc_port}",
        "--metrics-url", f"http://{triton_host}:{args.metrics_port}/metrics",
    ]


def run_beside(triton_cmd: list[str], env: Mapping[str, str], openai_cmd: list[str]) -> int:
    """Runs tritonserver and orca-openai as children until Triton exits; SIGINT/SIGTERM go to both, and
    orca-openai is stopped when Triton is gone. Returns Triton's exit status."""
    triton = subprocess.Popen(triton_cmd, env=dict(env))
    try:
        openai = subprocess.Popen(openai_cmd)
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


if __name__ == "__main__":
    sys.exit(main())
