"""The token-only engine core and the front end's OutputProcessor (engine core v3).

The core reports deltas (new ids, their TokenLogprobs, how a request finished) and holds no text; the
OutputProcessor accumulates them into RequestOutputs, detokenizes, and finishes a request at a stop
string, which the caller then aborts in the core: whatever the core sends for it afterwards (the token of
the iteration it was already in, its "cancelled" final output) never reaches the client."""

from __future__ import annotations

from typing import Any

import pytest
from _fixtures import smollm2, tiny_checkpoint, tiny_core, tiny_engine

from orca import LLM, EngineCoreOutput, OutputProcessor, SamplingParams
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


# -- prefix caching: num_cached_tokens and cache_salt through the front end ---------------------------
PREFIX = list(range(1, 41))  # 40 tokens: two full blocks of 16 (the default block_size) and 8 more


def test_num_cached_tokens_comes_from_the_deltas() -> None:
    processor = OutputProcessor(None)
    processor.add_request("r", len(PREFIX), GREEDY, arrival_time=0.0)
    first = processor.process([EngineCoreOutput("r", [5], time=1.0, num_cached_tokens=32)]).outputs[0]
    final = processor.process(
        [EngineCoreOutput("r", [6], finish_reason=FinishReason.LENGTH, time=2.0, num_cached_tokens=32)]
    ).outputs[0]
    assert first.num_cached_tokens == final.num_cached_tokens == 32
    assert final.replace(finish_reason="stop").num_cached_tokens == 32  # what the request-level baseline does
    processor.add_request("cold", len(PREFIX), GREEDY, arrival_time=0.0)
    cold = processor.process([EngineCoreOutput("cold", [5], finish_reason=FinishReason.LENGTH, time=1.0)])
    assert cold.outputs[0].num_cached_tokens == 0


def _run(engine: Any, request_id: str, prompt: list[int], cache_salt: str | None = None) -> list[Any]:
    """One request alone on the engine, to its end: its outputs."""
    engine.add_request(request_id, prompt, GREEDY, cache_salt=cache_salt)
    outs = []
    while engine.has_unfinished():
        outs.extend(o for o in engine.step() if o.request_id == request_id)
    return outs


def test_a_repeated_prefix_is_read_from_the_prefix_cache_once_per_salt() -> None:
    engine = tiny_engine("gpt2")
    assert engine.config.enable_prefix_caching  # the default
    first = _run(engine, "a", PREFIX)
    assert [o.num_cached_tokens for o in first] == [0] * len(first)
    again = _run(engine, "b", PREFIX)
    # Every output from admission on says so: the two full blocks came from the cache, the rest was computed.
    assert [o.num_cached_tokens for o in again] == [32] * len(again)
    assert again[-1].token_ids == first[-1].token_ids  # the same greedy tokens as computing every key
    salted = _run(engine, "c", PREFIX, cache_salt="tenant-b")
    assert salted[-1].num_cached_tokens == 0  # another salt shares nothing
    assert salted[-1].token_ids == first[-1].token_ids
    assert _run(engine, "d", PREFIX, cache_salt="tenant-b")[-1].num_cached_tokens == 32  # the same salt does
    assert _run(engine, "e", PREFIX)[-1].num_cached_tokens == 32
    stats = engine.stats()
    assert stats.prefix_cache_hits >= 3 * 32 and stats.prefix_cache_queries >= 5 * 32
    assert stats.prefix_cache_blocks >= 4  # two blocks for no salt, two for tenant-b


def test_without_prefix_caching_nothing_is_cached() -> None:
    engine = tiny_engine("gpt2", enable_prefix_caching=False)
    first = _run(engine, "a", PREFIX)
    again = _run(engine, "b", PREFIX)
    assert first[-1].num_cached_tokens == again[-1].num_cached_tokens == 0
    assert again[-1].token_ids == first[-1].token_ids
    assert engine.stats().prefix_cache_hits == 0 and engine.stats().prefix_cache_blocks == 0


def test_offline_generate_takes_a_cache_salt_for_all_prompts_or_one_each() -> None:
    llm = LLM(str(tiny_checkpoint("gpt2")))
    (first,) = llm.generate([PREFIX], GREEDY)
    assert first.num_cached_tokens == 0
    outs = llm.generate([PREFIX, PREFIX + [50]], GREEDY, cache_salt=[None, "tenant-b"])
    assert [o.num_cached_tokens for o in outs] == [32, 0]
    assert outs[0].token_ids == first.token_ids
    assert llm.generate([PREFIX], GREEDY, cache_salt="tenant-b")[0].num_cached_tokens == 32
    for salt, match in [
        (["a"], "got 1 cache salts for 2 prompts"),
        (["a", ""], "cache_salt must be a string of 1 to 1024 characters"),
        ("x" * 1025, "cache_salt must be a string of 1 to 1024 characters, got 1025"),
        (7, "cache_salt must be a string"),
    ]:
        with pytest.raises(ValueError, match=match):
            llm.generate([PREFIX, PREFIX], GREEDY, cache_salt=salt)
    assert not llm.engine.has_unfinished()  # refused before any work
