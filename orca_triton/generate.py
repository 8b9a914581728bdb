"""The generate interface's request parsing and response tensors, Triton-neutral (numpy in, numpy out).

model_repository/orca_gpt/1/model.py only moves these arrays in and out of Triton tensors; everything a
request means is decided here, where it can be unit-tested without a server.

Inputs (all optional; exactly one prompt input): input_ids INT32 [-1], text_input STRING [1],
messages STRING [1] (OpenAI-style JSON list of {role, content}), stream BOOL [1],
sampling_parameters STRING [1] (JSON object), exclude_input_in_output BOOL [1], cache_salt STRING [1]
(prefix caching: requests with different salts never share cached keys and values; a UTF-8 string of 1
to 1024 characters, the engine core's MAX_CACHE_SALT_CHARS; left out = no salt), and
triton-inference-server/vllm_backend's BOOL [1] flags return_finish_reason, return_num_input_tokens,
return_num_output_tokens, return_logprobs, return_cumulative_logprob. The sampling keys and cache_salt may
also come as request parameters (what the HTTP /generate endpoint makes of extra JSON keys).
Outputs: output_ids INT32 [-1], text_output STRING [1], finish_reason STRING [1], num_input_tokens
UINT32 [1], num_output_tokens UINT32 [1], logprobs STRING [1] (JSON), cumulative_logprob FP32 [1],
num_cached_tokens UINT32 [1] (on the final response only: the prompt tokens whose keys and values came
from the prefix cache when the request was first admitted, so were not computed for it; 0 with
EngineConfig.enable_prefix_caching off).

The flags: vllm_backend returns an additional output only when its flag is true, and then on every
response. orca_gpt always returned finish_reason (final response), num_input_tokens and
num_output_tokens (the total so far), so a flag left out keeps that; a flag set to true gives
vllm_backend's semantics (finish_reason on every response, "None" until the last; num_output_tokens
this response's count); false drops the output. logprobs and cumulative_logprob are new: only when
asked for.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from orca.core.engine import MAX_CACHE_SALT_CHARS
from orca.frontend.output_processor import Logprob, RequestOutput
from orca.frontend.tokenizer import check_stop_strings
from orca.sampling_params import SamplingParams, json_object, json_type, json_value

PROMPT_INPUTS = ("input_ids", "text_input", "messages")
RETURN_FLAGS = (
    "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens", "return_logprobs",
    "return_cumulative_logprob",
)
"""vllm_backend's additional-output flags (BOOL [1] inputs)."""
INPUT_NAMES = (
    *PROMPT_INPUTS, "stream", "sampling_parameters", "exclude_input_in_output", "cache_salt", *RETURN_FLAGS,
)


class TextCodec(Protocol):
    """What parsing needs: the model's tokenizer behind the front end's checks (orca.frontend.tokenizer.Tokenizer)."""

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
    # (None for `messages`: a chat answer is the completion alone; for input_ids see echo_ids)
    echo_ids: bool = False  # the prompt came as input_ids: echo their decoded text (decoded only when a
    # response needs it, after the engine has checked the ids: a tokenizer may raise on ids out of range)
    # The vllm_backend flags: None = not given (orca_gpt's defaults), else the client's value.
    return_finish_reason: bool | None = None
    return_num_input_tokens: bool | None = None
    return_num_output_tokens: bool | None = None
    return_logprobs: bool = False
    return_cumulative_logprob: bool = False
    logprobs_asked: bool = False  # sampling parameter logprobs given (params.logprobs may be 0 just so that
    # cumulative_logprob can be computed)
    cache_salt: str | None = None  # the prefix cache's salt (None: no salt)
    codec: TextCodec | None = dataclasses.field(default=None, compare=False, repr=False)  # decoded_token


