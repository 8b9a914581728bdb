"""A single stream's decode step with and without the lone step (CPUGraphs.lone, a GraphStep built by
lone_step: orca/worker/cpu_graphs/steps.py, its own compiled graph, attention inside it) in one engine, one
process: the shipped SmolLM2 GGUF (torch_compile and the other options as shipped), one request of a
--prompt-len-token random prompt decoding greedily; blocks of --steps steps alternate between the lone step
and the graph of every token count (its opaque attention op; ``runner.lone = None``), --blocks blocks in all.
Printed: the median milliseconds a step of each, their ratio, and the context the steps covered.
``--scattered``: the request's blocks are not consecutive (its prompt's first blocks come from the prefix
cache, the others from elsewhere in the pool), which the lone step reads through its block table.

With --b-options (inductor options, e.g. ``cpp_wrapper=True``): the blocks alternate instead between the
shipped lone step and a second GraphStep compiled with those options patched in (its model's forward a code
object of its own, so that dynamo compiles it rather than reuse the first's); ``--b-options
size_asserts=False`` (an option already shipped) is the control of two identical graphs.

Not a test, not a benchmark of record: docs/BENCHMARKS.md quotes its output with the command and the host.

    PYTHONPATH=. .venv/bin/python scripts/experiments/lone_step_ab.py [--scattered] [--b-options cpp_wrapper=True]
"""

from __future__ import annotations

import argparse
import ast
import random
import statistics
import time

import torch

from orca import EngineConfig, LLMEngine, SamplingParams
from orca.worker.cpu_graphs import CPUGraphs
from orca.worker.cpu_graphs import steps as steps_module
from orca.worker.cpu_graphs.decode_attention import LoneDecode
from orca.worker.cpu_graphs.views import graph_view


class _SecondLoneModel(steps_module._LoneModel):
    """_LoneModel's forward as a code object of its own (dynamo keeps its graphs by code object)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, blocks: torch.Tensor,
                table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lone = LoneDecode(blocks, table, positions[0])
        hidden = self.model(input_ids, positions, lone)
        return hidden, torch.stack(lone.written)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the shipped SmolLM2 GGUF)")
    p.add_argument("--quantization", default="auto", help="EngineConfig.quantization (default auto)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--blocks", type=int, default=24)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--b-options", default="", help="inductor options of a second lone step, e.g. cpp_wrapper=True "
                                                   "(separated by ',', or by ';' where a value holds a ',')")
    p.add_argument("--scattered", action="store_true",
                   help="the measured request's blocks not consecutive: its prompt run once before (to 64 more "
                        "tokens), so that it takes its first blocks from the prefix cache and the rest elsewhere")
    args = p.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, block_size=16, quantization=args.quantization))
    compiled = engine.core.executor.worker.runner
    if not isinstance(compiled, CPUGraphs) or compiled.lone is None:
        raise SystemExit("this engine runs no lone step (the forward pass is not compiled, or a layer has a window)")
    lone = compiled.lone
    rng = random.Random(0)
    prompt = [rng.randrange(3, engine.core.model_config.vocab_size) for _ in range(args.prompt_len)]
    steps = args.blocks * args.steps
    if args.scattered:
        engine.add_request("before", prompt, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    engine.add_request("r", prompt, SamplingParams(max_tokens=steps + 16, temperature=0, ignore_eos=True))
    for _ in range(5):
        engine.step()
    table = engine.core.blocks.table("r")
    consecutive = table == list(range(table[0], table[0] + len(table)))
    print(f"the request's blocks: {'consecutive' if consecutive else 'scattered'}")
    other = None
    if args.b_options:
        import torch._inductor.config as inductor_config

        items = args.b_options.split(";" if ";" in args.b_options else ",")
        options = {k.strip(): ast.literal_eval(v.strip()) for k, v in (item.split("=", 1) for item in items)}
        # (a view of its own, every tensor shared with the model: what lone_step compiles)
        other = steps_module.GraphStep(_SecondLoneModel(graph_view(compiled.model)), unbacked_rows=False,
                                       frozen=lone.frozen)
        compiled.lone = other
        t0 = time.perf_counter()
        with inductor_config.patch(options):
            engine.step()  # compiles it
        print(f"the second lone step ({args.b_options}) compiled in {time.perf_counter() - t0:.1f} s")
    else:
        engine.step()
    times: dict[str, list[float]] = {"lone": [], "op": []}
    for block in range(args.blocks):
        name = "lone" if block % 2 == 0 else "op"
        compiled.lone = lone if name == "lone" else other
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    compiled.lone = lone
    m = {k: statistics.median(v) for k, v in times.items()}
    b = f"lone step with {args.b_options}" if other is not None else "opaque op"
    print(f"ms a step: lone step {m['lone']:.2f}, {b} {m['op']:.2f}, ratio {m['op'] / m['lone']:.3f} "
          f"(context {args.prompt_len + 6}..{args.prompt_len + 6 + steps})")


if __name__ == "__main__":
    main()
