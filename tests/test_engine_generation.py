"""Whole generations through the engine: iteration-level scheduling with requests joining at different
iterations under a small max_bs and K/V budget gives every request exactly transformers' greedy tokens;
seeded sampling does not depend on the batch; stop conditions and K/V buffers per request."""

from __future__ import annotations

import random
from collections import deque

import pytest
from _fixtures import FAMILIES, drain, hf_greedy, tiny_checkpoint, tiny_engine, tiny_reference

from orca import LLM, EngineConfig, LLMEngine, RequestOutput, SamplingParams
from orca.core.plan import StepPlan, StepResult
from orca.executor import InProcessExecutor

MAX_BS = 5
N_SLOTS = 128  # a request needs up to 24 + 20 = 44 slots, 22 on average: about five fit at once
# K/V configurations every generation must be exact under (the parity the paged pool must keep):
# Orca's slot-exact reservation; paged blocks with a token budget that chunks most prompts; and a pool so
# small under on_demand admission that requests are preempted (and recomputed) again and again.
KV_CONFIGS = {
    "orca-reserve": dict(n_slots=N_SLOTS, block_size=1, kv_admission="reserve"),
    "paged-reserve-chunked": dict(n_slots=N_SLOTS, block_size=4, kv_admission="reserve", max_num_batched_tokens=8),
    "on-demand-preempting": dict(n_slots=44, block_size=4, kv_admission="on_demand", max_num_batched_tokens=8),
}


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


@pytest.mark.parametrize("kv", list(KV_CONFIGS))
def test_requests_joining_at_different_iterations_generate_transformers_greedy_tokens(
    family: str, kv: str, references: dict[str, list[list[int]]]
) -> None:
    options = KV_CONFIGS[kv]
    engine = tiny_engine(family, max_bs=MAX_BS, **options)
    budget = options.get("max_num_batched_tokens")
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
        it, stats = engine.last_iteration, engine.stats()
        assert it.batch_size <= MAX_BS and (budget is None or it.num_tokens <= budget)
        assert stats.kv_allocated_blocks <= stats.kv_total_blocks
        assert stats.kv_used_tokens <= stats.kv_allocated_slots
        assert it.kv_used_tokens <= it.kv_allocated_blocks * stats.block_size
        saw_full_batch |= it.batch_size == MAX_BS
        # A request waits for K/V memory although the batch has room: admission is memory-constrained.
        saw_memory_wait |= stats.waiting > 0 and it.batch_size < MAX_BS
        iteration += 1
        assert iteration < 2000
    assert saw_memory_wait, "the workload must exercise the K/V pool's limit"
    assert saw_full_batch or kv == "on-demand-preempting", "the workload must exercise max_bs"
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv_allocated_blocks, stats.kv_used_tokens) == (0, 0, 0, 0)
    if options["kv_admission"] == "reserve":
        assert stats.preemptions == 0
    else:
        assert stats.preemptions >= 8, "the tiny pool must force many preemptions"
    if budget is not None:
        assert sum(len(prompt) > budget for prompt, _ in specs) >= 8, "most prompts must be chunked"
    for i, expected in enumerate(references[family]):
        out = final[f"r{i}"]
        assert out.token_ids == expected, f"{family} {kv} r{i}"
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
    assert not llm.engine.has_unfinished() and llm.engine.stats().kv_allocated_blocks == 0


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


def test_seeded_request_samples_the_same_tokens_chunked_and_after_preemption(family: str) -> None:
    alone = tiny_engine(family)
    alone.add_request("s", PROMPT, SEEDED)
    expected = drain(alone)["s"].token_ids

    # Chunked: a budget of 4 tokens per iteration splits the 6-token prompt in two.
    chunked = tiny_engine(family, max_num_batched_tokens=4)
    chunked.add_request("s", PROMPT, SEEDED)
    first = chunked.step()
    assert first[0].new_token_ids == [] and chunked.last_iteration.num_tokens == 4  # no token mid-prompt
    assert drain(chunked)["s"].token_ids == expected

    # Preempted: two earlier requests grow into a 12-block pool until the latest arrival, "s" (26 tokens
    # at most), loses its blocks; it is recomputed when readmitted and draws the same tokens.
    tight = tiny_engine(family, block_size=4, n_slots=48, kv_admission="on_demand", max_num_batched_tokens=8)
    tight.add_request("a", [3] * 10, greedy(20))
    tight.add_request("b", [7] * 10, greedy(20))
    tight.add_request("s", PROMPT, SEEDED)
    outputs = drain(tight)
    assert tight.stats().preemptions >= 1
    assert outputs["s"].token_ids == expected
    reference = tiny_reference(family)
    assert outputs["a"].token_ids == hf_greedy(reference, [3] * 10, 20)
    assert outputs["b"].token_ids == hf_greedy(reference, [7] * 10, 20)


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


