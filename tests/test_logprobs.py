"""Log-probabilities (SamplingParams.logprobs, vLLM's semantics) against transformers, and their plumbing:
computed only for the requests that ask, in fp32 from the raw logits each token was drawn from."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _fixtures import FAMILIES, FakeCodec, drain, s, tiny_checkpoint, tiny_engine, tiny_reference

from orca import LLM, LLMEngine, Logprob, RequestOutput, SamplingParams
from orca.core.plan import SamplingSpec, TokenLogprobs
from orca.worker.sampler import token_logprobs
from orca_triton.generate import logprobs_json, parse_generate_request, response_tensors

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9], [100]]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    tiny_checkpoint(request.param)
    return request.param


@torch.inference_mode()
def hf_log_softmax(model: object, ids: list[int]) -> torch.Tensor:
    """(len(ids), V) fp32 log_softmax of transformers' logits at every position of ids."""
    return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)  # type: ignore[operator]


def check_against_transformers(family: str, prompt: list[int], out: RequestOutput, n: int) -> None:
    ref = hf_log_softmax(tiny_reference(family), prompt + out.token_ids[:-1])[len(prompt) - 1 :]  # (N, V)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[step]
        assert next(iter(entry)) == token  # the drawn token first
        assert entry[token].rank == 1  # greedy: the most likely
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        top = row.topk(n)
        assert set(entry) == set(top.indices.tolist()) | {token}  # the drawn token and transformers' top n
        for rank, (i, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[i].logprob == pytest.approx(lp, abs=1e-4)
            assert entry[i].rank == rank
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-5)


def test_greedy_logprobs_equal_transformers(family: str) -> None:
    engine = tiny_engine(family, max_bs=4, n_slots=256)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3))
    final = drain(engine)
    for i, prompt in enumerate(PROMPTS):
        out = final[str(i)]
        check_against_transformers(family, prompt, out, 3)
        assert all(len(entry) == 3 for entry in out.logprobs or [])  # greedy: the drawn token is in the top 3


def test_requests_without_logprobs_get_none_in_a_mixed_batch(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny_engine(family, max_bs=4, n_slots=256)
    asks = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=n) for n in (3, None, 0)]
    for i, (prompt, params) in enumerate(zip(PROMPTS, asks)):
        engine.add_request(str(i), prompt, params)
    rows_computed: list[int] = []
    import orca.worker.worker as worker_module  # where the iteration looks token_logprobs up

    real = worker_module.token_logprobs

    def spy(logits, token_ids, rows, specs, request_ids):  # type: ignore[no-untyped-def]
        rows_computed.append(len(rows))
        return real(logits, token_ids, rows, specs, request_ids)

    monkeypatch.setattr(worker_module, "token_logprobs", spy)
    streamed: dict[str, list[dict[int, Logprob]]] = {"0": [], "2": []}
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == "1":
                assert out.logprobs is None and out.new_logprobs is None and out.cumulative_logprob is None
            else:
                assert out.new_logprobs is not None and len(out.new_logprobs) == len(out.new_token_ids)
                streamed[out.request_id] += out.new_logprobs
            if out.finished:
                final[out.request_id] = out
    assert rows_computed and max(rows_computed) == 2  # never the row of the request that did not ask
    check_against_transformers(family, PROMPTS[0], final["0"], 3)
    check_against_transformers(family, PROMPTS[2], final["2"], 0)
    assert all(len(entry) == 1 for entry in final["2"].logprobs or [])  # 0: the drawn token's only
    assert streamed["0"] == final["0"].logprobs and streamed["2"] == final["2"].logprobs
    assert final["1"].token_ids == tokens_alone(engine, PROMPTS[1])


