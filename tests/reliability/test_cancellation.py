"""Cancellation storm: many streams at once, half of them cancelled by their clients at random points —
right after sending (most still wait for admission: the burst is far larger than max_bs), before their
first token (a long prompt: mid-prefill), mid-decode, and right at the end (holding all but the last
token) — half over gRPC (the call is cancelled) and half over HTTP generate_stream (the connection is
closed). The cancelled ones end without a second answer (what the client held is a prefix of the request
run alone, or its FINAL beat the cancellation); the others complete with exactly the tokens they produce
alone, one FINAL each; the engine finishes each request it saw once; every K/V block comes back; the
same stub goes on serving, and the log shows no failure.

CI size: orca_tiny (tiny GPT-2). Full size (``stress``, make test-stress): 200 streams on orca_gpt.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import tritonclient.grpc.aio as aiogrpc
from _reliability import (
    LogWatch,
    Outcome,
    Spec,
    alone_references,
    finished_by_reason,
    gauges,
    grpc_request,
    http_request,
    model_ready,
    report,
    size,
    stub_pid,
    wait_idle,
)
from test_soak import TEXTS

POINTS = ("before_admission", "mid_prefill", "mid_decode", "at_end")


@dataclass(frozen=True)
class StormSize:
    model: str
    streams: int
    text: bool
    max_tokens: tuple[int, ...]
    timeout: float


def ci_size() -> StormSize:
    return StormSize("orca_tiny", int(size("ORCA_CI_STORM_STREAMS", 64)), False, (24, 60, 120), 300)


def stress_size() -> StormSize:
    return StormSize("orca_gpt", int(size("ORCA_STRESS_STORM_STREAMS", 200)), True, (12, 24, 40), 3600)


def make_pool(s: StormSize) -> tuple[list[Spec], list[Spec]]:
    """(short prompts, long prompts): a long prompt's prefill is the longest single iteration."""
    rng = random.Random(7)
    short, long_ = [], []
    for key, max_tokens in enumerate(s.max_tokens):
        if s.text:
            short.append(Spec(key, text=TEXTS[key], max_tokens=max_tokens))
            long_.append(Spec(100 + key, text=TEXTS[12 + key % 4] * 3, max_tokens=max_tokens))
        else:
            short.append(Spec(key, input_ids=tuple(rng.randrange(210) for _ in range(3 + 7 * key)),
                              max_tokens=max_tokens))
            long_.append(Spec(100 + key, input_ids=tuple(rng.randrange(210) for _ in range(1500)),
                              max_tokens=max_tokens))
    return short, long_


