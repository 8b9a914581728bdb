"""Where a single-stream decode step goes, without a profiler: the shipped SmolLM2 GGUF (options as shipped),
one request of a --prompt-len-token random prompt decoding greedily, perf_counter around the worker's calls
(the iteration, its preparation, the forward pass (CPUGraphs.forward), the lone step's graph (GraphStep),
the opaque attention op (AttentionMetadata.write_and_attend) and its SDPA calls, the final norm, the
compiled head, the logits, sampling), --blocks blocks of --steps steps. Printed: each call's median
milliseconds a step (a call nested in another counts in both). ``--no-lone`` runs the graph of every token
count instead of the lone step (``runner.lone = None``; orca/worker/cpu_graphs/). Not a test, not a
benchmark of record: docs/BENCHMARKS.md quotes its output with the command and the host.

    PYTHONPATH=. .venv/bin/python scripts/experiments/single_stream_breakdown.py [--no-lone]
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch.nn.functional as F

import orca.worker.worker as worker_module
from orca import EngineConfig, LLMEngine, SamplingParams
from orca.models.attention import AttentionMetadata
from orca.worker.cpu_graphs import CPUGraphs
from orca.worker.cpu_graphs.head import CompiledHead
from orca.worker.cpu_graphs.steps import GraphStep

TOTALS: dict[str, float] = collections.defaultdict(float)
LABELS: list[str] = []  # in the order they were installed: nested calls under their callers


def timed(owner: Any, name: str, label: str) -> None:  # noqa: ANN401 - a module, class or instance
    """Replaces owner.name by a wrapper that adds its seconds to TOTALS[label]."""
    inner: Callable[..., Any] = getattr(owner, name)
    LABELS.append(label)

    def wrapper(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            TOTALS[label] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the shipped SmolLM2 GGUF)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--no-lone", action="store_true", help="the graph of every token count, not the lone step")
    args = p.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, block_size=16))
    worker = engine.core.executor.worker
    if args.no_lone and isinstance(worker.runner, CPUGraphs):
        worker.runner.lone = None
    timed(worker_module.Worker, "execute", "iteration")
    timed(worker_module.Worker, "_prepare", "  preparation")
    timed(CPUGraphs, "forward", "  forward pass")
    timed(GraphStep, "__call__", "    lone step")
    timed(AttentionMetadata, "write_and_attend", "    attention op")
    timed(F, "scaled_dot_product_attention", "      SDPA")
    timed(worker.model, "compute_logits", "  logits")
    if getattr(worker.model, "norm", None) is not None:
        timed(worker.model.norm, "forward", "    final norm")
    timed(CompiledHead, "__call__", "    compiled head")
    timed(worker_module, "sample", "  sampling")
    rng = random.Random(0)
    prompt = [rng.randrange(3, engine.core.model_config.vocab_size) for _ in range(args.prompt_len)]
    engine.add_request("r", prompt, SamplingParams(max_tokens=args.blocks * args.steps + 16, temperature=0,
                                                   ignore_eos=True))
    for _ in range(6):
        engine.step()
    blocks: list[dict[str, float]] = []
    for _ in range(args.blocks):
        TOTALS.clear()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        block = {label: seconds / args.steps * 1e3 for label, seconds in TOTALS.items()}
        block["step"] = (time.perf_counter() - t0) / args.steps * 1e3
        blocks.append(block)
    context = f"context {args.prompt_len + 6}..{args.prompt_len + 6 + args.blocks * args.steps}"
    print(f"ms a step ({'graph of every count' if args.no_lone else 'lone step'}; {context}; medians of "
          f"{args.blocks} blocks of {args.steps} steps):")
    for label in ["step", *(label for label in LABELS if label in blocks[0])]:
        print(f"  {label:<20} {statistics.median(b.get(label, 0.0) for b in blocks):7.3f}")


if __name__ == "__main__":
    main()
