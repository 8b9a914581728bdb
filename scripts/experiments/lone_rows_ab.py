"""A speculating single stream's verification through LoneStep's graph of several rows against the graph of
every token count (its opaque attention op, orca/worker/compiled.py), in one engine: the shipped SmolLM2
GGUF with speculative_method ngram (--num-speculative-tokens proposals), one request asked to repeat a
passage of Python's documentation (pydoc_data.topics) decoding greedily; the first verification of each
row count (2 to num_speculative_tokens + 1) past --min-context cached tokens is kept with its inputs, then
each is run again through the forward pass, 12 rounds of 10 calls alternating between the two graphs.
Printed: the median milliseconds a forward pass of each, by row count, and their ratio. Not a test, not a
benchmark of record: docs/BENCHMARKS.md quotes its output with the command and the host.

    PYTHONPATH=. .venv/bin/python scripts/experiments/lone_rows_ab.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from pydoc_data.topics import topics
from typing import Any

import torch

from orca import EngineConfig, LLMEngine, SamplingParams
from orca.worker.compiled import CompiledForward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the shipped SmolLM2 GGUF)")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--min-context", type=int, default=100)
    args = p.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, block_size=16, speculative_method="ngram",
                                    num_speculative_tokens=args.num_speculative_tokens))
    compiled = engine.core.executor.worker.compiled
    if compiled is None or compiled.lone_rows is None:
        raise SystemExit("this engine runs no LoneStep of several rows")
    kept: dict[int, tuple[Any, ...]] = {}
    forward = CompiledForward.__call__

    def keep(self: CompiledForward, ids: torch.Tensor, pos: torch.Tensor, meta: Any) -> torch.Tensor:  # noqa: ANN401
        rows = ids.shape[0]
        if 1 < rows and rows not in kept and len(meta.lengths) == 1 and meta.context_lens[0] >= args.min_context:
            kept[rows] = (ids.clone(), pos.clone(), meta)
        return forward(self, ids, pos, meta)

    CompiledForward.__call__ = keep
    text = topics[sorted(topics)[3]][:1500]
    message = [{"role": "user", "content": "Repeat the following text exactly, fixing any typos:\n\n" + text}]
    prompt = engine.tokenizer.apply_chat_template(message, add_generation_prompt=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    engine.add_request("r", prompt, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    CompiledForward.__call__ = forward
    rows_step = compiled.lone_rows
    for rows, (ids, pos, meta) in sorted(kept.items()):
        times: dict[str, list[float]] = {"rows": [], "general": []}
        for _ in range(12):
            for name in times:
                compiled.lone_rows = rows_step if name == "rows" else None
                t0 = time.perf_counter()
                with torch.inference_mode():
                    for _ in range(10):
                        compiled(ids, pos, meta)
                times[name].append((time.perf_counter() - t0) / 10 * 1e3)
        m = {k: statistics.median(v) for k, v in times.items()}
        print(f"{rows} rows after {meta.context_lens[0]} cached tokens: LoneStep {m['rows']:.2f} ms, the graph of "
              f"every count {m['general']:.2f} ms, ratio {m['general'] / m['rows']:.3f}")
    compiled.lone_rows = rows_step


if __name__ == "__main__":
    main()
