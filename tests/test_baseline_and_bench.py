"""The request-level baseline (orca.request_level, model_repository/request_level_gpt), the Orca trace
generator and the orca-bench commands.

The baseline is checked offline against the iteration-level engine (same tokens, same finish reasons)
and end to end through the session's one Triton (request_level_tiny beside orca_tiny, tests/_server.py).
The benchmarks only have to run to completion and write valid JSON and a PNG: no timing is asserted.
"""

from __future__ import annotations

import json
import math
import queue
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from _fixtures import FAMILIES, drain, smollm2, tiny_checkpoint, tiny_engine
from _server import REQUEST_LEVEL_TINY, REQUEST_LEVEL_TINY_BATCH
from orca_client import bench as orca_bench
from orca_client.client import parse_result
from orca_client.trace import PRESETS, TraceSpec, make_trace

from orca import LLMEngine, SamplingParams
from orca.request_level import RequestLevelBatcher


# -- the baseline, offline -----------------------------------------------------------------------------
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
    engine = tiny_engine(family, max_bs=8)
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
    engine = tiny_engine("gpt2", max_bs=8, n_slots=100)
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
    engine = tiny_engine("gpt2", max_bs=8)  # context 128
    batch = [
        (list(range(1, 121)), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)),
        ([1, 2, 3], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)),
    ]
    batcher = RequestLevelBatcher(engine)
    outputs = batcher.run(batch)
    assert batcher.last_plan[0].run_tokens == (8, 60)
    assert [o.token_ids for o in outputs] == [e.token_ids for e in iteration_level(engine, batch)]


def test_request_level_rejects_an_invalid_member_before_any_work() -> None:
    engine = tiny_engine("gpt2", max_bs=8)
    batch = [([1, 2], SamplingParams(max_tokens=4)), ([1, 500], SamplingParams(max_tokens=4))]
    with pytest.raises(ValueError, match=r"batch member 1: .*out of range"):
        RequestLevelBatcher(engine).run(batch)
    assert not engine.has_unfinished()


def test_request_level_stop_strings_and_eos_match_the_engine_on_smollm2() -> None:
    engine = smollm2().engine
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
    }
    inputs = []
    for name, (dtype, value) in values.items():
        value = value[np.newaxis] if batched else value
        tensor = grpcclient.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def model_stats(url: str, model: str) -> dict[str, Any]:
    client = grpcclient.InferenceServerClient(url)
    try:
        stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
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
    before = model_stats(orca_server.grpc_url, REQUEST_LEVEL_TINY)
    baseline = stream_batch(orca_server.grpc_url, REQUEST_LEVEL_TINY, BATCH, batched=True)
    after = model_stats(orca_server.grpc_url, REQUEST_LEVEL_TINY)
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
            "--json", str(out), "--plot", str(png)]
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
    assert result["slo"]["slo"] > 0 and set(result["throughput_within_slo"]) == {"orca_tiny", REQUEST_LEVEL_TINY}


def test_orca_bench_trace_unloaded_pass(orca_server: Any, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    argv = ["trace", "--url", orca_server.grpc_url, "--models", "orca_tiny", "--rates", "8", "--num-requests", "4",
            "--unloaded-requests", "2", "--no-progress", "--paper", *TINY_WORKLOAD, "--json", str(out)]
    assert orca_bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["unloaded"]["orca_tiny"]["summary"]["completed"] == 2
    assert result["slo"]["source"] == "unloaded"
    assert result["trace"]["prompt_len"] == [2, 16]  # explicit options override the --paper preset


def test_orca_bench_offline_runs_orca_and_transformers(tmp_path: Path) -> None:
    out = tmp_path / "offline.json"
    argv = ["offline", "--model", str(tiny_checkpoint("llama")), "--num-requests", "5", "--prompt-len", "4:12",
            "--max-new-tokens", "1:6", "--peak-seconds", "0.2", "--json", str(out)]
    assert orca_bench.main(argv) == 0
    result = json.loads(out.read_text())
    spec = TraceSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in result["trace"].items()})
    expected_tokens = sum(r.max_new_tokens for r in make_trace(spec, None))  # EOS ignored: exactly these
    for name in ("orca", "transformers"):
        run = result[name]
        assert run["generated_tokens"] == expected_tokens and run["tokens_per_second"] > 0
        assert run["mfu"] > 0 and run["model_flops"] == result["orca"]["model_flops"]
    assert result["transformers"]["same_tokens_as_orca"] == 5  # greedy: the same tokens from both
    assert result["ratio"] > 0 and result["peak_flops"] > 0
    breakdown = result["breakdown"]
    assert set(breakdown["seconds"]) == {"attention", "batched_ops", "sampling", "prepare", "scheduling"}
    assert breakdown["attention_measured"] and breakdown["seconds"]["attention"] > 0
    assert sum(breakdown["fraction"].values()) == pytest.approx(1.0)




def test_throughput_within_slo_reads_the_curve_up_to_its_first_crossing() -> None:
    def run(rate: float, tput: float, median: float) -> dict[str, Any]:
        return {"rate": rate, "summary": {"throughput_rps": tput, "normalized": {"p50": median}}}

    curve = [run(2, 1.8, 0.2), run(1, 1.0, 0.1), run(3, 2.6, 0.6), run(4, 3.0, 0.3)]  # any order
    # 0.2 -> 0.6 crosses 0.3 a quarter of the way from 1.8 to 2.6; the later point back under the SLO
    # (noise past the knee) does not count.
    assert orca_bench.throughput_within_slo(curve, slo=0.3) == pytest.approx(2.0)
    assert orca_bench.throughput_within_slo(curve, slo=1.0) == pytest.approx(3.0)
    assert orca_bench.throughput_within_slo(curve, slo=0.05) == 0.0
