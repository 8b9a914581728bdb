"""triton-inference-server/vllm_backend's tensors through the real tritonserver: the return_* flags, the
logprobs JSON and cumulative_logprob, over gRPC streaming (tritonclient) and HTTP /generate."""

from __future__ import annotations

import json
import queue
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from orca_client import OrcaClient, OrcaError

from orca import LLM, SamplingParams

PROMPT = [3, 1, 4, 1, 5]
FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens", "return_logprobs",
         "return_cumulative_logprob")


def generate(server: Any, model: str, body: dict[str, Any], stream: bool = False) -> tuple[int, Any]:
    endpoint = "generate_stream" if stream else "generate"
    body = {**body, "stream": True} if stream else body
    r = requests.post(f"{server.http_url}/v2/models/{model}/{endpoint}", json=body, timeout=300)
    if not stream or r.status_code != 200:
        return r.status_code, r.json()
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    return r.status_code, [json.loads(e) for e in events]


def grpc_stream(server: Any, model: str, tensors: dict[str, np.ndarray]) -> list[Any]:
    """One request on a gRPC stream with tritonclient itself; the results in order (raises on an error)."""
    types = {np.dtype(np.int32): "INT32", np.dtype(bool): "BOOL", np.dtype(object): "BYTES"}
    inputs = []
    for name, value in tensors.items():
        t = grpcclient.InferInput(name, list(value.shape), types[value.dtype])
        t.set_data_from_numpy(value)
        inputs.append(t)
    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put(error or result))
    client.async_stream_infer(model, inputs, request_id="vllm-compat")
    out = []
    try:
        while True:
            item = results.get(timeout=120)
            if isinstance(item, Exception):
                raise item
            out.append(item)
            if item.get_response().parameters["triton_final_response"].bool_param:
                return out
    finally:
        client.stop_stream()
        client.close()


@pytest.fixture(scope="module")
def offline(orca_server: Any) -> Any:
    """The offline engine's greedy tokens and logprobs (top 2) for PROMPT over the checkpoint orca_tiny serves."""
    llm = LLM(str(orca_server.tiny_checkpoint))
    return llm.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2))[0]


def flags(value: bool) -> dict[str, np.ndarray]:
    return {name: np.array([value]) for name in FLAGS}


def test_grpc_streaming_with_every_flag_gives_vllm_backend_outputs(orca_server: Any, offline: Any) -> None:
    results = grpc_stream(orca_server, "orca_tiny", {
        "input_ids": np.array(PROMPT, dtype=np.int32), "stream": np.array([True]),
        "sampling_parameters": np.array([b'{"max_tokens": 5, "temperature": 0, "ignore_eos": true, "logprobs": 2}'],
                                        dtype=object),
        **flags(True),
    })
    assert len(results) == 5
    total = 0.0
    for i, r in enumerate(results):
        final = i == len(results) - 1
        assert r.as_numpy("finish_reason").tolist() == [b"length" if final else b"None"]  # on every response
        assert r.as_numpy("num_input_tokens").tolist() == [len(PROMPT)]
        assert r.as_numpy("num_output_tokens").tolist() == [1]  # this response's tokens
        [token] = r.as_numpy("output_ids").tolist()
        assert token == offline.token_ids[i]
        logprobs = json.loads(r.as_numpy("logprobs")[0])
        assert len(logprobs) == 1  # this response's token only
        entry = logprobs[0]
        assert list(entry)[0] == str(token)  # the drawn token first, then the top 2 (greedy: it is one of them)
        expected = offline.logprobs[i]
        assert {int(k) for k in entry} == set(expected)
        for k, v in entry.items():
            assert set(v) == {"logprob", "rank", "decoded_token"} and v["decoded_token"] is None  # no tokenizer
            assert v["rank"] == expected[int(k)].rank
            assert v["logprob"] == pytest.approx(expected[int(k)].logprob, abs=1e-4)
        assert entry[str(token)]["rank"] == 1
        total += entry[str(token)]["logprob"]
        cumulative = r.as_numpy("cumulative_logprob")
        assert cumulative.dtype == np.float32 and cumulative.tolist() == [pytest.approx(total, abs=1e-4)]
    assert total == pytest.approx(offline.cumulative_logprob, abs=1e-4)


def test_grpc_flags_false_drop_outputs_and_left_out_keep_them(orca_server: Any) -> None:
    base = {"input_ids": np.array(PROMPT, dtype=np.int32), "stream": np.array([True]),
            "sampling_parameters": np.array([b'{"max_tokens": 3, "logprobs": 1, "ignore_eos": true}'], dtype=object)}
    # (ignore_eos: a sampled EOS would end the stream before its third response)
    results = grpc_stream(orca_server, "orca_tiny", {**base, **flags(False)})
    assert len(results) == 3
    for i, r in enumerate(results):  # num_cached_tokens has no flag: the final response always has it
        final = {"num_cached_tokens"} if i == 2 else set()
        assert {o.name for o in r.get_response().outputs} == {"output_ids"} | final
    results = grpc_stream(orca_server, "orca_tiny", base)  # orca_gpt's outputs as before the flags existed
    for i, r in enumerate(results):
        names = {o.name for o in r.get_response().outputs}
        final = {"finish_reason", "num_cached_tokens"} if i == 2 else set()
        assert names == {"output_ids", "num_input_tokens", "num_output_tokens"} | final
        assert r.as_numpy("num_output_tokens").tolist() == [i + 1]  # all so far


