"""The generate interface's request parsing and response tensors, Triton-neutral (numpy in, numpy out).

model_repository/orca_gpt/1/model.py only moves these arrays in and out of Triton tensors; everything a
request means is decided here, where it can be unit-tested without a server.

Inputs (all optional; exactly one prompt input): input_ids INT32 [-1], text_input STRING [1],
messages STRING [1] (OpenAI-style JSON list of {role, content}), stream BOOL [1],
sampling_parameters STRING [1] (JSON object), exclude_input_in_output BOOL [1]. The sampling keys may
also come as request parameters (what the HTTP /generate endpoint makes of extra JSON keys).
Outputs: output_ids INT32 [-1], text_output STRING [1], finish_reason STRING [1] (final response only),
num_input_tokens UINT32 [1], num_output_tokens UINT32 [1].
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from orca.engine import RequestOutput
from orca.sampling_params import SamplingParams, json_object

PROMPT_INPUTS = ("input_ids", "text_input", "messages")
INPUT_NAMES = (*PROMPT_INPUTS, "stream", "sampling_parameters", "exclude_input_in_output")


class TextCodec(Protocol):
    """What parsing needs from the engine: its tokenizer, behind the engine's own checks."""

    def encode(self, text: str) -> list[int]: ...
    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True)
class GenerateRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = False
    prompt_text: str | None = None  # the prompt as text, echoed before a non-streaming completion
    # (None for `messages`: a chat answer is the completion alone)


def parse_generate_request(
    inputs: dict[str, np.ndarray], parameters: dict[str, Any], codec: TextCodec, has_tokenizer: bool
) -> GenerateRequest:
    """Raises ValueError with a message saying what is wrong and what is allowed."""
    given = [name for name in PROMPT_INPUTS if name in inputs]
    if not given:
        raise ValueError("the request has no prompt: give input_ids, text_input or messages")
    if len(given) > 1:
        raise ValueError(f"give exactly one prompt input, got {', '.join(given)}")
    prompt_text: str | None = None
    if "input_ids" in inputs:
        arr = inputs["input_ids"]
        if arr.dtype.kind not in "iu":
            raise ValueError(f"input_ids must be integers, got {arr.dtype}")
        prompt_ids = [int(x) for x in arr.reshape(-1)]
        if has_tokenizer and prompt_ids:
            prompt_text = codec.decode(prompt_ids)
    elif "text_input" in inputs:
        prompt_text = _string_input(inputs, "text_input")
        if not prompt_text:
            raise ValueError("text_input is empty: give at least one character")
        prompt_ids = codec.encode(prompt_text)
    else:
        # A chat prompt is a structure, not text: its response carries the completion only.
        messages = _parse_messages(_string_input(inputs, "messages"))
        prompt_ids = codec.apply_chat_template(messages)
    params = _sampling_params(inputs, parameters)
    return GenerateRequest(
        prompt_token_ids=prompt_ids,
        params=params,
        stream=_bool_input(inputs, "stream"),
        exclude_input_in_output=_bool_input(inputs, "exclude_input_in_output"),
        prompt_text=prompt_text,
    )


def _single(inputs: dict[str, np.ndarray], name: str) -> Any:
    arr = inputs[name]
    if arr.size != 1:
        raise ValueError(f"{name} must hold exactly one element, got {arr.size}")
    return arr.reshape(-1)[0]


def _string_input(inputs: dict[str, np.ndarray], name: str) -> str:
    value = _single(inputs, name)
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{name} is not valid UTF-8") from None
    return str(value)


def _bool_input(inputs: dict[str, np.ndarray], name: str) -> bool:
    if name not in inputs:
        return False
    value = _single(inputs, name)
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name} must be a boolean, got {type(value).__name__}")


def _parse_messages(text: str) -> list[dict[str, str]]:
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"messages is not valid JSON: {exc}") from None
    if not isinstance(messages, list) or not messages:
        raise ValueError('messages must be a non-empty JSON list of {"role": ..., "content": ...} objects')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or not {"role", "content"} <= set(m):
            raise ValueError(f'messages[{i}] must be an object with exactly the keys "role" and "content"')
        if m["role"] not in ("system", "user", "assistant") or not isinstance(m["content"], str):
            raise ValueError(
                f'messages[{i}]: role must be "system", "user" or "assistant" and content a string'
            )
    return messages


def _sampling_params(inputs: dict[str, np.ndarray], parameters: dict[str, Any]) -> SamplingParams:
    values: dict[str, Any] = {}
    if "sampling_parameters" in inputs:
        values = json_object(_string_input(inputs, "sampling_parameters"), "sampling_parameters")
    SamplingParams.check_keys(parameters, "request parameter")
    values = {**values, **{k: _parameter_value(k, v) for k, v in parameters.items()}}
    return SamplingParams.from_dict(values)


def _parameter_value(name: str, value: Any) -> Any:
    """Request parameters are typed by Triton (int, bool, string, double); lists come as JSON strings."""
    if name in ("stop", "stop_token_ids") and isinstance(value, str):
        if name == "stop" and not value.startswith("["):
            return [value]
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{name} must be a JSON list, got {value!r}") from None
    return value


def response_tensors(
    out: RequestOutput, request: GenerateRequest, has_tokenizer: bool
) -> dict[str, np.ndarray]:
    """The output tensors of one response for `out`: this iteration's tokens when streaming, everything
    on the single final response otherwise."""
    if request.stream:
        ids, text = out.new_token_ids, out.text_delta or ""
    else:
        ids, text = out.token_ids, out.text or ""
        if not request.exclude_input_in_output and request.prompt_text is not None:
            text = request.prompt_text + text
    tensors = {
        "output_ids": np.asarray(ids, dtype=np.int32),
        "num_input_tokens": np.asarray([out.num_prompt_tokens], dtype=np.uint32),
        "num_output_tokens": np.asarray([len(out.token_ids)], dtype=np.uint32),
    }
    if has_tokenizer:
        tensors["text_output"] = np.asarray([text.encode("utf-8")], dtype=np.object_)
    if out.finished:
        tensors["finish_reason"] = np.asarray([(out.finish_reason or "").encode()], dtype=np.object_)
    return tensors
