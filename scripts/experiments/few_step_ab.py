"""Decode steps of 2-5 requests, the few step's graph (CPUGraphs.few, a GraphStep built by few_step:
orca/worker/cpu_graphs/steps.py, attention inside it) against the graph of every token count (attention as the
opaque op: the reference's per-request calls at 2 rows, the batched backend's batch from 3), on SmolLM2 as
shipped (int4, bfloat16 on an AVX512-BF16 CPU), one engine: `runner.few` set to None for the other side. Per
row count, rounds alternating the two: that many requests with random 64-token prompts (fresh each round: no
prefix-cache hit), 48 new tokens each, greedy; the decode steps' mean time (every step after the prompts'
iteration). Prints the medians over the rounds and their ratio, and how many requests got the same greedy
tokens both ways (in bfloat16 the two attentions round differently: FewDecode accumulates in float32, the
batched backend multiplies in bfloat16; near-ties may go either way).

    PYTHONPATH=.:client .venv/bin/python scripts/experiments/few_step_ab.py [--rounds 6]

Not a test, not a benchmark of record: docs/BENCHMARKS.md quotes its output with the host.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from orca import EngineConfig, LLMEngine, SamplingParams
from orca.worker.cpu_graphs import CPUGraphs


def steps(engine: LLMEngine, prompts: list[list[int]], tag: str) -> tuple[float, list[list[int]]]:
    """(mean seconds of a decode step, each request's tokens): the prompts in one iteration, then decode."""
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    engine.step()  # the prompts
    tokens: dict[str, list[int]] = {}
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - t0)
        for out in outputs:
            if out.finished:
                tokens[out.request_id] = list(out.token_ids)
    return statistics.mean(times), [tokens[f"{tag}-{i}"] for i in range(len(prompts))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--model", default=None, help="checkpoint (default: the shipped SmolLM2 GGUF)")
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model))
    compiled = engine.executor.worker.runner
    few = compiled.few if isinstance(compiled, CPUGraphs) else None
    if few is None:
        raise SystemExit("this engine runs no few step (the forward pass is not compiled, or a layer has a window)")
    rng = random.Random(0)
    top = min(10000, engine.model_config.vocab_size)  # (a --model of a smaller vocabulary)
    for rows in (2, 3, 4, 5):
        ms: dict[str, list[float]] = {"op": [], "few": []}
        same = total = 0
        for r in range(args.rounds + 1):  # (round 0: a warm-up, not counted)
            prompts = [[rng.randrange(100, top) for _ in range(64)] for _ in range(rows)]
            got = {}
            for side in ("op", "few") if r % 2 else ("few", "op"):
                compiled.few = few if side == "few" else None
                before = few.steps
                seconds, got[side] = steps(engine, prompts, f"{rows}-{r}-{side}")
                assert (few.steps > before) == (side == "few")
                if r:
                    ms[side].append(seconds * 1e3)
            same += sum(a == b for a, b in zip(got["op"], got["few"]))
            total += rows
        op, fw = statistics.median(ms["op"]), statistics.median(ms["few"])
        print(f"{rows} requests: decode step {op:.2f} ms through the op, {fw:.2f} ms in the few step's graph: "
              f"{op / fw:.3f}x; {same}/{total} requests the same greedy tokens (rounds: op "
              f"{[round(x, 2) for x in ms['op']]}, few {[round(x, 2) for x in ms['few']]})", flush=True)
    compiled.few = few
    engine.shutdown()


if __name__ == "__main__":
    main()
