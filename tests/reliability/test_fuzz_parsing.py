"""Fuzzed requests at the parsing layer: orca_triton.generate.parse_generate_request (Triton tensors and request
parameters -> GenerateRequest) and SamplingParams, followed by the engine's own request validation
(LLMEngine.validate, which EngineLoop.submit runs), exactly as model.py chains them.

For any input -- numpy arrays of any dtype and shape (empty, 0-d, 2-D, long), strings with unicode, NUL,
lone surrogates and invalid UTF-8, JSON with nested objects, NaN/Infinity, unknown keys, deep nesting and
over-long numbers, out-of-range and wrong-typed values for every sampling field, in sampling_parameters and
in the request parameters map -- the pair either accepts the request, and then the request is one the
engine can serve (checked here field by field, independently of SamplingParams, and its response tensors
can be built), or raises ValueError whose message names the offending field (and, for numeric fields, the
allowed range). Any other exception fails the test: in the server it would be an INTERNAL error, or worse.

Both real codecs model.py passes: the tiny GPT-2 engine without a tokenizer (vocab 211, context 128, a
96-slot K/V pool, so both length limits are reachable) and SmolLM2's engine with its tokenizer and chat
template. Deterministic (derandomize=True, no example database): the same examples on every run.
`pytest --hypothesis-show-statistics` prints how many examples each test ran.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any

import numpy as np
import pytest
from _fixtures import smollm2, tiny_engine
from hypothesis import HealthCheck, event, settings
from hypothesis import given as hyp_given
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.extra import numpy as hnp

from orca import LLMEngine, Logprob, RequestOutput
from orca.frontend.parallel_sampling import child_params
from orca.sampling_params import (
    MAX_INT64,
    MAX_LOGPROBS,
    MAX_N,
    ORCA_SCALAR_TYPES,
    VLLM_SCALAR_TYPES,
    SamplingParams,
)
from orca.structured_outputs_params import StructuredOutputs
from orca_triton.generate import (
    INPUT_NAMES,
    PROMPT_INPUTS,
    RETURN_FLAGS,
    GenerateRequest,
    parse_generate_request,
    response_tensors,
)

FUZZ = settings(
    derandomize=True, database=None, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def fuzz(examples: int) -> settings:
    return settings(FUZZ, max_examples=examples)

SAMPLING_FIELDS = SamplingParams.field_names()
NUMERIC_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "logprobs", "stop_token_ids", "n")
BOOL_INPUTS = ("stream", "exclude_input_in_output", *RETURN_FLAGS)
# A numeric field's message states the allowed range: an interval, a bound, or an enumeration.
RANGE = re.compile(r"[\[(]-?\d.*[\])]|[<>]=? ?-?\d|at (most|least) \d")


# -- the two codecs ----------------------------------------------------------------------------------
@functools.cache
def codec(kind: str) -> LLMEngine:
    if kind == "no_tokenizer":
        return tiny_engine("gpt2", n_slots=96, block_size=16)  # context 128 > 96 slots: both limits reachable
    return smollm2().engine  # only validate() and the tokenizer are used: the engine stays idle


@pytest.fixture(scope="module", params=["no_tokenizer", "tokenizer"])
def engine(request: pytest.FixtureRequest) -> LLMEngine:
    return codec(request.param)


def outcome(engine: LLMEngine, inputs: dict[str, Any], parameters: dict[str, Any]) -> str | GenerateRequest:
    """What model.py does up to submission: the ValueError's message, or the request the engine takes.
    Any other exception propagates and fails the test."""
    try:
        request = parse_generate_request(inputs, parameters, engine.text, engine.tokenizer is not None)
        # n > 1 reaches the engine as n requests of n = 1 (model.py, orca/frontend/parallel_sampling.py)
        engine.validate(request.prompt_token_ids, child_params(request.params)[0], request.cache_salt)
    except ValueError as exc:
        message = str(exc)
        assert message and len(message) < 2000, message  # clear, and clipped however large the input
        message.encode("utf-8")  # Triton's error carries UTF-8: a lone surrogate echoed back would not pass
        _event("refused")
        return message
    check_servable(engine, request)
    _event("accepted")
    return request


def _event(name: str) -> None:
    """Counted in `pytest --hypothesis-show-statistics` (how many examples were accepted, refused)."""
    if currently_in_test_context():
        event(name)


def check_servable(engine: LLMEngine, request: GenerateRequest) -> None:
    """An accepted request holds only what the engine can serve (the rules restated, not SamplingParams'
    own checks), and its responses can be built."""
    ids, p = request.prompt_token_ids, request.params
    vocab = engine.model_config.vocab_size
    assert ids and all(type(t) is int and 0 <= t < vocab for t in ids)
    assert type(p.max_tokens) is int and 1 <= p.max_tokens
    assert len(ids) + p.max_tokens <= min(engine.max_model_len, engine.n_slots)
    assert type(p.temperature) in (int, float) and math.isfinite(p.temperature) and p.temperature >= 0
    assert type(p.top_k) is int and 0 <= p.top_k <= MAX_INT64
    assert type(p.top_p) in (int, float) and 0 < p.top_p <= 1
    assert p.seed is None or (type(p.seed) is int and 0 <= p.seed <= MAX_INT64)
    assert isinstance(p.stop, tuple) and all(type(s) is str and s for s in p.stop)
    for s in p.stop:
        s.encode("utf-8")
    assert not p.stop or engine.tokenizer is not None
    assert isinstance(p.stop_token_ids, tuple) and all(type(t) is int and t >= 0 for t in p.stop_token_ids)
    assert type(p.ignore_eos) is bool
    assert type(p.speculate) is bool
    assert p.logprobs is None or (type(p.logprobs) is int and 0 <= p.logprobs <= MAX_LOGPROBS)
    assert p.structured_outputs is None or (isinstance(p.structured_outputs, StructuredOutputs)
                                            and engine.tokenizer is not None)
    for flag in (request.stream, request.exclude_input_in_output, request.return_logprobs,
                 request.return_cumulative_logprob):
        assert type(flag) is bool
    if request.cache_salt is not None:
        assert type(request.cache_salt) is str and 1 <= len(request.cache_salt) <= 1024
        request.cache_salt.encode("utf-8")
    # The final response of a finished request (non-streaming: the prompt's text is echoed).
    lp = [{3: Logprob(-0.5, 1)}]
    out = RequestOutput("r", new_token_ids=[3], token_ids=[3], num_prompt_tokens=len(ids), finished=True,
                        finish_reason="length", text_delta="x", text="x", new_logprobs=lp, logprobs=lp,
                        cumulative_logprob=-0.5)
    tensors = response_tensors(out, request, engine.tokenizer is not None)
    assert tensors["output_ids"].tolist() == [3]
    if "text_output" in tensors:
        text = tensors["text_output"][0].decode("utf-8")
        if not request.stream and not request.exclude_input_in_output and "messages" not in request_kinds(request):
            prompt = request.prompt_text if request.prompt_text is not None else engine.decode(ids)
            assert text == prompt + "x"  # the non-streaming echo: the prompt's text, then the completion


def request_kinds(request: GenerateRequest) -> set[str]:
    """Which prompt input the request came from: text_input keeps its text, input_ids echo their decoded
    text, messages echo nothing."""
    if request.prompt_text is not None:
        return {"text_input"}
    return {"input_ids"} if request.echo_ids else {"messages"}


def assert_blames(message: str, names: set[str], numeric: bool) -> None:
    assert any(name in message for name in names), f"{message!r} names none of {sorted(names)}"
    if numeric:
        assert RANGE.search(message), f"{message!r} gives no allowed range"


# -- strategies --------------------------------------------------------------------------------------
EDGE_INTS = [0, 1, -1, 2, 16, 20, 21, 127, 128, 210, 211, 2**31 - 1, 2**31, 2**32, MAX_INT64, 2**63, 2**64,
             -(2**63), 10**30, -(10**40), 10**300]
EDGE_FLOATS = [0.0, -0.0, 1.0, 0.5, 1.0000001, 1e-9, 1e-320, -1e-320, 5e-324, 1e308, 1.7976931348623157e308,
               -1.5, 2.0, 16.0, math.nan, math.inf, -math.inf]
WILD_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=24) | st.sampled_from(
    ["", " ", "\x00", "a\x00b", "\ud800", "x\udfff", "é", "日本語", "🙂" * 5, "\u202e\u200b", "[", "[1, 2]", "null",
     '["a"]', "NaN", "Infinity", "-1", "1e999", "true", "{}", '{"a": 1}'])
SCALARS = (st.none() | st.booleans() | st.integers() | st.sampled_from(EDGE_INTS)
           | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(EDGE_FLOATS) | WILD_TEXT)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(WILD_TEXT, children, max_size=3),
    max_leaves=8,
)


def valid_value(field: str) -> st.SearchStrategy[Any]:
    """Values SamplingParams takes for `field` (the engine may still refuse a long max_tokens)."""
    return {
        "max_tokens": st.integers(1, 200),
        "temperature": st.floats(0, 5) | st.integers(0, 3),
        "top_k": st.integers(0, 300),
        "top_p": st.floats(1e-6, 1),
        "seed": st.none() | st.integers(0, MAX_INT64),
        "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
        "stop_token_ids": st.lists(st.integers(0, 300), max_size=3),
        "ignore_eos": st.booleans(),
        "speculate": st.booleans(),
        "lora_name": st.none() | st.text(min_size=1, max_size=8),
        "logprobs": st.none() | st.integers(0, MAX_LOGPROBS),
        "n": st.integers(1, MAX_N),
        "structured_outputs": st.none() | st.sampled_from([
            {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}, {"json_object": True},
            {"regex": "[a-z]{1,5}"}, {"choice": ["yes", "no"]}, {"grammar": 'root ::= "a" | "b"'},
            '{"json": {"type": "string"}, "disable_any_whitespace": true}']),
    }[field]


def vllm_value(field: str, sent: Any) -> Any:
    """What SamplingParams.from_dict makes of a value it accepts: a string of a scalar field converted to
    the type vLLM declares; null stop and stop_token_ids, and top_k -1, off."""
    kind = VLLM_SCALAR_TYPES.get(field, ORCA_SCALAR_TYPES.get(field))
    if isinstance(sent, str) and kind is not None:
        text = sent.strip()
        sent = {"true": True, "false": False, "1": True, "0": False}[text.lower()] if kind is bool else kind(text)
    if field in ("stop", "stop_token_ids") and sent is None:
        return []
    if field == "top_k" and sent == -1 and not isinstance(sent, bool):
        return 0
    return sent


def field_value(field: str) -> st.SearchStrategy[Any]:
    """Mostly wild values, some valid ones, and each numeric field's edges."""
    return JSON_VALUES | valid_value(field) | st.sampled_from(EDGE_INTS + EDGE_FLOATS)


