"""orca_triton.generate: what a generate request means, checked without a server (the e2e tests cover the wire)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from _fixtures import FakeCodec, s

from orca import RequestOutput
from orca_triton.generate import GenerateRequest, parse_generate_request, response_tensors


def parse(inputs: dict, parameters: dict | None = None, has_tokenizer: bool = True) -> GenerateRequest:
    return parse_generate_request(inputs, parameters or {}, FakeCodec(), has_tokenizer)


def test_each_prompt_input() -> None:
    assert parse({"input_ids": np.array([1, 2], dtype=np.int32)}).prompt_token_ids == [1, 2]
    req = parse({"text_input": s("hi")})
    assert req.prompt_token_ids == [104, 105] and req.prompt_text == "hi"
    req = parse({"messages": s(json.dumps([{"role": "user", "content": "q"}]))})
    assert FakeCodec().decode(req.prompt_token_ids) == "<user>q<assistant>"
    assert req.prompt_text is None  # a chat answer is the completion alone


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({}, "no prompt"),
        ({"input_ids": np.array([1]), "text_input": s("x")}, "exactly one prompt input"),
        ({"input_ids": np.array([1.5])}, "input_ids must be integers"),
        ({"text_input": s("")}, "text_input is empty"),
        ({"text_input": np.array([b"\xff"], dtype=object)}, "not valid UTF-8"),
        ({"messages": s("{")}, "messages is not valid JSON"),
        ({"messages": s("[]")}, "non-empty JSON list"),
        ({"messages": s('[{"role": "user"}]')}, 'keys "role" and "content"'),
        ({"messages": s('[{"role": "robot", "content": "x"}]')},
         'role must be "system", "user", "assistant" or "tool", got "robot"'),
        ({"input_ids": np.array([1]), "stream": np.array([1])}, "stream must be a boolean"),
        ({"input_ids": np.array([1]), "sampling_parameters": s("[1]")}, "must be a JSON object"),
    ],
)
def test_invalid_requests_say_what_is_wrong(inputs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse(inputs)


USER = json.dumps([{"role": "user", "content": "q"}])


@pytest.mark.parametrize(
    ("inputs", "parameters", "name"),
    [
        ({"input_ids": np.array([1]), "sampling_parameters": s('{"max_tokens": ')}, {}, "sampling_parameters"),
        ({"input_ids": np.array([1]), "sampling_parameters": s("[" * 100_000)}, {}, "sampling_parameters"),
        ({"input_ids": np.array([1]), "sampling_parameters": s('{"seed": ' + "1" * 5000 + "}")}, {},
         "sampling_parameters"),
        ({"messages": s('[{"role": "user", "content": "q"')}, {}, "messages"),
        ({"messages": s("[" * 100_000)}, {}, "messages"),
        ({"messages": s(USER), "tools": s('[{"type": "function"')}, {}, "tools"),
        ({"messages": s(USER), "tools": s("[" * 100_000)}, {}, "tools"),
        ({"messages": s(json.dumps([{"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": '{"city": '}}]}]))}, {},
         r"messages[0].tool_calls[0].function.arguments"),
        ({"input_ids": np.array([1])}, {"stop": '["a", '}, "stop"),
        ({"input_ids": np.array([1])}, {"stop_token_ids": "[7, "}, "stop_token_ids"),
    ],
    ids=["sampling_parameters", "sampling_parameters-deep", "sampling_parameters-bigint", "messages",
         "messages-deep", "tools", "tools-deep", "tool_call-arguments", "stop-parameter", "stop_token_ids-parameter"],
)
def test_bad_json_in_an_input_is_a_value_error_naming_it(inputs: dict, parameters: dict, name: str) -> None:
    # orca_gpt answers these INVALID_ARG (model.py: a ValueError while parsing); Triton's HTTP /generate
    # reports that as a 400. (A body that is not JSON at all is Triton's own to parse: its 500.)
    with pytest.raises(ValueError, match=r"^" + re.escape(name) + r"\b.*(not valid JSON|nested too deeply|"
                       r"integer of more than)") as err:
        parse(inputs, parameters)
    assert type(err.value) is ValueError  # not JSONDecodeError's text or a RecursionError


def test_sampling_keys_from_json_and_request_parameters() -> None:
    req = parse({"input_ids": np.array([1]), "sampling_parameters": s('{"max_tokens": 5, "stop": ["a", "b"]}')})
    assert (req.params.max_tokens, req.params.temperature, req.params.stop) == (5, 1.0, ("a", "b"))
    assert parse({"input_ids": np.array([1])}, {"temperature": 0.5, "max_tokens": 3}).params.temperature == 0.5
    # Triton's HTTP parameters are scalars: one stop string, or a JSON list inside a string.
    assert parse({"input_ids": np.array([1])}, {"stop": "."}).params.stop == (".",)
    assert parse({"input_ids": np.array([1])}, {"stop": '[".", "!"]'}).params.stop == (".", "!")
    assert parse({"input_ids": np.array([1])}, {"stop_token_ids": "[7, 8]"}).params.stop_token_ids == (7, 8)
    with pytest.raises(ValueError, match="unknown request parameter"):
        parse({"input_ids": np.array([1])}, {"max_tokenz": 3})


def test_response_tensors_streaming_and_not() -> None:
    out = RequestOutput("r", new_token_ids=[9], token_ids=[8, 9], num_prompt_tokens=2, finished=True,
                       finish_reason="length", text_delta="b", text="ab")
    asked = {"return_finish_reason": np.array([True]), "return_num_output_tokens": np.array([True])}
    req = parse({"text_input": s("hi"), **asked})
    t = response_tensors(out, req, has_tokenizer=True)
    assert t["output_ids"].tolist() == [8, 9] and t["text_output"][0] == b"hiab"
    assert t["finish_reason"][0] == b"length" and t["num_output_tokens"].tolist() == [2]
    assert "finish_reason" not in response_tensors(out, parse({"text_input": s("hi")}), True)  # not asked
    streamed = response_tensors(out, parse({"text_input": s("hi"), "stream": np.array([True])}), True)
    assert streamed["output_ids"].tolist() == [9] and streamed["text_output"][0] == b"b"
    no_text = response_tensors(out, parse({"input_ids": np.array([1])}, has_tokenizer=False), False)
    assert "text_output" not in no_text


# -- prefix caching: the cache_salt input and the num_cached_tokens output ----------------------------
IDS = {"input_ids": np.array([1, 2], dtype=np.int32)}


def test_cache_salt_comes_as_an_input_or_a_request_parameter() -> None:
    assert parse(IDS).cache_salt is None
    assert parse({**IDS, "cache_salt": s("tenant-a")}).cache_salt == "tenant-a"
    assert parse({**IDS, "cache_salt": np.array(["tenant-ü"], dtype=object)}).cache_salt == "tenant-ü"
    # /generate's extra JSON keys are request parameters: the salt beside the sampling keys
    req = parse(IDS, {"cache_salt": "tenant-b", "max_tokens": 3})
    assert req.cache_salt == "tenant-b" and req.params.max_tokens == 3


@pytest.mark.parametrize(
    ("inputs", "parameters", "message"),
    [
        ({**IDS, "cache_salt": np.array([b"\xff"], dtype=object)}, {},
         "cache_salt is not valid UTF-8 (byte 0: invalid start byte); cache_salt must be a UTF-8 string of 1 to 1024"),
        ({**IDS, "cache_salt": np.array([3])}, {}, "cache_salt must be a string (BYTES, UTF-8), got int64"),
        ({**IDS, "cache_salt": np.array([b"a", b"b"], dtype=object)}, {}, "cache_salt must hold exactly one element"),
        (IDS, {"cache_salt": 7}, "cache_salt must be a UTF-8 string of 1 to 1024 characters, got integer"),
        (IDS, {"cache_salt": "\ud800"}, "cache_salt is not valid Unicode"),
        ({**IDS, "cache_salt": s("a")}, {"cache_salt": "b"}, "cache_salt is given twice"),
    ],
)
def test_a_bad_cache_salt_says_what_is_allowed(inputs: dict, parameters: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse(inputs, parameters)


def test_num_cached_tokens_is_on_the_final_response() -> None:
    running = RequestOutput("r", new_token_ids=[9], token_ids=[9], num_prompt_tokens=40, finished=False,
                           num_cached_tokens=32)
    final = running.replace(new_token_ids=[10], token_ids=[9, 10], finished=True, finish_reason="length")
    for stream in (False, True):
        req = parse({**IDS, "stream": np.array([stream])})
        assert "num_cached_tokens" not in response_tensors(running, req, has_tokenizer=False)
        tensor = response_tensors(final, req, has_tokenizer=False)["num_cached_tokens"]
        assert tensor.dtype == np.uint32 and tensor.tolist() == [32]
    cold = final.replace(num_cached_tokens=0)
    assert response_tensors(cold, parse(IDS), has_tokenizer=False)["num_cached_tokens"].tolist() == [0]


# -- tools: the tools input and tool messages -----------------------------------------------------------
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": CITY}}
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
]


def test_tools_and_tool_messages_reach_the_chat_template() -> None:
    codec = FakeCodec()
    parse_generate_request({"messages": s(json.dumps(TOOL_CHAT)), "tools": s(json.dumps([WEATHER]))}, {}, codec, True)
    messages, tools = codec.seen
    assert tools == [WEATHER]
    # the arguments' JSON text becomes an object: templates write it with tojson (as vLLM does)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[1]["content"] is None and messages[2] == TOOL_CHAT[2]
    # no tools (or an empty list): the codec is called as before, without them
    parse_generate_request({"messages": s(json.dumps(TOOL_CHAT)), "tools": s("[]")}, {}, codec, True)
    assert codec.seen[1] is None


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"text_input": s("x"), "tools": s(json.dumps([WEATHER]))}, "tools is only allowed with the messages input"),
        ({"tools": s("{}")}, "tools must be a JSON list"),
        ({"tools": s('[{"type": "function"}]')}, 'tools[0] must be an object {"type": "function"'),
        ({"tools": s('[{"type": "function", "function": {"name": "a b"}}]')},
         "tools[0].function.name must be 1 to 64 letters, digits, _ or -, got \"a b\""),
        ({"tools": s(json.dumps([WEATHER, WEATHER]))}, "tools[1].function.name: get_weather is given twice"),
        ({"tools": s('[{"type": "function", "function": {"name": "f", "parameters": []}}]')},
         "tools[0].function.parameters must be a JSON schema object, got array"),
        ({"messages": s('[{"role": "user", "content": null}]')}, "messages[0]: content must be a string, got null"),
        ({"messages": s('[{"role": "user", "content": "x", "tool_calls": []}]')},
         'messages[0]: tool_calls belong to an "assistant" message'),
        ({"messages": s('[{"role": "user", "content": "x", "tool_call_id": "1"}]')},
         'messages[0]: tool_call_id belongs to a "tool" message'),
        ({"messages": s('[{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]')},
         "messages[0].tool_calls[0].function.arguments is not valid JSON"),
        ({"messages": s('[{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]')},
         "messages[0].tool_calls[0].function.arguments must be a JSON object (or its JSON text), got array"),
        ({"messages": s('[{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]')},
         "messages[0].tool_calls[0].function.name must be a non-empty string"),
        ({"messages": s('[{"role": "assistant", "tool_calls": 3}]')}, "messages[0].tool_calls must be a list"),
        ({"messages": s('[{"role": "user", "content": "a", "weight": 1}]')},
         'messages[0] must be an object with exactly the keys "role" and "content" (and optionally "tool_calls", '
         '"tool_call_id", "name"), got "role", "content", "weight"'),
    ],
)
def test_bad_tools_and_tool_messages_say_what_is_wrong(inputs: dict, message: str) -> None:
    if "text_input" not in inputs:
        inputs = {"messages": s(json.dumps(TOOL_CHAT)), **inputs}
    with pytest.raises(ValueError, match=re.escape(message)):
        parse(inputs)