def tokens_alone(engine: LLMEngine, prompt: list[int]) -> list[int]:
    """The same request alone, without logprobs: its tokens must not change."""
    engine.add_request("alone", prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    return drain(engine)["alone"].token_ids


def test_sampled_tokens_get_their_rank_from_the_raw_logits() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 3.0], [5.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    drawn = torch.tensor([2, 0, 1])
    specs = [SamplingSpec(1.0, 0, 1.0, 0, n) for n in (2, None, 0)]
    out = token_logprobs(logits, drawn, [0, 2], specs, ["a", "b", "c"])
    assert set(out) == {"a", "c"}
    lp = logits.log_softmax(-1)
    assert out["a"] == TokenLogprobs(2, pytest.approx(lp[0, 2].item()), 3, (3, 1),
                                     (pytest.approx(lp[0, 3].item()), pytest.approx(lp[0, 1].item())))
    assert out["c"].rank == 1 and out["c"].top_ids == () and out["c"].logprob == pytest.approx(-np.log(4))
    only_zero = token_logprobs(logits, drawn, [2], specs, ["a", "b", "c"])  # no top n asked at all
    assert only_zero == {"c": out["c"]}


def test_offline_generate_exposes_logprobs(family: str) -> None:
    llm = LLM(str(tiny_checkpoint(family)), n_slots=256)
    outs = llm.generate(PROMPTS[:2], [
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    ])
    assert outs[0].logprobs is not None and len(outs[0].logprobs) == 4
    assert outs[0].cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(outs[0].token_ids,
                                                                                          outs[0].logprobs)))
    assert outs[1].logprobs is None and outs[1].cumulative_logprob is None


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "21"])
def test_logprobs_outside_0_20_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match=r"logprobs must be an integer in \[0, 20\]"):
        SamplingParams(logprobs=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"logprobs must be an integer in \[0, 20\]"):
        SamplingParams.from_json(json.dumps({"logprobs": value}))
    assert SamplingParams(logprobs=0).logprobs == 0 and SamplingParams(logprobs=20).logprobs == 20
    # a string converts as vllm_backend converts it (vLLM declares logprobs int | None); the constructor takes none
    assert SamplingParams.from_json('{"logprobs": "2"}').logprobs == 2
    with pytest.raises(ValueError, match=r"logprobs must be an integer in \[0, 20\]"):
        SamplingParams(logprobs="2")  # type: ignore[arg-type]


# -- the serving layer: vllm_backend's flags and outputs -------------------------------------------------


def b(value: bool) -> np.ndarray:
    return np.array([value])


def out_after(n: int, finished: bool, logprobs: bool = True) -> RequestOutput:
    """A request that drew tokens 65, 66, ... (n so far) with logprob -0.5 each, the top alternative 90."""
    entries = [{65 + i: Logprob(-0.5, 1), 90: Logprob(-1.0, 2)} for i in range(n)] if logprobs else None
    return RequestOutput(
        "r", new_token_ids=[64 + n], token_ids=[65 + i for i in range(n)], num_prompt_tokens=2,
        finished=finished, finish_reason="length" if finished else None, text_delta=chr(64 + n),
        text="".join(chr(65 + i) for i in range(n)),
        new_logprobs=None if entries is None else entries[-1:], logprobs=entries,
        cumulative_logprob=None if entries is None else -0.5 * n,
    )


def parse(inputs: dict, parameters: dict | None = None) -> object:
    return parse_generate_request({"text_input": s("hi"), **inputs}, parameters or {}, FakeCodec(), True)


def test_flags_left_out_give_no_additional_outputs() -> None:
    """As vllm_backend: an additional output only when its flag is true (orca's own output_ids always,
    num_cached_tokens on the final response)."""
    req = parse({"stream": b(True)}, {"logprobs": 2})
    assert req.params.logprobs == 2  # type: ignore[attr-defined]
    t = response_tensors(out_after(2, False), req, True)  # type: ignore[arg-type]
    assert set(t) == {"output_ids", "text_output"}
    t = response_tensors(out_after(3, True), req, True)  # type: ignore[arg-type]
    assert set(t) == {"output_ids", "text_output", "num_cached_tokens"}


