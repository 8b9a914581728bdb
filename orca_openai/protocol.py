"""OpenAI request bodies -> orca_gpt's prompt and sampling parameters, orca_gpt's responses -> OpenAI objects."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from orca_openai.triton import APIError, Chunk

MAX_COMPLETIONS_LOGPROBS = 5
"""OpenAI's bound for the completions API's logprobs (top_logprobs of chat: 20)."""
MAX_TOP_LOGPROBS = 20
MAX_CACHE_SALT_CHARS = 1024
"""cache_salt's bound, the engine's (orca.core.engine.MAX_CACHE_SALT_CHARS; orca_gpt checks it again)."""

# Parameters accepted and passed to orca_gpt's sampling parameters unchanged (the last three are vLLM-style
# extensions, sent with the openai client's extra_body).
_PASSED = ("temperature", "top_p", "seed", "top_k", "ignore_eos", "stop_token_ids")
# Accepted and ignored: they change nothing the engine does.
_IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
            "safety_identifier", "stream_options", "reasoning_effort", "modalities", "verbosity")
# Accepted when they hold their default (OpenAI's value that means "off").
_DEFAULTS: dict[str, Any] = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "n": 1,
                             "best_of": 1, "suffix": "", "tools": [], "functions": [], "tool_choice": "none",
                             "function_call": "none", "prediction": None, "audio": None, "web_search_options": None,
                             "response_format": {"type": "text"}}
_COMMON = {"model", "stream", "max_tokens", "stop", "logprobs", "cache_salt", *_PASSED, *_IGNORED, *_DEFAULTS}
COMPLETION_KEYS = _COMMON | {"prompt", "echo"}
CHAT_KEYS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


@dataclass
class Request:
    model: str
    prompt: str | list[int] | list[dict[str, str]]
    sampling: dict[str, Any]
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: not asked; n: the n most likely per token (0 = the sampled token's only)
    echo: str = ""
    cache_salt: str | None = None  # orca_gpt's cache_salt input (vLLM's extension): None = no salt


def _check_body(body: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for key, value in body.items():
        if key not in allowed:
            raise bad(f"unrecognized request argument supplied: {key}", key)
        if key in _DEFAULTS and value is not None and value != _DEFAULTS[key]:
            if key == "n":
                raise bad(f"n must be 1: orca-openai generates one choice per request, got {value!r}", "n")
            if key == "response_format" and isinstance(value, dict) and value.get("type") == "text":
                continue
            if key == "tool_choice" and value in ("auto", "none") and not body.get("tools"):
                continue
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
    if isinstance(prompt, str):
        pass
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        pass
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
    return Request(
        model=body["model"], prompt=prompt, sampling=_sampling(body, body.get("max_tokens")),
        stream=body.get("stream") or False, include_usage=_include_usage(body), logprobs=logprobs,
        echo=prompt if echo else "", cache_salt=_cache_salt(body),
    )


def _content(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def chat_request(body: Any) -> Request:
    body = _check_body(body, CHAT_KEYS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    converted = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}] must be an object", "messages")
        role = message.get("role")
        if role == "developer":
            role = "system"  # OpenAI's newer name for the system message
        if role not in ("system", "user", "assistant"):
            raise bad(f'messages[{i}].role must be "system", "developer", "user" or "assistant", got {role!r}',
                      "messages")
        if message.get("tool_calls") or message.get("function_call"):
            raise bad(f"messages[{i}]: tool calls are not supported", "messages")
        converted.append({"role": role, "content": _content(i, message.get("content"))})
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
    return Request(
        model=body["model"], prompt=converted, sampling=_sampling(body, max_tokens),
        stream=body.get("stream") or False, include_usage=_include_usage(body),
        logprobs=(top or 0) if logprobs else None, cache_salt=_cache_salt(body),
    )


# -- responses -------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; with `cached_tokens` (orca_gpt's num_cached_tokens: prompt tokens found in
    the prefix cache) also prompt_tokens_details.cached_tokens, as OpenAI reports its prompt caching."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def chunk_usage(last: Chunk) -> dict[str, Any]:
    """The usage of a request from its final response."""
    return usage(last.num_input_tokens or 0, last.num_output_tokens or 0, last.num_cached_tokens)


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
