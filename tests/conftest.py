"""Session fixtures shared by the server tests.

``orca_server`` (alias ``triton_server``) starts ONE tritonserver (the binary from the nvidia-pytriton
wheel, through :class:`orca_server.server.TritonServer`) for the whole test session, on free loopback
ports, serving the test repository of tests/_server.py: every shipped model as is, plus tiny variants.
It is lazy like every pytest fixture: a run that requests it from no test never starts Triton.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from orca_server.server import TritonServer

# "auto" dtype means bfloat16 on CPUs with native bfloat16 (orca.config.auto_dtype); the tests compare with
# float32 references (transformers, runs alone), so every engine of the session, the Triton server's
# included (it inherits this environment), takes float32 for "auto".
os.environ["ORCA_DTYPE"] = "float32"
# "auto" torch_compile compiles the forward pass at load on a CPU (tens of seconds per engine): the engines
# of the suite run eagerly unless a test asks for compiling (tests/test_compiled.py). The Triton server
# of the session compiles its shipped models as shipped (its environment drops this).
os.environ["ORCA_TORCH_COMPILE"] = "off"


def _startup_timeout() -> float:
    """Loading a real checkpoint on a 2-core CPU can take minutes; overridable for slow hosts."""
    return float(os.environ.get("ORCA_TRITON_STARTUP_TIMEOUT", "600"))


@pytest.fixture(scope="session")
def orca_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """The end-to-end test repository (tests/_server.py: the shipped models, tiny orca_gpt variants and
    the tiny request-level baseline) on one Triton for every test module that asks for it. The yielded
    server also has ``tiny_checkpoint``, the tiny GPT-2 directory the tiny models serve."""
    from _server import ENGINE_FAULTS, build_test_repository

    root = tmp_path_factory.mktemp("e2e")
    repo, tiny = build_test_repository(root)
    env = {k: v for k, v in os.environ.items() if k != "ORCA_TORCH_COMPILE"}  # shipped models: as shipped
    env["ORCA_ENGINE_FAULT"] = ENGINE_FAULTS
    env["ORCA_ENABLE_FAULT_INJECTION"] = "1"  # the fault hooks' test switch (orca.config.fault_spec)
    with TritonServer(repo, log_path=root / "tritonserver.log", startup_timeout=_startup_timeout(),
                      env=env) as server:
        server.tiny_checkpoint = tiny
        yield server


@pytest.fixture(scope="session")
def triton_server(orca_server: TritonServer) -> TritonServer:
    """The same single server: its repository holds every shipped model as is (tests/_server.py)."""
    return orca_server
