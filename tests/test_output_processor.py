"""The token-only engine core and the front end's OutputProcessor (engine core v3).

The core reports deltas (new ids, their TokenLogprobs, how a request finished) and holds no text; the
OutputProcessor accumulates them into RequestOutputs, detokenizes, and finishes a request at a stop
string, which the caller then aborts in the core: whatever the core sends for it afterwards (the token of
the iteration it was already in, its "cancelled" final output) never reaches the client."""

from __future__ import annotations

from typing import Any

import pytest
from _fixtures import smollm2, tiny_core, tiny_engine

from orca import EngineCoreOutput, OutputProcessor, SamplingParams
from orca.core.plan import TokenLogprobs
from orca.core.request import FinishReason, Request
from orca.frontend.tokenizer import Tokenizer

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_the_core_reports_deltas_and_holds_no_text() -> None:
    core = tiny_core("gpt2")
    assert not hasattr(core, "tokenizer")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    core.validate([1, 2, 3], params)
    core.add_request("a", [1, 2, 3], params)
    deltas: list[EngineCoreOutput] = []
    while core.has_unfinished():
        deltas.extend(core.step())
    assert all(len(d.new_token_ids) == 1 for d in deltas)  # one token per iteration, never the history
    assert all(len(d.new_logprobs) == 1 and d.new_logprobs[0].token_id == d.new_token_ids[0] for d in deltas)
    assert [d.finish_reason for d in deltas] == [None] * 5 + [FinishReason.LENGTH]
    # The same request through LLMEngine (core + OutputProcessor): the accumulated ids are the deltas'.
    engine = tiny_engine("gpt2")
    engine.add_request("a", [1, 2, 3], params)
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert outs[-1].token_ids == [d.new_token_ids[0] for d in deltas]
    assert outs[-1].cumulative_logprob == pytest.approx(sum(d.new_logprobs[0].logprob for d in deltas))
    assert outs[-1].num_output_tokens == 6 and outs[-1].finish_reason == "length"


def test_an_output_is_a_snapshot_of_the_history_at_its_iteration() -> None:
    """RequestOutputs share the request's history (built in O(new tokens)); each still reads as it was."""
    engine = tiny_engine("gpt2")
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    final = outs[-1].token_ids
    for i, out in enumerate(outs):
        assert out.token_ids == final[: i + 1] and out.num_output_tokens == i + 1
        assert out.new_token_ids == [final[i]] and len(out.logprobs) == i + 1
    outs[0].token_ids.append(99)  # a reader's copy: the history is untouched
    assert outs[1].token_ids == final[:2]


def test_request_token_ids_across_prompt_and_output() -> None:
    req = Request("r", [10, 11, 12], GREEDY, arrival=0, seed=0)
    req.output_token_ids.extend([20, 21])
    assert req.token_ids(0, 2) == [10, 11]
    assert req.token_ids(1, 3) == [11, 12, 20]
    assert req.token_ids(4, 1) == [21]  # an increment: read from the output, no concatenation
    assert req.token_ids(0, 5) == [10, 11, 12, 20, 21]


@pytest.fixture(scope="module")
def text() -> Tokenizer:
    engine = smollm2().engine
    return Tokenizer(engine.tokenizer, engine.checkpoint)


def test_a_stop_string_finishes_the_request_here_and_asks_the_core_to_abort_it(text: Tokenizer) -> None:
    ids = text.hf.encode("The capital of France is Paris. It is large.", add_special_tokens=False)
    processor = OutputProcessor(text)
    processor.add_request("r", 4, SamplingParams(max_tokens=50, stop=("Paris",), logprobs=0), arrival_time=1.0)
    shown: list[Any] = []
    aborts: list[str] = []
    for i, token in enumerate(ids):  # the core goes on: it has not seen the stop string
        delta = EngineCoreOutput("r", [token], [TokenLogprobs(token, -0.25, 1)], time=2.0 + i)
        processed = processor.process([delta])
        shown.extend(processed.outputs)
        aborts.extend(processed.aborts)
    cancelled = processor.process([EngineCoreOutput("r", [], finish_reason=FinishReason.CANCELLED, time=99.0)])
    assert aborts == ["r"] and cancelled.outputs == [] and "r" not in processor
    final = shown[-1]
    assert [o.finished for o in shown] == [False] * (len(shown) - 1) + [True]
    assert final.finish_reason == "stop" and final.text == "The capital of France is "
    assert "".join(o.text_delta for o in shown) == final.text
    # The token that completed the stop string is the last one kept; what the core generated after it is not.
    assert final.token_ids == ids[: len(shown)] and len(shown) < len(ids)
    assert final.num_prompt_tokens == 4 and final.arrival_time == 1.0 and final.finish_time == 2.0 + len(shown) - 1
    assert final.cumulative_logprob == pytest.approx(-0.25 * len(shown))


def test_llm_engine_aborts_a_request_finished_by_a_stop_string_in_its_core() -> None:
    engine = smollm2().engine
    prompt = engine.encode("The capital of France is")
    engine.add_request("paris", prompt, SamplingParams(max_tokens=12, temperature=0, stop=("Paris",)))
    finals = []
    while engine.has_unfinished():
        finals.extend(o for o in engine.step() if o.finished)
    assert len(finals) == 1 and finals[0].finish_reason == "stop" and "Paris" not in finals[0].text
    assert engine.core.request_ids() == [] and engine.stats().kv_allocated_blocks == 0
