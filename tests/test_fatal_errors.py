"""The engine's fatal classification: a sticky device error must not leave a model that fails every
iteration looking alive. max_consecutive_failures failed iterations in a row, or one error fatal by kind (a
CUDA error), fail the engine: every request it holds, running and waiting, is answered once with an error,
new ones are refused, and in Triton the model unloads itself and reports not ready.

The failures are real exceptions inside the in-process worker's iteration (Worker.inject_fault, what
$ORCA_ENGINE_FAULT's raise kinds use), with the message a real device error carries where that matters.
The fault hooks read their variables only with $ORCA_ENABLE_FAULT_INJECTION=1.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc.aio as aiogrpc
from _fixtures import RequestOutputs, tiny_core
from _server import SHIPPED_MODEL, _with_parameters
from checkpoints import make_gpt2

from orca import EngineFailedError, SamplingParams
from orca.config import FAULT_INJECTION_ENV, EngineConfig
from orca.core.engine_loop import EngineLoop, fault_from_env
from orca.core.errors import fatal_error
from orca.executor.worker_process import _injected_fault
from orca_server.server import TritonServer

sys.path.insert(0, str(Path(__file__).resolve().parent / "reliability"))
from _reliability import Spec, grpc_request, model_ready  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
CUDA_ERROR = ("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously "
              "reported at some other API call")


def _finals(outputs: queue.Queue[Any], n: int) -> dict[str, Any]:
    """The first n final outputs by request id; a second final for one request fails the test."""
    finals: dict[str, Any] = {}
    while len(finals) < n:
        out = outputs.get(timeout=60)
        if out.finished:
            assert out.request_id not in finals, f"{out.request_id} finished twice"
            finals[out.request_id] = out
    return finals


# -- the loop alone ------------------------------------------------------------------------------------
def test_a_sticky_error_fails_the_engine_after_max_consecutive_failures() -> None:
    """raise-always from iteration 2, max_bs 2, ten requests: iterations 2, 3 and 4 fail their two
    requests each (the worker's exception); the third failure in a row fails the engine, so the four still
    waiting end with the engine-failed error; each of the ten is answered exactly once, on_failure runs
    once and a new request is refused."""
    outputs: queue.Queue[Any] = queue.Queue()
    failures: list[str] = []
    failed = threading.Event()

    def on_failure(reason: str) -> None:
        failures.append(reason)
        failed.set()

    loop = EngineLoop(lambda: tiny_core("gpt2", max_bs=2, max_consecutive_failures=3),
                      on_output=RequestOutputs(outputs.put), on_failure=on_failure, fault=(2, "raise-always"))
    ids = [f"r{i}" for i in range(10)]
    for rid in ids:
        loop.submit(rid, [1, 2, 3], GREEDY)
    loop.start()
    try:
        finals = _finals(outputs, len(ids))
        assert failed.wait(30)
        by_error: dict[str, list[str]] = {}
        for rid, out in finals.items():
            assert out.finish_reason == "error", out
            by_error.setdefault("engine" if out.error.startswith("the engine failed") else "worker", []).append(rid)
        assert sorted(by_error["worker"]) == ids[:6]  # iterations 2-4, two requests each (r0, r1 from iteration 1)
        assert sorted(by_error["engine"]) == ids[6:]
        assert all("3 iterations in a row failed (max_consecutive_failures 3)" in finals[r].error
                   for r in by_error["engine"])
        assert len(failures) == 1 and loop.failed == failures[0]
        with pytest.raises(EngineFailedError, match="the engine has failed and serves no more requests: 3 iter"):
            loop.submit("late", [1, 2], GREEDY)
        assert outputs.empty()
    finally:
        loop.shutdown()


def test_a_success_starts_the_count_afresh() -> None:
    """max_consecutive_failures 2: fail, succeed, fail leaves the engine serving; a second failure in a row
    fails it, and the request it still held ends with its error."""
    core = tiny_core("gpt2", max_bs=1, max_consecutive_failures=2)
    for rid in ("a", "b", "c", "d"):
        core.add_request(rid, [1, 2, 3], GREEDY)
    reasons: dict[str, str | None] = {}

    def step(fault: bool) -> None:
        if fault:
            core.executor.inject_fault("RuntimeError from the test")
        for out in core.step():
            if out.finish_reason is not None:
                reasons[out.request_id] = out.error
    step(True)  # a fails
    step(False)  # b's prompt
    step(True)  # b fails
    assert core.failed is None and core.consecutive_failures == 1
    step(False)  # c's prompt
    step(True)  # c fails: one in a row
    step(True)  # d fails: two in a row, the engine fails (nothing else held)
    assert core.failed is not None and "2 iterations in a row failed" in core.failed
    assert set(reasons) == {"a", "b", "c", "d"}
    with pytest.raises(EngineFailedError):
        core.add_request("e", [1], GREEDY)


def test_a_cuda_error_fails_the_engine_at_once() -> None:
    """One iteration raising what torch raises after an illegal memory access fails the engine whatever
    max_consecutive_failures says: its requests get the error, the waiting ones the engine-failed error."""
    core = tiny_core("gpt2", max_bs=2, max_consecutive_failures=100)
    for rid in ("a", "b", "c"):
        core.add_request(rid, [1, 2, 3], GREEDY)
    core.executor.inject_fault(CUDA_ERROR)
    outs = {o.request_id: o for o in core.step()}
    assert core.failed is not None and core.failed.startswith("a device error in iteration")
    assert set(outs) == {"a", "b", "c"} and all(o.finish_reason == "error" for o in outs.values())
    assert "illegal memory access" in outs["a"].error and outs["c"].error.startswith("the engine failed: a device")
    assert not core.has_unfinished()


@pytest.mark.parametrize(("error", "fatal"), [
    ("AcceleratorError: CUDA error: device-side assert triggered", True),
    ("RuntimeError: CUDA error: unspecified launch failure", True),
    ("RuntimeError: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, ...)`", True),
    ("DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error", True),
    ("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", False),  # a smaller batch may fit
    ("RuntimeError: fault injected by $ORCA_ENGINE_FAULT in iteration 3", False),
    ("IndexError: index 70000 is out of bounds for dimension 0 with size 49152", False),
])
def test_fatal_by_kind(error: str, fatal: bool) -> None:
    assert fatal_error(error) is fatal


def test_the_option_is_checked() -> None:
    assert EngineConfig.from_parameters({"max_consecutive_failures": "5"}).max_consecutive_failures == 5
    with pytest.raises(ValueError, match="max_consecutive_failures must be an integer >= 1, got 0"):
        EngineConfig(max_consecutive_failures=0)


# -- the test switch of the fault hooks ----------------------------------------------------------------
def test_fault_hooks_are_read_only_behind_the_test_switch(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("ORCA_ENGINE_FAULT", "m:3:raise-always")
    monkeypatch.setenv("ORCA_WORKER_FAULT", "1:5:raise")
    monkeypatch.delenv(FAULT_INJECTION_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="orca.config"):
        assert fault_from_env("m") is None and _injected_fault(1) is None
    assert "$ORCA_ENGINE_FAULT is set but ignored" in caplog.text
    assert "$ORCA_WORKER_FAULT is set but ignored" in caplog.text
    monkeypatch.setenv(FAULT_INJECTION_ENV, "true")  # only "1" switches them on
    assert fault_from_env("m") is None
    monkeypatch.setenv(FAULT_INJECTION_ENV, "1")
    assert fault_from_env("m") == (3, "raise-always") and fault_from_env("other") is None
    assert _injected_fault(1) == (5, "raise") and _injected_fault(0) is None


# -- through Triton ------------------------------------------------------------------------------------
STICKY = "orca_tiny_sticky"


def test_a_sticky_error_makes_the_model_not_ready_and_answers_every_request_once(tmp_path: Path) -> None:
    """A tritonserver of its own: orca_tiny_sticky (max_bs 2) raises in every iteration from its 3rd on
    (raise-always). A burst of 8 streams: each gets exactly one terminal answer (the worker's exception or
    the engine-failed error; the first two may complete), the model unloads itself and reports not ready,
    a later request is refused, and the log says why."""
    repo = tmp_path / "model_repository"
    tiny = make_gpt2(tmp_path / "tiny-gpt2", n_positions=2048)
    (repo / STICKY / "1").mkdir(parents=True)
    shutil.copy(SHIPPED_MODEL / "1" / "model.py", repo / STICKY / "1" / "model.py")
    params = {"model": str(tiny), "torch_compile": "off", "max_bs": "2", "n_slots": "2048"}  # 3 failures: the default
    (repo / STICKY / "config.pbtxt").write_text(
        _with_parameters((SHIPPED_MODEL / "config.pbtxt").read_text(), STICKY, params))
    env = {"ORCA_ENGINE_FAULT": f"{STICKY}:3:raise-always", FAULT_INJECTION_ENV: "1"}
    with TritonServer(repo, log_path=tmp_path / "tritonserver.log", startup_timeout=600,
                      env={**os.environ, **env}) as server:
        assert model_ready(server.http_url, STICKY)
        specs = [Spec(i, input_ids=tuple(range(5 + i, 12 + i)), max_tokens=20) for i in range(8)]

        async def run() -> list[Any]:
            client = aiogrpc.InferenceServerClient(server.grpc_url)
            try:
                return await asyncio.gather(*(grpc_request(client, STICKY, s, s.key, timeout=120) for s in specs))
            finally:
                await client.close()

        outs = asyncio.run(run())
        for o in outs:
            assert o.transport_error is None and o.after_terminal == 0 and o.closed, o
            assert o.finals + len(o.errors) == 1, o  # exactly one terminal answer
        failed = [o for o in outs if o.errors]
        assert len(failed) >= 6, outs
        for o in failed:
            assert ("fault injected by $ORCA_ENGINE_FAULT" in o.errors[0]
                    or "the engine failed: 3 iterations in a row failed" in o.errors[0]), o
        assert any("the engine failed" in o.errors[0] for o in failed), outs  # some waited when it failed
        deadline = time.monotonic() + 60
        while model_ready(server.http_url, STICKY):
            assert time.monotonic() < deadline, "the failed model still reports ready"
            time.sleep(0.2)
        later = asyncio.run(_one(server.grpc_url, Spec(99, input_ids=(1, 2, 3), max_tokens=2)))
        assert later.errors or later.transport_error, later
        log = (tmp_path / "tritonserver.log").read_text(errors="replace")
        assert "3 iterations in a row failed (max_consecutive_failures 3)" in log
        assert f"{STICKY} unloads itself" in log


async def _one(url: str, spec: Spec) -> Any:
    client = aiogrpc.InferenceServerClient(url)
    try:
        return await grpc_request(client, STICKY, spec, spec.key, timeout=60)
    finally:
        await client.close()