def s(value: str | bytes) -> np.ndarray:
    return np.array([value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value], dtype=object)


def base_inputs(engine: LLMEngine) -> dict[str, np.ndarray]:
    return {"input_ids": np.array([5, 6, 7], dtype=np.int32)}


def sampling_json(values: dict[str, Any]) -> np.ndarray:
    return s(json.dumps(values))  # NaN and Infinity as JSON's common extension, as clients send them


# -- every sampling field, in sampling_parameters and in the request parameters ----------------------
@fuzz(700)
@hyp_given(data=st.data())
def test_every_sampling_field_fuzzed(engine: LLMEngine, data: st.DataObject) -> None:
    field = data.draw(st.sampled_from(SAMPLING_FIELDS), label="field")
    value = data.draw(field_value(field), label="value")
    channel = data.draw(st.sampled_from(["sampling_parameters", "parameters", "parameters_as_string"]))
    inputs, parameters = base_inputs(engine), {}
    if channel == "sampling_parameters":
        inputs["sampling_parameters"] = sampling_json({field: value})
    elif channel == "parameters":
        parameters[field] = value
    else:  # Triton's parameters are scalars: lists travel as JSON in a string
        parameters[field] = json.dumps(value)
    result = outcome(engine, inputs, parameters)
    if isinstance(result, str):
        assert_blames(result, {field}, field in NUMERIC_FIELDS)
        return
    # Accepted: the field holds exactly the value sent (a string as vllm_backend converts it).
    got = getattr(result.params, field)
    sent = parameters.get(field, value)
    if isinstance(sent, str) and field in ("stop", "stop_token_ids") and channel != "sampling_parameters":
        sent = [sent] if field == "stop" and not sent.startswith("[") else json.loads(sent)
    if field == "stop" and isinstance(sent, str):
        sent = [sent]
    sent = vllm_value(field, sent)
    if field == "structured_outputs":
        assert got == (None if sent is None else StructuredOutputs.parse(sent)), (got, sent)
        return
    if isinstance(sent, list):
        sent = tuple(sent)
    assert got == sent and (type(got) is type(sent) or {type(got), type(sent)} == {int, float}), (got, sent)


