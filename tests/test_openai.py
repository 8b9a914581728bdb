"""orca-openai (orca_openai/) with the official openai client, against the session's real tritonserver.

One orca-openai process per module (a subprocess, as `make serve` runs it) fronts the session's Triton
(tests/conftest.py) over gRPC, with an API key. Text comes from orca_gpt (SmolLM2 with its tokenizer and
chat template), with short requests: the host has two CPU cores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from _server import orca_openai
from test_server_e2e import metrics, wait_for

from orca_openai import protocol
from orca_openai.triton import Chunk, build_inputs, classify
from orca_server.server import free_ports

REPO_ROOT = Path(__file__).resolve().parent.parent
API_KEY = "sk-orca-test"
MODEL = "orca_gpt"
PARIS = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _health_status(url: str) -> int | None:
    """orca-openai's /health status, or None while nothing answers."""
    try:
        return requests.get(f"{url}/health", timeout=5).status_code
    except requests.RequestException:
        return None


@pytest.fixture(scope="module")
def api(orca_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """orca-openai's base URL (http://127.0.0.1:PORT), reporting cached_tokens (the prefix caching tests')."""
    log = tmp_path_factory.mktemp("openai") / "orca-openai.log"
    with orca_openai(orca_server, log, API_KEY, "--max-body-bytes", "100000", "--enable-prompt-tokens-details") as url:
        yield url


@pytest.fixture(scope="module")
def client(api: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api}/v1", api_key=API_KEY, max_retries=0, timeout=300)


# -- no server needed: request mapping, logprobs mapping, error statuses ------------------------------
def test_requests_map_to_orca_gpts_prompt_and_sampling_parameters() -> None:
    chat = protocol.chat_request({
        "model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                                   {"role": "user", "content": "Hi", "name": "x"}],
        "max_completion_tokens": 5, "max_tokens": 9, "temperature": 0, "stop": "\n", "seed": 3,
        "logprobs": True, "top_logprobs": 2, "stream": True, "stream_options": {"include_usage": True},
        "frequency_penalty": 0, "n": 1, "user": "u",
    })
    assert chat.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert chat.sampling == {"temperature": 0, "seed": 3, "max_tokens": 5, "stop": ["\n"]}
    assert (chat.stream, chat.include_usage, chat.logprobs) == (True, True, 2)
    comp = protocol.completion_request({"model": "m", "prompt": [[1, 2, 3]], "logprobs": 0, "top_k": 4})
    assert comp.prompt == [1, 2, 3] and comp.sampling == {"top_k": 4} and comp.logprobs == 0
    for body, match in [
        ({"model": "m", "prompt": "a", "n": 2}, "n must be 1"),
        ({"model": "m", "prompt": ["a", "b"]}, "one prompt per request"),
        ({"model": "m", "prompt": "a", "presence_penalty": 1}, "presence_penalty is not supported"),
        ({"model": "m", "prompt": "a", "bogus": 1}, "unrecognized request argument supplied: bogus"),
        ({"model": "m", "prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
        ({"model": "m", "prompt": "a", "stream_options": {"include_usage": True}}, "only allowed when stream"),
        ({"model": "m", "prompt": "a", "logprobs": 6}, r"logprobs must be an integer in \[0, 5\]"),
        ({"prompt": "a"}, "model must be"),
    ]:
        with pytest.raises(protocol.APIError, match=match) as err:
            protocol.completion_request(body)
        assert err.value.status == 400
    with pytest.raises(protocol.APIError, match="top_logprobs needs logprobs"):
        protocol.chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 1})


@pytest.mark.parametrize("prompt", ["", [], [""], [[]]])
def test_an_empty_prompt_is_a_400_naming_prompt(prompt: Any) -> None:
    # answered in the request's own terms before anything reaches orca_gpt (whose text_input is not the
    # client's word)
    with pytest.raises(protocol.APIError, match="prompt is empty.*give at least one character or token id") as err:
        protocol.completion_request({"model": "m", "prompt": prompt})
    assert (err.value.status, err.value.param) == (400, "prompt")
    with pytest.raises(protocol.APIError, match="prompt is required") as err:
        protocol.completion_request({"model": "m"})
    assert (err.value.status, err.value.param) == (400, "prompt")
    # what is not empty stays valid: a blank string is text, a token id 0 is a token
    assert protocol.completion_request({"model": "m", "prompt": " "}).prompt == " "
    assert protocol.completion_request({"model": "m", "prompt": [[0]]}).prompt == [0]


@pytest.mark.parametrize(("messages", "param", "match"), [
    ([{"role": "user", "content": ""}], "messages[0].content",
     r"messages\[0\].content is empty: a user message needs at least one character"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": ""}]}],
     "messages[1].content", r"messages\[1\].content is empty"),
    ([{"role": "user", "content": []}], "messages[0].content", r"messages\[0\].content is an empty list"),
    ([{"role": "user", "content": None}], "messages[0].content",
     r"messages\[0\].content must be a string or a list of text parts, got nothing"),
    ([{"role": "user", "content": 7}], "messages[0].content", "got an integer"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content",
     "only text parts"),
    ([{"role": "system", "content": ""}, {"role": "assistant", "content": None}], "messages",
     "every message's content is empty"),
])
def test_empty_chat_content_is_a_400_naming_the_message(messages: list, param: str, match: str) -> None:
    with pytest.raises(protocol.APIError, match=match) as err:
        protocol.chat_request({"model": "m", "messages": messages})
    assert (err.value.status, err.value.param) == (400, param)


def test_empty_content_stays_valid_where_openai_takes_it() -> None:
    # an empty system, assistant or tool message beside a user's text; an assistant's tool calls with null content
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    req = protocol.chat_request({"model": "m", "messages": [
        {"role": "system", "content": ""}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": ""}]})
    assert [m["content"] for m in req.prompt] == ["", "Hi", "", None, ""]


def test_bad_bodies_are_400s_before_triton_is_asked() -> None:
    # the ASGI app without its lifespan: it has no Triton connection, so a request that got that far
    # would be a 500; each of these is answered before
    from fastapi.testclient import TestClient

    from orca_openai.app import Settings, create_app

    app = TestClient(create_app(Settings()), raise_server_exceptions=False)
    for body, message in [(b"{not json", "not valid JSON"), (b"[" * 100_000, "nested too deeply"),
                          (b'{"prompt": ' + b"1" * 5000 + b"}", "could not be parsed as JSON"),
                          (b"\xff", "not valid JSON")]:
        r = app.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body[:20], r.text)
    r = app.post("/v1/completions", json={"model": MODEL, "prompt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = app.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": ""}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content", r.text
    for prompt in ([1, 4294967301], [2**70], [-1]):  # int32 on the way: 4294967301 would wrap to 5, 2**70 a 500
        r = app.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "token ids must be integers in [0, 2147483647]" in r.json()["error"]["message"]


def test_orca_gpts_logprobs_output_maps_to_openais_layouts() -> None:
    # vllm_backend's layout: per token {id: {logprob, rank, decoded_token}}, the drawn token among them
    chunk = Chunk(output_ids=[7, 9], text=" a b", final=True, logprobs=[
        {"7": {"logprob": -0.1, "rank": 1, "decoded_token": " a"}, "8": {"logprob": -2.5, "rank": 2,
                                                                         "decoded_token": " c"}},
        {"9": {"logprob": -3.0, "rank": 3, "decoded_token": " b"}, "1": {"logprob": -0.5, "rank": 1,
                                                                         "decoded_token": " d"},
         "2": {"logprob": float("-inf"), "rank": 2, "decoded_token": " e"}},
    ])
    chat = protocol.chat_logprobs(chunk, 2)["content"]
    assert [(t["token"], t["logprob"]) for t in chat] == [(" a", -0.1), (" b", -3.0)]
    assert [[(a["token"], a["logprob"]) for a in t["top_logprobs"]] for t in chat] == [
        [(" a", -0.1), (" c", -2.5)], [(" d", -0.5), (" e", -9999.0)]]
    assert chat[0]["bytes"] == list(b" a")
    comp = protocol.completion_logprobs(chunk, 1, offset=10)
    assert comp == {"tokens": [" a", " b"], "token_logprobs": [-0.1, -3.0], "top_logprobs": [{" a": -0.1},
                    {" d": -0.5}], "text_offset": [10, 12]}
    assert protocol.chat_logprobs(chunk, 0)["content"][1]["top_logprobs"] == []


def test_cache_salt_is_validated_and_sent_as_orca_gpts_input() -> None:
    comp = protocol.completion_request({"model": "m", "prompt": "a", "cache_salt": "tenant-a"})
    assert comp.cache_salt == "tenant-a" and "cache_salt" not in comp.sampling
    chat = protocol.chat_request({"model": "m", "messages": CHAT, "cache_salt": "tenant-b", "max_tokens": 3})
    assert chat.cache_salt == "tenant-b" and chat.sampling == {"max_tokens": 3}
    assert protocol.completion_request({"model": "m", "prompt": "a", "cache_salt": None}).cache_salt is None
    for salt, got in [("", "an empty string"), ("x" * 1025, "1025 characters"), (7, "an integer"),
                      (["a"], "an array"), ("\ud800", "not valid Unicode")]:
        for build, body in [(protocol.completion_request, {"prompt": "a"}),
                            (protocol.chat_request, {"messages": CHAT})]:
            with pytest.raises(protocol.APIError, match=r"cache_salt must be a string of 1 to 1024 characters, got .*"
                               + re.escape(got)) as err:
                build({"model": "m", **body, "cache_salt": salt})
            assert err.value.status == 400 and err.value.param == "cache_salt"
    sent = {i.name(): i for i in build_inputs("a", {"max_tokens": 2}, cache_salt="tenant-a")}
    assert sent["cache_salt"].datatype() == "BYTES" and sent["cache_salt"].shape() == [1]
    assert sent["cache_salt"]._get_content() == b"\x08\x00\x00\x00tenant-a"  # tritonclient's BYTES: length, bytes
    assert b"cache_salt" not in sent["sampling_parameters"]._get_content()  # not a sampling key
    assert "cache_salt" not in {i.name() for i in build_inputs("a", {"max_tokens": 2})}


def test_usage_reports_cached_prompt_tokens_as_openai_does() -> None:
    first = Chunk([7], None, False, num_input_tokens=40, num_output_tokens=1)
    final = Chunk([8], None, True, num_input_tokens=40, num_output_tokens=1, num_cached_tokens=32)
    # num_output_tokens is each response's own count (vllm_backend's): the completion is their sum
    assert protocol.chunk_usage([first, final], details=True) == {
        "prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42, "prompt_tokens_details": {"cached_tokens": 32}}
    # without --enable-prompt-tokens-details: no cached_tokens (a caller would learn of others' prompts)
    assert protocol.chunk_usage([first, final]) == {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42}
    # a model without the num_cached_tokens output: no details rather than a made-up 0
    older = Chunk([7, 8], None, True, num_input_tokens=40, num_output_tokens=2)
    assert protocol.chunk_usage([older], details=True) == {"prompt_tokens": 40, "completion_tokens": 2,
                                                           "total_tokens": 42}


def test_error_messages_map_to_http_statuses() -> None:
    assert classify("the waiting queue is full (2 requests): retry later").status == 429
    assert classify("the engine failed: worker 1 died").status == 503
    assert classify("the engine has failed and serves no more requests: x").status == 503
    assert classify("Request for unknown model: 'orca_gpt' is not found").status == 503
    assert classify("internal error: KeyError: 3").status == 500
    assert classify("generation failed: boom").status == 500
    assert classify("top_p must be in (0, 1], got 1.5").status == 400


# -- models, health, metrics, auth, limits ------------------------------------------------------------
def test_models_lists_the_orca_models_only(client: openai.OpenAI) -> None:
    ids = {m.id for m in client.models.list()}
    assert {"orca_gpt", "orca_tiny"} <= ids
    assert "request_level_gpt" not in ids  # not decoupled: not an orca model
    assert client.models.retrieve("orca_gpt").id == "orca_gpt"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no_such_model")


def test_health_and_metrics_pass_through(api: str) -> None:
    r = requests.get(f"{api}/health", timeout=10)
    assert r.status_code == 200 and r.text == "ready"
    metrics = requests.get(f"{api}/metrics", timeout=10)
    assert metrics.status_code == 200 and 'orca_running_requests{model="orca_gpt"' in metrics.text


def test_api_key_is_required_on_v1(api: str) -> None:
    no_key = requests.get(f"{api}/v1/models", timeout=10)
    assert no_key.status_code == 401
    assert set(no_key.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{api}/v1", api_key="wrong", max_retries=0).models.list()
    ok = requests.get(f"{api}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert ok.status_code == 200 and ok.json()["object"] == "list"


def test_a_body_over_the_limit_is_refused(api: str) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = requests.post(f"{api}/v1/completions", headers=headers, timeout=10,
                      json={"model": MODEL, "prompt": "x" * 200_000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    bad_json = requests.post(f"{api}/v1/completions", headers={**headers, "Content-Type": "application/json"},
                             data=b"{not json", timeout=10)
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]


# -- text -------------------------------------------------------------------------------------------
def test_completion_streamed_deltas_concatenate_to_the_non_streamed_text(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=12, temperature=0)
    choice = full.choices[0]
    assert full.object == "text_completion" and "Paris" in choice.text
    assert not choice.text.startswith(PARIS)  # the completion only
    assert choice.finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens == 5
    assert full.usage.total_tokens == 17
    chunks = list(client.completions.create(model=MODEL, prompt=PARIS, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streamed_deltas_concatenate_to_the_non_streamed_message(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=12, temperature=0)
    message = full.choices[0].message
    assert full.object == "chat.completion" and message.role == "assistant" and "Paris" in message.content
    assert full.usage.completion_tokens <= 12 and full.usage.prompt_tokens > 10  # the chat template's tokens
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    # The same counts; the second request may have found the first one's prompt in the prefix cache.
    exclude = {"prompt_tokens_details"}
    assert chunks[-1].usage.model_dump(exclude=exclude) == full.usage.model_dump(exclude=exclude)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= full.usage.prompt_tokens_details.cached_tokens


def test_stop_strings_end_with_finish_reason_stop(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=12, temperature=0, stop=".")
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text.strip() == "Paris"
    listed = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=12, temperature=0, stop=["x", "."])
    assert listed.choices[0].text == out.choices[0].text and listed.choices[0].finish_reason == "stop"


def test_seed_reproduces_a_sampled_completion(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0,
                                        top_p=0.95, seed=seed)
        return out.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3))


def test_token_id_prompt_and_echo(client: openai.OpenAI) -> None:
    ids = client.completions.create(model=MODEL, prompt=[504, 3575, 282], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 4
    echoed = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=4, temperature=0)
    assert echoed.choices[0].text == PARIS + plain.choices[0].text


# -- prefix caching ---------------------------------------------------------------------------------
TUTOR = [{"role": "system", "content": "You are a patient geography tutor. Answer in one short sentence and name "
                                       "the city only once, without any further explanation."},
         {"role": "user", "content": "What is the capital of France?"}]


def test_chat_reports_the_cached_prompt_tokens_in_usage(client: openai.OpenAI) -> None:
    salt = {"cache_salt": "openai-chat"}  # no other test sends it: the first request finds nothing cached
    ask = {"model": MODEL, "messages": TUTOR, "max_completion_tokens": 8, "temperature": 0}
    first = client.chat.completions.create(**ask, extra_body=salt)
    prompt = first.usage.prompt_tokens
    assert prompt > 32 and first.usage.prompt_tokens_details.cached_tokens == 0
    cached = 16 * ((prompt - 1) // 16)  # every full block but the one holding the last prompt token
    again = client.chat.completions.create(**ask, extra_body=salt)
    assert again.usage.prompt_tokens_details.cached_tokens == cached
    assert again.choices[0].message.content == first.choices[0].message.content  # the same greedy answer
    assert again.usage.prompt_tokens == prompt
    chunks = list(client.chat.completions.create(**ask, extra_body=salt, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == first.choices[0].message.content
    other = client.chat.completions.create(**ask, extra_body={"cache_salt": "openai-chat-other"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # another salt shares nothing
    assert other.choices[0].message.content == first.choices[0].message.content


def test_completions_report_the_cached_prompt_tokens_in_usage(client: openai.OpenAI) -> None:
    model, prompt = "orca_tiny", [(53 * i + 7) % 200 + 1 for i in range(40)]  # 2 full blocks and 8 tokens more
    ask = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    first = client.completions.create(**ask, extra_body={"cache_salt": "openai-completions"})
    assert first.usage.prompt_tokens == 40 and first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(**ask, extra_body={"cache_salt": "openai-completions"})
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    streamed = list(client.completions.create(**ask, extra_body={"cache_salt": "openai-completions"}, stream=True,
                                              stream_options={"include_usage": True}))
    assert streamed[-1].choices == [] and streamed[-1].usage.prompt_tokens_details.cached_tokens == 32
    assert all(c.usage is None for c in streamed[:-1])
    unsalted = client.completions.create(**ask)
    assert unsalted.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_cache_salt_is_a_400_naming_it(client: openai.OpenAI, stream: bool) -> None:
    for salt in ("", "x" * 1025, 7):
        with pytest.raises(openai.BadRequestError, match="cache_salt must be a string of 1 to 1024 characters") as err:
            client.completions.create(model=MODEL, prompt=PARIS, max_tokens=2, stream=stream,
                                      extra_body={"cache_salt": salt})
        assert err.value.status_code == 400 and err.value.param == "cache_salt"


# -- errors -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_bad_inputs_get_openai_errors(client: openai.OpenAI, stream: bool) -> None:
    with pytest.raises(openai.BadRequestError, match="temperature must be >= 0") as err:
        client.completions.create(model=MODEL, prompt=PARIS, max_tokens=4, temperature=-1, stream=stream)
    assert err.value.status_code == 400 and err.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 1"):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=0, stream=stream)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, top_p=1.5, stream=stream)
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no_such_model", prompt=PARIS, max_tokens=4, stream=stream)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.completions.create(model=MODEL, prompt=PARIS, max_tokens=4, n=2, stream=stream)
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, frequency_penalty=0.5)
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "function", "content": "x", "name": "f"}])
    with pytest.raises(openai.BadRequestError, match="no tokenizer"):  # orca_gpt's INVALID_ARG, passed through
        client.completions.create(model="orca_tiny", prompt="text", max_tokens=4, stream=stream)


def test_logprobs_are_mapped_or_refused_by_the_models_config(client: openai.OpenAI, orca_server: Any) -> None:
    import tritonclient.grpc as grpcclient

    config = grpcclient.InferenceServerClient(orca_server.grpc_url).get_model_config(MODEL, as_json=True)["config"]
    has_logprobs = "logprobs" in {o["name"] for o in config["output"]}
    if not has_logprobs:
        with pytest.raises(openai.BadRequestError, match="not supported by this model"):
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, logprobs=True, top_logprobs=2)
        with pytest.raises(openai.BadRequestError, match="not supported by this model"):
            client.completions.create(model=MODEL, prompt=PARIS, max_tokens=4, logprobs=2)
        return
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy
    comp = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=4, temperature=0, logprobs=1)
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text and len(lp.token_logprobs) == 4
    assert all(len(top) == 1 for top in lp.top_logprobs)
    streamed = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=4, temperature=0, logprobs=1,
                                         stream=True)
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


# -- cancellation -----------------------------------------------------------------------------------
def test_closing_a_stream_cancels_the_request_and_frees_its_kv_blocks(
    client: openai.OpenAI, orca_server: Any
) -> None:
    key = 'orca_requests_finished_total{reason="cancelled"}'
    before = metrics(orca_server, MODEL).get(key, 0)
    stream = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].text)
        if received == 3:
            break
    assert received == 3
    assert metrics(orca_server, MODEL)["orca_running_requests"] >= 1
    stream.close()
    wait_for(lambda: metrics(orca_server, MODEL).get(key, 0) == before + 1, "the cancellation")
    wait_for(lambda: metrics(orca_server, MODEL)["orca_kv_allocated_blocks"] == 0, "the K/V blocks freed")
    m = metrics(orca_server, MODEL)
    assert m["orca_running_requests"] == 0 and m["orca_waiting_requests"] == 0


def test_hanging_up_on_a_non_streaming_request_cancels_it(api: str, orca_server: Any) -> None:
    key = 'orca_requests_finished_total{reason="cancelled"}'
    before = metrics(orca_server, MODEL).get(key, 0)
    with pytest.raises(requests.Timeout):  # the client gives up (and closes the connection) after 2 s
        requests.post(f"{api}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=2,
                      json={"model": MODEL, "prompt": PARIS, "max_tokens": 400, "ignore_eos": True})
    wait_for(lambda: metrics(orca_server, MODEL).get(key, 0) == before + 1, "the cancellation")
    wait_for(lambda: metrics(orca_server, MODEL)["orca_kv_allocated_blocks"] == 0, "the K/V blocks freed")


def test_a_full_waiting_queue_answers_429(client: openai.OpenAI, orca_server: Any) -> None:
    model = "orca_tiny_q"  # max_bs 1, max_queue 2, no tokenizer: token-id prompts, empty text
    running = client.completions.create(model=model, prompt=[1, 2], max_tokens=2000, stream=True,
                                        extra_body={"ignore_eos": True})
    next(iter(running))  # admitted; max_bs 1 keeps every later request waiting behind it
    threads = [threading.Thread(target=client.completions.create,
                                kwargs={"model": model, "prompt": [3], "max_tokens": 2}) for _ in range(2)]
    for t in threads:
        t.start()
    wait_for(lambda: metrics(orca_server, model).get("orca_waiting_requests") == 2, "two waiting")
    with pytest.raises(openai.RateLimitError, match="the waiting queue is full") as err:
        client.completions.create(model=model, prompt=[4], max_tokens=2)
    assert err.value.status_code == 429 and err.value.code == "queue_full"
    running.close()  # cancel the long one: the waiting ones then run to completion
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive()
    wait_for(lambda: metrics(orca_server, model)["orca_running_requests"] == 0, "idle")


# -- the launcher -----------------------------------------------------------------------------------
def test_make_serve_starts_orca_openai_beside_triton(tmp_path: Path) -> None:
    """`make serve`'s command line (launcher) starts orca-openai on --openai-port; SIGINT stops both."""
    repo = tmp_path / "repo"
    (repo / "smoke" / "1").mkdir(parents=True)
    smoke = REPO_ROOT / "tests" / "smoke_model"
    (repo / "smoke" / "config.pbtxt").write_text((smoke / "config.pbtxt").read_text())
    (repo / "smoke" / "1" / "model.py").write_text((smoke / "model.py").read_text())
    http, grpc_port, metrics, port = free_ports(4)
    dry = subprocess.run(
        ["make", "-s", "-o", "venv", "serve", f"MODEL_REPOSITORY={repo}", f"HTTP_PORT={http}", f"GRPC_PORT={grpc_port}",
         f"METRICS_PORT={metrics}", f"OPENAI_PORT={port}", "SERVE_ARGS=--dry-run --address 127.0.0.1"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert dry.returncode == 0, dry.stderr
    assert f"-m orca_openai --host 127.0.0.1 --port {port} --triton-url 127.0.0.1:{grpc_port}" in dry.stdout
    off = subprocess.run(
        [sys.executable, "-m", "orca_server.launcher", "--model-repository", str(repo), "--dry-run", "--no-openai"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, "ORCA_OPENAI_PORT": "0"},
    )
    assert off.returncode == 0 and "orca_openai" not in off.stdout
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orca_server.launcher", "--model-repository", str(repo), "--address", "127.0.0.1",
             "--http-port", str(http), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics),
             "--openai-port", str(port), "--backend-dir", str(tmp_path / "backends")],
            cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        def listed() -> bool:
            try:
                r = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)
            except requests.RequestException:
                return False
            return r.status_code == 200

        wait_for(listed, f"orca-openai on :{port}\n{log.read_text()}", timeout=120)
        # the smoke model is not an orca model: served by Triton, not listed, and /health says so
        assert json.loads(requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).text)["data"] == []
        health = requests.get(f"http://127.0.0.1:{port}/health", timeout=5)
        assert health.status_code == 503 and "no orca model" in health.text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("signals", [(signal.SIGINT,), (signal.SIGINT, signal.SIGINT), (signal.SIGTERM,),
                                     (signal.SIGINT, signal.SIGTERM)], ids=["int", "int-int", "term", "int-term"])
def test_orca_openai_stops_quietly_on_sigint_and_sigterm(tmp_path: Path, signals: tuple[int, ...]) -> None:
    """Ctrl-C under `make serve` reaches orca-openai twice (the terminal's process group, then the launcher's
    forward): any mix of SIGINT/SIGTERM is one graceful stop, exit status 0, and no traceback on stderr."""
    (port,) = free_ports(1)
    err = tmp_path / "stderr.log"
    with open(err, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orca_openai", "--host", "127.0.0.1", "--port", str(port),
             "--triton-url", "127.0.0.1:1"],  # nothing there: /health answers 503, the server runs all the same
            cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
        )
    try:
        wait_for(lambda: _health_status(f"http://127.0.0.1:{port}") == 503, f"orca-openai on :{port}", timeout=60)
        for sig in signals:
            proc.send_signal(sig)
            time.sleep(0.05)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = err.read_text()
    assert "Traceback" not in log and "CancelledError" not in log and "KeyboardInterrupt" not in log, log
    assert "Application shutdown complete" in log


