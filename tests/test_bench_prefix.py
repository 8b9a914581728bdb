"""orca-bench prefix (client/orca_client/bench/prefix.py): its workloads, the figures it reads off a
server's metrics, and the offline command on a tiny model, prefix caching on and off."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from _fixtures import tiny_checkpoint
from orca_client import bench as orca_bench
from orca_client.bench import prefix


def token_text(n: int = 4096) -> prefix.Text:
    return prefix.Text([(7 * i + 3) % 190 for i in range(n)], None)


def play(workload: prefix.Workload, render: prefix.Renderer, answer: Any) -> dict[str, list[list[int]]]:
    """Every request of the workload in closed loops, each stream to its end in turn; `answer(request)` is
    the answer. Returns the rendered prompts in order, by stream."""
    prompts: dict[str, list[list[int]]] = {}
    for request in workload.first():
        while request is not None:
            prompts.setdefault(str(request.stream), []).append(render(request.messages))
            request = workload.next(request, answer(request))
    return prompts


def test_multi_turn_turns_extend_the_previous_turn_with_its_answer() -> None:
    workload = prefix.multi_turn(token_text(), conversations=3, turns=4, prefix_tokens=20, user_tokens=8)
    assert workload.num_requests == 12
    answers = {}

    def answer(request: prefix.Request) -> list[int]:
        answers[request.key] = [100 + len(answers)] * 5
        return answers[request.key]

    render = prefix.Renderer(None)
    prompts = play(workload, render, answer)
    system = workload.system
    assert len(prompts) == 3 and all(len(turns) == 4 for turns in prompts.values())
    for c, turns in prompts.items():
        for t, ids in enumerate(turns):
            assert ids[:20] == system  # every chat starts with the shared system prompt
            assert len(ids) == 20 + 8 * (t + 1) + 5 * t
            if t:  # the previous turn's prompt, its answer, then the new user message
                assert ids[: len(turns[t - 1])] == turns[t - 1]
                assert ids[len(turns[t - 1]): len(turns[t - 1]) + 5] == answers[f"c{c}.t{t - 1}"]
    # The user messages are distinct slices of the text; a second run starts over with no history.
    firsts = [turns[0][20:] for turns in prompts.values()]
    assert len({tuple(f) for f in firsts}) == 3
    again = workload.first()
    assert [len(render(r.messages)) for r in again] == [28, 28, 28]


def test_multi_turn_with_the_chat_template_extends_the_previous_turn() -> None:
    """SmolLM2's chat template (the default model's): turn t+1's token ids start with turn t's."""
    from orca.checkpoint import load_tokenizer, resolve_checkpoint
    from orca.frontend.tokenizer import Tokenizer

    checkpoint = resolve_checkpoint(None)
    hf = load_tokenizer(checkpoint)
    render = prefix.Renderer(Tokenizer(hf, checkpoint))
    text = prefix.Text.for_model(hf, hf.vocab_size, chat=True)
    workload = prefix.multi_turn(text, conversations=2, turns=3, prefix_tokens=64, user_tokens=32)
    assert isinstance(workload.system, str) and "\n" in workload.system + "".join(workload.users[0])
    prompts = play(workload, render, lambda r: f" The answer to {r.key} is short. ")
    first = list(prompts.values())
    common = 0
    while first[0][0][common] == first[1][0][common]:
        common += 1
    assert common >= 64  # the chat template's system header and the whole system prompt are shared
    for turns in first:
        for earlier, later in zip(turns, turns[1:]):
            assert len(later) > len(earlier) + 32 and later[: len(earlier)] == earlier


def test_shared_prefix_streams_take_the_requests_in_turn() -> None:
    workload = prefix.shared_prefix(token_text(), requests=7, prefix_tokens=12, user_tokens=4, concurrency=3)
    render = prefix.Renderer(None)
    firsts = workload.first()
    assert [r.key for r in firsts] == ["r0", "r1", "r2"] and [r.stream for r in firsts] == [0, 1, 2]
    nxt = workload.next(firsts[1], [1])
    assert (nxt.key, nxt.stream) == ("r3", 1)
    prompts = [render(r.messages) for r in firsts] + [render(nxt.messages)]
    assert all(p[:12] == workload.system and len(p) == 16 for p in prompts)
    assert len({tuple(p[12:]) for p in prompts}) == 4
    # Streams on several threads never send a request twice.
    workload.first()
    seen: list[str] = []
    lock = threading.Lock()

    def stream(request: prefix.Request | None) -> None:
        while request is not None:
            with lock:
                seen.append(request.key)
            request = workload.next(request, [1])

    threads = [threading.Thread(target=stream, args=(r,)) for r in workload.first()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == sorted(f"r{i}" for i in range(7))
    everyone = prefix.shared_prefix(token_text(), requests=5, prefix_tokens=4, user_tokens=2, concurrency=0)
    assert len(everyone.first()) == 5 and everyone.next(everyone.first()[0], [1]) is None


def test_cache_counters_sum_the_series_of_the_metrics() -> None:
    text = "\n".join([
        "# TYPE orca_prefix_cache_queries_total counter",
        'orca_prefix_cache_queries_total{model="orca_gpt",version="1"} 300',
        'orca_prefix_cache_hits_total{model="orca_gpt",version="1"} 120',
        'orca_prefix_cache_hits_total{model="other",version="1"} 7',
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640.0',
    ])
    assert prefix.sum_samples(text, prefix.ORCA_CACHE_METRICS, {"model": "orca_gpt"}) == {
        "orca_prefix_cache_queries_total": 300.0, "orca_prefix_cache_hits_total": 120.0}
    assert prefix.sum_samples(text, prefix.VLLM_CACHE_METRICS) == {
        "vllm:prefix_cache_queries_total": 1000.0, "vllm:prefix_cache_hits_total": 640.0}
    assert prefix.cache_rates(1000.0, 640.0) == {"queries": 1000, "hits": 640, "hit_rate": 0.64}
    assert prefix.cache_rates(0, 0)["hit_rate"] == 0.0 and prefix.cache_rates(None, None) is None
    assert prefix.cache_counters(None, prefix.ORCA_CACHE_METRICS, None) is None


def test_summary_and_ratios() -> None:
    records = [{"key": f"r{i}", "arrival_s": i, "prompt_tokens": 10, "output_tokens": 4, "ttft_s": 0.1 * (i + 1),
                "latency_s": 1.0, "cached_tokens": None} for i in range(5)]
    on = prefix.summarize(records, 2.0, None)
    assert on["requests"] == 5 and on["prompt_tokens"] == 50 and on["output_tokens_per_second"] == 10.0
    assert on["ttft_ms"]["median"] == pytest.approx(300.0) and on["ttft_ms"]["p90"] == pytest.approx(460.0)
    assert on["cached_tokens_reported"] is None
    off = prefix.summarize([{**r, "ttft_s": 2 * r["ttft_s"]} for r in records], 4.0, None)
    ratios = prefix.compare(on, off)
    assert ratios["ttft_median_off_over_on"] == pytest.approx(2.0)
    assert ratios["output_tokens_per_second_on_over_off"] == pytest.approx(2.0)
    assert prefix.vllm_max_model_len({"prefix_tokens": 256, "user_tokens": 128, "output_tokens": 64,
                                      "turns": 4}) == 2048
    assert prefix.vllm_max_model_len({"prefix_tokens": 4000, "user_tokens": 32, "output_tokens": 64}) == 6144


def test_orca_bench_prefix_offline_on_and_off(tmp_path: Path) -> None:
    """Both workloads on the tiny Llama (no tokenizer: token ids joined), blocks of 4 tokens: caching on
    finds the shared system prompt and the earlier turns, off finds nothing, and the greedy tokens are the
    same request by request."""
    out = tmp_path / "prefix.json"
    argv = ["prefix", "--mode", "offline", "--model", str(tiny_checkpoint("llama")), "--conversations", "3",
            "--turns", "3", "--requests", "5", "--concurrency", "2", "--prefix-tokens", "16", "--user-tokens", "6",
            "--output-tokens", "4", "--block-size", "4", "--torch-compile", "off", "--json", str(out)]
    assert orca_bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "prefix" and result["chat_template"] is False and "machine" in result
    assert set(result["workloads"]) == {"multi-turn", "shared-prefix"}
    for name, requests in (("multi-turn", 9), ("shared-prefix", 5)):
        record = result["workloads"][name]
        assert "serve" not in record and record["spec"]["requests"] == requests
        runs = record["offline"]["orca"]
        on, off = runs["on"], runs["off"]
        assert on["enable_prefix_caching"] is True and off["enable_prefix_caching"] is False
        for run in (on, off):
            assert run["requests"] == requests and run["output_tokens"] == 4 * requests
            assert run["prompt_tokens"] > 0 and run["output_tokens_per_second"] > 0
            assert 0 < run["ttft_ms"]["median"] <= run["ttft_ms"]["p90"]
            assert len(run["per_request"]) == requests
        assert on["prompt_tokens"] == off["prompt_tokens"]  # the same answers, so the same later turns
        assert 0 < on["prefix_cache"]["hits"] <= on["prefix_cache"]["queries"] and on["prefix_cache"]["hit_rate"] > 0
        assert off["prefix_cache"]["hits"] == 0 and off["prefix_cache"]["hit_rate"] == 0
        # Each request's num_cached_tokens (its first admission; nothing is preempted here) adds up to the hits.
        assert on["preemptions"] == 0 and on["cached_tokens_reported"] == on["prefix_cache"]["hits"]
        assert off["cached_tokens_reported"] == 0 and off["effective_prefix_caching"] is False
        assert runs["same_outputs"] == {"equal": requests, "requests": requests}
        assert runs["ratios"]["ttft_median_off_over_on"] > 0


class FakeChatServer:
    """An OpenAI-like chat server on a free port: each answer streams as chunked server-sent events (a
    role-only chunk first, as vLLM's and orca-openai's do, then the text in two parts, then the usage),
    and /metrics counts prefix cache queries and hits as vLLM names them (100 and 40 per request)."""

    def __init__(self) -> None:
        import http.server

        self.bodies: list[dict[str, Any]] = []
        self.count = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                n = owner.count
                text = (f'vllm:prefix_cache_queries_total{{engine="0"}} {100.0 * n}\n'
                        f'vllm:prefix_cache_hits_total{{engine="0"}} {40.0 * n}\n').encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    owner.bodies.append(body)
                    owner.count += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                last = body["messages"][-1]["content"]
                events = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                          {"choices": [{"delta": {"content": "re: "}}]},
                          {"choices": [{"delta": {"content": last[:6]}}]},
                          {"choices": [], "usage": {"prompt_tokens": len(json.dumps(body["messages"])),
                                                    "completion_tokens": body["max_tokens"]}}]
                for data in [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]:
                    raw = data.encode()
                    self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
                self.wfile.write(b"0\r\n\r\n")

        lock = threading.Lock()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_run_served_drives_chats_in_closed_loops_against_a_server() -> None:
    server = FakeChatServer()
    try:
        text = prefix.Text(list(range(1000)), lambda ids: " ".join(f"w{i}" for i in ids))
        workload = prefix.multi_turn(text, conversations=2, turns=3, prefix_tokens=4, user_tokens=2)
        summary, answers = prefix.run_served(
            server.url, "m", workload, 5, 30.0,
            lambda: prefix.cache_counters(f"{server.url}/metrics", prefix.VLLM_CACHE_METRICS, None))
    finally:
        server.close()
    assert summary["requests"] == 6 and summary["output_tokens"] == 30 and len(answers) == 6
    assert summary["prefix_cache"] == {"queries": 600, "hits": 240, "hit_rate": 0.4}  # the warm-up excluded
    assert all(0 < r["ttft_s"] <= r["latency_s"] for r in summary["per_request"])
    assert answers["c0.t0"] == "re: " + workload.users[0][0][:6]
    bodies = server.bodies[1:]  # after the warm-up
    assert all(b["stream"] and b["ignore_eos"] and b["temperature"] == 0 and b["max_tokens"] == 5 for b in bodies)
    last_turn = [b["messages"] for b in bodies if len(b["messages"]) == 6]
    assert len(last_turn) == 2
    for messages in last_turn:  # system, user, the answer it got, user, the answer, user
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
        assert messages[2]["content"] == "re: " + messages[1]["content"][:6]


def test_orca_bench_offline_takes_prefix_caching_on_or_off() -> None:
    """The flag itself (tests/test_baseline_and_bench.py runs orca-bench offline with the default, on, and
    checks that its JSON records it)."""
    parser = orca_bench.build_parser()
    assert parser.parse_args(["offline"]).prefix_caching == "on"
    assert parser.parse_args(["offline", "--prefix-caching", "off"]).prefix_caching == "off"
    with pytest.raises(SystemExit):
        parser.parse_args(["offline", "--prefix-caching", "maybe"])


def test_a_failed_server_is_recorded_with_its_log_and_printed(tmp_path: Path, capsys: Any) -> None:
    log = tmp_path / "vllm-serve.log"
    log.write_text("starting\nValueError: block_size 16 is not supported\n")
    on = prefix.summarize([{"key": "r0", "arrival_s": 0.0, "prompt_tokens": 8, "output_tokens": 2, "ttft_s": 0.1,
                            "latency_s": 0.2}], 1.0, prefix.cache_rates(8, 0))
    orca = prefix.pair_record({"on": on, "off": on}, {"on": {"r0": "a"}, "off": {"r0": "a"}})
    out = {"shared-prefix": {"orca": orca}}
    prefix.failed(out, "vllm", RuntimeError("vLLM's OpenAI server exited with 1 while starting"), log)
    error = out["shared-prefix"]["vllm"]["error"]
    assert error.startswith("vLLM's OpenAI server exited") and error.endswith("block_size 16 is not supported")
    prefix.failed(out, "orca", RuntimeError("late"), tmp_path / "missing.log")
    assert "error" not in out["shared-prefix"]["orca"]  # runs it has are kept
    result = {"workloads": {"shared-prefix": {
        "spec": {"requests": 1, "concurrency": 1, "prefix_tokens": 4, "user_tokens": 2, "output_tokens": 2},
        "serve": out["shared-prefix"]}}}
    prefix.print_prefix(result)
    printed = capsys.readouterr().out
    assert "serve    vllm   failed: vLLM's OpenAI server exited" in printed
    assert "same answers on and off: 1/1" in printed
