"""The generate interface's request parsing and response tensors, Triton-neutral (numpy in, numpy out).

model_repository/orca_gpt/1/model.py only moves these arrays in and out of Triton tensors; everything a
request means is decided here, where it can be unit-tested without a server.

Inputs (all optional; exactly one prompt input): input_ids INT32 [-1], text_input STRING [1],
messages STRING [1] (OpenAI-style JSON list of {role, content}; roles system, user, assistant and tool,
assistant messages may carry tool_calls, tool messages tool_call_id), tools STRING [1] (with messages only:
a JSON list of OpenAI tool objects {"type": "function", "function": {"name", "description",
"parameters"}}, rendered by the model's chat template, or by orca.frontend.tokenizer in Qwen's Hermes
format when the template knows no tools), stream BOOL [1],
sampling_parameters STRING [1] (JSON object), exclude_input_in_output BOOL [1], cache_salt STRING [1]
(prefix caching: requests with different salts never share cached keys and values; a UTF-8 string of 1
to 1024 characters, the engine core's MAX_CACHE_SALT_CHARS; left out = no salt), and
triton-inference-server/vllm_backend's BOOL [1] flags return_finish_reason, return_num_input_tokens,
return_num_output_tokens, return_logprobs, return_cumulative_logprob. The sampling keys may also come as
request parameters (what the HTTP /generate endpoint makes of extra JSON keys), read only when the request
has no sampling_parameters input (as vllm_backend reads them); cache_salt may come as a request parameter
either way. Sampling values follow vLLM's SamplingParams (orca.sampling_params.SamplingParams.from_dict):
strings convert to the field's type ("temperature": "0"), as vllm_backend converts them.
Outputs: output_ids INT32 [-1], text_output STRING [1], finish_reason STRING [1], num_input_tokens
UINT32 [1], num_output_tokens UINT32 [1], logprobs STRING [1] (JSON), cumulative_logprob FP32 [1],
num_cached_tokens UINT32 [1] (on the final response only: the prompt tokens whose keys and values came
from the prefix cache when the request was first admitted, so were not computed for it; 0 with
EngineConfig.enable_prefix_caching off).

Bounds (ValueError naming the field and the bound, INVALID_ARG in Triton): at most MAX_STOP_STRINGS (16)
stop strings of MAX_STOP_CHARS (1,000) characters, MAX_STOP_TOKEN_IDS (64) stop_token_ids, n at most MAX_N
(16); a text prompt (text_input, or messages and tools) of more than PROMPT_BYTES_PER_TOKEN (64) bytes per
token of max_model_len is refused before it is decoded or tokenized.

The flags, as vllm_backend's: an additional output comes only when its flag is true, and then on every
response (finish_reason "None" until the last; num_output_tokens this response's count; logprobs this
response's tokens'; cumulative_logprob the sum so far); left out or false, it does not come.
stream true with exclude_input_in_output false is refused as vllm_backend refuses it (a stream carries the
completion only); left out, a stream excludes the prompt and a single response starts with it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from orca.core.request_checks import MAX_CACHE_SALT_CHARS
from orca.frontend.generation_config import with_sampling_defaults
from orca.frontend.output_processor import Logprob, RequestOutput
from orca.frontend.tokenizer import check_stop_strings
from orca.sampling_params import SamplingParams
from orca.validation import json_object, json_type, json_value

PROMPT_INPUTS = ("input_ids", "text_input", "messages")
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
"""OpenAI's rule for a function's name."""
RETURN_FLAGS = (
    "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens", "return_logprobs",
    "return_cumulative_logprob",
)
"""vllm_backend's additional-output flags (BOOL [1] inputs)."""
INPUT_NAMES = (
    *PROMPT_INPUTS, "tools", "stream", "sampling_parameters", "exclude_input_in_output", "cache_salt", *RETURN_FLAGS,
)
STREAM_WITH_INPUT_ERROR = (
    "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
)
"""vllm_backend's answer, word for word (its CI compares the message), to stream true with
exclude_input_in_output false: a stream carries the completion only."""


