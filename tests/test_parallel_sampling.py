"""Parallel sampling (SamplingParams.n > 1) without a server: n's range, the children's ids and seeds
(orca/frontend/parallel_sampling.py), the engine core's refusal of n > 1, and the n-element response tensors
of orca_gpt (orca_triton.generate.parent_response_tensors, vllm_backend's layout). Through the real
tritonserver: tests/test_server_vllm_compat.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _fixtures import FakeCodec, s, tiny_checkpoint

from orca import EngineConfig, LLMEngine, SamplingParams
from orca.frontend.output_processor import RequestOutput
from orca.frontend.parallel_sampling import ParentRequest, child_params, child_request_id
from orca.sampling_params import MAX_INT64, MAX_N
from orca_triton.generate import parent_response_tensors, parse_generate_request


def test_n_is_an_integer_in_its_range() -> None:
    assert SamplingParams(n=MAX_N).n == MAX_N and SamplingParams().n == 1
    for bad in (0, MAX_N + 1, True, 1.5, "2"):
        with pytest.raises(ValueError, match=rf"n must be .*>= 1 and <= {MAX_N}"):
            SamplingParams(n=bad)  # type: ignore[arg-type]
    assert SamplingParams.from_dict({"n": "3"}).n == 3  # vllm_backend's strings, converted


def test_children_get_their_own_ids_and_seeds() -> None:
    params = SamplingParams(n=3, temperature=0.8, seed=MAX_INT64 - 1, max_tokens=5)
    children = child_params(params)
    assert [c.n for c in children] == [1, 1, 1] and {c.max_tokens for c in children} == {5}
    assert [c.seed for c in children] == [MAX_INT64 - 1, MAX_INT64, 0]  # seed + i, wrapping in its range
    assert [c.seed for c in child_params(SamplingParams(n=2))] == [None, None]
    parent = ParentRequest("r7", 3)
    assert parent.child_ids == [child_request_id("r7", i) for i in range(3)] == ["r7.0", "r7.1", "r7.2"]
    assert parent.index("r7.2") == 2 and not parent.finished


def test_the_engine_core_takes_one_sequence_per_request() -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("gpt2")), max_bs=2))
    with pytest.raises(ValueError, match="n must be 1 in the engine core, got n=2: a front end fans"):
        engine.add_request("a", [1, 2, 3], SamplingParams(n=2))


def _out(rid: str, new: list[int], ids: list[int], text: str, finished: bool = False, reason: str | None = None,
         cumulative: float | None = None) -> RequestOutput:
    return RequestOutput(rid, new, ids, 3, finished, reason, text_delta=text[-len(new):] if new else "", text=text,
                         cumulative_logprob=cumulative)


def _request(stream: bool, **flags: bool) -> object:
    inputs = {"text_input": s("abc"), "stream": np.array([stream]),
              "sampling_parameters": s('{"n": 2, "max_tokens": 4, "temperature": 0.5}'),
              **{k: np.array([v]) for k, v in flags.items()}}
    return parse_generate_request(inputs, {}, FakeCodec(), True)


FLAGS = dict(return_finish_reason=True, return_num_input_tokens=True, return_num_output_tokens=True,
             return_cumulative_logprob=True)


def test_a_streamed_response_carries_one_sequences_delta_and_empty_others() -> None:
    request = _request(True, **FLAGS)
    latest = [_out("r.0", [5], [4, 5], "de", cumulative=-1.5), None]
    t = parent_response_tensors(latest, 0, request, True)
    assert t["text_output"].tolist() == [b"e", b""] and t["num_output_tokens"].tolist() == [1, 0]
    assert t["finish_reason"].tolist() == [b"None", b"None"] and t["num_input_tokens"].tolist() == [3]
    assert t["cumulative_logprob"][0] == -1.5 and math.isnan(t["cumulative_logprob"][1])
    assert "output_ids" not in t and "num_cached_tokens" not in t  # n sequences: no flat output_ids
    latest = [_out("r.0", [5], [4, 5], "de", True, "length"), _out("r.1", [9], [8, 9], "hi", True, "stop")]
    t = parent_response_tensors(latest, 1, request, True)  # the last child finished: the FINAL's tensors
    assert t["text_output"].tolist() == [b"", b"i"] and t["finish_reason"].tolist() == [b"length", b"stop"]
    assert t["num_cached_tokens"].tolist() == [0]


def test_a_single_response_carries_every_sequence_whole_after_the_prompt() -> None:
    request = _request(False, return_num_output_tokens=True)
    latest = [_out("r.0", [5], [4, 5], "de", True, "length"), _out("r.1", [9], [7, 8, 9], "fgh", True, "length")]
    t = parent_response_tensors(latest, 1, request, True)
    assert t["text_output"].tolist() == [b"abcde", b"abcfgh"] and t["num_output_tokens"].tolist() == [2, 3]
    assert set(t) == {"text_output", "num_output_tokens", "num_cached_tokens"}
