"""Malformed requests end to end, through the real tritonserver, while valid greedy streams run.

A table of distinct malformed requests to `orca_tiny` (tests/_server.py: the tiny GPT-2 without a tokenizer,
vocab 211, context 2048; no failure test unloads it), each sent over HTTP `/v2/models/NAME/generate`, HTTP
`generate_stream` and a gRPC stream (ModelStreamInfer, tritonclient.grpc), plus requests only gRPC can
express (raw bytes, wrong dtypes and shapes). Meanwhile three valid greedy requests (two gRPC streams, one
HTTP server-sent-event stream) are generating, each run again as soon as it ends, and every malformed request
is sent only while all three are generating.

Each malformed request must be answered with an error naming the field, and for numeric fields the allowed
range. What the transports show of the error code: orca_gpt answers INVALID_ARG (orca_triton.generate's
ValueError), but Triton's `/generate` endpoints report every response error of a decoupled model as HTTP
400, and a gRPC stream (the only gRPC way to a decoupled model) hands over the message without a status
code. So the check is HTTP 400 plus a message that is not one of orca_gpt's other errors (INTERNAL:
"internal error: ...", "generation failed: ..."; UNAVAILABLE: "the engine failed ...", "the waiting queue
is full"). Requests Triton itself refuses before the model (wrong dtype or shape, an unknown input) carry
Triton's own message, which names the input. Bodies Triton's HTTP frontend cannot convert (TRITON_HTTP) never
reach the model: Triton answers them itself, with 500 for most, and those answers are pinned as they are.

Afterwards: every valid run produced exactly the tokens it produces alone, the model is ready, the engine is
idle (no request, block or slot left behind), no request finished with an error, and the server log shows
no stub crash and no traceback from the request path.
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from test_server_e2e import idle, metrics, wait_for

MODEL = "orca_tiny"  # vocab 211, context 2048, no tokenizer
ERROR_KEY = 'orca_requests_finished_total{reason="error"}'
# orca_gpt's messages for anything but INVALID_ARG (model.py) and the engine's UNAVAILABLE ones.
OTHER_CODES = re.compile(r"^(internal error|generation failed|the engine (failed|has failed)|request cancelled)|"
                         r"waiting queue is full")
NUMERIC = ("max_tokens", "temperature", "top_k", "top_p", "seed", "logprobs", "stop_token_ids", "input_ids")
RANGE = re.compile(r"[\[(]-?\d.*[\])]|[<>]=? ?-?\d|at (most|least) \d")
MAX_INT64 = "9223372036854775807"


@dataclass(frozen=True)
class Bad:
    """One malformed request: the generate endpoint's JSON body (top-level keys other than inputs become
    request parameters), what the answer must say (a regular expression), and whether a numeric range
    is expected."""

    body: dict[str, Any]
    says: str
    numeric: bool = False


IDS = [1, 2]
CHAT = '[{"role": "user", "content": "hi"}]'
# fmt: off
BAD = [
    # -- the prompt ------------------------------------------------------------------------------------
    Bad({"max_tokens": 4}, r"the request has no prompt: give input_ids, text_input or messages"),
    Bad({"input_ids": IDS, "text_input": "x"}, r"give exactly one prompt input, got input_ids, text_input"),
    Bad({"text_input": "x", "messages": CHAT}, r"give exactly one prompt input, got text_input, messages"),
    Bad({"input_ids": []}, r"the prompt is empty: give at least one token"),
    Bad({"input_ids": [1, -3]}, r"prompt token id -3 is out of range: ids must be integers in \[0, 210\]", True),
    Bad({"input_ids": [211]}, r"prompt token id 211 is out of range: .*\[0, 210\]", True),
    Bad({"input_ids": [5, 2147483647]}, r"prompt token id 2147483647 is out of range: .*\[0, 210\]", True),
    Bad({"input_ids": [-2147483648]}, r"prompt token id -2147483648 is out of range: .*\[0, 210\]", True),
    Bad({"input_ids": [7] * 2048}, r"the prompt has 2048 tokens; .* at most 2047", True),
    Bad({"input_ids": [7] * 5000}, r"the prompt has 5000 tokens; .* at most 2047", True),
    Bad({"text_input": "hello"}, r"text_input: this model .* has no tokenizer: send input_ids instead of text"),
    Bad({"text_input": ""}, r"text_input is empty: give at least one character"),
    Bad({"text_input": "\u00e9\u65e5\U0001f642\x00"}, r"text_input: this model .* has no tokenizer"),
    Bad({"messages": CHAT}, r"messages: this model .* has no tokenizer: send input_ids"),
    Bad({"messages": "{"}, r"messages is not valid JSON"),
    Bad({"messages": "[]"}, r"messages must be a non-empty JSON list .*, got an empty array"),
    Bad({"messages": '{"role": "user", "content": "hi"}'}, r"messages must be a non-empty JSON list .*, got object"),
    Bad({"messages": '[{"role": "robot", "content": "x"}]'}, r'messages\[0\]: role must be "system", "user", '
                                                              r'"assistant" or "tool", got "robot"'),
    Bad({"messages": '[{"role": "user"}]'}, r'messages\[0\] must be an object with exactly the keys "role" and '
                                             r'"content" .*, got "role"'),
    Bad({"messages": '[{"role": "user", "content": "a", "weight": "x"}]'},
        r'messages\[0\] must be an object with exactly .*, got "role", "content", "weight"'),
    Bad({"messages": '[{"role": "user", "content": {"text": [1, {"deep": null}]}}]'},
        r"messages\[0\]: content must be a string, got object"),
    Bad({"messages": '[{"role": "user", "content": "ok"}, 3]'}, r"messages\[1\] must be an object .*, got integer"),
    Bad({"messages": '[{"role": "user", "content": "\\ud800"}]'}, r"messages\[0\]: content is not valid Unicode"),
    Bad({"messages": "[" * 100_000}, r"messages is nested too deeply to parse"),
    # -- each sampling field as a request parameter (what /generate makes of top-level keys) -----------
    Bad({"input_ids": IDS, "max_tokens": 0}, r"max_tokens must be >= 1", True),
    Bad({"input_ids": IDS, "max_tokens": -5}, r"max_tokens must be >= 1 .*got -5", True),
    Bad({"input_ids": IDS, "max_tokens": 5000}, r"max_tokens must be in \[1, 2046\]", True),
    Bad({"input_ids": IDS, "max_tokens": "many"}, r"max_tokens must be an integer >= 1 .*got string 'many'", True),
    Bad({"input_ids": IDS, "max_tokens": 2.5}, r"max_tokens must be an integer >= 1 .*got number 2.5", True),
    Bad({"input_ids": IDS, "max_tokens": True}, r"max_tokens must be an integer >= 1 .*got true", True),
    Bad({"input_ids": IDS, "temperature": -0.5}, r"temperature must be >= 0 \(0 = greedy\), got -0.5", True),
    Bad({"input_ids": IDS, "temperature": "hot"}, r"temperature must be a number >= 0", True),
    Bad({"input_ids": IDS, "temperature": False}, r"temperature must be a number >= 0 .*got false", True),
    Bad({"input_ids": IDS, "top_p": 0}, r"top_p must be in \(0, 1\], got 0", True),
    Bad({"input_ids": IDS, "top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5", True),
    Bad({"input_ids": IDS, "top_p": -1}, r"top_p must be in \(0, 1\], got -1", True),
    Bad({"input_ids": IDS, "top_p": "most"}, r"top_p must be a number in \(0, 1\]", True),  # "0.9" converts
    Bad({"input_ids": IDS, "top_k": -2}, r"top_k must be >= 0 and <= " + MAX_INT64, True),  # -1 is vLLM's "off"
    Bad({"input_ids": IDS, "top_k": 2.5}, r"top_k must be an integer >= 0 and <= " + MAX_INT64, True),
    Bad({"input_ids": IDS, "top_k": 1e30}, r"top_k must be an integer >= 0 and <= " + MAX_INT64, True),
    Bad({"input_ids": IDS, "seed": -1}, r"seed must be >= 0 and <= " + MAX_INT64, True),
    Bad({"input_ids": IDS, "seed": 1.5}, r"seed must be an integer >= 0 and <= " + MAX_INT64, True),
    Bad({"input_ids": IDS, "seed": "abc"}, r"seed must be an integer >= 0 and <= " + MAX_INT64, True),
    Bad({"input_ids": IDS, "stop": "."}, r"stop strings need a tokenizer, and this model has none"),
    Bad({"input_ids": IDS, "stop": '["a", 3]'}, r"stop\[1\] must be a non-empty string, got integer 3"),
    Bad({"input_ids": IDS, "stop": "[oops"}, r"stop \(one stop string, or a JSON list .*\) is not valid JSON"),
    Bad({"input_ids": IDS, "stop_token_ids": "[-1]"}, r"stop_token_ids\[0\] must be >= 0, got -1", True),
    Bad({"input_ids": IDS, "stop_token_ids": "[1, 2.5]"}, r"stop_token_ids\[1\] must be an integer >= 0", True),
    Bad({"input_ids": IDS, "stop_token_ids": "5"}, r"stop_token_ids must be a list of integers >= 0", True),
    Bad({"input_ids": IDS, "stop_token_ids": "x"}, r"stop_token_ids \(a JSON list of integers >= 0 in a string\) "
                                                   r"is not valid JSON", True),
    Bad({"input_ids": IDS, "stop_token_ids": 7}, r"stop_token_ids must be a list of integers >= 0, got integer 7",
        True),
    Bad({"input_ids": IDS, "stop_token_ids": "[" * 100_000}, r"stop_token_ids .* is nested too deeply", True),
    Bad({"input_ids": IDS, "ignore_eos": 1}, r"ignore_eos must be a boolean \(true or false\), got integer 1"),
    Bad({"input_ids": IDS, "ignore_eos": "yes"}, r"ignore_eos must be a boolean \(true or false\), got string 'yes'"),
    Bad({"input_ids": IDS, "logprobs": 21}, r"logprobs must be an integer in \[0, 20\]", True),
    Bad({"input_ids": IDS, "logprobs": -1}, r"logprobs must be an integer in \[0, 20\]", True),
    Bad({"input_ids": IDS, "logprobs": 2.5}, r"logprobs must be an integer in \[0, 20\]", True),
    Bad({"input_ids": IDS, "nonsense": 3}, r"unknown request parameter\(s\) nonsense; allowed: max_tokens"),
    Bad({"input_ids": IDS, "frequency_penalty": 0.5}, r"frequency_penalty is not supported: orca's sampler applies "
                                                      r"no penalties; it is accepted only as 0"),
    Bad({"input_ids": IDS, "temp\u00e9rature": 1}, r"unknown request parameter\(s\) temp\u00e9rature"),
    Bad({"input_ids": IDS, "max_tokens": 4, "x" * 300: 1}, r"unknown request parameter\(s\) x{40}\.\.\. \(300 char"),
    # -- the sampling_parameters JSON ------------------------------------------------------------------
    Bad({"input_ids": IDS, "sampling_parameters": "{not json"}, r"sampling_parameters is not valid JSON"),
    Bad({"input_ids": IDS, "sampling_parameters": "[1, 2]"}, r"sampling_parameters must be a JSON object, got array"),
    Bad({"input_ids": IDS, "sampling_parameters": "null"}, r"sampling_parameters must be a JSON object, got null"),
    Bad({"input_ids": IDS, "sampling_parameters": '{"max_tokenz": 3}'}, r"unknown sampling parameter\(s\) max_tokenz"),
    Bad({"input_ids": IDS, "sampling_parameters": '{"": 1}'}, r"unknown sampling parameter\(s\) '';"),
    Bad({"input_ids": IDS, "sampling_parameters": '{"a": {"b": {"c": [1, {"d": NaN}]}}}'},
        r"unknown sampling parameter\(s\) a;"),
    Bad({"input_ids": IDS, "sampling_parameters": '{"top_k": 100000000000000000000000000000}'},
        r"top_k must be >= 0 and <= " + MAX_INT64 + r" \(0 = off\), got 100000000000000000000000000000", True),
    Bad({"input_ids": IDS, "sampling_parameters": '{"top_k": ' + "1" * 60 + "}"},
        r"top_k must be >= 0 and <= " + MAX_INT64 + r" \(0 = off\), got an integer of 60 digits", True),
    Bad({"input_ids": IDS, "sampling_parameters": '{"seed": 9223372036854775808}'},
        r"seed must be >= 0 and <= " + MAX_INT64, True),
    Bad({"input_ids": IDS, "sampling_parameters": '{"temperature": NaN}'},
        r"temperature must be a finite number >= 0 \(0 = greedy\), got nan", True),
    Bad({"input_ids": IDS, "sampling_parameters": '{"temperature": Infinity}'},
        r"temperature must be a finite number >= 0", True),
    Bad({"input_ids": IDS, "sampling_parameters": '{"top_p": -Infinity}'}, r"top_p must be a finite number in \(0, 1\]",
        True),
    Bad({"input_ids": IDS, "sampling_parameters": '{"temperature": 1e999}'}, r"temperature must be a finite number",
        True),
    Bad({"input_ids": IDS, "sampling_parameters": '{"max_tokens": null}'},
        r"max_tokens must be an integer >= 1 .*got null", True),
    Bad({"input_ids": IDS, "sampling_parameters": '{"max_tokens": 4.0}'}, r"max_tokens must be an integer >= 1", True),
    Bad({"input_ids": IDS, "sampling_parameters": '{"max_tokens": [16]}'}, r"max_tokens must be an integer >= 1", True),
    Bad({"input_ids": IDS, "sampling_parameters": '{"max_tokens": ' + "9" * 5000 + "}"},
        r"sampling_parameters holds an integer of more than 4300 digits"),
    Bad({"input_ids": IDS, "sampling_parameters": '{"max_tokens": 3, "max_tokens": 0}'}, r"max_tokens must be >= 1",
        True),
    Bad({"input_ids": IDS, "sampling_parameters": '{"top_p": 0.5, "temperature": -1}'},
        r"temperature must be >= 0 \(0 = greedy\), got -1", True),
    Bad({"input_ids": IDS, "sampling_parameters": '{"stop": [""]}'}, r"stop\[0\] must be a non-empty string"),
    Bad({"input_ids": IDS, "sampling_parameters": '{"stop": {"a": 1}}'},
        r"stop must be a string or a list of non-empty strings, got object"),
    Bad({"input_ids": IDS, "sampling_parameters": '{"stop": ["\\udfff"]}'}, r"stop\[0\] is not valid Unicode"),
    Bad({"input_ids": IDS, "sampling_parameters": '{"stop_token_ids": [1, [2]]}'},
        r"stop_token_ids\[1\] must be an integer >= 0, got array", True),
    Bad({"input_ids": IDS, "sampling_parameters": '{"stop_token_ids": "1, 2"}'},
        r"stop_token_ids must be a list of integers >= 0, got string '1, 2'", True),
    Bad({"input_ids": IDS, "sampling_parameters": '{"ignore_eos": "maybe"}'}, r"ignore_eos must be a boolean"),
    Bad({"input_ids": IDS, "sampling_parameters": '{"logprobs": true}'}, r"logprobs must be an integer in \[0, 20\]",
        True),
    Bad({"input_ids": IDS, "sampling_parameters": '{"logprobs": "30"}'}, r"logprobs must be an integer in \[0, 20\]",
        True),
    Bad({"input_ids": IDS, "sampling_parameters": "[" * 100_000}, r"sampling_parameters is nested too deeply"),
    Bad({"input_ids": IDS, "sampling_parameters": '{"ignore_eos": "' + "x" * 1_000_000 + '"}'},
        r"ignore_eos must be a boolean \(true or false\), got string 'x{80}'\.\.\. \(1000000 characters\)$"),
    # -- the prefix cache's salt -------------------------------------------------------------------------
    Bad({"input_ids": IDS, "cache_salt": ""}, r"cache_salt must be a string of 1 to 1024 characters, got 0 characters"),
    Bad({"input_ids": IDS, "cache_salt": "x" * 100_000},
        r"cache_salt must be a string of 1 to 1024 characters, got 100000 characters$"),
]
# fmt: on


def _grpc_inputs(spec: list[tuple[str, np.ndarray, str]]) -> list[grpcclient.InferInput]:
    out = []
    for name, arr, dtype in spec:
        tensor = grpcclient.InferInput(name, list(arr.shape), dtype)
        tensor.set_data_from_numpy(arr)
        out.append(tensor)
    return out


def _b(value: bytes) -> np.ndarray:
    return np.array([value], dtype=object)


OK_IDS = ("input_ids", np.array(IDS, np.int32), "INT32")
# Requests only gRPC can express. Those Triton refuses itself (before the model) carry Triton's message.
# fmt: off
GRPC_ONLY = [
    ([("text_input", _b(b"\xff\xfe"), "BYTES")], r"text_input is not valid UTF-8 \(byte 0: invalid start byte\)"),
    ([("text_input", _b(b"ab\xed\xa0\x80"), "BYTES")], r"text_input is not valid UTF-8 \(byte 2"),
    ([("messages", _b(b'[{"role": "user", "content": "\xc3"}]'), "BYTES")], r"messages is not valid UTF-8"),
    ([OK_IDS, ("sampling_parameters", _b(b'{"max_tokens": \x80}'), "BYTES")],
     r"sampling_parameters is not valid UTF-8"),
    ([("input_ids", np.array([1.0, 2.0], np.float32), "FP32")], r"input 'input_ids' data-type is 'FP32', but model "
                                                                 r"'orca_tiny' expects 'INT32'"),
    ([("input_ids", np.array([[1, 2]], np.int32), "INT32")], r"unexpected shape for input 'input_ids' .* Expected "
                                                              r"\[-1\], got \[1,2\]"),
    ([("text_input", np.array([5], np.int32), "INT32")], r"input 'text_input' data-type is 'INT32', but model "
                                                          r"'orca_tiny' expects 'BYTES'"),
    ([OK_IDS, ("stream", np.array([True, False]), "BOOL")], r"unexpected shape for input 'stream' .* Expected \[1\], "
                                                            r"got \[2\]"),
    ([OK_IDS, ("stream", np.array([1], np.int32), "INT32")], r"input 'stream' data-type is 'INT32', but model "
                                                             r"'orca_tiny' expects 'BOOL'"),
    ([OK_IDS, ("sampling_parameters", np.array([b"{}", b"{}"], dtype=object), "BYTES")],
     r"unexpected shape for input 'sampling_parameters' .* Expected \[1\], got \[2\]"),
    ([OK_IDS, ("return_logprobs", np.zeros(0, bool), "BOOL")], r"unexpected shape for input 'return_logprobs'"),
    ([OK_IDS, ("prompt", _b(b"x"), "BYTES")], r"unexpected inference input 'prompt' for model 'orca_tiny'"),
    ([OK_IDS, ("cache_salt", _b(b"\xff"), "BYTES")],
     r"cache_salt is not valid UTF-8 \(byte 0: invalid start byte\); cache_salt must be a UTF-8 string of 1 to 1024"),
    ([OK_IDS, ("cache_salt", np.array([b"a", b"b"], dtype=object), "BYTES")],
     r"unexpected shape for input 'cache_salt' .* Expected \[1\], got \[2\]"),
]
# fmt: on


# Bodies Triton's HTTP frontend refuses itself, before the model (tritonserver 2.51 of the pinned
# nvidia-pytriton wheel): its status (500 for what it cannot convert to the declared tensors, 400 for a
# request parameter that is not a scalar) and message, pinned here to document them. orca cannot change
# these answers; the model never sees the request.
TRITON_HTTP = [
    ("{not json", 500, r"failed to parse the request JSON buffer"),
    ("", 500, r"failed to parse the request JSON buffer: The document is empty"),
    ("[1, 2]", 500, r"attempt to get members for non-object"),
    ('{"input_ids": "abc"}', 500, r"Unable to parse 'data': attempt to access JSON non-signed-integer"),
    ('{"input_ids": [[1, 2]]}', 500, r"Unable to parse 'data': Shape does not match"),
    ('{"input_ids": [1.5]}', 500, r"Unable to parse 'data': attempt to access JSON non-signed-integer"),
    ('{"input_ids": [1], "stream": 3}', 500, r"Unable to parse 'data': attempt to access JSON non-boolean"),
    ('{"text_input": 5}', 500, r"Unable to parse JSON bytes array: attempt to access JSON non-string"),
    ('{"text_input": ["a", "b"]}', 400, r"can not convert input 'text_input' to tensor with proper shape"),
    ('{"input_ids": [1], "max_tokens": [1, 2]}', 400, r"parameter 'max_tokens' has invalid type. It should be "
                                                      r"either 'int', 'bool', or 'string'"),
    ('{"input_ids": [1], "max_tokens": null}', 400, r"parameter 'max_tokens' has invalid type"),
    ('{"input_ids": [1], "sampling_parameters": {"max_tokens": 4}}', 500, r"Unable to parse JSON bytes array"),
]


# -- valid load -------------------------------------------------------------------------------------
VALID = [([11, 12, 13], 300), ([42] * 5, 260), (list(range(100, 140)), 280)]


def _grpc_stream(server: Any, ids: list[int], max_tokens: int, first: threading.Event | None) -> list[int]:
    """One greedy request over a gRPC stream; its tokens (first is set when the first token arrives)."""
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    spec = [("input_ids", np.array(ids, np.int32), "INT32"), ("stream", np.array([True]), "BOOL"),
            ("sampling_parameters", _b(json.dumps(body).encode()), "BYTES")]
    responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    tokens: list[int] = []
    try:
        client.async_stream_infer(MODEL, _grpc_inputs(spec))
        while True:
            result, error = responses.get(timeout=120)
            if error is not None:
                raise AssertionError(f"a valid gRPC stream failed: {error}")
            tokens += result.as_numpy("output_ids").tolist()
            if first is not None and tokens:
                first.set()
            if result.get_response().parameters["triton_final_response"].bool_param:
                return tokens
    finally:
        client.stop_stream()
        client.close()


def _http_stream(server: Any, ids: list[int], max_tokens: int, first: threading.Event | None) -> list[int]:
    """One greedy request over HTTP generate_stream (server-sent events)."""
    body = {"input_ids": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    tokens: list[int] = []
    with requests.post(f"{server.http_url}/v2/models/{MODEL}/generate_stream", json=body, stream=True,
                       timeout=120) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                event = json.loads(line[len(b"data: "):])
                assert "error" not in event, f"a valid HTTP stream failed: {event}"
                ids_ = event["output_ids"]  # Triton writes a one-element array as a scalar
                tokens += ids_ if isinstance(ids_, list) else [ids_]
                if first is not None and tokens:
                    first.set()
    return tokens


class ValidLoad:
    """Each valid request on its own thread, run again and again until stopped; every run's tokens are
    kept. `generating[i]` is set while run i of that thread has tokens flowing."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.stop = threading.Event()
        self.generating = [threading.Event() for _ in VALID]
        self.runs: list[list[list[int]]] = [[] for _ in VALID]
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(len(VALID))]

    def _loop(self, i: int) -> None:
        ids, max_tokens = VALID[i]
        send = _http_stream if i == 2 else _grpc_stream
        try:
            while not self.stop.is_set():
                first = threading.Event()
                self.generating[i] = first
                tokens = send(self.server, ids, max_tokens, first)
                self.generating[i] = threading.Event()  # between runs: not generating
                self.runs[i].append(tokens)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(f"valid request {i}: {type(exc).__name__}: {exc}")

    def wait_generating(self) -> None:
        deadline = time.monotonic() + 60
        for i in range(len(VALID)):
            while not self.generating[i].wait(0.05):
                assert not self.errors, self.errors
                assert time.monotonic() < deadline, f"valid request {i} is not generating"

    def __enter__(self) -> ValidLoad:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


