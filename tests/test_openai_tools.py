"""Structured outputs and tool calls through orca-openai (orca_openai/protocol.py, orca_openai/tools.py).

The first part needs no server: the request mapping (response_format, structured_outputs, guided_*,
tools, tool_choice, tool messages), the grammars of tool_choice "required" and a named function, the three
parsers of tool_choice "auto" (whole and streamed, markers split across chunks) and the Hermes rendering of
tools for chat templates without them (SmolLM2's, with its real tokenizer). The second part runs the
official openai client against the session's tritonserver through an orca-openai subprocess (the fixtures
of tests/test_openai.py), with short requests: the host has two CPU cores, and the default model is tiny,
so what is tested is grammar-enforced output (tool_choice required or named), not whether it calls a
tool on its own.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
import requests
import test_openai
from test_openai import API_KEY, MODEL

from orca_openai import protocol
from orca_openai.app import _events, _full_response
from orca_openai.tools import AutoParser, NamedParser, RequiredParser, parse_all
from orca_openai.triton import Chunk, build_inputs

api, client = test_openai.api, test_openai.client  # the fixtures: this module's orca-openai and openai client

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat(**body: Any) -> protocol.Request:
    return protocol.chat_request({"model": "m", "messages": ASK, **body})


def refused(build: Any, body: dict[str, Any], param: str, match: str) -> None:
    with pytest.raises(protocol.APIError, match=match) as err:
        build({"model": "m", **body})
    assert err.value.status == 400 and err.value.param == param, (err.value.param, err.value.message)


# -- request mapping -----------------------------------------------------------------------------------
def test_response_format_and_vllms_fields_map_to_structured_outputs() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    assert chat(response_format=rf).sampling["structured_outputs"] == {"json": schema}
    assert chat(response_format={"type": "json_object"}).sampling["structured_outputs"] == {"json_object": True}
    assert "structured_outputs" not in chat(response_format={"type": "text"}).sampling
    comp = protocol.completion_request({"model": "m", "prompt": "x", "response_format": rf, "max_tokens": 3})
    assert comp.sampling == {"max_tokens": 3, "structured_outputs": {"json": schema}}
    for body, expected in [
        ({"structured_outputs": {"regex": "[ab]+", "disable_any_whitespace": True}},
         {"regex": "[ab]+", "disable_any_whitespace": True}),
        ({"structured_outputs": {"json": json.dumps(schema)}}, {"json": json.dumps(schema)}),
        ({"guided_json": schema, "guided_decoding_backend": "xgrammar"}, {"json": schema}),
        ({"guided_regex": r"\d+"}, {"regex": r"\d+"}),
        ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
        ({"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
    ]:
        assert chat(**body).sampling["structured_outputs"] == expected
        assert protocol.completion_request({"model": "m", "prompt": "x", **body}).sampling["structured_outputs"] \
            == expected
    # sent inside orca_gpt's sampling_parameters, like every other sampling key
    sent = {i.name(): i for i in build_inputs("x", chat(guided_choice=["yes", "no"]).sampling)}
    assert b'"structured_outputs": {"choice": ["yes", "no"]}' in sent["sampling_parameters"]._get_content()


@pytest.mark.parametrize(("body", "param", "match"), [
    ({"response_format": {"type": "xml"}}, "response_format.type",
     r'response_format.type must be "text", "json_object" or "json_schema", got "xml"'),
    ({"response_format": "json"}, "response_format.type", "response_format.type must be"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "response_format.json_schema must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format.json_schema.schema",
     r"response_format.json_schema.schema must be an object \(a JSON schema\), got nothing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": []}}},
     "response_format.json_schema.schema", "response_format.json_schema.schema must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name",
     "response_format.json_schema.name must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict", "strict must be a boolean"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs",
     "structured_outputs must hold exactly one of json, json_object, regex, choice, grammar, got json, regex"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structured_outputs.structural_tag is not"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "must be a non-empty list of strings"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object", "json_object must be true"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "its text is not a JSON object"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": 1}}, "structured_outputs",
     "disable_any_whitespace must be a boolean"),
    ({"guided_regex": 5}, "guided_regex", "guided_regex must be a non-empty string"),
    ({"guided_choice": "yes"}, "guided_choice", "guided_choice must be a non-empty list of strings"),
    ({"guided_json": 3}, "guided_json", "guided_json must be a JSON schema"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend",
     'guided_decoding_backend must be "xgrammar" or "auto"'),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "give at most one output constraint .*got response_format and guided_regex"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice", "at most one output constraint"),
])
def test_bad_output_constraints_are_400s_naming_the_param(body: dict[str, Any], param: str, match: str) -> None:
    refused(protocol.chat_request, {"messages": ASK, **body}, param, match)
    refused(protocol.completion_request, {"prompt": "x", **body}, param, match)


def test_tools_and_tool_choice_map_to_the_request_and_its_grammar() -> None:
    auto = chat(tools=TOOLS)
    assert auto.tool_choice == "auto" and "structured_outputs" not in auto.sampling
    assert auto.tools == TOOLS and isinstance(auto.tool_parser(), AutoParser)
    assert chat(tools=TOOLS, tool_choice="none").tool_parser() is None  # rendered, not parsed
    assert chat().tool_parser() is None and chat(tool_choice="auto").tools == []
    required = chat(tools=TOOLS, tool_choice="required")
    schema = required.sampling["structured_outputs"]["json"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == CITY
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}},
                         {"name": "get_time", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    one = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert one.sampling["structured_outputs"]["json"]["maxItems"] == 1
    assert isinstance(required.tool_parser(), RequiredParser)
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.sampling["structured_outputs"] == {"json": CITY} and isinstance(named.tool_parser(), NamedParser)
    bare = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert bare.sampling["structured_outputs"] == {"json": {"type": "object"}}
    # the tools input: OpenAI's tool objects, only the keys a template reads
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    sent = {i.name(): i for i in build_inputs(ASK, {}, tools=chat(tools=[strict]).tools)}
    assert json.loads(sent["tools"]._get_content()[4:]) == [WEATHER]
    assert "tools" not in {i.name() for i in build_inputs(ASK, {}, tools=[])}


def test_tool_messages_map_to_orca_gpts_messages() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    req = protocol.chat_request({"model": "m", "tools": TOOLS, "messages": [
        *ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "21 C"}]},
        {"role": "assistant", "content": None}]})
    assert req.prompt[1:] == [{"role": "assistant", "content": None, "tool_calls": [call]},
                              {"role": "tool", "content": "21 C", "tool_call_id": "call_1"},
                              {"role": "assistant", "content": ""}]


@pytest.mark.parametrize(("body", "param", "match"), [
    ({"tools": {"a": 1}}, "tools", "tools must be a list"),
    ({"tools": [WEATHER, "x"]}, "tools[1]", r"tools\[1\] must be an object"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type", r'tools\[0\].type must be "function"'),
    ({"tools": [{"type": "function"}]}, "tools[0].function", r"tools\[0\].function must be an object"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "get weather"}}]}, "tools[1].function.name",
     r'tools\[1\].function.name must be 1 to 64 letters, digits, _ or -, got "get weather"'),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "n" * 65}}]}, "tools[1].function.name",
     "must be 1 to 64"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "get_weather is given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters",
     r"tools\[0\].function.parameters must be an object \(a JSON schema\), got str"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
     "tools[0].function.description", "must be a string"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", 'tool_choice must be "none", "auto", "required"'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name",
     r'tool_choice.function.name "nope" names no tool in tools \(given: get_time, get_weather\)'),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice.function.name",
     "names no tool in tools"),
    ({"tool_choice": "required"}, "tool_choice", 'tool_choice "required" needs tools'),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools"}}, "tool_choice", "tool_choice must be"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "parallel_tool_calls must be a boolean"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     'at most one output constraint .*got tool_choice "required" and response_format'),
    ({"functions": [{"name": "f"}]}, "functions", "deprecated function calling"),
    ({"function_call": "auto"}, "function_call", "use tools and tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", r"messages\[0\].tool_call_id must be a string"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}, "messages",
     "only assistant messages carry tool calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f",
                                                                                          "arguments": "{x"}}]}]},
     "messages", r"messages\[0\].tool_calls\[0\].function.arguments must be the JSON text of an object"),
    ({"messages": [{"role": "assistant", "content": "x", "function_call": {"name": "f"}}]}, "messages",
     "function_call .* use tool_calls"),
])
def test_bad_tools_are_400s_naming_the_param(body: dict[str, Any], param: str, match: str) -> None:
    refused(protocol.chat_request, {"messages": ASK, **body}, param, match)


def test_completions_take_no_tools() -> None:
    refused(protocol.completion_request, {"prompt": "x", "tools": TOOLS}, "tools", "unrecognized request argument")


# -- parsers ---------------------------------------------------------------------------------------------
def streamed(parser: Any, text: str, size: int) -> tuple[str, list[dict[str, Any]]]:
    """The content and the assembled calls when the text comes `size` characters at a time."""
    deltas = [parser.feed(text[i:i + size]) for i in range(0, len(text), size)] + [parser.finish()]
    calls: dict[int, dict[str, Any]] = {}
    for entry in (e for d in deltas for e in d.calls):
        call = calls.setdefault(entry["index"], {"name": "", "arguments": ""})
        if "id" in entry:
            assert entry["id"].startswith("call_") and entry["type"] == "function"
            assert call["name"] == "" and entry["function"]["arguments"] == ""  # the header comes first
        call["name"] += entry["function"].get("name", "")
        call["arguments"] += entry["function"]["arguments"]
    return "".join(d.content for d in deltas), [calls[i] for i in sorted(calls)]


PARIS = {"city": "Paris", "unit": "celsius"}
PARIS_CALL = {"name": "get_weather", "arguments": PARIS}
TEXTS = {  # parser -> (text, content, calls)
    "hermes": ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
               "Let me check. ", [PARIS_CALL, {"name": "get_time", "arguments": {}}]),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {}}]', "", [PARIS_CALL, {"name": "get_time", "arguments": {}}]),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_time", "parameters": {}}', "", [PARIS_CALL, {"name": "get_time", "arguments": {}}]),
}
MORE = [  # (parser, text, content, calls)
    ("mistral", '  [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', "", [PARIS_CALL]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', "", [PARIS_CALL]),
    ("llama3_json", '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}', "", [PARIS_CALL]),
    # bare JSON naming no given tool, or not a call: content, unchanged
    ("llama3_json", '{"name": "search", "parameters": {"q": "x"}}', '{"name": "search", "parameters": {"q": "x"}}', []),
    ("mistral", "[1, 2, 3]", "[1, 2, 3]", []),
    ("hermes", "a <tool_call>not json</tool_call> b", "a <tool_call>not json</tool_call> b", []),
    ("hermes", "Just text, with a < sign and <tool_ but no call.", "Just text, with a < sign and <tool_ but no call.",
     []),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}', "", [{"name": "get_time", "arguments": {}}]),
    ("hermes", '[{"name": "get_time", "arguments": {}}]', '[{"name": "get_time", "arguments": {}}]', []),  # not its
    ("llama3_json", "<tool_call>x", "<tool_call>x", []),
]


def _cases() -> list[tuple[str, str, str, list[dict[str, Any]]]]:
    cases = [(name, *case) for name, case in TEXTS.items()] + MORE
    cases += [("auto", text, content, calls) for _, text, content, calls in cases if not (
        text.startswith("[1") or "<tool_call>x" in text or text.startswith("[{") and "get_time" in text[:20])]
    return cases


@pytest.mark.parametrize(("parser", "text", "content", "calls"), _cases())
def test_parsers_find_the_calls_whole_and_streamed(parser: str, text: str, content: str, calls: list) -> None:
    expected = [{"name": c["name"], "arguments": c["arguments"]} for c in calls]
    got_content, got = parse_all(AutoParser(parser, TOOLS), text)
    assert got_content == content
    assert [{"name": c.name, "arguments": json.loads(c.arguments)} for c in got] == expected
    for size in (1, 2, 5, 13):  # every marker split across chunks somewhere
        got_content, got_calls = streamed(AutoParser(parser, TOOLS), text, size)
        assert got_content == content
        assert [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in got_calls] == expected


def test_streamed_content_is_held_only_while_it_may_start_a_marker() -> None:
    parser = AutoParser("hermes", TOOLS)
    assert parser.feed("The answer <").content == "The answer "
    assert parser.feed("tool").content == ""
    assert parser.feed("box> is").content == "<toolbox> is"
    assert parser.feed(" here. <tool_call>").content == " here. "
    assert not parser.feed('{"name": "get_time", "arguments": {}}')
    delta = parser.feed("</tool_call>")
    assert [e["function"] for e in delta.calls] == [{"name": "get_time", "arguments": ""}, {"arguments": "{}"}]
    one = AutoParser("auto", TOOLS, parallel=False)  # parallel_tool_calls false: the first call only
    assert [c.name for c in parse_all(one, TEXTS["hermes"][0])[1]] == ["get_weather"]


def test_grammar_enforced_output_parses_as_it_streams() -> None:
    text = ('[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, {"name": "get_time", '
            '"parameters": {"note": "a } and \\" inside"}}]')
    for size in (1, 3, 200):
        content, calls = streamed(RequiredParser(), text, size)
        assert content == "" and [c["name"] for c in calls] == ["get_weather", "get_time"]
        assert json.loads(calls[1]["arguments"]) == {"note": 'a } and " inside'}
    parser = RequiredParser()
    first = parser.feed(text[:78])  # the first object is complete: handed out before the array ends
    assert [e["function"].get("name") for e in first.calls] == ["get_weather", None]
    assert parse_all(RequiredParser(), '[{"name": "get_wea') == ('[{"name": "get_wea', [])  # cut short: content
    content, calls = streamed(NamedParser("get_weather"), '{"city": "Rome", "unit": "celsius"}', 4)
    assert content == "" and calls == [{"name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}]


# -- responses from orca_gpt's text, without a server ---------------------------------------------------
def test_responses_carry_the_calls_and_finish_reason_tool_calls() -> None:
    req = chat(tools=TOOLS)
    chunks = [Chunk([1], 'Sure. <tool_call>{"name": "get_time", ', False),
              Chunk([2], '"arguments": {}}</tool_call>', True, finish_reason="stop", num_input_tokens=5,
                    num_output_tokens=2)]
    full = _full_response(req, True, "id", 0, chunks, req.tool_parser())
    message = full["choices"][0]["message"]
    assert full["choices"][0]["finish_reason"] == "tool_calls" and message["content"] == "Sure. "
    assert [(c["type"], c["function"]) for c in message["tool_calls"]] == [
        ("function", {"name": "get_time", "arguments": "{}"})]
    plain = _full_response(req, True, "id", 0, [Chunk([1], "No call.", True, finish_reason="stop")], req.tool_parser())
    assert plain["choices"][0] == {"index": 0, "finish_reason": "stop", "logprobs": None,
                                   "message": {"role": "assistant", "content": "No call.", "refusal": None}}
    cut = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    cut_off = _full_response(cut, True, "id", 0, [Chunk([1], '{"city": "Pa', True, finish_reason="length")],
                             cut.tool_parser())
    assert cut_off["choices"][0]["finish_reason"] == "length"  # the arguments may be cut: said so

    async def run() -> list[dict[str, Any]]:
        async def rest() -> Any:
            yield chunks[1]

        events = [e async for e in _events(req, True, "id", 0, chunks[0], rest(), req.tool_parser())]
        assert events[-1] == b"data: [DONE]\n\n"
        return [json.loads(e[6:]) for e in events[:-1]]

    import asyncio

    events = asyncio.run(run())
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": "Sure. "}
    assert [d["tool_calls"][0]["function"] for d in deltas[2:]] == [{"name": "get_time", "arguments": ""},
                                                                     {"arguments": "{}"}]
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, None, "tool_calls"]


# -- rendering tools for a chat template that knows none (SmolLM2's) ----------------------------------------
@pytest.fixture(scope="module")
def smol() -> Any:
    from orca.checkpoint import load_tokenizer, resolve_checkpoint
    from orca.frontend.tokenizer import Tokenizer

    return Tokenizer(load_tokenizer(resolve_checkpoint(None)), "SmolLM2")


def test_tools_render_in_hermes_format_when_the_template_knows_none(smol: Any) -> None:
    assert "tools" not in smol.hf.chat_template
    messages = [{"role": "system", "content": "Be brief."}, *ASK,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
                {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}]
    text = smol.hf.decode(smol.apply_chat_template(messages, tools=TOOLS))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions")
    assert f"<tools>\n{json.dumps(WEATHER)}\n{json.dumps(TIME)}\n</tools>" in text
    assert "<tool_call></tool_call> XML tags" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}\n</tool_call><|im_end|>') in text
    assert ("<|im_start|>user\n<tool_response>\n21 C\n</tool_response>\n<tool_response>\nsunny\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    # the rendered call is what the hermes parser reads back
    call = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert [(c.name, json.loads(c.arguments)) for c in parse_all(AutoParser("hermes", TOOLS), call)[1]] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    # no system message: one is prepended, with the tools only
    alone = smol.hf.decode(smol.apply_chat_template(ASK, tools=TOOLS))
    assert alone.startswith("<|im_start|>system\n# Tools\n") and "SmolLM" not in alone
    assert smol.apply_chat_template(ASK) == smol.apply_chat_template(ASK, tools=None)  # as before without tools


def test_a_template_that_knows_tools_gets_them(smol: Any) -> None:
    from orca.frontend.tokenizer import Tokenizer

    class Hf:  # a template of its own that renders tools (as Qwen2.5's does): it is given them as they are
        chat_template = "{{ tools }}"

        def __init__(self) -> None:
            self.seen: dict[str, Any] = {}

        def apply_chat_template(self, messages: list, **kwargs: Any) -> str:
            self.seen = {"messages": messages, **kwargs}
            return "x"

        def encode(self, text: str, add_special_tokens: bool) -> list[int]:
            return [1]

    hf = Hf()
    calls = [{"type": "function", "function": {"name": "get_time", "arguments": {}}}]
    Tokenizer(hf, "x").apply_chat_template([*ASK, {"role": "assistant", "content": None, "tool_calls": calls}],
                                           tools=TOOLS)
    assert hf.seen["tools"] == TOOLS and hf.seen["messages"][0] == ASK[0]
    assert hf.seen["messages"][1] == {"role": "assistant", "content": "", "tool_calls": calls}


# -- end to end: the openai client, orca-openai, Triton, orca_gpt with xgrammar ----------------------------------
# Room for two calls: in bfloat16 (dtype auto on a CPU with AVX-512 BF16) the shipped model calls the tool
# twice under tool_choice "required", which needs about 70 tokens (60 cut the second call: "length").
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 160}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _arguments_valid(call: Any) -> dict[str, Any]:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, CITY)
    return arguments


def test_response_format_json_schema_gives_json_that_validates(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string", "enum": ["Paris", "Rome", "Berlin"]},
                                               "big": {"type": "boolean"}},
              "required": ["capital", "big"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}}
    out = client.chat.completions.create(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                         response_format=rf, **GREEDY)
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    assert out.choices[0].finish_reason == "stop"
    choice = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=10,
                                       temperature=0, extra_body={"guided_choice": ["Paris", "Rome"]})
    assert choice.choices[0].text in ("Paris", "Rome")


def _calls_valid(calls: Any, names: tuple[str, ...] = ("get_weather", "get_time")) -> None:
    assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
    assert {c.function.name for c in calls} <= set(names)
    for call in calls:
        if call.function.name == "get_weather":
            _arguments_valid(call)
        else:
            assert json.loads(call.function.arguments) == {}


def test_tool_choice_required_and_named_give_calls_that_validate(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="required", **GREEDY)
    assert out.choices[0].finish_reason == "tool_calls", out.choices[0]
    _calls_valid(out.choices[0].message.tool_calls)
    # streamed, the named function's arguments as they are generated: the openai client's stream helper
    # assembles the deltas
    with client.chat.completions.stream(messages=ASK, tools=TOOLS, tool_choice=NAMED, **GREEDY) as events:
        final = events.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    calls = final.choices[0].message.tool_calls
    assert len(calls) == 1
    _calls_valid(calls, ("get_weather",))


def test_streamed_tool_calls_assemble_by_hand(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="required", stream=True,
                                                 **GREEDY))
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for tc in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += tc.id or ""
            call["name"] += (tc.function.name or "") if tc.function else ""
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert calls and list(calls) == list(range(len(calls)))
    for call in calls.values():
        assert call["id"].startswith("call_") and call["name"] in ("get_weather", "get_time")
        jsonschema.validate(json.loads(call["arguments"]), CITY if call["name"] == "get_weather" else {})
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_a_tool_result_turn_gets_text_back(client: openai.OpenAI) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"}]
    out = client.chat.completions.create(messages=messages, tools=TOOLS, tool_choice="none", model=MODEL,
                                         temperature=0, max_tokens=8)
    assert out.choices[0].message.content and out.choices[0].message.tool_calls is None
    assert out.usage.prompt_tokens > 100  # the tools and the call were rendered into the prompt


def test_bad_tools_and_constraints_are_400s(client: openai.OpenAI, api: str) -> None:
    bad_tool = [WEATHER, {"type": "function", "function": {"name": "get_time", "parameters": "none"}}]
    for kwargs, param, match in [
        ({"tools": bad_tool}, "tools[1].function.parameters", "must be an object"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name", "64"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", "names no tool"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "response_format.type must be"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "schema must be an object"),
    ]:
        with pytest.raises(openai.BadRequestError, match=match) as err:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kwargs)
        assert err.value.status_code == 400 and err.value.param == param
    # what only the engine can judge: its INVALID_ARG is a 400 naming the field
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for extra, name in [({"structured_outputs": {"regex": "(unclosed"}}, "regex"),
                        ({"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "json"),
                        ({"structured_outputs": {"grammar": "root ::= nothing_defined"}}, "grammar")]:
        r = requests.post(f"{api}/v1/chat/completions", headers=headers, timeout=60,
                          json={"model": MODEL, "messages": ASK, "max_tokens": 4, **extra})
        assert r.status_code == 400 and name in r.json()["error"]["message"], r.text
