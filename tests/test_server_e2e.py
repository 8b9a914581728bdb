"""End to end through a real tritonserver (from the nvidia-pytriton wheel) and real tritonclient calls.

One server per session serves the test repository (tests/_server.py): orca_gpt as shipped
(SmolLM2-135M-Instruct) and tiny random GPT-2 variants without a tokenizer. No sleeps decide a result:
where the test must wait for the server, it polls for a condition with a generous deadline.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import requests
import torch
import tritonclient.grpc as grpcclient
from orca_client import OrcaClient, OrcaError
from orca_client.client import ASKED_BY_DEFAULT, Chunk, build_inputs, parse_result

from orca import LLM, SamplingParams
from orca.checkpoint import default_model_path

PARIS_PROMPT = "The capital of France is"
JAPANESE_PROMPT = "The Japanese word for thank you is"


# -- helpers -----------------------------------------------------------------------------------------
def generate(server: Any, model: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    r = requests.post(f"{server.http_url}/v2/models/{model}/generate", json=body, timeout=300)
    return r.status_code, r.json()


def generate_stream(server: Any, model: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = requests.post(
        f"{server.http_url}/v2/models/{model}/generate_stream", json={**body, "stream": True}, timeout=300
    )
    assert r.status_code == 200, r.text
    return [json.loads(line[len("data: ") :]) for line in r.text.splitlines() if line.startswith("data: ")]


def metrics(server: Any, model: str) -> dict[str, float]:
    """orca_* samples of one model, keyed by name plus the labels other than model and version."""
    out: dict[str, float] = {}
    tag = f'model="{model}"'
    for line in requests.get(server.metrics_url, timeout=30).text.splitlines():
        if not line.startswith("orca_") or tag not in line:  # cheap screens first: the text is ~250 KB
            continue
        m = re.match(r"^(orca_\w+)\{([^}]*)\} (\S+)$", line)
        if not m or tag not in m.group(2):
            continue
        labels = [kv for kv in m.group(2).split(",") if not kv.startswith(("model=", "version="))]
        out[m.group(1) + ("{" + ",".join(labels) + "}" if labels else "")] = float(m.group(3))
    return out


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0, seen: list[Any] | None = None,
             period: float = 0.05) -> None:
    """Polls condition every `period` seconds until it holds; seen: the values condition read, shown (changes
    only) if it never does."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            saw = ""
            if seen:
                saw = f" (saw {[v for i, v in enumerate(seen) if i == 0 or v != seen[i - 1]]})"
            raise AssertionError(f"timed out waiting for {what}{saw}")
        time.sleep(period)


IDLE_GAUGES = ("orca_running_requests", "orca_waiting_requests", "orca_kv_allocated_blocks", "orca_kv_used_tokens",
               "orca_kv_reserved_slots")


def idle(server: Any, model: str) -> bool:
    m = metrics(server, model)
    return all(m.get(gauge) == 0 for gauge in IDLE_GAUGES)


def assert_idle(m: dict[str, float]) -> None:
    assert {gauge: m.get(gauge) for gauge in IDLE_GAUGES} == dict.fromkeys(IDLE_GAUGES, 0)