def test_flags_true_give_vllm_backend_outputs_on_every_response() -> None:
    flags = {f"return_{name}": b(True) for name in
             ("finish_reason", "num_input_tokens", "num_output_tokens", "logprobs", "cumulative_logprob")}
    req = parse({"stream": b(True), **flags, "sampling_parameters": s('{"logprobs": 1}')})
    t = response_tensors(out_after(2, False), req, True)  # type: ignore[arg-type]
    assert t["finish_reason"][0] == b"None"  # vllm_backend: str(None) until the last response
    assert t["num_output_tokens"].tolist() == [1]  # this response's tokens
    assert t["num_input_tokens"].tolist() == [2]
    assert json.loads(t["logprobs"][0]) == [{"66": {"logprob": -0.5, "rank": 1, "decoded_token": "B"},
                                              "90": {"logprob": -1.0, "rank": 2, "decoded_token": "Z"}}]
    assert t["cumulative_logprob"].dtype == np.float32 and t["cumulative_logprob"].tolist() == [-1.0]
    t = response_tensors(out_after(3, True), req, True)  # type: ignore[arg-type]
    assert t["finish_reason"][0] == b"length"
    # Not streaming: every token's entry on the one response.
    whole = parse({**flags, "sampling_parameters": s('{"logprobs": 1}')})
    t = response_tensors(out_after(3, True), whole, True)  # type: ignore[arg-type]
    assert len(json.loads(t["logprobs"][0])) == 3 and t["num_output_tokens"].tolist() == [3]


def test_flags_false_drop_outputs_and_logprobs_without_the_sampling_key_are_null() -> None:
    flags = {f"return_{name}": b(False) for name in ("finish_reason", "num_input_tokens", "num_output_tokens")}
    req = parse({**flags, "return_logprobs": b(True), "return_cumulative_logprob": b(True)})
    # cumulative_logprob needs the drawn tokens' log-probabilities: the engine computes those (logprobs 0)
    assert req.params.logprobs == 0  # type: ignore[attr-defined]
    t = response_tensors(out_after(2, True), req, True)  # type: ignore[arg-type]
    # (num_cached_tokens has no flag: a final response always carries it)
    assert set(t) == {"output_ids", "text_output", "logprobs", "cumulative_logprob", "num_cached_tokens"}
    assert t["logprobs"][0] == b"null"  # vllm_backend: logprobs not asked in the sampling parameters
    assert t["cumulative_logprob"].tolist() == [-1.0]
    assert parse({}).params.logprobs is None  # type: ignore[attr-defined]


def test_flag_values_and_logprobs_values_are_checked() -> None:
    with pytest.raises(ValueError, match="return_logprobs must be a boolean"):
        parse({"return_logprobs": np.array([1])})
    with pytest.raises(ValueError, match=r"logprobs must be an integer in \[0, 20\]"):
        parse({}, {"logprobs": 50})


def test_decoded_token_is_null_without_a_tokenizer() -> None:
    assert json.loads(logprobs_json([{7: Logprob(-0.25, 1)}], None)) == [
        {"7": {"logprob": -0.25, "rank": 1, "decoded_token": None}}
    ]


@pytest.mark.timeout(240)
def test_logprobs_with_tensor_and_pipeline_parallel_workers() -> None:
    """tp 2 x pp 2 worker processes (gloo): the last stage's tp rank 0 computes them, and the StepResult that
    carries them crosses the control plane: the same as one process."""
    from orca import EngineConfig

    asks = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=n) for n in (2, None, 0)]
    results = []
    for options in ({}, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}):
        engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("gpt2")), device="cpu", n_slots=256, **options))
        try:
            for i, (prompt, params) in enumerate(zip(PROMPTS, asks)):
                engine.add_request(str(i), prompt, params)
            results.append(drain(engine))
        finally:
            engine.shutdown()
    single, parallel = results
    for i in map(str, range(len(PROMPTS))):
        assert parallel[i].token_ids == single[i].token_ids
        if single[i].logprobs is None:
            assert parallel[i].logprobs is None
            continue
        assert parallel[i].logprobs is not None
        for a, b_ in zip(parallel[i].logprobs, single[i].logprobs):
            assert list(a) == list(b_) and [x.rank for x in a.values()] == [x.rank for x in b_.values()]
            assert [x.logprob for x in a.values()] == pytest.approx([x.logprob for x in b_.values()], abs=1e-4)
        assert parallel[i].cumulative_logprob == pytest.approx(single[i].cumulative_logprob, abs=1e-4)