def parse_generate_request(
    inputs: dict[str, np.ndarray], parameters: dict[str, Any], codec: TextCodec, has_tokenizer: bool
) -> GenerateRequest:
    """Raises ValueError with a message saying what is wrong and what is allowed (the prompt's ids are
    checked against the model by the engine when the request is submitted)."""
    given = [name for name in PROMPT_INPUTS if name in inputs]
    if not given:
        raise ValueError("the request has no prompt: give input_ids, text_input or messages")
    if len(given) > 1:
        raise ValueError(f"give exactly one prompt input, got {', '.join(given)}")
    prompt_text: str | None = None
    if "input_ids" in inputs:
        arr = np.asarray(inputs["input_ids"])
        if arr.dtype.kind not in "iu":
            raise ValueError(f"input_ids must be integers (INT32 token ids), got {arr.dtype}")
        prompt_ids = [int(x) for x in arr.reshape(-1).tolist()]
    elif "text_input" in inputs:
        prompt_text = _string_input(inputs, "text_input")
        if not prompt_text:
            raise ValueError("text_input is empty: give at least one character")
        prompt_ids = _with_codec("text_input", codec.encode, prompt_text)
    else:
        # A chat prompt is a structure, not text: its response carries the completion only.
        messages = _parse_messages(_string_input(inputs, "messages"))
        prompt_ids = _with_codec("messages", codec.apply_chat_template, messages)
    parameters = dict(parameters)
    cache_salt = _cache_salt(inputs, parameters.pop("cache_salt", None))
    params = _sampling_params(inputs, parameters)
    check_stop_strings(params, has_tokenizer)
    flags = {name: _bool_input(inputs, name) if name in inputs else None for name in RETURN_FLAGS}
    logprobs_asked = params.logprobs is not None
    if flags["return_cumulative_logprob"] and not logprobs_asked:
        params = dataclasses.replace(params, logprobs=0)  # the drawn tokens' log-probabilities, nothing more
    return GenerateRequest(
        prompt_token_ids=prompt_ids,
        params=params,
        stream=_bool_input(inputs, "stream"),
        exclude_input_in_output=_bool_input(inputs, "exclude_input_in_output"),
        prompt_text=prompt_text,
        echo_ids="input_ids" in inputs,
        return_finish_reason=flags["return_finish_reason"],
        return_num_input_tokens=flags["return_num_input_tokens"],
        return_num_output_tokens=flags["return_num_output_tokens"],
        return_logprobs=bool(flags["return_logprobs"]),
        return_cumulative_logprob=bool(flags["return_cumulative_logprob"]),
        logprobs_asked=logprobs_asked,
        cache_salt=cache_salt,
        codec=codec if has_tokenizer else None,
    )


def _cache_salt(inputs: dict[str, np.ndarray], parameter: Any) -> str | None:
    """The cache_salt input or request parameter (not both); None when neither is given. Its length is
    the engine core's to check (EngineCore.validate, when the request is submitted)."""
    allowed = f"a UTF-8 string of 1 to {MAX_CACHE_SALT_CHARS} characters"
    if "cache_salt" in inputs:
        if parameter is not None:
            raise ValueError("cache_salt is given twice, as an input and as a request parameter: give it once")
        try:
            salt = _string_input(inputs, "cache_salt")
        except ValueError as exc:
            raise ValueError(f"{exc}; cache_salt must be {allowed}") from None
    elif parameter is None:
        return None
    elif isinstance(parameter, str):
        salt = parameter
        try:
            salt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"cache_salt is not valid Unicode (character {exc.start}: {exc.reason}); "
                             f"cache_salt must be {allowed}") from None
    else:
        raise ValueError(f"cache_salt must be {allowed}, got {json_type(parameter)}")
    return salt


def _with_codec(name: str, call: Any, arg: Any) -> list[int]:
    """The tokenizer's answer for the prompt input `name`; its refusals (no tokenizer, no chat template,
    a chat template that raises on these messages) are ValueErrors naming the input."""
    try:
        return call(arg)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    except Exception as exc:
        if type(exc).__module__.split(".")[0] != "jinja2":  # TemplateError: the template's raise_exception
            raise
        raise ValueError(f"{name}: the model's chat template refuses them: {exc}") from None


def _single(inputs: dict[str, np.ndarray], name: str) -> Any:
    arr = np.asarray(inputs[name])
    if arr.size != 1:
        raise ValueError(f"{name} must hold exactly one element, got {arr.size} (shape {list(arr.shape)})")
    return arr.reshape(-1)[0]


def _string_input(inputs: dict[str, np.ndarray], name: str) -> str:
    value = _single(inputs, name)
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{name} is not valid UTF-8 (byte {exc.start}: {exc.reason})") from None
    if not isinstance(value, (str, np.str_)):
        raise ValueError(f"{name} must be a string (BYTES, UTF-8), got {np.asarray(inputs[name]).dtype}")
    try:
        str(value).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} is not valid Unicode (character {exc.start}: {exc.reason})") from None
    return str(value)


def _bool_input(inputs: dict[str, np.ndarray], name: str) -> bool:
    if name not in inputs:
        return False
    value = _single(inputs, name)
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name} must be a boolean (BOOL, true or false), got {np.asarray(inputs[name]).dtype}")


