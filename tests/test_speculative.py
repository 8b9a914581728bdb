"""Speculative decoding, n-gram (EngineConfig.speculative_method ngram; orca/core/speculative.py): the
proposer, the scheduler's use of what is left of the budget, and end to end against speculation off and
transformers: greedy and seeded tokens identical, the sampled distribution the target's, stop rules
inside an accepted run, logprobs of the kept tokens, the K/V accounting of rejected proposals, tensor
parallelism. Then the draft model (speculative_method draft): the same equalities with the model as its
own draft and with other tiny models, coupled draws when sampling, the pool's sizing, its options."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from _fixtures import decode_graphs, drain, hf_greedy, tiny_checkpoint, tiny_core, tiny_engine, tiny_reference
from checkpoints import make_gpt2, make_llama

from orca import EngineConfig, SamplingParams
from orca.core.block_manager import BlockManager
from orca.core.request import Request
from orca.core.scheduler import OrcaScheduler
from orca.core.speculative import DraftProposer, NgramProposer
from orca.tuning import SPEC_MISSES_BEFORE_PAUSE

# Proposals verified in iterations of any size (None: never disabled by the batch; the default stops at 4):
# the tests below check verification in busy batches.
SPEC = {"speculative_method": "ngram", "num_speculative_tokens": 4, "speculative_disable_by_batch_size": None}


def _request(prompt: list[int], output: list[int] = (), max_tokens: int = 64, rid: str = "r") -> Request:
    req = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), arrival=0, seed=0)
    req.output_token_ids = list(output)
    return req


# -- the proposer -------------------------------------------------------------------------------------
def test_proposes_what_followed_the_latest_earlier_occurrence_longest_match_first() -> None:
    p = NgramProposer(k=3, n_min=2, n_max=3)
    # "5 6" occurs twice before the end; the latest earlier one is followed by 9 10 11.
    assert p.propose(_request([5, 6, 7, 8, 5, 6, 9, 10, 11, 1, 5, 6])) == [9, 10, 11]
    # the 3-gram "1 5 6" matches an earlier place where the 2-gram's latest would not
    assert p.propose(_request([1, 5, 6, 40, 41, 42, 5, 6, 7, 8, 9, 1, 5, 6])) == [40, 41, 42]
    # no earlier occurrence of any 2..3-gram: nothing
    assert p.propose(_request([1, 2, 3, 4, 5])) == []


def test_a_repetition_shorter_than_k_continues_periodically_and_output_tokens_count() -> None:
    p = NgramProposer(k=4, n_min=2, n_max=2)
    assert p.propose(_request([3, 4], output=[3, 4])) == [3, 4, 3, 4]  # period 2, the copy reads its own proposals
    req = _request([1, 2, 3], output=[9, 1, 2])
    assert p.propose(req) == [3, 9, 1, 2]  # the match is in the prompt, the rest comes from the output


def test_never_proposes_beyond_max_tokens() -> None:
    p = NgramProposer(k=4, n_min=1, n_max=2)
    assert p.propose(_request([7, 8, 7, 8], output=[7], max_tokens=3)) == [8]  # 1 left before the last draw
    assert p.propose(_request([7, 8, 7, 8], output=[7, 8], max_tokens=3)) == []


def test_the_index_grows_with_the_request() -> None:
    p = NgramProposer(k=2, n_min=2, n_max=2)
    req = _request([1, 2, 3, 4])
    assert p.propose(req) == []
    req.output_token_ids += [1, 2]  # now "1 2" ends the sequence, and occurred at the start
    assert p.propose(req) == [3, 4]
    req.output_token_ids += [3, 9, 3]  # the last 2-gram, "9 3", occurred nowhere before
    assert p.propose(req) == []


def test_adapts_its_length_and_pauses_after_repeated_misses() -> None:
    p = NgramProposer(k=4, n_min=2, n_max=2)
    req = _request([1, 2, 3, 4, 5, 6, 1, 2])
    assert len(p.propose(req)) == 4
    p.verified(req, 4, 1)  # one kept: next time 2
    assert len(p.propose(req)) == 2
    p.verified(req, 2, 2)  # all kept: one more
    assert len(p.propose(req)) == 3
    for _ in range(SPEC_MISSES_BEFORE_PAUSE):
        p.verified(req, 1, 0)
    assert p.propose(req) == []  # paused for 1 iteration
    assert len(p.propose(req)) == 4  # back, at full length
    for _ in range(SPEC_MISSES_BEFORE_PAUSE):
        p.verified(req, 1, 0)
    assert p.propose(req) == [] and p.propose(req) == []  # paused twice as long
    assert p.propose(req) != []


# -- the scheduler ------------------------------------------------------------------------------------
def _increment(rid: str, arrival: int, spec: list[int]) -> Request:
    req = Request(rid, [1, 2, 3], SamplingParams(max_tokens=32), arrival=arrival, seed=0)
    req.output_token_ids = [4]
    req.admitted, req.num_computed_tokens = True, 3
    req.spec_token_ids = spec
    return req


def test_proposals_take_only_what_prompt_work_leaves_of_the_budget() -> None:
    blocks = BlockManager(64, 4)
    s = OrcaScheduler(8, blocks, kv_admission="on_demand", max_num_batched_tokens=8)
    inc = _increment("inc", 0, [5, 6, 7, 8])
    blocks.grow("inc", 4)
    s.add(inc)
    s.add(Request("new", list(range(10, 16)), SamplingParams(max_tokens=8), arrival=1, seed=0))
    batch = s.schedule()
    members = {m.request.request_id: m for m in batch.members}
    assert members["new"].num_tokens == 6  # the prompt is not cut for speculation
    assert members["inc"].num_tokens == 2 and members["inc"].spec_token_ids == [5]  # 8 - 1 - 6 = 1 left
    assert blocks.num_held("inc") == 2  # its proposal's slot (position 4) is in a second block


def test_proposals_never_preempt_and_stop_at_the_free_blocks() -> None:
    blocks = BlockManager(2, 4)  # 8 slots: the increment holds one block, one is free
    s = OrcaScheduler(8, blocks, kv_admission="on_demand")
    inc = _increment("inc", 0, [5, 6, 7, 8, 9, 10])
    blocks.grow("inc", 4)
    s.add(inc)
    batch = s.schedule()
    (m,) = batch.members
    assert m.num_tokens == 5 and m.spec_token_ids == [5, 6, 7, 8]  # positions 3..7: the pool's 8 slots
    assert batch.preempted == [] and blocks.num_free_blocks == 0


# -- end to end ---------------------------------------------------------------------------------------
def _prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    """Prompts with repeated phrases (what prompt lookup finds), of different lengths."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, vocab - 3) for _ in range(rng.randrange(3, 7))]
        filler = [rng.randrange(3, vocab - 3) for _ in range(rng.randrange(0, 6))]
        out.append((phrase + filler) * 2 + phrase[: rng.randrange(1, len(phrase))])
    return out


