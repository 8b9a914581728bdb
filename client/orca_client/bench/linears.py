"""``orca-bench linears``: the model's linear layers alone, as one decode iteration meets them: every
layer's projections in order, then the LM head, on --rows token rows (the batch size of a decode
iteration, or a prompt's tokens at 512), with each linear_backend (reference: torch's F.linear on the
checkpoint layout; onednn: the weights packed for oneDNN, orca.models.layers.PackedLinear; hybrid: onednn
below HYBRID_MIN_ROWS rows, F.linear from there; int8 and int4: the weights quantized as quantization
int8 / int4 loads them, orca.models.quantization.QuantizedLinear, multiplied by torch's weight-only
kernels at every row count), in turn in this process; median of --repeats passes
after a warm-up. Beside them, the memory bandwidth of a sum over as many bytes as the weights (the bound a
pass at one row cannot beat: every weight is read once). Reports ms per pass, the weights' GB/s and
GFLOP/s per backend and rows, and the ratios reference / onednn and onednn / hybrid.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

from orca_client.bench.common import machine_info, write_json
from orca_client.bench.options import doc_description, positive_int


def cmd_linears(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from orca.checkpoint import resolve_checkpoint
    from orca.config import EngineConfig
    from orca.models.layers import PackedLinear, onednn_packs
    from orca.models.loader import load_model
    from orca.models.quantization import QuantizedLinear, quantize
    from orca_client.peers.runner_common import timed

    dtype = EngineConfig(dtype=args.dtype, device="cpu").torch_dtype  # validated: a bad name is a ValueError
    if not onednn_packs(dtype):
        raise ValueError(f"oneDNN cannot pack {dtype} on this CPU: nothing to compare")
    model, _ = load_model(resolve_checkpoint(args.model), dtype, torch.device("cpu"))
    # The weights in the order an iteration uses them; the head last (the embedding's when tied).
    weights = [m.weight.detach() for m in model.modules() if type(m) is nn.Linear and m is not model.lm_head]
    head = model.lm_head.weight if model.lm_head is not None else model.input_embedding.weight
    weights.append(head.detach())
    packed = [PackedLinear(w, None) for w in weights]
    hybrid = [PackedLinear(w, None, keep_weight=True) for w in weights]
    # The quantized layers as quantization int8 / int4 loads them (the head int8 under int4), their own
    # kernels at every row count (no float copy). int4 only where its groups of 32 divide every layer.
    cpu = torch.device("cpu")
    kinds = ["int8"] + (["int4"] if all(w.shape[1] % 32 == 0 for w in weights) else [])
    if "int4" not in kinds:
        print("int4 skipped: groups of 32 do not divide every layer's input columns")
    quantized = {kind: [QuantizedLinear(quantize(w, "int8" if kind == "int4" and i == len(weights) - 1 else kind),
                                        None, cpu, dtype) for i, w in enumerate(weights)]
                 for kind in kinds}
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    params = sum(w.numel() for w in weights)
    rows = [int(r) for r in args.rows.split(",")]
    backends: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
        "reference": lambda x, i: F.linear(x, weights[i]),
        "onednn": lambda x, i: packed[i](x),
        "hybrid": lambda x, i: hybrid[i](x),
        **{kind: (lambda x, i, kind=kind: quantized[kind][i](x)) for kind in kinds},
    }

    def median_seconds(fn: Callable[[], object]) -> float:
        fn()  # warm-up
        return statistics.median(timed(fn)[1] for _ in range(args.repeats))

    with torch.inference_mode():
        buffer = torch.ones(nbytes // 4, dtype=torch.float32)
        bandwidth = nbytes / median_seconds(buffer.sum) / 1e9
        inputs = {n: {w.shape[1]: torch.randn(n, w.shape[1], dtype=dtype) for w in weights} for n in rows}
        runs = []
        for n in rows:
            record: dict[str, Any] = {"rows": n}
            for name, linear in backends.items():
                def one_pass(n: int = n, linear: Callable = linear) -> None:
                    for i, w in enumerate(weights):
                        linear(inputs[n][w.shape[1]], i)
                seconds = median_seconds(one_pass)
                record[name] = {"ms": seconds * 1e3, "weights_gb_per_s": nbytes / seconds / 1e9,
                                "gflop_per_s": 2 * params * n / seconds / 1e9}
            record["ratio_reference_to_onednn"] = record["reference"]["ms"] / record["onednn"]["ms"]
            record["ratio_onednn_to_hybrid"] = record["onednn"]["ms"] / record["hybrid"]["ms"]
            for kind in kinds:
                record[f"ratio_onednn_to_{kind}"] = record["onednn"]["ms"] / record[kind]["ms"]
            runs.append(record)
    result = {
        "benchmark": "linears", "machine": machine_info(), "command": sys.argv, "dtype": str(dtype),
        "threads": torch.get_num_threads(), "weight_bytes": nbytes, "linears": len(weights),
        "sum_bandwidth_gb_per_s": bandwidth, "runs": runs,
    }
    print(f"{len(weights)} linear weights ({nbytes / 1e6:.0f} MB {str(dtype).removeprefix('torch.')}, the head "
          f"last), {torch.get_num_threads()} threads; memory bandwidth (sum over as many bytes): {bandwidth:.1f} GB/s")
    print(f"{'rows':>5} {'reference ms':>13} {'GB/s':>6} {'onednn ms':>10} {'GB/s':>6} {'GFLOP/s':>8} {'ratio':>6} "
          f"{'hybrid ms':>10} {'GFLOP/s':>8} {'onednn/hybrid':>14}"
          + "".join(f" {kind + ' ms':>8} {'onednn/' + kind:>12}" for kind in kinds))
    for r in runs:
        ref, one, hyb = r["reference"], r["onednn"], r["hybrid"]
        print(f"{r['rows']:>5} {ref['ms']:>13.1f} {ref['weights_gb_per_s']:>6.1f} {one['ms']:>10.1f} "
              f"{one['weights_gb_per_s']:>6.1f} {one['gflop_per_s']:>8.1f} {r['ratio_reference_to_onednn']:>5.2f}x "
              f"{hyb['ms']:>10.1f} {hyb['gflop_per_s']:>8.1f} {r['ratio_onednn_to_hybrid']:>13.2f}x"
              + "".join(f" {r[kind]['ms']:>8.1f} {r[f'ratio_onednn_to_{kind}']:>11.2f}x" for kind in kinds))
    if args.json:
        write_json(args.json, result)
    return 0


def add_parser(sub: Any) -> None:
    li = sub.add_parser("linears", help="the model's linear layers alone at decode's (and a prompt's) row counts, "
                        "per linear_backend", description=doc_description(__doc__))
    li.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    li.add_argument("--dtype", default="float32", help="weights' dtype, or auto (default: %(default)s)")
    li.add_argument("--rows", default="1,2,4,8,16,32,64,128,512", help="token rows per pass, comma-separated "
                    "(default: %(default)s)")
    li.add_argument("--repeats", type=positive_int, default=9, help="timed passes per point (default: %(default)s)")
    li.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    li.set_defaults(func=cmd_linears)
