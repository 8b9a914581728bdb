"""The iteration timeline (issue 13): orca/core/timeline.py records what the engine did per iteration;
`orca-bench timeline` turns a trace into a Perfetto JSON and a PNG; `orca-bench trace --timeline` records
one for each model it drives through Triton."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from _fixtures import drain, tiny_checkpoint, tiny_engine
from _server import REQUEST_LEVEL_TINY
from orca_client import bench as orca_bench
from orca_client.timeline import _queue, _waiting_spans, request_tracks, summarize, to_perfetto
from tritonclient.utils import InferenceServerException

from orca import LLM, EngineConfig, LLMEngine, RequestOutput, SamplingParams
from orca.core.timeline import Timeline, read_timeline, rotated_paths
from orca.frontend.request_level import REQUEST_LEVEL_OPTIONS, RequestLevelBatcher

MAX_BS = 4
BUDGET = 16  # tokens per iteration: prompts longer than that run in chunks
BLOCK = 8


def busy_engine(trace: Path, **options: Any) -> LLMEngine:
    """Chunked prompts (a token budget), a pool of 12 blocks of 8 allocated on demand (so requests are
    preempted and recomputed), at most MAX_BS requests per iteration."""
    config = {"max_bs": MAX_BS, "max_num_batched_tokens": BUDGET, "n_slots": 96, "block_size": BLOCK,
              "kv_admission": "on_demand", **options}
    return tiny_engine("gpt2", trace=str(trace), **config)


def run_busy(engine: LLMEngine, seed: int = 0) -> tuple[dict[str, RequestOutput], list[str]]:
    """Ten requests, eight at once and two later; one cancelled while it waits and one while it runs."""
    rng = random.Random(seed)
    ids = [f"r{i}" for i in range(10)]
    requests = {
        rid: ([rng.randrange(1, 200) for _ in range(rng.randint(4, 40))],
              SamplingParams(max_tokens=rng.randint(3, 30), temperature=0, ignore_eos=True))
        for rid in ids
    }
    for rid in ids[:8]:
        engine.add_request(rid, *requests[rid])
    final: dict[str, RequestOutput] = {}
    cancelled: list[str] = []

    def collect(outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                assert out.request_id not in final
                final[out.request_id] = out

    for step in range(6):
        collect(engine.step())
        if step == 2:  # r7 is still waiting (the pool holds a few requests); r0 has run (nothing is in
            # flight between two steps of the in-process engine: both leave between iterations)
            assert engine.stats().waiting > 0 and "r7" in engine.request_ids()
            assert engine.abort_request("r7")
            assert engine.abort_request("r0")
            cancelled += ["r7", "r0"]
    for rid in ids[8:]:
        engine.add_request(rid, *requests[rid])
    collect(engine.step())
    final.update(drain(engine))
    assert set(final) == set(ids)
    return final, cancelled


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Timeline, dict[str, RequestOutput], list[str], Path]:
    trace = tmp_path_factory.mktemp("busy") / "trace.jsonl"
    engine = busy_engine(trace)
    try:
        final, cancelled = run_busy(engine)
        assert engine.stats().preemptions > 0  # the workload does preempt
    finally:
        engine.shutdown()
    return read_timeline(trace), final, cancelled, trace


def test_iterations_are_ordered_and_within_the_engines_bounds(busy: Any) -> None:
    timeline, final, _, _ = busy
    header, its = timeline.header, timeline.iterations
    assert header["scheduling"] == "iteration-level"
    assert (header["max_bs"], header["block_size"], header["max_num_batched_tokens"]) == (MAX_BS, BLOCK, BUDGET)
    assert header["kv_total_blocks"] == 96 // BLOCK
    assert [it["id"] for it in its] == list(range(len(its)))  # every iteration, in order
    for before, after in zip(its, its[1:]):
        assert before["start"] + before["duration"] <= after["start"] + 1e-6  # one batch in flight at a time
    for it in its:
        members = it["requests"]
        assert 1 <= len(members) <= MAX_BS
        assert len({m["id"] for m in members}) == len(members)
        assert it["num_tokens"] == sum(m["tokens"] for m in members) <= BUDGET
        assert it["duration"] >= 0 and it["waiting"] >= 0 and it["running"] >= len(members)
        assert 0 <= it["kv_used_tokens"] <= it["kv_blocks"] * BLOCK
        assert sum(m["blocks"] for m in members) <= it["kv_blocks"] <= header["kv_total_blocks"]
        for m in members:
            assert m["blocks"] * BLOCK >= m["start"] + m["tokens"]  # its K/V fits what it holds
            assert m["phase"] in ("prompt", "increment", "recompute")
            if m["phase"] == "increment":
                assert m["tokens"] == 1 and m["start"] > 0
        assert set(it["admitted"]) <= {m["id"] for m in members}
        assert not set(it["preempted"]) & {m["id"] for m in members}
    # All eight first requests arrived before the first iteration: what it did not admit waits.
    assert its[0]["waiting"] + its[0]["running"] == 8
    assert its[-1]["finished"] and len(final) == 10


def test_every_requests_tokens_are_its_increments_plus_one(busy: Any) -> None:
    timeline, final, cancelled, _ = busy
    tracks = {tr.id: tr for tr in request_tracks(timeline)}
    assert set(tracks) == set(final)
    preempted = {rid for it in timeline.iterations for rid in it["preempted"]}
    assert preempted and preempted <= set(final)
    chunked = [tr for tr in tracks.values() if sum(m.phase == "prompt" for m in tr.memberships) > 1]
    assert chunked  # prompts longer than the budget ran in chunks
    for rid, out in final.items():
        tr = tracks[rid]
        n = len(out.token_ids)
        assert tr.sampled == n  # one iteration drew each token
        if rid not in preempted and n:
            assert tr.increments + 1 == n, rid
        # Orca's phases in order: the prompt in chunks that follow each other, then increments; after a
        # preemption the request starts again (recompute) after what the prefix cache still holds of its
        # blocks (whole blocks; position 0 when nothing), and runs on from there.
        position = 0
        for m in tr.memberships:
            if m.start < position:
                assert m.phase == "recompute" and m.start == m.cached and m.start % BLOCK == 0, (rid, m)
            else:
                assert m.start == position, (rid, m)
            position = m.start + m.tokens
        assert (tr.finish_reason, tr.finish_tokens) == (out.finish_reason, n)
        assert tr.arrival is not None and tr.prompt_tokens == out.num_prompt_tokens
    admissions = {rid: sum(rid in it["admitted"] for it in timeline.iterations) for rid in final}
    for rid, tr in tracks.items():
        if tr.memberships and rid not in cancelled:
            assert admissions[rid] == 1 + len(tr.preempted_at), rid
    for rid in cancelled:
        assert final[rid].finish_reason == "cancelled"
    # Cancelled between iterations: a finish record of its own each; r7 never ran, r0 did.
    assert [e["id"] for e in timeline.events_of("finish")] == ["r7", "r0"]
    assert not tracks["r7"].memberships and tracks["r0"].memberships and tracks["r0"].finish_index is None


def test_trace_is_off_by_default_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert EngineConfig().trace is None
    assert EngineConfig.from_parameters({"trace": "", "model": str(tiny_checkpoint("gpt2"))}).trace is None
    llm = LLM(str(tiny_checkpoint("gpt2")), max_bs=2)
    assert llm.engine.timeline is None
    out = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [4, 4]
    assert list(tmp_path.iterdir()) == []


def test_llm_trace_argument_and_bad_bounds(tmp_path: Path) -> None:
    trace = tmp_path / "sub" / "llm.jsonl"
    llm = LLM(str(tiny_checkpoint("gpt2")), trace=trace)  # a Path works too
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    timeline = read_timeline(trace)
    assert [len(it["requests"]) for it in timeline.iterations] == [1] * 5
    assert request_tracks(timeline)[0].sampled == len(out[0].token_ids) == 5
    for bad in ({"trace_max_bytes": 10}, {"trace_backups": -1}, {"trace": 3}):
        with pytest.raises(ValueError):
            EngineConfig(**bad)


def test_rotation_keeps_the_trace_within_its_bound(tmp_path: Path) -> None:
    trace = tmp_path / "rot.jsonl"
    max_bytes, backups = 2048, 2
    engine = tiny_engine("gpt2", trace=str(trace), trace_max_bytes=max_bytes, trace_backups=backups, max_bs=4)
    for i in range(4):
        engine.add_request(f"a{i}", [1 + i, 2, 3], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    drain(engine)
    last = engine.last_iteration.batch_id
    engine.shutdown()
    files = rotated_paths(trace, backups)
    assert all(f.is_file() for f in files) and not trace.with_name("rot.jsonl.3").exists()
    runs = set()
    for f in files:
        assert f.stat().st_size <= max_bytes
        header = json.loads(f.read_text().splitlines()[0])
        assert header["type"] == "header"
        runs.add(header["run"])
    assert len(runs) == 1
    timeline = read_timeline(trace)
    ids = [it["id"] for it in timeline.iterations]
    assert ids == list(range(ids[0], last + 1)) and ids[0] > 0  # the newest iterations, the oldest gone
    assert sum(f.stat().st_size for f in files) <= (backups + 1) * max_bytes
    # A new engine at the same path starts afresh: no rotated file of the old run is left.
    engine = tiny_engine("gpt2", trace=str(trace), trace_max_bytes=max_bytes, trace_backups=backups)
    engine.add_request("b", [1, 2], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    drain(engine)
    engine.shutdown()
    assert not trace.with_name("rot.jsonl.1").exists()
    assert [it["id"] for it in read_timeline(trace).iterations] == [0, 1]


def test_a_line_cut_short_is_skipped(tmp_path: Path) -> None:
    trace = tmp_path / "cut.jsonl"
    engine = tiny_engine("gpt2", trace=str(trace))
    engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    drain(engine)
    engine.shutdown()
    text = trace.read_bytes()
    trace.write_bytes(text[: len(text) - 10])  # the writer died in the middle of the last record
    assert [it["id"] for it in read_timeline(trace).iterations] == [0, 1]
    with pytest.raises(ValueError, match="no such trace"):
        read_timeline(tmp_path / "missing.jsonl")


def test_request_level_batches_are_recorded_with_their_thrown_away_tokens(tmp_path: Path) -> None:
    trace = tmp_path / "rl.jsonl"
    engine = tiny_engine("gpt2", trace=str(trace), max_bs=4, **REQUEST_LEVEL_OPTIONS)
    batcher = RequestLevelBatcher(engine, id_prefix="rl-")
    batch = [([1, 2, 3, 4], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for n in (2, 9, 5)]
    outputs = batcher.run(batch)
    outputs += batcher.run(batch[:2])
    engine.shutdown()
    timeline = read_timeline(trace)
    assert timeline.header["scheduling"] == "request-level"
    assert [len(it["requests"]) for it in timeline.iterations] == [3] * 9 + [2] * 9  # run to the longest
    records = timeline.events_of("batch")
    assert [r["batch"] for r in records] == [0, 1]
    kept = [m["kept_tokens"] for r in records for m in r["members"]]
    assert kept == [len(o.token_ids) for o in outputs] == [2, 9, 5, 2, 9]
    assert all(m["run_tokens"] == 9 for r in records for m in r["members"])
    tracks = {tr.id: tr for tr in request_tracks(timeline)}
    assert {rid: sum(m.phase == "discarded" for m in tr.memberships) for rid, tr in tracks.items()} == {
        "rl-0-0": 7, "rl-0-1": 0, "rl-0-2": 4, "rl-1-0": 7, "rl-1-1": 0}


def test_request_level_members_wait_from_their_arrival(tmp_path: Path) -> None:
    """A member that reached the server before its batch started (it waited in Triton's batcher) arrives
    then: the timeline records the arrival and when it joined, and the drawing shows the wait."""
    trace = tmp_path / "rl.jsonl"
    engine = tiny_engine("gpt2", trace=str(trace), max_bs=4, **REQUEST_LEVEL_OPTIONS)
    batcher = RequestLevelBatcher(engine, id_prefix="rl-")
    batch = [([1, 2, 3, 4], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for n in (2, 3, 4)]
    now = time.monotonic()
    outputs = batcher.run(batch, arrival_times=[now - 2.0, now - 0.5, None])
    with pytest.raises(ValueError, match="2 arrival times for a batch of 3"):
        batcher.run(batch, arrival_times=[now, now])
    engine.shutdown()
    assert [round(o.arrival_time - now, 3) for o in outputs[:2]] == [-2.0, -0.5]
    assert outputs[2].arrival_time >= now
    timeline = read_timeline(trace)
    arrivals = {r["id"]: r for r in timeline.events_of("arrival")}
    assert arrivals["rl-0-0"]["joined"] - arrivals["rl-0-0"]["t"] == pytest.approx(2.0, abs=0.05)
    assert arrivals["rl-0-1"]["joined"] - arrivals["rl-0-1"]["t"] == pytest.approx(0.5, abs=0.05)
    assert "joined" not in arrivals["rl-0-2"]  # it reached the engine as it arrived
    summary = summarize(timeline)
    assert summary["max_wait_seconds"] == pytest.approx(2.0, abs=0.05)
    assert summary["mean_wait_seconds"] == pytest.approx(2.5 / 3, abs=0.05)
    first = timeline.iterations[0]["start"]
    tracks = {tr.id: tr for tr in request_tracks(timeline)}
    assert _waiting_spans(tracks["rl-0-0"], timeline.iterations) == [(arrivals["rl-0-0"]["t"], first)]
    # The queue drawn for request-level scheduling is the members still waiting, not the engine's (empty).
    assert [it["waiting"] for it in timeline.iterations] == [0] * 4
    assert _queue(timeline, list(tracks.values())) == [0] * 4


def test_perfetto_json_and_png_from_the_cli(busy: Any, tmp_path: Path) -> None:
    timeline, final, _, trace = busy
    perfetto, png, summary = tmp_path / "t.perfetto.json", tmp_path / "t.png", tmp_path / "s.json"
    argv = ["timeline", str(trace), "--perfetto", str(perfetto), "--png", str(png), "--json", str(summary)]
    assert orca_bench.main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    data = json.loads(perfetto.read_text())
    assert data == json.loads(json.dumps(to_perfetto(timeline)))
    events = data["traceEvents"]
    pids = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    assert set(pids) == {"iterations", "requests"}
    slices = [e for e in events if e["ph"] == "X" and e["pid"] == pids["iterations"]]
    assert [e["name"] for e in slices] == [f"iteration {it['id']}" for it in timeline.iterations]
    assert [e["args"]["batch_size"] for e in slices] == [len(it["requests"]) for it in timeline.iterations]
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in slices)
    tracks = {e["tid"]: e["args"]["name"] for e in events
              if e["name"] == "thread_name" and e["pid"] == pids["requests"]}
    assert sorted(tracks.values()) == sorted(final)  # one track per request
    phases = [e for e in events if e["ph"] == "X" and e["pid"] == pids["requests"] and e["name"] != "waiting"]
    assert len(phases) == sum(len(it["requests"]) for it in timeline.iterations)
    increments = {rid: 0 for rid in final}
    for e in phases:
        increments[tracks[e["tid"]]] += e["name"] == "increment"
    assert increments == {tr.id: tr.increments for tr in request_tracks(timeline)}
    preempted = [e for e in events if e["name"] == "preempted"]
    assert len(preempted) == sum(len(it["preempted"]) for it in timeline.iterations) > 0
    finished = [e for e in events if e["name"].startswith("finished")]
    assert sorted(tracks[e["tid"]] for e in finished) == sorted(final)
    assert {e["name"] for e in events if e["ph"] == "C"} == {"batch size", "queue", "K/V blocks"}
    s = json.loads(summary.read_text())
    assert s["iterations"] == len(timeline.iterations) and s["requests"] == 10
    assert s["tokens_generated"] == sum(len(o.token_ids) for o in final.values())


def test_orca_bench_timeline_entry_point_writes_beside_the_trace(busy: Any, tmp_path: Path) -> None:
    trace = tmp_path / "copy.jsonl"
    trace.write_bytes(busy[3].read_bytes())
    bench = Path(sys.executable).with_name("orca-bench")
    done = subprocess.run([str(bench), "timeline", str(trace), "--x", "time"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "10 requests (10 finished)" in done.stdout
    assert json.loads((tmp_path / "copy.perfetto.json").read_text())["traceEvents"]
    assert (tmp_path / "copy.png").read_bytes()[:4] == b"\x89PNG"
    bad = subprocess.run([str(bench), "timeline", str(tmp_path / "none.jsonl")], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "no such trace file" in bad.stderr


# -- through Triton ------------------------------------------------------------------------------------------
TIMELINE_TINY = "orca_tiny_timeline"


def test_orca_bench_trace_records_a_timeline_for_each_model(orca_server: Any, tmp_path: Path) -> None:
    directory = tmp_path / "timelines"
    models = [TIMELINE_TINY, REQUEST_LEVEL_TINY]
    argv = ["trace", "--url", orca_server.grpc_url, "--models", ",".join(models), "--rates", "50",
            "--num-requests", "8", "--unloaded-requests", "0", "--prompt-len", "2:40", "--max-new-tokens", "1:12",
            "--token-ids", "1:200", "--seed", "3", "--metrics-url", "", "--no-progress",
            "--timeline", str(directory), "--json", str(tmp_path / "trace.json"), "--admin-key", orca_server.admin_key]
    assert orca_bench.main(argv) == 0
    result = json.loads((tmp_path / "trace.json").read_text())
    sent = {}
    for run in result["runs"]:
        assert run["summary"]["completed"] == 8
        sent[run["model"]] = sorted((r["prompt_tokens"], r["output_tokens"]) for r in run["requests"])
    client = grpcclient.InferenceServerClient(orca_server.grpc_url)
    try:
        for model in models:
            timeline = read_timeline(directory / f"{model}.jsonl")
            tracks = request_tracks(timeline)
            # The requests the server saw are the ones sent, each generating max_new_tokens tokens.
            assert sorted((tr.prompt_tokens, tr.finish_tokens) for tr in tracks if tr.kept_tokens is None) == (
                sent[model] if model == TIMELINE_TINY else [])
            its = timeline.iterations
            assert [it["id"] for it in its] == sorted(it["id"] for it in its)
            assert all(1 <= len(it["requests"]) <= timeline.header["max_bs"] for it in its)
            assert (directory / f"{model}.png").read_bytes()[:4] == b"\x89PNG"
            assert json.loads((directory / f"{model}.perfetto.json").read_text())["traceEvents"]
            # Reloaded with the trace parameter it had afterwards: tracing off again.
            config = client.get_model_config(model, as_json=True)["config"]
            assert config["parameters"]["trace"].get("string_value", "") == ""  # (proto JSON omits "")
            assert client.is_model_ready(model)
    finally:
        client.close()
    orca = read_timeline(directory / f"{TIMELINE_TINY}.jsonl")
    assert orca.header["scheduling"] == "iteration-level" and orca.header["max_num_batched_tokens"] == 32
    for tr in request_tracks(orca):
        assert tr.sampled == tr.finish_tokens and (tr.preempted_at or tr.increments + 1 == tr.sampled)
    baseline = read_timeline(directory / f"{REQUEST_LEVEL_TINY}.jsonl")
    assert baseline.header["scheduling"] == "request-level"
    # orca-bench sent each request's send time: a request that waited in Triton's batcher for a running
    # batch arrived before it joined the engine, and the wait is drawn from its arrival.
    its = baseline.iterations
    waits = [its[tr.memberships[0].index]["start"] - tr.arrival for tr in request_tracks(baseline)]
    assert min(waits) >= 0 and max(waits) > 0.01, waits
    assert any("joined" in r for r in baseline.events_of("arrival"))
    members = [m for r in baseline.events_of("batch") for m in r["members"]]
    assert sorted((tr.prompt_tokens, m["kept_tokens"]) for m in members
                  for tr in request_tracks(baseline) if tr.id == m["id"]) == sent[REQUEST_LEVEL_TINY]


def test_request_level_client_send_time_is_checked(orca_server: Any) -> None:
    """client_send_time dates a request-level request's arrival; a value that is no Unix time is refused
    with a message naming it, and a good one answers as before."""
    client = grpcclient.InferenceServerClient(orca_server.grpc_url)
    values = {
        "input_ids": ("INT32", np.asarray([[1, 2, 3]], dtype=np.int32)),
        "sampling_parameters": ("BYTES", np.asarray([[b'{"max_tokens": 2, "temperature": 0}']], dtype=np.object_)),
    }
    inputs = []
    for name, (dtype, value) in values.items():
        tensor = grpcclient.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    try:
        with pytest.raises(InferenceServerException, match="client_send_time must be Unix time in seconds"):
            client.infer(REQUEST_LEVEL_TINY, inputs, parameters={"client_send_time": "soon"})
        with pytest.raises(InferenceServerException, match=r"client_send_time .*\(> 0\)"):
            client.infer(REQUEST_LEVEL_TINY, inputs, parameters={"client_send_time": -1.0})
        result = client.infer(REQUEST_LEVEL_TINY, inputs, parameters={"client_send_time": time.time() - 1.0})
        assert result.as_numpy("output_ids").shape[-1] == 2
    finally:
        client.close()