def _run(engine, prompts, params) -> dict[str, list[int]]:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    final = drain(engine)
    return {rid: out.token_ids for rid, out in final.items()}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_greedy_tokens_equal_speculation_off_and_transformers_in_busy_batches(family: str) -> None:
    """Preemption (a small pool, on_demand) and chunked prefill (a token budget) together, many requests."""
    prompts = _prompts(10, seed=1, vocab=150)
    params = [SamplingParams(temperature=0, max_tokens=12 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    options = {"n_slots": 192, "block_size": 4, "max_num_batched_tokens": 24, "kv_admission": "on_demand"}
    off_engine = tiny_engine(family, **options)
    off = _run(off_engine, prompts, params)
    on_engine = tiny_engine(family, **options, **SPEC)
    on = _run(on_engine, prompts, params)
    stats = on_engine.core.stats()
    assert on == off
    ref = tiny_reference(family)
    for i, p in enumerate(prompts):
        assert on[str(i)] == hf_greedy(ref, p, params[i].max_tokens), f"request {i}"
    assert stats.spec_proposed_tokens > 0 and stats.spec_accepted_tokens > 0, stats
    assert stats.kv_used_tokens == 0 and stats.kv_allocated_blocks == 0  # every block given back at the end
    off_engine.shutdown()
    on_engine.shutdown()


def test_preemption_happens_with_speculation_and_changes_nothing() -> None:
    prompts = _prompts(8, seed=5, vocab=150)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * len(prompts)
    options = {"n_slots": 96, "block_size": 4, "kv_admission": "on_demand"}
    on_engine = tiny_engine("llama", **options, **SPEC)
    on = _run(on_engine, prompts, params)
    assert on_engine.core.stats().preemptions > 0
    off_engine = tiny_engine("llama", **options)
    assert _run(off_engine, prompts, params) == on
    on_engine.shutdown()
    off_engine.shutdown()


@pytest.mark.parametrize("admission", ["reserve", "on_demand"])
def test_seeded_sampling_is_identical_with_speculation_on_and_off(admission: str) -> None:
    prompts = _prompts(8, seed=2, vocab=150)
    params = [SamplingParams(temperature=0.3, top_p=0.95, top_k=50, seed=100 + i, max_tokens=20, ignore_eos=True)
              for i in range(len(prompts))]
    results, accepted = [], 0
    for spec in ({}, SPEC):
        engine = tiny_engine("llama", kv_admission=admission, **spec)
        results.append(_run(engine, prompts, params))
        accepted += engine.core.stats().spec_accepted_tokens
        engine.shutdown()
    assert results[0] == results[1]
    assert accepted > 0


def test_the_sampled_distribution_is_the_targets() -> None:
    """The second output token over many seeds, speculation on (proposed, and verified, for most of
    them): chi-square against the model's own marginal (first token ~ p, second ~ p(. | first)), from
    transformers, at a fixed seed."""
    ref = tiny_reference("gpt2")
    # 100 distinct tokens: a first token among them finds its 1-gram in the prompt and proposes the next
    prompt = random.Random(0).sample(range(200), 100)
    temperature, n = 1.5, 600
    with torch.inference_mode():
        p1 = torch.softmax(ref(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        firsts = torch.arange(p1.shape[0])
        batch = torch.tensor([prompt + [t] for t in firsts.tolist()])
        p2 = torch.softmax(ref(batch).logits[:, -1] / temperature, -1)  # (V, V): row t = p(. | t)
        marginal = (p1.unsqueeze(1) * p2).sum(0)
    engine = tiny_engine("gpt2", max_bs=64, prompt_lookup_min=1, **SPEC)
    counts: Counter[int] = Counter()
    proposals_for_token_2 = 0
    for chunk in range(0, n, 64):
        ids = range(chunk, min(n, chunk + 64))
        for i in ids:
            engine.add_request(str(i), prompt, SamplingParams(temperature=temperature, seed=i, max_tokens=3,
                                                              ignore_eos=True))
        for out in drain(engine).values():
            counts[out.token_ids[1]] += 1
    proposals_for_token_2 = engine.core.stats().spec_verifications
    engine.shutdown()
    assert proposals_for_token_2 > n // 4  # the second token was mostly drawn through verification
    # Pool the categories with small expected counts, then chi-square.
    expected = marginal * n
    big = (expected >= 5).nonzero().flatten().tolist()
    observed = [counts.get(t, 0) for t in big] + [n - sum(counts.get(t, 0) for t in big)]
    exp = [expected[t].item() for t in big] + [n - sum(expected[t].item() for t in big)]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, exp) if e > 0)
    dof = len([e for e in exp if e > 0]) - 1
    # p < 0.001 rejects: chi-square's 0.999 quantile (Wilson-Hilferty)
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, (chi2, limit, dof)


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there() -> None:
    prompt = [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12]
    free = tiny_engine("gpt2", **SPEC)
    run = _run(free, [prompt], [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)])["0"]
    free.shutdown()
    stop = run[6]  # a token drawn well inside the run
    first = run.index(stop)
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(stop,))
    results = []
    for spec in ({}, SPEC):
        engine = tiny_engine("gpt2", **spec)
        engine.add_request("a", prompt, params)
        final = drain(engine)["a"]
        results.append((final.token_ids, final.finish_reason))
        engine.shutdown()
    assert results[0] == results[1] == (run[: first + 1], "stop")


