"""The request-level baseline (orca.frontend.request_level, model_repository/request_level_gpt), the Orca trace
generator and the orca-bench commands.

The baseline is checked offline against the iteration-level engine (same tokens, same finish reasons)
and end to end through the session's one Triton (request_level_tiny beside orca_tiny, tests/_server.py).
The benchmarks only have to run to completion and write valid JSON and a PNG: no timing is asserted. What
is asserted is what does not depend on the machine: tokens, K/V utilization in (0, 1] (higher under on_demand
than under reserve admission), preemptions (on_demand only, on a small pool), the iteration breakdown's phases
from the engine's profiling hook, and the K/V numbers orca-bench trace reads off Triton's metrics endpoint.
"""

from __future__ import annotations

import json
import math
import queue
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from _fixtures import FAMILIES, drain, smollm2, tiny_checkpoint, tiny_engine
from _server import REQUEST_LEVEL_TINY, REQUEST_LEVEL_TINY_BATCH
from orca_client import bench as orca_bench
from orca_client.bench import offline as orca_bench_offline
from orca_client.bench import trace_cmd as orca_bench_trace
from orca_client.client import parse_result
from orca_client.trace import PRESETS, TraceSpec, make_trace

from orca import EngineConfig, IterationStats, LLMEngine, SamplingParams
from orca.frontend.request_level import REQUEST_LEVEL_OPTIONS, RequestLevelBatcher


# -- the baseline, offline -----------------------------------------------------------------------------
def baseline_engine(family: str, **options: Any) -> LLMEngine:
    """A tiny engine a RequestLevelBatcher accepts (reserve admission, no token budget: as FasterTransformer
    runs). The iteration-level reference runs on the same engine: the policy does not change the tokens."""
    return tiny_engine(family, **REQUEST_LEVEL_OPTIONS, **options)


def iteration_level(engine: LLMEngine, batch: list[tuple[list[int], SamplingParams]]) -> list[Any]:
    """What orca_gpt's engine gives for the same requests (all submitted together)."""
    for i, (prompt, params) in enumerate(batch):
        engine.add_request(f"ref-{i}", prompt, params)
    final = drain(engine)
    return [final[f"ref-{i}"] for i in range(len(batch))]


def mixed_batch(engine: LLMEngine) -> list[tuple[list[int], SamplingParams]]:
    """Members that stop for every reason at different iterations: length, EOS, a stop token id taken from
    a first greedy run (so it surely occurs mid-way), seeded sampling with filters."""
    probe = iteration_level(engine, [([5, 6, 7], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))])
    stop_id = probe[0].token_ids[4]
    return [
        ([3, 1, 4, 1, 5], SamplingParams(max_tokens=7, temperature=0)),
        ([9, 2, 6], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)),
        ([5, 6, 7], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])),
        (list(range(10, 40)), SamplingParams(max_tokens=3, temperature=0.9, top_k=20, seed=11)),
        ([100], SamplingParams(max_tokens=25, temperature=1.0, top_p=0.9, seed=3)),
        ([8, 8], SamplingParams(max_tokens=30, temperature=1.0, seed=5)),  # may meet EOS
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_request_level_batch_gives_the_iteration_level_tokens(family: str) -> None:
    engine = baseline_engine(family, max_bs=8)
    batch = mixed_batch(engine)
    expected = iteration_level(engine, batch)
    assert {o.finish_reason for o in expected} == {"length", "stop"}
    batcher = RequestLevelBatcher(engine)
    outputs = batcher.run(batch)
    assert [o.token_ids for o in outputs] == [e.token_ids for e in expected]
    assert [o.finish_reason for o in outputs] == [e.finish_reason for e in expected]
    # FasterTransformer-style: one batch, every member run for the longest member's 40 iterations, and
    # every member answered at the same moment, when the batch ends.
    assert len(batcher.last_plan) == 1
    assert batcher.last_plan[0].run_tokens == (40,) * len(batch)
    assert len({o.finish_time for o in outputs}) == 1
    assert not engine.has_unfinished()


def test_request_level_splits_a_batch_the_kv_budget_cannot_hold() -> None:
    engine = baseline_engine("gpt2", max_bs=8, n_slots=100)
    batch = [([i + 1] * 10, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for i, n in
             enumerate((5, 30, 5, 5))]
    batcher = RequestLevelBatcher(engine)
    outputs = batcher.run(batch)
    # 40 slots each at the batch's length: two members per sub-batch, in arrival order.
    assert [s.members for s in batcher.last_plan] == [(0, 1), (2, 3)]
    assert [s.run_tokens for s in batcher.last_plan] == [(30, 30), (5, 5)]
    assert [o.token_ids for o in outputs] == [e.token_ids for e in iteration_level(engine, batch)]
    assert len({o.finish_time for o in outputs}) == 1  # still answered together


def test_request_level_member_near_the_context_end_runs_what_its_context_holds() -> None:
    engine = baseline_engine("gpt2", max_bs=8)  # context 128
    batch = [
        (list(range(1, 121)), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)),
        ([1, 2, 3], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)),
    ]
    batcher = RequestLevelBatcher(engine)
    outputs = batcher.run(batch)
    assert batcher.last_plan[0].run_tokens == (8, 60)
    assert [o.token_ids for o in outputs] == [e.token_ids for e in iteration_level(engine, batch)]