async def _storm(server: Any, s: StormSize, short: list[Spec], long_: list[Spec]) -> list[tuple[Outcome, Spec]]:
    rng = random.Random(11)
    plan = []
    for i in range(s.streams):
        point = POINTS[(i // 2) % len(POINTS)] if i % 2 else None
        transport = "grpc" if (i // 8) % 2 == 0 else "http"  # every point over both
        spec = rng.choice(long_ if point == "mid_prefill" or rng.random() < 0.15 else short)
        cancel: dict[str, Any] = {}
        if point == "before_admission":
            cancel = {"cancel_after_s": rng.uniform(0.0, 0.05)}
        elif point == "mid_prefill":
            cancel = {"cancel_after_s": rng.uniform(0.02, 0.3)}
        elif point == "mid_decode":
            cancel = {"cancel_after_tokens": rng.randint(1, spec.max_tokens - 2)}
        elif point == "at_end":
            cancel = {"cancel_after_tokens": spec.max_tokens - 1}
        plan.append((i, spec, transport, point, cancel))
    rng.shuffle(plan)  # cancelled and not, interleaved at random
    clients = [aiogrpc.InferenceServerClient(server.grpc_url) for _ in range(8)]
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                    timeout=aiohttp.ClientTimeout(total=None))

    async def one(i: int, spec: Spec, transport: str, point: str | None, cancel: dict[str, Any]) -> Outcome:
        if transport == "grpc":
            return await grpc_request(clients[i % len(clients)], s.model, spec, i, cancel_point=point,
                                      timeout=s.timeout, **cancel)
        return await http_request(session, server.http_url, s.model, spec, i, cancel_point=point,
                                  timeout=s.timeout, **cancel)

    try:
        outcomes = await asyncio.gather(*(one(*p) for p in plan))
    finally:
        await session.close()
        for c in clients:
            await c.close()
    return [(o, p[1]) for o, p in zip(outcomes, plan)]


def run_storm(server: Any, s: StormSize, tmp_path: Any, name: str) -> None:
    assert model_ready(server.http_url, s.model)
    short, long_ = make_pool(s)
    wait_idle(server, s.model, timeout=600)
    refs = asyncio.run(alone_references(server.grpc_url, s.model, short + long_))
    before = wait_idle(server, s.model)
    stub = stub_pid(server, s.model)
    log = LogWatch(server.log_path)
    t0 = time.monotonic()
    results = asyncio.run(_storm(server, s, short, long_))
    duration = time.monotonic() - t0
    after = wait_idle(server, s.model, timeout=300)  # every K/V block is back

    problems = []
    for out, spec in results:
        ref = refs[spec.key]
        if out.transport_error or out.after_terminal or out.terminal > 1:
            problems.append(f"{out.index}: more than one answer or a broken stream: {out}")
        elif out.cancelled:
            if out.terminal or out.tokens != ref[: len(out.tokens)] or len(out.tokens) >= len(ref):
                problems.append(f"{out.index}: cancelled, but holds {out.tokens} (alone: {ref}): {out}")
        elif out.terminal != 1 or out.finals != 1 or out.errors or not out.closed or out.tokens != ref:
            problems.append(f"{out.index}: did not complete as alone ({ref}): {out}")
    assert not problems, "\n".join(problems[:20]) + f"\n({len(problems)} in all)"
    assert stub_pid(server, s.model) == stub and model_ready(server.http_url, s.model)
    assert not log.problems(), log.problems()

    cancelled = [o for o, _ in results if o.cancelled]
    completed = [o for o, _ in results if not o.cancelled]
    finished = {k: v - finished_by_reason(before).get(k, 0) for k, v in finished_by_reason(after).items()}
    finished = {k: v for k, v in finished.items() if v}
    # Each request the engine saw finished once: as the client asked (cancelled), or ran out first. A call
    # cancelled before Triton handed it to the model never reaches the engine.
    assert set(finished) <= {"length", "stop", "cancelled"}, finished
    assert finished.get("cancelled", 0) <= len(cancelled), finished
    assert len(completed) <= finished.get("length", 0) + finished.get("stop", 0) <= len(results), finished
    assert all(v == 0 for v in gauges(after).values()), gauges(after)
    # A request is served as before: same tokens as alone.
    check = asyncio.run(alone_references(server.grpc_url, s.model, short[:1]))
    assert check[short[0].key] == refs[short[0].key]

    by_point = Counter((o.cancel_point, o.transport) for o in cancelled)
    figures = {
        "model": s.model, "streams": len(results), "duration_s": round(duration, 1), "failures": len(problems),
        "planned_cancellations": sum(1 for o, _ in results if o.cancel_point),
        "cancelled_by_the_client": len(cancelled),
        "final_beat_the_cancellation": sum(1 for o, _ in results if o.cancel_point and not o.cancelled),
        "cancelled_by_point_and_transport": {f"{p}/{t}": n for (p, t), n in sorted(by_point.items())},
        "cancelled_holding_no_token": sum(1 for o in cancelled if not o.tokens),
        "cancelled_mid_stream": sum(1 for o in cancelled if o.tokens),
        "completed": len(completed),
        "completed_by_transport": dict(Counter(o.transport for o in completed)),
        "engine_finished_by_reason": finished, "gauges_after": gauges(after),
    }
    path = report(name, figures, tmp_path)
    print(f"\nstorm figures: {path}\n" + "\n".join(f"  {k}: {v}" for k, v in figures.items()))
    assert cancelled and finished.get("cancelled", 0) > 0  # the storm did cancel requests in the engine


def test_cancellation_storm_ci(orca_server: Any, tmp_path: Any) -> None:
    run_storm(orca_server, ci_size(), tmp_path, "storm_ci")


@pytest.mark.stress
@pytest.mark.timeout(7200)
def test_cancellation_storm_stress(orca_server: Any, tmp_path: Any) -> None:
    run_storm(orca_server, stress_size(), tmp_path, "storm_stress")
