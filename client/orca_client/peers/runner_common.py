"""What every peer runner shares: reading the workload, the single-stream figure, writing the result.

Runners are scripts run by a peer's own python (scripts/peers/setup_*.sh make those venvs): this module
imports the standard library only, and the runners import it as a sibling file (their directory is
sys.path[0]), never through orca_client.

The workload (JSON, the runner's first argument, "-" for stdin):
  model           what the peer loads (a checkpoint directory for vLLM, a .gguf file for llama.cpp)
  prompts         token ids, one list per request
  max_tokens      new tokens per request (greedy, EOS ignored: every request makes exactly this many)
  dtype           the peer's weight dtype (vLLM); informational for llama.cpp (the GGUF decides)
  threads         CPU threads
  max_num_seqs    requests in flight at most (orca's max_bs)
  single_stream   {"prompt": [ids], "max_tokens": N, "repeats": R}

The result (JSON, the second argument, "-" for stdout) is written by write_result.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def read_workload(argv: list[str]) -> tuple[dict[str, Any], str]:
    if len(argv) != 3:
        raise SystemExit(f"usage: {argv[0]} WORKLOAD.json|- RESULT.json|-")
    text = sys.stdin.read() if argv[1] == "-" else open(argv[1]).read()
    return json.loads(text), argv[2]


def write_result(path: str, result: dict[str, Any]) -> None:
    text = json.dumps(result) + "\n"
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        with open(path, "w") as f:
            f.write(text)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def batch_record(tokens: list[list[int]], seconds: float) -> dict[str, Any]:
    generated = sum(len(t) for t in tokens)
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_second": generated / seconds,
            "tokens": tokens}


def single_stream(generate: Callable[[list[int], int], list[int]], spec: dict[str, Any]) -> dict[str, Any]:
    """One request alone: a warm-up, then `repeats` times the prompt with max_tokens new tokens and the
    same prompt with 1 new token (the prefill and the first token). Decode tokens/s = (max_tokens - 1) /
    (median full time - median one-token time): the tokens after the first, over the time they took.
    Every system is measured this way, from outside, so the figure means the same for all."""
    prompt, n, repeats = list(spec["prompt"]), int(spec["max_tokens"]), int(spec.get("repeats", 3))
    generate(prompt, n)  # warm-up
    full, first, tokens = [], [], []
    for _ in range(repeats):
        tokens, seconds = timed(lambda: generate(prompt, n))
        if len(tokens) != n:
            raise RuntimeError(f"single stream: {len(tokens)} tokens generated, {n} asked")
        full.append(seconds)
        first.append(timed(lambda: generate(prompt, 1))[1])
    full_s, first_s = statistics.median(full), statistics.median(first)
    return {
        "prompt_tokens": len(prompt),
        "max_tokens": n,
        "repeats": repeats,
        "seconds": full,
        "first_token_seconds": first,
        "tokens_per_second": n / full_s,
        "decode_tokens_per_second": (n - 1) / (full_s - first_s) if full_s > first_s else None,
        "tokens": tokens,
    }
