"""Session fixtures shared by the server tests.

``triton_server`` starts ONE tritonserver (the binary from the nvidia-pytriton
wheel, through :class:`orca_server.launcher.TritonServer`) for the whole test
session, serving the repository's own ``model_repository`` on free loopback
ports.  It is lazy like every pytest fixture: a run that requests it from no
test never starts Triton, so unit-test runs stay fast.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from orca_server.launcher import TritonServer

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_REPOSITORY = REPO_ROOT / "model_repository"


def _startup_timeout() -> float:
    """Loading a real checkpoint on a 2-core CPU can take minutes; overridable for slow hosts."""
    return float(os.environ.get("ORCA_TRITON_STARTUP_TIMEOUT", "600"))


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """A running Triton serving ``model_repository/``; stopped when the session ends.

    The yielded object has ``http_url`` (``http://127.0.0.1:PORT``),
    ``http_address`` and ``grpc_url`` (``127.0.0.1:PORT``, what
    ``tritonclient.http`` / ``tritonclient.grpc`` take), ``metrics_url``
    (``http://127.0.0.1:PORT/metrics``) and ``log_path``.  If startup fails the
    error carries the tail of the server log.
    """
    if not any(MODEL_REPOSITORY.glob("*/config.pbtxt")):
        pytest.fail(f"no model in {MODEL_REPOSITORY}: nothing for the triton_server fixture to serve")
    log_dir = tmp_path_factory.mktemp("triton_server")
    with TritonServer(
        MODEL_REPOSITORY,
        log_path=log_dir / "tritonserver.log",
        backend_dir=log_dir / "backends",
        startup_timeout=_startup_timeout(),
    ) as server:
        yield server
