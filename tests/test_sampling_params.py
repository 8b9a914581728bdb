"""Validation: SamplingParams and EngineConfig refuse bad values with a message naming the field; the
engine refuses bad requests, bounds its queue, cancels cleanly, and survives a failing iteration."""

from __future__ import annotations

import pytest
from _fixtures import drain, hf_greedy, tiny_checkpoint, tiny_engine, tiny_reference

from orca import EngineConfig, LLMEngine, QueueFullError, SamplingParams
from orca.core.plan import PlannedRequest, SamplingSpec, StepPlan, StepResult
from orca.executor import InProcessExecutor
from orca.sampling_params import DEFAULT_MAX_TOKENS
from orca.worker import Worker


# -- SamplingParams --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 2.0),
        ("max_tokens", "16.0"),
        ("max_tokens", True),
        ("max_tokens", None),
        ("temperature", -0.1),
        ("temperature", "hot"),
        ("temperature", True),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_p", "0.9x"),
        ("top_p", float("nan")),
        ("top_k", -2),
        ("top_k", 2.5),
        ("top_k", False),
        ("seed", -1),
        ("seed", 2**63),
        ("seed", 1.0),
        ("seed", True),
        ("stop", ""),
        ("stop", [""]),
        ("stop", [1]),
        ("stop", 3),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", 5),
        ("ignore_eos", 1),
        ("ignore_eos", "yes"),
    ],
)
def test_invalid_value_names_its_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})


def test_defaults_and_accepted_values() -> None:
    p = SamplingParams()
    assert p.max_tokens == DEFAULT_MAX_TOKENS and p.temperature == 1.0 and not p.greedy
    assert SamplingParams(temperature=0).greedy
    edge = SamplingParams(max_tokens=1, temperature=0, top_p=1, top_k=0, seed=0, stop="x", stop_token_ids=[0])
    assert edge.stop == ("x",) and edge.stop_token_ids == (0,)  # lists and single strings become tuples
    assert SamplingParams(seed=2**63 - 1, top_p=1e-9, temperature=2).seed == 2**63 - 1
    hash(SamplingParams(stop=["a", "b"]))  # immutable and hashable


def test_from_dict_rejects_unknown_keys_by_name() -> None:
    with pytest.raises(ValueError, match="unknown sampling parameter.*max_tokenz"):
        SamplingParams.from_dict({"max_tokens": 4, "max_tokenz": 5})
    with pytest.raises(ValueError, match="JSON object"):
        SamplingParams.from_dict([("max_tokens", 4)])  # type: ignore[arg-type]


def test_json_round_trip() -> None:
    p = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, top_p=0.8, seed=9, stop=["\n"], stop_token_ids=[2])
    assert SamplingParams.from_dict(p.to_dict()) == p
    text = (
        '{"max_tokens": 7, "temperature": 0.5, "top_k": 3, "top_p": 0.8, "seed": 9, "stop": ["\\n"], '
        '"stop_token_ids": [2]}'
    )
    assert SamplingParams.from_json(text) == p
    assert SamplingParams.from_json("") == SamplingParams() == SamplingParams.from_json("  ")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{max_tokens: 4}", "not valid JSON"),
        ('{"max_tokens": 4', "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ("null", "JSON object"),
        ('{"max_tokens": true}', "max_tokens"),
        ('{"max_tokens": 4.0}', "max_tokens"),
        ('{"temperature": "hot"}', "temperature"),
        ('{"top_p": 2}', "top_p"),
        ('{"seed": -5}', "seed"),
        ('{"best_of": 2}', "best_of"),
    ],
)
def test_from_json_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_json(text)


# -- EngineConfig ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_bs", 0),
        ("max_bs", True),
        ("n_slots", 0),
        ("n_slots", 1.5),
        ("max_queue", 0),
        ("n_workers", 0),
        ("kv_cache_bytes", 0),
        ("max_model_len", 0),
        ("seed", -1),
        ("dtype", "float64"),
        ("device", "tpu9"),
    ],
)
def test_engine_config_invalid_value_names_its_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