def test_logprobs_are_those_of_the_kept_tokens() -> None:
    prompts = _prompts(4, seed=3, vocab=150)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)] * len(prompts)
    runs = []
    for spec in ({}, SPEC):
        engine = tiny_engine("llama", **spec)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params[i])
        runs.append({rid: (out.token_ids, out.logprobs) for rid, out in drain(engine).items()})
        engine.shutdown()
    for rid in runs[0]:
        tokens_off, lp_off = runs[0][rid]
        tokens_on, lp_on = runs[1][rid]
        assert tokens_on == tokens_off and len(lp_on) == len(tokens_on)
        for a, b, token in zip(lp_off, lp_on, tokens_on):
            assert token in a and token in b and list(a) == list(b)  # the drawn token first, then the top 3
            for t in a:
                assert a[t].rank == b[t].rank
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)


def test_rejected_proposals_are_never_counted_in_the_pool() -> None:
    """After every iteration each admitted request's computed tokens are its prompt and generated tokens
    but the last drawn one (which the next iteration feeds): never a rejected proposal; the pool's used
    tokens are their sum; the blocks it holds cover them."""
    core = tiny_core("llama", n_slots=512, block_size=4, kv_admission="on_demand", **SPEC)
    prompts = _prompts(6, seed=4, vocab=150)
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True))
    rejected = 0
    while core.has_unfinished():
        core.step()
        it = core.last_iteration
        rejected += it.num_proposed - it.num_accepted
        live = [core.scheduler._pool[rid] for rid in core.request_ids()]
        for req in live:
            if req.admitted and req.output_token_ids and not req.running:
                assert req.num_computed_tokens == req.num_tokens - 1, req.request_id
                assert core.blocks.num_held(req.request_id) * 4 >= req.num_computed_tokens
        assert core.scheduler.kv_used_tokens == sum(r.num_computed_tokens for r in live if r.admitted)
    assert rejected > 0  # the property was exercised
    core.shutdown()


