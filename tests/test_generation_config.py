"""Sampling defaults from the checkpoint's generation_config.json: a request that leaves temperature,
top_k or top_p out gets the model's (Triton's generate and gRPC, hence orca-openai, and orca.LLM), one
that gives them keeps its own; and orca-client chat's own default temperature."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from _fixtures import tiny_checkpoint
from checkpoints import with_generation_config

from orca import LLM, SamplingParams
from orca.frontend.generation_config import describe_sampling_defaults, read_sampling_defaults
from orca_triton.generate import parse_generate_request

RECOMMENDED = {"temperature": 0.6, "top_p": 0.9, "top_k": 20}


class IdCodec:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 200 for c in text]

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(i) for i in token_ids)


@pytest.fixture(scope="module")
def recommended(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GPT-2 with a generation config that recommends sampling (and keeps its token ids)."""
    return with_generation_config(tiny_checkpoint("gpt2"), tmp_path_factory.mktemp("gencfg") / "gpt2",
                                  **RECOMMENDED, max_new_tokens=99, do_sample=True)


def _write(path: Path, config: dict | str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "generation_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def test_read_sampling_defaults(recommended: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert read_sampling_defaults(recommended) == RECOMMENDED  # max_new_tokens is no default (as in vLLM)
    assert json.loads((recommended / "generation_config.json").read_text())["eos_token_id"] == 210
    # token ids only (the converted SmolLM2 GGUF's), no file, nulls: no defaults
    assert read_sampling_defaults(_write(tmp_path / "ids", {"bos_token_id": 1, "eos_token_id": 2})) == {}
    assert read_sampling_defaults(tmp_path / "none") == {}
    assert read_sampling_defaults(_write(tmp_path / "null", {"temperature": None})) == {}
    # a value SamplingParams refuses is left out with a warning; the valid ones still apply
    with caplog.at_level(logging.WARNING):
        bad = read_sampling_defaults(_write(tmp_path / "bad", {"temperature": 0.3, "top_p": 0.0, "top_k": "x"}))
        assert read_sampling_defaults(_write(tmp_path / "junk", "{not json")) == {}
    assert bad == {"temperature": 0.3}
    assert "top_p must be in (0, 1]" in caplog.text and "top_k must be an integer" in caplog.text
    assert "temperature=0.6, top_k=20, top_p=0.9" in describe_sampling_defaults(RECOMMENDED, recommended)
    assert "temperature=1.0" in describe_sampling_defaults({}, tmp_path)


def _parse(defaults: dict, sampling: dict | None = None, parameters: dict | None = None) -> SamplingParams:
    inputs = {"input_ids": np.array([1, 2, 3])}
    if sampling is not None:
        inputs["sampling_parameters"] = np.array([json.dumps(sampling).encode()], dtype=object)
    return parse_generate_request(inputs, parameters or {}, IdCodec(), False, sampling_defaults=defaults).params


def test_generate_requests_get_the_model_defaults_and_their_own_values_win() -> None:
    params = _parse(RECOMMENDED)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.9, 20, 16)
    # a key the request gives wins, in sampling_parameters or, without that input, as a request parameter
    # (orca-openai sends only the keys its client gave, so its requests get the same)
    params = _parse(RECOMMENDED, {"temperature": 0, "max_tokens": 4})
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0, 0.9, 20, 4)
    params = _parse(RECOMMENDED, parameters={"top_k": 0, "max_tokens": 4})
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.9, 0, 4)
    assert _parse(RECOMMENDED, parameters={"top_p": 1.0}).top_p == 1.0
    # with the input sent, request parameters are not read (as vllm_backend): the defaults fill the rest
    assert _parse(RECOMMENDED, {"max_tokens": 4}, {"top_k": 0}).top_k == 20
    # no defaults: SamplingParams' own
    params = _parse({})
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)
    assert _parse({"temperature": 0.2}, {"temperature": 1.5}).temperature == 1.5


def test_offline_llm_uses_the_defaults_when_given_no_sampling_params(recommended: Path) -> None:
    # The defaults sample (temperature 0.6) and keep EOS: with seeds from the OS a draw could stop early (a CI
    # run stopped at 14 of 16 tokens). Seed 0 seeds the requests' seeds: the first request draws 16 tokens.
    llm = LLM(model=str(recommended), max_bs=2, seed=0)
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.top_p, default.top_k, default.max_tokens) == (0.6, 0.9, 20, 16)
    seen: list[SamplingParams] = []
    add_request = llm.engine.add_request

    def recording(request_id: str, prompt: list[int], params: SamplingParams, **kw: object) -> None:
        seen.append(params)
        add_request(request_id, prompt, params, **kw)

    llm.engine.add_request = recording  # type: ignore[method-assign]
    out = llm.generate([[1, 2, 3]])
    assert len(out[0].token_ids) == 16 and seen[-1] == default
    # a SamplingParams the user builds keeps its own values (every field has one)
    mine = SamplingParams(max_tokens=3, temperature=0)
    llm.generate([[1, 2, 3]], mine)
    assert seen[-1] == mine and seen[-1].top_p == 1.0
    # the incremental API: add_request without params gets the defaults too
    core_params: list[SamplingParams] = []
    core_add = llm.engine.core.add_request
    llm.engine.core.add_request = lambda rid, ids, params, *a, **kw: (  # type: ignore[method-assign]
        core_params.append(params), core_add(rid, ids, params, *a, **kw))
    add_request("incremental", [1, 2, 3])
    assert core_params == [default]
    llm.engine.abort_request("incremental")


def test_orca_client_chat_defaults_to_a_low_temperature(capsys: pytest.CaptureFixture) -> None:
    from orca_client.cli import CHAT_TEMPERATURE, CHAT_TOP_P, _sampling, build_parser

    parser = build_parser()
    chat = parser.parse_args(["chat", "hello"])
    assert chat.temperature == CHAT_TEMPERATURE == 0.2 and _sampling(chat)["temperature"] == 0.2
    assert chat.top_p == CHAT_TOP_P == 0.9 and _sampling(chat)["top_p"] == 0.9
    assert parser.parse_args(["chat", "hello", "--temperature", "1.0"]).temperature == 1.0  # explicit wins
    assert parser.parse_args(["chat", "hello", "--temperature", "0"]).temperature == 0
    assert parser.parse_args(["chat", "hello", "--top-p", "1"]).top_p == 1
    # generate leaves it to the server (the model's generation config); top_k stays unset for both
    generate = parser.parse_args(["generate", "--text", "hi"])
    assert generate.temperature is None and generate.top_p is None and chat.top_k is None
    with pytest.raises(SystemExit):
        parser.parse_args(["chat", "--help"])
    out = capsys.readouterr().out
    assert "default: 0.2" in out and "default: 0.9" in out
