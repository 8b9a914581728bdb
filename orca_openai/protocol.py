"""OpenAI request bodies -> orca_gpt's prompt and sampling parameters, orca_gpt's responses -> OpenAI objects."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from orca_openai import tools as tool_parsing
from orca_openai.triton import APIError, Chunk

MAX_COMPLETIONS_LOGPROBS = 5
"""OpenAI's bound for the completions API's logprobs (top_logprobs of chat: 20)."""
MAX_TOP_LOGPROBS = 20
MAX_CACHE_SALT_CHARS = 1024
"""cache_salt's bound, the engine's (orca.core.request_checks.MAX_CACHE_SALT_CHARS; orca_gpt checks it again)."""
MAX_TOKEN_ID = 2**31 - 1
"""A prompt's token ids are int32 on their way to the engine (which checks them against its vocabulary):
a larger one would wrap around (4294967301 became token 5) or fail to convert (2**70: a 500)."""

# Parameters accepted and passed to orca_gpt's sampling parameters unchanged (the last three are vLLM-style
# extensions, sent with the openai client's extra_body).
_PASSED = ("temperature", "top_p", "seed", "top_k", "ignore_eos", "stop_token_ids")
# Accepted and ignored: they change nothing the engine does.
_IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key",
            "safety_identifier", "stream_options", "reasoning_effort", "modalities", "verbosity")
# Accepted when they hold their default (OpenAI's value that means "off").
_DEFAULTS: dict[str, Any] = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "n": 1,
                             "best_of": 1, "suffix": "", "functions": [], "function_call": "none", "prediction": None,
                             "audio": None, "web_search_options": None}
# Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_CONSTRAINTS = ("response_format", "structured_outputs", *_GUIDED)
_COMMON = {"model", "stream", "max_tokens", "stop", "logprobs", "cache_salt", *_PASSED, *_IGNORED, *_DEFAULTS,
           *_CONSTRAINTS, "guided_decoding_backend"}
COMPLETION_KEYS = _COMMON | {"prompt", "echo"}
CHAT_KEYS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                       "parallel_tool_calls"}
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
"""OpenAI's rule for a function's (and a json_schema's) name."""
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
"""orca's structured_outputs sampling parameter (vLLM's StructuredOutputsParams): exactly one of these."""


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


@dataclass
class Request:
    model: str
    prompt: str | list[int] | list[dict[str, Any]]
    sampling: dict[str, Any]
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: not asked; n: the n most likely per token (0 = the sampled token's only)
    echo: str = ""
    cache_salt: str | None = None  # orca_gpt's cache_salt input (vLLM's extension): None = no salt
    tools: list[dict[str, Any]] = field(default_factory=list)  # chat: OpenAI's function tools (validated)
    tool_choice: Any = "none"  # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}
    parallel_tool_calls: bool = True

    def tool_parser(self, parser: str = "auto") -> Any:
        """A fresh parser of this request's output into tool calls (orca_openai.tools), or None."""
        return tool_parsing.make_parser(self.tool_choice, self.tools, parser, self.parallel_tool_calls)


def _check_body(body: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for key, value in body.items():
        if key not in allowed:
            raise bad(f"unrecognized request argument supplied: {key}", key)
        if key in _DEFAULTS and value is not None and value != _DEFAULTS[key]:
            if key == "n":
                raise bad(f"n must be 1: orca-openai generates one choice per request, got {value!r}", "n")
            if key in ("functions", "function_call"):
                raise bad(f"{key} (OpenAI's deprecated function calling) is not supported by orca-openai: "
                          "use tools and tool_choice", key)
            raise bad(f"{key} is not supported by orca-openai (only its default {_DEFAULTS[key]!r})", key)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model must be a non-empty string", "model")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad("stream must be a boolean", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options must be an object", "stream_options")
    if options and not stream:
        raise bad("stream_options is only allowed when stream is true", "stream_options")
    return body


_JSON_TYPES = {bool: "a boolean", int: "an integer", float: "a number", list: "an array", dict: "an object"}


def _cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM's cache_salt: requests with different salts never share the prefix cache's keys and values."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str):
        got = _JSON_TYPES.get(type(salt), type(salt).__name__)
    elif not salt:
        got = "an empty string"
    elif len(salt) > MAX_CACHE_SALT_CHARS:
        got = f"{len(salt)} characters"
    elif not salt.isascii() and not _encodable(salt):
        got = "a string that is not valid Unicode (a lone surrogate)"
    else:
        return salt
    raise bad(f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters, got {got}", "cache_salt")


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _sampling(body: dict[str, Any], max_tokens: Any) -> dict[str, Any]:
    sampling = {k: body[k] for k in _PASSED if body.get(k) is not None}
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad("stop must be a string or a list of strings", "stop")
        if len(stop) > 4:
            raise bad(f"stop holds at most 4 strings, got {len(stop)}", "stop")
        if stop:
            sampling["stop"] = stop
    return sampling


def _structured_outputs(body: dict[str, Any], tool_constraint: dict[str, Any] | None) -> dict[str, Any] | None:
    """The structured_outputs sampling parameter from response_format, structured_outputs or a guided_*
    field, or from the tool_choice's grammar (``tool_constraint``); at most one source per request."""
    found: list[tuple[str, dict[str, Any]]] = []
    if tool_constraint is not None:
        found.append(("tool_choice", tool_constraint))
    fmt = body.get("response_format")
    if fmt is not None:
        constraint = _response_format(fmt)
        if constraint is not None:
            found.append(("response_format", constraint))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _check_structured(body["structured_outputs"], "structured_outputs")))
    for key, kind in _GUIDED.items():
        if body.get(key) is not None:
            found.append((key, _check_structured({kind: body[key]}, key)))
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in ("xgrammar", "auto"):
        raise bad(f'guided_decoding_backend must be "xgrammar" or "auto" (orca enforces grammars with xgrammar), '
                  f"got {_short(backend)}", "guided_decoding_backend")
    if len(found) > 1:
        names = [name if name != "tool_choice" else f"tool_choice {_short(body['tool_choice'])}" for name, _ in found]
        raise bad(f"give at most one output constraint (response_format, structured_outputs, guided_json, "
                  f"guided_regex, guided_choice, guided_grammar, or tool_choice required or naming a function), "
                  f"got {' and '.join(names)}", found[1][0])
    return found[0][1] if found else None


def _response_format(fmt: Any) -> dict[str, Any] | None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        got = _short(kind) if isinstance(fmt, dict) else _JSON_TYPES.get(type(fmt), type(fmt).__name__)
        raise bad(f'response_format.type must be "text", "json_object" or "json_schema", got {got}',
                  "response_format.type")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad('response_format.json_schema must be an object {"name", "schema", "strict", "description"} '
                  'when response_format.type is "json_schema"', "response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise bad(f"response_format.json_schema.name must be 1 to 64 letters, digits, _ or -, got {_short(name)}",
                  "response_format.json_schema.name")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        got = "nothing" if schema is None else _JSON_TYPES.get(type(schema), type(schema).__name__)
        raise bad(f"response_format.json_schema.schema must be an object (a JSON schema), got {got}",
                  "response_format.json_schema.schema")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad("response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise bad("response_format.json_schema.description must be a string",
                  "response_format.json_schema.description")
    return {"json": schema}


def _check_structured(value: Any, param: str) -> dict[str, Any]:
    """vLLM's StructuredOutputsParams, checked for its shape (the engine checks what the schema, regex or
    grammar says, and refuses what it cannot compile)."""
    if not isinstance(value, dict):
        raise bad(f"{param} must be an object with one of {', '.join(STRUCTURED_KINDS)}", param)
    unknown = [k for k in value if k not in (*STRUCTURED_KINDS, "disable_any_whitespace", "backend")]
    if unknown:
        raise bad(f"{param}.{unknown[0]} is not supported: give one of {', '.join(STRUCTURED_KINDS)} (and "
                  f"optionally disable_any_whitespace, backend)", param)
    if value.get("backend") not in (None, "xgrammar", "auto"):
        raise bad(f'{param}.backend must be "xgrammar" or "auto" (orca enforces grammars with xgrammar), got '
                  f"{_short(value['backend'])}", f"{param}.backend")
    kinds = [k for k in STRUCTURED_KINDS if value.get(k) is not None]
    if len(kinds) != 1:
        raise bad(f"{param} must hold exactly one of {', '.join(STRUCTURED_KINDS)}, got "
                  f"{', '.join(kinds) or 'none'}", param)
    kind = kinds[0]
    item = value[kind]
    where = param if param.startswith("guided_") else f"{param}.{kind}"
    if kind == "json" and not isinstance(item, (dict, str, bool)):
        raise bad(f"{where} must be a JSON schema (an object, or its JSON text)", where)
    if kind == "json" and isinstance(item, str) and not isinstance(_json_or_none(item), dict):
        raise bad(f"{where} must be a JSON schema: its text is not a JSON object", where)
    if kind == "json_object" and item is not True:
        raise bad(f"{where} must be true", where)
    if kind in ("regex", "grammar") and (not isinstance(item, str) or not item):
        raise bad(f"{where} must be a non-empty string", where)
    if kind == "choice" and (not isinstance(item, list) or not item or not all(isinstance(c, str) for c in item)):
        raise bad(f"{where} must be a non-empty list of strings", where)
    flag = value.get("disable_any_whitespace")
    if flag is not None and not isinstance(flag, bool):
        raise bad(f"{param}.disable_any_whitespace must be a boolean", param)
    return {kind: item, **{k: value[k] for k in ("disable_any_whitespace", "backend") if value.get(k) is not None}}


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _short(value: Any, limit: int = 60) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]], Any, bool]:
    """(tools, tool_choice, parallel_tool_calls), validated; each tool as {"type": "function", "function":
    {"name", "description"?, "parameters"?}}."""
    raw = body.get("tools")
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise bad('tools must be a list of {"type": "function", "function": {...}} objects', "tools")
    tools, seen = [], set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(f'{where} must be an object {{"type": "function", "function": {{...}}}}', where)
        if tool.get("type") != "function":
            raise bad(f'{where}.type must be "function" (the only kind of tool orca-openai serves), got '
                      f"{_short(tool.get('type'))}", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad(f'{where}.function must be an object {{"name", "description", "parameters", "strict"}}',
                      f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise bad(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {_short(name)}",
                      f"{where}.function.name")
        if name in seen:
            raise bad(f"{where}.function.name: {name} is given twice: tool names must be unique",
                      f"{where}.function.name")
        seen.add(name)
        out: dict[str, Any] = {"name": name}
        description = function.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise bad(f"{where}.function.description must be a string", f"{where}.function.description")
            out["description"] = description
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise bad(f"{where}.function.parameters must be an object (a JSON schema), got "
                          f"{_JSON_TYPES.get(type(parameters), type(parameters).__name__)}",
                          f"{where}.function.parameters")
            out["parameters"] = parameters
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise bad(f"{where}.function.strict must be a boolean", f"{where}.function.strict")
        tools.append({"type": "function", "function": out})
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad(f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
                      f'{{"name": ...}}}}, got {_short(choice)}', "tool_choice")
        if choice == "required" and not tools:
            raise bad('tool_choice "required" needs tools', "tool_choice")
    else:
        function = choice.get("function") if isinstance(choice, dict) else None
        if not isinstance(function, dict) or choice.get("type") != "function" or not isinstance(
                function.get("name"), str):
            raise bad(f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
                      f'{{"name": ...}}}}, got {_short(choice)}', "tool_choice")
        if function["name"] not in seen:
            known = ", ".join(sorted(seen)) or "none: no tools are given"
            raise bad(f"tool_choice.function.name {_short(function['name'])} names no tool in tools (given: "
                      f"{known})", "tool_choice.function.name")
        choice = {"type": "function", "function": {"name": function["name"]}}
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    return tools, choice, parallel is not False


def _tool_constraint(tools: list[dict[str, Any]], choice: Any, parallel: bool) -> dict[str, Any] | None:
    """The grammar orca_gpt enforces for tool_choice "required" or a named function (vLLM's)."""
    if choice == "required":
        return {"json": tool_parsing.required_schema(tools, parallel)}
    if isinstance(choice, dict):
        tool = next(t for t in tools if t["function"]["name"] == choice["function"]["name"])
        return {"json": tool_parsing.named_schema(tool)}
    return None


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options") or {}
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise bad("stream_options.include_usage must be a boolean", "stream_options")
    return value


def completion_request(body: Any) -> Request:
    body = _check_body(body, COMPLETION_KEYS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if prompt is None:
        raise bad("prompt is required: a string or a list of token ids", "prompt")
    if prompt in ("", []):  # "", [], [""], [[]]: nothing to continue (orca_gpt would refuse it as its input's)
        raise bad(f"prompt is empty (got {_short(body['prompt'])}): give at least one character or token id", "prompt")
    if isinstance(prompt, str):
        pass
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        _check_token_ids(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("one prompt per request: orca-openai does not batch prompts; send one request each", "prompt")
    else:
        raise bad("prompt must be a string or a non-empty list of token ids", "prompt")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= MAX_COMPLETIONS_LOGPROBS):
        raise bad(f"logprobs must be an integer in [0, {MAX_COMPLETIONS_LOGPROBS}], got {logprobs!r}", "logprobs")
    echo = body.get("echo") or False
    if echo and not isinstance(prompt, str):
        raise bad("echo needs a text prompt", "echo")
    sampling = _sampling(body, body.get("max_tokens"))
    constraint = _structured_outputs(body, None)
    if constraint is not None:
        sampling["structured_outputs"] = constraint
    return Request(
        model=body["model"], prompt=prompt, sampling=sampling,
        stream=body.get("stream") or False, include_usage=_include_usage(body), logprobs=logprobs,
        echo=prompt if echo else "", cache_salt=_cache_salt(body),
    )


def _check_token_ids(ids: list[int]) -> None:
    for i, token in enumerate(ids):
        if not 0 <= token <= MAX_TOKEN_ID:
            raise bad(f"prompt's token ids must be integers in [0, {MAX_TOKEN_ID}], got {_short(token, 40)} at "
                      f"prompt[{i}]", "prompt")


def _content(i: int, content: Any) -> str:
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if not content:  # OpenAI's rule too: a list of parts holds at least one
            raise bad(f"{where} is an empty list: give a string or at least one text part", where)
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}: only text parts are supported", where)
            parts.append(part["text"])
        return "".join(parts)
    got = "nothing" if content is None else _JSON_TYPES.get(type(content), type(content).__name__)
    raise bad(f"{where} must be a string or a list of text parts, got {got}", where)


def _message(i: int, message: Any) -> dict[str, Any]:
    """One chat message as orca_gpt's messages input takes it."""
    if not isinstance(message, dict):
        raise bad(f"messages[{i}] must be an object", "messages")
    role = message.get("role")
    if role == "developer":
        role = "system"  # OpenAI's newer name for the system message
    if role not in ("system", "user", "assistant", "tool"):
        raise bad(f'messages[{i}].role must be "system", "developer", "user", "assistant" or "tool", got '
                  f"{_short(role)}", "messages")
    if message.get("function_call"):
        raise bad(f"messages[{i}].function_call (OpenAI's deprecated function calling) is not supported: use "
                  "tool_calls", "messages")
    calls = message.get("tool_calls")
    if role == "assistant" and calls:
        content = message.get("content")
        out: dict[str, Any] = {"role": role, "content": None if content is None else _content(i, content),
                               "tool_calls": _message_tool_calls(i, calls)}
        return out
    if calls:
        raise bad(f"messages[{i}].tool_calls: only assistant messages carry tool calls", "messages")
    content = message.get("content")
    if role == "assistant" and content is None:
        return {"role": role, "content": ""}
    out = {"role": role, "content": _content(i, content)}
    if role == "user" and not out["content"]:
        raise bad(f"messages[{i}].content is empty: a user message needs at least one character",
                  f"messages[{i}].content")
    if role == "tool":
        call = message.get("tool_call_id")
        if not isinstance(call, str):
            raise bad(f"messages[{i}].tool_call_id must be a string: the id of the tool call answered", "messages")
        out["tool_call_id"] = call
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
    return out


def _message_tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad(f"messages[{i}].tool_calls must be a list", "messages")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise bad(f'{where} must be an object {{"id", "type": "function", "function": {{"name", "arguments"}}}}',
                      "messages")
        name, arguments = function.get("name"), function.get("arguments", "{}")
        if not isinstance(name, str) or not name:
            raise bad(f"{where}.function.name must be a non-empty string", "messages")
        if isinstance(arguments, str):
            if not isinstance(_json_or_none(arguments or "{}"), dict):
                raise bad(f"{where}.function.arguments must be the JSON text of an object, got {_short(arguments)}",
                          "messages")
        elif not isinstance(arguments, dict):
            raise bad(f"{where}.function.arguments must be the JSON text of an object", "messages")
        entry: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if call.get("id") is not None:
            if not isinstance(call["id"], str):
                raise bad(f"{where}.id must be a string", "messages")
            entry["id"] = call["id"]
        out.append(entry)
    return out


def chat_request(body: Any) -> Request:
    body = _check_body(body, CHAT_KEYS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    converted = [_message(i, message) for i, message in enumerate(messages)]
    if not any(m["content"] or m.get("tool_calls") for m in converted):
        raise bad("every message's content is empty: give the model some text", "messages")
    tools, choice, parallel = _tools(body)
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad("logprobs must be a boolean", "logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}", "top_logprobs")
        if not logprobs:
            raise bad("top_logprobs needs logprobs to be true", "top_logprobs")
    sampling = _sampling(body, max_tokens)
    constraint = _structured_outputs(body, _tool_constraint(tools, choice, parallel))
    if constraint is not None:
        sampling["structured_outputs"] = constraint
    return Request(
        model=body["model"], prompt=converted, sampling=sampling,
        stream=body.get("stream") or False, include_usage=_include_usage(body),
        logprobs=(top or 0) if logprobs else None, cache_salt=_cache_salt(body),
        tools=tools, tool_choice=choice, parallel_tool_calls=parallel,
    )


# -- responses -------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; with `cached_tokens` (orca_gpt's num_cached_tokens: prompt tokens found in
    the prefix cache) also prompt_tokens_details.cached_tokens, as OpenAI reports its prompt caching (only
    with --enable-prompt-tokens-details: it tells a caller whether any earlier prompt began as theirs)."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def chunk_usage(chunks: list[Chunk], details: bool = False) -> dict[str, Any]:
    """The usage of a request from its responses: the prompt's tokens from the final one, the completion's
    the sum of every response's num_output_tokens (vllm_backend's: each response counts its own tokens); with
    ``details`` (--enable-prompt-tokens-details) the cached ones too."""
    last = chunks[-1] if chunks else Chunk([], None, True)
    generated = sum(c.num_output_tokens or 0 for c in chunks)
    return usage(last.num_input_tokens or 0, generated, last.num_cached_tokens if details else None)


def _token_entries(chunk: Chunk, n: int) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """For each token of the chunk: (its text, its logprob, the n most likely (text, logprob) by rank).

    orca_gpt's ``logprobs`` output (vllm_backend's layout): a JSON list, one dict per token keyed by token id,
    each value {"logprob", "rank", "decoded_token"}, the sampled token's entry among them."""
    entries = []
    for token_id, per_token in zip(chunk.output_ids, chunk.logprobs or [], strict=False):
        sampled = per_token.get(str(token_id)) or per_token.get(token_id) or {}
        ranked = sorted(per_token.values(), key=lambda e: e.get("rank") or math.inf)
        top = [(e.get("decoded_token") or "", _finite(e.get("logprob"))) for e in ranked if (e.get("rank") or 0) <= n
               and e.get("rank") is not None][:n]
        entries.append((sampled.get("decoded_token") or "", _finite(sampled.get("logprob")), top))
    return entries


def _finite(value: Any) -> float:
    value = float(value if value is not None else -math.inf)
    return value if math.isfinite(value) else -9999.0  # JSON has no -inf; OpenAI's floor


def chat_logprobs(chunk: Chunk, n: int) -> dict[str, Any]:
    def item(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**item(t, lp), "top_logprobs": [item(a, b) for a, b in top]}
                        for t, lp, top in _token_entries(chunk, n)], "refusal": None}


def completion_logprobs(chunk: Chunk, n: int, offset: int) -> dict[str, Any]:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token, logprob, top in _token_entries(chunk, n):
        tokens.append(token)
        token_logprobs.append(logprob)
        tops.append(dict(top))
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def merge_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not parts:
        return None
    merged: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, list):
                merged.setdefault(key, []).extend(value)
            else:
                merged[key] = value
    return merged