@fuzz(300)
@hyp_given(values=st.dictionaries(st.sampled_from(SAMPLING_FIELDS), JSON_VALUES, min_size=2, max_size=5))
def test_several_fields_at_once(engine: LLMEngine, values: dict[str, Any]) -> None:
    """Several fields wrong (or right) together: the message names one of them."""
    result = outcome(engine, {**base_inputs(engine), "sampling_parameters": sampling_json(values)}, {})
    if isinstance(result, str):
        assert_blames(result, set(values), numeric=False)


# -- the sampling_parameters tensor itself ----------------------------------------------------------
DEEP = ["[" * 100_000, "{\"a\":" * 50_000 + "1" + "}" * 50_000, '{"max_tokens": ' + "9" * 5000 + "}",
        '{"top_k": ' + "1" * 4301 + "}", '{"temperature": NaN}', '{"temperature": -Infinity}',
        '{"top_p": 1e999}', '{"max_tokens": 4, "max_tokens": 0}', "{\"seed\": 1" + "0" * 40 + "}",
        "\ufeff{}", '{"stop": ["\\ud800"]}', '{"stop": ["a\\u0000b"]}', "", "   ", "null", "[]", "1", '"x"']


@fuzz(500)
@hyp_given(
    text=st.one_of(
        st.sampled_from(DEEP),
        WILD_TEXT,
        st.builds(json.dumps, JSON_VALUES),
        st.builds(json.dumps, st.dictionaries(WILD_TEXT | st.sampled_from(SAMPLING_FIELDS), JSON_VALUES, max_size=4)),
    ),
    raw=st.none() | st.binary(max_size=12),
)
def test_sampling_parameters_text_fuzzed(engine: LLMEngine, text: str, raw: bytes | None) -> None:
    payload = raw if raw is not None else text
    result = outcome(engine, {**base_inputs(engine), "sampling_parameters": s(payload)}, {})
    if isinstance(result, str):
        assert_blames(result, {"sampling_parameters", *SAMPLING_FIELDS}, numeric=False)