MAX_STOP_STRINGS = 16
"""The most stop strings a request may give (OpenAI allows 4, vLLM sets no bound): each is searched for in
every new piece of text, on the response thread every request shares."""
MAX_STOP_CHARS = 1000
"""The longest stop string, in characters."""
MAX_STOP_TOKEN_IDS = 64
"""The most stop_token_ids a request may give."""
MAX_N = 16
"""The most sequences (n) one request may ask for here: each is an engine request of its own, so n is a
multiplier on the work one client can ask for (orca.sampling_params.MAX_N, 128, is OpenAI's bound)."""
PROMPT_BYTES_PER_TOKEN = 64
"""A text prompt (text_input; messages and tools together) longer than this many UTF-8 bytes per token of
max_model_len cannot fit the context, whatever the tokenizer makes of it: it is refused before tokenizing
(a 1 MiB prompt would otherwise hold a thread for most of a second)."""


def check_prompt_size(inputs: dict[str, np.ndarray], max_model_len: int | None) -> int:
    """The size of the request's text prompt in bytes (0 for input_ids), checked against
    PROMPT_BYTES_PER_TOKEN x max_model_len (None: unchecked) before it is decoded or tokenized: ValueError
    naming the input, its size and the bound."""
    names = [name for name in ("text_input", "messages", "tools") if name in inputs]
    size = sum(_raw_size(inputs[name]) for name in names)
    if max_model_len is not None and size > PROMPT_BYTES_PER_TOKEN * max_model_len:
        raise ValueError(
            f"{' and '.join(names)} is {size} bytes long; at most {PROMPT_BYTES_PER_TOKEN * max_model_len} bytes "
            f"are allowed ({PROMPT_BYTES_PER_TOKEN} per token of max_model_len {max_model_len}): a longer text "
            "cannot fit the context"
        )
    return size


def _raw_size(tensor: np.ndarray) -> int:
    """The bytes of a string input's elements (characters for a str), without decoding them."""
    arr = np.asarray(tensor)
    if arr.dtype.kind in "SU":
        return int(arr.nbytes)
    return sum(len(v) if isinstance(v, (bytes, str)) else 0 for v in arr.reshape(-1).tolist())


