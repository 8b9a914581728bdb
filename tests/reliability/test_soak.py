"""Soak: many requests over gRPC streaming (one stream each), Poisson arrivals at a rate above what the
server sustains, mixed prompt and output lengths, streaming and not. Every request is answered exactly
once: its stream ends after exactly one FINAL (tokens equal to the same request run alone, greedy) or one
error, and the only error allowed is the queue bound's refusal (UNAVAILABLE, "the waiting queue is full");
nothing is dropped. Afterwards the engine's gauges are back to zero, and the stub's resident memory stayed
bounded (its curve goes to the JSON report).

CI size: orca_tiny_soak (tiny GPT-2, max_bs 4, a waiting queue of 24: the burst is refused in part).
Full size (``stress``, make test-stress): the shipped SmolLM2 orca_gpt, 1,000 requests.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import pytest
import tritonclient.grpc.aio as aiogrpc
from _reliability import (
    LogWatch,
    Outcome,
    Sampler,
    Spec,
    alone_references,
    finished_by_reason,
    gauges,
    grpc_request,
    model_ready,
    poisson_arrivals,
    report,
    size,
    stub_pid,
    wait_idle,
)

# Text prompts for SmolLM2, short to long (about 5 to 100 tokens).
TEXTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 1969, the first humans to walk on the Moon were",
    "Here is a short poem about the sea:\n",
    "The mitochondria is known as the powerhouse of the cell because",
    "Explain in one sentence why the sky is blue. The sky is blue because",
    "A list of five fruits: apple, banana,",
    "Translate to French: 'Good morning, how are you?' ->",
    ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
     "movable metal type, oil-based ink and a wooden press adapted from those used to make wine. Within a few "
     "decades presses had spread across Europe, books became cheaper, and literacy rose. Summarize: the press"),
    ("Photosynthesis is the process by which green plants, algae and some bacteria turn light energy into "
     "chemical energy. Using sunlight, water and carbon dioxide, they make glucose and release oxygen. The "
     "process happens mostly in the chloroplasts of leaf cells, where chlorophyll absorbs red and blue light "
     "and reflects green, which is why leaves look green. Question: where does photosynthesis happen? Answer:"),
    ("def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    middle = len(items) // 2\n"
     "    left = merge_sort(items[:middle])\n    right = merge_sort(items[middle:])\n    return merge(left, right)\n\n"
     "def merge(left, right):\n"),
    "Q: What is 12 times 12?\nA:",
    ("The following is a conversation between a helpful assistant and a user who wants to plan a three-day "
     "trip to Rome, with museums, food and a day trip outside the city.\nUser: Where should I start?\nAssistant:"),
]


@dataclass(frozen=True)
class SoakSize:
    model: str
    requests: int
    rate: float  # offered requests per second (Poisson)
    pool: int  # distinct (prompt, max_tokens) pairs
    max_tokens: tuple[int, int]
    text: bool  # text prompts (SmolLM2) or token ids (tiny GPT-2, no tokenizer)
    rss_growth_mib: float  # allowed growth of the stub's RSS from after the references to the end
    timeout: float  # per request, from its arrival


def ci_size() -> SoakSize:
    return SoakSize("orca_tiny_soak", int(size("ORCA_CI_SOAK_REQUESTS", 150)), size("ORCA_CI_SOAK_RATE", 100.0), 12,
                    (4, 48), False, size("ORCA_CI_SOAK_RSS_GROWTH_MIB", 256), 300)


def stress_size() -> SoakSize:
    return SoakSize("orca_gpt", int(size("ORCA_STRESS_SOAK_REQUESTS", 1000)), size("ORCA_STRESS_SOAK_RATE", 12.0),
                    16, (4, 32), True, size("ORCA_STRESS_SOAK_RSS_GROWTH_MIB", 512), 3600)


def make_pool(s: SoakSize, seed: int = 0) -> list[Spec]:
    rng = random.Random(seed)
    pool = []
    for key in range(s.pool):
        max_tokens = rng.randint(*s.max_tokens)
        if s.text:
            pool.append(Spec(key, text=TEXTS[key % len(TEXTS)], max_tokens=max_tokens, ignore_eos=False))
        else:
            n = rng.choice([2, 5, 17, 40, 120, 300])
            pool.append(Spec(key, input_ids=tuple(rng.randrange(210) for _ in range(n)), max_tokens=max_tokens))
    return pool


async def _soak(
    server: Any, s: SoakSize, pool: list[Spec], seed: int
) -> tuple[list[Outcome], list[Spec], list[bool], float]:
    rng = random.Random(seed)
    arrivals = poisson_arrivals(s.requests, s.rate, seed)
    chosen = [rng.choice(pool) for _ in range(s.requests)]
    streaming = [rng.random() < 0.5 for _ in range(s.requests)]
    # Several channels: one HTTP/2 connection would cap the concurrent streams the server lets it open.
    clients = [aiogrpc.InferenceServerClient(server.grpc_url) for _ in range(8)]
    start = time.monotonic()

    async def one(i: int) -> Outcome:
        await asyncio.sleep(max(0.0, start + arrivals[i] - time.monotonic()))
        return await grpc_request(clients[i % len(clients)], s.model, chosen[i], i, stream=streaming[i],
                                  timeout=s.timeout)

    try:
        outcomes = await asyncio.gather(*(one(i) for i in range(s.requests)))
    finally:
        for c in clients:
            await c.close()
    return list(outcomes), chosen, streaming, start


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def run_soak(server: Any, s: SoakSize, tmp_path: Any, name: str) -> None:
    assert model_ready(server.http_url, s.model)
    pool = make_pool(s)
    wait_idle(server, s.model, timeout=600)
    refs = asyncio.run(alone_references(server.grpc_url, s.model, pool))
    before = wait_idle(server, s.model)
    stub = stub_pid(server, s.model)
    log = LogWatch(server.log_path)
    with Sampler(stub, server, s.model, period=1.0 if s.requests > 300 else 0.25) as sampler:
        outcomes, chosen, streaming, start = asyncio.run(_soak(server, s, pool, seed=1))
        after = wait_idle(server, s.model, timeout=300)
    assert stub_pid(server, s.model) == stub  # the same stub served throughout (never restarted)
    assert model_ready(server.http_url, s.model)

    # Every request answered exactly once.
    problems = []
    for out, spec in zip(outcomes, chosen):
        if out.transport_error or not out.closed or out.terminal != 1 or out.after_terminal:
            problems.append(f"{out.index}: not exactly one answer: {out}")
        elif out.errors:
            if not out.refused or out.tokens:
                problems.append(f"{out.index}: unexpected error {out.errors}")
        elif out.tokens != refs[spec.key]:
            problems.append(f"{out.index}: tokens differ from the request run alone: {out.tokens} != {refs[spec.key]}")
    assert not problems, "\n".join(problems[:20]) + f"\n({len(problems)} in all)"
    completed = [o for o in outcomes if not o.errors]
    refused = [o for o in outcomes if o.refused]
    # The engine saw each admitted request finish once, and nothing is left (gauges at zero).
    finished = {k: finished_by_reason(after).get(k, 0) - finished_by_reason(before).get(k, 0)
                for k in finished_by_reason(after)}
    assert sum(finished.values()) == len(completed), finished
    assert all(v == 0 for v in gauges(after).values()), gauges(after)
    assert not log.problems(), log.problems()

    # Above saturation: requests queued (the waiting gauge rose) or were refused.
    peak_waiting = max(x.get("waiting", 0) for x in sampler.samples)
    assert peak_waiting > 0 or refused, "the offered rate did not saturate the server: raise the rate"
    rss = [x["rss_mib"] for x in sampler.samples]
    growth = rss[-1] - rss[0]
    last_done = max(o.done for o in outcomes if o.done is not None)
    latencies = [o.done - o.sent for o in completed if o.done is not None]
    ttfts = [o.first_token - o.sent for o in completed if o.first_token is not None]
    tokens = sum(len(o.tokens) for o in completed)
    figures = {
        "model": s.model, "requests": s.requests, "offered_rate_per_s": s.rate,
        "arrival_span_s": round(max(o.sent for o in outcomes) - start, 2),
        "duration_s": round(last_done - start, 2),
        "completed": len(completed), "refused_queue_full": len(refused), "failures": len(problems),
        "streaming": sum(streaming),
        "throughput_req_per_s": round(len(completed) / (last_done - start), 2),
        "throughput_tokens_per_s": round(tokens / (last_done - start), 1),
        "latency_s_p50_p90_max": [round(_pct(latencies, q), 2) for q in (0.5, 0.9, 1.0)],
        "ttft_s_p50_p90": [round(_pct(ttfts, q), 2) for q in (0.5, 0.9)],
        "peak_waiting": peak_waiting, "finished_by_reason": finished, "gauges_after": gauges(after),
        "distinct_requests": len(pool), "rss_mib": {"start": round(rss[0], 1), "min": round(min(rss), 1),
                                                     "max": round(max(rss), 1), "end": round(rss[-1], 1),
                                                     "median": round(statistics.median(rss), 1)},
        "rss_curve": sampler.samples,
    }
    path = report(name, figures, tmp_path)
    print(f"\nsoak figures: {path}\n" + "\n".join(f"  {k}: {v}" for k, v in figures.items() if k != "rss_curve"))
    assert growth <= s.rss_growth_mib, f"the stub's RSS grew {growth:.0f} MiB (bound {s.rss_growth_mib:.0f})"


def test_soak_ci(orca_server: Any, tmp_path: Any) -> None:
    run_soak(orca_server, ci_size(), tmp_path, "soak_ci")


@pytest.mark.stress
@pytest.mark.timeout(7200)
def test_soak_stress(orca_server: Any, tmp_path: Any) -> None:
    run_soak(orca_server, stress_size(), tmp_path, "soak_stress")
