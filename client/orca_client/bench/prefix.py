"""``orca-bench prefix``: automatic prefix caching (EngineConfig.enable_prefix_caching) on and off, on
workloads whose prompts share their beginnings, offline and served.

Workloads: real English text (Python's documentation, pydoc_data.topics) in slices of the model's tokens,
rendered with the model's chat template (a model without a tokenizer or a chat template gets the slices'
token ids one after the other, offline only). --workload picks, comma-separated (default both):
  multi-turn     --conversations chats of --turns turns each, all started at once, each a closed loop: a
                 turn's prompt is a system prompt shared by every chat (--prefix-tokens), the chat's earlier
                 turns (its user messages and the answers actually generated) and a new user message
                 (--user-tokens); the chat sends it as soon as the answer to its previous turn has arrived.
  shared-prefix  --requests single-turn requests: one system prompt of --prefix-tokens tokens shared by all
                 and a distinct question of --user-tokens tokens each, --concurrency streams at a time (each
                 sends its next request when its last one has ended; 0: all at once).
Every request generates --output-tokens tokens (greedy, EOS ignored: the lengths are fixed).

--mode picks, comma-separated (default both):
  offline  orca's engine in this process (LLMEngine stepped as orca.LLM.generate steps it: a request's
           arrival is when the step that finished its predecessor returned, and it is added right then,
           so TTFT is the engine's own), once with enable_prefix_caching on and once off, a fresh engine
           each, one after the other; engine options --max-bs, --block-size, --max-num-batched-tokens,
           --n-slots, --dtype, --torch-compile. It also counts the requests whose tokens are the same on
           and off (greedy: they should all be).
  serve    a streaming chat-completions client (one thread per stream; TTFT = the first chunk with
           content) against orca's OpenAI API: make serve's launcher on a repository holding orca_gpt as
           shipped with the config parameter enable_prefix_caching "true", then again with "false"; and
           against vLLM's OpenAI server from the vLLM peer's venv (scripts/peers/setup_vllm_cpu.sh) with
           --enable-prefix-caching, started as orca-bench serve starts it (orca's dtype, max_num_seqs 32,
           its threads on the cores orca uses; its own block size, 128 on a CPU, unless --vllm-block-size
           (a multiple of 32 there): orca_gpt's is 16, so vLLM's cache reuses prompts in coarser steps).
           A server that fails is recorded with its error and the end of its log. --systems orca,vllm
           (vllm is skipped, saying why, when its venv is missing). One server at a time, started once
           for all the workloads (their texts do not overlap) and stopped before the next starts.

Reported per run: TTFT median and p90, output tokens/s and requests/s over the run's wall time, prompt
tokens, and the prefix cache's hit rate in tokens (hits / queries at admission: EngineStats offline; the
servers' prefix cache counters from their metrics endpoints, orca_prefix_cache_{queries,hits}_total and
vLLM's vllm:prefix_cache_{queries,hits}_total, where they exist); for each on/off pair, off/on TTFT median
and on/off throughput.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orca_client.bench.common import machine_info, write_json
from orca_client.bench.options import comma_choices, nonnegative_int, positive_int

WORKLOADS = ("multi-turn", "shared-prefix")
MODES = ("offline", "serve")
SYSTEMS = ("orca", "vllm")
SETTINGS = {"on": True, "off": False}
DEFAULT_LENGTHS = {  # (--prefix-tokens, --user-tokens) per workload
    "multi-turn": (256, 128),
    "shared-prefix": (1024, 32),
}
ORCA_MODEL = "orca_gpt"
ORCA_CACHE_METRICS = ("orca_prefix_cache_queries_total", "orca_prefix_cache_hits_total")
VLLM_CACHE_METRICS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")

Content = str | list[int]  # a message's content: text, or token ids (a model without a chat template)


# -- the workloads ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """One request of a workload: `key` names it the same in every run ("c3.t1": chat 3, turn 1; "r17"),
    `stream` is the closed loop that sends it, `messages` its chat ({"role", "content"})."""

    key: str
    stream: int
    messages: tuple[dict[str, Any], ...]


class Text:
    """The workloads' text: `ids` handed out in consecutive slices (wrapping around at the end), each a
    message's content: the slice decoded by `decode`, or its ids when there is none."""

    def __init__(self, ids: Sequence[int], decode: Callable[[list[int]], str] | None) -> None:
        if not ids:
            raise ValueError("no text to build the workload from")
        self.ids, self.decode, self.offset = list(ids), decode, 0

    @classmethod
    def for_model(cls, hf_tokenizer: Any | None, vocab_size: int, chat: bool) -> Text:
        """Python's documentation in the model's tokens (decoded back to text when the requests are chats),
        or, for a model without a tokenizer, fixed pseudo-random ids of its vocabulary."""
        if hf_tokenizer is not None:
            from orca_client.bench.core import english_token_ids

            ids = english_token_ids(hf_tokenizer, limit=100_000)
            decode = (lambda t: hf_tokenizer.decode(t, skip_special_tokens=True)) if chat else None
            return cls(ids, decode)
        rng = random.Random(0)
        return cls([rng.randrange(vocab_size) for _ in range(1 << 16)], None)

    def take(self, n: int) -> Content:
        chunk = [self.ids[(self.offset + k) % len(self.ids)] for k in range(n)]
        self.offset += n
        return chunk if self.decode is None else self.decode(chunk)