def check_request_bounds(params: SamplingParams) -> None:
    """The Triton path's caps on what one request may ask for (MAX_STOP_STRINGS, MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS, MAX_N): ValueError naming the field and the bound."""
    if len(params.stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop holds {len(params.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for i, stop in enumerate(params.stop):
        if len(stop) > MAX_STOP_CHARS:
            raise ValueError(f"stop[{i}] is {len(stop)} characters long; at most {MAX_STOP_CHARS} are allowed")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids holds {len(params.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} "
                         "are allowed")
    if params.n > MAX_N:
        raise ValueError(f"n must be >= 1 and <= {MAX_N} (sequences generated for the prompt, each an engine "
                         f"request of its own), got {params.n}")


class TextCodec(Protocol):
    """What parsing needs: the model's tokenizer behind the front end's checks (orca.frontend.tokenizer.Tokenizer)."""

    def encode(self, text: str) -> list[int]: ...
    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]: ...  # and tools=..., when given
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
    # The vllm_backend flags (left out = false): which additional outputs each response carries.
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_logprobs: bool = False
    return_cumulative_logprob: bool = False
    logprobs_asked: bool = False  # sampling parameter logprobs given (params.logprobs may be 0 just so that
    # cumulative_logprob can be computed)
    cache_salt: str | None = None  # the prefix cache's salt (None: no salt)
    codec: TextCodec | None = dataclasses.field(default=None, compare=False, repr=False)  # decoded_token


def parse_generate_request(
    inputs: dict[str, np.ndarray], parameters: dict[str, Any], codec: TextCodec, has_tokenizer: bool,
    sampling_defaults: Mapping[str, Any] | None = None, max_model_len: int | None = None,
) -> GenerateRequest:
    """Raises ValueError with a message saying what is wrong and what is allowed (the prompt's ids are
    checked against the model by the engine when the request is submitted). `sampling_defaults`: the
    model's (orca.frontend.generation_config.read_sampling_defaults), for the sampling keys the request
    leaves out. `max_model_len`: the engine's; a text prompt that cannot fit it is refused before it is
    tokenized (check_prompt_size; None: not checked)."""
    given = [name for name in PROMPT_INPUTS if name in inputs]
    if not given:
        raise ValueError("the request has no prompt: give input_ids, text_input or messages")
    if len(given) > 1:
        raise ValueError(f"give exactly one prompt input, got {', '.join(given)}")
    if "tools" in inputs and "messages" not in inputs:
        raise ValueError("tools is only allowed with the messages input (the chat template renders them)")
    check_prompt_size(inputs, max_model_len)
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
        tools = _parse_tools(_string_input(inputs, "tools")) if "tools" in inputs else None
        if tools:
            prompt_ids = _with_codec("messages", lambda m: codec.apply_chat_template(m, tools=tools), messages)
        else:  # a codec of its own (tests, the offline LLM's) need not know tools
            prompt_ids = _with_codec("messages", codec.apply_chat_template, messages)
    stream = _bool_input(inputs, "stream")
    if stream and "exclude_input_in_output" in inputs and not _bool_input(inputs, "exclude_input_in_output"):
        raise ValueError(STREAM_WITH_INPUT_ERROR)
    parameters = dict(parameters)
    cache_salt = _cache_salt(inputs, parameters.pop("cache_salt", None))
    params = _sampling_params(inputs, parameters, sampling_defaults)
    check_stop_strings(params, has_tokenizer)
    check_request_bounds(params)
    flags = {name: _bool_input(inputs, name) for name in RETURN_FLAGS}
    logprobs_asked = params.logprobs is not None
    if flags["return_cumulative_logprob"] and not logprobs_asked:
        params = dataclasses.replace(params, logprobs=0)  # the drawn tokens' log-probabilities, nothing more
    return GenerateRequest(
        prompt_token_ids=prompt_ids,
        params=params,
        stream=stream,
        exclude_input_in_output=stream or _bool_input(inputs, "exclude_input_in_output"),
        prompt_text=prompt_text,
        echo_ids="input_ids" in inputs,
        **flags,
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


_ROLES = ("system", "user", "assistant", "tool")
_MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")


def _parse_messages(text: str) -> list[dict[str, Any]]:
    """The chat: OpenAI's messages, content a string (null allowed for an assistant message with
    tool_calls). tool_calls' arguments arrive as JSON text (OpenAI's form) or an object, and leave as an
    object: chat templates write them with `tojson` (vLLM does the same)."""
    messages = json_value(text, "messages")
    if not isinstance(messages, list) or not messages:
        got = "an empty array" if isinstance(messages, list) else json_type(messages)
        raise ValueError(f'messages must be a non-empty JSON list of {{"role": ..., "content": ...}} objects, '
                         f"got {got}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f'messages[{i}] must be an object with the keys "role" and "content", got {json_type(m)}')
        role = m.get("role")
        needs_content = not (role == "assistant" and m.get("tool_calls"))
        if "role" not in m or (needs_content and "content" not in m) or not set(m) <= set(_MESSAGE_KEYS):
            keys = ", ".join(_clip(k) for k in m) or "none"
            raise ValueError(f'messages[{i}] must be an object with exactly the keys "role" and "content" (and '
                             f'optionally "tool_calls", "tool_call_id", "name"), got {keys}')
        if not isinstance(role, str) or role not in _ROLES:
            raise ValueError(f'messages[{i}]: role must be "system", "user", "assistant" or "tool", got {_clip(role)}')
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and not needs_content):
            raise ValueError(f"messages[{i}]: content must be a string, got {json_type(content)}")
        _check_text(f"messages[{i}]: content", content or "")
        for key in ("tool_call_id", "name"):
            if key in m and not isinstance(m[key], str):
                raise ValueError(f"messages[{i}]: {key} must be a string, got {json_type(m[key])}")
            if key in m:
                _check_text(f"messages[{i}]: {key}", m[key])
        if "tool_call_id" in m and role != "tool":
            raise ValueError(f'messages[{i}]: tool_call_id belongs to a "tool" message, not to {_clip(role)}')
        if "tool_calls" in m:
            if role != "assistant":
                raise ValueError(f'messages[{i}]: tool_calls belong to an "assistant" message, not to {_clip(role)}')
            m["tool_calls"] = _parse_tool_calls(f"messages[{i}].tool_calls", m["tool_calls"])
    return messages


def _check_text(what: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode ({exc.reason})") from None


def _parse_tool_calls(what: str, calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ValueError(f"{what} must be a list of tool calls, got {json_type(calls)}")
    for j, call in enumerate(calls):
        where = f"{what}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise ValueError(f'{where} must be an object {{"id", "type": "function", "function": {{"name", '
                             f'"arguments"}}}}, got {_clip(call)}')
        if call.get("type", "function") != "function":
            raise ValueError(f'{where}.type must be "function", got {_clip(call.get("type"))}')
        if "id" in call and not isinstance(call["id"], str):
            raise ValueError(f"{where}.id must be a string, got {json_type(call['id'])}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"{where}.function.name must be a non-empty string, got {_clip(function.get('name'))}")
        _check_text(f"{where}.function.name", function["name"])
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            _check_text(f"{where}.function.arguments", arguments)
            arguments = json_value(arguments, f"{where}.function.arguments") if arguments.strip() else {}
        if not isinstance(arguments, dict):
            raise ValueError(f"{where}.function.arguments must be a JSON object (or its JSON text), "
                             f"got {json_type(arguments)}")
        function["arguments"] = arguments
    return calls


def _parse_tools(text: str) -> list[dict[str, Any]]:
    """The tools input: OpenAI's tool objects, each a function with a unique name and, optionally, a
    description and a JSON schema object of its parameters."""
    tools = json_value(text, "tools")
    if not isinstance(tools, list):
        raise ValueError(f'tools must be a JSON list of {{"type": "function", "function": {{"name": ...}}}} '
                         f"objects, got {json_type(tools)}")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise ValueError(f'tools[{i}] must be an object {{"type": "function", "function": {{"name", '
                             f'"description", "parameters"}}}}, got {_clip(tool)}')
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise ValueError(f"tools[{i}].function.name must be 1 to 64 letters, digits, _ or -, got {_clip(name)}")
        if name in seen:
            raise ValueError(f"tools[{i}].function.name: {name} is given twice: tool names must be unique")
        seen.add(name)
        if "description" in function and not isinstance(function["description"], (str, type(None))):
            raise ValueError(f"tools[{i}].function.description must be a string, "
                             f"got {json_type(function['description'])}")
        _check_text(f"tools[{i}].function.description", function.get("description") or "")
        if "parameters" in function and not isinstance(function["parameters"], (dict, type(None))):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object, "
                             f"got {json_type(function['parameters'])}")
    return tools


def _clip(value: Any, limit: int = 40) -> str:
    text = json.dumps(value, ensure_ascii=True) if not isinstance(value, float) else repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def _sampling_params(
    inputs: dict[str, np.ndarray], parameters: dict[str, Any], defaults: Mapping[str, Any] | None = None
) -> SamplingParams:
    """The sampling values of the sampling_parameters input when it is given (the request parameters are
    then not read, as vllm_backend reads none: a client may send both, or Triton parameters of its own),
    else of the request parameters (the HTTP /generate endpoint's extra JSON keys)."""
    if "sampling_parameters" in inputs:
        values = json_object(_string_input(inputs, "sampling_parameters"), "sampling_parameters")
    else:
        SamplingParams.check_keys(parameters, "request parameter")
        values = {k: _parameter_value(k, v) for k, v in parameters.items()}
    return SamplingParams.from_dict(with_sampling_defaults(values, defaults))  # the request's keys win


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
    sequence = _sequence(out, request)
    tensors = {"output_ids": np.asarray(sequence.ids, dtype=np.int32),
               **_sequence_tensors([sequence], request, has_tokenizer, out.num_prompt_tokens)}
    if out.finished:
        tensors["num_cached_tokens"] = np.asarray([out.num_cached_tokens], dtype=np.uint32)
    return tensors


def parent_response_tensors(
    outs: Sequence[RequestOutput | None], changed: int | None, request: GenerateRequest, has_tokenizer: bool
) -> dict[str, np.ndarray]:
    """The output tensors of one response of a request with n > 1 (its children's latest outputs, in order),
    vllm_backend's layout: text_output, finish_reason, num_output_tokens, logprobs and cumulative_logprob
    with one element per sequence, num_input_tokens one. Streaming, child `changed` has its new tokens and the
    others empty deltas; otherwise (once, every child finished) each sequence whole. No output_ids (one
    flat tensor cannot hold n sequences); num_cached_tokens, on the last response, is the first sequence's."""
    sequences = [_sequence(out, request, empty=request.stream and i != changed) for i, out in enumerate(outs)]
    tensors = _sequence_tensors(sequences, request, has_tokenizer, len(request.prompt_token_ids))
    if all(out is not None and out.finished for out in outs):
        tensors["num_cached_tokens"] = np.asarray([outs[0].num_cached_tokens], dtype=np.uint32)  # type: ignore[union-attr]
    return tensors


class _SequenceValues(NamedTuple):
    """One sequence's share of a response."""

    ids: list[int]
    text: str
    finish_reason: str
    logprobs: str  # vllm_backend's JSON, or "null"
    cumulative_logprob: float


def _sequence(out: RequestOutput | None, request: GenerateRequest, empty: bool = False) -> _SequenceValues:
    """A sequence's values in a response: its new tokens when streaming, all of it (after the prompt unless
    exclude_input_in_output) otherwise; `empty` (or no output yet): no tokens, "" and [] logprobs."""
    if out is None or empty:
        ids, text, logprobs = [], "", [] if out is None or out.logprobs is not None else None
    elif request.stream:
        ids, text, logprobs = out.new_token_ids, out.text_delta or "", out.new_logprobs
    else:
        ids, text, logprobs = out.token_ids, out.text or "", out.logprobs
        if not request.exclude_input_in_output:
            text = _prompt_text(request) + text
    # vllm_backend's finish_reason: "None" until the sequence ends
    reason = (out.finish_reason or "") if out is not None and out.finished else str(None)
    cumulative = None if out is None else out.cumulative_logprob
    return _SequenceValues(
        ids, text, reason,
        "null" if not request.logprobs_asked or logprobs is None else logprobs_json(logprobs, request.codec),
        float("nan") if cumulative is None else cumulative,
    )


def _sequence_tensors(sequences: Sequence[_SequenceValues], request: GenerateRequest, has_tokenizer: bool,
                      num_input_tokens: int) -> dict[str, np.ndarray]:
    """The text and the additional outputs the request asked for, one element per sequence."""
    tensors: dict[str, np.ndarray] = {}
    if request.return_num_input_tokens:
        tensors["num_input_tokens"] = np.asarray([num_input_tokens], dtype=np.uint32)
    if request.return_num_output_tokens:  # this response's tokens (all of them on a single response)
        tensors["num_output_tokens"] = np.asarray([len(q.ids) for q in sequences], dtype=np.uint32)
    if has_tokenizer:
        tensors["text_output"] = np.asarray([q.text.encode("utf-8") for q in sequences], dtype=np.object_)
    if request.return_finish_reason:
        tensors["finish_reason"] = np.asarray([q.finish_reason.encode() for q in sequences], dtype=np.object_)
    if request.return_logprobs:
        tensors["logprobs"] = np.asarray([q.logprobs.encode("utf-8") for q in sequences], dtype=np.object_)
    if request.return_cumulative_logprob:
        tensors["cumulative_logprob"] = np.asarray([q.cumulative_logprob for q in sequences], dtype=np.float32)
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