def generate_concurrently(server: Any, model: str, requests_: list[dict[str, Any]], timeout: float = 300,
                          times: list[tuple[float, float]] | None = None) -> list[list[Chunk]]:
    """Sends the requests back to back on one gRPC stream and waits for every FINAL; each request's chunks
    (OrcaClient.generate's: return_finish_reason, return_num_input_tokens and return_num_output_tokens true
    unless given). They reach Triton within milliseconds: sent on a stream each, every one opening its own
    channel from its own thread, they reached a busy 2-core CI host up to seconds apart, and a burst of 8
    never ran more than 3 at once. `times`, when given, gets each request's (first response, FINAL)
    time.monotonic()."""
    chunks: list[list[Chunk]] = [[] for _ in requests_]
    stamps: list[list[float]] = [[] for _ in requests_]
    errors: list[str] = []
    finished = threading.Event()

    def on_result(result: Any, error: Any) -> None:
        if error is not None:  # (tritonclient does not say which request's)
            errors.append(error.message())
            finished.set()
            return
        i = int(result.get_response().id)
        chunks[i].append(parse_result(result))
        stamps[i].append(time.monotonic())
        if all(c and c[-1].final for c in chunks):
            finished.set()

    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=on_result)
    try:
        for i, request in enumerate(requests_):
            inputs = build_inputs(**{**dict.fromkeys(ASKED_BY_DEFAULT, True), **request})
            client.async_stream_infer(model, inputs, request_id=str(i))
        assert finished.wait(timeout), f"not every request finished in {timeout} s"
        if errors:
            raise OrcaError("; ".join(errors))
    finally:
        client.stop_stream(cancel_requests=not finished.is_set() or bool(errors))
        client.close()
    if times is not None:
        times += [(s[0], s[-1]) for s in stamps]
    return chunks


@pytest.fixture(scope="module")
def tiny_llm(orca_server: Any) -> LLM:
    """The offline engine over the same tiny checkpoint the server's orca_tiny serves."""
    return LLM(str(orca_server.tiny_checkpoint))