_ROLES = ("system", "user", "assistant")


def _parse_messages(text: str) -> list[dict[str, str]]:
    messages = json_value(text, "messages")
    if not isinstance(messages, list) or not messages:
        got = "an empty array" if isinstance(messages, list) else json_type(messages)
        raise ValueError(f'messages must be a non-empty JSON list of {{"role": ..., "content": ...}} objects, '
                         f"got {got}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f'messages[{i}] must be an object with the keys "role" and "content", got {json_type(m)}')
        if set(m) != {"role", "content"}:
            keys = ", ".join(_clip(k) for k in m) or "none"
            raise ValueError(f'messages[{i}] must be an object with exactly the keys "role" and "content", got {keys}')
        if not isinstance(m["role"], str) or m["role"] not in _ROLES:
            raise ValueError(f'messages[{i}]: role must be "system", "user" or "assistant", got {_clip(m["role"])}')
        if not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}]: content must be a string, got {json_type(m['content'])}")
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"messages[{i}]: content is not valid Unicode ({exc.reason})") from None
    return messages


def _clip(value: Any, limit: int = 40) -> str:
    text = json.dumps(value, ensure_ascii=True) if not isinstance(value, float) else repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


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
        return json_value(value, _STRING_LISTS[name])
    return value


_STRING_LISTS = {
    "stop": "stop (one stop string, or a JSON list of non-empty strings in a string)",
    "stop_token_ids": "stop_token_ids (a JSON list of integers >= 0 in a string)",
}


def response_tensors(
    out: RequestOutput, request: GenerateRequest, has_tokenizer: bool
) -> dict[str, np.ndarray]:
    """The output tensors of one response for `out`: this iteration's tokens when streaming, everything
    on the single final response otherwise."""
    if request.stream:
        ids, text, logprobs = out.new_token_ids, out.text_delta or "", out.new_logprobs
    else:
        ids, text, logprobs = out.token_ids, out.text or "", out.logprobs
        if not request.exclude_input_in_output:
            text = _prompt_text(request) + text
    tensors = {"output_ids": np.asarray(ids, dtype=np.int32)}
    if request.return_num_input_tokens is not False:
        tensors["num_input_tokens"] = np.asarray([out.num_prompt_tokens], dtype=np.uint32)
    if request.return_num_output_tokens is not False:
        # vllm_backend's (flag true): this response's tokens; orca_gpt's (no flag): all so far.
        n = len(ids) if request.return_num_output_tokens else out.num_output_tokens
        tensors["num_output_tokens"] = np.asarray([n], dtype=np.uint32)
    if has_tokenizer:
        tensors["text_output"] = np.asarray([text.encode("utf-8")], dtype=np.object_)
    if request.return_finish_reason or (request.return_finish_reason is None and out.finished):
        reason = (out.finish_reason or "") if out.finished else str(None)  # vllm_backend: "None" until the end
        tensors["finish_reason"] = np.asarray([reason.encode()], dtype=np.object_)
    if request.return_logprobs:
        text_json = "null" if not request.logprobs_asked or logprobs is None else logprobs_json(logprobs, request.codec)
        tensors["logprobs"] = np.asarray([text_json.encode("utf-8")], dtype=np.object_)
    if request.return_cumulative_logprob:
        value = float("nan") if out.cumulative_logprob is None else out.cumulative_logprob
        tensors["cumulative_logprob"] = np.asarray([value], dtype=np.float32)
    if out.finished:
        tensors["num_cached_tokens"] = np.asarray([out.num_cached_tokens], dtype=np.uint32)
    return tensors


def _prompt_text(request: GenerateRequest) -> str:
    """The prompt to echo before a non-streaming completion ("" for messages)."""
    if request.prompt_text is not None:
        return request.prompt_text
    if request.echo_ids and request.codec is not None and request.prompt_token_ids:
        return request.codec.decode(request.prompt_token_ids)
    return ""


def logprobs_json(logprobs: list[dict[int, Logprob]], codec: TextCodec | None) -> str:
    """vllm_backend's `logprobs` output: a JSON list with, per token, {"<token id>": {"logprob", "rank",
    "decoded_token"}} (the drawn token first, then the top n; decoded_token null without a tokenizer)."""
    return json.dumps([
        {
            str(token_id): {
                "logprob": lp.logprob,
                "rank": lp.rank,
                "decoded_token": None if codec is None else codec.decode([token_id]),
            }
            for token_id, lp in entry.items()
        }
        for entry in logprobs
    ])