class MultiTurn:
    """Chats in closed loops: turn t of chat c = [system, (user, assistant) of turns < t, user t]. first()
    starts a run (each chat's first turn) and forgets the last run's answers; next() records an answer
    and gives the chat's next turn, None after its last. A chat's turns come one at a time, so each chat's
    history is only touched by the stream that sends it."""

    name = "multi-turn"

    def __init__(self, system: Content, users: list[list[Content]]) -> None:
        self.system, self.users = system, users
        self._history: list[list[dict[str, Any]]] = [[] for _ in users]

    @property
    def num_requests(self) -> int:
        return sum(len(turns) for turns in self.users)

    def first(self) -> list[Request]:
        self._history = [[] for _ in self.users]
        return [self._turn(c, 0) for c in range(len(self.users)) if self.users[c]]

    def _turn(self, c: int, t: int) -> Request:
        messages = ({"role": "system", "content": self.system}, *self._history[c],
                    {"role": "user", "content": self.users[c][t]})
        return Request(f"c{c}.t{t}", c, messages)

    def next(self, request: Request, answer: Content) -> Request | None:
        c = request.stream
        t = len(self._history[c]) // 2
        self._history[c] += [{"role": "user", "content": self.users[c][t]}, {"role": "assistant", "content": answer}]
        return self._turn(c, t + 1) if t + 1 < len(self.users[c]) else None


class SharedPrefix:
    """Single-turn requests [system, question i], `concurrency` streams at a time (0: all at once): first()
    gives each stream its first request, next() the stream's next one (the lowest not yet sent)."""

    name = "shared-prefix"

    def __init__(self, system: Content, questions: list[Content], concurrency: int) -> None:
        self.system, self.questions = system, questions
        self.concurrency = concurrency or len(questions)
        self._lock = threading.Lock()
        self._sent = 0

    @property
    def num_requests(self) -> int:
        return len(self.questions)

    def first(self) -> list[Request]:
        self._sent = min(self.concurrency, len(self.questions))
        return [self._request(i, i) for i in range(self._sent)]

    def _request(self, i: int, stream: int) -> Request:
        messages = ({"role": "system", "content": self.system}, {"role": "user", "content": self.questions[i]})
        return Request(f"r{i}", stream, messages)

    def next(self, request: Request, answer: Content) -> Request | None:
        with self._lock:  # the streams share the requests
            i = self._sent
            if i >= len(self.questions):
                return None
            self._sent += 1
        return self._request(i, request.stream)


Workload = MultiTurn | SharedPrefix


def multi_turn(text: Text, conversations: int, turns: int, prefix_tokens: int, user_tokens: int) -> MultiTurn:
    system = text.take(prefix_tokens)
    return MultiTurn(system, [[text.take(user_tokens) for _ in range(turns)] for _ in range(conversations)])


def shared_prefix(text: Text, requests: int, prefix_tokens: int, user_tokens: int, concurrency: int) -> SharedPrefix:
    system = text.take(prefix_tokens)
    return SharedPrefix(system, [text.take(user_tokens) for _ in range(requests)], concurrency)


