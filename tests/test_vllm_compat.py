"""triton-inference-server/vllm_backend's request semantics, without a server (tests/test_server_vllm_compat.py
sends the same through tritonserver): sampling values as strings, the sampling_parameters input over request
parameters, vLLM's other SamplingParams fields, the return_* flags, stream with exclude_input_in_output false,
and the vllm:* metrics."""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np
import pytest
from _fixtures import FakeCodec, s

from orca.frontend.output_processor import RequestOutput
from orca.sampling_params import UNSUPPORTED_VLLM_FIELDS, VLLM_FIELDS, SamplingParams
from orca_triton.generate import STREAM_WITH_INPUT_ERROR, parse_generate_request, response_tensors


def parse(inputs: dict[str, Any], parameters: dict[str, Any] | None = None) -> Any:
    return parse_generate_request({"text_input": s("hi"), **inputs}, parameters or {}, FakeCodec(), True)


# -- 1. strings convert to the type vLLM declares --------------------------------------------------------
def test_every_vllm_backend_ci_sampling_object_parses() -> None:
    p = SamplingParams.from_json('{"temperature": "0", "top_p": "1", "max_tokens": "5", "logprobs": "2"}')
    assert (p.temperature, p.top_p, p.max_tokens, p.logprobs) == (0.0, 1.0, 5, 2) and p.greedy
    p = SamplingParams.from_dict({"top_k": "-1", "seed": "7", "ignore_eos": "true", "n": "1", "temperature": "1"})
    assert (p.top_k, p.seed, p.ignore_eos) == (0, 7, True)  # top_k -1: vLLM's "off"
    assert SamplingParams.from_dict({"ignore_eos": "False"}).ignore_eos is False  # not bool("False")


@pytest.mark.parametrize(("values", "message"), [
    # orca's own fields: the field's usual message, with its range
    ({"temperature": "hot"}, r"temperature must be a number >= 0 \(0 = greedy\), got string 'hot'"),
    ({"max_tokens": "5.0"}, "max_tokens must be an integer >= 1 .*, got string '5.0'"),
    ({"seed": ""}, "seed must be an integer >= 0 and <= 9223372036854775807 .*, got string ''"),
    ({"ignore_eos": "yes"}, r"ignore_eos must be a boolean \(true or false\), got string 'yes'"),
    # a vLLM field orca lacks: the type vLLM declares
    ({"min_p": "x"}, "min_p must be a number, got string 'x' .*vllm_backend"),
    ({"presence_penalty": "high"}, "presence_penalty must be a number, got string 'high'"),
    ({"temperature": "-1"}, r"temperature must be >= 0"),  # converted, then checked as any number
    ({"top_p": "nan"}, "top_p must be a finite number"),
])
def test_a_string_that_does_not_convert_names_its_field(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(values)


# -- 2. the sampling_parameters input over request parameters ------------------------------------------
def test_request_parameters_are_not_read_when_the_input_is_sent() -> None:
    req = parse({"sampling_parameters": s('{"temperature": "0", "max_tokens": "5"}')},
                {"temperature": "0", "top_p": "1", "foo": 1, "max_tokens": 99})
    assert (req.params.temperature, req.params.max_tokens, req.params.top_p) == (0.0, 5, 1.0)
    # without the input the request parameters are the sampling values (HTTP /generate's JSON keys), checked
    req = parse({}, {"temperature": "0", "max_tokens": 3})
    assert (req.params.temperature, req.params.max_tokens) == (0.0, 3)
    with pytest.raises(ValueError, match="unknown request parameter.*foo"):
        parse({}, {"foo": 1})
    # cache_salt is no sampling value: a request parameter either way
    assert parse({"sampling_parameters": s("{}")}, {"cache_salt": "tenant"}).cache_salt == "tenant"


# -- 3. vLLM's other SamplingParams fields ------------------------------------------------------------
def test_vllm_fields_at_their_defaults_are_accepted() -> None:
    defaults = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": "0", "repetition_penalty": 1.0, "min_p": 0,
                "min_tokens": 0, "prompt_logprobs": None, "detokenize": True, "skip_special_tokens": "true",
                "spaces_between_special_tokens": True, "include_stop_str_in_output": False, "logit_bias": None,
                "allowed_token_ids": [], "bad_words": None, "stop": None, "stop_token_ids": None, "best_of": None,
                "lora_name": None}
    assert SamplingParams.from_dict({**defaults, "max_tokens": 4}) == SamplingParams(max_tokens=4)
    assert set(VLLM_FIELDS) >= {"n", "presence_penalty", "min_p", "logit_bias", "structured_outputs", "seed"}