def test_reserve_takes_the_blocks_of_max_tokens_at_admission() -> None:
    engine = tiny_engine("llama", block_size=4, n_slots=64, kv_admission="reserve")
    engine.add_request("short", [1, 2, 3], greedy(2))  # 5 tokens: 2 blocks
    engine.add_request("long", [4] * 10, greedy(7))  # 17 tokens: 5 blocks
    engine.step()
    stats = engine.stats()
    assert (stats.kv_allocated_blocks, stats.kv_used_tokens, stats.running) == (2 + 5, 3 + 10, 2)
    outputs = engine.step()
    assert [out.request_id for out in outputs if out.finished] == ["short"]
    assert (engine.stats().kv_allocated_blocks, engine.stats().kv_used_tokens) == (5, 11)
    drain(engine)
    assert engine.stats().kv_allocated_blocks == 0 and engine.stats().kv_used_tokens == 0


def test_on_demand_takes_blocks_as_requests_grow() -> None:
    engine = tiny_engine("llama", block_size=4, n_slots=64, kv_admission="on_demand")
    engine.add_request("short", [1, 2, 3], greedy(2))
    engine.add_request("long", [4] * 10, greedy(7))
    engine.step()  # prompts: 3 tokens (1 block) and 10 tokens (3 blocks)
    assert (engine.stats().kv_allocated_blocks, engine.stats().kv_used_tokens) == (1 + 3, 3 + 10)
    engine.step()  # increments at positions 3 and 10: both fit the blocks they hold; short finishes
    assert (engine.stats().kv_allocated_blocks, engine.stats().kv_used_tokens) == (3, 11)
    engine.step()  # long's token 12 needs a fourth block
    assert (engine.stats().kv_allocated_blocks, engine.stats().kv_used_tokens) == (3, 12)
    engine.step()
    assert (engine.stats().kv_allocated_blocks, engine.stats().kv_used_tokens) == (4, 13)
    drain(engine)
    assert engine.stats().kv_allocated_blocks == 0


def test_the_pool_is_sized_from_kv_cache_bytes_in_whole_blocks() -> None:
    engine = tiny_engine("gpt2", kv_cache_bytes=100_000, block_size=8)
    cfg = engine.model_config
    bytes_per_block = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * 8  # fp32
    stats = engine.stats()
    assert stats.kv_total_blocks == 100_000 // bytes_per_block and stats.block_size == 8
    assert engine.n_slots == stats.kv_total_blocks * 8
    assert tiny_engine("gpt2", n_slots=37, block_size=8).stats().kv_total_blocks == 4  # whole blocks


def test_an_unadmitted_request_that_cannot_fit_the_pool_is_refused() -> None:
    engine = tiny_engine("gpt2", block_size=4, n_slots=48, kv_admission="on_demand")
    with pytest.raises(ValueError, match=r"K/V cache of 48 slots: max_tokens must be in \[1, 38\]"):
        engine.add_request("big", [1] * 10, greedy(39))


class TwoStageExecutor(InProcessExecutor):
    """Holds up to two plans and runs each only when its result is collected, as a two-stage pipeline
    returns them: the engine must build the second plan while the first is still out."""

    max_in_flight = 2

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.plans: deque[StepPlan] = deque()
        self.most_in_flight = 0

    def submit(self, plan: StepPlan) -> None:
        self.plans.append(plan)
        self.most_in_flight = max(self.most_in_flight, len(self.plans))
        flying = [r.request_id for p in self.plans for r in p.requests]
        assert len(flying) == len(set(flying)), "a request is in two plans in flight"

    def collect(self) -> StepResult:
        return self.worker.execute(self.plans.popleft())


def test_two_batches_in_flight_give_the_same_tokens(family: str, references: dict[str, list[list[int]]]) -> None:
    config = EngineConfig(model=str(tiny_checkpoint(family)), n_workers=2, max_bs=3, block_size=4, n_slots=96,
                          max_num_batched_tokens=10)
    executor = TwoStageExecutor(config)
    engine = LLMEngine(config, executor=executor)
    specs = workload(0)
    for i, (prompt, n) in enumerate(specs):
        engine.add_request(f"r{i}", prompt, greedy(n))
    outputs = drain(engine)
    assert executor.most_in_flight == 2
    assert [outputs[f"r{i}"].token_ids for i in range(len(specs))] == references[family]
    with pytest.raises(ValueError, match="n_workers"):
        LLMEngine(EngineConfig(model=str(tiny_checkpoint(family)), n_workers=2))