class Renderer:
    """A request's messages as the prompt's token ids: the model's chat template as orca_gpt applies it
    (orca.frontend.tokenizer.Tokenizer.apply_chat_template, the generation prompt added) when `tokenizer`
    (orca's Tokenizer) is given, else the messages' token ids one after the other."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer

    @property
    def chat(self) -> bool:
        return self.tokenizer is not None

    def __call__(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        if self.tokenizer is not None:
            return self.tokenizer.apply_chat_template([dict(m) for m in messages])
        return [t for m in messages for t in m["content"]]


def model_text(model: str | None) -> tuple[Path, Renderer, Any | None, int]:
    """The checkpoint, how its prompts are rendered, its transformers tokenizer (or None) and vocabulary."""
    from orca.checkpoint import read_model_config, resolve_checkpoint
    from orca.frontend.tokenizer import Tokenizer

    checkpoint = resolve_checkpoint(model)
    tokenizer = Tokenizer.load(checkpoint)
    chat = tokenizer.available and bool(getattr(tokenizer.hf, "chat_template", None))
    vocab = read_model_config(checkpoint)[0].vocab_size
    return checkpoint, Renderer(tokenizer if chat else None), tokenizer.hf, vocab


def build_workload(name: str, args: argparse.Namespace, hf_tokenizer: Any | None, vocab: int, chat: bool) -> Workload:
    prefix, user = DEFAULT_LENGTHS[name]
    prefix = prefix if args.prefix_tokens is None else args.prefix_tokens
    user = user if args.user_tokens is None else args.user_tokens
    text = Text.for_model(hf_tokenizer, vocab, chat)
    text.offset = WORKLOADS.index(name) * len(text.ids) // len(WORKLOADS)  # no text in common between them
    if name == "multi-turn":
        return multi_turn(text, args.conversations, args.turns, prefix, user)
    return shared_prefix(text, args.requests, prefix, user, args.concurrency)


def workload_spec(workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    prefix, user = DEFAULT_LENGTHS[workload.name]
    spec: dict[str, Any] = {
        "prefix_tokens": prefix if args.prefix_tokens is None else args.prefix_tokens,
        "user_tokens": user if args.user_tokens is None else args.user_tokens,
        "output_tokens": args.output_tokens, "requests": workload.num_requests,
    }
    if isinstance(workload, MultiTurn):
        spec.update(conversations=len(workload.users), turns=args.turns)
    else:
        spec.update(concurrency=workload.concurrency)
    return spec


# -- what a run reports -------------------------------------------------------------------------------
def _percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile, linearly interpolated between the closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def cache_rates(queries: float | None, hits: float | None) -> dict[str, Any] | None:
    """The prefix cache over a run, in tokens; None when the system does not say."""
    if queries is None or hits is None:
        return None
    return {"queries": int(queries), "hits": int(hits), "hit_rate": hits / queries if queries > 0 else 0.0}


def summarize(records: list[dict[str, Any]], seconds: float, cache: dict[str, Any] | None) -> dict[str, Any]:
    """A run's figures from its requests' records (prompt_tokens, output_tokens, ttft_s, latency_s)."""
    ttft = [r["ttft_s"] * 1e3 for r in records if r["ttft_s"] is not None]
    latency = [r["latency_s"] * 1e3 for r in records]
    output = sum(r["output_tokens"] for r in records)
    cached = [r["cached_tokens"] for r in records if r.get("cached_tokens") is not None]
    return {
        "requests": len(records),
        "seconds": seconds,
        "prompt_tokens": sum(r["prompt_tokens"] for r in records),
        "output_tokens": output,
        "output_tokens_per_second": output / seconds if seconds > 0 else None,
        "requests_per_second": len(records) / seconds if seconds > 0 else None,
        "ttft_ms": {"median": _percentile(ttft, 50), "p90": _percentile(ttft, 90),
                    "mean": statistics.fmean(ttft) if ttft else None},
        "latency_ms": {"median": _percentile(latency, 50), "p90": _percentile(latency, 90)},
        "prefix_cache": cache,
        # what the responses say they took from the cache (RequestOutput / usage), where they say it
        "cached_tokens_reported": sum(cached) if len(cached) == len(records) and records else None,
        "per_request": sorted(records, key=lambda r: r["arrival_s"]),
    }


def compare(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """off/on TTFT (how much sooner the first token comes with the cache) and on/off throughput."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    return {
        "ttft_median_off_over_on": ratio(off["ttft_ms"]["median"], on["ttft_ms"]["median"]),
        "ttft_p90_off_over_on": ratio(off["ttft_ms"]["p90"], on["ttft_ms"]["p90"]),
        "output_tokens_per_second_on_over_off": ratio(on["output_tokens_per_second"], off["output_tokens_per_second"]),
        "requests_per_second_on_over_off": ratio(on["requests_per_second"], off["requests_per_second"]),
    }


def same_outputs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, int]:
    """Requests (by key) whose outputs are equal in both runs."""
    return {"equal": sum(a[k] == b.get(k) for k in a), "requests": len(a)}


# -- offline: orca's engine in this process ----------------------------------------------------------
def has_prefix_caching() -> bool:
    from dataclasses import fields

    from orca import EngineConfig

    return "enable_prefix_caching" in {f.name for f in fields(EngineConfig)}


