"""A speculating single stream's verification through the lone step's graph of several rows
(CPUGraphs.lone_rows, a GraphStep built by lone_rows_step: orca/worker/cpu_graphs/steps.py) against the graph
of every token count (its opaque attention op; ``runner.lone_rows = None``), in one engine: the shipped
SmolLM2 GGUF with speculative_method ngram (--num-speculative-tokens proposals), one request asked to repeat a
passage of Python's documentation (pydoc_data.topics) decoding greedily; the first verification of each row
count (2 to num_speculative_tokens + 1) past --min-context cached tokens is kept with its inputs (the token
ids, positions and IterationLayout CPUGraphs.forward took), then each is run again through the forward pass,
12 rounds of 10 calls alternating between the two graphs. Printed: the median milliseconds a forward pass of
each, by row count, and their ratio. Not a test, not a benchmark of record: docs/BENCHMARKS.md quotes its
output with the command and the host.

    PYTHONPATH=. .venv/bin/python scripts/experiments/lone_rows_ab.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from pydoc_data.topics import topics

import torch

from orca import EngineConfig, LLMEngine, SamplingParams
from orca.models.attention import IterationLayout
from orca.worker.cpu_graphs import CPUGraphs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the shipped SmolLM2 GGUF)")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--min-context", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, block_size=16, speculative_method="ngram",
                                    num_speculative_tokens=args.num_speculative_tokens))
    compiled = engine.core.executor.worker.runner
    if not isinstance(compiled, CPUGraphs) or compiled.lone_rows is None:
        raise SystemExit("this engine runs no lone step of several rows (the forward pass is not compiled, or a "
                         "layer has a window)")
    kept: dict[int, tuple[torch.Tensor, torch.Tensor, IterationLayout]] = {}
    forward = CPUGraphs.forward

    def keep(self: CPUGraphs, ids: torch.Tensor, pos: torch.Tensor, layout: IterationLayout) -> torch.Tensor:
        rows = ids.shape[0]
        if (1 < rows and rows not in kept and len(layout.lengths) == 1
                and layout.context_lens[0] >= args.min_context):
            kept[rows] = (ids.clone(), pos.clone(), layout)
        return forward(self, ids, pos, layout)

    CPUGraphs.forward = keep  # type: ignore[method-assign]
    text = topics[sorted(topics)[3]][:1500]
    message = [{"role": "user", "content": "Repeat the following text exactly, fixing any typos:\n\n" + text}]
    prompt = engine.tokenizer.apply_chat_template(message, add_generation_prompt=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    engine.add_request("r", prompt, SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    CPUGraphs.forward = forward  # type: ignore[method-assign]
    rows_step = compiled.lone_rows
    for rows, (ids, pos, layout) in sorted(kept.items()):
        times: dict[str, list[float]] = {"rows": [], "general": []}
        for _ in range(12):
            for name in times:
                compiled.lone_rows = rows_step if name == "rows" else None
                t0 = time.perf_counter()
                with torch.inference_mode():
                    for _ in range(10):
                        compiled.forward(ids, pos, layout)
                times[name].append((time.perf_counter() - t0) / 10 * 1e3)
        m = {k: statistics.median(v) for k, v in times.items()}
        print(f"{rows} rows after {layout.context_lens[0]} cached tokens: lone step {m['rows']:.2f} ms, the graph of "
              f"every count {m['general']:.2f} ms, ratio {m['general'] / m['rows']:.3f}")
    compiled.lone_rows = rows_step


if __name__ == "__main__":
    main()
