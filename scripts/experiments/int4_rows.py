"""torch's CPU int4 kernel (``torch._weight_int4pack_mm_for_cpu``, groups of 32, bfloat16 activations) at 1
to 8 rows, over SmolLM2-135M's 30 layers' four int4 linears (q/k/v fused 960 x 576, o 576 x 576, gate/up
fused 3072 x 576, down 576 x 1536: 120 matmuls, 53 MB of int4 weights, more than the caches hold): median
milliseconds for the 120, 15 rounds. What a verifying iteration of speculative decoding (k + 1 rows) costs
in the int4 layers against a one-row decode step. Not a test, not a benchmark of record:
docs/BENCHMARKS.md quotes its output with the command and the host.

    .venv/bin/python scripts/experiments/int4_rows.py
"""

from __future__ import annotations

import statistics
import time

import torch

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one layer's int4 linears
LAYERS, GROUP = 30, 32


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    layers = []
    for n, k in SHAPES * LAYERS:
        packed = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 2)
        scales_and_zeros = torch.randn(k // GROUP, n, 2, dtype=torch.bfloat16)
        layers.append((packed, scales_and_zeros, k))
    print("rows | ms for the 120 matmuls | x one row")
    one = None
    for rows in (1, 2, 3, 4, 5, 6, 8):
        x = {k: torch.randn(rows, k, dtype=torch.bfloat16) for _, k in SHAPES}
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            for packed, scales_and_zeros, k in layers:
                torch._weight_int4pack_mm_for_cpu(x[k], packed, GROUP, scales_and_zeros)
            times.append((time.perf_counter() - t0) * 1e3)
        ms = statistics.median(times)
        one = one or ms
        print(f"{rows} | {ms:.2f} | {ms / one:.2f}", flush=True)


if __name__ == "__main__":
    main()