@pytest.fixture(scope="module")
def hf_smollm2() -> Any:
    """transformers loading the same GGUF file the server serves: the reference for text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return tok, model


# -- text in, text out (the default model) -----------------------------------------------------------
def test_capital_of_france_over_http_generate(orca_server: Any) -> None:
    status, body = generate(orca_server, "orca_gpt", {"text_input": PARIS_PROMPT, "max_tokens": 12, "temperature": 0,
                                                      "return_finish_reason": True, "return_num_output_tokens": True})
    assert status == 200, body
    assert body["text_output"].startswith(PARIS_PROMPT)  # non-streaming: prompt + completion
    assert "Paris" in body["text_output"][len(PARIS_PROMPT) :]
    assert body["num_output_tokens"] == len(body["output_ids"]) == 12
    assert body["finish_reason"] == "length"


def test_chat_question_answers_paris(orca_server: Any) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    status, body = generate(
        orca_server,
        "orca_gpt",
        {"messages": json.dumps(messages), "max_tokens": 24, "temperature": 0, "exclude_input_in_output": True,
         "return_finish_reason": True},
    )
    assert status == 200, body
    assert "Paris" in body["text_output"]
    assert body["finish_reason"] == "stop"  # the chat model ends its turn with <|im_end|>


def test_greedy_text_equals_transformers_on_the_same_gguf(orca_server: Any, hf_smollm2: Any) -> None:
    tok, model = hf_smollm2
    for prompt in (PARIS_PROMPT, "Once upon a time", "def fibonacci(n):"):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            ref = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :].tolist()
        ref = ref[: ref.index(tok.eos_token_id) + 1] if tok.eos_token_id in ref else ref
        status, body = generate(
            orca_server, "orca_gpt",
            {"text_input": prompt, "max_tokens": 16, "temperature": 0, "exclude_input_in_output": True},
        )
        assert status == 200, body
        assert body["output_ids"] == ref, prompt
        assert body["text_output"] == tok.decode(ref, skip_special_tokens=True), prompt


def test_streamed_deltas_concatenate_to_the_non_streaming_completion(orca_server: Any) -> None:
    request = {"text_input": JAPANESE_PROMPT, "max_tokens": 24, "temperature": 0, "exclude_input_in_output": True,
               "return_num_output_tokens": True}
    status, whole = generate(orca_server, "orca_gpt", request)
    assert status == 200, whole
    completion = whole["text_output"]
    assert " " in completion and any(ord(c) > 127 for c in completion), completion  # spaces and multi-byte
    # HTTP server-sent events: one per iteration's token.
    events = generate_stream(orca_server, "orca_gpt", request)
    assert len(events) == whole["num_output_tokens"]
    assert "".join(e["text_output"] for e in events) == completion
    assert all("\ufffd" not in e["text_output"] for e in events)
    # gRPC streaming through the client library.
    chunks = list(OrcaClient(orca_server.grpc_url).generate(text=JAPANESE_PROMPT, max_tokens=24, temperature=0))
    assert "".join(c.text or "" for c in chunks) == completion
    assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]  # exactly one FINAL, last


def test_stop_string_ends_generation_and_is_not_returned(orca_server: Any) -> None:
    # Triton's HTTP parameters are scalars: one stop string as a string, several as a JSON list in one.
    for stop in (".", '["!", "."]'):
        status, body = generate(
            orca_server, "orca_gpt",
            {"text_input": PARIS_PROMPT, "max_tokens": 12, "temperature": 0, "stop": stop,
             "exclude_input_in_output": True, "return_finish_reason": True},
        )
        assert status == 200, body
        assert body["finish_reason"] == "stop"
        assert body["text_output"] == " Paris"
    # The same through the JSON sampling_parameters input, streaming over gRPC.
    chunks = list(OrcaClient(orca_server.grpc_url).generate(text=PARIS_PROMPT, max_tokens=12, temperature=0,
                                                            stop=["Paris"]))
    assert "".join(c.text or "" for c in chunks) == " "
    assert chunks[-1].finish_reason == "stop"


# -- a checkpoint without a tokenizer ----------------------------------------------------------------
def test_model_without_tokenizer_serves_ids_and_rejects_text(orca_server: Any) -> None:
    status, body = generate(orca_server, "orca_tiny", {"text_input": "hello", "max_tokens": 4})
    assert status == 400
    assert "no tokenizer" in body["error"] and "input_ids" in body["error"]
    # (ignore_eos: the random model's sampling defaults can draw EOS before the 4th token, as a CI run did)
    status, body = generate(orca_server, "orca_tiny", {"input_ids": [5, 6, 7], "max_tokens": 4, "ignore_eos": True})
    assert status == 200, body
    assert len(body["output_ids"]) == 4 and "text_output" not in body


def test_served_greedy_tokens_equal_offline_generate(orca_server: Any, tiny_llm: LLM) -> None:
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], list(range(10, 40)), [100]]
    max_tokens = [7, 20, 3, 12]
    expected = tiny_llm.generate(
        prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_tokens]
    )
    chunks = generate_concurrently(orca_server, "orca_tiny", [
        {"input_ids": p, "max_tokens": n, "temperature": 0, "ignore_eos": True} for p, n in zip(prompts, max_tokens)
    ])
    assert [[t for c in cs for t in c.output_ids] for cs in chunks] == [e.token_ids for e in expected]


# -- iteration-level scheduling, cancellation, errors -------------------------------------------------
def test_short_request_joins_and_returns_before_a_running_long_one(orca_server: Any) -> None:
    client = OrcaClient(orca_server.grpc_url, "orca_tiny")
    long_stream = client.generate(input_ids=[1, 2, 3], max_tokens=1900, ignore_eos=True, temperature=0)
    first = next(long_stream)  # the long request is running
    assert first.output_ids and not first.final
    short = list(client.generate(input_ids=[4, 5], max_tokens=3, stream=False, ignore_eos=True))
    assert short[-1].final and short[-1].num_output_tokens == 3
    long_chunks = [first]
    for chunk in long_stream:  # the long one is still going: its FINAL comes later
        long_chunks.append(chunk)
    assert long_chunks[-1].final and sum(c.num_output_tokens for c in long_chunks) == 1900  # each response's count
    assert sum(len(c.output_ids) for c in long_chunks) == 1900


def test_client_cancellation_aborts_and_frees_kv_blocks(orca_server: Any) -> None:
    wait_for(lambda: idle(orca_server, "orca_tiny"), "idle")
    before = metrics(orca_server, "orca_tiny")
    stream = OrcaClient(orca_server.grpc_url, "orca_tiny").generate(
        input_ids=[7, 8, 9], max_tokens=1900, ignore_eos=True
    )
    for _, chunk in zip(range(5), stream):
        assert not chunk.final
    during = metrics(orca_server, "orca_tiny")
    # on_demand admission: blocks for what the request holds so far, not for its max_tokens.
    assert during["orca_running_requests"] == 1 and 1 <= during["orca_kv_allocated_blocks"] < -(-1903 // 16)
    assert during["orca_kv_used_tokens"] >= 3 + 4
    stream.close()  # leaving early: stop_stream(cancel_requests=True)
    key = 'orca_requests_finished_total{reason="cancelled"}'
    wait_for(lambda: metrics(orca_server, "orca_tiny").get(key, 0) == before.get(key, 0) + 1, "cancellation")
    wait_for(lambda: idle(orca_server, "orca_tiny"), "blocks freed")
    generated = metrics(orca_server, "orca_tiny")["orca_generated_tokens_total"]
    assert generated - before["orca_generated_tokens_total"] < 1900  # it stopped early


def test_cancelling_a_request_still_waiting_for_admission_removes_it(orca_server: Any) -> None:
    """A waiting request produces no output; the model's periodic sweep of its senders finds it."""
    model = "orca_tiny_q"
    wait_for(lambda: idle(orca_server, model), "idle")
    before = metrics(orca_server, model)
    running = OrcaClient(orca_server.grpc_url, model).generate(input_ids=[1, 2], max_tokens=2000, ignore_eos=True)
    next(running)  # admitted; max_bs 1 keeps the next request waiting behind it
    client = grpcclient.InferenceServerClient(orca_server.grpc_url)
    results: list[Any] = []
    client.start_stream(callback=lambda result, error: results.append((result, error)))
    client.async_stream_infer(model, build_inputs(input_ids=[3], max_tokens=2, ignore_eos=True), request_id="w")
    wait_for(lambda: metrics(orca_server, model).get("orca_waiting_requests") == 1, "one waiting")
    client.stop_stream(cancel_requests=True)
    client.close()
    key = 'orca_requests_finished_total{reason="cancelled"}'
    wait_for(lambda: metrics(orca_server, model).get(key, 0) == before.get(key, 0) + 1, "the cancellation")
    m = metrics(orca_server, model)
    assert m["orca_waiting_requests"] == 0 and m["orca_running_requests"] == 1
    assert not next(running).final  # the running one goes on
    running.close()
    wait_for(lambda: idle(orca_server, model), "idle")
    assert metrics(orca_server, model).get(key, 0) == before.get(key, 0) + 2


