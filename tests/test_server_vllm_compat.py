"""triton-inference-server/vllm_backend's tensors through the real tritonserver: the return_* flags, the
logprobs JSON and cumulative_logprob, over gRPC streaming (tritonclient) and HTTP /generate; and what its
own CI sends: sampling values as strings, Triton request parameters beside the sampling_parameters input,
vLLM's other SamplingParams fields, stream with exclude_input_in_output false, and the vllm:* metrics."""

from __future__ import annotations

import json
import queue
import re
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


def grpc_stream(server: Any, model: str, tensors: dict[str, np.ndarray], parameters: dict[str, Any] | None = None
                ) -> list[Any]:
    """One request on a gRPC stream with tritonclient itself (with Triton request `parameters`, as
    vllm_backend's CI sends its sampling values beside the input); the results in order (raises on an
    error)."""
    types = {np.dtype(np.int32): "INT32", np.dtype(bool): "BOOL", np.dtype(object): "BYTES"}
    inputs = []
    for name, value in tensors.items():
        t = grpcclient.InferInput(name, list(value.shape), types[value.dtype])
        t.set_data_from_numpy(value)
        inputs.append(t)
    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put(error or result))
    client.async_stream_infer(model, inputs, request_id="vllm-compat", parameters=parameters)
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


def test_grpc_flags_false_or_left_out_drop_outputs(orca_server: Any) -> None:
    base = {"input_ids": np.array(PROMPT, dtype=np.int32), "stream": np.array([True]),
            "sampling_parameters": np.array([b'{"max_tokens": 3, "logprobs": 1, "ignore_eos": true}'], dtype=object)}
    # (ignore_eos: a sampled EOS would end the stream before its third response)
    for extra in (flags(False), {}):  # as vllm_backend: an additional output only when its flag is true
        results = grpc_stream(orca_server, "orca_tiny", {**base, **extra})
        assert len(results) == 3
        for i, r in enumerate(results):  # num_cached_tokens has no flag: the final response always has it
            final = {"num_cached_tokens"} if i == 2 else set()
            assert {o.name for o in r.get_response().outputs} == {"output_ids"} | final


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
    assert "finish_reason" not in body and "num_input_tokens" not in body  # flags left out: not sent


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
    ({"sampling_parameters": '{"logprobs": "30"}'}, "logprobs must be an integer in [0, 20]"),  # "30" converts
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