def test_orca_client_parses_logprobs_and_cumulative_logprob(orca_server: Any, offline: Any) -> None:
    client = OrcaClient(orca_server.grpc_url, "orca_tiny")
    chunks = list(client.generate(input_ids=PROMPT, max_tokens=5, temperature=0, ignore_eos=True, logprobs=2,
                                  return_logprobs=True, return_cumulative_logprob=True, return_finish_reason=True))
    assert [c.finish_reason for c in chunks] == [None] * 4 + ["length"]
    entries = [e for c in chunks for e in c.logprobs or []]
    assert [next(iter(e)) for e in entries] == offline.token_ids
    assert chunks[-1].cumulative_logprob == pytest.approx(offline.cumulative_logprob, abs=1e-4)
    # return_logprobs without the sampling parameter logprobs: "null", as vllm_backend answers
    chunks = list(client.generate(input_ids=PROMPT, max_tokens=2, stream=False, return_logprobs=True))
    assert chunks[-1].logprobs is None and chunks[-1].cumulative_logprob is None


def test_http_generate_with_logprobs_on_the_text_model(orca_server: Any) -> None:
    status, body = generate(orca_server, "orca_gpt", {
        "text_input": "The capital of France is", "max_tokens": 4, "temperature": 0, "exclude_input_in_output": True,
        "return_logprobs": True, "logprobs": 2, "return_cumulative_logprob": True, "return_num_output_tokens": True,
    })
    assert status == 200, body
    logprobs = json.loads(body["logprobs"])
    assert len(logprobs) == len(body["output_ids"]) == body["num_output_tokens"] == 4
    drawn = []
    for token, entry in zip(body["output_ids"], logprobs):
        assert list(entry)[0] == str(token) and entry[str(token)]["rank"] == 1 and 2 <= len(entry) <= 3
        assert sorted(v["rank"] for k, v in entry.items()) == [1, 2]  # greedy: the drawn token is the top 1
        drawn.append(entry[str(token)])
    assert "".join(d["decoded_token"] for d in drawn) == body["text_output"]
    assert body["cumulative_logprob"] == pytest.approx(sum(d["logprob"] for d in drawn), abs=1e-4)
    assert "finish_reason" in body and "num_input_tokens" in body  # flags left out: as before


def test_http_generate_stream_gives_each_events_tokens(orca_server: Any, offline: Any) -> None:
    status, events = generate(orca_server, "orca_tiny", {
        "input_ids": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 2,
        "return_logprobs": True, "return_cumulative_logprob": True, "return_finish_reason": True,
    }, stream=True)
    assert status == 200, events
    assert [e["finish_reason"] for e in events] == ["None"] * 4 + ["length"]
    entries = [json.loads(e["logprobs"]) for e in events]
    assert all(len(e) == 1 for e in entries)
    assert [int(next(iter(e[0]))) for e in entries] == offline.token_ids
    assert events[-1]["cumulative_logprob"] == pytest.approx(offline.cumulative_logprob, abs=1e-4)


BAD = [
    ({"logprobs": 21}, "logprobs must be an integer in [0, 20]"),
    ({"logprobs": -1}, "logprobs must be an integer in [0, 20]"),
    ({"logprobs": 2.5}, "logprobs must be an integer in [0, 20]"),
    ({"sampling_parameters": '{"logprobs": "3"}'}, "logprobs must be an integer in [0, 20]"),
]


@pytest.mark.parametrize(("extra", "message"), BAD)
def test_bad_logprobs_get_invalid_arg_naming_the_range(orca_server: Any, extra: dict[str, Any], message: str) -> None:
    status, body = generate(orca_server, "orca_tiny", {"input_ids": PROMPT, "return_logprobs": True, **extra})
    assert status == 400 and message in body["error"], body


def test_bad_values_over_grpc(orca_server: Any) -> None:
    client = OrcaClient(orca_server.grpc_url, "orca_tiny")
    with pytest.raises(OrcaError, match=r"logprobs must be an integer in \[0, 20\].*got 99"):
        list(client.generate(input_ids=PROMPT, logprobs=99, return_logprobs=True))
    # A flag of another type never reaches the model: Triton itself refuses it, naming the input.
    with pytest.raises(Exception, match="'return_logprobs' data-type is 'BYTES', but model 'orca_tiny' expects 'BOOL'"):
        grpc_stream(orca_server, "orca_tiny", {"input_ids": np.array(PROMPT, dtype=np.int32),
                                               "return_logprobs": np.array([b"yes"], dtype=object)})
