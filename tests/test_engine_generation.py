"""Whole generations through the engine: iteration-level scheduling with requests joining at different
iterations under a small max_bs and K/V budget gives every request exactly transformers' greedy tokens;
seeded sampling does not depend on the batch; stop conditions and K/V buffers per request."""

from __future__ import annotations

import random

import pytest
from _fixtures import FAMILIES, drain, hf_greedy, tiny_checkpoint, tiny_engine, tiny_reference

from orca import LLM, RequestOutput, SamplingParams

MAX_BS = 5
N_SLOTS = 128  # a request needs up to 24 + 20 = 44 slots, 22 on average: about five fit at once


@pytest.fixture(scope="session", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    tiny_checkpoint(request.param)  # built once per session
    return request.param


def workload(seed: int, n: int = 16) -> list[tuple[list[int], int]]:
    """n (prompt, max_tokens) pairs of different lengths."""
    rng = random.Random(seed)
    return [([rng.randrange(0, 190) for _ in range(rng.randint(1, 24))], rng.randint(1, 20)) for _ in range(n)]


def greedy(max_tokens: int, **options: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **options)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def references() -> dict[str, list[list[int]]]:
    """transformers' greedy tokens for workload(0), per family, computed once."""
    return {fam: [hf_greedy(tiny_reference(fam), prompt, n) for prompt, n in workload(0)] for fam in FAMILIES}


def test_requests_joining_at_different_iterations_generate_transformers_greedy_tokens(
    family: str, references: dict[str, list[list[int]]]
) -> None:
    engine = tiny_engine(family, max_bs=MAX_BS, n_slots=N_SLOTS)
    specs = workload(0)
    rng = random.Random(1)
    join_at = sorted(rng.randint(0, 20) for _ in specs)  # iteration at which request i arrives
    streamed: dict[str, list[int]] = {f"r{i}": [] for i in range(len(specs))}
    final: dict[str, RequestOutput] = {}
    saw_full_batch = saw_memory_wait = False
    iteration = added = 0
    while added < len(specs) or engine.has_unfinished():
        while added < len(specs) and join_at[added] <= iteration:
            prompt, n = specs[added]
            engine.add_request(f"r{added}", prompt, greedy(n))
            added += 1
        for out in engine.step():
            streamed[out.request_id].extend(out.new_token_ids)
            if out.finished:
                final[out.request_id] = out
        stats = engine.last_iteration
        assert stats.batch_size <= MAX_BS
        assert engine.slots.n_reserved <= N_SLOTS
        assert engine.runner.kv_cache.allocated_slots == engine.slots.n_reserved
        saw_full_batch |= stats.batch_size == MAX_BS
        # A request waits for K/V memory although the batch has room: admission is slot-constrained.
        saw_memory_wait |= engine.scheduler.num_waiting > 0 and stats.batch_size < MAX_BS
        iteration += 1
        assert iteration < 1000
    assert saw_full_batch and saw_memory_wait, "the workload must exercise both max_bs and n_slots"
    assert engine.slots.n_reserved == 0 and len(engine.runner.kv_cache) == 0
    for i, expected in enumerate(references[family]):
        out = final[f"r{i}"]
        assert out.token_ids == expected, f"{family} r{i}"
        assert streamed[f"r{i}"] == expected
        assert out.finish_reason == "length" and out.num_prompt_tokens == len(specs[i][0])
        assert out.first_token_time is not None and out.finish_time is not None
        assert out.arrival_time <= out.first_token_time <= out.finish_time
    # Discriminating: the model does not just repeat one token.
    assert len({t for tokens in references[family] for t in tokens}) > 20


@pytest.mark.parametrize("max_queue", [1024, 2])
def test_offline_generate_matches_transformers(
    family: str, max_queue: int, references: dict[str, list[list[int]]]
) -> None:
    # max_queue 2: generate() must feed the prompts in as the waiting queue drains.
    llm = LLM(model=str(tiny_checkpoint(family)), max_bs=MAX_BS, n_slots=N_SLOTS, max_queue=max_queue)
    specs = workload(0)
    outputs = llm.generate([prompt for prompt, _ in specs], [greedy(n) for _, n in specs])
    assert [out.token_ids for out in outputs] == references[family]
    assert [out.prompt_token_ids for out in outputs] == [prompt for prompt, _ in specs]
    assert all(out.finish_reason == "length" and out.text is None for out in outputs)
    assert not llm.engine.has_unfinished() and llm.engine.slots.n_reserved == 0


def test_offline_generate_rejects_bad_arguments_before_any_work() -> None:
    llm = LLM(model=str(tiny_checkpoint("gpt2")), n_slots=64)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[1, 2], [3]], [greedy(2)])
    with pytest.raises(ValueError, match="prompts"):
        llm.generate("not a list")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[1, 2], [3]], greedy(63))  # 2 + 63 > 64 slots
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text needs a tokenizer"])