# -- the request parameters map (Triton's JSON of the request's parameters) --------------------------
@fuzz(300)
@hyp_given(
    parameters=st.dictionaries(
        st.sampled_from((*SAMPLING_FIELDS, "cache_salt")) | WILD_TEXT | st.text(min_size=41, max_size=60),
        st.none() | st.booleans() | st.integers() | st.floats() | WILD_TEXT | JSON_VALUES,
        min_size=1, max_size=4,
    )
)
def test_request_parameters_fuzzed(engine: LLMEngine, parameters: dict[str, Any]) -> None:
    result = outcome(engine, base_inputs(engine), parameters)
    if isinstance(result, str):
        # An unknown key is shown clipped to 40 characters, quoted when empty, blank or unprintable.
        assert_blames(result, {k[:40] for k in parameters} | {repr(k)[:40] for k in parameters}, numeric=False)


# -- the tensors: every input, any dtype, any shape ------------------------------------------------
DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.float16,
          np.float32, np.float64, np.bool_, np.complex64, np.dtype("U4"), np.dtype("S4")]
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3)


def object_arrays(elements: st.SearchStrategy[Any]) -> st.SearchStrategy[np.ndarray]:
    return SHAPES.flatmap(lambda shape: st.lists(elements, min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))
                          .map(lambda xs: np.array(xs + [None], dtype=object)[:-1].reshape(shape)))


WILD_ARRAYS = st.one_of(
    st.sampled_from(DTYPES).flatmap(lambda dt: hnp.arrays(dt, SHAPES)),
    object_arrays(st.binary(max_size=10) | WILD_TEXT.map(lambda t: t.encode("utf-8", "surrogatepass"))),
    object_arrays(WILD_TEXT | st.integers() | st.none() | st.floats()),
    st.sampled_from([
        np.zeros(0, np.int32), np.array(5, np.int32), np.array([True]).reshape(1, 1),
        np.arange(200_000, dtype=np.int32), np.full(9000, 3, np.int64), np.array([2**63 - 1, 2**64 - 1], np.uint64),
        np.array([-(2**63)], np.int64), np.array([b"\xff\xfe"], dtype=object),
        np.array([b"\xed\xa0\x80"], dtype=object),
        np.array([b"a" * 100_000], dtype=object), np.array([b"\x00"], dtype=object), np.array([b""], dtype=object),
        np.array(["\ud800"], dtype=object), np.array([b"[" * 100_000], dtype=object),
    ]),
)
# The messages the engine writes about a prompt name it "prompt" (empty, too long, ids out of range).
ALIASES = {name: {name, "prompt"} for name in PROMPT_INPUTS}


