"""The Triton path's bounds on what one request may ask for: stop strings, stop_token_ids and n are capped,
and a text prompt that cannot fit the context is refused before it is decoded or tokenized. Against the real
server: 20 concurrent 1 MiB prompts beside small requests are refused at once, and the small ones are
unharmed (long prompts that do fit are tokenized off execute's thread)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpc
from _fixtures import FakeCodec, s
from _server import SHIPPED_MODEL, _with_parameters

from orca_server.server import TritonServer
from orca_triton.generate import (
    MAX_N,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    PROMPT_BYTES_PER_TOKEN,
    GenerateRequest,
    parse_generate_request,
)

sys.path.insert(0, str(Path(__file__).resolve().parent / "reliability"))
from _reliability import Spec, grpc_request  # noqa: E402


class CountingCodec(FakeCodec):
    """FakeCodec that counts what it was asked to tokenize."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return super().encode(text)


def parse(inputs: dict, sampling: dict | None = None, codec: Any = None, max_model_len: int | None = 100,
          ) -> GenerateRequest:
    inputs = inputs or {"text_input": s("hi")}
    if sampling is not None:
        inputs["sampling_parameters"] = s(json.dumps(sampling))
    return parse_generate_request(inputs, {}, codec or FakeCodec(), True, max_model_len=max_model_len)