def test_engine_rejects_options_the_model_cannot_honour() -> None:
    model = str(tiny_checkpoint("gpt2"))
    with pytest.raises(ValueError, match="max_model_len"):
        LLMEngine(EngineConfig(model=model, max_model_len=129))  # the tiny GPT-2 has 128 positions
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        LLMEngine(EngineConfig(model=model, kv_cache_bytes=10))  # less than one slot
    with pytest.raises(ValueError, match="n_workers"):
        LLMEngine(EngineConfig(model=model, n_workers=2))
    with pytest.raises(ValueError, match="neither"):
        LLMEngine(EngineConfig(model="/nonexistent/checkpoint"))


# -- request validation ----------------------------------------------------------------------------
@pytest.fixture
def engine() -> LLMEngine:
    """Tiny GPT-2 (vocab 211, context 128) with a 64-slot K/V pool under Orca's reservation, one token per
    block, so admission is slot-exact."""
    return tiny_engine("gpt2", n_slots=64, max_queue=2, kv_admission="reserve", block_size=1)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "empty"),
        ("1 2 3", SamplingParams(), "empty"),  # not a list of ids
        ([1, -1], SamplingParams(), r"out of range.*\[0, 210\]"),
        ([1, 211], SamplingParams(), r"out of range.*\[0, 210\]"),
        ([1, True], SamplingParams(), "out of range"),
        ([1, 2.0], SamplingParams(), "out of range"),
        ([1] * 128, SamplingParams(max_tokens=1), "at most 127"),
        ([1] * 100, SamplingParams(max_tokens=29), r"max_tokens must be in \[1, 28\]"),
        ([1] * 10, SamplingParams(max_tokens=55), r"K/V cache of 64 slots: max_tokens must be in \[1, 54\]"),
        ([1] * 64, SamplingParams(max_tokens=1), "K/V cache holds 64 slots, so a prompt may have at most 63"),
        ([1] * 10, SamplingParams(max_tokens=5, stop=["x"]), "tokenizer"),
    ],
)
def test_engine_rejects_bad_requests(engine: LLMEngine, prompt: object, params: SamplingParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)  # type: ignore[arg-type]
    assert not engine.has_unfinished() and engine.stats().kv_allocated_slots == 0


def test_engine_accepts_a_request_that_fills_the_cache_exactly(engine: LLMEngine) -> None:
    engine.add_request("full", [1] * 10, SamplingParams(temperature=0, max_tokens=54, ignore_eos=True))
    out = drain(engine)["full"]
    assert out.finish_reason == "length" and len(out.token_ids) == 54


def test_duplicate_request_id_is_refused(engine: LLMEngine) -> None:
    engine.add_request("x", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [3], SamplingParams(max_tokens=2))


def test_queue_full(engine: LLMEngine) -> None:
    # max_queue 2 bounds the requests waiting for admission; admitted ones do not count.
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)  # 25 slots each: two fit in 64
    engine.add_request("a", [1] * 5, params)
    engine.add_request("b", [1] * 5, params)
    with pytest.raises(QueueFullError, match="full"):
        engine.add_request("c", [1] * 5, params)
    engine.step()  # a and b are admitted: the queue is empty again
    engine.add_request("c", [1] * 5, params)
    engine.add_request("d", [1] * 5, params)
    engine.step()  # c and d wait: 50 + 25 > 64
    assert engine.stats().waiting == 2
    with pytest.raises(QueueFullError):
        engine.add_request("e", [1] * 5, params)
    assert set(drain(engine)) == {"a", "b", "c", "d"}