def test_opted_out_requests_and_structured_outputs_propose_nothing() -> None:
    engine = tiny_engine("llama", **SPEC)
    prompts = _prompts(3, seed=6, vocab=150)
    _run(engine, prompts, [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, speculate=False)] * 3)
    assert engine.core.stats().spec_proposed_tokens == 0
    engine.shutdown()


def test_timeline_marks_proposed_and_accepted_tokens(tmp_path) -> None:
    from orca.core.timeline import read_timeline

    trace = tmp_path / "trace.jsonl"
    engine = tiny_engine("llama", trace=str(trace), **SPEC)
    out = _run(engine, _prompts(3, seed=7, vocab=150),
               [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 3)
    stats = engine.core.stats()
    engine.shutdown()
    timeline = read_timeline(str(trace))
    members = [m for it in timeline.iterations for m in it["requests"]]
    assert sum(m.get("proposed", 0) for m in members) == stats.spec_proposed_tokens > 0
    assert sum(m.get("accepted", 0) for m in members) == stats.spec_accepted_tokens
    drawn = Counter()
    for m in members:
        drawn[m["id"]] += (1 + m.get("accepted", 0)) if m["sampled"] else 0
    assert dict(drawn) == {rid: len(tokens) for rid, tokens in out.items()}


@pytest.mark.parametrize("bad, message", [
    ({"speculative_method": "eagle"}, "speculative_method must be one of off, ngram, draft"),
    ({"num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in \[1, 16\]"),
    ({"prompt_lookup_max": 17}, r"prompt_lookup_max must be an integer in \[1, 16\]"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min 3 exceeds prompt_lookup_max 2"),
])
def test_bad_options_are_refused_by_name(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**bad)


def test_speculate_must_be_a_boolean() -> None:
    with pytest.raises(ValueError, match="speculate must be a boolean"):
        SamplingParams(speculate="yes")
    assert SamplingParams.from_dict({"speculate": "false"}).speculate is False


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_parallel_greedy_with_speculation_equals_one_rank(layout: dict) -> None:
    prompts = _prompts(4, seed=8, vocab=150)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * len(prompts)
    one = tiny_engine("llama", **SPEC)
    expected = _run(one, prompts, params)
    one.shutdown()
    tp = tiny_engine("llama", **layout, **SPEC)
    try:
        assert _run(tp, prompts, params) == expected
        assert tp.core.stats().spec_accepted_tokens > 0
    finally:
        tp.shutdown()


def test_structured_outputs_speculate_within_their_grammar() -> None:
    """The default model writing JSON under a schema whose keys repeat (what prompt lookup finds): the
    same greedy tokens as speculation off, valid, and proposals were accepted."""
    import json

    import jsonschema
    from _fixtures import smollm2

    from orca import LLM

    schema = {"type": "array", "minItems": 3, "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                         "city": {"type": "string", "maxLength": 8}},
        "required": ["name", "city"], "additionalProperties": False}}
    params = SamplingParams(max_tokens=80, temperature=0,
                            structured_outputs={"json": schema, "disable_any_whitespace": True})
    prompt = "List three people and their cities as JSON."
    off = smollm2().generate([prompt], params)[0]
    llm = LLM(quantization="none", speculative_method="ngram")
    try:
        on = llm.generate([prompt], params)[0]
        stats = llm.engine.core.stats()
    finally:
        llm.engine.shutdown()
    assert on.token_ids == off.token_ids
    jsonschema.validate(json.loads(on.text), schema)
    assert stats.spec_accepted_tokens > 0, stats


# -- the draft model (speculative_method draft) ------------------------------------------------------
@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Draft checkpoints for the tiny models: each family's model itself ("self"), and a different tiny
    model of one layer with the same vocabulary ("other"; a GPT-2 for the Llama, a Llama for the GPT-2:
    the draft's architecture is its own)."""
    root = tmp_path_factory.mktemp("drafts")
    return {
        "gpt2/self": str(tiny_checkpoint("gpt2")),
        "llama/self": str(tiny_checkpoint("llama")),
        "llama/other": str(make_llama(root / "llama-1", seed=1, num_hidden_layers=1)),
        "gpt2/other": str(make_llama(root / "llama-211", seed=1, num_hidden_layers=1, vocab_size=211,
                                     eos_token_id=210)),
        "llama/gpt2": str(make_gpt2(root / "gpt2-197", seed=1, n_layer=1, vocab_size=197, eos_token_id=196,
                                    bos_token_id=196)),
    }


def _draft(model: str) -> dict:
    return {"speculative_method": "draft", "speculative_model": model, "num_speculative_tokens": 4,
            "speculative_disable_by_batch_size": None}


def test_the_draft_proposer_takes_the_drafts_within_its_length_and_room_and_pauses() -> None:
    p = DraftProposer(k=4)
    req = _request([1, 2, 3], output=[4], max_tokens=20)
    assert p.num_to_propose(req, verifying=0) == 4
    assert p.propose(req, [5, 6, 7, 8]) == [5, 6, 7, 8]
    p.verified(req, 4, 1)  # one kept: next time 2, or 3 when this iteration accepts all it verifies
    assert p.num_to_propose(req, verifying=2) == 3 and p.num_to_propose(req, verifying=0) == 2
    assert p.propose(req, [5, 6, 7]) == [5, 6]
    # never past max_tokens: output 17 of 20, one more drawn at least, so at most 20 - 18 - 1 = 1 drafted
    near_end = _request([1], output=[2] * 17, max_tokens=20)
    assert p.num_to_propose(near_end, verifying=0) == 1
    near_end.output_token_ids.append(3)  # (the iteration kept one token)
    assert p.propose(near_end, [9, 9, 9]) == [9]
    for _ in range(SPEC_MISSES_BEFORE_PAUSE):
        p.verified(req, 1, 0)
    assert p.num_to_propose(req, verifying=0) == 0  # paused: no draft steps ...
    assert p.propose(req, []) == []  # ... and the pause counted down at completion
    assert p.num_to_propose(req, verifying=0) == 4


_OFF: dict = {}


def _greedy_off(family: str, prompts: tuple, max_tokens: tuple, options: dict) -> dict[str, list[int]]:
    """Speculation off's tokens, once per family (the draft cases compare to the same run)."""
    key = (family, prompts, max_tokens, tuple(sorted(options.items())))
    if key not in _OFF:
        engine = tiny_engine(family, **options)
        _OFF[key] = _run(engine, [list(p) for p in prompts],
                         [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens])
        engine.shutdown()
    return _OFF[key]


@pytest.mark.parametrize("family, draft", [("gpt2", "self"), ("llama", "self"), ("gpt2", "other"),
                                           ("llama", "other"), ("llama", "gpt2")])
def test_draft_greedy_tokens_equal_speculation_off_and_transformers_in_busy_batches(
    family: str, draft: str, drafts: dict[str, str],
) -> None:
    """Preemption (a small pool, on_demand) and chunked prefill (a token budget) together, many requests:
    the draft's pool follows the model's through recomputations, prompt chunks and rejected proposals."""
    prompts = _prompts(10, seed=1, vocab=150)
    params = [SamplingParams(temperature=0, max_tokens=12 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    options = {"n_slots": 128, "block_size": 4, "max_num_batched_tokens": 24, "kv_admission": "on_demand"}
    off = _greedy_off(family, tuple(map(tuple, prompts)), tuple(p.max_tokens for p in params), options)
    engine = tiny_engine(family, **options, **_draft(drafts[f"{family}/{draft}"]))
    on = _run(engine, prompts, params)
    stats = engine.core.stats()
    engine.shutdown()
    assert on == off
    ref = tiny_reference(family)
    for i, p in enumerate(prompts):
        assert on[str(i)] == hf_greedy(ref, p, params[i].max_tokens), f"request {i}"
    assert stats.preemptions > 0 and stats.spec_proposed_tokens > 0, stats
    if draft == "self":  # the model drafting for itself is always right
        assert stats.spec_accepted_tokens / stats.spec_proposed_tokens > 0.9, stats
    assert stats.kv_used_tokens == 0 and stats.kv_allocated_blocks == 0


@pytest.mark.parametrize("draft", ["self", "other"])
def test_draft_seeded_sampling_is_identical_on_and_off_and_coupled_draws_are_accepted(
    draft: str, drafts: dict[str, str],
) -> None:
    """Sampled at temperature 0.8: a seeded request's tokens are the same with and without the draft;
    the model drafting for itself draws, at each output step, with the noise the verification draws with,
    so its proposals are accepted (almost) always, though each is a random draw."""
    prompts = _prompts(8, seed=2, vocab=150)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=20, ignore_eos=True)
              for i in range(len(prompts))]
    options = {"n_slots": 160, "block_size": 4, "kv_admission": "on_demand"}
    off_engine = tiny_engine("llama", **options)
    off = _run(off_engine, prompts, params)
    off_engine.shutdown()
    engine = tiny_engine("llama", **options, **_draft(drafts[f"llama/{draft}"]))
    on = _run(engine, prompts, params)
    stats = engine.core.stats()
    engine.shutdown()
    assert on == off
    assert len({tuple(t) for t in on.values()}) == len(prompts)  # (sampled: no two alike)
    assert stats.spec_proposed_tokens > 0
    if draft == "self":
        assert stats.spec_accepted_tokens / stats.spec_proposed_tokens > 0.9, stats


@pytest.mark.parametrize("options", [{"attention_backend": "reference"}, {"kv_cache_dtype": "int8"}],
                         ids=["reference", "int8"])
def test_draft_over_the_other_attention_paths_and_a_quantized_pool(options: dict, drafts: dict[str, str]) -> None:
    """The reference attention backend (per request, no batched increments) and an int8 pool (the draft's
    quantized like the model's): greedy tokens still speculation off's, with preemption."""
    prompts = _prompts(6, seed=10, vocab=150)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * len(prompts)
    options = {"n_slots": 96, "block_size": 4, "kv_admission": "on_demand", **options}
    off_engine = tiny_engine("llama", **options)
    off = _run(off_engine, prompts, params)
    off_engine.shutdown()
    for draft in ("self", "gpt2"):
        engine = tiny_engine("llama", **options, **_draft(drafts[f"llama/{draft}"]))
        assert _run(engine, prompts, params) == off, draft
        stats = engine.core.stats()
        assert stats.spec_proposed_tokens > 0 and stats.preemptions > 0, stats
        engine.shutdown()


def test_draft_requests_that_opt_out_are_not_drafted_for() -> None:
    engine = tiny_engine("llama", **_draft(str(tiny_checkpoint("llama"))))
    _run(engine, _prompts(3, seed=6, vocab=150),
         [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, speculate=False)] * 3)
    assert engine.core.stats().spec_proposed_tokens == 0
    engine.shutdown()


def test_the_draft_pool_mirrors_the_blocks_and_shares_the_budget(drafts: dict[str, str]) -> None:
    """Both pools fit kv_cache_bytes: with a draft the engine has fewer blocks, and the draft's pool has
    as many (and its scratch blocks), shaped for its own layers and heads."""
    budget = 1 << 20
    plain = tiny_core("llama", kv_cache_bytes=budget, block_size=4)
    blocks = plain.stats().kv_total_blocks
    plain.shutdown()
    core = tiny_core("llama", kv_cache_bytes=budget, block_size=4, max_bs=8, **_draft(drafts["llama/gpt2"]))
    worker = core.executor.worker
    with_draft = core.stats().kv_total_blocks
    assert with_draft < blocks
    assert blocks == budget // worker.kv_layout.bytes_per_block
    per_block = worker.kv_layout.bytes_per_block + worker.draft.layout.bytes_per_block
    assert worker.draft.scratch_blocks == 8  # max_bs x ceil(num_speculative_tokens / block_size)
    scratch = worker.draft.scratch_blocks * worker.draft.layout.bytes_per_block
    assert with_draft == (budget - scratch) // per_block
    # the draft (a one-layer GPT-2: 4 K/V heads of 16) has its own pool over the same blocks, then the scratch
    assert tuple(worker.draft.pool.shape) == (1, 2, 4, (with_draft + 8) * 4, 16)
    assert worker.kv_pool.shape[3] == with_draft * 4
    core.shutdown()


def test_the_draft_runs_outside_cuda_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """With decode iterations on CUDA graphs (their reasons lifted on a CPU, flex attention): a decode
    iteration replays the model's graph (padded) and runs the draft over its own rows, unpadded; the
    tokens are speculation off's."""
    import orca.worker.resolution

    prompts = _prompts(3, seed=9, vocab=150)
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, speculate=i > 0) for i in range(3)]
    options = {"n_slots": 128, "block_size": 4, "attention_backend": "flex", "max_bs": 4}
    off_engine = tiny_engine("llama", **options)
    off = _run(off_engine, prompts, params)
    off_engine.shutdown()
    monkeypatch.setattr(orca.worker.resolution, "why_no_graphs", lambda *args: None)
    engine = tiny_engine("llama", **options, **_draft(str(tiny_checkpoint("llama"))))
    worker = engine.core.executor.worker
    on = _run(engine, prompts, params)
    stats = engine.core.stats()
    engine.shutdown()
    assert on == off
    assert decode_graphs(worker).replays > 0 and stats.spec_accepted_tokens > 0