@pytest.mark.parametrize(("sampling", "message"), [
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, f"stop holds 17 strings; at most {MAX_STOP_STRINGS} are allowed"),
    ({"stop": ["ok", "y" * (MAX_STOP_CHARS + 1)]}, rf"stop\[1\] is 1001 characters long; at most {MAX_STOP_CHARS} are"),
    ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))},
     f"stop_token_ids holds 65 ids; at most {MAX_STOP_TOKEN_IDS} are allowed"),
    ({"n": MAX_N + 1}, rf"n must be >= 1 and <= {MAX_N} \(sequences generated for the prompt, each an engine request"),
])
def test_caps_name_the_field_and_the_bound(sampling: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse({}, sampling)


def test_values_at_the_caps_are_accepted() -> None:
    req = parse({}, {"stop": ["z" * MAX_STOP_CHARS] * MAX_STOP_STRINGS,
                     "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS)), "n": MAX_N})
    assert len(req.params.stop) == MAX_STOP_STRINGS and req.params.n == MAX_N
    assert len(req.params.stop_token_ids) == MAX_STOP_TOKEN_IDS


@pytest.mark.parametrize("name", ["text_input", "messages"])
def test_a_text_too_long_for_the_context_is_refused_without_tokenizing(name: str) -> None:
    """max_model_len 100: 6,400 bytes pass (then tokenized), 6,401 are refused and never reach the codec;
    messages count with tools."""
    limit = PROMPT_BYTES_PER_TOKEN * 100

    def prompt(size: int) -> np.ndarray:
        if name == "text_input":
            return s("a" * size)
        wrapper = json.dumps([{"role": "user", "content": ""}])
        return s(json.dumps([{"role": "user", "content": "a" * (size - len(wrapper))}]))

    codec = CountingCodec()
    assert len(parse({name: prompt(limit)}, codec=codec, max_model_len=None).prompt_token_ids) > 0
    assert codec.calls == 1
    parse({name: prompt(limit)}, codec=codec)
    assert codec.calls == 2
    with pytest.raises(ValueError, match=rf"^{name} is {limit + 1} bytes long; at most {limit} bytes are allowed "
                                         rf"\(64 per token of max_model_len 100\)"):
        parse({name: prompt(limit + 1)}, codec=codec)
    assert codec.calls == 2
    big = np.array(["é" * limit], dtype=object)  # UTF-8 bytes, not characters: 2 each
    with pytest.raises(ValueError, match=f"is {2 * limit} bytes long"):
        parse({name: np.array([big[0].encode()], dtype=object)}, codec=codec)
    assert codec.calls == 2


def test_messages_and_tools_count_together() -> None:
    chat = s(json.dumps([{"role": "user", "content": "q"}]))
    tools = s(json.dumps([{"type": "function", "function": {"name": "f", "description": "d" * 6400}}]))
    with pytest.raises(ValueError, match="^messages and tools is .* bytes long; at most 6400"):
        parse_generate_request({"messages": chat, "tools": tools}, {}, FakeCodec(), True, max_model_len=100)


# -- through Triton ------------------------------------------------------------------------------------
MODEL = "orca_bounds"  # the shipped SmolLM2 (a real tokenizer), eager
MIB = 1 << 20


def test_huge_prompts_are_refused_at_once_beside_small_requests(tmp_path: Path) -> None:
    """20 concurrent 1 MiB text prompts (beyond 64 bytes x max_model_len 8,192 = 512 KiB) beside 10 small
    requests and 2 long prompts that pass the size check (400 KiB: tokenized on the prompt pool, then
    refused by the engine as longer than the context): every huge one gets the size check's INVALID_ARG
    (so it was never tokenized: the check comes first), every small one completes. The times are printed,
    not asserted (a shared host's load decides them), beside Triton's own statistics of the mixed run (a
    request's wait for execute and execute's time, from the server's side of gRPC): docs/RELIABILITY.md has
    the figures."""
    repo = tmp_path / "model_repository"
    (repo / MODEL / "1").mkdir(parents=True)
    shutil.copy(SHIPPED_MODEL / "1" / "model.py", repo / MODEL / "1" / "model.py")
    params = {"torch_compile": "off", "max_bs": "8", "n_slots": "4096"}
    (repo / MODEL / "config.pbtxt").write_text(
        _with_parameters((SHIPPED_MODEL / "config.pbtxt").read_text(), MODEL, params))
    small = [Spec(i, input_ids=tuple(range(100 + i, 110 + i)), max_tokens=8) for i in range(10)]
    huge_text = "word " * (MIB // 5)
    long_text = "word " * (400 * 1024 // 5)
    with TritonServer(repo, log_path=tmp_path / "tritonserver.log", startup_timeout=600,
                      env=dict(os.environ)) as server:

        async def run(specs: list[Spec], texts: list[str]) -> tuple[list[Any], list[tuple[float, str]]]:
            client = aiogrpc.InferenceServerClient(server.grpc_url, channel_args=[
                ("grpc.max_send_message_length", 8 * MIB), ("grpc.max_receive_message_length", 8 * MIB)])
            try:
                return await asyncio.gather(
                    asyncio.gather(*(grpc_request(client, MODEL, sp, sp.key, timeout=300) for sp in specs)),
                    asyncio.gather(*(_timed_text(client, text, 1000 + i) for i, text in enumerate(texts))),
                )
            finally:
                await client.close()

        alone, _ = asyncio.run(run(small, []))
        before = _inference_stats(server)
        outs, refusals = asyncio.run(run(small, [huge_text] * 20 + [long_text] * 2))
        after = _inference_stats(server)
    huge, long = refusals[:20], refusals[20:]
    took = sorted(t for t, _ in huge)

    def ttft(outcomes: list[Any]) -> str:
        return f"{max(o.first_token - o.sent for o in outcomes) * 1e3:.0f} ms"
    print(f"\n20 x 1 MiB prompts refused in {took[0] * 1e3:.1f}-{took[-1] * 1e3:.1f} ms "
          f"(median {took[10] * 1e3:.1f} ms); 2 x 400 KiB tokenized and refused in "
          f"{', '.join(f'{t * 1e3:.0f}' for t, _ in long)} ms; 10 small requests: longest TTFT {ttft(outs)} "
          f"(alone {ttft(alone)}); in Triton, per request: " + ", ".join(
              f"{key} {(after[key][1] - before[key][1]) / 1e6 / (after[key][0] - before[key][0]):.1f} ms"
              for key in ("queue", "compute_infer", "success")))
    for a, o in zip(alone, outs):
        assert not a.errors and a.finals == 1 and len(a.tokens) == 8, a
        assert not o.errors and o.finals == 1 and len(o.tokens) == 8, o
    for _, error in huge:
        assert "text_input is 1048575 bytes long; at most 524288 bytes are allowed" in error, error
    for _, error in long:
        assert "text_input" not in error and "8192" in error, error  # the engine's context check, after tokenizing


def _inference_stats(server: TritonServer) -> dict[str, tuple[int, int]]:
    """Triton's cumulative statistics of MODEL (an administrative API: the admin key): count and ns of each
    phase (queue: waiting for execute; compute_infer: execute; success: both, once the request arrived)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        stats = client.get_inference_statistics(MODEL, as_json=True, headers=server.grpc_admin_headers)
    finally:
        client.close()
    phases = stats["model_stats"][0]["inference_stats"]
    return {key: (int(phases[key].get("count", 0)), int(phases[key].get("ns", 0))) for key in phases}


async def _timed_text(client: aiogrpc.InferenceServerClient, text: str, index: int) -> tuple[float, str]:
    """Sends one text prompt on a stream of its own: (seconds until its error, the error)."""
    out = await grpc_request(client, MODEL, Spec(index, text=text, max_tokens=1), index, timeout=300)
    assert len(out.errors) == 1 and out.finals == 0, out
    return out.done - out.sent, out.errors[0]