# -- sampling --------------------------------------------------------------------------------------
SEEDED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
PROMPT = [5, 17, 42, 99, 3, 150]


def test_seeded_request_samples_the_same_tokens_alone_and_in_a_busy_batch(family: str) -> None:
    alone = tiny_engine(family)
    alone.add_request("s", PROMPT, SEEDED)
    expected = drain(alone)["s"].token_ids
    assert len(expected) == 20
    assert expected != hf_greedy(tiny_reference(family), PROMPT, 20)  # it really samples

    busy = tiny_engine(family, max_bs=4, n_slots=120)
    others = {
        0: [("x0", [1, 2, 3], SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True))],
        1: [("x1", [9] * 12, greedy(30)), ("x2", [4, 4], SamplingParams(temperature=1.5, top_k=5, seed=7))],
        3: [("x3", [8, 6, 7], SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1235, max_tokens=25))],
        5: [("x4", PROMPT, SamplingParams(temperature=0.7, top_p=0.5, max_tokens=10, ignore_eos=True))],
    }
    outputs: dict[str, RequestOutput] = {}
    for iteration in range(8):
        for rid, prompt, params in others.get(iteration, []):
            busy.add_request(rid, prompt, params)
        if iteration == 2:
            busy.add_request("s", PROMPT, SEEDED)
        outputs.update({out.request_id: out for out in busy.step() if out.finished})
        assert busy.last_iteration.batch_size > 1 or iteration == 0
    outputs.update(drain(busy))
    assert outputs["s"].token_ids == expected


def test_unseeded_requests_differ() -> None:
    engine = tiny_engine("gpt2")  # EngineConfig.seed None: per-request seeds come from the OS
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"u{i}", PROMPT, params)
    outputs = drain(engine)
    sequences = {tuple(out.token_ids) for out in outputs.values()}
    assert len(sequences) == 4


def test_engine_seed_makes_unseeded_requests_reproducible() -> None:
    def run() -> list[list[int]]:
        engine = tiny_engine("llama", seed=42)
        params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
        for i in range(3):
            engine.add_request(f"u{i}", PROMPT, params)
        outputs = drain(engine)
        return [outputs[f"u{i}"].token_ids for i in range(3)]

    first = run()
    assert run() == first
    assert len({tuple(tokens) for tokens in first}) == 3


# -- stopping and the K/V cache --------------------------------------------------------------------
def test_stop_token_ids_and_eos(family: str) -> None:
    expected = hf_greedy(tiny_reference(family), PROMPT, 12)
    k = 4
    stop = expected[k]
    first = expected.index(stop)  # the first time the stop token comes
    engine = tiny_engine(family)
    engine.add_request("stop-id", PROMPT, greedy(12, stop_token_ids=[stop]))
    out = drain(engine)["stop-id"]
    assert out.finish_reason == "stop" and out.token_ids == expected[: first + 1]

    # EOS stops a request unless it sets ignore_eos (the tiny models never pick their own EOS, so name
    # the same token the EOS of this engine).
    engine.eos_token_ids = {stop}
    engine.add_request("eos", PROMPT, SamplingParams(temperature=0, max_tokens=12))
    engine.add_request("ignore", PROMPT, greedy(12))
    outputs = drain(engine)
    assert outputs["eos"].finish_reason == "stop" and outputs["eos"].token_ids == expected[: first + 1]
    assert outputs["ignore"].finish_reason == "length" and outputs["ignore"].token_ids == expected


def test_kv_buffers_are_sized_per_request_and_freed_when_it_finishes() -> None:
    engine = tiny_engine("llama")
    engine.add_request("short", [1, 2, 3], greedy(2))
    engine.add_request("long", [4] * 10, greedy(7))
    engine.step()
    cache, layout = engine.runner.kv_cache, engine.runner.kv_layout
    cfg = engine.model_config
    assert cache.get("short").shape == (cfg.num_layers, 2, cfg.num_kv_heads, 3 + 2, cfg.head_dim)
    assert cache.get("long").shape == (cfg.num_layers, 2, cfg.num_kv_heads, 10 + 7, cfg.head_dim)
    assert engine.slots.n_reserved == 5 + 17 == cache.allocated_slots
    assert layout.bytes_per_slot == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    outputs = engine.step()
    assert [out.request_id for out in outputs if out.finished] == ["short"]
    assert len(cache) == 1 and engine.slots.n_reserved == 17
    drain(engine)
    assert len(cache) == 0 and engine.slots.n_reserved == 0


def test_n_slots_defaults_to_the_kv_cache_budget() -> None:
    engine = tiny_engine("gpt2", kv_cache_bytes=100_000)
    assert engine.n_slots == 100_000 // engine.runner.kv_layout.bytes_per_slot