# -- the malformed requests' transports ---------------------------------------------------------------
def _http(server: Any, endpoint: str, body: dict[str, Any]) -> str:
    data = json.dumps(body, ensure_ascii=True).encode()
    r = requests.post(f"{server.http_url}/v2/models/{MODEL}/{endpoint}", data=data, timeout=60)
    assert r.status_code == 400, (endpoint, r.status_code, r.text[:300])
    text = r.text
    if endpoint == "generate_stream":  # the error as the stream's one event
        events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
        assert len(events) == 1, text[:300]
        text = events[0]
    return json.loads(text)["error"]


def _as_grpc(body: dict[str, Any]) -> tuple[list[grpcclient.InferInput], dict[str, Any]]:
    """The tensors and parameters /generate makes of a body: prompt and flag inputs, the rest parameters."""
    spec, parameters = [], {}
    for key, value in body.items():
        if key == "input_ids":
            spec.append((key, np.array(value, np.int32).reshape(-1), "INT32"))
        elif key in ("text_input", "messages", "sampling_parameters"):
            spec.append((key, _b(value.encode("utf-8", "surrogatepass")), "BYTES"))
        else:
            parameters[key] = value
    return _grpc_inputs(spec), parameters


class GrpcStream:
    """One gRPC stream for the malformed requests, one at a time: each answer is its only response."""

    def __init__(self, server: Any) -> None:
        self.responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def error(self, inputs: list[grpcclient.InferInput], parameters: dict[str, Any]) -> str:
        self.client.async_stream_infer(MODEL, inputs, parameters=parameters or None)
        result, error = self.responses.get(timeout=60)
        assert error is not None, f"accepted: {result.get_response()}"
        # The stream carries no status code (error.status() is None): the message is all a client gets.
        return error.message()

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def _check(message: str, bad: Bad, where: str) -> None:
    assert re.search(bad.says, message), f"{where}: {message[:300]!r} does not match {bad.says!r}"
    assert not OTHER_CODES.search(message), f"{where}: not an INVALID_ARG answer: {message[:300]!r}"
    assert len(message) < 2000, f"{where}: message of {len(message)} characters"
    if bad.numeric:
        assert RANGE.search(message), f"{where}: no allowed range in {message[:300]!r}"


