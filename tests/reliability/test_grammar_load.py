"""Structured outputs under attack through the real tritonserver (README "Security"): grammar bombs beside
ordinary requests, and a flood of distinct schemas, against the shipped orca_gpt (SmolLM2, its tokenizer).

Every request is answered exactly once: a bomb with INVALID_ARG naming its field, an ordinary request with
its tokens, a schema past the compile queue with the queue's refusal. Timing is printed (docs/RELIABILITY.md
records it), never asserted.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from typing import Any

import tritonclient.grpc as grpcclient
from _reliability import rss_kib, stub_pid
from orca_client.client import build_inputs, parse_result

MODEL = "orca_gpt"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
def _nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


BOMBS = {  # each refused when the request is read: (structured_outputs, words of its error)
    "maxLength 1e9": ({"json": {"type": "string", "maxLength": 10**9}}, "maxlength"),
    "nested regex repetition": ({"regex": "(a{1000}){1000}"}, "repeats"),
    "deep schema": ({"json": _nested(100)}, "nests deeper"),
    "huge enum": ({"json": {"enum": list(range(30_000))}}, "json values"),
    "grammar repetition": ({"grammar": 'root ::= "a"{0,1000000}'}, "repeats"),
}


def _stream(server: Any, requests_: list[dict[str, Any]], timeout: float = 600) -> tuple[list[Any], list[str]]:
    """Sends `requests_` back to back on one gRPC stream; (each request's first-response time after the send,
    or None; every error message). A request is answered by its FINAL or by one error."""
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    finals: set[str] = set()
    errors: list[str] = []
    done = threading.Event()

    def on_result(result: Any, error: Any) -> None:
        if error is not None:
            errors.append(error.message())
        else:
            rid = result.get_response().id
            first.setdefault(rid, time.monotonic())
            if parse_result(result).final:
                finals.add(rid)
        if len(finals) + len(errors) >= len(requests_):
            done.set()

    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=on_result)
    try:
        for i, request in enumerate(requests_):
            sent[str(i)] = time.monotonic()
            client.async_stream_infer(MODEL, build_inputs(**request), request_id=str(i))
        assert done.wait(timeout), f"{len(finals)} finished and {len(errors)} failed of {len(requests_)}"
    finally:
        client.stop_stream(cancel_requests=not done.is_set())
        client.close()
    ttft = [first[rid] - sent[rid] if rid in first else None for rid in map(str, range(len(requests_)))]
    return ttft, errors


def _ordinary(n: int) -> list[dict[str, Any]]:
    """Half unconstrained, half with the one (cached after its first compile) schema."""
    return [{"text": f"Name city number {i}:", "max_tokens": 4, "temperature": 0,
             **({"structured_outputs": json.dumps({"json": SCHEMA})} if i % 2 else {})} for i in range(n)]


def test_grammar_bombs_are_refused_and_ordinary_requests_unharmed(orca_server: Any) -> None:
    """40 ordinary requests alone, then the same beside every bomb (each on a stream of its own, sent
    together): each bomb refused with its field named, the 40 all answered, no error among them; the
    stub's memory bounded. Prints the p99 time to first token of both runs."""
    pid = stub_pid(orca_server, MODEL)
    _stream(orca_server, _ordinary(2))  # the schema's compile and the stub's warm-up out of the way
    alone, errors = _stream(orca_server, _ordinary(40))
    assert not errors and all(t is not None for t in alone)
    rss_before = rss_kib(pid)
    refusals: dict[str, str] = {}

    def bomb(name: str, so: dict[str, Any]) -> None:  # a stream of its own: its error is its answer
        _, bomb_errors = _stream(orca_server, [{"text": "x", "max_tokens": 4, "structured_outputs": json.dumps(so)}])
        refusals[name] = bomb_errors[0] if bomb_errors else "ANSWERED"

    threads = [threading.Thread(target=bomb, args=(name, so)) for name, (so, _) in BOMBS.items()]
    for t in threads:
        t.start()
    beside, errors = _stream(orca_server, _ordinary(40))
    for t in threads:
        t.join(180)
    assert not errors and all(t is not None for t in beside)
    for name, (_, words) in BOMBS.items():
        assert words in refusals.get(name, "").lower() and "structured_outputs" in refusals[name], (name, refusals)
    growth = (rss_kib(pid) - rss_before) / 1024
    assert growth < 256, f"the stub's RSS grew {growth:.0f} MiB"
    p99 = [statistics.quantiles(ts, n=100)[98] for ts in (alone, beside)]
    print(f"\ngrammar bombs: {len(BOMBS)} refused; 40 ordinary alone p99 TTFT {p99[0] * 1000:.0f} ms, beside the "
          f"bombs {p99[1] * 1000:.0f} ms ({p99[1] / p99[0]:.2f}x); stub RSS {growth:+.0f} MiB")


def test_500_distinct_schemas_at_once_are_bounded_by_the_compile_queue(orca_server: Any) -> None:
    """500 requests, each with a schema of its own, back to back on one stream: each answered once, by its
    tokens or by the compile queue's refusal (the waiting queue is full: 429 through orca-openai); at least
    the queue's 64 are served."""
    pid = stub_pid(orca_server, MODEL)
    rss_before = rss_kib(pid)
    requests_ = [{"text": "JSON:", "max_tokens": 2, "temperature": 0, "structured_outputs": json.dumps(
        {"json": {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}})}
        for i in range(500)]
    started = time.monotonic()
    ttft, errors = _stream(orca_server, requests_)
    wall = time.monotonic() - started
    served = sum(t is not None for t in ttft)
    assert served + len(errors) == 500
    assert all("waiting queue is full" in e for e in errors), {e for e in errors if "waiting queue is full" not in e}
    assert served >= 64
    growth = (rss_kib(pid) - rss_before) / 1024
    assert growth < 256, f"the stub's RSS grew {growth:.0f} MiB"
    print(f"\n500 distinct schemas: {served} served, {len(errors)} refused by the compile queue, {wall:.1f} s; "
          f"stub RSS {growth:+.0f} MiB")
