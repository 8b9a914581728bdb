"""Why the engine is loaded and stepped on one thread (docs/design.md, "The serving path").

Decode steps of the default model, one stream, timed in fresh processes taken in turn:
  same   the engine built and stepped on one thread (what LLM and EngineLoop do)
  other  built on the main thread, stepped on another one (what the Triton model did before: two OpenMP
         teams in the process); the worker then logs its foreign-thread warning once
and a bare F.linear of SmolLM2's MLP shape at one row on the first thread that used OpenMP, then on a
second thread, then on the first again.

    .venv/bin/python scripts/experiments/thread_teams.py [--rounds 3] [--tokens 64] [--torch-compile auto]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time


def child(mode: str, tokens: int, torch_compile: str) -> None:
    from orca import LLM, SamplingParams

    def steps(llm: LLM) -> float:
        engine = llm.engine
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        engine.add_request("r", list(range(100, 228)), params)
        times = []
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:]) * 1e3

    out: dict[str, float] = {}
    if mode == "same":
        def body() -> None:
            llm = LLM(None, torch_compile=torch_compile)
            steps(llm)
            out["ms"] = steps(llm)
        thread = threading.Thread(target=body)
    else:
        llm = LLM(None, torch_compile=torch_compile)

        def body() -> None:
            steps(llm)
            out["ms"] = steps(llm)
        thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    print(json.dumps(out))


def linear() -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    w, x = torch.randn(1536, 576), torch.randn(1, 576)

    def bench() -> float:
        for _ in range(200):
            F.linear(x, w)
        runs = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(2000):
                F.linear(x, w)
            runs.append((time.perf_counter() - t) / 2000 * 1e6)
        return statistics.median(runs)

    result = {"first thread": bench()}
    other: dict[str, float] = {}
    thread = threading.Thread(target=lambda: other.update(us=bench()))
    thread.start()
    thread.join()
    result["second thread"] = other["us"]
    result["first thread again"] = bench()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--torch-compile", default="auto")
    p.add_argument("--child", choices=("same", "other"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.tokens, args.torch_compile)
        return
    print("F.linear 1 x 576 -> 1536, float32, us:", {k: round(v, 1) for k, v in linear().items()})
    results: dict[str, list[float]] = {"same": [], "other": []}
    for _ in range(args.rounds):
        for mode in results:
            done = subprocess.run([sys.executable, __file__, "--child", mode, "--tokens", str(args.tokens),
                                   "--torch-compile", args.torch_compile], capture_output=True, text=True, check=True)
            results[mode].append(json.loads(done.stdout.strip().splitlines()[-1])["ms"])
    for mode, values in results.items():
        each = ", ".join(f"{v:.1f}" for v in values)
        print(f"{mode:5s} decode step ms: median {statistics.median(values):.1f}  ({each})")
    print(f"other / same: {statistics.median(results['other']) / statistics.median(results['same']):.2f}x")


if __name__ == "__main__":
    main()
