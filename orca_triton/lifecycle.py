"""What the Triton model needs to know about tritonserver itself, beside the engine: whether it is shutting
down (HttpProbe, through its HTTP port, and its --exit-timeout-secs) and whether it is still alive (the
reaper, a process that kills the stub once tritonserver is gone), and how the engine's log reaches the
server's (log_to_stderr). Nothing here calls into Triton."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger("orca_gpt")

TRITON_EXIT_TIMEOUT_S = 30.0  # tritonserver's default --exit-timeout-secs


# The reaper: a small process beside the stub that kills it once tritonserver is gone (killed, crashed, or
# exited past its timeout without unloading the model), then exits; it exits too when the stub does. A
# process, not a thread: a stub whose server died can block every thread of its own, the GIL included.
_REAPER = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: Triton decides, then we see
stub, server = int(sys.argv[1]), int(sys.argv[2])
def started(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in "ZX" else fields[19]
    except (OSError, IndexError):
        return None
server_start, stub_start = started(server), started(stub)
while True:
    time.sleep(0.5)
    if started(stub) != stub_start:
        sys.exit(0)
    if server_start is None or started(server) != server_start:  # None: gone before we first looked
        os.kill(stub, signal.SIGKILL)  # first: the server's end of our stdout may be gone with it
        try:
            print(f"orca reaper: tritonserver (pid {server}) was gone: killed its Python backend stub {stub}",
                  flush=True)
        except OSError:
            pass
        sys.exit(0)
"""


def start_reaper() -> subprocess.Popen | None:
    python = sys.executable if "python" in Path(sys.executable).name else shutil.which("python3")
    if python is None:
        logger.warning("no python3 found: the stub cannot watch for tritonserver's death")
        return None
    return subprocess.Popen([python, "-S", "-c", _REAPER, str(os.getpid()), str(os.getppid())],
                            stdin=subprocess.DEVNULL, close_fds=True)


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def flag(args: list[str], name: str) -> str | None:
    """The value of tritonserver's --name=value (or --name value), else None."""
    for i, arg in enumerate(args):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(args):
            return args[i + 1]
    return None


def exit_timeout(args: list[str]) -> float:
    """tritonserver's --exit-timeout-secs, else Triton's default."""
    try:
        return max(0.0, float(flag(args, "exit-timeout-secs") or TRITON_EXIT_TIMEOUT_S))
    except ValueError:
        return TRITON_EXIT_TIMEOUT_S


class HttpProbe:
    """Opens a fresh connection to tritonserver's HTTP port each time. While shutting down, Triton first
    accepts new connections and closes (or resets) them unanswered, then closes its port. closed() is True
    after two such answers in a row: unanswered connections, or (having been answered before) refused ones.
    A port that refuses connections before it ever answered (Triton still loading models) and a slow
    answer count for nothing; with HTTP off (--allow-http=false) nothing is noticed."""

    def __init__(self, args: list[str]) -> None:
        address = flag(args, "http-address") or "0.0.0.0"
        self.address = (
            "127.0.0.1" if address in ("0.0.0.0", "") else address,
            int(flag(args, "http-port") or 8000),
        )
        self.enabled = (flag(args, "allow-http") or "true").lower() not in ("false", "0")
        self.answered = False
        self.misses = 0

    def closed(self) -> bool:
        if not self.enabled:
            return False
        try:
            sock = socket.create_connection(self.address, timeout=2)
        except TimeoutError:
            return False
        except OSError:  # refused: not listening (yet, or any more)
            self.misses = self.misses + 1 if self.answered else 0
            return self.misses >= 2
        with sock:
            try:
                sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: triton\r\nConnection: close\r\n\r\n")
                reply = sock.recv(64)
            except TimeoutError:
                return False
            except OSError:
                reply = b""
        if reply.startswith(b"HTTP/"):
            self.answered, self.misses = True, 0
        else:
            self.misses += 1
        return self.misses >= 2


def log_to_stderr(*names: str) -> None:
    """Sends the INFO records of the `orca` loggers (loading, compiling at load, the K/V pool) and of the
    loggers `names` to stderr, which Triton's Python backend stub passes on to the server's log. Once per
    process: a second call adds nothing."""
    for name in ("orca", *names):
        log = logging.getLogger(name)
        log.setLevel(logging.INFO)
        if not any(getattr(h, "_orca_stderr", False) for h in log.handlers):
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            handler._orca_stderr = True
            log.addHandler(handler)
            log.propagate = False