def test_serve_bench_hops_time_each_endpoint_beside_the_iterations(orca_server: Any, api: str) -> None:
    """orca-bench serve's batch-1 view (client/orca_client/bench/serve.py measure_hops), on the real server:
    one request at a time through Triton's HTTP generate_stream, its gRPC stream and orca-openai's events,
    each with every token's arrival, and the model's share from Triton's orca_iteration_seconds."""
    from orca_client.bench.serve import HOPS, Running, measure_hops

    server = Running(api, "orca_tiny", None, orca_server.http_url, orca_server.grpc_url, orca_server.metrics_url,
                     api_key=API_KEY)
    for stamps_of in HOPS.values():
        stamps = stamps_of(server, [5, 6, 7], 6)
        assert len(stamps) == 6 and stamps == sorted(stamps)
    hops = measure_hops(server, prompt_tokens=8, output_tokens=6, repeats=1)
    assert set(hops) == {"http_generate_stream", "grpc_stream", "openai_sse"}
    for figures in hops.values():
        assert figures["itl_ms_p90"] >= figures["itl_ms_median"] > 0
        assert figures["iteration_ms_mean"] > 0


def test_triton_unreachable_is_503_not_500(tmp_path: Path) -> None:
    """orca-openai before Triton is up (or after it died): an OpenAI error object with 503, never a 500."""
    port, dead = free_ports(2)
    log = tmp_path / "orca-openai.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "orca_openai", "--host", "127.0.0.1", "--port", str(port),
                                 "--triton-url", f"127.0.0.1:{dead}"], stdout=out, stderr=subprocess.STDOUT,
                                cwd=REPO_ROOT)
    try:
        wait_for(lambda: _health_status(f"http://127.0.0.1:{port}") == 503,
                 f"orca-openai on :{port}\n{log.read_text()}", timeout=120)
        for path, body in (("/v1/chat/completions", {"model": MODEL, "messages": CHAT}),
                           ("/v1/completions", {"model": MODEL, "prompt": PARIS}), ("/v1/models", None)):
            r = (requests.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=30) if body
                 else requests.get(f"http://127.0.0.1:{port}{path}", timeout=30))
            assert r.status_code == 503, (path, r.text)
            assert "unreachable" in r.json()["error"]["message"]
        assert "Traceback" not in log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