BAD_REQUESTS = [
    ({"max_tokens": 4}, "no prompt"),
    ({"input_ids": []}, "prompt is empty"),
    ({"input_ids": [1, -3]}, "out of range"),
    ({"input_ids": [1, 211]}, "[0, 210]"),
    ({"input_ids": [7] * 2048}, "at most 2047"),
    ({"input_ids": [1, 2], "max_tokens": 0}, "max_tokens must be >= 1"),
    ({"input_ids": [1, 2], "max_tokens": 5000}, "max_tokens must be in [1, 2046]"),
    ({"input_ids": [1, 2], "sampling_parameters": "{not json"}, "not valid JSON"),
    ({"input_ids": [1, 2], "sampling_parameters": "[1, 2]"}, "must be a JSON object"),
    ({"input_ids": [1, 2], "sampling_parameters": '{"max_tokenz": 3}'}, "unknown sampling parameter(s) max_tokenz"),
    ({"input_ids": [1, 2], "nonsense": 3}, "unknown request parameter(s) nonsense"),
    ({"input_ids": [1, 2], "sampling_parameters": '{"max_tokens": "many"}'}, "max_tokens must be an integer"),
    ({"input_ids": [1, 2], "temperature": -0.5}, "temperature must be >= 0"),
    ({"input_ids": [1, 2], "top_p": 0}, "top_p must be in (0, 1]"),
    ({"input_ids": [1, 2], "top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"input_ids": [1, 2], "top_k": -2}, "top_k must be >= 0"),  # -1 is vLLM's "off"
    ({"input_ids": [1, 2], "cache_salt": "x" * 1025}, "cache_salt must be a string of 1 to 1024 characters, got 1025"),
    ({"input_ids": [1, 2], "cache_salt": ""}, "cache_salt must be a string of 1 to 1024 characters"),
]


def test_bad_input_gets_invalid_arg_and_harms_no_request_in_flight(orca_server: Any, tiny_llm: LLM) -> None:
    client = OrcaClient(orca_server.grpc_url, "orca_tiny")
    in_flight = client.generate(input_ids=[11, 12, 13], max_tokens=400, temperature=0, ignore_eos=True)
    tokens = list(next(in_flight).output_ids)
    for body, message in BAD_REQUESTS:
        status, reply = generate(orca_server, "orca_tiny", body)
        assert status == 400, (body, reply)
        assert message in reply["error"], (body, reply)
    # The same over gRPC streaming (whose error responses carry the message but no status code).
    with pytest.raises(OrcaError, match=re.escape("top_p must be in (0, 1], got 2.0")):
        list(client.generate(input_ids=[1, 2], top_p=2.0))
    for chunk in in_flight:
        tokens += chunk.output_ids
    expected = tiny_llm.generate([[11, 12, 13]], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    assert tokens == expected[0].token_ids


def test_full_waiting_queue_answers_unavailable(orca_server: Any) -> None:
    client = OrcaClient(orca_server.grpc_url, "orca_tiny_q")
    running = client.generate(input_ids=[1, 2], max_tokens=2000, ignore_eos=True)
    next(running)  # admitted; max_bs 1 keeps every later request waiting behind it
    # kv_admission reserve: the running request holds the blocks for its prompt and all of max_tokens. (A
    # scrape is a sample, not a barrier: a stress run read 0 blocks at the first token, and the request was
    # still running to be cancelled at the test's end.)
    reserve = -(-(2 + 2000) // 16)
    wait_for(lambda: metrics(orca_server, "orca_tiny_q")["orca_kv_allocated_blocks"] == reserve, "the reserve")
    waiting = [client.generate(input_ids=[3], max_tokens=2, ignore_eos=True) for _ in range(2)]
    threads = [threading.Thread(target=lambda g=g: list(g)) for g in waiting]
    for t in threads:
        t.start()
    wait_for(lambda: metrics(orca_server, "orca_tiny_q").get("orca_waiting_requests") == 2, "two waiting")
    status, body = generate(orca_server, "orca_tiny_q", {"input_ids": [4], "max_tokens": 2})
    # The model answers with code UNAVAILABLE; Triton's /generate reports any response error as 400.
    assert status == 400 and "the waiting queue is full (2 requests): retry later" in body["error"], body
    running.close()  # cancel the long one: the waiting ones then run to completion
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive()
    wait_for(lambda: idle(orca_server, "orca_tiny_q"), "idle")


def test_metrics_move_with_requests(orca_server: Any) -> None:
    before = metrics(orca_server, "orca_tiny")
    assert before["orca_kv_slots"] == 8192  # n_slots from config.pbtxt
    assert before["orca_kv_total_blocks"] == 8192 // 16  # block_size 16
    status, body = generate(orca_server, "orca_tiny", {"input_ids": [1, 2, 3, 4], "max_tokens": 6, "ignore_eos": True})
    assert status == 200, body
    after = metrics(orca_server, "orca_tiny")
    assert after["orca_prompt_tokens_total"] - before.get("orca_prompt_tokens_total", 0) == 4
    assert after["orca_generated_tokens_total"] - before.get("orca_generated_tokens_total", 0) == 6
    key = 'orca_requests_finished_total{reason="length"}'
    assert after[key] - before.get(key, 0) == 1
    for hist in ("orca_time_to_first_token_seconds", "orca_request_latency_seconds",
                 "orca_time_per_output_token_seconds"):
        assert after[f"{hist}_count"] - before.get(f"{hist}_count", 0) == 1, hist
    assert after["orca_iteration_batch_size_count"] - before.get("orca_iteration_batch_size_count", 0) >= 6
    iterations = after["orca_iteration_seconds_count"] - before.get("orca_iteration_seconds_count", 0)
    assert iterations == after["orca_iteration_batch_size_count"] - before.get("orca_iteration_batch_size_count", 0)
    assert after["orca_iteration_seconds_sum"] > before.get("orca_iteration_seconds_sum", 0)
    assert_idle(after)  # published before the response went out


# A scraper in a process of its own, as Prometheus scrapes: one line of JSON (a model's samples by name,
# orca-bench's parse) per scrape, every argv[3] seconds, until terminated.
_SCRAPER = r"""
import json, sys, time
from orca_client.bench.trace_cmd import fetch_metrics
url, model, interval = sys.argv[1], sys.argv[2], float(sys.argv[3])
while True:
    sample = fetch_metrics(url, model, timeout=30)
    if sample is not None:  # (an unreadable scrape)
        sample["t"] = time.monotonic()  # when it was read (the same clock as the test's, on this host)
    print(json.dumps(sample), flush=True)
    time.sleep(interval)
"""


class MetricsScraper:
    """Scrapes a model's orca_* gauges from another process while the block runs; `samples` once it ends,
    each with "t", when it was read (time.monotonic()). Not from this process: its gRPC streams parse
    thousands of responses a second, and a scrape made here (waiting for the interpreter lock at every
    read) once took longer than a whole burst."""

    def __init__(self, server: Any, model: str, interval: float = 0.02) -> None:
        self.argv = [sys.executable, "-c", _SCRAPER, server.metrics_url, model, str(interval)]
        self.samples: list[dict[str, float]] = []

    def __enter__(self) -> MetricsScraper:
        """Returns once the first scrape is in (the process's start-up, seconds on a busy host, is not
        part of the block)."""
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, text=True)
        first = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not first:
            raise AssertionError(f"the metrics scraper exited ({self.proc.wait()}) before its first scrape")
        self._first = first
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=30)
        for line in (self._first + out).splitlines():
            with contextlib.suppress(ValueError):  # a line cut short by the termination
                sample = json.loads(line)
                if sample is not None:
                    self.samples.append(sample)


def test_kv_gauges_follow_a_burst_and_return_to_zero(orca_server: Any) -> None:
    model = "orca_tiny"
    wait_for(lambda: idle(orca_server, model), "idle")
    before = metrics(orca_server, model)
    prompts = [[i + 1] * (i + 2) for i in range(8)]  # 2..9 tokens; max_bs 8 runs all of them at once
    # 8 x (9 + 900) tokens fit the 8192-slot pool: nobody is preempted. 900 tokens take ~2 s alone here,
    # several times that with 8 together: a long window for the scraper.
    times: list[tuple[float, float]] = []
    with MetricsScraper(orca_server, model) as scraper:
        start = time.monotonic()
        results = generate_concurrently(orca_server, model, [
            {"input_ids": p, "max_tokens": 900, "temperature": 0, "ignore_eos": True} for p in prompts], times=times)
    assert [sum(len(c.output_ids) for c in chunks) for chunks in results] == [900] * 8
    # When the 8 ran together, seen from here: after the last one's first token, before the first FINAL.
    together = (max(first for first, _ in times) - start, min(final for _, final in times) - start)
    seen = [(round(s["t"] - start, 3), s.get("orca_running_requests"), s.get("orca_waiting_requests"))
            for s in scraper.samples]
    during = [s for s in scraper.samples if s.get("orca_running_requests") == 8]
    assert during, f"no scrape saw 8 running; together in {together} s; (t s, running, waiting): {seen}"
    for sample in during:
        assert sample["orca_waiting_requests"] == 0
        assert sample["orca_kv_allocated_blocks"] >= 8  # a block each at least
        assert sample["orca_kv_used_tokens"] >= sum(len(p) for p in prompts)
        assert sample["orca_kv_reserved_slots"] >= 8 * 16
    after = metrics(orca_server, model)
    assert_idle(after)  # the last FINAL went out after the idle state was published
    assert after["orca_kv_total_blocks"] == before["orca_kv_total_blocks"] == 512
    assert after["orca_preemptions_total"] == before["orca_preemptions_total"]


def test_a_tiny_pool_preempts_under_a_burst_and_every_request_completes(orca_server: Any, tiny_llm: LLM) -> None:
    model = "orca_tiny_preempt"  # 8 blocks of 16 tokens, on_demand
    before = metrics(orca_server, model)
    assert before["orca_kv_total_blocks"] == 8 and before["orca_kv_slots"] == 128
    prompts = [[(7 * i + j) % 200 + 1 for j in range(3 + i)] for i in range(8)]
    results = generate_concurrently(orca_server, model, [
        {"input_ids": p, "max_tokens": 100, "temperature": 0, "ignore_eos": True} for p in prompts
    ])
    for chunks in results:
        assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
        assert chunks[-1].finish_reason == "length" and sum(c.num_output_tokens for c in chunks) == 100
    after = metrics(orca_server, model)
    assert after["orca_preemptions_total"] > before.get("orca_preemptions_total", 0)
    assert_idle(after)
    # Preempted requests recompute their K/V: the tokens are those of the unhurried offline engine.
    expected = tiny_llm.generate(prompts, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert [[t for c in chunks for t in c.output_ids] for chunks in results] == [e.token_ids for e in expected]


# -- prefix caching ------------------------------------------------------------------------------------
CACHED_PROMPT = [(37 * i + 11) % 200 + 1 for i in range(40)]  # two full blocks of 16 tokens and 8 more; no
# other test sends it


def test_a_repeated_prefix_comes_from_the_prefix_cache_per_salt(orca_server: Any, tiny_llm: LLM) -> None:
    model = "orca_tiny"  # the shipped config: prefix caching on, blocks of 16
    wait_for(lambda: idle(orca_server, model), "idle")
    before = metrics(orca_server, model)
    client = OrcaClient(orca_server.grpc_url, model)
    request = {"input_ids": CACHED_PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    first = list(client.generate(**request))  # streaming: num_cached_tokens on the final response only
    assert [c.num_cached_tokens for c in first] == [None] * (len(first) - 1) + [0]
    tokens = [t for c in first for t in c.output_ids]
    expected = tiny_llm.generate([CACHED_PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert tokens == expected[0].token_ids
    again = list(client.generate(**request, stream=False))
    assert again[-1].num_cached_tokens == 32  # the two full blocks; the rest of the prompt is computed
    assert again[-1].output_ids == tokens  # the same greedy tokens as computing every key and value
    # Another salt shares nothing with unsalted requests; requests of the same salt share its blocks.
    salted = list(client.generate(**request, stream=False, cache_salt="tenant-b"))
    assert salted[-1].num_cached_tokens == 0 and salted[-1].output_ids == tokens
    status, body = generate(orca_server, model, {**request, "cache_salt": "tenant-b"})  # the input, over HTTP
    assert status == 200, body
    assert body["num_cached_tokens"] == 32 and body["output_ids"] == tokens
    after = metrics(orca_server, model)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0)

    assert grew("orca_prefix_cache_hits_total") == 2 * 32
    assert grew("orca_prefix_cache_queries_total") >= 4 * 32  # every prompt's full blocks were looked up
    assert after["orca_prefix_cache_blocks"] >= 4  # two blocks without a salt, two of tenant-b
    assert grew("orca_prompt_tokens_total") == 4 * len(CACHED_PROMPT)  # cached or not, the prompt's tokens
    assert_idle(after)


def test_the_request_level_baseline_caches_no_prefix(orca_server: Any) -> None:
    """request_level_gpt runs as FasterTransformer did: every prompt computed whole (num_cached_tokens 0); a
    salt (a request parameter there: it has no cache_salt input) is checked, then changes nothing."""
    prompt = ("Paris has the Eiffel Tower, the Louvre, Notre-Dame and the Seine; Rome has the Colosseum, the "
              "Pantheon and the Tiber; Berlin has the Brandenburg Gate and the Spree. The capital of France is")
    for _ in range(2):
        status, body = generate(orca_server, "request_level_gpt",
                                {"text_input": prompt, "max_tokens": 2, "temperature": 0, "cache_salt": "tenant-a",
                                 "return_num_input_tokens": True})
        assert status == 200, body
        assert body["num_input_tokens"] > 32 and body["num_cached_tokens"] == 0
    status, body = generate(orca_server, "request_level_gpt", {"text_input": prompt, "max_tokens": 2, "cache_salt": ""})
    assert status == 400 and "cache_salt must be a string of 1 to 1024 characters" in body["error"], body


def test_every_engine_steps_on_the_thread_that_loaded_it(orca_server: Any) -> None:
    """orca_gpt builds its engine on the scheduler thread that steps it, and the request-level baseline
    steps on the stub thread that loaded it (orca/worker _foreign_thread): after requests to both, no
    worker of the server has run an iteration on a thread other than its loader's (it would say so in the
    server's log, once per engine)."""
    for model in ("orca_gpt", "request_level_gpt"):
        status, body = generate(orca_server, model, {"text_input": PARIS_PROMPT, "max_tokens": 3, "temperature": 0})
        assert status == 200, body
    log = orca_server.log_path.read_text(errors="replace")
    assert "but this worker loaded its model on thread" not in log


# -- speculative decoding --------------------------------------------------------------------------------
def test_speculative_decoding_serves_the_same_tokens_and_counts_its_proposals(orca_server: Any,
                                                                             tiny_llm: LLM) -> None:
    """orca_tiny_spec (speculative_method ngram) streams the greedy tokens the offline engine without
    speculation makes, several tokens in some responses; a seeded sampled request the same with
    speculation on as off; its proposals show in the orca_ and vllm: counters; an opted-out request
    proposes nothing."""
    model = "orca_tiny_spec"
    prompts = [[20 + i, 40 + i, 60 + i] * 8 for i in range(4)]  # the tiny model's output loops here, a little
    before = metrics(orca_server, model)
    results = generate_concurrently(orca_server, model, [
        {"input_ids": p, "max_tokens": 40, "temperature": 0, "ignore_eos": True} for p in prompts
    ])
    expected = tiny_llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert [[t for c in chunks for t in c.output_ids] for chunks in results] == [e.token_ids for e in expected]
    assert max(len(c.output_ids) for chunks in results for c in chunks) > 1  # a verification kept proposals
    after = metrics(orca_server, model)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0)

    proposed = grew("orca_spec_decode_num_draft_tokens_total")
    accepted = grew("orca_spec_decode_num_accepted_tokens_total")
    assert proposed >= accepted > 0 and after["orca_spec_decode_num_drafts_total"] > 0
    text = requests.get(orca_server.metrics_url, timeout=30).text
    vllm = re.search(r'^vllm:spec_decode_num_accepted_tokens_total\{[^}]*model="orca_tiny_spec"[^}]*\} (\S+)$', text,
                     re.M)
    assert vllm and float(vllm.group(1)) == after["orca_spec_decode_num_accepted_tokens_total"]
    # seeded sampling: the same tokens as the offline engine without speculation
    sampled = {"temperature": 0.5, "seed": 11, "max_tokens": 30, "ignore_eos": True}
    status, body = generate(orca_server, model, {"input_ids": prompts[0], **sampled})
    assert status == 200, body
    offline = tiny_llm.generate([prompts[0]], SamplingParams(**sampled))[0].token_ids
    assert body["output_ids"] == offline
    # opted out (a sampling_parameters key): no proposal
    wait_for(lambda: idle(orca_server, model), "idle")
    mid = metrics(orca_server, model)
    status, body = generate(orca_server, model, {"input_ids": prompts[1], "max_tokens": 20, "temperature": 0,
                                                 "ignore_eos": True, "speculate": False})
    assert status == 200, body
    assert body["output_ids"] == expected[1].token_ids[:20]
    assert metrics(orca_server, model)["orca_spec_decode_num_draft_tokens_total"] == \
        mid["orca_spec_decode_num_draft_tokens_total"]