def test_abort_a_waiting_request(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)  # 35 slots: one at a time
    engine.add_request("run", [1] * 5, params)
    engine.add_request("wait", [2] * 5, params)
    engine.step()
    assert engine.stats().waiting == 1 and engine.stats().kv_allocated_slots == 35
    assert engine.abort_request("wait")
    assert not engine.abort_request("wait") and not engine.abort_request("never-added")
    outputs = engine.step()
    cancelled = [out for out in outputs if out.request_id == "wait"]
    assert len(cancelled) == 1
    assert cancelled[0].finished and cancelled[0].finish_reason == "cancelled" and cancelled[0].token_ids == []
    assert engine.stats().kv_allocated_slots == 35  # only "run" holds slots
    assert set(drain(engine)) == {"run"}
    assert engine.stats().kv_allocated_slots == 0


def test_abort_a_running_request_frees_its_slots(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("victim", [1] * 5, params)
    engine.add_request("next", [2] * 5, params)
    engine.step()
    engine.step()
    assert engine.abort_request("victim")
    assert engine.stats().kv_allocated_slots == 0
    outputs = engine.step()  # the cancellation, and "next" admitted into the freed slots
    by_id = {out.request_id: out for out in outputs}
    assert by_id["victim"].finish_reason == "cancelled" and len(by_id["victim"].token_ids) == 2
    assert not by_id["next"].finished and engine.stats().kv_allocated_slots == 35
    drain(engine)


class FlakyExecutor(InProcessExecutor):
    """The in-process executor, reporting a failure for the third iteration (as a worker does when its
    forward raises: see test_a_worker_turns_an_exception_into_an_error_result)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.calls = 0

    def collect(self) -> StepResult:
        result = super().collect()
        self.calls += 1
        return StepResult(result.batch_id, error="RuntimeError: device fell over") if self.calls == 3 else result


def test_a_worker_turns_an_exception_into_an_error_result() -> None:
    worker = Worker(EngineConfig(model=str(tiny_checkpoint("gpt2")), n_slots=64, block_size=4))
    worker.init_kv_pool(16)
    spec = SamplingSpec(temperature=0.0, top_k=0, top_p=1.0, seed=0)
    good = PlannedRequest("a", (1, 2, 3), 0, (0,), spec, sample_step=0)
    # The plan names a request the worker never saw: its forward cannot run.
    result = worker.execute(StepPlan(0, (good, PlannedRequest("ghost", (4,), 7))))
    assert result.batch_id == 0 and result.sampled == {}
    assert result.error is not None and "ghost" in result.error
    assert worker.num_requests == 0  # the failed plan's requests are dropped
    result = worker.execute(StepPlan(1, (good,)))  # the worker carries on
    assert result.error is None and list(result.sampled) == ["a"]


def test_an_iteration_that_fails_fails_only_its_requests() -> None:
    config = EngineConfig(model=str(tiny_checkpoint("gpt2")), n_slots=64, kv_admission="reserve", block_size=1)
    engine = LLMEngine(config, executor=FlakyExecutor(config))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params)
    engine.add_request("b", [4, 5], params)
    engine.step()
    engine.step()
    engine.add_request("c", [6, 7, 8, 9], params)  # joins the failing iteration in initiation
    outputs = {out.request_id: out for out in engine.step()}
    assert sorted(outputs) == ["a", "b", "c"]
    for out in outputs.values():
        assert out.finished and out.finish_reason == "error"
        assert out.error is not None and "RuntimeError" in out.error and "device fell over" in out.error
        assert out.new_token_ids == []
    assert len(outputs["a"].token_ids) == 2 and outputs["c"].token_ids == []
    assert engine.stats().kv_allocated_slots == 0
    assert not engine.has_unfinished()

    # The engine serves the next requests normally.
    engine.add_request("after", [1, 2, 3], params)
    out = drain(engine)["after"]
    assert out.finish_reason == "length"
    assert out.token_ids == hf_greedy(tiny_reference("gpt2"), [1, 2, 3], 8)
    assert engine.stats().kv_allocated_slots == 0