def engine_config(args: argparse.Namespace, caching: bool) -> Any:
    from orca import EngineConfig

    return EngineConfig(
        model=args.model, max_bs=args.max_bs, dtype=args.dtype, block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens or None, n_slots=args.n_slots,
        torch_compile=args.torch_compile, attention_backend=args.attention_backend, enable_prefix_caching=caching,
    )


def run_offline(args: argparse.Namespace, workload: Workload, render: Renderer,
                caching: bool) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """The workload on a fresh engine with prefix caching on or off, after a warm-up (two requests as long
    as the workload's first prompts, of token ids no prompt of it starts with). Returns the run's summary
    and each request's tokens."""
    import torch

    from orca import LLMEngine, SamplingParams

    engine = LLMEngine(engine_config(args, caching))
    try:
        vocab = engine.model_config.vocab_size
        warm = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        length = max(len(render(r.messages)) for r in workload.first())
        for k in range(2):
            engine.add_request(f"warmup-{k}", [(7 * i + 5 + k) % vocab for i in range(length)], warm)
        while engine.has_unfinished():
            engine.step()
        params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
        before = engine.stats()
        records, answers, seconds = drive_closed_loop(engine, workload, render, params)
        after = engine.stats()
        cache = None
        if hasattr(after, "prefix_cache_queries"):
            cache = cache_rates(after.prefix_cache_queries - before.prefix_cache_queries,
                                after.prefix_cache_hits - before.prefix_cache_hits)
            cache["blocks_at_end"] = getattr(after, "prefix_cache_blocks", None)
        summary = {
            "enable_prefix_caching": engine.config.enable_prefix_caching,
            "effective_prefix_caching": getattr(engine.config, "enable_prefix_caching", caching),
            "attention_backend": engine.executor.worker.attention_backend,
            "dtype": str(engine.config.torch_dtype).removeprefix("torch."),
            "device": str(engine.config.torch_device),
            "max_bs": engine.config.max_bs, "block_size": engine.block_size, "n_slots": engine.n_slots,
            "max_num_batched_tokens": engine.config.max_num_batched_tokens,
            "preemptions": after.preemptions - before.preemptions,
            **summarize(records, seconds, cache),
        }
    finally:
        engine.shutdown()
    del engine
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return summary, answers


def drive_closed_loop(engine: Any, workload: Workload, render: Renderer,
                      params: Any) -> tuple[list[dict[str, Any]], dict[str, list[int]], float]:
    """Steps an LLMEngine through the workload: every stream's first request at the start, each next one
    the moment the step that finished its predecessor returns (its arrival time then; held back only while
    the engine's waiting queue is full, its arrival unchanged). Returns the requests' records, their
    tokens by key, and the wall time from the start to the last answer."""
    max_queue = engine.config.max_queue
    backlog: deque[tuple[Request, list[int], float]] = deque()
    live: dict[str, tuple[Request, int]] = {}
    records: list[dict[str, Any]] = []
    answers: dict[str, list[int]] = {}
    start = time.monotonic()
    for request in workload.first():
        backlog.append((request, render(request.messages), start))
    while backlog or engine.has_unfinished():
        while backlog and engine.stats().waiting < max_queue:
            request, ids, arrival = backlog.popleft()
            engine.add_request(request.key, ids, params, arrival_time=arrival)
            live[request.key] = (request, len(ids))
        for out in engine.step():
            if not out.finished:
                continue
            if out.error or out.finish_reason not in ("length", "stop"):
                raise RuntimeError(f"request {out.request_id} failed: {out.error or out.finish_reason}")
            request, prompt_tokens = live.pop(out.request_id)
            tokens = list(out.token_ids)
            answers[request.key] = tokens
            first = out.first_token_time
            records.append({
                "key": request.key, "stream": request.stream, "arrival_s": out.arrival_time - start,
                "prompt_tokens": prompt_tokens, "output_tokens": len(tokens),
                "ttft_s": None if first is None else first - out.arrival_time,
                "latency_s": out.finish_time - out.arrival_time,
                "cached_tokens": getattr(out, "num_cached_tokens", None),
            })
            nxt = workload.next(request, out.text if render.chat else tokens)
            if nxt is not None:
                now = time.monotonic()
                backlog.append((nxt, render(nxt.messages), now))
    return records, answers, time.monotonic() - start


# -- serve: through the servers' OpenAI APIs ----------------------------------------------------------
@dataclass
class ChatResult:
    text: str
    ttft_s: float | None
    latency_s: float
    prompt_tokens: int | None
    completion_tokens: int
    cached_tokens: int | None