@pytest.mark.parametrize("bad, message", [
    ({"speculative_method": "draft"}, "speculative_method draft needs speculative_model"),
    ({"speculative_model": "/some/draft"}, "speculative_model is the draft model of speculative_method draft; "
                                           "with speculative_method off"),
    ({"speculative_method": "draft", "speculative_model": "/some/draft", "tensor_parallel_size": 2},
     "speculative_method draft runs in one worker process: tensor_parallel_size and pipeline_parallel_size "
     "must be 1, got 2 and 1"),
    ({"speculative_method": "draft", "speculative_model": "/some/draft", "pipeline_parallel_size": 2},
     "must be 1, got 1 and 2"),
])
def test_bad_draft_options_are_refused_by_name(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**bad)


def test_a_draft_of_another_vocabulary_or_a_shorter_context_is_refused_at_load(tmp_path) -> None:
    with pytest.raises(ValueError, match="speculative_model .* has a vocabulary of 211 tokens and the model one of "
                                         "197: a draft model must have the model's vocabulary size"):
        tiny_core("llama", **_draft(str(tiny_checkpoint("gpt2"))))
    short = make_llama(tmp_path / "short", max_position_embeddings=64, num_hidden_layers=1)
    with pytest.raises(ValueError, match="takes 64 positions, fewer than max_model_len 128"):
        tiny_core("llama", **_draft(str(short)))
    tiny_core("llama", max_model_len=64, **_draft(str(short))).shutdown()  # within its context: served


