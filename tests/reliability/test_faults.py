"""Faults: an exception inside one iteration fails that iteration's requests only, and the engine and the
Triton model keep serving; a client that stops reading its stream blocks nobody else.

The exception is real: $ORCA_ENGINE_FAULT="MODEL:ITER:raise" (orca/core/engine_loop.py) makes the in-process
worker raise inside its iteration (after the model ran, before sampling), as a device or kernel error would.
tests/_server.py sets it for orca_tiny_raise at iteration 3.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import queue
import socket
import struct
import termios
import threading
import time
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpc
from _fixtures import RequestOutputs, tiny_core, tiny_engine
from _reliability import (
    LogWatch,
    Spec,
    alone_references,
    finished_by_reason,
    grpc_request,
    metrics,
    model_ready,
    stub_pid,
    wait_idle,
)
from orca_client.client import build_inputs, parse_result

from orca import LLM, SamplingParams
from orca.core.engine_loop import EngineLoop

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


# -- the loop alone ------------------------------------------------------------------------------------
def test_an_exception_inside_an_iteration_fails_its_requests_only() -> None:
    """max_bs 2, the fault at the first iteration: b and c are in it and fail with the exception's message;
    d, waiting behind them, and e, submitted later, complete with the tokens of an engine without fault."""
    outputs: queue.Queue[Any] = queue.Queue()
    loop = EngineLoop(lambda: tiny_core("gpt2", max_bs=2), on_output=RequestOutputs(outputs.put), fault=(1, "raise"))
    for rid in ("b", "c", "d"):
        loop.submit(rid, [1, 2, 3], GREEDY)  # before start: all three are there for the first iteration
    loop.start()
    finals: dict[str, Any] = {}
    try:
        while len(finals) < 3:
            out = outputs.get(timeout=60)
            if out.finished:
                assert out.request_id not in finals
                finals[out.request_id] = out
        loop.submit("e", [4, 5], GREEDY)
        while "e" not in finals:
            out = outputs.get(timeout=60)
            if out.finished:
                finals[out.request_id] = out
        assert loop.failed is None
        reference = tiny_engine("gpt2")
        expected = {}
        for rid, prompt in (("d", [1, 2, 3]), ("e", [4, 5])):
            reference.add_request(rid, prompt, GREEDY)
        while reference.has_unfinished():
            expected.update({o.request_id: o.token_ids for o in reference.step() if o.finished})
        for rid in ("b", "c"):
            assert finals[rid].finish_reason == "error" and finals[rid].token_ids == []
            assert "RuntimeError: fault injected by $ORCA_ENGINE_FAULT in iteration 1" in finals[rid].error
        for rid in ("d", "e"):
            assert finals[rid].finish_reason == "length" and finals[rid].token_ids == expected[rid]
        stats = loop.stats
        assert (stats.running, stats.waiting, stats.kv_allocated_blocks) == (0, 0, 0)
    finally:
        loop.shutdown()


def test_fault_kinds_are_checked_when_the_loop_is_built() -> None:
    with pytest.raises(ValueError, match="unknown kind 'explode'"):
        EngineLoop(lambda: tiny_core("gpt2"), on_output=RequestOutputs(lambda out: None), fault=(1, "explode"))


# -- through Triton ----------------------------------------------------------------------------------------
def test_an_exception_in_one_iteration_fails_only_its_requests_and_the_model_keeps_serving(orca_server: Any) -> None:
    """orca_tiny_raise (max_bs 2) raises inside its 3rd iteration. Request a runs alone in iterations 1-2
    and completes; a burst of 6 follows: the 1 or 2 of them in iteration 3 get the error (INTERNAL, with
    the exception's message), the others complete with the tokens of the offline engine, and so does a
    request after them; the model stays ready and idle, on the same stub."""
    model = "orca_tiny_raise"
    llm = LLM(str(orca_server.tiny_checkpoint))
    before = metrics(orca_server, model)
    stub = stub_pid(orca_server, model)
    log = LogWatch(orca_server.log_path)
    a = Spec(0, input_ids=(5, 6, 7), max_tokens=2)
    burst = [Spec(1 + i, input_ids=tuple(range(10 + i, 20 + 3 * i)), max_tokens=12 + i) for i in range(6)]
    after_spec = Spec(9, input_ids=(42, 43), max_tokens=7)
    specs = [a, *burst, after_spec]
    expected = llm.generate([list(s.input_ids) for s in specs],
                            [SamplingParams(max_tokens=s.max_tokens, temperature=0, ignore_eos=True) for s in specs])
    ref = {s.key: e.token_ids for s, e in zip(specs, expected)}

    async def run() -> tuple[Any, list[Any], Any]:
        client = aiogrpc.InferenceServerClient(orca_server.grpc_url)
        try:
            first = await grpc_request(client, model, a, 0, timeout=120)
            outs = await asyncio.gather(*(grpc_request(client, model, s, s.key, timeout=120) for s in burst))
            last = await grpc_request(client, model, after_spec, 9, timeout=120)
        finally:
            await client.close()
        return first, outs, last

    first, outs, last = asyncio.run(run())
    assert first.finals == 1 and first.tokens == ref[0] and not first.errors
    failed = [o for o in outs if o.errors]
    assert 1 <= len(failed) <= 2, outs  # only the members of iteration 3 (max_bs 2)
    for o in failed:
        assert o.errors == [
            "generation failed: RuntimeError: fault injected by $ORCA_ENGINE_FAULT in iteration 3"
        ], o
        assert o.tokens == [] and o.finals == 0 and o.closed and not o.after_terminal
    for o, s in zip(outs, burst):
        if not o.errors:
            assert o.finals == 1 and o.closed and o.tokens == ref[s.key], o
    assert last.finals == 1 and last.tokens == ref[9] and not last.errors
    after = wait_idle(orca_server, model)
    errors = finished_by_reason(after).get("error", 0) - finished_by_reason(before).get("error", 0)
    assert errors == len(failed)
    assert model_ready(orca_server.http_url, model) and stub_pid(orca_server, model) == stub
    assert "iteration" in log.text() and "fault injected" in log.text()  # the worker logged the exception


# -- a client that stops reading ---------------------------------------------------------------------------
def _unread_bytes(sock: socket.socket) -> int:
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def test_a_client_that_stops_reading_blocks_no_other_stream(orca_server: Any) -> None:
    """Two clients stop reading long, heavy streams (every token with its 20 most likely alternatives): an
    HTTP generate_stream socket with a small receive buffer that is never read, and a gRPC stream whose
    callback blocks on its first response (HTTP/2 flow control then holds the server's writes). Meanwhile
    other requests complete, with the tokens they produce alone. Once the gRPC reader resumes, its stream
    delivers every token and one FINAL; the HTTP one is closed unread; every K/V block comes back."""
    model = "orca_tiny"
    server = orca_server
    wait_idle(server, model)
    heavy_tokens = 1500
    heavy = {"input_ids": [1, 2, 3], "max_tokens": heavy_tokens, "temperature": 0, "ignore_eos": True,
             "logprobs": 20, "return_logprobs": True}
    others = [Spec(i, input_ids=tuple(range(30 + i, 40 + 2 * i)), max_tokens=10 + 5 * i) for i in range(6)]
    refs = asyncio.run(alone_references(server.grpc_url, model, others))
    log = LogWatch(server.log_path)

    # The HTTP client that never reads.
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.connect((server.host, server.http_port))
    body = json.dumps({**heavy, "stream": True}).encode()
    raw.sendall(f"POST /v2/models/{model}/generate_stream HTTP/1.1\r\nHost: {server.http_address}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)

    # The gRPC client whose callback blocks.
    release = threading.Event()
    got: list[Any] = []
    ended = threading.Event()

    def callback(result: Any, error: Any) -> None:
        got.append(error if error is not None else parse_result(result))
        if error is not None or got[-1].final:
            ended.set()
        release.wait(timeout=600)  # stuck here: the stream's reader thread reads nothing more

    stuck = grpcclient.InferenceServerClient(server.grpc_url)
    stuck.start_stream(callback=callback)
    stuck.async_stream_infer(model, build_inputs(input_ids=heavy["input_ids"], max_tokens=heavy_tokens,
                                                 temperature=0, ignore_eos=True, logprobs=20,
                                                 return_logprobs=True), request_id="stuck")
    try:
        deadline = time.monotonic() + 120
        while not got or _unread_bytes(raw) == 0:  # both stuck clients have data they do not read
            assert time.monotonic() < deadline, "the stuck clients never got a response"
            time.sleep(0.05)

        async def run_others() -> list[Any]:
            client = aiogrpc.InferenceServerClient(server.grpc_url)
            try:
                return await asyncio.gather(*(grpc_request(client, model, s, s.key, timeout=120) for s in others))
            finally:
                await client.close()

        t0 = time.monotonic()
        outs = asyncio.run(run_others())
        took = time.monotonic() - t0
        for o, s in zip(outs, others):
            assert o.finals == 1 and not o.errors and o.closed and o.tokens == refs[s.key], o
        assert not release.is_set() and len(got) == 1  # the gRPC reader was stuck all along
        assert _unread_bytes(raw) > 0  # so was the HTTP one
        print(f"\n{len(others)} requests completed in {took:.1f} s beside two stuck readers")
    finally:
        release.set()
    assert ended.wait(timeout=300), "the resumed gRPC stream never ended"
    stuck.stop_stream()
    stuck.close()
    raw.close()
    chunks = [c for c in got if not isinstance(c, Exception)]
    assert len(chunks) == len(got), got[-1]
    assert sum(len(c.output_ids) for c in chunks) == heavy_tokens
    assert [c.final for c in chunks].count(True) == 1 and chunks[-1].final
    wait_idle(server, model, timeout=300)
    assert not log.problems(), log.problems()