# -- what vllm_backend's own CI sends (ci/L0_backend_vllm, ci/L0_additional_outputs_vllm) ----------------
def text_request(prompt: str, sampling: dict[str, Any], stream: bool, **extra: np.ndarray) -> dict[str, np.ndarray]:
    """vllm_backend's CI request (ci/common/test_util.py create_vllm_request): text_input, stream and the
    sampling_parameters input, values as strings."""
    return {"text_input": np.array([prompt.encode()], dtype=object), "stream": np.array([stream]),
            "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=object), **extra}


def test_string_sampling_values_with_the_same_request_parameters(orca_server: Any, offline: Any) -> None:
    """Every vllm_backend CI request: {"temperature": "0", "top_p": "1"} as strings, sent both as the input
    and as Triton request parameters (which are then not read: max_tokens 2 and foo change nothing)."""
    sampling = {"temperature": "0", "top_p": "1", "max_tokens": "5", "ignore_eos": "true", "n": "1"}
    tensors = {"input_ids": np.array(PROMPT, dtype=np.int32), "stream": np.array([False]),
               "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=object)}
    [r] = grpc_stream(orca_server, "orca_tiny", tensors, parameters={**sampling, "max_tokens": "2", "foo": 1})
    assert r.as_numpy("output_ids").tolist() == offline.token_ids  # greedy, 5 tokens
    # HTTP /generate without the input: its JSON keys are the sampling values, strings converted the same
    status, body = generate(orca_server, "orca_tiny", {"input_ids": PROMPT, **sampling})
    assert status == 200 and body["output_ids"] == offline.token_ids, body


@pytest.mark.parametrize(("sampling", "message"), [
    ({"n": "0"}, "n must be >= 1 and <= 128 (sequences generated for the prompt), got 0"),
    ({"presence_penalty": "0.5"}, "presence_penalty is not supported: orca's sampler applies no penalties"),
    ({"lora_name": "sql-lora"}, "lora_name 'sql-lora': this model serves no LoRA adapters (enable_lora is off)"),
    ({"temperature": "warm"}, "temperature must be a number >= 0 (0 = greedy), got string 'warm'"),
])
def test_vllm_fields_orca_lacks_and_bad_strings_are_refused_by_name(
    orca_server: Any, sampling: dict[str, Any], message: str
) -> None:
    tensors = {"input_ids": np.array(PROMPT, dtype=np.int32), "stream": np.array([False]),
               "sampling_parameters": np.array([json.dumps({"temperature": "0", **sampling}).encode()], dtype=object)}
    with pytest.raises(Exception, match=re.escape(message)) as err:
        grpc_stream(orca_server, "orca_tiny", tensors)
    assert "unknown" not in str(err.value)


def test_stream_with_the_prompt_in_the_output_gets_vllm_backends_error(orca_server: Any) -> None:
    message = "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
    request = text_request("The capital of France is", {"temperature": "0"}, True,
                           exclude_input_in_output=np.array([False]))
    with pytest.raises(Exception) as err:
        grpc_stream(orca_server, "orca_gpt", request)
    assert getattr(err.value, "message", lambda: str(err.value))() == message
    # left out, a stream carries the completion only, and a single response starts with the prompt
    streamed = grpc_stream(orca_server, "orca_gpt", text_request("The capital of France is",
                                                                 {"temperature": "0", "max_tokens": "3"}, True))
    whole = grpc_stream(orca_server, "orca_gpt", text_request("The capital of France is",
                                                              {"temperature": "0", "max_tokens": "3"}, False))
    text = "".join(r.as_numpy("text_output")[0].decode() for r in streamed)
    assert whole[0].as_numpy("text_output")[0].decode() == "The capital of France is" + text


def vllm_samples(server: Any, model: str) -> dict[str, float]:
    """vllm:* samples of one model (labels model and version, as vllm_backend's), keyed by name plus any
    other labels."""
    out: dict[str, float] = {}
    for line in requests.get(server.metrics_url, timeout=30).text.splitlines():
        m = re.match(r'^(vllm:\w+)\{([^}]*)\} (\S+)$', line)
        if not m or f'model="{model}"' not in m.group(2) or 'version="1"' not in m.group(2):
            continue
        labels = [kv for kv in m.group(2).split(",") if not kv.startswith(("model=", "version="))]
        out[m.group(1) + ("{" + ",".join(labels) + "}" if labels else "")] = float(m.group(3))
    return out


def test_vllm_metrics_count_a_request_as_vllm_backend_does(orca_server: Any) -> None:
    model = "orca_tiny_preempt"  # no other test of this session sends it requests that finish normally here
    before = vllm_samples(orca_server, model)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prompt_tokens_total"):
        assert name in before, name
    grpc_stream(orca_server, model, {"input_ids": np.array(PROMPT, dtype=np.int32), "stream": np.array([True]),
                                     "sampling_parameters": np.array([b'{"max_tokens": "6", "ignore_eos": "true"}'],
                                                                     dtype=object)})
    after = vllm_samples(orca_server, model)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew("vllm:prompt_tokens_total") == len(PROMPT) and grew("vllm:generation_tokens_total") == 6
    assert grew("vllm:time_to_first_token_seconds_count") == 1
    assert grew("vllm:time_per_output_token_seconds_count") == 5  # one per token after the first
    assert grew("vllm:e2e_request_latency_seconds_count") == 1
    assert grew("vllm:request_prompt_tokens_sum") == len(PROMPT) and grew("vllm:request_prompt_tokens_count") == 1
    assert grew("vllm:request_generation_tokens_sum") == 6
    assert grew("vllm:request_params_n_sum") == 1 and grew("vllm:request_params_max_tokens_sum") == 6
    assert grew('vllm:request_success_total{finished_reason="length"}') == 1
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0


def test_report_custom_metrics_false_leaves_out_every_vllm_series(orca_server: Any) -> None:
    """REPORT_CUSTOM_METRICS "false" (as absent), vllm_backend's switch: the model reports no vllm:* series
    at all, while its orca_* series stay; the shipped config's "true" reports them (the test above)."""
    model = "orca_tiny_timeline"  # configured with REPORT_CUSTOM_METRICS false (tests/_server.py)
    grpc_stream(orca_server, model, {"input_ids": np.array(PROMPT, dtype=np.int32), "stream": np.array([True]),
                                     "sampling_parameters": np.array([b'{"max_tokens": 2}'], dtype=object)})
    assert vllm_samples(orca_server, model) == {}
    assert vllm_samples(orca_server, "orca_tiny_preempt")  # another model's, in the same server
    text = requests.get(orca_server.metrics_url, timeout=30).text
    assert re.search(rf'^orca_generated_tokens_total\{{[^}}]*model="{model}"[^}}]*\}} [1-9]', text, re.M)


# -- n > 1: several sequences per request (vllm_backend's n-element tensors) -------------------------------
N_PROMPT = "The capital of France is"


def test_n_greedy_sequences_answer_once_with_n_element_tensors(orca_server: Any) -> None:
    sampling = {"temperature": "0", "max_tokens": "5", "ignore_eos": "true"}
    [one] = grpc_stream(orca_server, "orca_gpt", text_request(N_PROMPT, sampling, False))
    request = text_request(N_PROMPT, {**sampling, "n": "3"}, False, return_finish_reason=np.array([True]),
                           return_num_output_tokens=np.array([True]), return_num_input_tokens=np.array([True]))
    [r] = grpc_stream(orca_server, "orca_gpt", request)
    texts = r.as_numpy("text_output").tolist()
    assert texts == [one.as_numpy("text_output")[0]] * 3 and texts[0].decode().startswith(N_PROMPT)
    assert r.as_numpy("finish_reason").tolist() == [b"length"] * 3
    assert r.as_numpy("num_output_tokens").tolist() == [5, 5, 5] and r.as_numpy("num_input_tokens").shape == (1,)
    assert r.as_numpy("output_ids") is None  # one flat tensor cannot hold n sequences
    # HTTP /generate: the n texts as a JSON list
    status, body = generate(orca_server, "orca_gpt", {"text_input": N_PROMPT, **sampling, "n": 2})
    assert status == 200 and body["text_output"] == [texts[0].decode()] * 2, body


def test_n_seeded_sequences_stream_each_as_its_own_seed_would(orca_server: Any) -> None:
    """n = 2 with seed 11 streams sequence i as an n = 1 request with seed 11 + i samples it; each response
    has the new tokens of one sequence and empty strings for the other; one FINAL."""
    sampling = {"temperature": "1.0", "max_tokens": "6", "ignore_eos": "true"}
    singles = []
    for seed in (11, 12):
        [r] = grpc_stream(orca_server, "orca_gpt", text_request(N_PROMPT, {**sampling, "seed": str(seed)}, False))
        singles.append(r.as_numpy("text_output")[0].decode()[len(N_PROMPT):])
    assert singles[0] != singles[1]  # distinct seeds, distinct samples (else the test below proves little)
    results = grpc_stream(orca_server, "orca_gpt", text_request(
        N_PROMPT, {**sampling, "seed": "11", "n": "2"}, True, return_finish_reason=np.array([True])))
    streamed = ["", ""]
    for r in results:
        texts = [t.decode() for t in r.as_numpy("text_output")]
        assert len(texts) == 2 and sum(t != "" for t in texts) <= 1
        streamed = [a + b for a, b in zip(streamed, texts)]
    assert streamed == singles
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r in results]
    assert finals.count(True) == 1 and finals[-1]
    assert results[-1].as_numpy("finish_reason").tolist() == [b"length", b"length"]


@pytest.mark.parametrize(("model", "sampling", "message"), [
    ("orca_gpt", {"n": "2", "structured_outputs": {"choice": ["a", "b"]}}, "n > 1 with structured_outputs is not "
     "supported"),
    ("orca_tiny", {"n": "2"}, "n > 1 needs a model with a tokenizer"),
])
def test_n_where_it_cannot_be_served_is_refused(orca_server: Any, model: str, sampling: dict[str, Any],
                                                message: str) -> None:
    tensors = {"input_ids": np.array(PROMPT, dtype=np.int32), "stream": np.array([False]),
               "sampling_parameters": np.array([json.dumps({"temperature": "0", **sampling}).encode()], dtype=object)}
    with pytest.raises(Exception, match=re.escape(message)):
        grpc_stream(orca_server, model, tensors)


def test_a_model_that_fails_to_load_lists_no_metric_families(orca_server: Any) -> None:
    """As vllm_backend's (its CI's vllm_invalid_2, `model` naming nothing): a copy of orca_tiny whose
    checkpoint does not exist fails to load, and the metrics port then lists no series of it, orca_ or
    vllm: (the families are made once the engine has loaded)."""
    import shutil

    repo = orca_server.model_repository
    name = "orca_fails_to_load"
    shutil.copytree(repo / "orca_tiny", repo / name)
    config = (repo / name / "config.pbtxt").read_text()
    config = re.sub(r'^name: "orca_tiny"$', f'name: "{name}"', config, flags=re.M)
    config = re.sub(r'key: "model" value: \{ string_value: "[^"]*" \}',
                    'key: "model" value: { string_value: "/nonexistent/checkpoint" }', config)
    (repo / name / "config.pbtxt").write_text(config)
    try:
        r = requests.post(f"{orca_server.http_url}/v2/repository/models/{name}/load", timeout=300,
                          headers=orca_server.admin_headers)
        assert r.status_code != 200 and "nonexistent" in r.text, r.text
        ours = [line for line in requests.get(orca_server.metrics_url, timeout=30).text.splitlines()
                if line.startswith(("orca_", "vllm:"))]  # (Triton's own nv_* series list every model)
        assert not [line for line in ours if f'model="{name}"' in line]
        assert any('model="orca_tiny"' in line for line in ours)  # the loaded models' series are there
    finally:
        shutil.rmtree(repo / name)