@pytest.mark.parametrize("limit, proposes", [(None, True), (3, True), (2, False)])
def test_an_iteration_of_speculative_disable_by_batch_size_requests_verifies_no_proposal(limit, proposes) -> None:
    blocks = BlockManager(64, 4)
    s = OrcaScheduler(8, blocks, kv_admission="on_demand", spec_disable_batch_size=limit)
    for i, rid in enumerate(("a", "b")):
        s.add(_increment(rid, i, [5, 6]))
        blocks.grow(rid, 4)
    batch = s.schedule()
    assert [m.num_tokens for m in batch.members] == ([3, 3] if proposes else [1, 1])
    assert all(bool(m.spec_token_ids) == proposes for m in batch.members)


def test_speculative_disable_by_batch_size_is_checked_and_defaults_to_the_measured_crossover() -> None:
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size must be an integer >= 1"):
        EngineConfig(speculative_disable_by_batch_size=0)
    # 4: n-gram lookup cost at 4 streams and more on the CPU measured (docs/BENCHMARKS.md); a config.pbtxt's
    # empty value is the default, and None (Python) never disables.
    assert EngineConfig().speculative_disable_by_batch_size == 2
    shipped = EngineConfig.from_parameters({"speculative_disable_by_batch_size": ""})
    assert shipped.speculative_disable_by_batch_size == 2
    assert EngineConfig(speculative_disable_by_batch_size=None).speculative_disable_by_batch_size is None