@fuzz(700)
@hyp_given(data=st.data())
def test_any_input_tensor_fuzzed(engine: LLMEngine, data: st.DataObject) -> None:
    """One input of an otherwise valid request replaced by an arbitrary array (or a prompt input added or
    taken away): refused naming that input, or accepted and servable."""
    prompt = data.draw(st.sampled_from(PROMPT_INPUTS if engine.tokenizer is not None else ("input_ids",)))
    valid = {"input_ids": np.array([5, 6, 7], np.int32), "text_input": s("The capital of France is"),
             "messages": s(json.dumps([{"role": "user", "content": "Hi"}]))}
    inputs = {prompt: valid[prompt]}
    for flag in data.draw(st.lists(st.sampled_from(BOOL_INPUTS), max_size=3, unique=True)):
        inputs[flag] = np.array([data.draw(st.booleans())])
    if "stream" in inputs and inputs["stream"][0] and "exclude_input_in_output" in inputs:
        inputs["exclude_input_in_output"] = np.array([True])  # stream with the prompt: refused (vllm_backend's)
    name = data.draw(st.sampled_from(INPUT_NAMES))
    action = data.draw(st.sampled_from(["replace", "replace", "replace", "drop_prompt"]))
    if action == "drop_prompt":
        del inputs[prompt]
        blamed = {"prompt"}
    else:
        inputs[name] = data.draw(WILD_ARRAYS, label=name)
        blamed = ALIASES.get(name, {name})
        if name in PROMPT_INPUTS and name != prompt:  # a second prompt input
            blamed = {"prompt input"}
        elif name == "sampling_parameters":
            blamed = {"sampling_parameters", *SAMPLING_FIELDS}
    result = outcome(engine, inputs, {})
    if isinstance(result, str):
        assert_blames(result, blamed, numeric=False)


@fuzz(300)
@hyp_given(
    ids=st.lists(st.integers(-(2**63), 2**64 - 1) | st.sampled_from(EDGE_INTS[:12]), max_size=40),
    dtype=st.sampled_from([np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32, np.uint64]),
)
def test_input_ids_values_fuzzed(engine: LLMEngine, ids: list[int], dtype: Any) -> None:
    """Ids of every integer dtype, anywhere in its range (as Triton would hand them over): out-of-range ids
    are refused by the engine with the vocabulary's range before any tokenizer sees them."""
    info = np.iinfo(dtype)
    arr = np.array([min(max(i, info.min), info.max) for i in ids], dtype=dtype)
    result = outcome(engine, {"input_ids": arr}, {"max_tokens": 1})
    if isinstance(result, str):
        assert_blames(result, {"prompt", "input_ids"}, numeric=bool(ids))


# -- messages (the chat prompt) ---------------------------------------------------------------------
CHAT_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": WILD_TEXT | st.text(max_size=200)},
)
MESSAGE = CHAT_MESSAGE | st.dictionaries(
    st.sampled_from(["role", "content", "name", "tool_calls"]) | WILD_TEXT, JSON_VALUES, max_size=3
)


@fuzz(300)
@hyp_given(
    messages=st.one_of(st.lists(CHAT_MESSAGE, min_size=1, max_size=4).map(json.dumps),  # the chat template's
                       st.lists(MESSAGE, max_size=4).map(json.dumps), JSON_VALUES.map(json.dumps),  # input
                       WILD_TEXT, st.sampled_from(DEEP)),
)
def test_messages_fuzzed(engine: LLMEngine, messages: str) -> None:
    result = outcome(engine, {"messages": s(messages)}, {"max_tokens": 4})
    if isinstance(result, str):
        assert_blames(result, {"messages", "prompt"}, numeric=False)


@fuzz(300)
@hyp_given(text=WILD_TEXT | st.text(max_size=300) | st.binary(max_size=20))
def test_text_input_fuzzed(engine: LLMEngine, text: str | bytes) -> None:
    result = outcome(engine, {"text_input": s(text)}, {"max_tokens": 4})
    if isinstance(result, str):
        assert_blames(result, {"text_input", "prompt"}, numeric=False)