def chat_stream(url: str, model: str, messages: Sequence[dict[str, Any]], max_tokens: int, timeout: float,
                api_key: str | None = None) -> ChatResult:
    """One streaming chat completion (greedy, EOS ignored, usage asked for): the answer's text, the time to
    the first chunk with content and to the end, and the usage the server reports."""
    import json

    import requests

    body = {"model": model, "messages": [dict(m) for m in messages], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    parts: list[str] = []
    first: float | None = None
    chunks = 0
    usage: dict[str, Any] = {}
    start = time.monotonic()
    with requests.post(f"{url}/v1/chat/completions", json=body, headers=headers, stream=True, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
        # Each HTTP chunk as it arrives (uvicorn's streams are chunked); a stream without chunks byte by byte,
        # since a read of n bytes there waits for all n.
        size = None if "chunked" in r.headers.get("transfer-encoding", "").lower() else 1
        for line in r.iter_lines(chunk_size=size):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"{url}: {event['error']}")
            for choice in event.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if first is None:
                        first = time.monotonic()
                    parts.append(content)
                    chunks += 1
            if event.get("usage"):
                usage = event["usage"]
    end = time.monotonic()
    details = usage.get("prompt_tokens_details") or {}
    return ChatResult("".join(parts), None if first is None else first - start, end - start,
                      usage.get("prompt_tokens"), usage.get("completion_tokens") or chunks,
                      details.get("cached_tokens"))


def sum_samples(text: str, names: Sequence[str], labels: dict[str, str] | None = None) -> dict[str, float]:
    """Prometheus text: each of `names` summed over its series (only those with `labels`, when given)."""
    from orca_client.bench.trace_cmd import _LABEL, _SAMPLE_LINE

    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE_LINE.match(line)
        if m is None or m.group(1) not in names:
            continue
        if labels and any(dict(_LABEL.findall(m.group(2) or "")).get(k) != v for k, v in labels.items()):
            continue
        try:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        except ValueError:
            continue
    return out


def cache_counters(url: str | None, names: Sequence[str], labels: dict[str, str] | None) -> tuple[float, float] | None:
    """(queries, hits) of a server's prefix cache from its metrics endpoint; None when it has no such
    counters or cannot be read."""
    import urllib.request

    if not url:
        return None
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode("utf-8", errors="replace")
    except (OSError, ValueError):
        return None
    samples = sum_samples(text, names, labels)
    if names[0] not in samples or names[1] not in samples:
        return None
    return samples[names[0]], samples[names[1]]


def run_served(url: str, model: str, workload: Workload, output_tokens: int, timeout: float,
               counters: Callable[[], tuple[float, float] | None]) -> tuple[dict[str, Any], dict[str, str]]:
    """The workload against a server's chat completions, one thread per stream, after a short warm-up
    request. Returns the run's summary and each request's answer text."""
    run_chat = chat_stream  # one name for the threads
    run_chat(url, model, [{"role": "user", "content": "Say hello."}], 4, timeout)
    lock = threading.Lock()
    records: list[dict[str, Any]] = []
    answers: dict[str, str] = {}
    errors: list[BaseException] = []
    start = time.monotonic()

    def stream(request: Request | None) -> None:
        try:
            while request is not None:
                arrival = time.monotonic()
                res = run_chat(url, model, request.messages, output_tokens, timeout)
                with lock:
                    answers[request.key] = res.text
                    records.append({
                        "key": request.key, "stream": request.stream, "arrival_s": arrival - start,
                        "prompt_tokens": res.prompt_tokens or 0, "output_tokens": res.completion_tokens,
                        "ttft_s": res.ttft_s, "latency_s": res.latency_s, "cached_tokens": res.cached_tokens,
                    })
                request = workload.next(request, res.text)
        except BaseException as exc:  # noqa: BLE001 - reported after every stream has ended
            with lock:
                errors.append(exc)

    before = counters()
    threads = [threading.Thread(target=stream, args=(r,), daemon=True) for r in workload.first()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - start
    after = counters()
    if errors:
        raise RuntimeError(f"{len(errors)} stream(s) failed; the first: {errors[0]}") from errors[0]
    cache = None
    if before is not None and after is not None:
        cache = cache_rates(after[0] - before[0], after[1] - before[1])
    return summarize(records, seconds, cache), answers


def vllm_max_model_len(spec: dict[str, Any], template_tokens: int = 16) -> int:
    """A context vLLM's server allows for the workload's longest request (its last turn and answer, each
    message with up to `template_tokens` of the chat template's), with a quarter to spare for the text
    slices' tokenizing differently once joined, in multiples of 1024; at least orca-bench serve's 2048."""
    turns = spec.get("turns", 1)
    longest = (spec["prefix_tokens"] + turns * spec["user_tokens"] + turns * spec["output_tokens"]
               + 2 * (turns + 1) * template_tokens)
    return max(2048, -(-int(longest * 1.25) // 1024) * 1024)


# -- the command --------------------------------------------------------------------------------------
def cmd_prefix(args: argparse.Namespace) -> int:
    import torch

    workloads = comma_choices(args.workload, WORKLOADS, "workload")
    modes = comma_choices(args.mode, MODES, "mode")
    systems = comma_choices(args.systems, SYSTEMS, "system")
    if not has_prefix_caching():
        raise ValueError("this orca has no prefix caching (EngineConfig.enable_prefix_caching)")
    checkpoint, render, hf_tokenizer, vocab = model_text(args.model)
    if "serve" in modes and not render.chat:
        raise ValueError(f"--mode serve sends chat completions: {checkpoint} has no tokenizer with a chat template")
    result: dict[str, Any] = {
        "benchmark": "prefix", "command": " ".join(["orca-bench", *sys.argv[1:]]), "machine": machine_info(),
        "checkpoint": str(checkpoint), "torch_threads": torch.get_num_threads(),
        "chat_template": render.chat, "workloads": {},
    }
    skipped = check_systems(modes, systems)
    if skipped:
        result["skipped"] = skipped
    built = {name: build_workload(name, args, hf_tokenizer, vocab, render.chat) for name in workloads}
    for name, workload in built.items():
        record: dict[str, Any] = {"spec": workload_spec(workload, args)}
        result["workloads"][name] = record
        if "offline" in modes:
            record["offline"] = {"orca": run_pair(
                f"{name}, offline", lambda caching, w=workload: run_offline(args, w, render, caching))}
    if "serve" in modes:
        for name, served in serve_workloads(args, built, checkpoint, systems, skipped).items():
            result["workloads"][name]["serve"] = served
    print_prefix(result)
    if args.json:
        write_json(args.json, result)
    return 0


def run_pair(label: str, run: Callable[[bool], tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """One system with prefix caching on, then off: both summaries, the ratios and the equal outputs."""
    runs, outputs = {}, {}
    for setting, caching in SETTINGS.items():
        print(f"== {label}, prefix caching {setting}", file=sys.stderr, flush=True)
        runs[setting], outputs[setting] = run(caching)
    return pair_record(runs, outputs)


def pair_record(runs: dict[str, Any], outputs: dict[str, Any]) -> dict[str, Any]:
    """Both runs, the ratios and the requests whose outputs are equal on and off."""
    return {**runs, "ratios": compare(runs["on"], runs["off"]),
            "same_outputs": same_outputs(outputs["on"], outputs["off"])}


def check_systems(modes: list[str], systems: list[str]) -> dict[str, str]:
    """The systems that cannot run (vllm without its venv), by name, with why; said before anything runs."""
    skipped: dict[str, str] = {}
    if "serve" in modes and "vllm" in systems:
        from orca_client.peers import PeerUnavailable, peer_python

        try:
            peer_python("vllm")
        except PeerUnavailable as exc:
            skipped["vllm"] = str(exc)
            print(f"skipping vllm: {exc}", file=sys.stderr, flush=True)
    return skipped


def serve_workloads(args: argparse.Namespace, workloads: dict[str, Workload], checkpoint: Path, systems: list[str],
                    skipped: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Every workload through each server in turn: orca's with prefix caching on, orca's with it off, vLLM's
    with it on; each server started once for all the workloads (their texts do not overlap) and stopped
    before the next starts. By workload: {"orca": {"on", "off", "ratios", "same_outputs"}, "vllm": {"on"},
    "orca_on_over_vllm_on"}."""
    import tempfile

    import torch

    from orca.config import auto_dtype
    from orca_client.bench.serve import orca_server, vllm_server

    out: dict[str, dict[str, Any]] = {name: {} for name in workloads}
    with tempfile.TemporaryDirectory(prefix="orca-prefix-bench-") as tmp:
        work = Path(tmp)
        if "orca" in systems:
            runs: dict[str, dict[str, Any]] = {name: {} for name in workloads}
            answers: dict[str, dict[str, Any]] = {name: {} for name in workloads}
            try:
                for setting, caching in SETTINGS.items():
                    params = {"enable_prefix_caching": "true" if caching else "false"}
                    if args.model:
                        params["model"] = str(Path(args.model).expanduser().resolve())
                    print(f"== orca's server, prefix caching {setting}", file=sys.stderr, flush=True)
                    with orca_server(work, args.startup_timeout, params) as server:
                        for name, workload in workloads.items():
                            print(f"   {name}", file=sys.stderr, flush=True)
                            runs[name][setting], answers[name][setting] = run_served(
                                server.openai_url, server.model, workload, args.output_tokens, args.timeout,
                                lambda s=server: cache_counters(s.metrics_url, ORCA_CACHE_METRICS,
                                                                {"model": ORCA_MODEL}))
                for name in workloads:
                    out[name]["orca"] = pair_record(runs[name], answers[name])
            except (RuntimeError, OSError) as exc:
                failed(out, "orca", exc, work / "orca-serve.log")
        if "vllm" in systems and "vllm" not in skipped:
            print("== vLLM's server, prefix caching on", file=sys.stderr, flush=True)
            dtype = str(auto_dtype(torch.device("cpu"))).removeprefix("torch.")
            context = max(vllm_max_model_len(workload_spec(w, args)) for w in workloads.values())
            try:
                with vllm_server(work, checkpoint, dtype, args.max_num_seqs, torch.get_num_threads(),
                                 args.startup_timeout, prefix_caching=True, max_model_len=context,
                                 block_size=args.vllm_block_size) as server:
                    for name, workload in workloads.items():
                        print(f"   {name}", file=sys.stderr, flush=True)
                        summary, _ = run_served(
                            server.openai_url, server.model, workload, args.output_tokens, args.timeout,
                            lambda s=server: cache_counters(f"{s.openai_url}/metrics", VLLM_CACHE_METRICS, None))
                        summary["block_size"] = args.vllm_block_size or "vLLM's default"
                        out[name]["vllm"] = {"on": summary}
            except (RuntimeError, OSError) as exc:
                failed(out, "vllm", exc, work / "vllm-serve.log")
    for record in out.values():
        orca_on, vllm_on = record.get("orca", {}).get("on"), record.get("vllm", {}).get("on")
        if orca_on and vllm_on:
            record["orca_on_over_vllm_on"] = {
                "output_tokens_per_second": _ratio(orca_on["output_tokens_per_second"],
                                                   vllm_on["output_tokens_per_second"]),
                "ttft_median_vllm_over_orca": _ratio(vllm_on["ttft_ms"]["median"], orca_on["ttft_ms"]["median"]),
            }
    return out


def failed(out: dict[str, dict[str, Any]], system: str, exc: BaseException, log: Path) -> None:
    """A server that failed: its error, with the end of its log (the log goes with the temporary
    directory), in place of its runs, for every workload that has none; the other systems go on."""
    message = str(exc)
    try:
        message += "\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    except OSError:
        pass
    print(f"error: {system}: {message}", file=sys.stderr, flush=True)
    for record in out.values():
        if system not in record:
            record[system] = {"error": message}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_prefix(result: dict[str, Any]) -> None:
    for name, record in result["workloads"].items():
        spec = record["spec"]
        shape = (f"{spec['conversations']} chats x {spec['turns']} turns" if name == "multi-turn"
                 else f"{spec['requests']} requests, {spec['concurrency']} at a time")
        print(f"\n{name}: {shape}, system prompt {spec['prefix_tokens']} tokens, user messages "
              f"{spec['user_tokens']}, {spec['output_tokens']} new tokens each")
        print(f"  {'mode':8} {'system':6} {'cache':5} {'reqs':>5} {'prompt tok':>10} {'hit rate':>8} "
              f"{'TTFT med ms':>11} {'p90 ms':>8} {'out tok/s':>9} {'req/s':>6} {'wall s':>7}")
        pairs = []
        for mode in MODES:
            for system, runs in record.get(mode, {}).items():
                if system not in SYSTEMS:
                    continue
                if "error" in runs:
                    print(f"  {mode:8} {system:6} failed: {runs['error'].splitlines()[0][:200]}")
                    continue
                for setting in SETTINGS:
                    r = runs.get(setting)
                    if r is None:
                        continue
                    cache = r["prefix_cache"]
                    rate = "-" if cache is None else f"{100 * cache['hit_rate']:.1f}%"
                    print(f"  {mode:8} {system:6} {setting:5} {r['requests']:>5} {r['prompt_tokens']:>10} {rate:>8} "
                          f"{_fmt(r['ttft_ms']['median'], '.1f'):>11} {_fmt(r['ttft_ms']['p90'], '.1f'):>8} "
                          f"{_fmt(r['output_tokens_per_second'], '.1f'):>9} "
                          f"{_fmt(r['requests_per_second'], '.2f'):>6} {r['seconds']:>7.1f}")
                if "ratios" in runs:
                    pairs.append((mode, system, runs))
        for mode, system, runs in pairs:
            q = runs["ratios"]
            same = runs["same_outputs"]
            what = "tokens" if mode == "offline" else "answers"
            print(f"  {mode} {system}: TTFT median off/on {_fmt(q['ttft_median_off_over_on'], '.2f')}x, "
                  f"output tok/s on/off {_fmt(q['output_tokens_per_second_on_over_off'], '.2f')}x, "
                  f"req/s on/off {_fmt(q['requests_per_second_on_over_off'], '.2f')}x; same {what} on and off: "
                  f"{same['equal']}/{same['requests']}")
        vs = record.get("serve", {}).get("orca_on_over_vllm_on")
        if vs:
            print(f"  serve, caching on: orca/vLLM output tok/s {_fmt(vs['output_tokens_per_second'], '.2f')}x, "
                  f"TTFT median vLLM/orca {_fmt(vs['ttft_median_vllm_over_orca'], '.2f')}x")
    for system, why in result.get("skipped", {}).items():
        print(f"skipped {system}: {why}")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("prefix", help="prefix caching on and off on multi-turn chats and a shared system prompt, "
                       "offline and through the servers (orca's, vLLM's)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default=",".join(WORKLOADS),
                   help="multi-turn, shared-prefix or both, comma-separated (default: %(default)s)")
    p.add_argument("--mode", default=",".join(MODES), help="offline, serve or both (default: %(default)s)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help="with --mode serve: orca, vllm or both (default: %(default)s)")
    p.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--conversations", type=positive_int, default=16,
                   help="multi-turn: chats, all at once (default: %(default)s)")
    p.add_argument("--turns", type=positive_int, default=4, help="multi-turn: turns per chat (default: %(default)s)")
    p.add_argument("--requests", type=positive_int, default=32, help="shared-prefix: requests (default: %(default)s)")
    p.add_argument("--concurrency", type=nonnegative_int, default=8,
                   help="shared-prefix: streams at a time, each sending its next request when its last ends; "
                        "0: all at once (default: %(default)s)")
    p.add_argument("--prefix-tokens", type=nonnegative_int, default=None,
                   help="the shared system prompt's tokens (default: 256 multi-turn, 1024 shared-prefix)")
    p.add_argument("--user-tokens", type=positive_int, default=None,
                   help="tokens of each user message (default: 128 multi-turn, 32 shared-prefix)")
    p.add_argument("--output-tokens", type=positive_int, default=64,
                   help="new tokens per request, greedy, EOS ignored (default: %(default)s)")
    e = p.add_argument_group("offline engine (--mode offline; the server runs orca_gpt as shipped)")
    e.add_argument("--max-bs", type=positive_int, default=32, help="max_bs (default: %(default)s)")
    e.add_argument("--block-size", type=positive_int, default=16,
                   help="K/V block size in tokens: the prefix cache's unit (default: %(default)s)")
    e.add_argument("--max-num-batched-tokens", type=nonnegative_int, default=0, metavar="N",
                   help="token budget per iteration; 0: no limit (default: %(default)s)")
    e.add_argument("--n-slots", type=positive_int, default=None, metavar="N",
                   help="the K/V pool in tokens (default: the engine's)")
    e.add_argument("--dtype", default="auto", help="engine dtype (default: %(default)s)")
    e.add_argument("--torch-compile", default="auto", choices=("auto", "off"),
                   help="EngineConfig.torch_compile (default: %(default)s)")
    e.add_argument("--attention-backend", default="auto", choices=("auto", "reference", "batched", "flex"),
                   help="EngineConfig.attention_backend (default: %(default)s; flex decodes from CUDA graphs on a GPU)")
    s = p.add_argument_group("serve (--mode serve)")
    s.add_argument("--max-num-seqs", type=positive_int, default=32,
                   help="vLLM's max_num_seqs: orca's max_bs (default: %(default)s)")
    s.add_argument("--vllm-block-size", type=positive_int, default=None, metavar="N",
                   help="vLLM's K/V block size, its prefix cache's unit: a multiple of 32 on a CPU (default: "
                        "vLLM's own, 128 on a CPU; orca_gpt as shipped has 16)")
    s.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a server may take to start")
    s.add_argument("--timeout", type=float, default=1800.0, help="seconds one request may take")
    p.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    p.set_defaults(func=cmd_prefix)


if __name__ == "__main__":  # without tritonclient (the GPU machine): python -m orca_client.bench.prefix
    from orca_client.bench import main

    sys.exit(main(only="prefix"))
