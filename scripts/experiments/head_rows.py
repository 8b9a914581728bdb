"""The int8 LM head at 1-16 rows: its compiled graph (CompiledHead, orca/worker/cpu_graphs/head.py: inductor's
weight-only GEMM template or torch's kernel, whichever max_autotune measured faster at load; its switch to the
float copy from COMPILED_HEAD_FLOAT_ROWS turned off here, so that every row count runs the graph), torch's
_weight_int8pack_mm eagerly, and the bfloat16 float copy that linear_backend hybrid multiplies from its
threshold on (oneDNN). SmolLM2's head shape (49152 x 576), random weights, bfloat16 activations, 2 threads;
64 MB streamed through the caches before every call, as a decode step's other layers do. Median
milliseconds of --rounds rounds, the three alternating. Not a test, not a benchmark of record:
COMPILED_HEAD_FLOAT_ROWS (orca/tuning.py) and docs/BENCHMARKS.md quote its output with the command and the host.

    PYTHONPATH=. .venv/bin/python scripts/experiments/head_rows.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from orca.models.quantization import QuantizedLinear, quantize
from orca.worker.cpu_graphs import CPUGraphs

ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=10, help="calls per round (default: %(default)s)")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    vocab, hidden = 49152, 576
    head = QuantizedLinear(quantize(torch.randn(vocab, hidden) * 0.05, "int8"), None, torch.device("cpu"),
                           torch.bfloat16, float_copy=True)
    model = torch.nn.Module()
    model.lm_head = head
    forward = CPUGraphs(model)  # (installs the compiled head as the head's matmul)
    flush = torch.randn(64 * 1024 * 1024 // 4)

    def bench(fns: dict[str, Callable[[], object]]) -> dict[str, float]:
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                total = 0.0
                for _ in range(args.calls):
                    flush.add_(1.0)
                    t0 = time.perf_counter()
                    fn()
                    total += time.perf_counter() - t0
                times[name].append(total / args.calls * 1e3)
        return {k: round(statistics.median(v), 3) for k, v in times.items()}

    with torch.inference_mode():
        assert forward.head is not None
        forward.head.float_rows = None  # the compiled int8 graph at every row count (the float copy: "copy")
        forward.head(torch.randn(1, hidden, dtype=torch.bfloat16))  # compiles (autotunes at one row)
        print("rows | compiled int8 ms | eager int8 (_weight_int8pack_mm) ms | bfloat16 copy (oneDNN) ms")
        for rows in ROWS:
            x = torch.randn(rows, hidden, dtype=torch.bfloat16)
            r = bench({
                "compiled": lambda x=x: forward.head(x),  # type: ignore[misc]
                "eager": lambda x=x: head.quantized_matmul(x),
                "copy": lambda x=x: torch.ops.mkldnn._linear_pointwise(x, head.float_packed, None, "none", [], ""),
            })
            print(f"{rows} | {r['compiled']} | {r['eager']} | {r['copy']}", flush=True)


if __name__ == "__main__":
    main()
