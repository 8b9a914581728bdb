"""Inductor options A/B in the engine: one model (the shipped SmolLM2 GGUF by default, torch_compile as
shipped) compiled with the inductor options of --a and of --b patched in (for example
``size_asserts=False``), each decoding one stream in a process of its own (two engines of one model class
in one process share dynamo's graph: the second would not compile), the processes run A, B, A, B, ...
--repeats times each; each reports the median milliseconds a step of its blocks of --steps steps; printed:
each process's figure, the medians, their ratio, and whether A and B drew the same greedy tokens. Not a
test, not a benchmark of record: docs/BENCHMARKS.md quotes its output with the command and the host.

    PYTHONPATH=. .venv/bin/python scripts/experiments/inductor_options_ab.py --b size_asserts=False
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import statistics
import subprocess
import sys
import time


def options(text: str) -> dict[str, object]:
    """'a=1,b=False' -> {'a': 1, 'b': False} (each value a Python literal)."""
    out: dict[str, object] = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=", 1)
        out[key.strip()] = ast.literal_eval(value.strip())
    return out


def run_one(args: argparse.Namespace) -> None:
    """One engine with args.one's options: prints a JSON line of its load time, step times and tokens."""
    import torch._inductor.config as inductor_config

    from orca import EngineConfig, LLMEngine, SamplingParams

    t0 = time.perf_counter()
    with inductor_config.patch(options(args.one)):
        engine = LLMEngine(EngineConfig(model=args.model, block_size=16))
    load = time.perf_counter() - t0
    rng = random.Random(0)
    prompt = [rng.randrange(3, engine.core.model_config.vocab_size) for _ in range(args.prompt_len)]
    engine.add_request("r", prompt, SamplingParams(max_tokens=args.blocks * args.steps + 16, temperature=0,
                                                   ignore_eos=True))
    tokens: list[int] = []
    for _ in range(6):
        for out in engine.step():
            tokens.extend(out.token_ids)
    times = []
    for _ in range(args.blocks):
        t1 = time.perf_counter()
        for _ in range(args.steps):
            for out in engine.step():
                tokens.extend(out.token_ids)
        times.append((time.perf_counter() - t1) / args.steps * 1e3)
    print(json.dumps({"load": load, "ms": statistics.median(times), "tokens": tokens}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the shipped SmolLM2 GGUF)")
    p.add_argument("--a", default="", help="inductor options of A (default: none patched)")
    p.add_argument("--b", default="", help="inductor options of B, e.g. size_asserts=False")
    p.add_argument("--repeats", type=int, default=3, help="processes of each")
    p.add_argument("--blocks", type=int, default=15)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:
        return run_one(args)
    results: dict[str, list[dict]] = {"A": [], "B": []}
    for _ in range(args.repeats):
        for name, text in (("A", args.a), ("B", args.b)):
            cmd = [sys.executable, __file__, "--one", text, "--blocks", str(args.blocks), "--steps", str(args.steps),
                   "--prompt-len", str(args.prompt_len)] + (["--model", args.model] if args.model else [])
            line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            results[name].append(json.loads(line))
            r = results[name][-1]
            print(f"{name} ({text or 'as shipped'}): load {r['load']:.1f} s, {r['ms']:.2f} ms a step", flush=True)
    m = {k: statistics.median(r["ms"] for r in v) for k, v in results.items()}
    same = all(r["tokens"] == results["A"][0]["tokens"] for v in results.values() for r in v)
    print(f"A {m['A']:.2f} ms a step, B {m['B']:.2f}; A / B {m['A'] / m['B']:.3f}; same tokens: {same}")


if __name__ == "__main__":
    main()