# -- what the fuzzing found, pinned -----------------------------------------------------------------
# Each of these raised something other than ValueError (an INTERNAL error in the server; the top_k one
# failed the whole iteration, every request batched with it included), or gave a message without the
# field or the allowed range, before the fixes in orca_triton/generate.py and orca/sampling_params.py.
FOUND = [
    # SamplingParams took any top_k; the worker's int64 tensor overflowed and the iteration failed.
    ("no_tokenizer", {"sampling_parameters": '{"top_k": 100000000000000000000000000000}'}, {},
     r"top_k must be >= 0 and <= 9223372036854775807 \(0 = off\), got 100000000000000000000000000000$"),
    # The tokenizer decoded the prompt's ids before the engine checked them: OverflowError.
    ("tokenizer", {"input_ids": np.array([-1], np.int64)}, {}, r"prompt token id -1 is out of range.*\[0, 49151\]"),
    ("tokenizer", {"input_ids": np.array([2**64 - 1], np.uint64)}, {}, r"out of range.*\[0, 49151\]"),
    # A lone surrogate in a chat message: the tokenizer raised TypeError.
    ("tokenizer", {"messages": '[{"role": "user", "content": "\\ud800"}]'}, {}, r"messages\[0\]: content is not valid"),
    ("tokenizer", {"messages": '[{"role": "user", "content": "hi"}]', "sampling_parameters": '{"stop": ["\\udfff"]}'},
     {}, r"stop\[0\] is not valid Unicode"),
    # Nesting deeper than Python's recursion limit: RecursionError.
    ("no_tokenizer", {"sampling_parameters": "[" * 100_000}, {}, r"sampling_parameters is nested too deeply"),
    ("no_tokenizer", {"messages": "[" * 100_000}, {}, r"messages is nested too deeply"),
    ("no_tokenizer", {}, {"stop_token_ids": "[" * 100_000}, r"stop_token_ids .* is nested too deeply"),
    # An integer of more than 4300 digits: Python's own ValueError, naming nothing the client sent.
    ("no_tokenizer", {"sampling_parameters": '{"max_tokens": ' + "9" * 5000 + "}"}, {},
     r"sampling_parameters holds an integer of more than 4300 digits"),
    # Messages without the range: type errors said only "must be an integer".
    ("no_tokenizer", {}, {"max_tokens": "1.5"}, r"max_tokens must be an integer >= 1 .*, got string '1.5'"),
    ("no_tokenizer", {}, {"top_k": 2.5}, r"top_k must be an integer >= 0 and <= 9223372036854775807"),
    ("no_tokenizer", {}, {"temperature": math.nan}, r"temperature must be a finite number >= 0"),
    ("no_tokenizer", {}, {"top_p": "0.9x"}, r"top_p must be a number in \(0, 1\]"),
    ("no_tokenizer", {}, {"seed": -1}, r"seed must be >= 0 and <= 9223372036854775807"),
    ("no_tokenizer", {}, {"stop_token_ids": "[1, -2]"}, r"stop_token_ids\[1\] must be >= 0, got -2"),
    ("no_tokenizer", {}, {"stop": '["a", 3]'}, r"stop\[1\] must be a non-empty string, got integer 3"),
    # The no-tokenizer refusal did not name the input.
    ("no_tokenizer", {"text_input": "hello"}, {}, r"text_input: this model .* has no tokenizer: send input_ids"),
    ("no_tokenizer", {"messages": '[{"role": "user", "content": "hi"}]'}, {},
     r"messages: this model .* has no tokenizer"),
    # A megabyte value was echoed whole; an empty unknown key was invisible.
    ("no_tokenizer", {}, {"ignore_eos": "x" * 1_000_000}, r"ignore_eos must be a boolean .*\(1000000 characters\)$"),
    ("no_tokenizer", {"sampling_parameters": '{"": 1}'}, {}, r"unknown sampling parameter\(s\) '';"),
    # A text_input of another type than BYTES was taken as its str().
    ("no_tokenizer", {"text_input": np.array([7], np.int32)}, {}, r"text_input must be a string \(BYTES"),
]


@pytest.mark.parametrize(("kind", "inputs", "parameters", "message"), FOUND)
def test_what_the_fuzzing_found(kind: str, inputs: dict[str, Any], parameters: dict[str, Any], message: str) -> None:
    engine = codec(kind)
    arrays = {k: v if isinstance(v, np.ndarray) else s(v) for k, v in inputs.items()}
    if not any(name in arrays for name in PROMPT_INPUTS):
        arrays["input_ids"] = np.array([5, 6, 7], np.int32)
    result = outcome(engine, arrays, parameters)
    assert isinstance(result, str) and re.search(message, result), result
