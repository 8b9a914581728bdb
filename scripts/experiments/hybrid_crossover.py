"""From how many rows the hybrid backend's float copies beat the int kernels, in the engine: one engine of
the model (linear_backend hybrid, its two compiled graphs), decode iterations of B requests timed with
every quantized layer on the int kernels, then on the float copies (the compiled forward's float_rows set
to never and to always), alternating in one process, the best of --rounds medians each. The layers'
weights stream from memory here, as they do when serving; a layer-by-layer timing keeps them in cache and
finds an earlier crossover. Not a test: docs/BENCHMARKS.md quotes its output with the command, the
machine and the date (HYBRID_QUANTIZED_MIN_ROWS in orca/tuning.py came from it).

    PYTHONPATH=. python scripts/experiments/hybrid_crossover.py --quantization auto --batch-sizes 1,2,4,6,8,32
"""

from __future__ import annotations

import argparse
import itertools
import time

from orca import EngineConfig, LLMEngine, SamplingParams

NEVER, ALWAYS = 10**9, 1  # float_rows: no iteration reaches it / every iteration does


def decode_step_ms(engine: LLMEngine, batch: int, float_rows: int, new_tokens: int, ids: itertools.count) -> float:
    """The median time of the decode iterations (every request an increment) of `batch` requests of
    64-token prompts, with the compiled forward's float_rows set as given."""
    engine.executor.worker.compiled.float_rows = float_rows
    for i in range(batch):
        engine.add_request(f"r{next(ids)}", list(range(100 + i, 164 + i)),
                           SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        it = engine.last_iteration
        if it is not None and it.num_tokens == batch and it.num_initiation == 0:
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: the shipped SmolLM2)")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", default="1,2,3,4,5,6,8,12,16,32")
    parser.add_argument("--new-tokens", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    engine = LLMEngine(EngineConfig(model=args.model, max_bs=max(sizes), quantization=args.quantization,
                                    dtype=args.dtype, linear_backend="hybrid"))
    compiled = engine.executor.worker.compiled
    if compiled is None or compiled.float_rows is None:
        raise SystemExit("no compiled forward pass with float copies: a quantized model on a CPU is needed")
    shipped = compiled.float_rows
    ids = itertools.count()
    for setting in (NEVER, ALWAYS):  # warm-up
        decode_step_ms(engine, 2, setting, 4, ids)
    print(f"{engine.config.torch_dtype}, quantization {engine.config.quantization}; float_rows as shipped: {shipped}")
    print("batch  int kernels ms  float copies ms  float/int")
    for batch in sizes:
        runs: dict[str, list[float]] = {"int": [], "float": []}
        for _ in range(args.rounds):  # alternating, so that the host's drift hits both alike
            for name, setting in (("int", NEVER), ("float", ALWAYS)):
                runs[name].append(decode_step_ms(engine, batch, setting, args.new_tokens, ids))
        best = {name: min(times) for name, times in runs.items()}
        print(f"{batch:5d}  {best['int']:14.2f}  {best['float']:15.2f}  {best['float'] / best['int']:9.2f}",
              flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
