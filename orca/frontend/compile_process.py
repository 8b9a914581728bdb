"""Grammar compile processes: a fresh interpreter per worker (never a fork: the parent holds CUDA and threads;
not multiprocessing's spawn, which reruns the parent's __main__), its address space capped, killable past a
deadline; the compiled grammar comes back as xgrammar's JSON."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from orca.frontend.grammar import clip, compile_grammar, engine_message

if TYPE_CHECKING:
    from orca.frontend.structured_outputs import StructuredOutputCompiler, _Job

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
"""How long a compile process may take to start (it imports xgrammar, hence torch: seconds)."""


class CompileProcess:
    """One compile process (started on first use, replaced after a kill), driven by one dispatcher thread."""

    def __init__(self, owner: StructuredOutputCompiler) -> None:
        self.owner = owner
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._conn: Any = None
        self._stopped = False

    def ensure_started(self) -> None:
        with self._lock:
            if self._stopped:
                raise RuntimeError("the grammar compiler is shut down")
            if self._process is not None and self._process.poll() is None:
                return
            _, info_json = self.owner.tokenizer_info()
            mine, theirs = socket.socketpair()
            # The parent's import path (Triton's stub adds the model's directory); its own session, so a
            # Ctrl-C to the terminal's process group reaches only Triton, which shuts the model down.
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            command = [_python_executable(), "-c", _CHILD_MAIN, str(theirs.fileno()), str(self.owner.memory_limit)]
            try:
                process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                                           start_new_session=True)
            finally:
                theirs.close()
            ours = Connection(mine.detach())
            ours.send((info_json, self.owner._threads))
            ready = ours.poll(START_TIMEOUT_S)
            try:
                message = ours.recv() if ready else None
            except (EOFError, OSError):
                message = None
            if message != ("ready",):
                process.kill()
                process.wait(10)
                ours.close()
                why = f"exit code {process.returncode}" if ready else f"not ready within {START_TIMEOUT_S:g} s"
                raise RuntimeError(f"the grammar compile process did not start ({why})")
            if self._stopped:  # shut down while it started
                process.kill()
                ours.close()
                raise RuntimeError("the grammar compiler is shut down")
            self._process, self._conn = process, ours
            logger.info("grammar compile process %d started", process.pid)

    def compile(self, job: _Job) -> tuple[Any, str | None, float]:
        """(compiled grammar, None, seconds) or (None, the request's error, 0): at most the deadline after
        the process takes the job; a process past it, or dead, is replaced on the next compile."""
        self.ensure_started()
        so, owner = job.so, self.owner
        try:
            self._conn.send((so, job.fault))
        except OSError:  # it died since the last compile
            code = self._kill()
            return None, f"structured_outputs.{so.kind} could not be compiled: the compile process exited ({code})", 0.0
        if not self._conn.poll(owner.deadline):
            self._kill()
            return None, (f"structured_outputs.{so.kind} took longer than {owner.deadline:g} s to compile and was "
                          f"stopped: simplify it"), 0.0
        try:
            status, value, seconds = self._conn.recv()
        except (EOFError, OSError):
            code = self._kill()
            return None, f"structured_outputs.{so.kind} could not be compiled: the compile process exited ({code})", 0.0
        if status == "memory":
            self._kill()  # its heap may be fragmented past use: a fresh one
            return None, (f"structured_outputs.{so.kind} needs more than {_gib(owner.memory_limit)} of memory to "
                          f"compile: simplify it"), 0.0
        if status == "error":
            return None, value, 0.0
        import xgrammar

        info, _ = owner.tokenizer_info()
        return xgrammar.CompiledGrammar.deserialize_json(value, info), None, seconds

    def _kill(self) -> int | None:
        with self._lock:
            process, conn = self._process, self._conn
            self._process = self._conn = None
        if process is None:
            return None
        process.kill()
        process.wait(10)
        conn.close()
        logger.warning("grammar compile process %d stopped (exit code %s)", process.pid, process.returncode)
        return process.returncode

    def stop(self) -> None:
        """Kills the process, without waiting for one being started (that one is killed once it is up)."""
        self._stopped = True
        if self._lock.acquire(blocking=False):
            self._lock.release()
            self._kill()


def _gib(n: int) -> str:
    return f"{n / 2**30:g} GiB" if n >= 2**30 else f"{n / 2**20:g} MiB"


def _python_executable() -> str:
    from orca.executor.control import python_executable as python

    return python()


_CHILD_MAIN = ("import sys; from orca.frontend.compile_process import compile_process_main; "
               "compile_process_main(int(sys.argv[1]), int(sys.argv[2]))")


def compile_process_main(fd: int, memory_limit: int) -> None:
    """The body of a compile process, over the socket `fd` to its parent: imports, builds the compiler from
    the parent's TokenizerInfo, caps its address space, then answers ("ok", grammar JSON, seconds),
    ("error", message, 0) or ("memory", "", 0) for each (StructuredOutputs, fault) it is sent, until the
    socket closes; it dies with the thread that started it (PR_SET_PDEATHSIG)."""
    _die_with_parent()
    conn = Connection(fd)
    import jsonschema  # noqa: F401 - imported before the address space is capped
    import xgrammar

    info_json, threads = conn.recv()
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.deserialize_json(info_json), max_threads=threads,
                                        cache_enabled=False)  # the parent caches
    del info_json
    _cap_address_space(memory_limit)
    conn.send(("ready",))
    while True:
        try:
            so, fault = conn.recv()
        except (EOFError, OSError):
            return
        start = time.perf_counter()
        try:
            if fault == "hang":  # tests: a compile that never ends
                threading.Event().wait()
            elif fault == "exit":  # tests: a compile that crashes its process
                os._exit(3)
            elif fault == "oom":  # tests: a compile that allocates twice its cap (which, uncapped, would succeed)
                hog = bytearray(2 * memory_limit)
                del hog
            text = compile_grammar(compiler, so).serialize_json()
            conn.send(("ok", text, time.perf_counter() - start))
        except ValueError as exc:
            conn.send(("error", str(exc), 0.0))
        except MemoryError:
            conn.send(("memory", "", 0.0))
        except Exception as exc:  # noqa: BLE001 - the request gets the error, the process goes on
            conn.send(("error", f"structured_outputs could not be compiled: {type(exc).__name__}: "
                                f"{clip(engine_message(exc))}", 0.0))


def _die_with_parent() -> None:
    """Linux: SIGKILL when the parent's thread that started this process exits (a dispatcher, which lives
    until shutdown), so a hung compile never outlives a killed server."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before the call
        os._exit(1)


def _cap_address_space(limit: int) -> None:
    """RLIMIT_AS at what the process maps now plus `limit` bytes (torch's import alone maps 0.7-3 GiB)."""
    import resource

    try:
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        print("[orca.grammar] cannot read the address space size: no memory limit", file=sys.stderr, flush=True)
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = size + limit if hard == resource.RLIM_INFINITY else min(size + limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