def test_request_level_rejects_an_invalid_member_before_any_work() -> None:
    engine = baseline_engine("gpt2", max_bs=8)
    batch = [([1, 2], SamplingParams(max_tokens=4)), ([1, 500], SamplingParams(max_tokens=4))]
    with pytest.raises(ValueError, match=r"batch member 1: .*out of range"):
        RequestLevelBatcher(engine).run(batch)
    assert not engine.has_unfinished()


def test_request_level_runs_without_prefix_caching() -> None:
    """FasterTransformer computed every prompt whole: the baseline refuses an engine with a prefix cache,
    and a prompt it has run before is computed again (num_cached_tokens 0)."""
    with pytest.raises(ValueError, match="needs an engine with enable_prefix_caching=False"):
        RequestLevelBatcher(tiny_engine("gpt2", kv_admission="reserve", max_num_batched_tokens=None))
    batcher = RequestLevelBatcher(baseline_engine("gpt2"))
    prompt = list(range(1, 41))  # two full blocks of 16 and 8 tokens more
    batch = [(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))] * 2
    first, again = batcher.run(batch), batcher.run(batch)
    assert [o.num_cached_tokens for o in first + again] == [0] * 4
    assert again[0].token_ids == first[0].token_ids
    assert batcher.engine.stats().prefix_cache_hits == 0
    batcher.validate(prompt, batch[0][1], cache_salt="tenant-a")  # checked as orca_gpt checks it, then unused
    with pytest.raises(ValueError, match="cache_salt must be a string of 1 to 1024 characters"):
        batcher.validate(prompt, batch[0][1], cache_salt="")


def test_request_level_stop_strings_and_eos_match_the_engine_on_smollm2() -> None:
    # The session's shared SmolLM2 engine admits on demand; the baseline needs its own, reserving engine.
    engine = LLMEngine(EngineConfig(model=smollm2().engine.config.model, **REQUEST_LEVEL_OPTIONS))
    tok = engine.tokenizer
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    batch = [
        (tok.encode(prompts[0]), SamplingParams(max_tokens=12, temperature=0, stop=["."])),
        (tok.encode(prompts[1]), SamplingParams(max_tokens=16, temperature=0, stop=["there", "\n"])),
        (tok.encode(prompts[2]), SamplingParams(max_tokens=6, temperature=0)),
        # " Paris." : the stop string is completed by the last allowed token, and still wins.
        (tok.encode(prompts[0]), SamplingParams(max_tokens=2, temperature=0, stop=["."])),
    ]
    outputs = RequestLevelBatcher(engine).run(batch)
    expected = iteration_level(engine, batch)
    assert [o.token_ids for o in outputs] == [e.token_ids for e in expected]
    assert [o.text for o in outputs] == [e.text for e in expected]
    assert [o.finish_reason for o in outputs] == [e.finish_reason for e in expected]
    assert outputs[0].finish_reason == "stop" and "." not in outputs[0].text
    assert outputs[3].finish_reason == "stop" and outputs[3].text == " Paris"


# -- the baseline, end to end -------------------------------------------------------------------------
LONG = 1000  # iterations of the batch's longest member: long enough that orca_tiny answers the rest first

BATCH = [  # the longest first: with request-level batching no answer may come before its answer
    {"input_ids": [1, 2, 3], "max_tokens": LONG, "temperature": 0, "ignore_eos": True},
    {"input_ids": [4, 5], "max_tokens": 1, "temperature": 0, "ignore_eos": True},
    {"input_ids": [6] * 10, "max_tokens": 9, "temperature": 1.0, "top_k": 20, "seed": 7},
    {"input_ids": [7, 8, 9, 10], "max_tokens": 30, "temperature": 0},
]
assert len(BATCH) == REQUEST_LEVEL_TINY_BATCH  # one full Triton batch: it runs at once


def stream_batch(url: str, model: str, requests: list[dict[str, Any]], batched: bool) -> list[tuple[str, Any]]:
    """Sends the requests on one gRPC stream, in order; returns (request id, Chunk or error) in the order
    the answers arrived."""
    answers: queue.Queue[tuple[str, Any]] = queue.Queue()

    def on_result(result: Any, error: Any) -> None:
        if error is not None:
            answers.put(("?", error))
        else:
            answers.put((result.get_response().id, parse_result(result)))

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=on_result)
    try:
        for i, request in enumerate(requests):
            client.async_stream_infer(model, triton_inputs(request, batched), request_id=f"member-{i}")
        received: list[tuple[str, Any]] = []
        while len(received) < len(requests):
            try:
                received.append(answers.get(timeout=300))
            except queue.Empty:
                missing = f"{len(received)} of {len(requests)} answers in 300 s"
                raise AssertionError(f"{model}: {missing}: {received}") from None
        return received
    finally:
        client.stop_stream()
        client.close()


