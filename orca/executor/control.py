"""The control plane between the driver and its worker processes: the messages of joining, and the sockets
they travel on (authenticated multiprocessing connections, TCP_NODELAY)."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

from orca.config import EngineConfig

AUTHKEY_ENV = "ORCA_WORKER_AUTHKEY"


@dataclass(frozen=True)
class Hello:
    """A worker's first message: where it runs. Ranks go by (node_index, local_index)."""

    node_index: int
    local_index: int
    hostname: str
    pid: int


@dataclass(frozen=True)
class Assignment:
    """The driver's answer to Hello: everything a worker needs to join."""

    config: EngineConfig
    rank: int
    store_port: int  # the driver's TCPStore, on the host the worker connected to


@dataclass(frozen=True)
class StageTiming:
    """When a rank ran a plan (plan.profile only): lets tests and benchmarks see batches overlap."""

    rank: int
    batch_id: int
    start: float  # time.time(), wall clock (comparable across processes on one host)
    end: float


def listen(host: str, port: int, backlog: int) -> socket.socket:
    """A TCP socket listening on host:port (port 0: a free one), as multiprocessing's Listener binds."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=backlog)


def shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def no_delay(conn: Connection) -> None:
    """Small messages go out at once: with Nagle's algorithm a message written right after another waits
    for the peer's delayed ACK (40 ms on Linux)."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.close()


def python_executable() -> str:
    """The interpreter for worker processes. Inside Triton's Python backend stub sys.executable may be
    the stub itself; the environment's python is next to the stdlib's prefix."""
    exe = sys.executable
    if exe and os.path.basename(exe).startswith("python"):
        return exe
    for candidate in (os.path.join(sys.prefix, "bin", "python3"), os.path.join(sys.base_prefix, "bin", "python3")):
        if os.access(candidate, os.X_OK):
            return candidate
    return "python3"
