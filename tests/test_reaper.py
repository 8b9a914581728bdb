"""The reaper (orca_triton/lifecycle.py start_reaper): a process beside each Python backend stub that kills the
stub once tritonserver is gone. Here a stand-in "server" process starts a stand-in "stub" that starts the reaper
as model.py does; SIGKILL of the server must take the stub with it."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

_STUB = """
import os, sys, time
from orca_triton.lifecycle import start_reaper
reaper = start_reaper()
os.write(int(sys.argv[1]), f"{os.getpid()} {reaper.pid}\\n".encode())
time.sleep(120)
"""
# The stub's stdout stays the test's (as a real stub's is tritonserver's, whose reader outlives it); the
# stub reports its pid and the reaper's on a pipe of its own.
_SERVER = """
import os, subprocess, sys
read, write = os.pipe()
stub = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(write)], pass_fds=(write,))
os.close(write)
print(os.read(read, 100).decode().strip(), flush=True)
stub.wait()
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the reaper reads /proc")
def test_the_reaper_kills_the_stub_when_tritonserver_dies() -> None:
    server = subprocess.Popen([sys.executable, "-c", _SERVER, _STUB], stdout=subprocess.PIPE, text=True,
                              cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    stub = reaper = None
    try:
        stub, reaper = (int(pid) for pid in server.stdout.readline().split())
        assert _alive(stub) and _alive(reaper)
        server.send_signal(signal.SIGKILL)  # at once: a server gone before the reaper first looks counts too
        server.wait(timeout=10)
        deadline = time.monotonic() + 15
        while (_alive(stub) or _alive(reaper)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(stub), "the stub outlived tritonserver"
        assert not _alive(reaper), "the reaper stayed behind"
    finally:
        for pid in (stub, reaper):
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if server.poll() is None:
            server.kill()
            server.wait()


@pytest.mark.parametrize("model", ["orca_gpt", "request_level_gpt"])
def test_each_engine_model_starts_a_reaper_and_stops_it_in_finalize(model: str) -> None:
    """README and docs/design.md say a reaper runs beside each stub: both engine models start one."""
    tree = ast.parse((REPO_ROOT / "model_repository" / model / "1" / "model.py").read_text())
    methods = {node.name: ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    assert "self._reaper = start_reaper()" in methods["initialize"]
    assert "self._reaper.kill()" in methods["finalize"]