def triton_inputs(request: dict[str, Any], batched: bool) -> list[grpcclient.InferInput]:
    """The same tensors for both models; the batching model's carry Triton's batch dimension."""
    sampling = {k: v for k, v in request.items() if k not in ("input_ids", "stream")}
    values = {
        "input_ids": ("INT32", np.asarray(request["input_ids"], dtype=np.int32)),
        "stream": ("BOOL", np.asarray([request.get("stream", False)])),
        "sampling_parameters": ("BYTES", np.asarray([json.dumps(sampling).encode()], dtype=np.object_)),
        # the outputs compared below come only when asked for (vllm_backend's flags)
        **{flag: ("BOOL", np.asarray([True])) for flag in
           ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")},
    }
    inputs = []
    for name, (dtype, value) in values.items():
        value = value[np.newaxis] if batched else value
        tensor = grpcclient.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def model_stats(server: Any, model: str) -> dict[str, Any]:
    """Triton's statistics of `model` (an administrative API: the server's admin key)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        stats = client.get_inference_statistics(model, as_json=True, headers=server.grpc_admin_headers)
        stats = stats["model_stats"][0]
    finally:
        client.close()
    full = [b for b in stats.get("batch_stats", []) if int(b["batch_size"]) == REQUEST_LEVEL_TINY_BATCH]
    return {
        "executions": int(stats.get("execution_count", 0)),
        "inferences": int(stats.get("inference_count", 0)),
        "full_batches": int(full[0]["compute_infer"]["count"]) if full else 0,
    }


@pytest.fixture(scope="module")
def baseline_batch(orca_server: Any) -> dict[str, Any]:
    """BATCH through request_level_tiny (one Triton batch) and through orca_tiny, each on one stream."""
    before = model_stats(orca_server, REQUEST_LEVEL_TINY)
    baseline = stream_batch(orca_server.grpc_url, REQUEST_LEVEL_TINY, BATCH, batched=True)
    after = model_stats(orca_server, REQUEST_LEVEL_TINY)
    orca = stream_batch(orca_server.grpc_url, "orca_tiny", BATCH, batched=False)
    return {"baseline": baseline, "orca": orca, "before": before, "after": after}


def test_baseline_members_of_one_batch_return_together_after_the_longest(baseline_batch: dict[str, Any]) -> None:
    before, after = baseline_batch["before"], baseline_batch["after"]
    # Triton ran the four requests as one batch: one execution of batch size four.
    assert after["executions"] - before["executions"] == 1
    assert after["inferences"] - before["inferences"] == REQUEST_LEVEL_TINY_BATCH
    assert after["full_batches"] - before["full_batches"] == 1
    # The longest member (sent first) is answered first: no other member came back before the batch's
    # longest was done, though they needed 1, 9 and 30 iterations against its 1000.
    order = [request_id for request_id, _ in baseline_batch["baseline"]]
    assert order[0] == "member-0"
    assert sorted(order) == [f"member-{i}" for i in range(len(BATCH))]
    # Iteration-level scheduling on the same requests answers every shorter one before the longest.
    orca_order = [request_id for request_id, _ in baseline_batch["orca"]]
    assert orca_order[-1] == "member-0"


def test_baseline_tokens_equal_orca_for_the_same_requests(baseline_batch: dict[str, Any]) -> None:
    baseline = {rid: chunk for rid, chunk in baseline_batch["baseline"]}
    orca = {rid: chunk for rid, chunk in baseline_batch["orca"]}
    for i, request in enumerate(BATCH):
        b, o = baseline[f"member-{i}"], orca[f"member-{i}"]
        assert not isinstance(b, Exception) and not isinstance(o, Exception), (b, o)
        assert b.output_ids == o.output_ids, i
        assert b.finish_reason == o.finish_reason, i
        assert b.num_input_tokens == len(request["input_ids"]) and b.num_output_tokens == len(b.output_ids)
        assert b.num_cached_tokens == 0  # the baseline has no prefix cache
    assert len(baseline["member-0"].output_ids) == LONG
    assert len(baseline["member-1"].output_ids) == 1  # its own max_tokens, though it ran 1000 iterations


def test_baseline_answers_an_invalid_member_alone(orca_server: Any) -> None:
    requests = [
        {"input_ids": [1, 2], "max_tokens": 5, "temperature": 0, "ignore_eos": True},
        {"input_ids": [1, 500], "max_tokens": 5},
        {"input_ids": [3, 4], "max_tokens": 5, "stream": True},
        {"input_ids": [5, 6], "max_tokens": 2, "temperature": 0, "ignore_eos": True},
    ]
    answers = stream_batch(orca_server.grpc_url, REQUEST_LEVEL_TINY, requests, batched=True)
    errors = sorted(str(a) for rid, a in answers if rid == "?")  # stream errors carry no request id
    assert len(errors) == 2
    assert "out of range" in errors[0] and "cannot stream" in errors[1], errors
    done = {rid: a for rid, a in answers if rid != "?"}
    assert len(done["member-0"].output_ids) == 5 and len(done["member-3"].output_ids) == 2


# -- the trace generator ------------------------------------------------------------------------------
def test_trace_is_deterministic_and_identical_across_rates() -> None:
    spec = TraceSpec(num_requests=50, prompt_len=(4, 40), max_new_tokens=(1, 9), seed=3)
    slow, again, fast = make_trace(spec, 1.0), make_trace(spec, 1.0), make_trace(spec, 4.0)
    assert slow == again
    assert [(r.prompt_token_ids, r.max_new_tokens) for r in slow] == [
        (r.prompt_token_ids, r.max_new_tokens) for r in fast
    ]
    assert slow[0].arrival == 0.0 and all(math.isclose(s.arrival, 4 * f.arrival) for s, f in zip(slow, fast))
    assert make_trace(TraceSpec(50, (4, 40), (1, 9), seed=4), 1.0) != slow
    assert all(r.arrival == 0 for r in make_trace(spec, None))


def test_trace_has_the_requested_distributions() -> None:
    spec = TraceSpec(num_requests=20_000, prompt_len=(32, 512), max_new_tokens=(1, 128), token_ids=(10, 20))
    rate = 2.5
    trace = make_trace(spec, rate)
    lengths = [len(r.prompt_token_ids) for r in trace]
    new = [r.max_new_tokens for r in trace]
    for values, (low, high) in ((lengths, spec.prompt_len), (new, spec.max_new_tokens)):
        counts = Counter(values)
        assert min(values) == low and max(values) == high and len(counts) == high - low + 1  # every value
        assert statistics.mean(values) == pytest.approx((low + high) / 2, rel=0.02)
        assert statistics.pvariance(values) == pytest.approx(((high - low + 1) ** 2 - 1) / 12, rel=0.05)
    ids = Counter(t for r in trace[:200] for t in r.prompt_token_ids)
    assert set(ids) == set(range(10, 20))
    # Poisson arrivals: exponential gaps of mean 1/rate (an exponential's std equals its mean).
    gaps = np.diff([r.arrival for r in trace])
    assert gaps.min() > 0
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() == pytest.approx(1 / rate, rel=0.05)
    assert np.mean(gaps > 1 / rate) == pytest.approx(math.exp(-1), abs=0.02)  # P(gap > mean) = 1/e


def test_trace_presets_and_validation() -> None:
    assert PRESETS["paper"].prompt_len == (32, 512) and PRESETS["paper"].max_new_tokens == (1, 128)
    assert PRESETS["offline"].num_requests == 32
    for bad in ({"prompt_len": (0, 4)}, {"max_new_tokens": (5, 4)}, {"token_ids": (7, 7)}, {"num_requests": 0}):
        with pytest.raises(ValueError):
            PRESETS["default"].with_options(**bad)
    with pytest.raises(ValueError, match="rate"):
        make_trace(PRESETS["default"], 0.0)


# -- the benchmarks -----------------------------------------------------------------------------------
TINY_WORKLOAD = ["--prompt-len", "2:16", "--max-new-tokens", "1:8", "--token-ids", "1:200", "--seed", "1"]


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_orca_bench_trace_runs_both_models(orca_server: Any, tmp_path: Path) -> None:
    out, png = tmp_path / "trace.json", tmp_path / "trace.png"
    argv = ["trace", "--url", orca_server.grpc_url, "--models", f"orca_tiny,{REQUEST_LEVEL_TINY}",
            "--rates", "4,16", "--num-requests", "8", "--unloaded-requests", "0", *TINY_WORKLOAD,
            "--metrics-url", orca_server.metrics_url, "--json", str(out), "--plot", str(png)]
    assert orca_bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert_png(png)
    assert [(r["model"], r["rate"]) for r in result["runs"]] == [
        ("orca_tiny", 4), ("orca_tiny", 16), (REQUEST_LEVEL_TINY, 4), (REQUEST_LEVEL_TINY, 16)
    ]
    sent = None
    for run in result["runs"]:
        s = run["summary"]
        assert s["completed"] == 8 and s["errors"] == 0
        assert s["throughput_rps"] > 0 and s["normalized"]["p50"] > 0
        requests = run["requests"]
        assert all(r["output_tokens"] == r["max_new_tokens"] and r["finish_reason"] == "length" for r in requests)
        shape = [(r["prompt_tokens"], r["max_new_tokens"]) for r in requests]
        assert sent is None or shape == sent  # every model and rate gets the same requests
        sent = shape
        streamed = run["model"] == "orca_tiny"
        assert all((r["itl"] is not None) == (streamed and r["output_tokens"] > 1) for r in requests)
        # K/V numbers from the metrics endpoint for orca_tiny only: the baseline exports no K/V gauges.
        assert (run["kv"] is not None) == streamed
        if streamed:
            assert run["kv"]["preemptions"] == 0 and run["kv"]["samples"] >= 2
    assert "no orca_kv_allocated_blocks" in result["kv_notes"][REQUEST_LEVEL_TINY]
    assert result["model_parameters"]["orca_tiny"]["max_bs"] == "8"
    assert result["slo"]["slo"] > 0 and set(result["throughput_within_slo"]) == {"orca_tiny", REQUEST_LEVEL_TINY}


def test_orca_bench_trace_reads_kv_utilization_from_the_metrics_endpoint(orca_server: Any, tmp_path: Path) -> None:
    # Long requests all at once, so the samples (every 20 ms) find the pool in use for a while.
    out = tmp_path / "trace.json"
    argv = ["trace", "--url", orca_server.grpc_url, "--models", "orca_tiny", "--rates", "1000", "--num-requests", "8",
            "--unloaded-requests", "0", "--no-progress", "--prompt-len", "20:40", "--max-new-tokens", "300:400",
            "--token-ids", "1:200", "--metrics-url", orca_server.metrics_url, "--metrics-interval", "0.02",
            "--json", str(out)]
    assert orca_bench.main(argv) == 0
    kv = json.loads(out.read_text())["runs"][0]["kv"]
    assert kv["busy_samples"] > 0 and 0 < kv["utilization"] <= 1
    assert kv["block_size"] == 16 and kv["total_blocks"] == 8192 // 16  # orca_tiny: n_slots 8192
    assert 0 < kv["mean_allocated_blocks"] <= kv["peak_allocated_blocks"] <= kv["total_blocks"]
    assert kv["preemptions"] == 0  # the pool holds every request


def test_orca_bench_trace_unloaded_pass(orca_server: Any, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    argv = ["trace", "--url", orca_server.grpc_url, "--models", "orca_tiny", "--rates", "8", "--num-requests", "4",
            "--unloaded-requests", "2", "--no-progress", "--paper", *TINY_WORKLOAD, "--json", str(out)]
    assert orca_bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["unloaded"]["orca_tiny"]["summary"]["completed"] == 2
    assert result["slo"]["source"] == "unloaded"
    assert result["trace"]["prompt_len"] == [2, 16]  # explicit options override the --paper preset


OFFLINE_TINY = ["--num-requests", "5", "--prompt-len", "4:12", "--token-ids", "1:190", "--peak-seconds", "0.2"]


def run_offline(tmp_path: Path, *options: str) -> dict[str, Any]:
    out = tmp_path / "offline.json"
    argv = ["offline", "--model", str(tiny_checkpoint("llama")), *OFFLINE_TINY, *options, "--json", str(out)]
    assert orca_bench.main(argv) == 0
    return json.loads(out.read_text())


def expected_tokens(result: dict[str, Any]) -> int:
    spec = TraceSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in result["trace"].items()})
    return sum(r.max_new_tokens for r in make_trace(spec, None))  # EOS ignored: exactly these


def test_orca_bench_offline_both_policies_against_transformers(tmp_path: Path) -> None:
    # Requests that generate many blocks' worth of tokens (blocks of 4, 8-24 new tokens): reserve holds the
    # blocks for prompt + max_tokens from admission, on_demand only those of the tokens computed so far.
    result = run_offline(tmp_path, "--kv-admission", "both", "--block-size", "4", "--max-new-tokens", "8:24")
    assert result["kv_admission"] == ["reserve", "on_demand"]
    runs = result["orca_policies"]
    assert list(runs) == ["reserve", "on_demand"] and result["orca"] == runs["on_demand"]
    assert result["linear_backend"] == "hybrid"  # what auto resolved to on this CPU (a tiny model: it fits)
    assert result["enable_prefix_caching"] is True  # the engine's default (--prefix-caching on)
    hf = result["transformers"]
    assert hf["generated_tokens"] == expected_tokens(result) and hf["tokens_per_second"] > 0 and hf["mfu"] > 0
    assert hf["same_tokens_as_orca"] == 5  # greedy in fp32: the same tokens from both
    assert result["same_tokens_across_policies"] == 5 and result["ratio"] > 0 and result["peak_flops"] > 0
    for policy, run in runs.items():
        assert run["kv_admission"] == policy and run["max_num_batched_tokens"] is None
        assert run["generated_tokens"] == expected_tokens(result) and run["tokens_per_second"] > 0
        assert run["mfu"] > 0 and run["model_flops"] == hf["model_flops"]
        assert run["same_tokens_as_transformers"] == 5 and run["ratio_to_transformers"] > 0
        kv = run["kv"]
        assert 0 < kv["utilization"] <= 1 and kv["block_size"] == 4 and kv["preemptions"] == 0
        assert 0 < kv["mean_allocated_blocks"] <= kv["peak_allocated_blocks"] <= kv["total_blocks"]
        assert run["iterations"] > 0 and run["mean_batch_size"] > 0
        breakdown = run["breakdown"]
        assert set(breakdown["seconds"]) == {"attention", "batched_ops", "sampling", "prepare", "scheduling"}
        assert breakdown["attention_measured"] and breakdown["seconds"]["attention"] > 0
        assert breakdown["profiled_iterations"] == breakdown["iterations"] == run["iterations"]
        assert sum(breakdown["fraction"].values()) == pytest.approx(1.0)
    # Every request runs to its max_tokens, and still reserve's blocks are partly empty until the end.
    assert runs["on_demand"]["kv"]["utilization"] > runs["reserve"]["kv"]["utilization"]
    assert runs["on_demand"]["kv"]["mean_allocated_blocks"] < runs["reserve"]["kv"]["mean_allocated_blocks"]


def test_orca_bench_offline_small_pool_preempts_on_demand_only(tmp_path: Path) -> None:
    # 12 blocks of 4 tokens for 5 requests of up to 12 + 24 tokens: reserve admits them a few at a time,
    # on_demand admits more and preempts (recomputing later) when they outgrow the pool; a token budget of
    # 6 splits prompts into chunks. The tokens do not change.
    result = run_offline(tmp_path, "--kv-admission", "both", "--block-size", "4", "--max-new-tokens", "8:24",
                         "--n-slots", "48", "--max-num-batched-tokens", "6", "--skip-transformers")
    assert "transformers" not in result and "ratio" not in result
    runs = result["orca_policies"]
    assert result["same_tokens_across_policies"] == 5
    assert runs["reserve"]["kv"]["preemptions"] == 0 and runs["on_demand"]["kv"]["preemptions"] > 0
    for run in runs.values():
        assert run["n_slots"] == 48 and run["kv"]["total_blocks"] == 12 and run["max_num_batched_tokens"] == 6
        assert run["generated_tokens"] == expected_tokens(result)
        assert 0 < run["kv"]["utilization"] <= 1 and run["kv"]["peak_allocated_blocks"] <= 12


def test_orca_bench_distributed_measures_the_control_plane(tmp_path: Path) -> None:
    out = tmp_path / "distributed.json"
    argv = ["distributed", "--model", str(tiny_checkpoint("llama")), "--layouts", "1x1,2x1", "--batch", "3",
            "--context-lens", "8,40", "--decode-steps", "5", "--json", str(out)]
    assert orca_bench.main(argv) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["tensor_parallel_size"], r["context_len"]) for r in runs] == [(1, 8), (1, 40), (2, 8), (2, 40)]
    for r in runs:
        assert r["iterations"] == 4 and r["iteration_ms_median"] > 0  # decode iterations of the whole batch
    in_process, parallel = runs[:2], runs[2:]
    assert all(r["plan_bytes_median"] is None and r["overhead_ms_median"] is None for r in in_process)
    for r in parallel:
        assert 0 < r["plan_bytes_median"] < 1000 and 0 <= r["overhead_ms_median"] < r["iteration_ms_median"]
    # What is sent per iteration does not grow with the tokens held (only integer widths may).
    assert abs(parallel[1]["plan_bytes_median"] - parallel[0]["plan_bytes_median"]) <= 32


def test_orca_bench_core_times_the_scheduler_thread_and_the_output_side_apart(tmp_path: Path) -> None:
    """The engine core over the stub executor: every (batch, history) point, its requests brought to the
    history first; the core's time and the output side's are measured apart, the stub's taken out."""
    out = tmp_path / "core.json"
    argv = ["core", "--model", str(tiny_checkpoint("gpt2")), "--batch", "2,5", "--history", "0,40", "--steps", "4",
            "--logprobs", "2", "--json", str(out)]
    assert orca_bench.main(argv) == 0
    points = json.loads(out.read_text())["points"]
    assert [(p["batch"], p["history"]) for p in points] == [(2, 0), (2, 40), (5, 0), (5, 40)]
    for p in points:
        assert p["steps"] == 4 and p["core_ms"] > 0 and p["output_ms"] > 0 and p["stub_ms"] > 0
        assert p["engine"] == "token-only core + OutputProcessor"


def test_orca_bench_linears_times_each_backend_over_the_models_weights(tmp_path: Path) -> None:
    out = tmp_path / "linears.json"
    argv = ["linears", "--model", str(tiny_checkpoint("llama")), "--rows", "1,4,400", "--repeats", "3",
            "--json", str(out)]
    assert orca_bench.main(argv) == 0
    result = json.loads(out.read_text())
    # The tiny Llama: 3 layers x (qkv, o, gate_up, down) + its untied head.
    assert result["linears"] == 13 and result["sum_bandwidth_gb_per_s"] > 0
    assert [r["rows"] for r in result["runs"]] == [1, 4, 400]
    for r in result["runs"]:
        assert r["reference"]["ms"] > 0 and r["onednn"]["ms"] > 0 and r["hybrid"]["ms"] > 0
        assert r["ratio_reference_to_onednn"] == pytest.approx(r["reference"]["ms"] / r["onednn"]["ms"])
        assert r["ratio_onednn_to_hybrid"] == pytest.approx(r["onednn"]["ms"] / r["hybrid"]["ms"])
        # the quantized layers' own kernels: int8; int4's groups of 32 do not divide the tiny MLP's 112 columns
        assert r["int8"]["ms"] > 0 and r["ratio_onednn_to_int8"] == pytest.approx(r["onednn"]["ms"] / r["int8"]["ms"])
        assert "int4" not in r


def test_orca_bench_decode_sweeps_batch_sizes_against_transformers_and_the_roofline(tmp_path: Path) -> None:
    """The GPU benchmark (orca_client/bench/decode.py) at CPU size: a random tiny Llama built on the spot,
    orca's reference, batched and flex backends, transformers' continuous batching, three batch sizes."""
    out = tmp_path / "decode.json"
    # The rate is the difference between a 33-token and a 1-token run (medians of 3): with 5 tokens, 4 decode
    # steps of this tiny model (~1 ms each) were within a busy host's noise, and the difference came out
    # negative (no rate) under a competing process.
    argv = ["decode", "--shape", "tiny", "--device", "cpu", "--batch-sizes", "1,3,4", "--prompt-len", "6",
            "--new-tokens", "33", "--repeats", "3", "--systems", "orca-reference,orca-batched,orca-flex,transformers",
            "--json", str(out)]
    assert orca_bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["systems"] == ["orca-reference", "orca-batched", "orca-flex", "transformers"]
    assert result["dtype"] == "float32"
    assert result["shape"]["num_layers"] == 2 and result["copy_bandwidth_bytes_per_second"] > 0
    assert [r["batch"] for r in result["runs"]] == [1, 3, 4]
    bounds = [r["roofline_tokens_per_second"] for r in result["runs"]]
    assert bounds == sorted(bounds) and bounds[0] > 0  # more rows per weight read
    for r in result["runs"]:
        for system in result["systems"]:
            run = r[system]
            assert run["decode_tokens_per_second"] > 0 and 0 < run["fraction_of_roofline"] < 1
        assert r["orca-flex"]["attention_backend"] == "flex" and r["orca-flex"]["cuda_graph_sizes"] is None
        assert r["orca-batched"]["attention_backend"] == "batched"
        # Greedy in fp32 on the same weights: the same tokens as transformers.
        for system in ("orca-reference", "orca-batched", "orca-flex"):
            assert r[system]["same_tokens_as_transformers"] == r["batch"], system
    assert orca_bench.main(["decode", "--systems", "vllm"]) == 2  # refused before any work


def test_orca_bench_decode_over_a_quantized_kv_pool(tmp_path: Path) -> None:
    """--kv-cache-dtype: orca's systems over an int8 pool (flex reads it too), the roofline counting a byte a
    value and a float32 scale per token and K/V head."""
    out = tmp_path / "decode.json"
    argv = ["decode", "--shape", "tiny", "--device", "cpu", "--batch-sizes", "1,3", "--prompt-len", "6",
            "--new-tokens", "33", "--repeats", "2", "--systems", "orca-batched,orca-flex", "--kv-cache-dtype",
            "int8", "--json", str(out)]
    assert orca_bench.main(argv) == 0
    result = json.loads(out.read_text())
    shape = result["shape"]
    assert result["kv_cache_dtype"] == "int8"
    assert result["kv_bytes_per_token"] == shape["num_layers"] * 2 * shape["num_kv_heads"] * (shape["head_dim"] + 4)
    for r in result["runs"]:
        for system in result["systems"]:
            assert r[system]["decode_tokens_per_second"] > 0, system


def test_decode_roofline_counts_weights_once_and_kv_per_request() -> None:
    from orca_client.bench.decode import roofline

    # 1 GB of weights and 1 kB per token of context at 1 TB/s: one request of 1000 tokens reads 1.001 GB.
    assert roofline(10**9, 1000, 1, 1000, 10**12) == pytest.approx(1 / 1.001e-3)
    assert roofline(10**9, 1000, 8, 1000, 10**12) == pytest.approx(8 / 1.008e-3)


def test_kv_usage_weights_iterations_by_duration() -> None:
    usage = orca_bench_offline.KVUsage(block_size=4)
    for duration, used, blocks, batch in ((1.0, 8, 4, 2), (3.0, 16, 4, 3), (5.0, 0, 0, 1)):
        usage.add(IterationStats(batch_size=batch, duration=duration, kv_used_tokens=used, kv_allocated_blocks=blocks))
    summary = usage.summary()
    # 8/16 for 1 s, 16/16 for 3 s; the iteration with nothing allocated is left out.
    assert summary["utilization"] == pytest.approx((0.5 * 1 + 1.0 * 3) / 4)
    assert summary["mean_allocated_blocks"] == pytest.approx(4.0) and summary["peak_allocated_blocks"] == 4
    assert usage.iterations == 3 and usage.mean_batch_size == pytest.approx(2.0)
    assert orca_bench_offline.KVUsage(block_size=16).summary()["utilization"] is None


METRICS_TEXT = """# HELP orca_kv_allocated_blocks K/V blocks held by requests
# TYPE orca_kv_allocated_blocks gauge
orca_kv_allocated_blocks{{model="orca_gpt",version="1"}} {allocated}
orca_kv_allocated_blocks{{model="other",version="1"}} 99
orca_kv_used_tokens{{model="orca_gpt",version="1"}} {used}
orca_kv_reserved_slots{{model="orca_gpt",version="1"}} {slots}
orca_kv_total_blocks{{model="orca_gpt",version="1"}} 100
orca_preemptions_total{{model="orca_gpt",version="1"}} {preemptions}
nv_inference_count{{model="orca_gpt",version="1"}} 12
orca_lora_requests_total{{model="other",version="1",adapter="model=\\"orca_gpt\\""}} 5
orca_kv_used_tokens_extra{{model="orca_gpt",version="1"}} 7
"""


def test_parse_metrics_keeps_one_models_samples() -> None:
    text = METRICS_TEXT.format(allocated=3, used=40, slots=48, preemptions=2)
    assert orca_bench_trace.parse_metrics(text, "orca_gpt") == {
        "orca_kv_allocated_blocks": 3, "orca_kv_used_tokens": 40, "orca_kv_reserved_slots": 48,
        "orca_kv_total_blocks": 100, "orca_preemptions_total": 2, "nv_inference_count": 12,
        "orca_kv_used_tokens_extra": 7,
    }
    # Only the named metrics (not one whose name merely starts with a named one's).
    assert orca_bench_trace.parse_metrics(text, "orca_gpt", ["orca_kv_used_tokens", "orca_kv_total_blocks"]) == {
        "orca_kv_used_tokens": 40, "orca_kv_total_blocks": 100,
    }
    other = {"orca_kv_allocated_blocks": 99, "orca_lora_requests_total": 5}
    assert orca_bench_trace.parse_metrics(text, "other") == other
    assert orca_bench_trace.parse_metrics(text, "request_level_gpt") == {}


@pytest.fixture
def metrics_endpoint() -> Any:
    """A local HTTP server answering each GET with the next of `texts` (the last one repeats)."""
    import http.server
    import threading

    texts: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = (texts.pop(0) if len(texts) > 1 else texts[0]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return None

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics", texts
    server.shutdown()
    server.server_close()


def test_kv_sampler_averages_the_busy_samples(metrics_endpoint: Any) -> None:
    url, texts = metrics_endpoint
    texts.extend([
        METRICS_TEXT.format(allocated=0, used=0, slots=0, preemptions=5),  # idle: left out
        METRICS_TEXT.format(allocated=2, used=16, slots=32, preemptions=5),  # 50%
        METRICS_TEXT.format(allocated=4, used=64, slots=64, preemptions=7),  # 100%
        METRICS_TEXT.format(allocated=0, used=0, slots=0, preemptions=8),
    ])
    with orca_bench_trace.KVSampler(url, "orca_gpt", interval=0.01, block_size=99) as sampler:
        deadline = time.monotonic() + 10
        while len(sampler.samples) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    kv = sampler.summary()
    assert kv is not None and kv["busy_samples"] == 2 and kv["samples"] >= 4
    assert kv["utilization"] == pytest.approx(0.75) and kv["block_size"] == 16  # slots / blocks, not 99
    assert kv["mean_allocated_blocks"] == pytest.approx(3.0) and kv["peak_allocated_blocks"] == 4
    assert kv["preemptions"] == 3 and kv["total_blocks"] == 100


def test_kv_sampler_reports_none_without_gauges_or_endpoint(metrics_endpoint: Any) -> None:
    url, texts = metrics_endpoint
    texts.append(METRICS_TEXT.format(allocated=1, used=1, slots=16, preemptions=0))
    for sampler_url, model, note in (
        (url, "request_level_gpt", "exports no orca_kv_allocated_blocks"),
        ("http://127.0.0.1:9/metrics", "orca_gpt", "not reachable"),  # the discard port: nothing listens
        ("", "orca_gpt", "no metrics URL"),
    ):
        with orca_bench_trace.KVSampler(sampler_url, model, interval=0.01) as sampler:
            pass
        assert sampler.summary() is None and note in (sampler.note or "")


def test_throughput_within_slo_reads_the_curve_up_to_its_first_crossing() -> None:
    def run(rate: float, tput: float, median: float) -> dict[str, Any]:
        return {"rate": rate, "summary": {"throughput_rps": tput, "normalized": {"p50": median}}}

    curve = [run(2, 1.8, 0.2), run(1, 1.0, 0.1), run(3, 2.6, 0.6), run(4, 3.0, 0.3)]  # any order
    # 0.2 -> 0.6 crosses 0.3 a quarter of the way from 1.8 to 2.6; the later point back under the SLO
    # (noise past the knee) does not count.
    assert orca_bench_trace.throughput_within_slo(curve, slo=0.3) == pytest.approx(2.0)
    assert orca_bench_trace.throughput_within_slo(curve, slo=1.0) == pytest.approx(3.0)
    assert orca_bench_trace.throughput_within_slo(curve, slo=0.05) == 0.0