@pytest.mark.parametrize(("values", "message"), [
    ({"n": "0"}, r"n must be >= 1 and <= 128 \(sequences generated for the prompt\), got 0"),
    ({"n": 129}, r"n must be >= 1 and <= 128"),
    ({"n": 2.5}, r"n must be an integer >= 1 and <= 128"),
    ({"presence_penalty": 0.5}, "presence_penalty is not supported: orca's sampler applies no penalties"),
    ({"repetition_penalty": "1.1"}, "repetition_penalty is not supported"),
    ({"min_p": 0.1}, "min_p is not supported"),
    ({"min_tokens": 4}, "min_tokens is not supported"),
    ({"prompt_logprobs": 1}, "prompt_logprobs is not supported"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias is not supported"),
    ({"include_stop_str_in_output": "true"}, "include_stop_str_in_output is not supported"),
    ({"best_of": 2}, "best_of is not supported"),
])
def test_an_unsupported_vllm_field_is_refused_by_name(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        SamplingParams.from_dict(values)
    assert "unknown" not in str(err.value)


def test_every_unsupported_field_states_its_accepted_value() -> None:
    for name, (allowed, why) in UNSUPPORTED_VLLM_FIELDS.items():
        assert allowed and why, name
        SamplingParams.from_dict({name: allowed[0]})  # its default is accepted


# -- 4. additional outputs only when asked ----------------------------------------------------------------
def output(n: int, finished: bool) -> RequestOutput:
    return RequestOutput("r", new_token_ids=[64 + n], token_ids=[65 + i for i in range(n)], num_prompt_tokens=2,
                         finished=finished, finish_reason="length" if finished else None, text_delta=chr(64 + n),
                         text="".join(chr(65 + i) for i in range(n)))


@pytest.mark.parametrize("stream", [True, False])
def test_outputs_come_only_when_their_flag_is_true(stream: bool) -> None:
    flags = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")
    for value in (None, False):
        extra = {} if value is None else {f: np.array([value]) for f in flags}
        req = parse({"stream": np.array([stream]), **extra})
        t = response_tensors(output(3, True), req, True)
        assert set(t) == {"output_ids", "text_output", "num_cached_tokens"}
    req = parse({"stream": np.array([stream]), **{f: np.array([True]) for f in flags}})
    t = response_tensors(output(3, True), req, True)
    assert t["finish_reason"].tolist() == [b"length"] and t["num_input_tokens"].tolist() == [2]
    assert t["num_output_tokens"].tolist() == [1 if stream else 3]  # this response's tokens
    if stream:
        assert response_tensors(output(2, False), req, True)["finish_reason"].tolist() == [b"None"]


# -- 5. stream with exclude_input_in_output false ----------------------------------------------------------
def test_stream_with_the_prompt_in_the_output_is_refused_as_vllm_backend_refuses_it() -> None:
    with pytest.raises(ValueError) as err:
        parse({"stream": np.array([True]), "exclude_input_in_output": np.array([False])})
    assert str(err.value) == STREAM_WITH_INPUT_ERROR == (
        "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed.")
    assert parse({"stream": np.array([True])}).exclude_input_in_output  # left out: the completion only
    assert parse({"stream": np.array([True]), "exclude_input_in_output": np.array([True])}).stream
    single = parse({"exclude_input_in_output": np.array([False])})  # a single response starts with the prompt
    assert response_tensors(output(2, True), single, True)["text_output"].tolist() == [b"hiAB"]


# -- 6. the vllm:* metrics ---------------------------------------------------------------------------------
class FakeMetric:
    def __init__(self, family: FakeFamily, labels: dict[str, str], buckets: list[float] | None) -> None:
        self.family, self.labels, self.buckets = family, labels, buckets
        self.value: float = 0.0
        self.observed: list[float] = []

    def increment(self, n: float) -> None:
        self.value += n

    def set(self, v: float) -> None:
        self.value = v
        FakeFamily.sets.append((self.family.name, v))

    def observe(self, v: float) -> None:
        self.observed.append(v)


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    made: dict[str, FakeFamily] = {}
    sets: list[tuple[str, float]] = []  # every gauge set, in order

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.kind, self.metrics = name, kind, []
        FakeFamily.made[name] = self

    def Metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> FakeMetric:  # noqa: N802
        metric = FakeMetric(self, labels, buckets)
        self.metrics.append(metric)
        return metric


@pytest.fixture
def metrics_module(monkeypatch: pytest.MonkeyPatch) -> Any:
    fake = types.ModuleType("triton_python_backend_utils")
    fake.MetricFamily = FakeFamily  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    monkeypatch.delitem(sys.modules, "orca_triton.metrics", raising=False)
    FakeFamily.made, FakeFamily.sets = {}, []
    import orca_triton.metrics as module

    yield module
    sys.modules.pop("orca_triton.metrics", None)


def test_vllm_series_beside_orca_series_with_vllm_backend_labels(metrics_module: Any) -> None:
    from orca.core.outputs import EngineStats

    labels = {"model": "orca_gpt", "version": "1"}
    m = metrics_module.Metrics(labels)
    m.vllm.engine_loaded(2048)
    made = FakeFamily.made
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds",
                 "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_n",
                 "vllm:request_params_max_tokens", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total", "orca_prompt_tokens_total"):
        assert name in made and all(x.labels == labels for x in made[name].metrics), name
    assert made["vllm:request_prompt_tokens"].metrics[0].buckets == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert made["vllm:time_to_first_token_seconds"].metrics[0].buckets[:3] == [0.001, 0.005, 0.01]
    m.publish(EngineStats(running=3, waiting=2, kv_total_blocks=10, kv_allocated_blocks=4, block_size=16,
                          preemptions=5))
    value = {name: made[name].metrics[0].value for name in made if made[name].metrics}
    assert value["vllm:num_requests_running"] == 3 and value["vllm:num_requests_waiting"] == 2
    assert value["vllm:kv_cache_usage_perc"] == pytest.approx(0.4)
    assert value["vllm:num_preemptions_total"] == 5 == value["orca_preemptions_total"]
    m.vllm.finished("cancelled", 7, 3, 16)
    assert made["vllm:request_prompt_tokens"].metrics[0].observed == [7]
    assert made["vllm:request_params_n"].metrics[0].observed == [1]
    [success] = made["vllm:request_success_total"].metrics
    assert success.labels == {**labels, "finished_reason": "abort"} and success.value == 1


def test_a_scrape_between_two_gauge_sets_never_overstates(metrics_module: Any) -> None:
    """A scrape reads each gauge on its own: falling gauges are set before rising ones and the running count
    last, so no state between two sets shows more requests than there are, or running ones without their K/V."""
    from orca.core.outputs import EngineStats

    m = metrics_module.Metrics({"model": "m", "version": "1"})
    m.publish(EngineStats(running=1, waiting=7, kv_total_blocks=512, kv_allocated_blocks=1, block_size=16))
    state = {name: value for name, value in FakeFamily.sets}
    FakeFamily.sets.clear()
    # the 7 admitted, then one ends, then two are preempted
    for running, waiting, blocks in ((8, 0, 8), (7, 0, 60), (6, 2, 40)):
        m.publish(EngineStats(running=running, waiting=waiting, kv_total_blocks=512, kv_allocated_blocks=blocks,
                              block_size=16))
    assert FakeFamily.sets, "nothing was set"
    for prefix in ("orca_", "vllm:"):
        running, waiting = ("orca_running_requests", "orca_waiting_requests") if prefix == "orca_" else (
            "vllm:num_requests_running", "vllm:num_requests_waiting")
        seen = dict(state)
        for name, value in FakeFamily.sets:
            seen[name] = value
            assert seen[running] + seen[waiting] <= 8, (name, value, seen)
            if prefix == "orca_" and seen[running] == 8:
                assert seen["orca_kv_allocated_blocks"] >= 8, seen
    assert seen["orca_running_requests"] == 6 and seen["vllm:num_requests_waiting"] == 2


def test_report_vllm_off_makes_no_vllm_series(metrics_module: Any) -> None:
    """REPORT_CUSTOM_METRICS off: no vllm:* family is made; the calls the model makes still work."""
    from orca.core.outputs import EngineStats

    m = metrics_module.Metrics({"model": "m", "version": "1"}, report_vllm=False)
    m.vllm.engine_loaded(2048)
    m.publish(EngineStats(running=1, waiting=0, kv_total_blocks=10, kv_allocated_blocks=1, block_size=16,
                          preemptions=2))
    m.vllm.ttft.observe(0.1)
    m.vllm.counters["preemptions"].increment(1)
    m.vllm.finished("stop", 3, 2, 8)
    assert not [name for name in FakeFamily.made if name.startswith("vllm:")]
    assert FakeFamily.made["orca_preemptions_total"].metrics[0].value == 2
