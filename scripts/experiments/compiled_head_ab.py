"""The compiled int8 LM head in the engine: one engine of the default model (quantization auto, its head
GGUF Q8_0: int8; torch_compile as shipped), one stream decoding, its steps timed with the head's compiled
graph (CompiledHead, orca/worker/cpu_graphs/head.py, installed as the head's `matmul`) and with torch's eager
kernel (CompiledHead.uninstall: the layer's own row policy, QuantizedLinear.matmul), alternating in blocks of
--steps steps, --rounds rounds; median milliseconds a step each. Not a test, not a benchmark of record:
docs/BENCHMARKS.md quotes its output with the command and the host.

    PYTHONPATH=. .venv/bin/python scripts/experiments/compiled_head_ab.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from orca import EngineConfig, LLMEngine, SamplingParams
from orca.worker.cpu_graphs import CPUGraphs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the shipped SmolLM2 GGUF)")
    p.add_argument("--quantization", default="auto", help="EngineConfig.quantization (default auto)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=128)
    args = p.parse_args()
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, block_size=16, quantization=args.quantization))
    worker = engine.core.executor.worker  # type: ignore[attr-defined]
    head = worker.model.lm_head
    runner = worker.runner
    compiled = runner.head if isinstance(runner, CPUGraphs) else None
    if compiled is None:
        raise SystemExit(f"this model's head has no compiled graph ({type(head).__name__}; compiled forward: "
                         f"{worker.no_compile_reason or 'on'})")
    print(f"load {time.perf_counter() - t0:.1f} s (compiling {runner.compile_seconds:.1f} s)")
    rng = random.Random(0)
    vocab = engine.core.model_config.vocab_size
    engine.add_request("r", [rng.randrange(3, vocab) for _ in range(args.prompt_len)],
                       SamplingParams(max_tokens=2 * args.rounds * args.steps + 16, temperature=0, ignore_eos=True))
    for _ in range(6):
        engine.step()
    times: dict[str, list[float]] = {"compiled head": [], "eager head": []}
    for _ in range(args.rounds):
        for name, kernel in (("compiled head", compiled), ("eager head", None)):
            if kernel is None:
                compiled.uninstall()
            else:
                head.__dict__["matmul"] = kernel
            t1 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times[name].append((time.perf_counter() - t1) / args.steps * 1e3)
    head.__dict__["matmul"] = compiled
    medians = {k: statistics.median(v) for k, v in times.items()}
    print(", ".join(f"{k} {v:.2f} ms a step" for k, v in medians.items())
          + f"; eager / compiled {medians['eager head'] / medians['compiled head']:.3f}")


if __name__ == "__main__":
    main()
