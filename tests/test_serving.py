"""orca_triton.generate: what a generate request means, checked without a server (the e2e tests cover the wire)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from orca import RequestOutput
from orca_triton.generate import GenerateRequest, parse_generate_request, response_tensors


class FakeCodec:
    """A stand-in tokenizer with an obvious mapping: one id per character."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(i) for i in token_ids)


def parse(inputs: dict, parameters: dict | None = None, has_tokenizer: bool = True) -> GenerateRequest:
    return parse_generate_request(inputs, parameters or {}, FakeCodec(), has_tokenizer)


def s(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=object)


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
        ({"messages": s('[{"role": "robot", "content": "x"}]')}, 'role must be "system", "user" or "assistant"'),
        ({"input_ids": np.array([1]), "stream": np.array([1])}, "stream must be a boolean"),
        ({"input_ids": np.array([1]), "sampling_parameters": s("[1]")}, "must be a JSON object"),
    ],
)
def test_invalid_requests_say_what_is_wrong(inputs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse(inputs)


def test_sampling_keys_from_json_and_request_parameters() -> None:
    req = parse(
        {"input_ids": np.array([1]), "sampling_parameters": s('{"max_tokens": 5, "stop": ["a", "b"]}')},
        {"temperature": 0.5},
    )
    assert (req.params.max_tokens, req.params.temperature, req.params.stop) == (5, 0.5, ("a", "b"))
    # Triton's HTTP parameters are scalars: one stop string, or a JSON list inside a string.
    assert parse({"input_ids": np.array([1])}, {"stop": "."}).params.stop == (".",)
    assert parse({"input_ids": np.array([1])}, {"stop": '[".", "!"]'}).params.stop == (".", "!")
    assert parse({"input_ids": np.array([1])}, {"stop_token_ids": "[7, 8]"}).params.stop_token_ids == (7, 8)
    with pytest.raises(ValueError, match="unknown request parameter"):
        parse({"input_ids": np.array([1])}, {"max_tokenz": 3})


def test_response_tensors_streaming_and_not() -> None:
    out = RequestOutput("r", new_token_ids=[9], token_ids=[8, 9], num_prompt_tokens=2, finished=True,
                       finish_reason="length", text_delta="b", text="ab")
    req = parse({"text_input": s("hi")})
    t = response_tensors(out, req, has_tokenizer=True)
    assert t["output_ids"].tolist() == [8, 9] and t["text_output"][0] == b"hiab"
    assert t["finish_reason"][0] == b"length" and t["num_output_tokens"].tolist() == [2]
    streamed = response_tensors(out, parse({"text_input": s("hi"), "stream": np.array([True])}), True)
    assert streamed["output_ids"].tolist() == [9] and streamed["text_output"][0] == b"b"
    no_text = response_tensors(out, parse({"input_ids": np.array([1])}, has_tokenizer=False), False)
    assert "text_output" not in no_text