@pytest.fixture(scope="module")
def alone(orca_server: Any) -> list[list[int]]:
    """Each valid request's tokens when it runs alone (one after the other, the model otherwise idle)."""
    wait_for(lambda: idle(orca_server, MODEL), "orca_tiny idle")
    return [_grpc_stream(orca_server, ids, n, None) for ids, n in VALID]


def _log_tail(path: Any, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode("utf-8", "replace")


def test_table_is_distinct_and_large() -> None:
    keys = ([json.dumps(b.body, sort_keys=True) for b in BAD] + [repr([(n, a.tolist(), d) for n, a, d in spec])
                                                                  for spec, _ in GRPC_ONLY]
            + [body for body, _, _ in TRITON_HTTP])
    assert len(set(keys)) == len(keys) == len(BAD) + len(GRPC_ONLY) + len(TRITON_HTTP)
    assert len(BAD) + len(GRPC_ONLY) >= 60  # those orca answers


def test_malformed_requests_refused_while_valid_streams_run(orca_server: Any, alone: list[list[int]]) -> None:
    assert [len(t) for t in alone] == [n for _, n in VALID]
    log_offset = orca_server.log_path.stat().st_size
    before = metrics(orca_server, MODEL)
    grpc = GrpcStream(orca_server)
    answered = 0
    try:
        with ValidLoad(orca_server) as load:
            for bad in BAD:
                load.wait_generating()
                for endpoint in ("generate", "generate_stream"):
                    _check(_http(orca_server, endpoint, bad.body), bad, f"HTTP {endpoint} {_short(bad.body)}")
                    answered += 1
                _check(grpc.error(*_as_grpc(bad.body)), bad, f"gRPC {_short(bad.body)}")
                answered += 1
            for spec, says in GRPC_ONLY:
                load.wait_generating()
                _check(grpc.error(_grpc_inputs(spec), {}), Bad({}, says), f"gRPC {[n for n, _, _ in spec]}")
                answered += 1
            for body, status, says in TRITON_HTTP:
                load.wait_generating()
                for endpoint in ("generate", "generate_stream"):
                    r = requests.post(f"{orca_server.http_url}/v2/models/{MODEL}/{endpoint}", data=body.encode(),
                                      timeout=60)
                    assert (r.status_code, bool(re.search(says, r.json()["error"]))) == (status, True), (body, r.text)
            load.wait_generating()  # still generating after the last malformed request
        assert not load.errors, load.errors
    finally:
        grpc.close()
    assert answered == 3 * len(BAD) + len(GRPC_ONLY)
    # Every valid run, interrupted by nothing, gave exactly its tokens alone.
    for i, runs in enumerate(load.runs):
        assert runs, f"valid request {i} never completed"
        for run in runs:
            assert run == alone[i], f"valid request {i} differs from its run alone"
    # The model serves on: ready, idle (nothing left behind), and no request failed in the engine.
    assert requests.get(f"{orca_server.http_url}/v2/models/{MODEL}/ready", timeout=30).status_code == 200
    wait_for(lambda: idle(orca_server, MODEL), "orca_tiny idle after the malformed requests")
    after = metrics(orca_server, MODEL)
    assert after.get(ERROR_KEY, 0) == before.get(ERROR_KEY, 0)
    finished = 'orca_requests_finished_total{reason="length"}'
    assert after[finished] - before.get(finished, 0) == sum(len(r) for r in load.runs)
    assert_no_crash(_log_tail(orca_server.log_path, log_offset))


# A stub that died or was restarted, model.py's log of an INTERNAL answer or of a failed send, or a
# traceback through the request path.
CRASH = re.compile(r"is not healthy|[Ss]tub process.*(died|unhealthy|restart|exit)|Segmentation fault|core dumped|"
                   r"could not submit a request|sending a response for .* failed")
REQUEST_PATH = ("orca_triton/generate.py", "orca/sampling_params.py", "orca/validation.py",
                "orca/structured_outputs_params.py", "in _submit", "in execute")


def assert_no_crash(log: str) -> None:
    found = CRASH.search(log)
    assert found is None, log[max(0, found.start() - 2000): found.end() + 2000]
    for m in re.finditer(r"Traceback \(most recent call last\)", log):
        block = log[m.start(): m.start() + 5000]
        assert not any(p in block for p in REQUEST_PATH), block


def _short(body: dict[str, Any]) -> str:
    text = json.dumps(body)
    return text if len(text) < 120 else text[:117] + "..."


def iter_cases() -> Iterator[str]:  # for reporting: one line per distinct malformed request
    yield from (_short(b.body) for b in BAD)
    yield from (repr([(n, d) for n, _, d in spec]) for spec, _ in GRPC_ONLY)
    yield from (body[:117] for body, _, _ in TRITON_HTTP)
