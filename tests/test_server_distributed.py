"""Failures through the real tritonserver, and readiness that tells the truth. orca_tiny_tp2
(tests/_server.py) serves the tiny GPT-2 with tensor parallelism over two CPU worker processes that its
Triton stub started: it generates what the offline engine generates; when one of its workers is killed,
the request in flight ends with an error, new requests are refused, the model unloads itself (not ready)
and no worker process is left. orca_tiny_hang and orca_tiny_crash (in-process engines) fail the same way
when an iteration hangs or the scheduler thread dies. Only this module uses these models: the failure
tests leave them unloaded."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import requests
from orca_client import OrcaClient, OrcaError
from test_server_e2e import generate_concurrently, wait_for

from orca import LLM, SamplingParams

MODEL = "orca_tiny_tp2"


def worker_pids(server: Any) -> list[int]:
    """Live processes running `python -m orca.worker` that descend from this session's tritonserver (the
    ones the Triton stub of orca_tiny_tp2 started: no other model of the test server is distributed;
    other test servers on the machine are not ours)."""
    parents: dict[int, int] = {}
    workers = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            status = (entry / "status").read_text().splitlines()
        except OSError:
            continue
        pid = int(entry.name)
        parents[pid] = int(next(line.split()[1] for line in status if line.startswith("PPid:")))
        zombie = any(line.startswith("State:") and "Z" in line for line in status)
        if b"orca.worker" in cmdline and not zombie:
            workers.append(pid)

    def descends(pid: int) -> bool:
        while pid > 1:
            if pid == server.pid:
                return True
            pid = parents.get(pid, 0)
        return False

    return [pid for pid in workers if descends(pid)]


def ready(server: Any) -> bool:
    return requests.get(f"{server.http_url}/v2/models/{MODEL}/ready", timeout=10).status_code == 200


def test_tensor_parallel_model_serves_what_the_offline_engine_generates(orca_server: Any) -> None:
    assert ready(orca_server)
    assert len(worker_pids(orca_server)) == 2
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], list(range(10, 40))]
    max_tokens = [7, 20, 12]
    expected = LLM(str(orca_server.tiny_checkpoint), device="cpu").generate(
        prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_tokens]
    )
    chunks = generate_concurrently(orca_server, MODEL, [
        {"input_ids": p, "max_tokens": n, "temperature": 0, "ignore_eos": True} for p, n in zip(prompts, max_tokens)
    ])
    assert [[t for c in cs for t in c.output_ids] for cs in chunks] == [e.token_ids for e in expected]


def test_killed_worker_errors_requests_and_unloads_the_model(orca_server: Any) -> None:
    pids = worker_pids(orca_server)
    assert len(pids) == 2
    client = OrcaClient(orca_server.grpc_url, MODEL)
    stream = client.generate(input_ids=[1, 2, 3], max_tokens=1900, ignore_eos=True, temperature=0)
    first = next(stream)
    assert first.output_ids and not first.final  # running
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(OrcaError, match="failed"):
        for _ in stream:  # the request in flight ends with an error, not a hang
            pass
    wait_for(lambda: not ready(orca_server), "the failed model to report not ready", timeout=60)
    wait_for(lambda: not worker_pids(orca_server), "the workers to be gone", timeout=30)
    with pytest.raises(OrcaError):  # refused: failed (UNAVAILABLE) or unloaded
        list(OrcaClient(orca_server.grpc_url, MODEL).generate(input_ids=[1, 2], max_tokens=2))


# -- readiness that tells the truth (in-process engines) ------------------------------------------------
@pytest.mark.parametrize("model,words", [("orca_tiny_hang", "hung"), ("orca_tiny_crash", "scheduler thread died")])
def test_a_hung_iteration_or_a_dead_scheduler_thread_makes_the_model_not_ready(
    orca_server: Any, model: str, words: str
) -> None:
    """tests/_server.py makes orca_tiny_hang's 3rd iteration hang (past its worker_timeout of 2 s) and
    orca_tiny_crash's scheduler thread die before its 3rd: the request in flight ends with an error
    naming why, the model reports not ready, new requests are refused."""
    url = f"{orca_server.http_url}/v2/models/{model}/ready"
    assert requests.get(url, timeout=10).status_code == 200
    stream = OrcaClient(orca_server.grpc_url, model).generate(input_ids=[1, 2, 3], max_tokens=50, ignore_eos=True)
    with pytest.raises(OrcaError, match=words):
        for _ in stream:
            pass
    wait_for(lambda: requests.get(url, timeout=10).status_code != 200, f"{model} to report not ready", timeout=60)
    with pytest.raises(OrcaError):
        list(OrcaClient(orca_server.grpc_url, model).generate(input_ids=[1, 2], max_tokens=2))
